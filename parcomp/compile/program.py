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

from ..cost.placement import format_placement, placement_table
from ..cost.topology import axis_groups, group_ranks
from ..errors import ParcompError
from ..ir.graph import PHASES, Graph
from ..reference.assemble import assemble
from ..reference.cp_storage import outputs as cp_outputs
from ..spec.train_config import MAX_STEPS
from ..units import plural
from .gcpause import no_cycle_collection  # noqa: F401 - re-exported for the backends (emit)

__all__ = ["Program", "Collective", "Provenance", "TrainLoop", "PHASES",
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
    (:func:`parcomp.ir.redistribute.step_bytes`); ``local_shape`` is its operand's per-rank shape.
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
            (:class:`parcomp.spec.train_options.TrainOptions`).
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
        pipeline: the :class:`parcomp.passes.pipeline.pipeline_plan.PipelinePlan` of a training spec
            with a ``pp`` mesh axis (stages, their programs, per-stage action lists, the
            simulation), or None.
        launch: how program.py runs on a cluster: the spec's ``topology`` (nodes, devices
            per node) or None, and its ``placement`` / ``timeout`` keys where given.
        stages: with ``pipeline``, per virtual stage ``{kind: Program}`` of its lowered
            programs (``forward``, ``backward``, ``optimizer``, ...; ``train`` None): what the
            stage functions are printed from, as the SPMD step is from this Program; else ().
    """

    graph: Graph
    groups: dict
    spec_file: str | None
    phases: dict
    provenance: dict
    collectives: tuple
    train: TrainLoop | None
    search: dict | None = None
    launch: dict | None = None  # {topology: (nodes, per node) | None, placement=, timeout=}
    pipeline: object = None
    stages: tuple = ()

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
