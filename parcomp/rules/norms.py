"""Rules of the norms + embedding part (issue 17): sharding strategies, VJPs and error
bounds of ``layer_norm``, ``rms_norm`` (+ ``*_grad``), ``dropout``, ``embedding`` (+ grad).

Merged into the shared tables (:data:`parcomp.rules.sharding.STRATEGY_RULES`,
:data:`parcomp.rules.vjp.VJP_RULES`, :data:`parcomp.rules.error.ERROR_RULES`).

Sharding, one mesh axis:

- a norm (over the last dim) splits any other dim of x (batch, or seq: Megatron sequence
  parallel); weight and bias stay replicated. Its weight gradient ``sum(dy * xhat)`` over
  the split dim is then a partial sum that the planner reduces (an all_reduce over tp).
- dropout is linear in x with a mask fixed by the global element index: R, S(d) and P.
- embedding(ids, table): ids split on any dim (rows follow); table split on dim 1 (hidden)
  gives the output split on its last dim; table split on dim 0 (vocab-parallel) gives a
  partial sum (ids outside the rank's rows give zero rows: one all_reduce makes it whole);
  a partial table gives a partial output (a gather of rows is linear in the table).
- embedding_grad(dy, ids) -> table: dy split on hidden gives S(1); a replicated dy can give
  S(0) (each rank scatters only its own rows); dy and ids split on a token dim give P.
"""
from __future__ import annotations

import numpy as np

from ..ir.types import P, R, Shard
from ..reference.norm_ops import NORM_NUMPY_OPS, dropout_scale
from .vjp_bounds import norm_dg_move


def gamma(k, u: float):
    """Higham's gamma_k = k u / (1 - k u) (inf when k u >= 1); k may be an array."""
    ku = np.asarray(k, np.float64) * u
    return np.where(ku < 1, ku / np.where(ku < 1, 1 - ku, 1.0), np.inf)


# ---- sharding: (node, in types) -> [(in placements, out placement)] -------------------

def _norm(node, ts):
    k = len(ts)
    return [((R,) * k, R)] + [((Shard(d),) + (R,) * (k - 1), Shard(d)) for d in range(ts[0].rank - 1)]


def _norm_grad(node, ts):
    k = len(ts)
    return ([((R,) * k, R), ((P,) + (R,) * (k - 1), P)]
            + [((Shard(d), Shard(d)) + (R,) * (k - 2), Shard(d)) for d in range(ts[1].rank - 1)])


def _dropout(node, ts):
    step = (R,) * (len(ts) - 1)  # the step counter: a replicated scalar
    return [((R,) + step, R), ((P,) + step, P)] + [((Shard(d),) + step, Shard(d)) for d in range(ts[0].rank)]


def _embedding(node, ts):
    ids = ts[0]
    return ([((R, R), R), ((R, Shard(1)), Shard(ids.rank)), ((R, Shard(0)), P), ((R, P), P)]
            + [((Shard(d), R), Shard(d)) for d in range(ids.rank)])


def _embedding_grad(node, ts):
    ids = ts[1]
    return ([((R, R), R), ((Shard(ids.rank), R), Shard(1)), ((R, R), Shard(0)), ((P, R), P)]
            + [((Shard(d), Shard(d)), P) for d in range(ids.rank)])


NORM_STRATEGY_RULES = {"layer_norm": _norm, "rms_norm": _norm, "layer_norm_grad": _norm_grad,
                       "rms_norm_grad": _norm_grad, "dropout": _dropout, "embedding": _embedding,
                       "embedding_grad": _embedding_grad}


# ---- VJPs: (builder, node, grad) -> one gradient (or None) per operand ---------------

def _norm_vjp(b, n, g):
    x, eps = n.inputs[0], n.attr("eps")
    lead = tuple(range(b.type(x).rank - 1))
    out = [b.op(n.op + "_grad", [g, *n.inputs[:2]], eps=eps)]
    if len(n.inputs) > 1:  # weight: sum over the tokens of dy * xhat
        xhat = b.op(n.op, [x], eps=eps)
        out.append(b.op("sum", [b.op("mul", [g, xhat])], dims=lead, bucket="norm"))
    if len(n.inputs) > 2:  # bias
        out.append(b.op("sum", [g], dims=lead, bucket="norm"))  # bucket: parcomp/passes/bucket.py
    return tuple(out)


def _dropout_vjp(b, n, g):  # the same mask (same seed, step and global indices) on the gradient
    return (b.op("dropout", [g, *n.inputs[1:]], p=n.attr("p"), seed=n.attr("seed")),) + (None,) * (len(n.inputs) - 1)


