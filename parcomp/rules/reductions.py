"""Rules of the reductions part (issue 17): sharding strategies, VJPs and error bounds of
``log``, ``amax`` (+ ``amax_grad``), ``argmax`` (+ ``argmax_key`` / ``argmax_index``),
``mean``, ``softmax``, ``log_softmax``, ``pick`` / ``pick_grad``, ``label_mask``, ``mask_pad``.

Merged into :data:`parcomp.rules.sharding.STRATEGY_RULES`, :data:`parcomp.rules.vjp.VJP_RULES`
and :data:`parcomp.rules.error.ERROR_RULES`. Sharding, one mesh axis:

- a max over a split dim gives a partial max ``P(max)`` (amax, argmax_key); a sum over one a
  partial sum (``sum``, and ``pick`` of a vocab-split z: only the owner of the column holds it);
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


REDUCE_STRATEGY_RULES = {"amax": _amax, "amax_grad": _amax_grad, "mean": _mean, "softmax": _keep_dim,
                         "log_softmax": _keep_dim, "argmax": _argmax, "argmax_key": _argmax,
                         "pick": _pick, "pick_grad": _pick_grad}
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
}


# ---- error bounds: (vals, errs, node, out, u) -> bound (see parcomp/rules/error.py) ------

def _gamma(k, u):
    ku = float(k) * u
    return ku / (1 - ku) if ku < 1 else float("inf")


def _tiny(node):
    dt = np.dtype(node.type.dtype) if node.type.dtype != "bfloat16" else np.dtype("float32")
    return float(np.finfo(dt).tiny) if dt.kind == "f" else 0.0


def _full(e, x):
    return np.broadcast_to(np.asarray(e, np.float64), np.shape(x))


def _log(vals, errs, node, out, u):
    x, e = vals[0], _full(errs[0], vals[0])
    low = np.abs(x) - e
    with np.errstate(divide="ignore", invalid="ignore"):
        prop = np.where(low > 0, e / np.where(low > 0, low, 1.0), np.where(e > 0, np.inf, 0.0))
    return prop + 8 * u * np.abs(out) + _tiny(node)


def _amax_err(vals, errs, node, out, u):
    """Exact otherwise, and ``max_j (x_j - e_j) <= max(x + d) <= max_j (x_j + e_j)``: the
    larger distance of those from ``max(x)``, at most ``max |d|``. An element far below the
    max (a padded vocab entry at the dtype's lowest value, whose error is near the dtype's
    max) does not widen it."""
    x = np.asarray(vals[0], np.float64)
    e = _full(errs[0], vals[0]).astype(np.float64)
    dims = _norm(node.attr("dims"), x.ndim)
    if not dims:
        return e.copy()
    with np.errstate(invalid="ignore", over="ignore"):
        hi, lo = np.nan_to_num(x + e, nan=np.inf), np.nan_to_num(x - e, nan=-np.inf)
        m = np.max(x, axis=dims)
        far = np.maximum(np.max(hi, axis=dims) - m, m - np.max(lo, axis=dims))
    return np.minimum(np.nan_to_num(far, nan=np.inf), np.max(e, axis=dims))


def _amax_grad_err(vals, errs, node, out, u):
    """g / count on the maxima; where another element is within the errors of the max the
    mask may differ: charged |g| + e_g there."""
    g, x, y = vals
    eg, ex, ey = (_full(e, v) for e, v in zip(errs, vals))
    dims = _norm(node.attr("dims"), x.ndim)
    gy, ye, eye = (np.expand_dims(a, dims) for a in (g, y, ey))
    near = np.abs(x - ye) <= ex + eye
    unsure = np.sum(near, axis=dims, keepdims=True) > np.sum(x == ye, axis=dims, keepdims=True)
    egy = np.expand_dims(eg, dims)
    return np.where(near, egy + np.where(unsure, np.abs(gy), 0.0), 0.0) + u * np.abs(out) + _tiny(node)


def _argmax_err(vals, errs, node, out, u):
    """An index is exact (bound 0) where the max beats every other element by more than
    twice the errors; elsewhere rounding may pick another index: bound inf (cannot vouch)."""
    x, e = vals[0], _full(errs[0], vals[0])
    dim = node.attr("dim") % x.ndim
    top = np.max(x, axis=dim, keepdims=True)
    emax = np.max(e, axis=dim, keepdims=True)
    close = np.sum(np.abs(top - x) <= 2 * emax, axis=dim) > np.sum(x == top, axis=dim)
    return np.where(close, np.inf, 0.0)


def _mean_err(vals, errs, node, out, u):
    x, e = vals[0], _full(errs[0], vals[0])
    dims = _norm(node.attr("dims"), x.ndim)
    k = int(np.prod([x.shape[d] for d in dims])) if dims else 1
    return (np.sum(e, axis=dims) + _gamma(k - 1, u) * np.sum(np.abs(x), axis=dims)) / k \
        + 2 * u * np.abs(out) + _tiny(node)


def _softmax_parts(x, e, dim, u):
    p = np.exp(x - np.max(x, axis=dim, keepdims=True))
    p = p / np.sum(p, axis=dim, keepdims=True)
    mix = np.sum(p * e, axis=dim, keepdims=True)
    zmax = np.max(np.abs(x), axis=dim, keepdims=True)
    return p, mix, zmax, _gamma(x.shape[dim] + 8, u)


def _softmax_err(vals, errs, node, out, u):
    """|dp_i| <= p_i (e_i + sum_j p_j e_j); rounding of the sum, the exps and the shift."""
    x, e = vals[0], _full(errs[0], vals[0])
    dim = node.attr("dim") % x.ndim
    p, mix, zmax, g = _softmax_parts(x, e, dim, u)
    return p * (e + mix) + p * (g + 8 * u * (1 + zmax)) + u * np.abs(out) + _tiny(node)


def _log_softmax_err(vals, errs, node, out, u):
    x, e = vals[0], _full(errs[0], vals[0])
    dim = node.attr("dim") % x.ndim
    p, mix, zmax, g = _softmax_parts(x, e, dim, u)
    return e + mix + g + 8 * u * (zmax + np.abs(out)) + _tiny(node)


def _pick_err(vals, errs, node, out, u):
    from ..reference.reduce_ops import REDUCE_NUMPY_OPS
    return np.abs(REDUCE_NUMPY_OPS["pick"]([_full(errs[0], vals[0]), vals[1]], node))


def _pick_grad_err(vals, errs, node, out, u):
    from ..reference.reduce_ops import REDUCE_NUMPY_OPS
    return np.abs(REDUCE_NUMPY_OPS["pick_grad"]([_full(errs[0], vals[0]), vals[1]], node))


def _mask_pad_err(vals, errs, node, out, u):
    from ..reference.reduce_ops import REDUCE_NUMPY_OPS
    return REDUCE_NUMPY_OPS["mask_pad"]([_full(errs[0], vals[0]).copy()], node.with_attrs(fill="0"))


def _zero(vals, errs, node, out, u):
    return np.zeros(np.shape(out))


REDUCE_ERROR_RULES = {"log": _log, "amax": _amax_err, "amax_grad": _amax_grad_err, "argmax": _argmax_err,
                      "argmax_key": _argmax_err, "argmax_index": lambda v, e, n, o, u: _full(e[0], o).copy(),
                      "mean": _mean_err, "softmax": _softmax_err, "log_softmax": _log_softmax_err,
                      "pick": _pick_err, "pick_grad": _pick_grad_err, "label_mask": _zero,
                      "mask_pad": _mask_pad_err}

