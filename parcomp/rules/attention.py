"""Sharding rules, VJPs and error bounds of the attention part (issue 17).

``sdpa(q, k, v)`` works on ``[batch, heads, seq, head_dim]``; every (batch, head) pair
is independent, so splitting batch or heads on all three operands is exact (Megatron's
tensor-parallel attention splits heads). Its output is linear in ``v`` (``R, R, P -> P``)
and its columns are ``v``'s (``R, R, S(3) -> S(3)``). Without a causal mask, query rows
are independent too (``S(2), R, R -> S(2)``); with one, a rank's rows would need their
global offset, so the query sequence is not split. ``sdpa_grad(dy, q, k, v)`` follows
the same batch/head splits, is linear in ``dy``, and without a mask the gradient of q
follows a query-sequence split while those of k and v become partial sums over it.

The VJP of ``sdpa`` is three ``sdpa_grad`` nodes (q, k, v), each recomputing the
attention probabilities (no extra op or value of the softmax reaches the graph).
Error bounds are first-order compositions of the matmul rule
(:func:`parcomp.rules.error._matmul`) with a rigorous softmax step: a score error of at
most E in a row moves every probability by at most a factor ``exp(+-2E)``.

Also here: the pointwise ops RoPE's cos/sin tables need (``cos``, ``sin``, ``cast``,
``arange``): their VJPs and error bounds.
"""
from __future__ import annotations

import numpy as np

from ..ir.types import P, R, Shard
from ..reference.numpy_attn import attention_probs
from .vjp_bounds import sdpa_dy_move


def sdpa_strategies(node, ts):
    """Single-axis strategies of ``sdpa(q, k, v)`` (see the module docstring)."""
    out = [((R, R, R), R), ((R, R, P), P), ((R, R, Shard(3)), Shard(3))]
    out += [((Shard(d),) * 3, Shard(d)) for d in (0, 1)]
    if node.attr("cp") == "ring":  # issue 14: K/V blocks around the ring inside the op
        out.append(((Shard(2),) * 3, Shard(2)))
    elif not node.attr("causal", False) or node.attr("cp"):  # cp: mask at q_start (issue 14)
        out.append(((Shard(2), R, R), Shard(2)))
    return out


def sdpa_grad_strategies(node, ts):
    """Single-axis strategies of ``sdpa_grad(dy, q, k, v)``."""
    out = [((R,) * 4, R), ((P, R, R, R), P)] + [((Shard(d),) * 4, Shard(d)) for d in (0, 1)]
    if node.attr("cp") == "ring":  # issue 14: dq at its queries, dk/dv returned to their owners
        out.append(((Shard(2),) * 4, Shard(2)))
    elif not node.attr("causal", False) or node.attr("cp"):  # query rows independent: dq split, dk/dv summed over them
        out.append(((Shard(2), Shard(2), R, R), Shard(2) if node.attr("wrt") == "q" else P))
    return out


def _sdpa_vjp(b, n, g):
    attrs = {"causal": n.attr("causal", False), "scale": n.attr("scale")}
    for key in ("window", "cp", "cp_axis", "chunking", "cp_size"):  # context parallel (issue 14): the grads keep the split too
        if n.attr(key):
            attrs[key] = n.attr(key)
    return tuple(b.op("sdpa_grad", [g, *n.inputs], wrt=w, **attrs) for w in "qkv")


def _float_input(b, x) -> bool:
    return b.type(x).dtype.startswith("float") or b.type(x).dtype.startswith("bfloat")


ATTENTION_STRATEGIES = {"sdpa": sdpa_strategies, "sdpa_grad": sdpa_grad_strategies,
                        "arange": lambda node, ts: [((), R)]}  # values depend on the global index
ATTENTION_VJPS = {
    "sdpa": _sdpa_vjp,
    "cos": lambda b, n, g: (b.op("mul", [g, b.op("neg", [b.op("sin", [n.inputs[0]])])]),),
    "sin": lambda b, n, g: (b.op("mul", [g, b.op("cos", [n.inputs[0]])]),),
    "cast": lambda b, n, g: (b.op("cast", [g], type=b.type(n.inputs[0]))
                             if _float_input(b, n.inputs[0]) else None,),
    "arange": lambda b, n, g: (),
}


# ---- error bounds (the helpers of parcomp.rules.error, which imports this module) -------

def gamma(k, u: float) -> float:
    """Higham's gamma_k = k u / (1 - k u); inf when k u >= 1."""
    ku = float(k) * u
    return ku / (1.0 - ku) if ku < 1.0 else float("inf")


def tiny(dtype) -> float:
    """The smallest normal number of a float dtype (bfloat16's is float32's), else 0."""
    if str(dtype) == "bfloat16":
        return 2.0 ** -126
    dt = np.dtype(dtype)
    return float(np.finfo(dt).tiny) if dt.kind == "f" else 0.0


def _max_slope(df, x, e):
    """max |f'| over x - e, x, x + e."""
    d = np.abs(df(x))
    if np.any(e):
        d = np.maximum(d, np.maximum(np.abs(df(x + e)), np.abs(df(x - e))))
    return d


def _t(x):
    return np.swapaxes(x, -1, -2)