def _embedding_vjp(b, n, g):
    ids, table = n.inputs
    return None, b.op("embedding_grad", [g, ids], type=b.type(table))


NORM_VJP_RULES = {"layer_norm": _norm_vjp, "rms_norm": _norm_vjp, "dropout": _dropout_vjp,
                  "embedding": _embedding_vjp}


# ---- error bounds: (vals, errs, node, out, u) -> bound (see parcomp/rules/error.py) ------

def _mean(a):
    return np.mean(a, axis=-1, keepdims=True)


def _xhat_bounds(x, ex, eps, rms, u):
    """(xhat, rstd, error of xhat, relative error of rstd) of a norm over the last dim.

    Input errors, rigorously (not only to first order): with d = x - mu and s = sqrt(var + eps),
    an input moved by at most e moves d by dd (|dd_i| <= e_i + mean e; for rms, e_i) and,
    since mean(d) = 0, s^2 by at most X = 2 mean(|d| e) + mean(dd^2); so |s' - s| <= t s with
    t = 1 - sqrt(1 - X/s^2) (from |s'^2 - s^2| = |s' - s| (s' + s)), and
    xhat' - xhat = (dd - xhat (s' - s)) / s' gives |xhat' - xhat| <= (rstd |dd| + |xhat| t) / (1 - t)
    (when X >= s^2, or beyond, |xhat| + sqrt(n): mean(xhat^2) <= 1 bounds any row). First order this is
    rstd (e_i + mean e + |xhat_i| mean(|xhat| e)): the actual variance, no worst case.
    Own rounding: the mean to gamma_n mean|x|, the variance (any algorithm, E[x^2] - mu^2
    included) to gamma_{2n+8} mean(x^2) / (var + eps), the sqrt/divide to 4u."""
    n = x.shape[-1]
    ex = np.broadcast_to(ex, x.shape)
    mu = 0.0 if rms else _mean(x)
    d = x - mu
    var = _mean(d * d)
    rstd = 1.0 / np.sqrt(var + eps)
    xhat = d * rstd
    dd = ex + (0.0 if rms else _mean(ex))
    big = (2 * _mean(np.abs(d) * ex) + _mean(dd * dd)) * rstd * rstd
    with np.errstate(invalid="ignore", divide="ignore"):
        t = np.where(big < 1, big / (1 + np.sqrt(np.maximum(1 - big, 0.0))), np.inf)
        prop = np.where(t < 1, (rstd * dd + np.abs(xhat) * t) / np.where(t < 1, 1 - t, 1.0), np.inf)
        rel_in = np.where(t < 1, t / np.where(t < 1, 1 - t, 1.0), np.inf)
    prop = np.minimum(prop, _xhat_move(xhat, rstd, ex, dd, big, t, rms))
    prop = np.minimum(prop, np.abs(xhat) + np.sqrt(n))  # any normalized row has |xhat_i| < sqrt(n)
    err_mu = 0.0 if rms else gamma(n + 1, u) * _mean(np.abs(x))
    rel_own = 0.5 * (gamma(2 * n + 8, u) * _mean(x * x) + 2 * err_mu * _mean(np.abs(d))) / (var + eps) + 4 * u
    exhat = prop + np.abs(xhat) * (rel_own + u) + rstd * (err_mu + u * np.abs(d))
    return xhat, rstd, exhat, rel_in + rel_own


def _xhat_move(xhat, rstd, ex, dd, big, t, rms):
    """|xhat' - xhat| for inputs moved by at most ``ex``: ``rstd |J| ex`` (the exact first
    order, :func:`parcomp.rules.vjp_bounds.norm_dg_move`) plus the rest, rigorously: with
    s' = s sqrt(1 + z), z = (2 mean(d dd) + mean(dd^2)) / s^2 (|z| <= big < 1),
    xhat' - xhat - J dd = dd (1/s' - 1/s) - xhat (f(z) - mean(d dd) / s^2), f(z) = 1 - (1+z)^-1/2;
    |1/s' - 1/s| <= rstd t / (1 - t) and |f(z) - z/2| <= 3/8 z^2 (1 - |z|)^-5/2 (Taylor), so the
    rest is at most |dd| rstd t / (1-t) + |xhat| (mean(dd^2) rstd^2 / 2 + 3/8 big^2 (1-big)^-5/2).
    Inf where big >= 1 or the |J| is too large to build (the caller keeps its other bound)."""
    first = norm_dg_move(xhat, ex, rms)
    if first is None:
        return np.inf
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        ok = big < 1
        safe = np.where(ok, big, 0.0)
        rest = (dd * rstd * np.where(t < 1, t / np.where(t < 1, 1 - t, 1.0), np.inf)
                + np.abs(xhat) * (0.5 * _mean(dd * dd) * rstd * rstd + 0.375 * safe * safe * (1 - safe) ** -2.5))
        return np.where(ok, rstd * first + rest, np.inf)


