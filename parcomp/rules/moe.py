"""Rules of the MoE ops: sharding strategies and VJPs of
``moe_route`` (+ ``moe_route_grad``), ``moe_dispatch``, ``moe_combine`` (+ ``moe_combine_grad_c``).

Merged into STRATEGY_RULES and VJP_RULES. Sharding, one mesh axis (tokens
``x[B, S, H]``, weights ``c[B, S, E]``, slots ``y[B, E, C, H]``; semantics in
parcomp/reference/moe_ops.py, where every result is computed per row and per expert):

- rows split (``S(0)`` everywhere): each rank routes, dispatches and combines its own rows;
- experts split (``c`` ``S(2)``, slots ``S(1)``): dispatch fills its experts' slots, combine
  sums its experts' share of each token: a partial sum (the rank holds some of the k terms);
- hidden split (``x`` ``S(2)``, slots ``S(3)``): data movement, the hidden dim rides along;
- the sequence dim is never split (a slot's index counts the row's earlier tokens), nor the
  expert dim of the router (top-k compares all experts).

Expert parallelism is then ``S(0) -> S(1)`` of the slots between dispatch and the experts: one
``all_to_all`` over ``ep`` there and its inverse before combine (parcomp/ir/redistribute.py).
"""
from __future__ import annotations

from ..ir.types import P, R, Shard


# ---- sharding: (node, in types) -> [(in placements, out placement)] -------------------

def _route(node, ts):
    rank = ts[0].rank
    dims = range(rank - 1 if node.attr("capacity", 0) == 0 else rank - 2)
    out = [(tuple(R for _ in ts), R)] + [(tuple(Shard(d) for _ in ts), Shard(d)) for d in dims]
    return out + ([((P, R), P)] if node.op == "moe_route_grad" else [])


# never a partial c: its zeros say which slots are routed, and partial pieces of c have others
def _dispatch(node, ts):
    return [((R, R), R), ((Shard(0), Shard(0)), Shard(0)), ((R, Shard(2)), Shard(1)),
            ((Shard(2), R), Shard(3)), ((P, R), P)]


def _combine(node, ts):
    return [((R, R), R), ((Shard(0), Shard(0)), Shard(0)), ((Shard(1), Shard(2)), P),
            ((Shard(3), R), Shard(2)), ((P, R), P)]


def _combine_grad_c(node, ts):
    return [((R, R, R), R), ((Shard(0), Shard(0), Shard(0)), Shard(0)), ((R, Shard(1), Shard(2)), Shard(2)),
            ((Shard(2), Shard(3), R), P), ((P, R, R), P), ((R, P, R), P)]


MOE_STRATEGY_RULES = {"moe_route": _route, "moe_route_grad": _route, "moe_dispatch": _dispatch,
                      "moe_combine": _combine, "moe_combine_grad_c": _combine_grad_c}


# ---- VJPs: (builder, node, grad) -> one gradient (or None) per operand ---------------

def _route_vjp(b, n, g):
    return (b.op("moe_route_grad", [g, n.inputs[0]], top_k=n.attr("top_k"), capacity=n.attr("capacity", 0)),)


def _dispatch_vjp(b, n, g):
    """dx: the slots' gradients summed back per token; dc (weighted) g[slot] . x."""
    x, c = n.inputs
    w = n.attr("weighted", False)
    dx = b.op("moe_combine", [g, c], weighted=w)
    return dx, (b.op("moe_combine_grad_c", [x, g, c]) if w else None)


def _combine_vjp(b, n, g):
    """dy: each token's gradient put in its slots (times c); dc: g . y[slot] (the gate's path)."""
    y, c = n.inputs
    w = n.attr("weighted", True)
    dy = b.op("moe_dispatch", [g, c], capacity=b.type(y).shape[2], weighted=w)
    return dy, (b.op("moe_combine_grad_c", [g, y, c]) if w else None)


MOE_VJP_RULES = {"moe_route": _route_vjp, "moe_dispatch": _dispatch_vjp, "moe_combine": _combine_vjp}
