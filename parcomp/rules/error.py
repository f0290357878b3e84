"""Forward rounding-error rules: one per op, the table :data:`ERROR_RULES`.

A rule is ``(vals, errs, node, out, u) -> err``: given the operands' values
``vals`` (float64 copies of what the op was fed; int64 labels stay ints), bounds
``errs`` on their elementwise absolute errors (float64, broadcastable to the
operand), the op's computed result ``out`` (float64) and the unit roundoff ``u``
of the node's dtype, it returns a float64 array of the output's shape bounding
``|computed - exact|`` elementwise. First-order analysis as in Higham,
*Accuracy and Stability of Numerical Algorithms* (2nd ed., SIAM 2002), ch. 2-3:
each op contributes its operands' errors times its sensitivity plus its own
rounding, ``|fl(x op y) - x op y| <= u |x op y|`` (Higham (2.4)), and a dot
product of length ``k`` in any order is within ``gamma_k |a|.|b|``,
``gamma_k = k u / (1 - k u)`` (Higham (3.5)). Because the matmul and sum rules
hold for every summation order, the same bound covers the sharded program
(partial sums reduced by collectives are a reassociation) and torch's kernels.

Library functions (exp, tanh, erf, ...) are charged a few ulps (``c u |f|``
with ``c`` = 8 or 16, more than numpy's and torch's documented <= 4 ulp), and
pointwise rules take the largest sensitivity over ``x - e, x, x + e``, so a
kink (relu, a mask flip in relu_grad) inside the error interval is covered.
The smallest normal number (:func:`tiny`) is added per rounding for underflow.
:data:`GRAPH_RULES` holds the rules that need an operand's producers (AdamW follows
the gradient through both of its moving averages).
"""
from __future__ import annotations

import numpy as np

from ..reference.numpy_ops import NUMPY_OPS
from .norms import NORM_ERROR_RULES
from ..reference.numpy_ops import NUMPY_OPS, _ce_target
from .reductions import REDUCE_ERROR_RULES


_NOT_NUMPY = {"bfloat16": (2.0 ** -8, 2.0 ** -126)}  # (u, smallest normal) of dtypes numpy lacks


def unit_roundoff(dtype) -> float:
    """u = eps/2 of a float dtype (float32: 2**-24, bfloat16: 2**-8); 0 for integer and bool."""
    if str(dtype) in _NOT_NUMPY:
        return _NOT_NUMPY[str(dtype)][0]
    dt = np.dtype(dtype)
    return float(np.finfo(dt).eps) / 2 if dt.kind == "f" else 0.0


def tiny(dtype) -> float:
    """The smallest normal number of a float dtype (0 for others): the underflow allowance."""
    if str(dtype) in _NOT_NUMPY:
        return _NOT_NUMPY[str(dtype)][1]
    dt = np.dtype(dtype)
    return float(np.finfo(dt).tiny) if dt.kind == "f" else 0.0


def gamma(k, u: float) -> float:
    """Higham's gamma_k = k u / (1 - k u); inf when k u >= 1."""
    ku = float(k) * u
    return ku / (1.0 - ku) if ku < 1.0 else float("inf")


def _tiny(node):
    return tiny(node.type.dtype)


def _spread(f, x, e, fx=None):
    """max |f(x +- e) - f(x)| (0 where e is 0): the variation of f over the error interval."""
    if not np.any(e):
        return np.zeros(np.shape(fx if fx is not None else x))
    fx = f(x) if fx is None else fx
    return np.maximum(np.abs(f(x + e) - fx), np.abs(f(x - e) - fx))


def _max_slope(df, x, e):
    """max |f'| over x - e, x, x + e: the sensitivity of f inside the error interval."""
    d = np.abs(df(x))
    if np.any(e):
        d = np.maximum(d, np.maximum(np.abs(df(x + e)), np.abs(df(x - e))))
    return d


def _grad_of(op):
    """x -> f'(x) through the ``<op>_grad`` numpy op (dy = 1)."""
    return lambda node: lambda x: NUMPY_OPS[f"{op}_grad"]([np.ones_like(x), x], node)


