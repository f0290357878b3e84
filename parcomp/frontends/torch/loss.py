"""aten lowerings of a model that computes its own loss (loss part), merged into
:data:`parcomp.frontends.torch.export.TABLE`.

transformers' ``ForCausalLMLoss`` pads the labels with ``ignore_index`` (``aten.pad``), shifts
them (``slice``), and takes ``F.cross_entropy(..., ignore_index=-100, reduction="mean")``
(``aten.cross_entropy_loss``). The lowerings:

- ``pad`` / ``constant_pad_nd`` (constant mode): one parcomp ``pad`` per padded dim; a
  negative pad (a crop) is a ``slice`` of that dim;
- ``cross_entropy_loss(z, labels)`` (class indices, no ``weight``): classes moved to the last
  dim, the per-token ``cross_entropy`` (0 where ignored; decompose-reductions writes it in
  Megatron's vocab-parallel form, so split logits are never gathered), then ``none``: that;
  ``sum``: its sum; ``mean``: its sum over the sum of ``label_mask`` (torch's mean over the
  counted tokens, the same form as ``train loss=cross_entropy``);
- ``nll_loss`` / ``nll_loss_nd`` on log-probabilities: ``-pick`` per token, the same reductions.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten

REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # torch's at::Reduction enum


def _pad(b, n, a):
    """``pad(x, [last_lo, last_hi, prev_lo, prev_hi, ...], mode, value)``: one op per dim."""
    mode = a.get("mode", "constant")
    if mode != "constant":
        raise b.fail(f"pad mode {mode!r} is not supported; only mode='constant'")
    x, pads = b.val(a["self"]), [int(p) for p in a["pad"]]
    value = float(a.get("value") or 0.0)
    rank = b.types[x].rank
    if len(pads) % 2 or len(pads) // 2 > rank:
        raise b.fail(f"pad {pads} does not fit a rank-{rank} tensor")
    for i in range(len(pads) // 2):
        d, lo, hi = rank - 1 - i, pads[2 * i], pads[2 * i + 1]
        size = b.types[x].shape[d]
        if lo < 0 or hi < 0:  # a crop: the kept part, then the positive pads
            x = b.emit("slice", [x], f"_crop{d}", dim=d, start=max(-lo, 0), stop=size - max(-hi, 0), step=1)
            lo, hi = max(lo, 0), max(hi, 0)
        if lo or hi:
            x = b.emit("pad", [x], f"_pad{d}", dim=d, before=lo, after=hi, value=value)
    return x


def _classes_last(b, z: str, labels: str) -> str:
    """``z`` [N, C, d1, ...] (torch's class dim 1) with its classes moved last, checked
    against the labels' shape [N, d1, ...]."""
    zt, lt = b.types[z], b.types[labels]
    if not lt.dtype.startswith("int"):
        raise b.fail(f"the target {lt} holds class probabilities; only class indices (int64) are supported")
    if zt.rank >= 3:
        z = b.emit("permute", [z], "_classes_last", perm=(0,) + tuple(range(2, zt.rank)) + (1,))
    return z


def _reduce(b, per: str, labels: str, a, what: str) -> str:
    """The loss ``per`` token reduced as torch's ``reduction`` says (mean: over counted tokens)."""
    if a.get("weight") is not None:
        raise b.fail(f"{what} with class weights is not supported; leave weight=None")
    how = REDUCTIONS.get(int(a.get("reduction", 1)))
    if how is None:
        raise b.fail(f"{what} reduction {a.get('reduction')!r} is unknown")
    if how == "none":
        return per
    dims = tuple(range(b.types[per].rank))
    total = b.emit("sum", [per], "_total", dims=dims) if dims else per
    if how == "sum":
        return total
    valid = b.emit("label_mask", [labels], "_counted", ignore_index=int(a.get("ignore_index", -100)),
                   dtype=b.types[per].dtype)
    count = b.emit("sum", [valid], "_count", dims=dims) if dims else valid
    return b.emit("div", [total, count])  # torch: sum over the counted tokens / their number


def _cross_entropy_loss(b, n, a):
    labels = b.val(a["target"])
    z = _classes_last(b, b.val(a["self"]), labels)
    per = b.emit("cross_entropy", [z, labels], "_per_token", ignore_index=int(a.get("ignore_index", -100)),
                 label_smoothing=float(a.get("label_smoothing") or 0.0))
    return _reduce(b, per, labels, a, "cross_entropy")


def _nll_loss(b, n, a):
    labels = b.val(a["target"])
    z = _classes_last(b, b.val(a["self"]), labels)
    picked = b.emit("pick", [z, labels], "_target", ignore_index=int(a.get("ignore_index", -100)))
    return _reduce(b, b.emit("neg", [picked], "_per_token"), labels, a, "nll_loss")


LOSS_TABLE = {
    aten.pad.default: _pad,
    aten.constant_pad_nd.default: _pad,
    aten.cross_entropy_loss.default: _cross_entropy_loss,
    aten.nll_loss.default: _nll_loss,
    aten.nll_loss_nd.default: _nll_loss,
}