def _norm_err(vals, errs, node, out, u):
    """w xhat + b: |w| e_xhat + e_w (|xhat| + e_xhat) + e_b + the product's and sum's rounding."""
    xhat, _, exhat, _ = _xhat_bounds(vals[0], errs[0], float(node.attr("eps")), node.op == "rms_norm", u)
    e, y = exhat, xhat
    if len(vals) > 1:
        w, ew = vals[1], errs[1]
        e, y = np.abs(w) * exhat + ew * (np.abs(xhat) + exhat) + u * np.abs(w * xhat), w * xhat
    if len(vals) > 2:
        e = e + errs[2] + u * np.abs(y + vals[2])
    return e + u * np.abs(out)


def _norm_grad_err(vals, errs, node, out, u):
    """rstd (g - mean g - xhat m), m = mean(g xhat), g = dy w: each factor's error (the
    products of two errors included: g xhat and xhat m), rstd's rigorous relative error
    (:func:`_xhat_bounds`), the means' rounding gamma_{n+4} and a few roundings of every term."""
    dy, x = vals[0], vals[1]
    rms = node.op == "rms_norm_grad"
    xhat, rstd, exhat, rel_r = _xhat_bounds(x, errs[1], float(node.attr("eps")), rms, u)
    edy = np.broadcast_to(errs[0], dy.shape)
    g, eg = dy, edy
    if len(vals) > 2:
        w, ew = vals[2], errs[2]
        g, eg = dy * w, np.abs(w) * edy + (np.abs(dy) + edy) * ew + u * np.abs(dy * w)
    n = x.shape[-1]
    m = _mean(g * xhat)
    mg = 0.0 if rms else _mean(np.abs(g))
    big = np.abs(g) + mg + np.abs(xhat) * np.abs(m)
    em_x = _mean(eg * exhat + np.abs(g) * exhat) + gamma(n + 4, u) * _mean(np.abs(g * xhat))
    em = em_x + _mean(eg * np.abs(xhat))  # m's error: its e_g part first order, then the rest
    moved = norm_dg_move(xhat, eg, rms)  # |J| e_g (vjp_bounds.py), at most the expansion
    if moved is None:
        moved = eg + (0.0 if rms else _mean(eg)) + np.abs(xhat) * _mean(eg * np.abs(xhat))
    einner = (moved + (0.0 if rms else gamma(n + 4, u) * mg) + exhat * (np.abs(m) + em)
              + np.abs(xhat) * em_x + 4 * u * big)
    return rstd * (rel_r * big + (1 + rel_r) * einner) + u * np.abs(out)


def _dropout_err(vals, errs, node, out, u):
    """x * fl(mask / (1 - p)): the scale's rounding and the product's, mask-independent."""
    s = dropout_scale(node.attr("p"))
    return s * (np.broadcast_to(errs[0], np.shape(vals[0])) + 2 * u * np.abs(vals[0]))


def _embedding_err(vals, errs, node, out, u):
    """Rows are copied: each output row carries its table row's error."""
    ids, table = vals
    return NORM_NUMPY_OPS["embedding"]([ids, np.broadcast_to(errs[1], table.shape)], node)


def _embedding_grad_err(vals, errs, node, out, u):
    """A scatter-add: per table row the summed errors plus gamma_k sum |dy| over its k tokens."""
    dy, ids = vals
    scatter = NORM_NUMPY_OPS["embedding_grad"]
    e = scatter([np.broadcast_to(errs[0], dy.shape).astype(np.float64), ids], node)
    count = scatter([np.ones(dy.shape), ids], node)
    return e + gamma(count, u) * scatter([np.abs(dy), ids], node)


def _bucket_err(vals, errs, node, out, u):
    """Layout-only: errors move with the values (concatenated, or sliced back)."""
    es = [np.broadcast_to(e, np.shape(v)).astype(np.float64) for v, e in zip(vals, errs)]
    return np.asarray(NORM_NUMPY_OPS[node.op](es, node), np.float64)


NORM_ERROR_RULES = {"bucket_cat": _bucket_err, "bucket_part": _bucket_err,"layer_norm": _norm_err, "rms_norm": _norm_err, "layer_norm_grad": _norm_grad_err,
                    "rms_norm_grad": _norm_grad_err, "dropout": _dropout_err,
                    "embedding": _embedding_err, "embedding_grad": _embedding_grad_err}