# f'(x) of every pointwise op, and the magnitude its own rounding is relative to
_DERIV = {
    "relu": _grad_of("relu"),
    "gelu": _grad_of("gelu"),
    "silu": _grad_of("silu"),
    "pow": _grad_of("pow"),
    "tanh": lambda n: lambda x: 1.0 - np.tanh(x) ** 2,
    "sigmoid": lambda n: lambda x: NUMPY_OPS["sigmoid_grad"]([np.ones_like(x), 1 / (1 + np.exp(-x))], n),
    "exp": lambda n: np.exp,
}
# (c, magnitude(x, out)): own rounding <= c u magnitude; gelu's 1 + erf(.) cancels for x << 0
_ROUND = {
    "relu": (0, None), "tanh": (8, None), "exp": (8, None), "sigmoid": (8, None), "silu": (8, None),
    "pow": (8, None), "gelu": (16, lambda x, out: np.abs(x) + np.abs(out)),
}


def _pointwise(vals, errs, node, out, u):
    x, e = vals[0], errs[0]
    c, mag = _ROUND[node.op]
    own = c * u * (np.abs(out) if mag is None else mag(x, out)) + (_tiny(node) if c else 0.0)
    return _max_slope(_DERIV[node.op](node), x, e) * e + own


# rounding of dy * d(x) relative to: (c, magnitude(dy, x, out)); x is y for tanh/sigmoid
_GRAD_ROUND = {
    "relu_grad": (0, lambda dy, x, out: 0.0),
    "gelu_grad": (16, lambda dy, x, out: np.abs(dy) * (1 + np.abs(x))),
    "tanh_grad": (8, lambda dy, x, out: np.abs(dy) * (1 + x * x)),
    "sigmoid_grad": (8, lambda dy, x, out: np.abs(dy) * np.abs(x) * (1 + np.abs(x))),
    "silu_grad": (16, lambda dy, x, out: np.abs(dy) * (1 + np.abs(x))),
    "pow_grad": (8, lambda dy, x, out: np.abs(out)),
}


def _pointwise_grad(vals, errs, node, out, u):
    """op(dy, x) = dy * d(x): |d| e_dy + (|dy| + e_dy) * variation of d over x +- e_x + rounding."""
    dy, x = vals
    edy, ex = errs
    one = np.ones_like(x)

    def d(t):
        return NUMPY_OPS[node.op]([one, t], node)

    d0 = d(x)
    c, mag = _GRAD_ROUND[node.op]
    own = c * u * mag(dy, x, out) + (_tiny(node) if c else 0.0)
    return np.abs(d0) * edy + (np.abs(dy) + edy) * _spread(d, x, ex, d0) + own


def _add(vals, errs, node, out, u):
    return errs[0] + errs[1] + u * np.abs(out) + _tiny(node)


def _mul(vals, errs, node, out, u):
    (a, b), (ea, eb) = vals, errs
    return np.abs(a) * eb + ea * np.abs(b) + ea * eb + u * np.abs(out) + _tiny(node)


def _div(vals, errs, node, out, u):
    """|a/b| error over b +- e_b: (e_a + |a/b| e_b) / (|b| - e_b); inf where b may be 0."""
    (a, b), (ea, eb) = vals, errs
    low = np.abs(b) - eb
    with np.errstate(divide="ignore", invalid="ignore"):
        prop = np.where(low > 0, (ea + np.abs(a / b) * eb) / np.where(low > 0, low, 1.0), np.inf)
    return prop + u * np.abs(out) + _tiny(node)


def _matmul(vals, errs, node, out, u):
    """|A| e_B + e_A |B| + e_A e_B + gamma_k |A| |B| (Higham (3.13)), k the contracted length."""
    (a, b), (ea, eb) = vals, errs
    aa, ab = np.abs(a), np.abs(b)
    ea, eb = np.broadcast_to(ea, a.shape), np.broadcast_to(eb, b.shape)
    k = a.shape[-1]
    return (np.matmul(aa, eb) + np.matmul(ea, ab) + np.matmul(ea, eb)
            + gamma(k, u) * np.matmul(aa, ab) + k * _tiny(node))


def _sum(vals, errs, node, out, u):
    """A matmul with ones: sum of the errors + gamma_{k-1} sum |x| over the k summed elements."""
    x, e = vals[0], np.broadcast_to(errs[0], vals[0].shape)
    dims = tuple(node.attr("dims"))
    k = int(np.prod([x.shape[d] for d in dims])) if dims else 1
    return np.sum(e, axis=dims) + gamma(k - 1, u) * np.sum(np.abs(x), axis=dims) + k * _tiny(node)


