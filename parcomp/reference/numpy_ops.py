"""numpy semantics of every compute op: the ground truth of the reference interpreter.

One entry per op of :data:`parcomp.ir.ops.OPS` that computes (sources and layout
changes are handled by the interpreter). Each takes the list of operand arrays
and the node (for attributes and the result type) and returns an array.
Modelled on the ONNX reference evaluator's one-function-per-op tables.
"""
from __future__ import annotations

import math

import ml_dtypes  # noqa: F401  registers numpy's bfloat16 (mixed precision)
import numpy as np

from .norm_ops import NORM_NUMPY_OPS
from .reduce_ops import REDUCE_NUMPY_OPS

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _gelu(x, node):
    if node.attr("approximate", "none") == "tanh":
        c = math.sqrt(2.0 / math.pi)
        return 0.5 * x * (1.0 + np.tanh(c * (x + 0.044715 * x ** 3)))
    return (0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))).astype(x.dtype)


def _sigmoid(x):
    """1 / (1 + exp(-x)) without overflow: exp of -|x| only (the same value in every dtype)."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(np.result_type(x, np.float32))


def _gelu_grad(dy, x, node):
    if node.attr("approximate", "none") == "tanh":
        c = math.sqrt(2.0 / math.pi)
        t = np.tanh(c * (x + 0.044715 * x ** 3))
        d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)
    else:
        cdf = 0.5 * (1.0 + _erf(x / math.sqrt(2.0)))
        d = cdf + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    return (dy * d).astype(dy.dtype)


def _silu_grad(dy, x):
    s = _sigmoid(x)
    return dy * (s + x * s * (1 - s))


def _log_softmax(z):
    z = z - np.max(z, axis=-1, keepdims=True)
    return z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))


def _ce_target(logits, labels, node):
    """torch's target distribution: (1 - eps) onehot + eps / C; zero rows for ignored labels."""
    eps, ignore = float(node.attr("label_smoothing", 0.0)), int(node.attr("ignore_index", -100))
    lab = np.asarray(labels, np.int64)
    keep = lab != ignore
    onehot = (np.arange(logits.shape[-1]) == np.where(keep, lab, -1)[..., None]).astype(np.float64)
    return ((1 - eps) * onehot + eps / logits.shape[-1]) * keep[..., None]


def _cross_entropy(logits, labels, node):
    """Per-token loss -sum_j target_j log_softmax_j (0 where the label is ignored)."""
    q = _ce_target(logits, labels, node)
    return (-np.sum(q * _log_softmax(logits), axis=-1)).astype(logits.dtype)


def _cross_entropy_grad(dl, logits, labels, node):
    q = _ce_target(logits, labels, node)
    keep = q.sum(axis=-1, keepdims=True) > 0
    p = np.exp(_log_softmax(logits)) * keep
    return (dl[..., None] * (p - q)).astype(logits.dtype)


def _adamw(p, m, v, t, node):
    """torch.optim.AdamW (decoupled weight decay), step number ``t`` counted from 1."""
    lr, b1, b2 = node.attr("lr"), node.attr("beta1"), node.attr("beta2")
    eps, wd = node.attr("eps"), node.attr("weight_decay")
    p = p * (1 - lr * wd)
    # bias corrections as Python floats, as torch.optim computes them: in double precision
    # whatever the dtype of the step counter (a float32 step made 1 - 0.999**t off by 1.3e-5)
    t = float(np.asarray(t))
    bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
    denom = np.sqrt(v) / math.sqrt(bc2) + eps
    return (p - (lr / bc1) * m / denom).astype(p.dtype)


NUMPY_OPS = {
    "relu": lambda a, n: np.maximum(a[0], 0).astype(a[0].dtype),
    "gelu": lambda a, n: _gelu(a[0], n).astype(a[0].dtype),
    "tanh": lambda a, n: np.tanh(a[0]),
    "exp": lambda a, n: np.exp(a[0]),
    "sigmoid": lambda a, n: _sigmoid(a[0]).astype(a[0].dtype),
    "silu": lambda a, n: (a[0] * _sigmoid(a[0])).astype(a[0].dtype),
    "pow": lambda a, n: np.power(a[0], a[0].dtype.type(n.attr("exponent"))),
    "add_scalar": lambda a, n: a[0] + a[0].dtype.type(n.attr("value")),
    "neg": lambda a, n: -a[0],
    "scale": lambda a, n: a[0] * a[0].dtype.type(n.attr("value")),
    "add": lambda a, n: a[0] + a[1],
    "sub": lambda a, n: a[0] - a[1],
    "mul": lambda a, n: a[0] * a[1],
    "div": lambda a, n: a[0] / a[1],
    "matmul": lambda a, n: np.matmul(a[0], a[1]),
    "permute": lambda a, n: np.ascontiguousarray(np.transpose(a[0], n.attr("perm"))),
    "reshape": lambda a, n: a[0].reshape(n.type.shape),
    "relayout": lambda a, n: a[0],  # layout only: the value is unchanged
    "sum": lambda a, n: np.sum(a[0], axis=tuple(n.attr("dims"))).astype(a[0].dtype),
    "expand": lambda a, n: np.ascontiguousarray(
        np.broadcast_to(np.expand_dims(a[0], tuple(n.attr("dims"))), n.type.shape)),
    "ones": lambda a, n: np.ones(n.type.shape, n.type.dtype),
    "relu_grad": lambda a, n: a[0] * (a[1] > 0).astype(a[0].dtype),
    "gelu_grad": lambda a, n: _gelu_grad(a[0], a[1], n),
    "tanh_grad": lambda a, n: a[0] * (1 - a[1] * a[1]),
    "sigmoid_grad": lambda a, n: a[0] * a[1] * (1 - a[1]),
    "silu_grad": lambda a, n: _silu_grad(a[0], a[1]).astype(a[0].dtype),
    "pow_grad": lambda a, n: (a[0] * n.attr("exponent") * np.power(
        a[1], a[1].dtype.type(n.attr("exponent") - 1))).astype(a[0].dtype),
    "cross_entropy": lambda a, n: _cross_entropy(a[0], a[1], n),
    "cross_entropy_grad": lambda a, n: _cross_entropy_grad(a[0], a[1], a[2], n),
    "adamw_param": lambda a, n: _adamw(a[0], a[1], a[2], a[3], n),
    # lowered ops (parcomp/passes/lowering/lower.py); ``inplace`` changes where torch writes, not the value
    "dense": lambda a, n: np.matmul(a[0], np.swapaxes(a[1], -1, -2)) + (a[2] if len(a) > 2 else 0),
    "addmm": lambda a, n: a[0] + np.matmul(a[1], a[2]),
    "matmul_t": lambda a, n: np.ascontiguousarray(np.swapaxes(np.matmul(a[0], a[1]), -1, -2)),
    "add_scaled": lambda a, n: a[0] + a[1] * a[1].dtype.type(n.attr("b")),
    "axpby": lambda a, n: a[0] * a[0].dtype.type(n.attr("a")) + a[1] * a[1].dtype.type(n.attr("b")),
    "mse_sum": lambda a, n: np.sum((a[0] - a[1]) * (a[0] - a[1])).astype(a[0].dtype),
    "mse_grad": lambda a, n: ((a[0] * a[0].dtype.type(2.0)) * (a[1] - a[2])).astype(a[1].dtype),
    "wait": lambda a, n: a[0],
    # norms + embedding part: layer_norm, rms_norm, dropout, embedding (+ grads)
    **NORM_NUMPY_OPS,
    **REDUCE_NUMPY_OPS,  # reductions part: parcomp/reference/reduce_ops.py
}

