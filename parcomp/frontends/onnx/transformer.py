"""ONNX lowerings of the transformer op set, onto the IR ops the torch.export
frontend uses for transformers (:mod:`parcomp.frontends.torch.attention`, :mod:`parcomp.frontends.torch.norms`).

Added to :data:`parcomp.frontends.onnx.ops.TABLE` (same ``lower(b, node) -> [result, ...]``
contract; ``b`` is the importer's builder):

- ``Gather`` of a 2-D table by computed integer ids (axis 0), or of a 2-D weight by constant
  ids (position ids) -> ``embedding``; of a computed value at constant indices -> one
  ``slice`` per run of consecutive indices (+ ``cat``, + ``reshape`` to the indices' shape);
- ``LayerNormalization`` / ``RMSNormalization`` -> ``layer_norm`` / ``rms_norm`` (over
  ``axis`` and the dims after it: flattened into one by ``reshape``); ``Softmax`` /
  ``LogSoftmax`` -> ``softmax`` / ``log_softmax``;
  ``ReduceMean`` / ``ReduceSum`` / ``ReduceMax`` -> ``mean`` / ``sum`` / ``amax`` (+ ``reshape``
  for ``keepdims``; RMSNorm written out with them becomes one ``rms_norm``:
  :mod:`.norms`);
- views: ``Slice`` (constant starts/ends/axes/steps, steps >= 1) -> ``slice``; ``Split``,
  ``SplitToSequence`` (+ ``SequenceAt``) -> one ``slice`` per part; ``Concat`` -> ``cat``;
  ``Expand`` -> ``reshape`` + ``expand``;
- ``Cos``, ``Sin``; ``Cast`` between dtypes -> ``cast``; ``Where`` with a constant condition
  that is all true or all false -> that branch.

A constant the importer folded (``Range``, ``Shape`` arithmetic...) that a computed node
reads is rebuilt as IR ops when it is an ``arange`` broadcast along one axis (position
ids, as GPT-2 and Llama compute them): ``arange`` + ``reshape`` + ``expand``
(:func:`materialize`); any other constant tensor operand is a located error.  Attention
(the exporters' decomposed ``scaled_dot_product_attention``) is found by
:mod:`.attention`.
"""
from __future__ import annotations

import math

import numpy as np

from parcomp.ir.types import TensorType
from .ops import TABLE, require_float, need_static, reshape_to, unary, dtype_of


def _axis(b, n, rank: int, default: int = 0) -> int:
    a = int(n.attrs.get("axis", default))
    if not -rank <= a < rank:
        raise b.fail(f"axis {a} is out of range for rank {rank}")
    return a % rank


def slice_of(b, x: str, dim: int, start, stop, step: int = 1, suffix: str = "") -> str:
    """``x[start:stop:step]`` along ``dim`` (Python slice clamping), or ``x`` when whole."""
    size = b.type(x).shape[dim]
    lo, hi, st = slice(int(start), int(stop), int(step)).indices(size)
    hi = max(hi, lo)
    if (lo, hi, st) == (0, size, 1):
        return x
    return b.emit("slice", [x], suffix, dim=dim, start=lo, stop=hi, step=st)


def expand_to(b, x: str, shape, suffix: str = "") -> str:
    """``x`` broadcast to ``shape``: drop the size-1 dims it widens (``reshape``), then
    insert them at full size (``expand``)."""
    shape, src, dtype = tuple(int(s) for s in shape), b.type(x).shape, b.type(x).dtype
    lead = len(shape) - len(src)
    new = tuple(d for d in range(len(shape)) if d < lead or (src[d - lead] == 1 and shape[d] != 1))
    kept = tuple(shape[d] for d in range(len(shape)) if d not in new)
    if kept != b.type(x).shape:
        x = b.emit("reshape", [x], suffix + "_squeeze", ty=TensorType(kept, dtype))
    if not new:
        return x
    return b.emit("expand", [x], suffix, ty=TensorType(shape, dtype), dims=new)


def _arange_axis(c: np.ndarray):
    """``(axis, start, step)`` when ``c`` (rank >= 1) is ``start + step * i`` along one axis
    and constant along the others, else None."""
    if c.ndim == 0 or c.size < 1 or c.dtype.kind not in "iuf":
        return None
    for d in range(c.ndim):
        line = np.moveaxis(c, d, 0).reshape(c.shape[d], -1)[:, 0]
        start = line[0]
        step = line[1] - line[0] if c.shape[d] > 1 else 1
        want = start + step * np.arange(c.shape[d], dtype=np.float64)
        shape = [1] * c.ndim
        shape[d] = c.shape[d]
        if np.array_equal(np.broadcast_to(want.reshape(shape), c.shape), c.astype(np.float64)):
            return d, start.item(), step.item()
    return None


