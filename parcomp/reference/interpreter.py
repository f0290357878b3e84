"""The reference SPMD interpreter: every rank in one process, collectives simulated.

It runs a *local* program (after ``localize``) on all ranks of the mesh in
lockstep, node by node.  Compute ops use :data:`NUMPY_OPS`; collectives combine
the group's local arrays in coordinate order and are logged, so tests can pin
the exact collectives that ran. It runs the lowered program (parcomp/passes/lowering/lower.py):
the same op sequence, frees and in-place writes as the emitted program.py. A
collective with ``async_op=true`` completes at once; its ``wait`` passes the value on.
MoE layers run dropless: the values between a ``moe_dispatch`` and its ``moe_combine`` are held
as the routed rows only (parcomp/reference/moe_packed.py), or, where a statement on them is not
covered, the whole program runs again on the dense slot buffers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import VerifyError
from ..ir.graph import Graph, describe
from ..ir.liveness import broadcast_view, frees_of, storage_roots
from ..ir.redistribute import Step, step_bytes
from ..ir.transitions import TRANSITIONS
from ..ir.types import Partial, Replicate, TensorType, shard_offsets
from .assemble import assemble
from .cp_ring import is_ring, run_ring
from .cp_storage import feed as cp_feed, outputs as cp_outputs
from . import moe_packed
from .moe_ops import ragged_all_to_all
from .numpy_attn import source_array
from .numpy_ops import NUMPY_OPS
from .ranked import at_rank


def _contig(x) -> np.ndarray:
    """A C-contiguous copy that keeps 0-d arrays 0-d (np.ascontiguousarray would not)."""
    return np.array(x, order="C", copy=True)


def _block(full, ty, layout, mesh, coords):
    idx = tuple(slice(s, s + n) for s, n in shard_offsets(ty, layout, mesh, coords))
    return full[idx]


def split_for_ranks(full, layout, mesh, rng=None) -> list:
    """The local array every rank holds of ``full`` under ``layout`` (index = rank).

    Partial axes: by default coordinate 0 holds the value and the others zeros
    (what ``partial_mask`` does).  With ``rng`` (a numpy Generator) the value is
    split as ``x/n + o_c`` with random sign-varying offsets ``o_c`` summing to
    zero, so a nonlinear op applied to partial sums gives a visibly wrong answer
    (DTensor's strategy validator splits Partial inputs asymmetrically for the
    same reason).  Replicas along ``R`` axes stay bit-identical.  A ``P(max)`` axis: every
    coordinate holds the value (``partial_mask``); with ``rng``, all but one random
    coordinate hold it lowered by random amounts (a max combined by sum is then wrong).
    """
    full = np.asarray(full)
    ty = TensorType(full.shape, str(full.dtype))
    locs = [_block(full, ty, layout, mesh, mesh.coords(r)).copy() for r in range(mesh.size)]
    for a, p in enumerate(layout):
        if not isinstance(p, Partial):
            continue
        n, cache = mesh.sizes[a], {}
        if p.op == "max":
            _split_max(locs, full, layout, mesh, a, rng)
            continue
        for r in range(mesh.size):
            coords = mesh.coords(r)
            key = tuple(0 if (i == a or isinstance(q, Replicate)) else c
                        for i, (c, q) in enumerate(zip(coords, layout)))
            if rng is None:
                locs[r] = locs[r] if coords[a] == 0 else np.zeros_like(locs[r])
                continue
            if key not in cache:
                offs = [rng.standard_normal(locs[r].shape) * 3 for _ in range(n - 1)]
                cache[key] = offs + [-sum(offs) if offs else np.zeros(locs[r].shape)]
            locs[r] = (locs[r] / n + cache[key][coords[a]]).astype(full.dtype)
    return [_contig(x) for x in locs]


def _split_max(locs, full, layout, mesh, a, rng):
    """The pieces of a P(max) split along mesh axis ``a`` (see :func:`split_for_ranks`)."""
    if rng is None:
        return
    keys = {}
    for r in range(mesh.size):
        coords = mesh.coords(r)
        # one owner per group along ``a`` whatever the coordinates on the other P(max) axes, so
        # that on two such axes some rank (the owners' crossing) still holds the exact value
        key = tuple(0 if (i == a or isinstance(q, (Replicate, Partial))) else c
                    for i, (c, q) in enumerate(zip(coords, layout)))
        if key not in keys:
            keys[key] = (int(rng.integers(mesh.sizes[a])),
                         [np.abs(rng.standard_normal(locs[r].shape)) * 3 for _ in range(mesh.sizes[a])])
        owner, offs = keys[key]
        if coords[a] != owner:
            locs[r] = (locs[r] - offs[coords[a]]).astype(full.dtype)


@dataclass


class SPMDRun:
    """Result of :func:`run_spmd`: per-rank values, the collective log, the executed op
    sequence (node names, in order), each rank's peak live bytes, and the point-to-point
    shifts of ring attention nodes (``p2p``: parcomp/reference/cp_ring.py). ``moe``: per rank,
    ``{"expert_rows", "expert_flops"}``: the rows its MoE experts multiplied by their weights
    (forward and backward, each matmul counted) and the FLOPs of those matmuls; empty where the
    program has no MoE layer, or where it ran on the dense slot buffers (``moe_dense``: why).
    A value between a dispatch and its combine is a :class:`~.moe_packed.SlotRows` in ``env``."""

    env: list
    log: list = field(default_factory=list)
    p2p: list = field(default_factory=list)
    ops: list = field(default_factory=list)
    peak_bytes: list = field(default_factory=list)
    moe: list = field(default_factory=list)
    moe_dense: str = ""

    def outputs(self, program: Graph) -> dict:
        """Full output arrays, assembled from the ranks' local values."""
        out = {}
        for public, value in program.named_outputs():
            node = program[value]
            gshape = _global_shape(program, value)
            out[public] = assemble([e[value] for e in self.env], node.layout, gshape,
                                   program.mesh, node.type.dtype)
        return cp_outputs(program, out)  # balanced chunking: natural order