def _move(vals, errs, node, out, u):
    """Layout/shape-only ops: the error moves with the value."""
    e = np.broadcast_to(errs[0], np.shape(vals[0])).astype(np.float64)
    return np.asarray(NUMPY_OPS[node.op]([e], node), np.float64)


def _scale(vals, errs, node, out, u):
    c = float(node.attr("value"))
    return abs(c) * errs[0] + 2 * u * np.abs(out) + _tiny(node)  # the constant's rounding and the product's


def _add_scalar(vals, errs, node, out, u):
    return errs[0] + u * (np.abs(out) + abs(float(node.attr("value")))) + _tiny(node)


def _softmax(z):
    z = z - np.max(z, axis=-1, keepdims=True)
    p = np.exp(z)
    return p / np.sum(p, axis=-1, keepdims=True)


def _cross_entropy(vals, errs, node, out, u):
    """logsumexp(z) - z[label]: sensitivity sum_j |p_j - onehot_j| e_j; rounding of the
    C-term sum (gamma_C), the exps and logs (8u) and the max shift (u max|z|)."""
    z, labels = vals
    ez = np.broadcast_to(errs[0], z.shape)
    classes = z.shape[-1]
    p, oh = _softmax(z), _ce_target(z, labels, node)  # onehot, smoothed, 0 rows if ignored
    prop = np.sum(np.abs(p - oh) * ez, axis=-1)
    zmax = np.max(np.abs(z), axis=-1)
    smooth = float(node.attr("label_smoothing", 0.0)) * gamma(classes, u) * np.mean(
        np.abs(z - zmax[..., None]) + np.abs(out)[..., None], axis=-1)
    return prop + gamma(classes + 8, u) + 8 * u * (zmax + np.abs(out)) + smooth + _tiny(node)


def _cross_entropy_grad(vals, errs, node, out, u):
    """dl * (softmax(z) - onehot): |dp_i| <= p_i (e_i + sum_j p_j e_j) to first order."""
    dl, z, labels = vals
    edl, ez = np.asarray(errs[0])[..., None], np.broadcast_to(errs[1], z.shape)
    classes = z.shape[-1]
    p, oh = _softmax(z), _ce_target(z, labels, node)
    dp = p * (ez + np.sum(p * ez, axis=-1, keepdims=True))
    adl = np.abs(dl)[..., None]
    zmax = np.max(np.abs(z), axis=-1, keepdims=True)
    own = adl * (p * (gamma(classes + 8, u) + 4 * u * zmax) + u * np.abs(p - oh)) + u * np.abs(out)
    return np.abs(p - oh) * edl + (adl + edl) * dp + own + _tiny(node)


def _adamw(vals, errs, node, out, u):
    """torch.optim.AdamW's update (numpy_ops._adamw), interval by interval.

    sqrt over v +- e_v exactly (no derivative, sqrt(0) is steep); the bias corrections
    1 - b**t computed in float32 carry (t + 8) u b**t, which 1 - b**t may magnify;
    the denominator never drops below eps, so the bound stays finite.
    """
    p, m, v, t = vals
    ep, em, ev = (np.broadcast_to(e, np.shape(x)) for e, x in zip(errs[:3], vals[:3]))
    lr, b1, b2 = (float(node.attr(k)) for k in ("lr", "beta1", "beta2"))
    eps, wd = float(node.attr("eps")), float(node.attr("weight_decay"))
    bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
    rel1, rel2 = (t + 8) * u * b1 ** t / bc1, (t + 8) * u * b2 ** t / bc2
    vv = np.maximum(v, 0.0)
    s = np.sqrt(vv)
    es = np.maximum(np.sqrt(vv + ev) - s, s - np.sqrt(np.maximum(vv - ev, 0.0))) + u * s
    sq2 = np.sqrt(bc2)
    den = s / sq2 + eps
    eden = es / sq2 + (s / sq2) * (0.5 * rel2 + 4 * u) + u * den
    q = m / den
    eq = (em + np.abs(q) * eden) / np.maximum(den - eden, eps * (1 - 4 * u))
    step = (lr / bc1) * q
    estep = (lr / bc1) * (eq + np.abs(q) * (rel1 + 4 * u))
    decay = p * (1 - lr * wd)
    edecay = abs(1 - lr * wd) * ep + 4 * u * np.abs(p)
    return edecay + estep + u * (np.abs(decay) + np.abs(step) + np.abs(out)) + _tiny(node)