def materialize(b, name: str, c: np.ndarray) -> str | None:
    """IR ops computing the constant ``c`` (ONNX value ``name``) when it is an arange
    broadcast along one axis (:func:`_arange_axis`), else None."""
    found = _arange_axis(c)
    if found is None:
        return None
    d, start, step = found
    dtype = "int64" if c.dtype.kind in "iu" else str(c.dtype)
    if dtype not in ("int64", "float32", "float64", "float16"):
        return None
    r = b.emit("arange", [], "_arange", ty=TensorType((c.shape[d],), dtype), start=start, step=step)
    r = reshape_to(b, r, tuple(s for i, s in enumerate(c.shape) if i == d or s == 1))
    wide = tuple(i for i, s in enumerate(c.shape) if i != d and s != 1)
    if not wide:
        return r
    return b.emit("expand", [r], "_expand", ty=TensorType(c.shape, dtype), dims=wide)


# ---- lowerings ----

def _gather(b, n):
    """An embedding lookup (computed ids, or constant ids of a weight: position ids), else a
    slice of the value at a constant index or contiguous range."""
    data, idx = n.inputs[:2]
    k, v = b.static(idx), b.value(data)
    rank = b.type(v).rank
    axis = _axis(b, n, rank)
    if k is None or (data in b.inits and axis == 0 and rank == 2 and k.ndim >= 1 and _arange_axis(k)):
        if axis != 0 or rank != 2:
            raise b.fail(f"Gather along axis {axis} of a rank-{rank} value by computed indices: "
                         f"parcomp lowers Gather to an embedding (axis 0 of a 2-D table)")
        return [b.emit("embedding", [b.value(idx), v])]
    shape = b.type(v).shape
    flat = [int(i) % shape[axis] for i in k.reshape(-1)] if shape[axis] else []
    runs = []  # [start, stop) runs of consecutive indices, one slice each
    for i in flat:
        if runs and runs[-1][1] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, i + 1])
    parts = [slice_of(b, v, axis, lo, hi, 1, f"_{j}") for j, (lo, hi) in enumerate(runs)]
    if not parts:
        raise b.fail("Gather with no indices")
    r = parts[0] if len(parts) == 1 else b.emit("cat", parts, "_cat", dim=axis)
    return [reshape_to(b, r, shape[:axis] + tuple(k.shape) + shape[axis + 1:])]


def _layer_norm(op: str):
    """Normalise over ``axis`` and every later dim: those dims are flattened into one
    (``reshape``), normalised as the last, and the result reshaped back."""
    def lower(b, n):
        x = require_float(b, b.value(n.inputs[0]), n.op)
        shape = b.type(x).shape
        axis = _axis(b, n, len(shape), -1)
        tail = shape[axis:]
        flat = (math.prod(tail),)
        affine = []
        for i in n.inputs[1:3]:
            if not i:
                continue
            w = b.value(i)
            if b.type(w).shape != tail:
                raise b.fail(f"{n.op}'s scale/bias {b.type(w)} must have shape {list(tail)} (no broadcasting)")
            affine.append(reshape_to(b, w, flat))
        y = b.emit(op, [reshape_to(b, x, shape[:axis] + flat), *affine], "_norm" if len(tail) != 1 else "",
                   eps=float(n.attrs.get("epsilon", 1e-5)))
        return [reshape_to(b, y, shape)]
    return lower


def _softmax(op: str):
    def lower(b, n):
        x = require_float(b, b.value(n.inputs[0]), n.op)
        return [b.emit(op, [x], dim=_axis(b, n, b.type(x).rank, -1))]
    return lower


def _reduce(op: str):
    """ReduceMean/Sum/Max: axes from the second input (opset 18) or the attribute."""
    def lower(b, n):
        x = require_float(b, b.value(n.inputs[0]), n.op)
        rank = b.type(x).rank
        axes = (need_static(b, n.inputs[1], "the axes").reshape(-1) if len(n.inputs) > 1 and n.inputs[1]
                else n.attrs.get("axes"))
        if axes is None or not len(axes):
            if n.attrs.get("noop_with_empty_axes", 0):
                return [x]
            axes = range(rank)
        dims = tuple(sorted({int(a) % rank for a in axes}))
        if op != "sum" and any(b.type(x).shape[d] == 0 for d in dims):
            raise b.fail(f"{n.op} over an empty axis of {b.type(x)}: no value to reduce")
        r = b.emit(op, [x], "_reduce" if n.attrs.get("keepdims", 1) else "", dims=dims)
        if n.attrs.get("keepdims", 1):
            r = reshape_to(b, r, [1 if d in dims else s for d, s in enumerate(b.type(x).shape)])
        return [r]
    return lower