def _global_shape(program, value):
    node = program[value]
    shape = list(node.type.shape)
    for a, p in enumerate(node.layout):
        if hasattr(p, "dim"):
            shape[p.dim] *= program.mesh.sizes[a]
    return tuple(shape)


def run_spmd(program: Graph, feeds: dict, partial_rng=None) -> SPMDRun:
    """Run a local program on every rank. ``feeds``: full arrays for inputs and params.

    Nodes run in program order, as program.py's statements do: a value is dropped after
    the node whose ``frees`` names it, and the first operand of an ``inplace`` node is
    overwritten (reading either afterwards is a KeyError). ``run.env`` keeps every value
    for inspection; ``run.peak_bytes[r]`` is the most bytes rank r held at once, values
    sharing a buffer (views, in-place results: :func:`storage_roots`) counted once.

    Raises:
        VerifyError: an ``inplace`` node writes into a broadcast view (:func:`check_in_place`).
    """
    if moe_packed.MODE.packed and any(n.op == "moe_dispatch" for n in program.nodes):
        state = partial_rng.bit_generator.state if partial_rng is not None else None
        try:
            return _run(program, feeds, partial_rng)
        except moe_packed.NotPacked as e:  # a statement on slots not covered: the dense buffers
            if partial_rng is not None:  # the same split of the inputs again
                partial_rng.bit_generator.state = state
            with moe_packed.DENSE:
                run = _run(program, feeds, partial_rng)
            run.moe_dense = str(e)
            return run
    return _run(program, feeds, partial_rng)


def _run(program, feeds, partial_rng):
    mesh = program.mesh
    ranks = range(mesh.size)
    run = SPMDRun([{} for _ in ranks], peak_bytes=[0] * mesh.size, moe=[{} for _ in ranks])
    live, roots, size = [{} for _ in ranks], storage_roots(program), [{} for _ in ranks]
    check_in_place(program, roots)
    for n in program.nodes:
        run.ops.append(n.name)
        if n.op in ("input", "param"):
            full = np.asarray(source_array(n, feeds[n.name]), dtype=n.type.dtype)  # fused views
            full = cp_feed(program, n, full)  # balanced chunking: storage order
            for r, local in enumerate(split_for_ranks(full, n.layout, mesh, partial_rng)):
                live[r][n.name] = local
        elif n.op in _LAYOUT_OPS:
            _layout_op(program, n, run, live)
        elif is_ring(n):  # context parallel ring attention: K/V blocks around the ring
            run.p2p.append(run_ring(program, n, live))
        else:
            for r in ranks:  # at_rank: where this rank's block lies (ranked.py); MoE slots packed
                live[r][n.name] = moe_packed.apply(NUMPY_OPS[n.op], at_rank(program, n, r),
                                                   [live[r][i] for i in n.inputs], run.moe[r])
        for r in ranks:
            _account(n, live[r], roots, size[r], run, r)
    for public, value in program.named_outputs():
        if isinstance(run.env[0][value], moe_packed.SlotRows):
            raise moe_packed.NotPacked(f"%{value}: slots as a program output ({public})")
    return run


