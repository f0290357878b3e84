"""The pipeline section of ``parcomp explain`` for a spec with a ``pp`` axis: each stage's
modules and devices, the schedule, the point-to-point sends of one microbatch with their
bytes, the bubble (the idle fraction of a step), and per pp rank its memory (weights,
gradients, optimizer state, the schedule's peak stash) and the p2p bytes of a step.

Nothing is recomputed here: the stages, sends and bubble come from the compiled program's
:class:`~parcomp.passes.pipeline.pipeline_plan.PipelinePlan` (the analytic bubble of
:func:`parcomp.passes.pipeline.schedule.analytic`, the simulated one of
:func:`parcomp.passes.pipeline.schedule.simulate` on the stages' forward FLOPs), the devices from the
placement table (:func:`parcomp.cost.placement.placement_table`), the modules from the
balancing units of :func:`parcomp.passes.pipeline.split_stages.module_units`.
"""
from __future__ import annotations

from ..passes.pipeline.split_stages import module_units
from ..units import format_bytes

#: the analytic bubble of each schedule with equal stage times (parcomp/passes/pipeline/schedule.py: analytic):
#: its formula, and the denominator from (pp, m, virtual)
FORMULAS = {"gpipe": ("(pp-1)/(m+pp-1)", lambda pp, m, v: m + pp - 1),
            "1f1b": ("(pp-1)/(m+pp-1)", lambda pp, m, v: m + pp - 1),
            "interleaved": ("(pp-1)/(virtual*m+pp-1)", lambda pp, m, v: v * m + pp - 1),
            "zb-h1": ("(pp-1)/(3m+pp-1)", lambda pp, m, v: 3 * m + pp - 1)}


def pipeline_record(compiled) -> dict | None:
    """The pipeline section of ``compiled`` (None without a pipeline): ``{"pp", "dp",
    "schedule", "virtual", "microbatches", "micro_batch", "stages": [{"stage", "pp_rank",
    "modules", "ranks", "send": [{"value", "shape", "bytes"}], "recv": [...]}], "bubble_formula",
    "bubble_analytic", "bubble_simulated"}``; bytes are one microbatch's activation sent forward
    by each rank of a stage to its peer (its gradient comes back in backward: the same bytes)."""
    plan = compiled.program_.pipeline
    if plan is None:
        return None
    units, rep = module_units(compiled.unsharded), compiled.report["pipeline"]
    ranks = compiled.report["placement_table"]["ranks"]
    stages = []
    for st in plan.stages:
        mods = list(dict.fromkeys(u for n, u in units.items() if plan.stage_of.get(n) == st.index))
        pp_rank = plan.rank_of_stage(st.index)
        mem = rep["stages"][st.index]
        stages.append({"stage": st.index, "pp_rank": pp_rank, "modules": mods,
                       "ranks": [r["rank"] for r in ranks if r["stage"] == pp_rank],
                       "send": _values(st.forward, st.send), "recv": _values(st.forward, st.recv),
                       **{k: mem[k] for k in MEMORY_KEYS}})
    return {**{k: rep[k] for k in ("pp", "dp", "schedule", "virtual", "microbatches", "micro_batch",
                                   "bubble_analytic", "bubble_simulated")},
            "stages": stages, "bubble_formula": _formula(plan.schedule, plan.pp, plan.microbatches, plan.virtual),
            "ranks": _rank_memory(stages, plan.pp, plan.microbatches)}


#: the per-stage memory figures of report.json's pipeline record (one rank of the stage)
MEMORY_KEYS = ("weight_bytes", "grad_bytes", "optimizer_state_bytes", "stash_bytes_per_microbatch",
               "peak_inflight_microbatches", "peak_inflight_bytes")


def _rank_memory(stages, pp, m) -> list:
    """Per pp coordinate (every rank of it holds the same): its stages' weights, gradients and
    optimizer state, the peak stash of the schedule (its stages' in-flight microbatches times
    their stash), their sum, and the p2p bytes one rank sends in a step (each activation
    forward and its gradient back, per microbatch)."""
    out = []
    for r in range(pp):
        mine = [s for s in stages if s["pp_rank"] == r]
        row = {k: sum(s[k] for s in mine) for k in ("weight_bytes", "grad_bytes", "optimizer_state_bytes",
                                                    "peak_inflight_bytes")}
        sent = sum(v["bytes"] for s in mine for v in s["send"] + s["recv"]) * m
        out.append({"pp_rank": r, "ranks": mine[0]["ranks"], **row, "total_bytes": sum(row.values()),
                    "p2p_bytes_per_step": sent})
    return out


def _formula(schedule, pp, m, virtual) -> str:
    """``(pp-1)/(m+pp-1) = 1/5``: the schedule's analytic bubble, with its numbers."""
    if schedule not in FORMULAS:
        return ""
    text, den = FORMULAS[schedule]
    return f"{text} = {pp - 1}/{den(pp, m, virtual)}"


def _values(graph, names) -> list:
    return [{"value": v, "shape": list(graph[v].type.shape), "bytes": int(graph[v].type.nbytes)}
            for v in names]


def pipeline_blocks(rec: dict) -> list:
    """``parcomp explain``'s blocks (:mod:`parcomp.report.explain_text`) for :func:`pipeline_record`."""
    m, pp = rec["microbatches"], rec["pp"]
    virt = f", {rec['virtual']} chunks per rank" if rec["virtual"] > 1 else ""
    rows = []
    for s in rec["stages"]:
        sends = ", ".join(f"%{v['value']} {'x'.join(map(str, v['shape']))} {format_bytes(v['bytes'])}"
                          for v in s["send"]) or "- (the loss)"
        rows.append([str(s["stage"]), _modules(s["modules"]), " ".join(map(str, s["ranks"])),
                     sends, format_bytes(sum(v["bytes"] for v in s["send"]))])
    return [("text", [f"pipeline: pp={pp} schedule {rec['schedule']}{virt}: {m} microbatch"
                      f"{'' if m == 1 else 'es'} of {rec['micro_batch']} x dp {rec['dp']}"]),
            ("table", "pipeline stages (p2p per microbatch, each rank to its peer; backward returns the same bytes)",
             ["stage", "modules", "ranks", "sends to the next stage", "bytes/microbatch"], rows),
            ("text", [f"bubble (idle fraction of a step): {rec['bubble_analytic']:.3f} with equal stages, "
                      f"{rec['bubble_formula']}; {rec['bubble_simulated']:.3f} simulated on these stages' FLOPs"]),
            ("table", "per-rank memory of each pp rank (one rank of it; stash: the schedule's peak "
                      "in-flight microbatches x each stage's stash), and the p2p bytes it sends in a step",
             ["pp rank", "ranks", "weights", "grads", "optimizer state", "stash peak", "total", "p2p/step"],
             [[str(r["pp_rank"]), " ".join(map(str, r["ranks"])), format_bytes(r["weight_bytes"]),
               format_bytes(r["grad_bytes"]), format_bytes(r["optimizer_state_bytes"]),
               format_bytes(r["peak_inflight_bytes"]), format_bytes(r["total_bytes"]),
               format_bytes(r["p2p_bytes_per_step"])] for r in rec["ranks"]])]


def _modules(mods: list) -> str:
    """The modules of a stage, the first and last of a long run: ``0 .. 71 (72 modules)``."""
    if len(mods) <= 3:
        return ", ".join(mods) or "-"
    return f"{mods[0]} .. {mods[-1]} ({len(mods)} modules)"
