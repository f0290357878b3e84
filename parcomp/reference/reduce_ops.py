"""numpy semantics of the reductions part; merged into
:data:`parcomp.reference.numpy_ops.NUMPY_OPS`.

``amax`` / ``argmax`` / ``mean`` / ``log`` / ``softmax`` / ``log_softmax`` as torch computes
them, the pieces their split-dim decompositions use (``argmax_key`` / ``argmax_index``,
``pick`` / ``pick_grad``, ``label_mask``, ``mask_pad``) and ``amax_grad``.

Ops that look at a *global* index along a dim (``RANKED_OPS``) carry ``index_start``: the
global index of this rank's first element along that dim (0 unsharded). The interpreter
sets it per rank with :func:`at_rank`; program.py computes it from the rank's coordinates.
"""
from __future__ import annotations

import numpy as np

from ..ir.ops import RANKED_OPS, index_dim
from ..ir.types import TensorType, shard_offsets

_LOW = (1 << 32) - 1  # argmax keys: the low 32 bits hold LOW - global index


def _dims(node, x):
    return tuple(d % max(x.ndim, 1) for d in node.attr("dims"))


def _softmax(x, dim):
    z = x - np.max(x, axis=dim, keepdims=True)
    e = np.exp(z)
    return (e / np.sum(e, axis=dim, keepdims=True)).astype(x.dtype)


def _log_softmax(x, dim):
    z = x - np.max(x, axis=dim, keepdims=True)
    return (z - np.log(np.sum(np.exp(z), axis=dim, keepdims=True))).astype(x.dtype)


def _amax_grad(g, x, y, node):
    """torch's amax backward: the gradient split evenly over the elements equal to the max."""
    dims = _dims(node, x)
    hit = (x == np.expand_dims(y, dims)).astype(x.dtype)
    count = np.sum(hit, axis=dims, keepdims=True)
    return (np.expand_dims(g, dims) * hit / count).astype(x.dtype)


def orderable(x) -> np.ndarray:
    """float -> int64 whose order is the float order (float32 bits; NaN above +inf, as
    torch.argmax treats NaN as the largest). Exact for float32/float16 values."""
    bits = np.asarray(x, np.float32).view(np.int32).astype(np.int64)
    return np.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def _argmax_key(x, node):
    """max over ``dim`` of (orderable(x) << 32) + (LOW - global index): the max value and,
    among equal maxima, the first global index, in one int64 (a max-reducible key)."""
    dim = node.attr("dim") % x.ndim
    idx = np.arange(x.shape[dim], dtype=np.int64) + int(node.attr("index_start", 0))
    idx = idx.reshape([-1 if d == dim else 1 for d in range(x.ndim)])
    return np.max((orderable(x) << 32) + (_LOW - idx), axis=dim)


def _pick_index(labels, node, classes):
    """(local column of each label, whether this rank holds it and it is not ignored)."""
    lab = np.asarray(labels, np.int64)
    local = lab - int(node.attr("index_start", 0))
    mine = (local >= 0) & (local < classes) & (lab != int(node.attr("ignore_index", -100)))
    return np.where(mine, local, 0), mine


def _pick(z, labels, node):
    """z[..., label] where this rank holds column ``label`` (and it is not ignored), else 0."""
    col, mine = _pick_index(labels, node, z.shape[-1])
    got = np.take_along_axis(z, col[..., None], axis=-1)[..., 0]
    return np.where(mine, got, 0).astype(z.dtype)


def _pick_grad(g, labels, node):
    """g scattered to column ``label`` of a zero tensor of the node's (local) type."""
    out = np.zeros(node.type.shape, g.dtype)
    col, mine = _pick_index(labels, node, node.type.shape[-1])
    np.put_along_axis(out, col[..., None], np.where(mine, g, 0)[..., None].astype(g.dtype), axis=-1)
    return out


def _mask_pad(x, node):
    """Entries at global index >= ``size`` along the last dim set to ``fill``: the dtype's most
    negative finite number ("lowest") or 0."""
    idx = np.arange(x.shape[-1]) + int(node.attr("index_start", 0))
    fill = np.finfo(x.dtype).min if node.attr("fill", "lowest") == "lowest" else 0.0
    return np.where(idx >= int(node.attr("size")), x.dtype.type(fill), x)


