"""The compiler's front door: graph + spec -> sharded graph, per-rank program, report."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ..cost.memory import check_peak
from ..cost.topology import check_topology
from ..ir.graph import Graph
from ..passes.attention.cp_balance import check_ends as check_balanced_ends
from ..passes.moe_capacity import apply_moe_spec  # the spec's MoE capacity
from ..passes.pass_list import logical_stage, model_stage, passes_for, program_stage, run_passes
from ..passes.pipeline.pipeline_plan import attach_pipeline
from ..passes.train.accumulate import accumulate_warnings, loss_accumulation
from ..report.cp_report import sp_cp_record  # SP vs CP
from ..report.report import build_report
from .build import build_program, stage_programs
from .gcpause import no_cycle_collection
from .moe_warnings import moe_gather_warnings
from .pinned_gathers import pinned_gather_warnings
from .program import Program
from .repeat_compile import reuse_fits, reused_stages
from .zero_warnings import zero_warnings


@dataclass(frozen=True)
class Compiled:
    """What ``compile_graph`` returns.

    Attributes:
        unsharded: the model's graph as imported (with the spec's MoE capacity, if it has a
            ``moe`` statement: parcomp/passes/moe_capacity.py).
        logical: the unsharded graph of what the program computes (with layouts
            bound; for training, with loss, backward and update): the ground
            truth the program must equal.
        sharded: global types, every layout and every collective explicit.
        program: per-rank types (``stage local``), lowered (parcomp/passes/lowering/lower.py):
            what the interpreter and the backends execute, op for op.
        report: collectives with kind, axis, bytes and reason (see :mod:`parcomp.report.report`),
            derived from ``program_``.
        spec: the parsed spec.
        program_: the :class:`parcomp.compile.program.Program` (``program`` with mesh groups, train
            loop, phases, provenance, collectives): what backends read.
        reused: whether the stages were stamped from a reduced compile (block-plan reuse,
            :mod:`parcomp.compile.repeat_compile`) rather than the pass pipeline on the whole graph.
    """

    unsharded: Graph
    logical: Graph
    sharded: Graph
    program: Graph
    report: dict
    spec: object = None
    program_: Program | None = None
    reused: bool = False


def compile_graph(graph: Graph, spec, after: Callable | None = None, reuse: bool = True) -> Compiled:
    """Compile ``graph`` under ``spec``; ``after(pass_name, graph)`` sees each stage.

    With ``reuse`` (the default) and no ``after``, a model of many repeated blocks whose
    plan search is the heuristic is compiled by reusing a few blocks' plan
    (:mod:`parcomp.compile.repeat_compile`; the same result, checked); ``reuse=False`` or an
    ``after`` callback (it needs every pass's whole graph) compile the whole graph.
    Whether reuse ran is ``Compiled.reused`` (the report is the same either way).

    Raises:
        parcomp.errors.ParcompError: spec/model mismatch, uneven shards, invalid IR, a
            ``tp`` group that spans nodes of the spec's topology, a model whose own
            mesh line or layouts do not fit the spec's mesh.
    """
    with no_cycle_collection():  # parcomp/compile/gcpause.py
        return _compile(graph, spec, after, reuse)


def _compile(graph: Graph, spec, after, reuse=True) -> Compiled:
    passes = passes_for(spec)  # the one pass list (parcomp/passes/pass_list.py), for this spec
    stages = None
    if reuse and after is None and reuse_fits(spec):
        stages = reused_stages(graph, spec, passes)  # None: reuse does not apply (parcomp/compile/repeat_compile.py)
    reused = stages is not None
    if stages is None:
        stages = run_passes(graph, spec, passes, after)
    graph = model_stage(stages)  # with the spec's MoE capacity
    moe_changes = apply_moe_spec(stages["input"], spec)[1] if "moe-capacity" in stages else []
    placement = check_topology(spec)  # the list's check-topology passed: the placement
    sharded, program = stages["insert-collectives"], program_stage(stages)  # lowered
    logical = logical_stage(stages)
    check_balanced_ends(sharded, spec, {name for name, _ in graph.named_outputs()})  # chunking=balanced needs split-seq ends
    prog = build_program(sharded, program, spec)
    report = build_report(prog, [n.name for n in graph.params])
    report["placement"] = placement
    if moe_changes:
        report["moe_capacity"] = moe_changes
    check_peak(report, spec)
    report["warnings"] = zero_warnings(logical, spec) + pinned_gather_warnings(
        sharded, report, getattr(getattr(spec, "context_parallel", None), "axis", None))
    report.update(sp_cp_record(graph, spec, placement, sharded))  # SP vs CP (parcomp/report/cp_report.py)
    report["warnings"] += moe_gather_warnings(graph, sharded)  # tokens gathered, not all_to_all
    report["warnings"] += accumulate_warnings(graph, spec)  # a per-microbatch token mean, averaged
    if loss_accumulation(graph, spec):  # accumulate=K, loss=output: token mean or mean of K losses
        report["training"]["loss_accumulation"] = loss_accumulation(graph, spec)
    if "split-stages" in stages:  # a pp mesh axis and a train line: the pipeline's plan, its
        plan = stages["lower-stages"]  # stages' programs lowered as the SPMD program
        prog, report = attach_pipeline(plan, spec, prog, report)
        prog = replace(prog, stages=stage_programs(plan, spec))
    return Compiled(graph, logical, sharded, program, report, spec, prog, reused)