def _slice(b, n):
    x = b.value(n.inputs[0])
    rank = b.type(x).rank
    arg = lambda i: (need_static(b, n.inputs[i], "Slice's operand").reshape(-1)  # noqa: E731
                     if len(n.inputs) > i and n.inputs[i] else None)
    starts, ends, axes, steps = arg(1), arg(2), arg(3), arg(4)
    axes = range(len(starts)) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    for s, e, a, st in zip(starts, ends, axes, steps):
        if int(st) < 1:
            raise b.fail(f"Slice with step {int(st)}: parcomp slices forwards only (step >= 1)")
        x = slice_of(b, x, int(a) % rank, max(min(int(s), 2 ** 62), -2 ** 62),
                     max(min(int(e), 2 ** 62), -2 ** 62), int(st), f"_{int(a) % rank}")
    return [x]


def _parts(b, x: str, dim: int, sizes) -> list:
    out, off = [], 0
    if sum(sizes) != b.type(x).shape[dim]:
        raise b.fail(f"split sizes {list(sizes)} do not add up to {b.type(x).shape[dim]}")
    for i, s in enumerate(sizes):
        out.append(slice_of(b, x, dim, off, off + int(s), 1, f"_{i}"))
        off += int(s)
    return out


def _split(b, n):
    x = b.value(n.inputs[0])
    dim = _axis(b, n, b.type(x).rank)
    size = b.type(x).shape[dim]
    if len(n.inputs) > 1 and n.inputs[1]:
        sizes = [int(s) for s in need_static(b, n.inputs[1], "the split sizes").reshape(-1)]
    else:
        k = int(n.attrs.get("num_outputs", len(n.outputs)))
        step = -(-size // k)
        sizes = [min(step, size - o) for o in range(0, size, step)]
    return _parts(b, x, dim, sizes)


def _split_to_sequence(b, n):
    """A sequence is a tuple of IR values (only ``SequenceAt`` with a constant index reads it)."""
    x = b.value(n.inputs[0])
    dim = _axis(b, n, b.type(x).rank)
    size = b.type(x).shape[dim]
    split = need_static(b, n.inputs[1], "the split") if len(n.inputs) > 1 and n.inputs[1] else None
    if split is None:
        parts = _parts(b, x, dim, [1] * size)
        if not n.attrs.get("keepdims", 1):
            shape = b.type(x).shape
            parts = [reshape_to(b, p, shape[:dim] + shape[dim + 1:]) for p in parts]
        return [tuple(parts)]
    if split.ndim == 0:
        step = int(split)
        return [tuple(_parts(b, x, dim, [min(step, size - o) for o in range(0, size, step)]))]
    return [tuple(_parts(b, x, dim, [int(s) for s in split]))]


def _sequence_at(b, n):
    seq = b.env.get(n.inputs[0])
    if not isinstance(seq, tuple):
        raise b.fail(f"{n.inputs[0]!r} is not a sequence parcomp made (only SplitToSequence's are read)")
    i = int(need_static(b, n.inputs[1], "the position"))
    return [seq[i]]


def _concat(b, n):
    xs = [b.value(i) for i in n.inputs]
    xs = [x for x in xs if b.type(x).numel or len(xs) == 1]
    if len(xs) == 1:
        return xs
    return [b.emit("cat", xs, dim=_axis(b, n, b.type(xs[0]).rank))]


def _expand(b, n):
    x = b.value(n.inputs[0])
    want = b.onnx_type(n.outputs[0]).shape if b.types_onnx.get(n.outputs[0]) is not None else \
        tuple(np.broadcast_shapes(b.type(x).shape, tuple(need_static(b, n.inputs[1], "the shape"))))
    return [expand_to(b, x, want)]


def _cast(b, n):
    v = b.value(n.inputs[0])
    to = dtype_of(n.attrs["to"])
    if to == b.type(v).dtype:
        return [v]
    return [b.emit("cast", [v], ty=TensorType(b.type(v).shape, to))]


def _where(b, n):
    cond = b.static(n.inputs[0])
    if cond is None or not (cond.all() or not cond.any()):
        raise b.fail("Where with a condition computed at run time or mixing true and false: parcomp "
                     "has no select op (a causal attention mask is recognised as part of attention)")
    pick = n.inputs[1] if cond.all() else n.inputs[2]
    c = b.static(pick)
    out = b.onnx_type(n.outputs[0]).shape
    if c is not None:
        return [np.broadcast_to(c, out).copy()]
    return [expand_to(b, b.value(pick), out)]


TRANSFORMER_TABLE = {
    "Gather": _gather,
    "LayerNormalization": _layer_norm("layer_norm"), "RMSNormalization": _layer_norm("rms_norm"),
    "Softmax": _softmax("softmax"), "LogSoftmax": _softmax("log_softmax"),
    "ReduceMean": _reduce("mean"), "ReduceSum": _reduce("sum"), "ReduceMax": _reduce("amax"),
    "Slice": _slice, "Split": _split, "SplitToSequence": _split_to_sequence,
    "SequenceAt": _sequence_at, "Concat": _concat, "Expand": _expand,
    "Cos": unary("cos"), "Sin": unary("sin"), "Cast": _cast, "Where": _where,
}
TABLE.update(TRANSFORMER_TABLE)