def topk_order(x, k: int, dim: int) -> np.ndarray:
    """int64 indices of the ``k`` largest of ``x`` along ``dim``, largest first; equal values
    in index order (the lower index first); NaN above every number, as torch.topk ranks it."""
    x = np.asarray(x)
    key = np.where(np.isnan(x), np.inf, x) if x.dtype.kind == "f" else x
    order = np.argsort(-key if x.dtype.kind == "f" else -key.astype(np.int64), axis=dim, kind="stable")
    if x.dtype.kind == "f":  # NaN first (stable: in index order), then the numbers
        nan = np.take_along_axis(np.isnan(x), order, axis=dim)
        order = np.take_along_axis(order, np.argsort(~nan, axis=dim, kind="stable"), axis=dim)
    return np.take(order, np.arange(k), axis=dim).astype(np.int64)


def _log(x):
    """np.log, log(0) = -inf without a warning (a 0/1 mask's log is a fill of -inf on purpose)."""
    with np.errstate(divide="ignore"):
        return np.log(x)


def _put_along(g, idx, node):
    dim = node.attr("dim") % g.ndim
    shape = list(g.shape)
    shape[dim] = int(node.attr("size"))
    out = np.zeros(shape, g.dtype)
    for j in range(idx.shape[dim]):  # duplicate indices add up (scatter_add)
        sel = [slice(None)] * g.ndim
        sel[dim] = slice(j, j + 1)
        sl = tuple(sel)
        np.put_along_axis(out, idx[sl], np.take_along_axis(out, idx[sl], axis=dim) + g[sl], axis=dim)
    return out


REDUCE_NUMPY_OPS = {
    "log": lambda a, n: _log(a[0]),
    "amax": lambda a, n: np.max(a[0], axis=_dims(n, a[0])) if n.attr("dims") else a[0].copy(),
    "amax_grad": lambda a, n: _amax_grad(a[0], a[1], a[2], n),
    "argmax": lambda a, n: np.argmax(a[0], axis=n.attr("dim") % a[0].ndim).astype(np.int64),
    "argmax_key": lambda a, n: _argmax_key(a[0], n),
    "argmax_index": lambda a, n: (_LOW - (np.asarray(a[0], np.int64) & _LOW)).astype(np.int64),
    "mean": lambda a, n: np.mean(a[0], axis=_dims(n, a[0])).astype(a[0].dtype),
    "softmax": lambda a, n: _softmax(a[0], n.attr("dim")),
    "log_softmax": lambda a, n: _log_softmax(a[0], n.attr("dim")),
    "pick": lambda a, n: _pick(a[0], a[1], n),
    "pick_grad": lambda a, n: _pick_grad(a[0], a[1], n),
    "label_mask": lambda a, n: (np.asarray(a[0]) != int(n.attr("ignore_index", -100))).astype(n.type.dtype),
    "mask_pad": lambda a, n: _mask_pad(a[0], n),
    "topk": lambda a, n: np.take_along_axis(a[0], topk_order(a[0], n.attr("k"), n.attr("dim") % a[0].ndim),
                                            axis=n.attr("dim") % a[0].ndim),
    "topk_index": lambda a, n: topk_order(a[0], n.attr("k"), n.attr("dim") % a[0].ndim),
    "take_along": lambda a, n: np.take_along_axis(a[0], np.asarray(a[1], np.int64),
                                                  axis=n.attr("dim") % a[0].ndim),
    "put_along": lambda a, n: _put_along(a[0], np.asarray(a[1], np.int64), n),
}


def _global(ty, layout, mesh) -> TensorType:
    shape = list(ty.shape)
    for a, p in enumerate(layout or ()):
        if hasattr(p, "dim"):
            shape[p.dim] *= mesh.sizes[a]
    return TensorType(tuple(shape), ty.dtype)


def at_rank(program, node, rank: int):
    """``node`` of local ``program`` with ``index_start`` for mesh rank ``rank`` (other ops,
    and programs without layouts, come back unchanged)."""
    if node.op not in RANKED_OPS or program.mesh is None or node.layout is None:
        return node
    ty, layout, d = index_dim(program, node)
    gty = _global(ty, layout, program.mesh)
    start = shard_offsets(gty, layout, program.mesh, program.mesh.coords(rank))[d][0]
    return node.with_attrs(index_start=int(start))
