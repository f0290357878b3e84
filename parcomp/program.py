"""The Program: everything a backend needs to print one rank's code, as fields.

A :class:`Program` is what ``compile_graph`` hands to every backend (and what
``report.json`` is derived from): the per-rank graph (``stage local``), the mesh
and its process groups (arithmetic, never a list of the world's ranks), the
training loop's facts, each collective's bytes, reason and cause, and every
node's phase and provenance.  A backend reads these fields; it never parses a
name, a report dict or a reason string to recover them.

Backends import only :mod:`parcomp.ir` and this module; what else of the
compiler they use is re-exported here (see ``__all__``).  No torch here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import ParcompError
from .gcpause import no_cycle_collection  # noqa: F401 - re-exported for the backends (emit)
from .ir.graph import PHASES, Graph
from .ir.ops import COLLECTIVES
from .ir.types import Shard, TensorType, layout_str
from .passes.bucket import bucketed_members
from .passes.cp_balance import outputs as cp_outputs
from .passes.cp_ring import ring_records
from .passes.placement import format_placement, placement_table
from .passes.topology import axis_groups, group_ranks, joint_groups
from .passes.train_config import MAX_STEPS, train_config
from .redistribute import Step, step_bytes
from .reference.interpreter import assemble
from .report import plural

__all__ = ["Program", "Collective", "Provenance", "TrainLoop", "build_program", "PHASES",
           "ParcompError", "MAX_STEPS", "axis_groups", "group_ranks", "assemble", "plural",
           "placement_table", "format_placement", "cp_outputs"]


@dataclass(frozen=True)
class Provenance:
    """Why a node exists: the spec rule that caused it and the model code it came from.

    Attributes:
        spec_file: basename of the spec file (``tp2.pcs``; never a machine path), or None.
        spec_line: 1-based line of the rule in that file, or None.
        source: module path in the model (``mlp.c_fc``) where the frontend knows it, or None.
    """

    spec_file: str | None = None
    spec_line: int | None = None
    source: str | None = None

    @property
    def spec_ref(self) -> str | None:
        """``tp2.pcs:7``, or None when no spec rule caused the node."""
        return f"{self.spec_file}:{self.spec_line}" if self.spec_file else None


@dataclass(frozen=True)
class Collective:
    """One collective (or local layout change) of the program, with its cost and cause.

    ``bytes`` are bytes sent per rank by a ring algorithm
    (:func:`parcomp.redistribute.step_bytes`); ``local_shape`` is its operand's per-rank shape.
    """

    name: str
    kind: str
    axis: str
    dim: int | None
    dtype: str
    local_shape: tuple
    src_layout: str
    dst_layout: str
    bytes: int
    phase: str
    producer: str
    consumers: tuple
    reason: str
    provenance: Provenance

    def record(self) -> dict:
        """The ``report.json`` record of this collective."""
        return {"name": self.name, "kind": self.kind, "axis": self.axis, "dim": self.dim,
                "dtype": self.dtype, "local_shape": list(self.local_shape), "from": self.src_layout,
                "to": self.dst_layout, "bytes": self.bytes, "phase": self.phase,
                "producer": self.producer, "consumers": list(self.consumers), "reason": self.reason,
                "spec_line": self.provenance.spec_ref}


@dataclass(frozen=True)
class TrainLoop:
    """A training program's loop: what each step carries to the next.

    Attributes:
        steps: the spec's ``steps`` (the default of a program's ``--steps``).
        carried: public output names that are the next step's params and optimizer state
            (each is the name of the param it replaces).
        state: the optimizer-state params: zeros at step 1, not read from a checkpoint.
        step: the input fed the step number k = 1..K (AdamW's), or None.
        loss_output: public name of the loss output.
        loss, optimizer: ``mse`` ..., ``sgd`` | ``adamw``; ``hyperparameters``: sorted pairs.
        zero: ZeRO stage (0, 1, 2); ``dp``: size of the dp axis (1 without one);
        batch: global batch (dim 0 of the inputs), or None.
        options: the train line's clip_grad_norm / lr_schedule / accumulate
            (:class:`parcomp.passes.train_options.TrainOptions`, issue 13).
    """

    steps: int
    carried: tuple
    state: tuple
    step: str | None
    loss_output: str
    loss: str
    optimizer: str
    hyperparameters: tuple
    zero: int
    dp: int
    batch: int | None
    options: object = None


@dataclass(frozen=True, eq=False)
class Program:
    """One rank's program and the facts about it every backend and the report read.

    Attributes:
        graph: the per-rank graph (``stage local``, with its mesh).
        groups: ``{mesh axis: axis_groups(...)}`` (size, stride, count: no rank lists), and
            ``{"dp,tp": joint_groups(...)}`` for each joint group a collective runs over.
        spec_file: the spec's path as given (for the report), or None.
        phases: ``{value: forward | loss | backward | optimizer}`` for every node.
        provenance: ``{value: Provenance}`` for every node.
        collectives: the collectives and local layout changes, in program order.
        train: the loop facts of a training program, or None for a forward program.
        search: shard-prop's account of the layout search (``search``: dp | ilp |
            heuristic, ``proven_optimal``, ``cost_s``, ``seconds``), or None.
        pipeline: the :class:`parcomp.passes.pipeline_plan.PipelinePlan` of a training spec
            with a ``pp`` mesh axis (stages, their programs, per-stage action lists, the
            simulation), or None.
        launch: how program.py runs on a cluster: the spec's ``topology`` (nodes, devices
            per node) or None, and its ``placement`` / ``timeout`` keys where given.
    """

    graph: Graph
    groups: dict
    spec_file: str | None
    phases: dict
    provenance: dict
    collectives: tuple
    train: TrainLoop | None
    search: dict | None = None
    launch: dict | None = None  # {topology: (nodes, per node) | None, placement=, timeout=} (issue 16)
    pipeline: object = None

    @property
    def mesh(self):
        return self.graph.mesh

    @property
    def spec_name(self) -> str | None:
        """The spec file's basename (what a program may print), or None."""
        return os.path.basename(self.spec_file) if self.spec_file else None

    def group_ranks(self, axis: str) -> list:
        """The rank lists of mesh axis ``axis``, in coordinate order (O(world size))."""
        return group_ranks(self.groups[axis])

    def collective(self, name: str) -> Collective | None:
        """The :class:`Collective` record of node ``name`` (the first of that name), or None."""
        index = self.__dict__.get("_by_name")
        if index is None:  # built once (the records are immutable): a lookup per node stays linear
            index = {}
            for c in self.collectives:
                index.setdefault(c.name, c)  # the first record of a name, as a scan finds
            object.__setattr__(self, "_by_name", index)
        return index.get(name)


