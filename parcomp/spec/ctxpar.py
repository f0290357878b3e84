"""``context-parallel [over AXIS] [lowering=NAME]``: causal attention over a split sequence.

The statement says which mesh axis splits the sequence of every ``sdpa`` (default: the axis
named ``cp``; a mesh without one must say ``over AXIS``, never a silent tp or dp) and how attention is lowered across it:

- ``all_gather`` (the default): each rank keeps its own query
  rows and gathers the whole K and V (one all_gather each, forward); backward gives each rank
  the dK/dV of every key from its own queries, a partial sum that a reduce_scatter returns to
  the keys' owners.

- ``all_to_all`` (DeepSpeed-Ulysses; ``ulysses`` is the same): q/k/v exchanged from the
  sequence split to a heads split, attention on whole sequences, the output exchanged back
  (``parcomp/passes/attention/cp_ulysses.py``).
- ``ring``: K/V blocks passed around the ring by point-to-point sends, an online-softmax
  merge; backward with each step's own block, dK/dV returned to their owners
  (``parcomp/reference/cp_ring.py``).

``chunking=balanced`` (rank r holds chunks r and 2cp-1-r of 2cp) works with the all_gather and
ring lowerings (``parcomp/passes/attention/cp_balance.py``).

``load_balanced`` is named here so that a spec asking for it as a lowering gets a located error
(the balanced placement is ``chunking=balanced``), never a silent other lowering.
Every error is a :class:`~parcomp.errors.SpecError` at the statement or at the option.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import SourceLoc

#: lowerings built, and those named but not built yet (a located error)
LOWERINGS = ("all_gather", "all_to_all", "ring")  # all_to_all: DeepSpeed-Ulysses (passes/attention/cp_ulysses.py)
NOT_BUILT = ("load_balanced",)
ALIASES = {"ulysses": "all_to_all"}  # DeepSpeed's name for the all_to_all form
CHUNKINGS = ("contiguous", "balanced")


@dataclass(frozen=True)
class ContextParallel:
    """A parsed ``context-parallel`` statement: the mesh axis, the lowering, where it is."""

    axis: str
    lowering: str
    loc: SourceLoc
    chunking: str = "contiguous"  # or "balanced": parcomp/passes/attention/cp_balance.py


def make_context_parallel(builder, tok, payload) -> ContextParallel:
    """The :class:`ContextParallel` of one statement (``payload``: ``[over-axis or None, options...]``).

    Raises:
        SpecError: an unknown axis, no ``cp`` axis on the mesh without ``over``, an
            unknown option or lowering, a lowering not built yet.
    """
    names = builder.mesh.names
    over, options = payload[0], payload[1:]
    if over is not None:
        axis = builder.axis(over, "'context-parallel over'")
    elif "cp" in names:
        axis = "cp"
    else:
        raise builder.err(tok, f"context-parallel: which mesh axis splits the sequence? the mesh "
                               f"has no 'cp' axis ({builder.axes_text()}); say 'context-parallel over AXIS'")
    lowering, chunking = LOWERINGS[0], "contiguous"
    for key, val in options:
        if str(key) == "chunking":  # load-balanced causal chunking
            chunking = _chunking(builder, key, val)
            continue
        if str(key) != "lowering":
            raise builder.err(key, f"context-parallel has no option {str(key)!r}; its options are "
                                   f"lowering= ({', '.join(LOWERINGS)}) and chunking= ({', '.join(CHUNKINGS)})")
        val = ALIASES.get(val, val)
        if val in NOT_BUILT:
            raise builder.err(key, f"context-parallel lowering={val} is not built yet; built: "
                                   f"{', '.join(LOWERINGS)}")
        if val not in LOWERINGS:
            raise builder.err(key, f"context-parallel lowering={val!r} is not a lowering; choose one "
                                   f"of: {', '.join(LOWERINGS)}")
        lowering = val
    if lowering == "all_to_all" and chunking == "balanced":  # whole sequences per rank: nothing to balance
        raise builder.err(tok, "context-parallel lowering=all_to_all runs attention on whole sequences "
                               "(heads split), so chunking=balanced has nothing to balance; use it with "
                               "lowering=all_gather or lowering=ring")
    return ContextParallel(axis, lowering, builder.loc(tok), chunking)


def _chunking(builder, key, val) -> str:
    """``contiguous`` (rank r holds rows r*L .. r*L+L-1) or ``balanced`` (the sequence cut into
    2cp chunks, rank r holds chunks r and 2cp-1-r: parcomp/passes/attention/cp_balance.py).

    Raises:
        SpecError: at the option, for any other value.
    """
    if val not in CHUNKINGS:
        raise builder.err(key, f"context-parallel chunking={val!r} is not a chunking; choose one of: "
                               f"{', '.join(CHUNKINGS)}")
    return val