def check_in_place(program: Graph, roots: dict) -> None:
    """No ``inplace`` node may write into a broadcast view: its first operand must not be
    an ``expand`` (or a view of one, or an in-place result living in one). numpy would
    compute the value (its ``expand`` is a copy), but the emitted program's ``x.add_(y)``
    on a stride-0 tensor dies under torchrun ("more than one element of the written-to
    tensor refers to a single memory location"); the in-place pass never marks such a node
    (:func:`parcomp.ir.liveness.broadcast_view`), a hand-written ``.pcir`` may.

    ``roots``: :func:`storage_roots` of ``program``.

    Raises:
        VerifyError: naming the node, the value it writes into and the ``expand`` (its
            ``node`` attribute is the node's name, for a caller with the source text).
    """
    for n in program.nodes:
        if not (n.attr("inplace") and n.inputs):
            continue
        x = n.inputs[0]
        expand = broadcast_view(program, x, roots[x])
        if expand:
            via = "" if expand == x else f", a view of the broadcast %{expand}"
            err = VerifyError(f"%{n.name} ({n.op}, inplace=true) writes into %{x}{via}: a broadcast "
                              "(expand) view whose elements share memory, which torch refuses to write "
                              "(\"more than one element of the written-to tensor refers to a single memory "
                              "location\"); drop inplace=true on it\n  at: " + describe(n))
            err.node = n.name
            raise err


def _account(n, live, roots, size, run, r):
    """Record ``n``'s value, drop what it overwrote or freed, update rank r's peak."""
    run.env[r][n.name] = live[n.name]
    size.setdefault(roots[n.name], moe_packed.nbytes(live[n.name]))
    if n.attr("inplace"):
        del live[n.inputs[0]]  # its buffer now holds n's value
    held = sum(size[b] for b in {roots[v] for v in live})
    run.peak_bytes[r] = max(run.peak_bytes[r], held)
    for v in frees_of(n):
        live.pop(v, None)


def _layout_op(program, n, run, live):
    mesh = program.mesh
    axes = mesh.axes_of(n.attr("axis"))  # one axis, or a joint group's (coordinate order)
    src = program[n.inputs[0]]
    sent = {}  # ragged all_to_all: rank -> bytes it sent
    for group in mesh.groups(axes):
        xs = [live[r][n.inputs[0]] for r in group]
        if any(isinstance(x, moe_packed.SlotRows) for x in xs):
            ys = _packed_layout_op(xs, n, sent, group)
        else:
            ys = _LAYOUT_OPS[n.op](xs, n) if not n.attr("ragged") else ragged_all_to_all(xs, n, sent, group)
        for r, y in zip(group, ys):
            live[r][n.name] = y if isinstance(y, moe_packed.SlotRows) else _contig(y)
    if TRANSITIONS[n.op].collective:  # local ops send nothing and are not logged
        gty = TensorType(_global_shape(program, n.name), n.type.dtype)
        step = Step(n.op, axes[0], n.attr("dim"), n.attr("src_dim"), src.layout, n.layout,
                    group=axes if len(axes) > 1 else ())
        run.log.append({"kind": n.op, "axis": n.attr("axis"), "dim": n.attr("dim"),
                        "name": n.name, "local_shape": tuple(src.type.shape),
                        "bytes": step_bytes(step, gty, mesh),
                        **({"sent_bytes": sent} if n.attr("ragged") else {})})


def _packed_layout_op(xs, n, sent, group):
    """A layout op of MoE slots held packed (parcomp/reference/moe_packed.py): the exchange
    between rows-split and experts-split, a sum over tp inside the experts, a partial mask."""
    if n.op == "all_to_all":
        return moe_packed.exchange(xs, n, sent if n.attr("ragged") else None, group)
    if n.op == "all_reduce":
        return moe_packed.summed(xs, n)
    if n.op == "partial_mask":
        return moe_packed.masked(xs, n)
    raise moe_packed.NotPacked(f"%{n.name}: {n.op} of slots")


def _sum(xs):
    total = xs[0].copy()
    for x in xs[1:]:
        total = total + x
    return total


def _reduce(xs, n):
    """The group's sum, or its elementwise max for ``reduce_op="max"`` (a P(max))."""
    return np.maximum.reduce([np.asarray(x) for x in xs]) if n.attr("reduce_op") == "max" else _sum(xs)


_LAYOUT_OPS = {  # the simulation of each op of the transition table (TRANSITIONS)
    "all_reduce": lambda xs, n: [_reduce(xs, n)] * len(xs),
    "all_gather": lambda xs, n: [np.concatenate(xs, axis=n.attr("dim"))] * len(xs),
    "reduce_scatter": lambda xs, n: np.split(_sum(xs), len(xs), axis=n.attr("dim")),
    "all_to_all": lambda xs, n: [
        np.concatenate([np.split(x, len(xs), axis=n.attr("dim"))[j] for x in xs], axis=n.attr("src_dim"))
        for j in range(len(xs))],
    "shard_slice": lambda xs, n: [np.split(x, len(xs), axis=n.attr("dim"))[c] for c, x in enumerate(xs)],
    "partial_mask": lambda xs, n: [x if c == 0 or n.attr("reduce_op") == "max" else np.zeros_like(x)
                                   for c, x in enumerate(xs)],
}
assert set(_LAYOUT_OPS) == set(TRANSITIONS), "one simulation per layout op of the transition table"
