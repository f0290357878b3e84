"""numpy semantics of the attention part's ops: views, RoPE pointwise ops, sdpa.

Merged into :data:`parcomp.reference.numpy_ops.NUMPY_OPS`; same calling convention
(operand arrays, node). The attention ops compute in the operands' dtype, as torch does.
"""
from __future__ import annotations

import numpy as np

from .cp_ops import causal_keep
from .cp_ring import storage_order


def slice_index(node, rank: int) -> tuple:
    """The numpy index of ``slice``/``slice_grad`` ``node`` for a rank-``rank`` array."""
    idx = [slice(None)] * rank
    idx[node.attr("dim")] = slice(node.attr("start"), node.attr("stop"), node.attr("step", 1))
    return tuple(idx)


def _slice_grad(g, node):
    out = np.zeros(node.type.shape, g.dtype)
    out[slice_index(node, g.ndim)] = g
    return out


def pad_array(x, node, value=None):
    """``pad`` (loss part): ``x`` with ``before``/``after`` copies of ``value`` (default:
    the node's) on ``dim``, in ``x``'s dtype (an int64 label pad stays int64)."""
    widths = [(0, 0)] * np.ndim(x)
    widths[node.attr("dim")] = (node.attr("before"), node.attr("after"))
    return np.pad(x, widths, constant_values=np.asarray(
        node.attr("value") if value is None else value).astype(np.asarray(x).dtype))


def attention_probs(q, k, node):
    """softmax(scale q k^T) over the last dim, causal (top-left aligned: key j <= query i)
    entries kept when ``causal``; [..., Sq, Sk] in q's dtype. Query row i is global row
    ``q_start + i`` (a context-parallel rank's block of q; 0 by default)."""
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * q.dtype.type(node.attr("scale"))
    if node.attr("causal", False):
        sq, sk = s.shape[-2:]
        s = np.where(causal_keep(node, sq, sk), s, -np.inf)  # context parallel: cp_ops
    s = s - np.max(s, axis=-1, keepdims=True)
    p = np.exp(s)
    return (p / np.sum(p, axis=-1, keepdims=True)).astype(q.dtype)


def _sdpa(q, k, v, node):
    return np.matmul(attention_probs(q, k, node), v).astype(q.dtype)


def sdpa_grads(dy, q, k, v, node) -> dict:
    """{"q": dq, "k": dk, "v": dv} of sdpa at (q, k, v) for output gradient dy."""
    p = attention_probs(q, k, node)
    dp = np.matmul(dy, np.swapaxes(v, -1, -2))
    ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
    c = q.dtype.type(node.attr("scale"))
    return {"q": np.matmul(ds, k) * c, "k": np.matmul(np.swapaxes(ds, -1, -2), q) * c,
            "v": np.matmul(np.swapaxes(p, -1, -2), dy)}


def _arange(node):
    n, (start, step) = node.type.shape[0], (node.attr("start", 0), node.attr("step", 1))
    x = (start + step * np.arange(n, dtype=np.float64)).astype(node.type.dtype)
    return x[storage_order(node.attr("balanced"), n)] if node.attr("storage") else x


def source_array(node, x):
    """A feed ``x`` for source ``node`` as the graph holds it: a fused view param's stored
    tensor reshaped to the view (the global shape on a local program), its head units
    reordered first when it has a ``stored_order`` (:func:`stored_to_view`)."""
    x = np.asarray(x)
    if node.attr("part_of_shape") and tuple(x.shape) == tuple(node.attr("part_of_shape")):
        a, b = node.attr("part_rows")  # a multi-query part param: its rows of the stored tensor
        return x[a:b]
    if node.attr("stored_shape") and tuple(x.shape) == tuple(node.attr("stored_shape")):
        return stored_to_view(x, node.attr("global_shape") or node.type.shape, node.attr("stored_order"))
    return x


def fused_dim(stored, view) -> int:
    """The dim of the stored shape a fused view cuts into parts: the first that differs."""
    return next(d for d in range(len(stored)) if d >= len(view) or view[d] != stored[d])


def stored_to_view(x, view, order=None):
    """A fused weight's stored tensor ``x`` as its view of shape ``view``: with ``order``
    (grouped q|k|v, parcomp/passes/fused_weights.py), the fused dim cut into ``len(order)``
    equal units (heads) taken in that order first, then reshaped; else :func:`to_shape`."""
    if not order:
        return to_shape(x, view)
    a = fused_dim(x.shape, view)
    units = x.reshape(x.shape[:a] + (len(order), -1) + x.shape[a + 1:])
    return np.take(units, list(order), axis=a).reshape(view)


def view_to_stored(x, stored, order=None):
    """The inverse of :func:`stored_to_view` for a view ``x`` of the same size: the stored
    tensor of shape ``stored``."""
    stored = tuple(stored)
    if not order:
        return x.reshape(stored)
    a = fused_dim(stored, x.shape)
    units = x.reshape(stored[:a] + (len(order), -1) + stored[a + 1:])
    return np.take(units, list(np.argsort(order)), axis=a).reshape(stored)


def to_shape(x, shape):
    """``x`` reshaped to ``shape`` (a fused view), or padded with zeros at the end of each dim
    (a padded vocab table, parcomp/passes/vocab_pad.py) when ``shape`` has more elements."""
    if x.size == int(np.prod(shape)):
        return x.reshape(shape)
    return np.pad(x, [(0, s - n) for n, s in zip(x.shape, shape)])


NUMPY_ATTN = {
    "slice": lambda a, n: np.ascontiguousarray(a[0][slice_index(n, a[0].ndim)]),
    "slice_grad": lambda a, n: _slice_grad(a[0], n),
    "cat": lambda a, n: np.concatenate(a, axis=n.attr("dim")),
    "pad": lambda a, n: pad_array(a[0], n),
    "sdpa": lambda a, n: _sdpa(*a, n),
    "sdpa_grad": lambda a, n: sdpa_grads(*a, n)[n.attr("wrt")].astype(a[0].dtype),
    "cos": lambda a, n: np.cos(a[0]),
    "sin": lambda a, n: np.sin(a[0]),
    "cast": lambda a, n: a[0].astype(n.type.dtype),
    "arange": lambda a, n: _arange(n),
}