def _mm_err(a, b, ea, eb, u, k=None):
    """The matmul rule |A| e_B + e_A |B| + e_A e_B + gamma_k |A||B| for a @ b."""
    ea, eb = np.broadcast_to(ea, a.shape), np.broadcast_to(eb, b.shape)
    aa, ab = np.abs(a), np.abs(b)
    k = a.shape[-1] if k is None else k
    return np.matmul(aa, eb) + np.matmul(ea, ab) + np.matmul(ea, eb) + gamma(k, u) * np.matmul(aa, ab)


def _probs_err(q, k, eq, ek, node, u, tiny):
    """(p, bound on |p_computed - p|) of the attention probabilities softmax(scale q k^T)."""
    c, dim, sk = abs(float(node.attr("scale"))), q.shape[-1], k.shape[-2]
    s = np.matmul(q, _t(k)) * c
    es = c * _mm_err(q, _t(k), eq, _t(np.broadcast_to(ek, k.shape)), u, dim + 4) + dim * tiny
    p = attention_probs(q, k, node)
    keep = p > 0 if node.attr("causal", False) else np.ones(p.shape, bool)
    big = np.max(np.where(keep, es, 0.0), axis=-1, keepdims=True)
    smax = np.max(np.where(keep, np.abs(s), 0.0), axis=-1, keepdims=True)
    own = gamma(2 * sk + 16, u) + 8 * u * smax  # exps of rounded shifts, the sum, the division
    return p, p * (np.expm1(np.minimum(2 * big, 700.0)) + own) + tiny


def _sdpa_err(vals, errs, node, out, u):
    q, k, v = vals
    t = tiny(node.type.dtype)
    p, ep = _probs_err(q, k, errs[0], errs[1], node, u, t)
    return _mm_err(p, v, ep, errs[2], u, k.shape[-2] + 2) + u * np.abs(out) + k.shape[-2] * t


def _sdpa_grad_err(vals, errs, node, out, u):
    """dv = p^T dy; ds = p (dy v^T - rowsum(p dy v^T)); dq = c ds k; dk = c ds^T q."""
    dy, q, k, v = vals
    edy, eq, ek, ev = (np.broadcast_to(e, x.shape) for e, x in zip(errs, vals))
    t, sk = tiny(node.type.dtype), k.shape[-2]
    p, ep = _probs_err(q, k, eq, ek, node, u, t)
    wrt = node.attr("wrt")
    if wrt == "v":
        return _mm_err(_t(p), dy, _t(ep), edy, u, q.shape[-2]) + u * np.abs(out) + sk * t
    dp = np.matmul(dy, _t(v))
    edp_y = np.matmul(edy, np.abs(_t(v)))  # dy's own error, first order (its |J|: vjp_bounds.py)
    edp = _mm_err(dy, _t(v), 0.0, _t(ev), u) + np.matmul(edy, _t(ev)) + t  # + edp_y: the whole
    r = np.sum(dp * p, axis=-1, keepdims=True)
    er = (np.sum(np.abs(dp) * ep + edp * p + (edp + edp_y) * ep, axis=-1, keepdims=True)
          + gamma(sk + 2, u) * np.sum(np.abs(dp * p), axis=-1, keepdims=True))
    tt = dp - r
    et = edp + er + u * np.abs(tt)
    ds = p * tt
    et_y = edp_y + np.sum(p * edp_y, axis=-1, keepdims=True)  # p (e + <p, e>): the expansion
    eds = p * et + ep * np.abs(tt) + ep * (et + et_y) + u * np.abs(ds) + t
    c = abs(float(node.attr("scale")))
    other = k if wrt == "q" else q
    moved = sdpa_dy_move(p, v, other, edy, wrt)  # |J| e_dy, at most the expansion p et_y
    if wrt == "q":
        e = _mm_err(ds, k, eds, ek, u, sk + 2) + np.matmul(p * et_y, ek)
        e = e + (np.matmul(p * et_y, np.abs(k)) if moved is None else moved)
    else:
        e = _mm_err(_t(ds), q, _t(eds), eq, u, q.shape[-2] + 2) + np.matmul(_t(p * et_y), eq)
        e = e + (np.matmul(_t(p * et_y), np.abs(q)) if moved is None else moved)
    return c * e + 2 * u * np.abs(out) + sk * t


def _trig(f, df):
    def rule(vals, errs, node, out, u):
        x, e = vals[0], errs[0]
        return _max_slope(df, x, e) * e + 8 * u * np.abs(out) + 2 * u + tiny(node.type.dtype)
    return rule


def _cast_err(vals, errs, node, out, u):
    return np.broadcast_to(errs[0], np.shape(out)).astype(np.float64) + u * np.abs(out)


ATTENTION_ERRORS = {
    "sdpa": _sdpa_err,
    "sdpa_grad": _sdpa_grad_err,
    "cos": _trig(np.cos, lambda x: np.sin(x)),
    "sin": _trig(np.sin, lambda x: np.cos(x)),
    "cast": _cast_err,
    "arange": lambda vals, errs, node, out, u: u * np.abs(out),
}


def cat_err(vals, errs, node, out, u):
    """Errors move with their values: the operands' bounds, concatenated."""
    es = [np.broadcast_to(e, np.shape(x)).astype(np.float64) for e, x in zip(errs, vals)]
    return np.concatenate(es, axis=node.attr("dim"))