def _adam_inputs(node, graph):
    """``(g, m0, v0)`` when ``m``/``v`` of adamw_param are autodiff's ``b1 m0 + (1-b1) g`` and
    ``b2 v0 + (1-b2) g*g`` (parcomp/passes/autodiff.py), else None."""
    def scaled(name):
        n = graph[name] if name in graph else None
        return n.inputs[0] if n is not None and n.op == "scale" else None

    mn, vn = (graph[i] if i in graph else None for i in node.inputs[1:3])
    if mn is None or vn is None or mn.op != "add" or vn.op != "add":
        return None
    g, m0, v0, gg = scaled(mn.inputs[1]), scaled(mn.inputs[0]), scaled(vn.inputs[0]), scaled(vn.inputs[1])
    if None in (g, m0, v0, gg) or graph[gg].op != "mul" or graph[gg].inputs != (g, g):
        return None
    return g, m0, v0


def adamw_joint(node, graph, env, err, u):
    """AdamW's bound with the gradient's error followed through m and v together.

    The independent rule treats e_m and e_v as unrelated, but both come from one g and
    the update is nearly scale-invariant in it (step 1: lr g / (|g| + eps)); charging
    them separately makes a 20% error of g a 20% error of the update and, over a few
    steps, the bound explodes. Here the update is re-evaluated in float64 for g' on a
    grid over [g - e_g, g + e_g] (m0, v0 fixed), and the independent rule gets only the
    rest of m's and v's errors (their state's and roundings). Returns None (use the
    independent rule) when m and v are not autodiff's moving averages of one g.
    """
    found = _adam_inputs(node, graph)
    if found is None:
        return None
    g, m0, v0 = (np.asarray(env[k], np.float64) for k in found)
    eg = np.broadcast_to(err[found[0]], g.shape)
    p, m, v, t = (np.asarray(env[i], np.float64) for i in node.inputs)
    b1, b2 = float(node.attr("beta1")), float(node.attr("beta2"))

    def update(gp):
        return NUMPY_OPS["adamw_param"]([p, b1 * m0 + (1 - b1) * gp, b2 * v0 + (1 - b2) * gp * gp, t], node)

    u0 = update(g)
    vary = np.zeros_like(u0)
    for f in (-1.0, -0.5, 0.5, 1.0):
        vary = np.maximum(vary, np.abs(update(g + f * eg) - u0))
    em, ev = (np.broadcast_to(err[i], g.shape) for i in node.inputs[1:3])
    rest = [err[node.inputs[0]], np.maximum(em - (1 - b1) * eg, 0.0),
            np.maximum(ev - (1 - b2) * (2 * np.abs(g) * eg + eg * eg), 0.0), err[node.inputs[3]]]
    return vary + _adamw([p, m, v, t], rest, node, np.asarray(env[node.name], np.float64), u)


def _dense(vals, errs, node, out, u):
    """a @ w.T (+ b): the matmul rule on the transposed weight, then the bias addition."""
    (a, w), (ea, ew) = vals[:2], errs[:2]
    ewt = np.swapaxes(np.broadcast_to(ew, w.shape), -1, -2)
    e = _matmul([a, np.swapaxes(w, -1, -2)], [ea, ewt], node, out, u)
    return e + (errs[2] + u * np.abs(out) + _tiny(node) if len(vals) > 2 else 0.0)


def _addmm(vals, errs, node, out, u):
    """b + a @ w: the matmul rule, then the bias addition."""
    return _matmul(vals[1:], errs[1:], node, out, u) + errs[0] + u * np.abs(out) + _tiny(node)


def _matmul_t(vals, errs, node, out, u):
    return np.swapaxes(_matmul(vals, errs, node, np.swapaxes(out, -1, -2), u), -1, -2)


