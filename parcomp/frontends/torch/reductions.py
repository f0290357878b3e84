"""aten lowerings of the reductions part, merged into
:data:`parcomp.frontends.torch.export.TABLE`: ``amax``, ``argmax``, ``mean``, ``log``,
``softmax``, ``log_softmax`` (dims normalised to >= 0; ``keepdim`` becomes a reshape).
"""
from __future__ import annotations

import torch

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
    def lower(b, n, a):
        x = b.val(a["self"])
        return b.emit(op, [x], dim=int(a["dim"]) % max(b.types[x].rank, 1))
    return lower


REDUCTION_TABLE = {
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