# ---- attention part: views, RoPE pointwise ops, sdpa ----
from .numpy_attn import NUMPY_ATTN, source_array  # noqa: E402

NUMPY_OPS.update(NUMPY_ATTN)
# ---- end of the attention part ----
from .train_ops import TRAIN_NUMPY_OPS  # noqa: E402  training options

NUMPY_OPS.update(TRAIN_NUMPY_OPS)
#: dtypes whose results numpy may widen (bfloat16 matmul gives float32): rounded to the declared
#: dtype after every op, as torch rounds a bf16/fp16 kernel's float32 accumulation
LOW_DTYPES = ("bfloat16", "float16")


def _declared(f):
    def op(a, n):
        out = f(a, n)
        dt = n.type.dtype
        if dt in LOW_DTYPES and np.asarray(out).dtype != np.dtype(dt):
            return np.asarray(out).astype(dt)
        return out
    return op


NUMPY_OPS.update({k: _declared(f) for k, f in NUMPY_OPS.items()})


def run_unsharded(graph, feeds: dict, overrides: dict | None = None, env: dict | None = None) -> dict:
    """Evaluate a global graph on one process: ``feeds`` maps input/param names to arrays.

    ``overrides``: ``{value name: array}`` taken as those values instead of computing them
    (the optimizer run on given gradients, parcomp/check/train_check.py). ``env``: a dict that
    receives every value computed. Returns ``{public output name: array}``. Raises KeyError
    naming a missing feed.

    MoE layers run dropless (parcomp/reference/moe_packed.py): ``env`` holds the values between
    a dispatch and its combine as the routed rows (``SlotRows``), or, where a statement on them
    is not covered, the whole graph is evaluated again on the dense slot buffers.
    """
    env = {} if env is None else env
    overrides = overrides or {}
    try:
        return _evaluate(graph, feeds, overrides, env)
    except moe_packed.NotPacked:
        env.clear()
        with moe_packed.DENSE:
            return _evaluate(graph, feeds, overrides, env)


def _evaluate(graph, feeds, overrides, env):
    for n in graph.nodes:
        if n.name in overrides:
            env[n.name] = overrides[n.name]
        elif n.op in ("input", "param"):
            if n.name not in feeds:
                raise KeyError(f"no value given for {n.op} {n.name!r}")
            env[n.name] = source_array(n, feeds[n.name])  # a fused weight's view
        else:
            env[n.name] = moe_packed.apply(NUMPY_OPS[n.op], n, [env[i] for i in n.inputs])
    out = {name: env[v] for name, v in graph.named_outputs()}
    if any(isinstance(v, moe_packed.SlotRows) for v in out.values()):
        raise moe_packed.NotPacked("slots as an output")
    return out


def rerun_with(graph, env: dict, overrides: dict) -> dict:
    """The outputs of ``graph`` had its values ``overrides`` been these arrays: ``env`` (every
    value of a :func:`run_unsharded` run, left unchanged) with only the values that depend on
    an overridden one computed again (the optimizer on other gradients: cheap)."""
    new, dirty = {**env, **overrides}, set(overrides)
    for n in graph.nodes:
        if n.name not in overrides and any(i in dirty for i in n.inputs):
            new[n.name] = moe_packed.apply(NUMPY_OPS[n.op], n, [new[i] for i in n.inputs])
            dirty.add(n.name)
    return {name: new[v] for name, v in graph.named_outputs()}
from . import moe_packed  # noqa: E402  dropless MoE: the routed rows only
from .moe_ops import MOE_NUMPY_OPS  # noqa: E402  expert parallel MoE

NUMPY_OPS.update(MOE_NUMPY_OPS)
