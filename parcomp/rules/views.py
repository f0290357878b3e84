"""Sharding rules and VJPs of the view ops of the attention part: slice, cat.

Blocks are contiguous (:class:`parcomp.ir.types.Shard`), so the shard dim is remapped
only where every rank's block of the result is a block of its operand's block:

- ``slice`` along ``dim``: any other dim stays split (``S(e) -> S(e)``), partial sums
  stay partial. Slicing the split dim itself keeps the split only when the slice is the
  whole dim (``0:size:1``); any other slice of a split dim takes rows from some ranks and
  none from others, so the operand is first redistributed (the planner picks how).
- ``slice_grad`` (zeros with the slice written in) has the same rules.
- ``pad`` along ``dim`` (loss part): as ``slice``; partial only with a zero fill.
- ``cat`` along ``dim``: every operand split on the same other dim gives that split;
  all replicated gives replicated; all partial gives partial (cat is linear in all its
  operands jointly, so a replicated operand cannot join partial ones: it would be
  counted n times). Operands split along ``dim`` itself are not a split of the result
  (rank r would hold ``[x_r | y_r]``, not the r-th block of ``[x | y]``): redistributed.

``reshape`` (existing, :func:`parcomp.rules.sharding.reshape_dim_map`) keeps a split
through a merge or split of dims only when the split dim is the outermost of its group;
``unsqueeze``/``squeeze``/``split``/``stack`` are lowered by the frontend to
reshape/slice/cat and follow these rules.
"""
from __future__ import annotations

from ..ir.types import P, R, Shard


def _whole(node, size) -> bool:
    return (node.attr("start"), node.attr("stop"), node.attr("step", 1)) == (0, size, 1)


def slice_strategies(node, ts):
    """``slice`` / ``slice_grad``: every dim but the sliced one keeps its split; the sliced
    dim only when the slice is all of it (identity)."""
    d = node.attr("dim")
    full = node.type.shape[d] if node.op == "slice_grad" else ts[0].shape[d]
    out = [((R,), R), ((P,), P)]
    return out + [((Shard(e),), Shard(e)) for e in range(ts[0].rank) if e != d or _whole(node, full)]


def cat_strategies(node, ts):
    """``cat`` along ``dim``: all R, all P, or all split on one other dim."""
    d, k = node.attr("dim"), len(ts)
    out = [((R,) * k, R), ((P,) * k, P)]
    return out + [((Shard(e),) * k, Shard(e)) for e in range(node.type.rank) if e != d]


def _slice_vjp(b, n, g):
    keys = {k: n.attr(k) for k in ("dim", "start", "stop")} | {"step": n.attr("step", 1)}
    back = "slice_grad" if n.op == "slice" else "slice"
    return (b.op(back, [g], type=b.type(n.inputs[0]) if back == "slice_grad" else None, **keys),)


def _cat_vjp(b, n, g):
    d, off, out = n.attr("dim"), 0, []
    for x in n.inputs:
        size = b.type(x).shape[d]
        out.append(b.op("slice", [g], dim=d, start=off, stop=off + size, step=1))
        off += size
    return tuple(out)


def pad_strategies(node, ts):
    """``pad`` along ``dim`` (loss part): every other dim keeps its split; the padded
    dim only when nothing is added; partial sums stay partial only for a zero fill (a
    nonzero fill on every rank would be summed ``n`` times)."""
    d = node.attr("dim")
    none = node.attr("before") == 0 and node.attr("after") == 0
    out = [((R,), R)] + ([((P,), P)] if float(node.attr("value")) == 0.0 else [])
    return out + [((Shard(e),), Shard(e)) for e in range(ts[0].rank) if e != d or none]


def _pad_vjp(b, n, g):  # the fill is a constant: x's gradient is g without the padding
    lo, size = n.attr("before"), b.type(n.inputs[0]).shape[n.attr("dim")]
    return (b.op("slice", [g], dim=n.attr("dim"), start=lo, stop=lo + size, step=1),)


VIEW_STRATEGIES = {"slice": slice_strategies, "cat": cat_strategies, "pad": pad_strategies}  # by kind
VIEW_VJPS = {"slice": _slice_vjp, "slice_grad": _slice_vjp, "cat": _cat_vjp, "pad": _pad_vjp}
