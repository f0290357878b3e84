"""Rules of the MoE ops (issue 14): sharding strategies, VJPs and error bounds of
``moe_route`` (+ ``moe_route_grad``), ``moe_dispatch``, ``moe_combine`` (+ ``moe_combine_grad_c``).

Merged into STRATEGY_RULES, VJP_RULES and ERROR_RULES. Sharding, one mesh axis (tokens
``x[B, S, H]``, weights ``c[B, S, E]``, slots ``y[B, E, C, H]``; semantics in
parcomp/reference/moe_ops.py, where every result is computed per row and per expert):

- rows split (``S(0)`` everywhere): each rank routes, dispatches and combines its own rows;
- experts split (``c`` ``S(2)``, slots ``S(1)``): dispatch fills its experts' slots, combine
  sums its experts' share of each token: a partial sum (the rank holds some of the k terms);
- hidden split (``x`` ``S(2)``, slots ``S(3)``): data movement, the hidden dim rides along;
- the sequence dim is never split (a slot's index counts the row's earlier tokens), nor the
  expert dim of the router (top-k compares all experts).

Expert parallelism is then ``S(0) -> S(1)`` of the slots between dispatch and the experts: one
``all_to_all`` over ``ep`` there and its inverse before combine (parcomp/redistribute.py).
"""
from __future__ import annotations

import numpy as np

from ..ir.types import P, R, Shard
from ..reference import moe_ops


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


# ---- error bounds: (vals, errs, node, out, u) -> bound (see parcomp/rules/error.py) ------

def _gamma(k, u):
    ku = float(k) * u
    return ku / (1 - ku) if ku < 1 else float("inf")


def _full(e, x):
    return np.broadcast_to(np.asarray(e, np.float64), np.shape(x))


def _tiny(node):
    dt = np.dtype(node.type.dtype)
    return float(np.finfo(dt).tiny) if dt.kind == "f" else 0.0


def _unstable(z, e, top, capacity):
    """Tokens whose top-k set an error ``e`` could change (rows, with a capacity: a changed
    choice moves every later token's slot): bool ``[..., S, 1]``."""
    lo = np.min(np.where(top, z - e, np.inf), axis=-1, keepdims=True)
    hi = np.max(np.where(top, -np.inf, z + e), axis=-1, keepdims=True)
    bad = ~(lo > hi)  # k == E: hi is -inf, never unstable
    if capacity:
        bad = np.broadcast_to(np.any(bad, axis=-2, keepdims=True), bad.shape)
    return bad


def _route_parts(z, ez, node, u):
    k, cap = node.attr("top_k"), node.attr("capacity", 0)
    top, kept = moe_ops.top_mask(z, k, cap)
    w = moe_ops._weights(z, top)
    mix = np.sum(w * ez, axis=-1, keepdims=True)
    zmax = np.max(np.where(top, np.abs(z), 0), axis=-1, keepdims=True)
    dw = w * (ez + mix) + w * (_gamma(2 * z.shape[-1] + 16, u) + 8 * u * (1 + zmax))
    return top, kept, w, dw, _unstable(z, ez, top, cap)


def _route_err(vals, errs, node, out, u):
    """Softmax over the top-k (|dw_i| <= w_i (e_i + sum w_j e_j) + rounding); inf for a token
    whose top-k set is within the error of changing."""
    z = vals[0]
    top, kept, w, dw, bad = _route_parts(z, _full(errs[0], z), node, u)
    err = np.where(kept, dw + u * np.abs(out), 0) + _tiny(node)
    return np.where(bad, np.inf, err)


def _route_grad_err(vals, errs, node, out, u):
    """dz = w (g' - s), s = sum g' w: first-order in the errors of g and of w."""
    g, z = vals
    eg = np.where(moe_ops.top_mask(z, node.attr("top_k"), node.attr("capacity", 0))[1], _full(errs[0], g), 0)
    top, kept, w, dw, bad = _route_parts(z, _full(errs[1], z), node, u)
    gk = np.where(kept, g, 0)
    s = np.sum(gk * w, axis=-1, keepdims=True)
    ds = (np.sum(eg * (w + dw) + np.abs(gk) * dw, axis=-1, keepdims=True)
          + _gamma(z.shape[-1], u) * np.sum(np.abs(gk) * w, axis=-1, keepdims=True))
    err = dw * (np.abs(gk - s) + eg + ds) + w * (eg + ds) + 2 * u * w * (np.abs(gk) + np.abs(s))
    err = np.where(top, err + u * np.abs(out), 0) + 2 * _tiny(node)
    return np.where(bad, np.inf, err)


def _pairs(c, capacity):
    return moe_ops.slots(c, capacity)


def _dispatch_err(vals, errs, node, out, u):
    x, c = vals
    ex, ec = _full(errs[0], x), _full(errs[1], c)
    b, s, e, pos = _pairs(c, node.attr("capacity"))
    err = np.zeros(np.shape(out))
    if node.attr("weighted", False):
        ac, ecs = np.abs(c[b, s, e])[:, None], ec[b, s, e][:, None]
        err[b, e, pos] = (ac + ecs) * ex[b, s] + ecs * np.abs(x[b, s]) + u * np.abs(out[b, e, pos]) + _tiny(node)
    else:
        err[b, e, pos] = ex[b, s]
    return err


def _combine_err(vals, errs, node, out, u):
    y, c = vals
    ey, ec = _full(errs[0], y), _full(errs[1], c)
    b, s, e, pos = _pairs(c, y.shape[2])
    w = node.attr("weighted", True)
    ac = np.abs(c[b, s, e])[:, None] if w else 1.0
    ecs = ec[b, s, e][:, None] if w else 0.0
    ay = np.abs(y[b, e, pos])
    terms = (ac + ecs) * ey[b, e, pos] + ecs * ay + _gamma(c.shape[2] + 1, u) * ac * ay + 2 * _tiny(node)
    err = np.zeros(np.shape(out))
    np.add.at(err, (b, s), terms)
    return err


def _combine_grad_c_err(vals, errs, node, out, u):
    g, y, c = vals
    eg, ey = _full(errs[0], g), _full(errs[1], y)
    b, s, e, pos = _pairs(c, y.shape[2])
    ag, ay, egs, eys = np.abs(g[b, s]), np.abs(y[b, e, pos]), eg[b, s], ey[b, e, pos]
    h = g.shape[-1]
    err = np.zeros(np.shape(out))
    err[b, s, e] = np.sum(ag * eys + egs * ay + egs * eys + _gamma(h, u) * ag * ay, axis=-1) + h * _tiny(node)
    return err


MOE_ERROR_RULES = {"moe_route": _route_err, "moe_route_grad": _route_grad_err, "moe_dispatch": _dispatch_err,
                   "moe_combine": _combine_err, "moe_combine_grad_c": _combine_grad_c_err}
