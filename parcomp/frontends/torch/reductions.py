"""aten lowerings of the reductions part, merged into
:data:`parcomp.frontends.torch.export.TABLE`: ``amax``, ``argmax``, ``mean``, ``log``,
``softmax``, ``log_softmax`` (dims normalised to >= 0; ``keepdim`` becomes a reshape);
``topk`` (its values and indices: ``topk`` and ``topk_index``, picked by getitem),
``gather`` (``take_along``) and ``scatter_add`` into zeros (``put_along``).
"""
from __future__ import annotations

import torch

from parcomp.ir.types import TensorType

aten = torch.ops.aten


def _dims_of(b, x, dim) -> tuple:
    rank = b.types[x].rank
    dims = range(rank) if dim is None or (isinstance(dim, (list, tuple)) and not dim) else (
        dim if isinstance(dim, (list, tuple)) else [dim])
    return tuple(sorted(int(d) % max(rank, 1) for d in dims))


def _keepdim(b, n, y, keep):
    """A reduction with keepdim=True: its result reshaped to torch's (size-1 dims kept)."""
    return b.emit("reshape", [y], "_keepdim", ty=b.type_of(n)) if keep else y


def _reduction(op):
    def lower(b, n, a):
        x = b.val(a["self"])
        dims = _dims_of(b, x, a.get("dim"))
        if op == "argmax":
            if a.get("dim") is None:
                raise b.fail("argmax without dim (over the flattened tensor) is not supported; give dim")
            y = b.emit("argmax", [x], "_argmax" if a.get("keepdim") else "", dim=dims[0])
        else:
            y = b.emit(op, [x], "_" + op if a.get("keepdim") else "", dims=dims)
        return _keepdim(b, n, y, a.get("keepdim"))
    return lower


def _softmax_lowering(op):
    def lower(b, n, a):  # softmax(x, dim, dtype=...): x converted to dtype first, as torch does
        x = b.val(a["self"])
        want = b.type_of(n)
        if want.dtype != b.types[x].dtype:
            x = b.emit("cast", [x], "_in", ty=TensorType(b.types[x].shape, want.dtype))
        return b.emit(op, [x], dim=int(a["dim"]) % max(b.types[x].rank, 1))
    return lower


def _topk(b, n, a):
    """[values, indices]: ``topk`` and ``topk_index``. ``sorted=False`` gets the sorted order
    (torch leaves that order unspecified); ``largest=False`` is refused."""
    x = b.val(a["self"])
    if not a.get("largest", True):
        raise b.fail("topk(largest=False) is not supported",
                     "; write torch.topk(-x, k, dim) and negate its values")
    rank = max(b.types[x].rank, 1)
    dim, k = int(a.get("dim", -1)) % rank, int(a["k"])
    return [b.emit("topk", [x], "_values", k=k, dim=dim), b.emit("topk_index", [x], "_indices", k=k, dim=dim)]


def _gather(b, n, a):
    if a.get("sparse_grad"):
        raise b.fail("gather(sparse_grad=True) is not supported")
    x, idx = b.val(a["self"]), b.val(a["index"])
    return b.emit("take_along", [x, idx], dim=int(a["dim"]) % max(b.types[x].rank, 1))


ZERO_ALLOCATIONS = (aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default)


def _scatter_add(b, n, a):
    """scatter_add into a fresh zero tensor (zeros / zeros_like / new_zeros): ``put_along``."""
    base = a["self"]
    if not (isinstance(base, torch.fx.Node) and base.target in ZERO_ALLOCATIONS):
        raise b.fail("scatter_add is supported into a fresh zero tensor only (torch.zeros, zeros_like, "
                     "new_zeros)", "; add the tensor it scatters into after: x + torch.zeros(...).scatter_add(...)")
    g, idx = b.val(a["src"]), b.val(a["index"])
    dim = int(a["dim"]) % max(b.types[g].rank, 1)
    want = b.type_of(n)
    if b.types[idx].shape != b.types[g].shape:
        raise b.fail("scatter_add with an index smaller than src is not supported; slice src to the index's shape")
    return b.emit("put_along", [g, idx], dim=dim, size=want.shape[dim])


REDUCTION_TABLE = {
    aten.topk.default: _topk,
    aten.gather.default: _gather,
    aten.scatter_add.default: _scatter_add,
    aten.amax.default: _reduction("amax"),
    aten.argmax.default: _reduction("argmax"),
    aten.mean.dim: _reduction("mean"),
    aten.mean.default: _reduction("mean"),  # x.mean(): over every dim (a model's own scalar loss)
    aten.log.default: lambda b, n, a: b.emit("log", [b.val(a["self"])]),
    aten._softmax.default: _softmax_lowering("softmax"),
    aten.softmax.int: _softmax_lowering("softmax"),
    aten._log_softmax.default: _softmax_lowering("log_softmax"),
    aten.log_softmax.int: _softmax_lowering("log_softmax"),
}