def _axpby(vals, errs, node, out, u):
    """a x + b y (add_scaled: a = 1): the scale rule on each term, then the addition
    (a fused multiply-add rounds less, so torch's ``add_(y, alpha=b)`` is covered)."""
    (x, y), (ex, ey) = vals, errs
    a, b = float(node.attr("a", 1.0)), float(node.attr("b"))
    return (abs(a) * ex + abs(b) * ey + 2 * u * (np.abs(a * x) + np.abs(b * y)) + u * np.abs(out)
            + 2 * _tiny(node))


def _mse_parts(y, t, ey, et, u):
    d = y - t
    return d, ey + et + u * np.abs(d)


def _mse_sum(vals, errs, node, out, u):
    """sum (y - t)^2: per element 2|d| e_d + e_d^2 + u d^2, summed with gamma_{k-1} sum d^2."""
    d, ed = _mse_parts(*vals, *errs, u)
    k = d.size
    return (np.sum(2 * np.abs(d) * ed + ed * ed + u * d * d) + gamma(max(k - 1, 0), u) * np.sum(d * d)
            + (k + 1) * _tiny(node))


def _mse_grad(vals, errs, node, out, u):
    """2 dl (y - t): the product rule on 2 dl (exact doubling) and d = y - t."""
    dl, y, t = vals
    edl, ey, et = errs
    d, ed = _mse_parts(y, t, ey, et, u)
    return 2 * (np.abs(dl) * ed + edl * np.abs(d) + edl * ed) + u * np.abs(out) + _tiny(node)


ERROR_RULES = {
    **{op: _pointwise for op in _DERIV},
    **{op: _pointwise_grad for op in _GRAD_ROUND},
    "add_scalar": _add_scalar,
    "neg": lambda vals, errs, node, out, u: np.broadcast_to(errs[0], np.shape(out)).astype(np.float64),
    "scale": _scale,
    "add": _add,
    "sub": _add,
    "mul": _mul,
    "div": _div,
    "matmul": _matmul,
    "permute": _move,
    "reshape": _move,
    "expand": _move,
    "relayout": _move,
    "sum": _sum,
    "ones": lambda vals, errs, node, out, u: np.zeros(np.shape(out)),
    "cross_entropy": _cross_entropy,
    "cross_entropy_grad": _cross_entropy_grad,
    "adamw_param": _adamw,
    "dense": _dense,
    "addmm": _addmm,
    "matmul_t": _matmul_t,
    "add_scaled": _axpby,
    "axpby": _axpby,
    "mse_sum": _mse_sum,
    "mse_grad": _mse_grad,
    "wait": _move,
    **NORM_ERROR_RULES,  # norms + embedding part (issue 17): parcomp/rules/norms.py
    **REDUCE_ERROR_RULES,  # reductions part (issue 17): parcomp/rules/reductions.py
}
"""op -> rule ``(vals, errs, node, out, u) -> err`` for every op of :data:`parcomp.ir.ops.OPS`
that computes (sources and collectives are handled by :mod:`parcomp.tolerance`)."""

# ---- attention part (issue 17): views, sdpa, RoPE pointwise ops ----
from .attention import ATTENTION_ERRORS, cat_err  # noqa: E402

ERROR_RULES.update({"slice": _move, "slice_grad": _move, "cat": cat_err, **ATTENTION_ERRORS})
ERROR_RULES["pad"] = lambda vals, errs, node, out, u: _pad_err(errs[0], vals[0], node)  # loss part


def _pad_err(err, x, node):
    """``pad`` (loss part, issue 17): x's error moves with it; the fill is exact (error 0)."""
    from ..reference.numpy_attn import pad_array

    return pad_array(np.broadcast_to(err, np.shape(x)).astype(np.float64), node, value=0.0)


# ---- end of the attention part ----
from .clip_bounds import CLIP_ERROR_RULES  # noqa: E402  training options (issue 13)

ERROR_RULES.update(CLIP_ERROR_RULES)

GRAPH_RULES = {"adamw_param": adamw_joint}
"""op -> rule ``(node, graph, values, errors, u) -> err or None`` that may look at the
operands' producers (None: use :data:`ERROR_RULES`); applied on global graphs."""
from .moe import MOE_ERROR_RULES  # noqa: E402  expert parallel MoE (issue 14)

ERROR_RULES.update(MOE_ERROR_RULES)
