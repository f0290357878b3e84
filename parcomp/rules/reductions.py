"""Rules of the reductions part: sharding strategies and VJPs of
``log``, ``amax`` (+ ``amax_grad``), ``argmax`` (+ ``argmax_key`` / ``argmax_index``),
``mean``, ``softmax``, ``log_softmax``, ``pick`` / ``pick_grad``, ``label_mask``, ``mask_pad``,
``topk`` / ``topk_index`` and ``take_along`` / ``put_along`` (their gradients).

Merged into :data:`parcomp.rules.sharding.STRATEGY_RULES` and :data:`parcomp.rules.vjp.VJP_RULES`.
Sharding, one mesh axis:

- a max over a split dim gives a partial max ``P(max)`` (amax, argmax_key); a sum over one a
  partial sum (``sum``, and ``pick`` of a vocab-split z: only the owner of the column holds it);
- ``topk`` / ``topk_index`` never split the dim they choose along (a split one would need a
  local top-k and a merge); ``take_along`` / ``put_along`` split any other dim with their
  indices, and are linear in their first operand (``P`` passes through);
- ``mean``, ``softmax``, ``log_softmax`` and ``argmax`` never split their reduced dim: the
  decompose pass (parcomp/passes/decompose.py) writes them as amax / sum / pick first, and
  shard-prop may then split that dim;
- ``amax`` of a ``P(max)`` is a ``P(max)`` (a max of maxima); a ``P(sum)`` never reaches it.
"""
from __future__ import annotations

import numpy as np

from ..ir.types import PMAX, P, R, Shard


def _norm(dims, rank):
    return tuple(sorted(d % max(rank, 1) for d in dims))


def _shift(d, dims):
    return d - sum(1 for x in dims if x < d)


# ---- sharding: (node, in types) -> [(in placements, out placement)] -------------------

def _amax(node, ts):
    dims = _norm(node.attr("dims"), ts[0].rank)
    out = [((R,), R), ((PMAX,), PMAX)]
    return out + [((Shard(d),), PMAX if d in dims else Shard(_shift(d, dims))) for d in range(ts[0].rank)]


def _amax_grad(node, ts):
    dims = _norm(node.attr("dims"), ts[1].rank)
    out = [((R, R, R), R), ((P, R, R), P)]
    for d in range(ts[1].rank):
        if d not in dims:
            k = Shard(_shift(d, dims))
            out.append(((k, Shard(d), k), Shard(d)))
    return out


def _mean(node, ts):
    dims = _norm(node.attr("dims"), ts[0].rank)
    return [((R,), R), ((P,), P)] + [((Shard(d),), Shard(_shift(d, dims)))
                                     for d in range(ts[0].rank) if d not in dims]


def _keep_dim(node, ts):  # softmax, log_softmax: any dim but the reduced one
    dim = node.attr("dim") % ts[0].rank
    return [((R,), R)] + [((Shard(d),), Shard(d)) for d in range(ts[0].rank) if d != dim]


def _argmax(node, ts):
    dim = node.attr("dim") % ts[0].rank
    out = [((R,), R)] + [((Shard(d),), Shard(_shift(d, (dim,)))) for d in range(ts[0].rank) if d != dim]
    return out + ([((Shard(dim),), PMAX)] if node.op == "argmax_key" else [])


def _pick(node, ts):
    z = ts[0]
    return ([((R, R), R), ((Shard(z.rank - 1), R), P), ((P, R), P)]
            + [((Shard(d), Shard(d)), Shard(d)) for d in range(z.rank - 1)])


def _pick_grad(node, ts):
    rank = node.type.rank
    return ([((R, R), R), ((R, R), Shard(rank - 1)), ((P, R), P)]
            + [((Shard(d), Shard(d)), Shard(d)) for d in range(rank - 1)])


def _topk(node, ts):
    dim = node.attr("dim") % ts[0].rank
    return [((R,), R)] + [((Shard(d),), Shard(d)) for d in range(ts[0].rank) if d != dim]