def build_program(sharded: Graph, local: Graph, spec) -> Program:
    """The :class:`Program` of a compiled graph.

    Args:
        sharded: the global graph with every collective (after ``insert-collectives``).
        local: the per-rank graph (after ``localize``); same node names.
        spec: the parsed spec (its ``file`` and ``train`` line).

    Raises:
        parcomp.errors.SpecError: a bad ``train`` line (already checked by then).
    """
    mesh = local.mesh
    groups = {a: axis_groups(mesh, i) for i, a in enumerate(mesh.names)}
    for n in local.nodes:  # joint groups (issue 11): one entry per axis set a collective uses
        if n.op in COLLECTIVES and n.attr("axis") not in groups:
            groups[n.attr("axis")] = joint_groups(mesh, mesh.axes_of(n.attr("axis")))
    prov = _provenances(local.nodes)
    return Program(local, groups, getattr(spec, "file", None), {n.name: n.phase for n in local.nodes},
                   prov, _collectives(sharded, local, prov), _train_loop(local, spec), sharded.search,
                   {"topology": getattr(spec, "topology", None), **dict(getattr(spec, "launch", ()))})


def _provenances(nodes) -> dict:
    """``{name: _provenance(node)}``; nodes with the same spec rule and source share one
    (immutable, compared by value) record: a deep model's nodes have few distinct ones."""
    made, out = {}, {}
    for n in nodes:
        loc = n.spec_loc
        key = (n.source,) if loc is None else (n.source, loc.file, loc.line)
        got = made.get(key)
        if got is None:
            got = made[key] = _provenance(n)
        out[n.name] = got
    return out


def _provenance(node) -> Provenance:
    loc = node.spec_loc
    if loc is None:
        return Provenance(source=node.source)
    return Provenance(os.path.basename(loc.file), loc.line, node.source)


