"""numpy semantics of the norms + embedding part: layer_norm, rms_norm, their
input gradients, dropout and embedding; merged into :data:`parcomp.reference.numpy_ops.NUMPY_OPS`.

Three ops read where this rank's block lies in the global tensor (:func:`at_rank` puts it
on the node, per rank, from the layouts): ``dropout`` (its mask hashes the seed, the training
step (its second operand, in a training step) and each element's *global* flat index, so every
sharding and the unsharded run draw the same mask, and each step a new one), ``embedding`` with a vocab-split table (rows ``vocab_start ...`` are this rank's;
other ids give zero rows, Megatron's VocabParallelEmbedding) and ``embedding_grad`` of a
vocab-split table gradient. Without those attributes an op computes the unsharded value.

The hash is integer arithmetic on int64 that never overflows (32-bit products split in
16-bit halves), so numpy and torch (``backends/torch/runtime/program_norms.py``) agree bit for bit.
"""
from __future__ import annotations

import numpy as np

from ..ir.types import TensorType, shard_offsets

M32 = 0xFFFFFFFF
RANKED_OPS = ("dropout", "embedding", "embedding_grad")


def _mul32(x, c: int):
    """(x * c) mod 2**32 for 0 <= x < 2**32, without int64 overflow."""
    return (((x & 0xFFFF) * c) + ((((x >> 16) * c) & 0xFFFF) << 16)) & M32


def _mix32(x):
    """A 32-bit integer finaliser (lowbias32): x in [0, 2**32) -> a well-mixed value there."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def index_hash(seed: int, index, step=None):
    """32-bit hash (int64 array) of ``seed``, the training step ``step`` (a whole number >= 0,
    or None: a forward program's one pass) and each global flat ``index`` (int64, >= 0)."""
    index = np.asarray(index, np.int64)
    h = np.int64(_mix32(np.int64(seed & M32)))
    if step is not None:
        h = np.int64(_mix32(h ^ np.int64(int(step) & M32)))
    h = _mix32(h ^ (index >> 32))
    return _mix32(h ^ (index & M32))


def drop_threshold(p: float) -> int:
    """Hashes below this are dropped: round(p * 2**32) (0: keep all)."""
    return int(round(float(p) * 2.0 ** 32))


def global_index(shape, start, global_shape):
    """Flat index in a ``global_shape`` tensor of every element of a block of ``shape``
    starting at ``start`` (int64 array of ``shape``)."""
    idx = np.zeros(tuple(shape), np.int64)
    stride = 1
    for d in reversed(range(len(shape))):
        r = (np.arange(shape[d], dtype=np.int64) + int(start[d])) * stride
        idx = idx + r.reshape((-1,) + (1,) * (len(shape) - d - 1))
        stride *= int(global_shape[d])
    return idx


def dropout_keep(node, shape, step=None) -> np.ndarray:
    """The keep mask (bool, ``shape``) of a dropout node on this rank's block at training step
    ``step`` (its second operand's value; None for a dropout without one)."""
    start = node.attr("index_start") or (0,) * len(shape)
    gshape = node.attr("index_shape") or tuple(shape)
    h = index_hash(int(node.attr("seed")), global_index(shape, start, gshape), step)
    return h >= drop_threshold(node.attr("p"))


def dropout_scale(p: float) -> float:
    """1 / (1 - p), 0 for p = 1 (every element dropped)."""
    return 0.0 if p >= 1 else 1.0 / (1.0 - float(p))


def _dropout(a, node):
    x, step = a[0], (int(np.asarray(a[1])) if len(a) > 1 else None)
    keep = dropout_keep(node, x.shape, step).astype(x.dtype)
    return x * (keep * x.dtype.type(dropout_scale(node.attr("p"))))


def _stats(x, eps, rms):
    """(normalised x, 1/sqrt(var + eps)) over the last dim, in x's dtype."""
    e = x.dtype.type(eps)
    if rms:
        rstd = 1 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + e)
        return x * rstd, rstd
    d = x - np.mean(x, axis=-1, keepdims=True)
    rstd = 1 / np.sqrt(np.mean(d * d, axis=-1, keepdims=True) + e)
    return d * rstd, rstd


