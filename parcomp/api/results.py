"""``parcomp.check`` and ``parcomp.explain`` from Python: the CLI's results as dataclasses.

``check`` runs the body of ``parcomp check`` (:func:`parcomp.cli.check_cmd.check`) on the
module the caller holds, so its verdict and numbers are the CLI's own: every rank of the sharded
program in float64 on the numpy interpreter against the unsharded graph (and the torch module);
with a ``train`` line, the spec's steps against the unsharded steps and torch.optim.
``explain`` compiles and reads the explanation the CLI prints (:func:`parcomp.report.explain.explain`).
Each result keeps the CLI's ``--json`` object as ``raw``.
"""
from __future__ import annotations

import contextlib
import io
import json
import weakref
from dataclasses import dataclass
from types import SimpleNamespace

from .specs import resolve_spec


@dataclass(frozen=True)
class Collective:
    """One collective of the compiled step: what, over which mesh axis, in which phase, how many
    bytes each rank sends, on which local shape (its operand's per-rank shape), and why it is
    there. ``check(...).collectives`` and ``explain(...).collectives`` (and each
    ``LayoutChange.steps``) are both tuples of it; ``explain`` also fills ``seconds`` (the
    cost model's estimate) and ``spec_line`` (the spec line that caused it), which ``check``
    leaves None. A member of a gradient bucket after its first is a step of ``explain`` with
    0 bytes (the bucket's one all_reduce carries them all), as in ``parcomp explain``."""

    kind: str
    axis: str
    phase: str
    bytes: int
    local_shape: tuple
    dim: int | None
    reason: str
    seconds: float | None = None
    spec_line: str | None = None

    @classmethod
    def from_json(cls, d: dict) -> "Collective":
        seconds = d.get("seconds")
        return cls(d["kind"], d["axis"], d["phase"], int(d["bytes"]), tuple(d.get("local_shape") or ()),
                   d.get("dim"), d.get("reason", ""), None if seconds is None else float(seconds), d.get("spec_line"))


#: the name ``explain``'s collectives had before they were :class:`Collective` (the same type now)
Step = Collective


@dataclass(frozen=True)
class Comparison:
    """One comparison of ``check`` (the program against the unsharded graph, or against torch):
    ``err_over_tol <= 1`` passes; ``worst`` names the element with the largest ratio."""

    ok: bool
    max_abs_err: float
    err_over_tol: float
    rtol: float
    worst: str | None
    why: str
    max_grad_err: float | None = None
    max_param_err: float | None = None
    max_loss_err: float | None = None

    @classmethod
    def from_json(cls, d: dict | None) -> "Comparison | None":
        if d is None:
            return None
        return cls(bool(d["ok"]), float(d["max_abs_err"]), float(d["err_over_tol"]), float(d["rtol"]),
                   d.get("worst"), d.get("why", ""), d.get("max_grad_err"), d.get("max_param_err"),
                   d.get("max_loss_err"))


@dataclass(frozen=True)
class CheckResult:
    """What ``parcomp check --json`` prints, as an object.

    Attributes:
        ok: the verdict is OK.
        verdict: ``OK``, ``FAIL`` or ``CANNOT VOUCH`` (a discrete choice on a near tie).
        result: the sharded program against the unsharded graph, in float64.
        vs_model: (forward) the program against the torch module, in its dtype; or None.
        vs_torch: (training) the steps against torch.optim; or None.
        losses, reference_losses: (training) each step's loss, sharded and unsharded.
        collectives: every collective of the step.
        world_size: ranks in the mesh.
        raw: the CLI's JSON object.
    """

    ok: bool
    verdict: str
    result: Comparison
    vs_model: Comparison | None
    vs_torch: Comparison | None
    losses: tuple | None
    reference_losses: tuple | None
    collectives: tuple
    world_size: int
    raw: dict

    def __bool__(self) -> bool:
        return self.ok

    @classmethod
    def from_json(cls, d: dict) -> "CheckResult":
        losses = d.get("losses")
        ref = d.get("reference_losses")
        return cls(bool(d["ok"]), d.get("verdict", "OK" if d["ok"] else "FAIL"), Comparison.from_json(d),
                   Comparison.from_json(d.get("vs_model")), Comparison.from_json(d.get("vs_torch")),
                   None if losses is None else tuple(losses), None if ref is None else tuple(ref),
                   tuple(Collective.from_json(c) for c in d["collectives"]), int(d["world_size"]), d)


