"""aten lowerings of a buffer written in parts, merged into
:data:`parcomp.frontends.torch.export.TABLE`: ``buf[..., a:b].copy_(h)`` (DeepSeek-V3's MLA keys
``key_states = kv.new_empty(...)`` filled from ``k_nope`` and ``k_rot``), which torch.export
functionalizes into ``copy`` (the source converted and broadcast to the slot) and
``slice_scatter`` (the buffer with one slice replaced): the buffer's kept parts and the new
slice joined by ``cat``. The buffer itself is usually a folded allocation
(parcomp/frontends/torch/fold.py, ``ALLOCATIONS``), whose parts that the writes cover drop out.
"""
from __future__ import annotations

import torch

from parcomp.ir.types import TensorType

from .attention import expand_to, slice_of

aten = torch.ops.aten


def _copy(b, n, a):
    """copy(self, src): src converted to self's dtype and broadcast to its shape."""
    src, want = b.val(a["src"]), b.type_of(n)
    if b.types[src].dtype != want.dtype:
        src = b.emit("cast", [src], "_cast", ty=TensorType(b.types[src].shape, want.dtype))
    return src if b.types[src].shape == want.shape else expand_to(b, src, want.shape, "_expand")


def _slice_scatter(b, n, a):
    """self with self[start:end] along dim replaced by src: cat(before, src, after)."""
    x, src = b.val(a["self"]), b.val(a["src"])
    rank = b.types[x].rank
    dim, step = int(a.get("dim") or 0) % max(rank, 1), int(a.get("step") or 1)
    if step != 1:
        raise b.fail(f"slice_scatter with step {step} is not supported (only contiguous slices)",
                     "; build the tensor with torch.cat of its parts")
    size = b.types[x].shape[dim]
    lo, hi, _ = slice(a.get("start"), a.get("end")).indices(size)
    hi = max(hi, lo)
    if b.types[src].dtype != b.types[x].dtype:
        src = b.emit("cast", [src], "_cast", ty=TensorType(b.types[src].shape, b.types[x].dtype))
    parts = ([slice_of(b, x, dim, 0, lo, 1, "_before")] if lo > 0 else []) + [src] + (
        [slice_of(b, x, dim, hi, size, 1, "_after")] if hi < size else [])
    return parts[0] if len(parts) == 1 else b.emit("cat", parts, dim=dim)


BUFFER_TABLE = {
    aten.copy.default: _copy,
    aten.slice_scatter.default: _slice_scatter,
}


# ---- a routing mask: scatter of a value at top-k indices, masked_fill by its bool ---------
# DeepSeek-V3's router keeps the experts of the best groups:
#   group_mask = zeros_like(group_scores).scatter_(1, group_idx, 1)     # group_idx: topk indices
#   scores.masked_fill(~group_mask...bool(), float("-inf"))
# parcomp has no bool ops: the mask stays a float 0/1 tensor (``put_along`` of the value at the
# indices, which topk makes distinct, so writing and adding agree), and masked_fill(x, mask, v)
# becomes arithmetic with the kept entries' 0/1 ``keep``: x * keep + v * (1 - keep), with
# log(keep) for v = -inf (0 where kept, -inf where filled; +inf: -log(keep)). Exact where x is
# finite; the gradient reaches x only where kept, as torch's.

def _scatter_value(b, n, a):
    """scatter(zeros, dim, topk indices, value): ``put_along`` of the value at the indices."""
    base, index = a["self"], a["index"]
    from .reductions import ZERO_ALLOCATIONS

    if not (isinstance(base, torch.fx.Node) and base.target in ZERO_ALLOCATIONS and _is_topk_indices(index)):
        raise b.fail("scatter is supported into a fresh zero tensor at topk indices only (distinct "
                     "indices: writing and adding agree)", "; write x.scatter_add into torch.zeros")
    idx, want = b.val(index), b.type_of(n)
    dim = int(a["dim"]) % max(want.rank, 1)
    ones = b.emit("ones", [], "_ones", ty=TensorType(b.types[idx].shape, want.dtype))
    value = float(a["value"])
    src = ones if value == 1.0 else b.emit("scale", [ones], "_value", value=value)
    return b.emit("put_along", [src, idx], dim=dim, size=want.shape[dim])


def _is_topk_indices(fx) -> bool:
    import operator

    return (isinstance(fx, torch.fx.Node) and fx.target is operator.getitem and fx.args[1] == 1
            and getattr(fx.args[0], "target", None) is aten.topk.default)


def _as_bool(fx):
    """The float tensor a ``.bool()`` of ``fx`` converts, or None."""
    if (isinstance(fx, torch.fx.Node) and fx.target in (aten._to_copy.default, aten.to.dtype)
            and fx.meta.get("val") is not None and fx.meta["val"].dtype == torch.bool
            and len(fx.users) == 1):
        src = fx.args[0]
        if isinstance(src, torch.fx.Node) and src.meta.get("val") is not None \
                and src.meta["val"].dtype.is_floating_point:
            return src
    return None


def _mask_source(mask):
    """``(float 0/1 tensor m, negated)`` when ``mask`` is ``m.bool()`` or ``~m.bool()``."""
    if isinstance(mask, torch.fx.Node) and mask.target is aten.bitwise_not.default and len(mask.users) == 1:
        m = _as_bool(mask.args[0])
        return (m, True, (mask, mask.args[0])) if m is not None else None
    m = _as_bool(mask)
    return (m, False, (mask,)) if m is not None else None


def _masked_fill(m, negated):
    def lower(b, n, a):
        x, mask = b.val(a["self"]), b.val(m)
        value, ty = float(a["value"]), b.type_of(n)
        if b.types[mask].dtype != ty.dtype:
            mask = b.emit("cast", [mask], "_mask", ty=TensorType(b.types[mask].shape, ty.dtype))
        one = b.emit("ones", [], "_one", ty=TensorType((), ty.dtype))
        keep = mask if negated else b.emit("sub", [one, mask], "_keep")  # 1 where x stays
        kept = b.emit("mul", [x, keep], "_kept")
        if value == float("-inf") or value == float("inf"):
            fill = b.emit("log", [keep], "_fill")
            fill = fill if value < 0 else b.emit("scale", [fill], "_neg", value=-1.0)
        else:
            fill = b.emit("scale", [b.emit("sub", [one, keep], "_filled")], "_fill", value=value)
        out = b.emit("add", [kept, fill])
        return out if b.types[out].shape == ty.shape else expand_to(b, out, ty.shape, "_expand")
    return lower


def mask_patterns(fx_nodes) -> dict:
    """fx node -> lowering of ``masked_fill(x, [~]m.bool(), v)`` with float ``m`` (the inner
    ``.bool()`` and ``~`` lower to nothing)."""
    out = {}
    for n in fx_nodes:
        if n.op == "call_function" and n.target is aten.masked_fill.Scalar:
            found = _mask_source(n.args[1])
            if found is not None:
                m, negated, inner = found
                out[n] = _masked_fill(m, negated)
                out.update({i: (lambda b, fx, a: None) for i in inner})
    return out


BUFFER_TABLE[aten.scatter.value] = _scatter_value
