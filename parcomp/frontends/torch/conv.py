"""aten lowerings of patch convolutions: a convolution whose stride equals its kernel.

A ViT's patch embedding (``nn.Conv2d(c, h, kernel_size=p, stride=p)``), a 1-D patch or frame
embedding (``nn.Conv1d``) and a video's tubelets (``nn.Conv3d``) cut the input into
non-overlapping patches and apply one linear map to each. The frontend writes exactly that
with existing ops, so their sharding rules, VJPs and emitters apply unchanged:

- ``x`` ``[*lead, C, S1, .., Sn]`` (``lead``: the batch, or nothing for an unbatched input),
  first cut to ``o_i * k_i`` along each spatial dim when ``k_i`` does not divide ``S_i``
  (torch drops the remainder), ``reshape`` to ``[*lead, C, o1, k1, .., on, kn]``,
  ``permute`` to ``[*lead, o1, .., on, C, k1, .., kn]``, ``reshape`` to
  ``[*lead, o1, .., on, C*k1*..*kn]``: one row per patch, in the order of the weight's
  ``[C, k1, .., kn]``;
- the weight ``[O, C, k1, .., kn]`` ``reshape``\\ d to ``[O, C*k1*..*kn]`` and transposed
  (``permute``), as ``nn.Linear``'s is; ``matmul``, then ``add`` of the bias ``[O]``;
- ``permute`` back to torch's ``[*lead, O, o1, .., on]``.

Covered: ``aten.conv1d/conv2d/conv3d`` (``padding`` 0 or ``"valid"``, or ``"same"`` with a
kernel of ones) and ``aten.convolution`` not transposed, with stride equal to the kernel,
no padding, dilation 1 and groups 1. Any other convolution (overlapping windows, padding,
dilation, groups, ``conv_transpose*``) is a located error that says which of these it has.
"""
from __future__ import annotations

import math

import torch

from parcomp.ir.types import TensorType
from .attention import slice_of

aten = torch.ops.aten

_WHY = (": parcomp lowers only patch convolutions (stride equal to the kernel, no padding, "
        "dilation 1, groups 1: a ViT's patch embedding) to a matmul over the patches")


def _ints(v, n: int) -> tuple:
    v = [v] if isinstance(v, int) else list(v)
    return tuple(int(x) for x in (v * n if len(v) == 1 else v))


def _patch_conv(b, x: str, w: str, bias, stride, padding, dilation, groups, transposed=False) -> str:
    """The lowering (module docstring) of one convolution, or a located error."""
    kshape = b.types[w].shape
    n = len(kshape) - 2
    tx = b.types[x]
    if n < 1 or tx.rank not in (n + 1, n + 2):
        raise b.fail(f"convolution of {tx} by a weight {b.types[w]}: expected an input "
                     f"[batch, channels, {n} spatial dims] or [channels, {n} spatial dims]")
    kernel = kshape[2:]
    if isinstance(padding, str):
        if padding != "valid" and not (padding == "same" and set(kernel) == {1}):
            raise b.fail(f"convolution with padding={padding!r} and kernel {list(kernel)}", _WHY)
        padding = 0
    stride, padding, dilation = _ints(stride, n), _ints(padding, n), _ints(dilation, n)
    bad = [f"{what} {list(v)}" for what, v, ok in (
        ("stride", stride, stride == kernel), ("padding", padding, not any(padding)),
        ("dilation", dilation, set(dilation) == {1} or set(kernel) == {1}))
        if not ok]
    if int(groups) != 1:
        bad.append(f"groups={int(groups)}")
    if transposed:
        bad.insert(0, "transposed")
    if bad:
        raise b.fail(f"convolution with kernel {list(kernel)} and {', '.join(bad)}", _WHY)
    lead = tx.rank - n - 1
    c, spatial, dtype = tx.shape[lead], tx.shape[lead + 1:], tx.dtype
    outs = tuple(s // k for s, k in zip(spatial, kernel))
    for i, (o, k) in enumerate(zip(outs, kernel)):  # torch drops the rows past the last patch
        x = slice_of(b, x, lead + 1 + i, 0, o * k, 1, f"_crop{i}")
    head = tx.shape[:lead]
    cut = head + (c,) + tuple(v for ok in zip(outs, kernel) for v in ok)
    x = b.emit("reshape", [x], "_patches", ty=TensorType(cut, dtype))
    perm = (tuple(range(lead)) + tuple(lead + 1 + 2 * i for i in range(n)) + (lead,)
            + tuple(lead + 2 + 2 * i for i in range(n)))
    if perm != tuple(range(len(cut))):
        x = b.emit("permute", [x], "_patches_t", perm=perm)
    feat = c * math.prod(kernel)
    rows = b.emit("reshape", [x], "_rows", ty=TensorType(head + outs + (feat,), dtype))
    wf = b.emit("reshape", [w], "_w", ty=TensorType((kshape[0], feat), b.types[w].dtype))
    wt = b.emit("permute", [wf], "_wt", perm=(1, 0))
    y = b.emit("matmul", [rows, wt], "_mm")
    if bias is not None:
        y = b.emit("add", [y, b.val(bias)], "_bias")
    back = tuple(range(lead)) + (lead + n,) + tuple(lead + i for i in range(n))
    return b.emit("permute", [y], perm=back) if back != tuple(range(len(back))) else y


def _conv(b, n, a):
    return _patch_conv(b, b.val(a["input"]), b.val(a["weight"]), a["bias"], a["stride"],
                       a["padding"], a["dilation"], a["groups"])


def _convolution(b, n, a):
    return _patch_conv(b, b.val(a["input"]), b.val(a["weight"]), a["bias"], a["stride"],
                       a["padding"], a["dilation"], a["groups"], transposed=bool(a["transposed"]))


def _conv_transpose(b, n, a):
    raise b.fail(f"transposed convolution (kernel {list(b.types[b.val(a['weight'])].shape[2:])})", _WHY)


CONV_TABLE = {
    aten.conv_transpose1d.default: _conv_transpose, aten.conv_transpose2d.input: _conv_transpose,
    aten.conv_transpose3d.input: _conv_transpose,
    **{getattr(aten, op).default: _conv for op in ("conv1d", "conv2d", "conv3d")},
    **{getattr(aten, op).padding: _conv for op in ("conv1d", "conv2d", "conv3d")},
    aten.convolution.default: _convolution,
}