def _norm(a, node):
    y, _ = _stats(a[0], node.attr("eps"), node.op == "rms_norm")
    if len(a) > 1:
        y = y * a[1]
    if len(a) > 2:
        y = y + a[2]
    return y.astype(a[0].dtype)


def _norm_grad(a, node):
    """dx of a norm: rstd (g - mean g - xhat mean(g xhat)), g = dy w (rms: no mean g term)."""
    dy, x = a[0], a[1]
    rms = node.op == "rms_norm_grad"
    xhat, rstd = _stats(x, node.attr("eps"), rms)
    g = dy * a[2] if len(a) > 2 else dy
    inner = g - xhat * np.mean(g * xhat, axis=-1, keepdims=True)
    if not rms:
        inner = inner - np.mean(g, axis=-1, keepdims=True)
    return (rstd * inner).astype(dy.dtype)


def _local_ids(ids, rows, node):
    local = np.asarray(ids, np.int64) - int(node.attr("vocab_start", 0))
    ok = (local >= 0) & (local < rows)
    return np.where(ok, local, 0), ok


def _embedding(a, node):
    ids, table = a
    local, ok = _local_ids(ids, table.shape[0], node)
    return np.where(ok[..., None], table[local], table.dtype.type(0))


def _embedding_grad(a, node):
    dy, ids = a
    local, ok = _local_ids(ids, node.type.shape[0], node)
    if node.attr("padding_idx") is not None:  # torch's padding row: no gradient from the lookup
        ok = ok & (np.asarray(ids) != node.attr("padding_idx"))
    out = np.zeros(node.type.shape, dy.dtype)
    np.add.at(out, local[ok], dy[ok])
    return out


NORM_NUMPY_OPS = {
    "layer_norm": _norm,
    "rms_norm": _norm,
    "layer_norm_grad": _norm_grad,
    "rms_norm_grad": _norm_grad,
    "dropout": _dropout,
    "embedding": _embedding,
    "embedding_grad": _embedding_grad,
    # lowered (parcomp/passes/lowering/bucket.py): one flat buffer for several gradients, and back
    "bucket_cat": lambda a, n: np.concatenate([np.reshape(x, -1) for x in a]),
    "bucket_part": lambda a, n: a[0][n.attr("offset"):n.attr("offset") + n.attr("numel")].reshape(n.type.shape),
}


def _global_type(ty, layout, mesh) -> TensorType:
    shape = list(ty.shape)
    for a, p in enumerate(layout or ()):
        if hasattr(p, "dim"):
            shape[p.dim] *= mesh.sizes[a]
    return TensorType(tuple(shape), ty.dtype)


def rank_attrs(node, in_types, in_layouts, out_layout, mesh, coords):
    """``node`` (of a local program, operand types ``in_types``) with the attributes saying
    where the block of the rank at mesh ``coords`` lies: ``index_start``/``index_shape`` for
    dropout (its output's block), ``vocab_start`` for an embedding whose table (operand 1)
    or an embedding_grad whose result is split along dim 0. Other nodes come back unchanged."""
    if node.op not in RANKED_OPS or mesh is None:
        return node
    if node.op == "dropout":
        gty = _global_type(node.type, out_layout, mesh)
        starts = tuple(s for s, _ in shard_offsets(gty, out_layout, mesh, coords))
        return node.with_attrs(index_start=starts, index_shape=gty.shape)
    ty, layout = (node.type, out_layout) if node.op == "embedding_grad" else (in_types[1], in_layouts[1])
    start = shard_offsets(_global_type(ty, layout, mesh), layout, mesh, coords)[0][0]
    return node.with_attrs(vocab_start=int(start))


def at_rank(program, node, rank: int):
    """:func:`rank_attrs` of ``node`` in local ``program`` for mesh rank ``rank``."""
    if node.op not in RANKED_OPS:
        return node
    ins = [program[i] for i in node.inputs]
    return rank_attrs(node, [i.type for i in ins], [i.layout for i in ins], node.layout,
                      program.mesh, program.mesh.coords(rank))