def _collectives(sharded, local, prov) -> tuple:
    users, outs = sharded.users(), {v: p for p, v in sharded.named_outputs()}
    recs, bucketed = [], set()
    for n in sharded.nodes:
        recs += [Collective(**r, provenance=prov[n.name]) for r in ring_records(sharded, local, n)]  # issue 14
        if n.op not in COLLECTIVES:
            continue
        bucket = bucketed_members(local, n.name)  # norms part (issue 17): passes/bucket.py
        if bucket is not None:
            if bucket[0].name not in bucketed:
                bucketed.add(bucket[0].name)
                recs.append(_bucket_record(sharded, local, bucket, prov))
            continue
        src = sharded[n.inputs[0]]
        step = _step(sharded.mesh, n, src)
        consumers = [f"{sharded[u].op} %{u}" for u in users[n.name]]
        if n.name in outs:
            consumers.append(f"output {outs[n.name]}")
        recs.append(Collective(
            n.name, n.op, n.attr("axis"), n.attr("dim"), n.type.dtype, tuple(local[src.name].type.shape),
            layout_str(src.layout), layout_str(n.layout), step_bytes(step, n.type, sharded.mesh),
            n.phase, src.name, tuple(consumers), _collective_reason(local, n), prov[n.name]))
    return tuple(recs)


def _collective_reason(local, n):
    """``n``'s reason; a ragged all_to_all's (issue 14, parcomp/passes/moe_ragged.py) says how it sends."""
    if n.name not in local or not local[n.name].attr("ragged"):
        return n.attr("reason")
    return (n.attr("reason") or "") + ("; ragged: only the routed tokens' rows travel, after the per-rank "
                                       "split sizes (one byte per row); bytes here: the padded buffer's, "
                                       "an upper bound")


def _step(mesh, n, src, after=None) -> Step:
    """The :class:`Step` layout op ``n`` (one axis or a joint group) takes ``src`` by."""
    axes = mesh.axes_of(n.attr("axis"))
    return Step(n.op, axes[0], n.attr("dim"), n.attr("src_dim"), src.layout,
                n.layout if after is None else after, group=axes if len(axes) > 1 else ())


def _bucket_record(sharded, local, bucket, prov) -> Collective:
    """The one all_reduce of a bucket of gradients (its members' records merged): norm-weight
    gradients (passes/bucket.py) or dp gradients (passes/dp_buckets.py, issue 16). Bytes are
    the flat buffer's, whose layout is the bucket_cat's (a split member makes it S(0))."""
    ar, parts = bucket
    cat = local[ar.inputs[0]]
    step = _step(sharded.mesh, ar, cat, ar.layout)
    flat = TensorType((ar.type.numel * _split_ranks(cat.layout, sharded.mesh),), ar.type.dtype)
    consumers = tuple(f"bucket_part %{p}" for p in parts)
    return Collective(ar.name, "all_reduce", ar.attr("axis"), None, ar.type.dtype, tuple(ar.type.shape),
                      layout_str(cat.layout), layout_str(ar.layout), step_bytes(step, flat, sharded.mesh),
                      ar.phase, ar.inputs[0], consumers, ar.attr("reason"), prov[ar.name])


def _split_ranks(layout, mesh) -> int:
    """How many ranks' blocks make the global value of a ``layout`` (the split axes' sizes)."""
    n = 1
    for size, p in zip(mesh.sizes, layout):
        n *= size if isinstance(p, Shard) else 1
    return n


def _train_loop(local, spec) -> TrainLoop | None:
    """The loop facts, from the phases ``autodiff`` set (nothing is read from a name's shape)."""
    if getattr(spec, "train", None) is None:
        return None
    cfg = train_config(spec)
    params = {n.name for n in local.params}
    carried = tuple(pub for pub, _ in local.named_outputs() if pub in params)
    optimizer = {n.name for n in local.params if n.phase == "optimizer"}
    state = tuple(c for c in carried if c in optimizer)
    step = next((n.name for n in local.inputs if n.phase == "optimizer"), None)
    dp = spec.mesh.sizes[spec.mesh.axis_index("dp")] if "dp" in spec.mesh.names else 1
    batch = cfg.batch or next((n.attr("global_shape")[0] for n in local.inputs
                               if n.attr("global_shape")), None)
    return TrainLoop(cfg.steps, carried, state, step, "loss", cfg.loss, cfg.optimizer, cfg.hyper,
                     cfg.zero, dp, batch, cfg.options)
