"""The one per-axis transition table: which layout op turns which placement into which.

See docs/design/search.md, "Redistribution" (as DTensor's ``_redistribute.py``), for one mesh axis of
``n`` ranks; ``before`` / ``after``: bytes of one rank's local tensor around the op.

==============  =================  ============================
from -> to      op                 bytes sent per rank (ring)
==============  =================  ============================
P -> R          all_reduce(sum)    2(n-1)/n * before
P(max) -> R     all_reduce(max)    2(n-1)/n * before  (``reduce_op="max"``; never summed)
S(d) -> R       all_gather(d)      (n-1)/n * after  (concat, never sum)
P -> S(d)       reduce_scatter(d)  (n-1)/n * before
S(e) -> S(d)    all_to_all(e, d)   (n-1)/n * before
R -> S(d)       shard_slice(d)     0 (local)
R -> P          partial_mask       0 (local: value on coordinate 0, zeros elsewhere)
R -> P(max)     partial_mask(max)  0 (local: every rank keeps the value; max(x, x) = x)
==============  =================  ============================

``reduce_op`` (an attribute of all_reduce and partial_mask, default ``"sum"``) names
the partial kind: the op turns ``P(reduce_op)`` into ``R`` (or back). A P(max) is
never reduce_scattered: no backend here has an honest max reduce_scatter (gloo has
none), so the planner reduces it with all_reduce(max) and slices locally.

Read by the planner (:mod:`parcomp.ir.redistribute`: the step each change needs and
its bytes), the verifier (each layout op's input -> output placements) and the
reference interpreter (which simulation runs, which ops are logged as traffic).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .types import Partial, Replicate, Shard


@dataclass(frozen=True)
class Transition:
    """One layout op on one mesh axis.

    ``source`` / ``target``: ``(dim, src_dim, reduce_op) -> placement`` before and after
    (``dim``: the tensor dim gathered, scattered or sliced, the target dim of
    all_to_all; ``src_dim``: the dim all_to_all concatenates; ``reduce_op``: the
    partial kind, one of ``reduce_ops``).  ``sent``:
    ``(n, before, after) -> bytes`` one rank sends (``before`` / ``after``: local
    bytes around the op, ``n``: ranks on the axis).  ``collective``: talks to the
    other ranks (a local op only slices or masks its own data).
    """

    op: str
    source: Callable
    target: Callable
    sent: Callable
    collective: bool = True
    reduce_ops: tuple = ("sum",)  # the partial kinds it takes (``reduce_op`` attribute)

    def placements(self, dim=None, src_dim=None, reduce_op="sum") -> tuple:
        """``(before, after)`` placements on the op's axis."""
        return self.source(dim, src_dim, reduce_op), self.target(dim, src_dim, reduce_op)


def _no_bytes(n, before, after) -> int:
    return 0


TRANSITIONS = {t.op: t for t in (
    Transition("all_reduce", lambda d, s, r: Partial(r), lambda d, s, r: Replicate(),
               lambda n, before, after: 2 * before * (n - 1) // n, reduce_ops=("sum", "max")),
    Transition("all_gather", lambda d, s, r: Shard(d), lambda d, s, r: Replicate(),
               lambda n, before, after: after * (n - 1) // n),
    Transition("reduce_scatter", lambda d, s, r: Partial(r), lambda d, s, r: Shard(d),
               lambda n, before, after: before * (n - 1) // n),
    Transition("all_to_all", lambda d, s, r: Shard(s), lambda d, s, r: Shard(d),
               lambda n, before, after: before * (n - 1) // n),
    Transition("shard_slice", lambda d, s, r: Replicate(), lambda d, s, r: Shard(d), _no_bytes, False),
    Transition("partial_mask", lambda d, s, r: Replicate(), lambda d, s, r: Partial(r), _no_bytes, False,
               reduce_ops=("sum", "max")),
)}
"""layout op -> :class:`Transition`; the keys are :data:`parcomp.ir.ops.LAYOUT_OPS`."""

JOINT_KINDS = ("all_reduce", "all_gather", "reduce_scatter")
"""Layout ops that may run over a joint group of several mesh axes at once (``axis="dp,tp"``):
the group's ranks in rank order, the first axis outermost (the shard order), so the op is the
per-axis ops over those axes in a row (:mod:`parcomp.ir.redistribute`)."""
