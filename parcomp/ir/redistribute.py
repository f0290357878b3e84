"""Redistribution planning: a layout change as a list of steps, before any code.

The per-axis steps, their placements and bytes come from the one transition
table, :data:`parcomp.ir.transitions.TRANSITIONS` (docs/design/search.md, "Redistribution").

Multi-axis plans respect the shard-order convention of :mod:`parcomp.ir.types`
(first mesh axis outer): per tensor dim, the common prefix of source and target
shard axes is kept, the rest of the source axes are gathered innermost first,
partial axes not wanted partial (or wanted as another partial kind) are reduced,
then the target's remaining axes are added outermost first (reduce_scatter where
the axis is still a partial sum, a local slice otherwise), and last ``R -> P``
masks. A ``P(max)`` is reduced by ``all_reduce{reduce_op="max"}`` (never summed,
never reduce_scattered).

Joint groups: consecutive steps of one kind that span several mesh axes
(all_reduce of the same partial kind; all_gather or reduce_scatter of the same dim)
become one step over the joint group of those axes (``Step.group``), whose ranks are
ordered with the first mesh axis outermost, the shard order. Under the ring model
this is never dearer (all_reduce sends ``2(1 - 1/(n1 n2))`` instead of
``2(1 - 1/n1) + 2(1 - 1/n2)`` times its bytes; all_gather / reduce_scatter the same
bytes) and saves a call's alpha, so the search prices and chooses it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache


from .transitions import JOINT_KINDS, TRANSITIONS
from .types import DTYPE_BYTES, Layout, Mesh, Partial, Replicate, Shard, TensorType, local_shape, shard_axes

# alpha-beta cost model (DTensor _collective_utils.py style): seconds per collective
# call plus seconds per byte sent per rank. Local steps cost EPSILON to break ties.
# One model for every device profile (the Program must not change between them); see
# docs/design/search.md for why alpha is 1e-4 s.
ALPHA_S = 1e-4
BETA_S_PER_BYTE = 1e-10
EPSILON_S = 1e-12
# compute is priced too (as in AutoParallel's communication + compute cost), so
# that work replicated across ranks costs more than the same work split
SECONDS_PER_FLOP = 1e-11
# the data-parallel mesh axis: shard-prop never all-gathers the batch's values
# over it (passes/shard_prop.py, "data parallel stays data parallel")
DP_AXIS = "dp"


@dataclass(frozen=True)
class Step:
    """One redistribution step on one mesh axis.

    ``kind``: all_gather | all_reduce | reduce_scatter | all_to_all | shard_slice |
    partial_mask.  ``dim``: the tensor dim gathered/scattered/sliced (target dim
    for all_to_all), ``src_dim``: the dim concatenated by all_to_all.
    ``before``/``after``: the full layouts around the step.
    ``reduce_op``: the partial kind an all_reduce / partial_mask works on ("sum", "max").
    ``group``: for a step over a joint group of several mesh axes, those axes in mesh
    order (``axis`` is the first); empty for a one-axis step.
    """

    kind: str
    axis: int
    dim: int | None
    src_dim: int | None
    before: Layout
    after: Layout
    reduce_op: str = "sum"
    group: tuple = ()

    @property
    def axes(self) -> tuple:
        """The mesh axes the step runs over (one, or a joint group's)."""
        return self.group or (self.axis,)

    def ranks(self, mesh: Mesh) -> int:
        """How many ranks one of the step's groups holds."""
        return math.prod([mesh.sizes[a] for a in self.axes])

    @property
    def is_collective(self) -> bool:
        return TRANSITIONS[self.kind].collective


def step_bytes(step: Step, ty: TensorType, mesh: Mesh) -> int:
    """Bytes one rank sends for ``step`` on a tensor of global type ``ty`` (ring algorithms)."""
    itemsize = DTYPE_BYTES[ty.dtype]
    before = math.prod(local_shape(ty, step.before, mesh)) * itemsize
    after = math.prod(local_shape(ty, step.after, mesh)) * itemsize
    return TRANSITIONS[step.kind].sent(step.ranks(mesh), before, after)


def plan(src: Layout, tgt: Layout, rank: int) -> tuple:
    """Steps that turn a tensor of ``rank`` dims from layout ``src`` into ``tgt``
    (steps over several mesh axes joined into joint-group steps: :func:`_joint`)."""
    return _plan(tuple(src), tuple(tgt), rank)


@lru_cache(maxsize=None)
def _plan(src, tgt, rank):
    return _joint(plan_per_axis(src, tgt, rank))


def plan_per_axis(src: Layout, tgt: Layout, rank: int) -> tuple:
    """The same change as :func:`plan`, one mesh axis per step (no joint groups)."""
    src, tgt = tuple(src), tuple(tgt)
    cur, steps = list(src), []

    def emit(kind, axis, dim=None, src_dim=None, reduce_op="sum"):
        was, new = TRANSITIONS[kind].placements(dim, src_dim, reduce_op)
        assert cur[axis] == was, (kind, cur, axis)
        before = tuple(cur)
        cur[axis] = new
        steps.append(Step(kind, axis, dim, src_dim, before, tuple(cur), reduce_op))

    if src == tgt:
        return ()
    keep = {d: _common_prefix(shard_axes(src, d), shard_axes(tgt, d)) for d in range(rank)}
    a2a = _all_to_all_moves(src, tgt, rank)
    for d in range(rank):  # phase A: drop shards beyond the kept prefix, innermost first
        for a in reversed(shard_axes(src, d)[keep[d]:]):
            if a in a2a:
                emit("all_to_all", a, dim=a2a[a], src_dim=d)
            else:
                emit("all_gather", a, dim=d)
    for a, (s, t) in enumerate(zip(src, tgt)):  # phase B: reduce partials not wanted partial
        if isinstance(s, Partial) and s != t and (not isinstance(t, Shard) or s.op != "sum"):
            emit("all_reduce", a, reduce_op=s.op)  # a P(max) is never reduce_scattered
    for d in range(rank):  # phase C: add target shards, outermost first
        for a in shard_axes(tgt, d)[keep[d]:]:
            if cur[a] == Shard(d):
                continue  # arrived by all_to_all
            if isinstance(cur[a], Partial):
                emit("reduce_scatter", a, dim=d)
            else:
                emit("shard_slice", a, dim=d)
    for a, t in enumerate(tgt):  # phase D: R -> P
        if isinstance(t, Partial) and not isinstance(cur[a], Partial):
            emit("partial_mask", a, reduce_op=t.op)
    assert tuple(cur) == tgt, (src, tgt, cur)
    return tuple(steps)


def _joint(steps) -> tuple:
    """``steps`` with each run of consecutive same-kind steps over several axes (same dim,
    same reduce_op, kind in :data:`JOINT_KINDS`) made one step over the joint group."""
    out = []
    for st in steps:
        last = out[-1] if out else None
        if (last is not None and st.kind in JOINT_KINDS and last.kind == st.kind
                and last.dim == st.dim and last.reduce_op == st.reduce_op):
            axes = tuple(sorted(last.axes + (st.axis,)))
            out[-1] = Step(st.kind, axes[0], st.dim, None, last.before, st.after, st.reduce_op, axes)
        else:
            out.append(st)
    return tuple(out)


def _common_prefix(xs, ys) -> int:
    k = 0
    while k < min(len(xs), len(ys)) and xs[k] == ys[k]:
        k += 1
    return k


def _all_to_all_moves(src, tgt, rank) -> dict:
    """Axes whose S(d) -> S(e) change can be one all_to_all: axis -> e.

    The unambiguous case: the axis is the innermost shard axis of d in the source and d
    keeps the others in the target; it becomes the innermost shard axis of e in the
    target, whose other shard axes e already has in the source. Each group of the axis
    then holds one chunk of the outer axes' split of d (and of e): its local all_to_all
    moves exactly the axis's sub-chunks (``dp x ep``: the MoE tokens' exchange over ep
    while dp splits the same rows).
    """
    out = {}
    for a, (s, t) in enumerate(zip(src, tgt)):
        if isinstance(s, Shard) and isinstance(t, Shard) and s.dim != t.dim:
            sd, se = shard_axes(src, s.dim), shard_axes(src, t.dim)
            td, te = shard_axes(tgt, s.dim), shard_axes(tgt, t.dim)
            if sd[-1] == a and td == sd[:-1] and te[-1] == a and se == te[:-1]:
                out[a] = t.dim
    return out


def plan_cost(src: Layout, tgt: Layout, ty: TensorType, mesh: Mesh) -> float:
    """Estimated seconds to redistribute ``ty`` from ``src`` to ``tgt`` (alpha-beta).

    Steps over a mesh axis of size 1 are free: one rank holds the same data in
    every placement, and insert-collectives plans nothing over such an axis.
    """
    return _plan_cost(tuple(src), tuple(tgt), ty, mesh)


@lru_cache(maxsize=None)
def _plan_cost(src, tgt, ty, mesh):
    total = 0.0
    for st in plan(src, tgt, ty.rank):
        if st.ranks(mesh) == 1:
            continue  # one rank: every placement is the same data (insert-collectives drops it)
        if st.is_collective:
            total += ALPHA_S + BETA_S_PER_BYTE * step_bytes(st, ty, mesh)
        else:
            total += EPSILON_S
    return total


def gathers_over(src: Layout, tgt: Layout, rank: int, mesh: Mesh, axis: str,
                 kinds: tuple = ("all_gather",)) -> bool:
    """Whether turning ``src`` into ``tgt`` runs a collective of one of ``kinds`` over mesh
    axis ``axis`` (alone or in a joint group) of more than one rank; False when the mesh has
    no such axis."""
    if axis not in mesh.names or mesh.sizes[mesh.names.index(axis)] == 1:
        return False
    a = mesh.names.index(axis)
    return any(st.kind in kinds and a in st.axes for st in plan(src, tgt, rank))


def compute_cost(node, in_types, ins, out, mesh) -> float:
    """Estimated seconds of one rank's local compute for ``node`` under a strategy.

    Matmul: 2*M*N*K of the local shapes; every other op: one flop per local
    output element.
    """
    local_out = math.prod(local_shape(node.type, out, mesh)) if node.type.rank else 1
    if node.op == "matmul":
        k = in_types[0].shape[-1]
        for a in shard_axes(ins[0], in_types[0].rank - 1):
            k //= mesh.sizes[a]
        return SECONDS_PER_FLOP * 2 * local_out * k
    return SECONDS_PER_FLOP * local_out