@dataclass(frozen=True)
class LayoutChange:
    """A value that changes layout between its producer and its consumers, the collectives
    that do it, their cost, and the alternatives the search weighed."""

    value: str
    module: str | None
    phase: str
    from_layout: str
    to_layout: str
    kinds: str
    bytes: int
    seconds: float
    steps: tuple
    alternatives: tuple


@dataclass(frozen=True)
class Explanation:
    """What ``parcomp explain --json`` prints under ``explain``, as an object.

    Attributes:
        mesh: ``{axis: size}``; world_size; training: the spec has a train line.
        changes: every layout change (:class:`LayoutChange`), in program order.
        collectives: every collective of every change, flattened (:class:`Collective`, as
            ``check``'s, with ``seconds`` and ``spec_line``).
        memory_bytes_per_rank: weights, gradients, optimizer state, saved activations, peak.
        totals: bytes, counts and seconds per axis and phase; estimated_comm_seconds.
        raw: the CLI's JSON object (``{"explain": ..., ...}``).
        dtensor: for a DTensor plan, DTensor's own collectives on it against these, per block
            (:class:`parcomp.api.dtensor_compare.DTensorComparison`; ``str()`` of it is the
            text); None for a parcomp spec.
    """

    mesh: dict
    world_size: int
    training: bool
    changes: tuple
    collectives: tuple
    memory_bytes_per_rank: dict
    totals: dict
    estimated_comm_seconds: float
    raw: dict
    dtensor: object = None

    def count(self, kind: str | None = None, phase: str | None = None) -> int:
        """How many collectives (of ``kind``, in ``phase``) the step runs."""
        return sum(1 for c in self.collectives if (kind is None or c.kind == kind)
                   and (phase is None or c.phase == phase))

    @classmethod
    def from_json(cls, raw: dict) -> "Explanation":
        """``raw``: ``parcomp explain --json``'s object; a step's ``local_shape`` is read from
        ``raw["local_shapes"]`` (collective name -> per-rank shape) where ``explain`` put it."""
        x = raw["explain"]
        shapes = raw.get("local_shapes") or {}
        changes = []
        for e in x["edges"]:
            steps = tuple(Collective(s["kind"], s["axis"], s.get("phase", e["phase"]), int(s["bytes"]),
                                     tuple(shapes.get(s.get("name"), ())), s.get("dim"), s.get("reason", ""),
                                     float(s["seconds"]), s.get("spec_line")) for s in e["steps"])
            changes.append(LayoutChange(e["value"], e.get("module"), e["phase"], e["from"], e["to"], e["kinds"],
                                        int(e["bytes"]), float(e["seconds"]), steps, tuple(e.get("alternatives", ()))))
        return cls(x["mesh"], int(x["world_size"]), bool(x.get("training")), tuple(changes),
                   tuple(s for c in changes for s in c.steps), x["memory_bytes_per_rank"], x["totals"],
                   float(x["estimated_comm_seconds"]), raw)


_GRAPHS = weakref.WeakKeyDictionary()  # module -> {(input signature, names, mode): graph}


def imported_graph(module, example_inputs, input_names=None):
    """``module`` traced by torch.export and lowered (:func:`import_torch`), once per module,
    input shapes and dtypes, input names and train/eval mode: a property test that checks many
    specs of one model imports it once. (A module whose code or structure changes in between
    is not noticed: pass a new module.)"""
    from ..frontends.torch.export import import_torch

    key = (tuple((tuple(x.shape), str(x.dtype)) for x in example_inputs), tuple(input_names or ()), module.training)
    per = _GRAPHS.setdefault(module, {})
    if key not in per:
        per[key] = import_torch(module, tuple(example_inputs), input_names)
    return per[key]


_import = imported_graph