def _along(node, ts):
    dim = node.attr("dim") % ts[0].rank
    return [((R, R), R), ((P, R), P)] + [((Shard(d), Shard(d)), Shard(d))
                                         for d in range(ts[0].rank) if d != dim]


REDUCE_STRATEGY_RULES = {"amax": _amax, "amax_grad": _amax_grad, "mean": _mean, "softmax": _keep_dim,
                         "log_softmax": _keep_dim, "argmax": _argmax, "argmax_key": _argmax,
                         "pick": _pick, "pick_grad": _pick_grad, "topk": _topk, "topk_index": _topk,
                         "take_along": _along, "put_along": _along}
"""op -> strategy rule; ``log``, ``argmax_index``, ``label_mask`` and ``mask_pad`` are
pointwise (kind ``nonlinear``: R and S(d), never P)."""


# ---- VJPs: (builder, node, grad) -> one gradient (or None) per operand ---------------

def _mean_vjp(b, n, g):
    x = b.type(n.inputs[0])
    dims = _norm(n.attr("dims"), x.rank)
    count = int(np.prod([x.shape[d] for d in dims])) if dims else 1
    return (b.op("scale", [b.op("expand", [g], dims=dims, type=x)], value=1.0 / count),)


def _softmax_vjp(b, n, g):
    """dx = y * (g - sum(g * y)) over the softmax dim."""
    y, ty = n.name, b.type(n.name)
    dim = (n.attr("dim") % ty.rank,)
    s = b.op("expand", [b.op("sum", [b.op("mul", [g, y])], dims=dim)], dims=dim, type=ty)
    return (b.op("mul", [y, b.op("sub", [g, s])]),)


def _log_softmax_vjp(b, n, g):
    """dx = g - exp(y) * sum(g) over the dim."""
    y, ty = n.name, b.type(n.name)
    dim = (n.attr("dim") % ty.rank,)
    s = b.op("expand", [b.op("sum", [g], dims=dim)], dims=dim, type=ty)
    return (b.op("sub", [g, b.op("mul", [b.op("exp", [y]), s])]),)


def _amax_vjp(b, n, g):
    if n.attr("detach", False):
        return (None,)  # a shift the result does not depend on (softmax's max)
    return (b.op("amax_grad", [g, n.inputs[0], n.name], dims=n.attr("dims")),)


def _topk_vjp(b, n, g):
    """dx: g put back at the chosen indices (0 elsewhere)."""
    x, dim = n.inputs[0], n.attr("dim")
    idx = b.op("topk_index", [x], k=n.attr("k"), dim=dim)
    return (b.op("put_along", [g, idx], dim=dim, size=b.type(x).shape[dim]),)


def _no_grad(b, n, g):
    return (None,) * len(n.inputs)


REDUCE_VJP_RULES = {
    "log": lambda b, n, g: (b.op("div", [g, n.inputs[0]]),),
    "amax": _amax_vjp,
    "argmax": _no_grad, "argmax_key": _no_grad, "argmax_index": _no_grad, "label_mask": _no_grad,
    "mean": _mean_vjp,
    "softmax": _softmax_vjp,
    "log_softmax": _log_softmax_vjp,
    "pick": lambda b, n, g: (b.op("pick_grad", [g, n.inputs[1]], type=b.type(n.inputs[0]),
                                  ignore_index=n.attr("ignore_index", -100)), None),
    "pick_grad": lambda b, n, g: (b.op("pick", [g, n.inputs[1]], ignore_index=n.attr("ignore_index", -100)),
                                  None),
    "mask_pad": lambda b, n, g: (b.op("mask_pad", [g], size=n.attr("size"), fill="0"),),
    "topk": _topk_vjp, "topk_index": _no_grad,
    "take_along": lambda b, n, g: (b.op("put_along", [g, n.inputs[1]], dim=n.attr("dim"),
                                        size=b.type(n.inputs[0]).shape[n.attr("dim")]), None),
    "put_along": lambda b, n, g: (b.op("take_along", [g, n.inputs[1]], dim=n.attr("dim")), None),
}
