"""Each pipeline stage's programs through the lowering passes of the one pass list.

The pass ``lower-stages`` (:mod:`parcomp.passes.pass_list`) runs after ``split-stages``: every
program a stage runs (forward, backward, optimizer, the ``stats`` of ``clip_grad_norm``, ZB-H1's
``backward_input`` and ``backward_weight``) goes through group ``lower`` of the list, the passes
the SPMD program goes through (fused matmuls and reductions, fused and in-place optimizer
updates, overlapped all_reduces, ``frees``), so the pipelined program.py prints the same
statements the SPMD program of the same layouts does.  The programs lowered are the per-rank
ones with tp inside the stages (``plan.local``, ``plan.split``), else the stages' own graphs.

What the lowering may not change, it does not: a program's inputs, params and named outputs
stay (the runtime feeds and reads them by name), inputs are never written in place (the
passes leave sources alone but a param or optimizer state the optimizer phase updates, whose
result is that program's output under the param's name).  Pure: plan in, plan out.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from parcomp.ir.graph import Graph

__all__ = ["StageLowered", "lower_stages", "KINDS"]

#: the programs of a stage, in the order a step runs them
KINDS = ("forward", "backward", "backward_input", "backward_weight", "stats", "optimizer")


@dataclass(frozen=True, eq=False)
class StageLowered:
    """One virtual stage's lowered programs: what program.py prints and the interpreter runs.

    Attributes:
        programs: ``{kind: lowered graph}`` for each kind of :data:`KINDS` the stage has
            (``stats`` with clip_grad_norm only, ``backward_input``/``backward_weight`` with
            ZB-H1 only).
        sharded: ``{kind: global sharded graph}`` the lowered per-rank program came from (tp
            inside the stage: its collectives with global types, for their bytes); empty for
            a stage whose programs are its own unsharded graphs.
    """

    programs: dict
    sharded: dict

    def __getattr__(self, kind):  # lowered.forward, lowered.optimizer, ...
        try:
            return self.__dict__["programs"][kind]
        except KeyError:
            raise AttributeError(kind) from None


def _unlowered(plan, s: int) -> tuple:
    """``({kind: graph}, {kind: sharded graph})`` of virtual stage ``s`` before lowering."""
    st = plan.stages[s]
    src = plan.local[s] if plan.local else st
    progs = {"forward": src.forward, "backward": src.backward, "optimizer": src.optimizer}
    if st.stats is not None:
        progs["stats"] = src.stats
    sharded = dict(getattr(src, "sharded", None) or {})
    if plan.split:
        progs["backward_input"] = plan.split[s].backward_input
        progs["backward_weight"] = plan.split[s].backward_weight
        if "backward" in sharded:  # each half's collectives are the whole backward's
            sharded["backward_input"] = sharded["backward_weight"] = sharded["backward"]
    return {k: progs[k] for k in KINDS if k in progs}, sharded


def lower_stages(plan, lower) -> object:
    """``plan`` (a :class:`~.pipeline_plan.PipelinePlan`) with ``lowered``: one
    :class:`StageLowered` per virtual stage, each program through ``lower(graph) -> Graph``
    (group ``lower`` of the pass list, verified after each pass)."""
    shared = _shared_on_a_rank(plan)
    out = []
    for s in range(len(plan.stages)):
        progs, sharded = _unlowered(plan, s)
        low = {k: _lowered(lower, g) for k, g in progs.items()}
        if shared:
            low["optimizer"] = _out_of_place(low["optimizer"], shared)
        out.append(StageLowered(low, sharded))
    return replace(plan, lowered=tuple(out))


def _lowered(lower, graph: Graph) -> Graph:
    got = lower(graph)
    assert got.output_names == graph.output_names, "lowering renamed a stage program's outputs"
    return got


def _shared_on_a_rank(plan) -> set:
    """Tied params two model chunks of one rank both update (interleaved schedules): each
    chunk's update reads the step's old value, so neither may write it in place."""
    return {p for p, held in plan.tied if len({plan.rank_of_stage(t) for t in held}) < len(held)}


def _out_of_place(graph: Graph, shared: set) -> Graph:
    """``graph`` with no update written into the buffer of a param of ``shared`` or its state
    (``<p>.<state>``)."""
    def owned(name):
        return any(name == p or name.startswith(p + ".") for p in shared)

    roots = {}
    for n in graph.nodes:  # an in-place result lives in its first operand's buffer
        roots[n.name] = roots.get(n.inputs[0], n.inputs[0]) if n.attr("inplace") else n.name
    return graph.with_nodes([
        replace(n, attrs=tuple((k, v) for k, v in n.attrs if k != "inplace"))
        if n.attr("inplace") and graph[roots[n.name]].op == "param" and owned(roots[n.name]) else n
        for n in graph.nodes])