def check(module, example_inputs, spec, *, steps: int | None = None, seed: int = 0,
          input_names=None) -> CheckResult:
    """``parcomp check`` of ``module`` under ``spec`` (a Spec, a ``.pcs`` path or text, or a
    DTensor plan): one process, no torch.distributed. A spec with a ``train`` line checks its
    ``steps`` training steps (``steps=`` overrides, as ``--steps``).

    Raises:
        ParcompError: the spec does not fit the model (located), as the CLI's exit 2.
    """
    from ..cli.check_cmd import check as check_command

    graph = _import(module, example_inputs, input_names)
    spec = resolve_spec(spec, module, graph)
    args = SimpleNamespace(model=(graph, module, tuple(example_inputs)), spec=spec, json=True, seed=seed,
                           steps=steps)
    with contextlib.redirect_stdout(io.StringIO()):
        raw = check_command(args)
    return CheckResult.from_json(json.loads(json.dumps({"ok": raw.get("ok", True), **raw}, sort_keys=True)))


def explain(module, example_inputs, spec, *, input_names=None, train: str | None = None,
            compare_dtensor: bool = True) -> Explanation:
    """``parcomp explain`` of ``module`` under ``spec``: each collective, why, its cost.

    For a DTensor plan (``(plan dict, mesh)``), ``train`` is a ``train ...`` line to add to its
    translation, and (``compare_dtensor``) ``.dtensor`` says where DTensor running the plan
    itself would issue more collectives than parcomp's program (:mod:`.dtensor_compare`).

    Raises:
        ParcompError: the spec does not fit the model (located).
    """
    from ..compile.compiler import compile_graph
    from ..report.explain import explain as explain_compiled
    from ..report.explain_pipeline import pipeline_record

    graph = _import(module, example_inputs, input_names)
    plan = _plan_of(spec)
    if plan is not None:
        from .dtensor_plan import mesh_axes, plan_spec

        parsed = plan_spec(plan, module, graph, train=train)
    else:
        parsed = resolve_spec(spec, module, graph)
    compiled = compile_graph(graph, parsed)
    raw = {"ok": True, "explain": explain_compiled(compiled), "plots": None}
    prog = compiled.program_  # each step's per-rank operand shape, as check's collectives have it
    raw["local_shapes"] = {c.name: list(c.local_shape) for c in prog.collectives} if prog is not None else {}
    pipe = pipeline_record(compiled)
    if pipe:
        raw["pipeline"] = pipe
    spcp = compiled.report.get("sp_vs_cp")
    if spcp:
        raw["sp_vs_cp"] = spcp
    x = Explanation.from_json(json.loads(json.dumps(raw, sort_keys=True)))
    if plan is not None and compare_dtensor:
        from dataclasses import asdict, replace

        from .dtensor_compare import compare

        cmp = compare(module, tuple(example_inputs), plan[0], mesh_axes(plan[1]), x)
        raw["dtensor_comparison"] = {**asdict(cmp), "lines": cmp.lines()}
        x = replace(x, dtensor=cmp, raw=raw)
    return x


def _plan_of(spec):
    """``(plan dict, mesh)`` when ``spec`` is a DTensor plan with its mesh, else None."""
    if isinstance(spec, tuple) and len(spec) == 2 and any(isinstance(s, dict) for s in spec):
        return spec if isinstance(spec[0], dict) else spec[::-1]
    return None


def spec_from_plan(plan: dict, mesh, module, example_inputs=None, *, train: str | None = None,
                   input_names=None) -> str:
    """The ``.pcs`` text a DTensor plan (``{module path: ColwiseParallel(), ...}`` over ``mesh``, a
    DeviceMesh or ``{"tp": 2}``) translates to (:mod:`parcomp.api.dtensor_plan`); with
    ``example_inputs`` the inputs' and outputs' layouts too; ``train``: a ``train ...`` line to add.
    Save it as a ``.pcs`` file, or pass it as the spec."""
    from .dtensor_plan import mesh_axes, plan_text

    graph = None if example_inputs is None else _import(module, example_inputs, input_names)
    return plan_text(plan, mesh_axes(mesh), module, graph, train)
