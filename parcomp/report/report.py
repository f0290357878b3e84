"""The compile report: every collective, why it is there, and what it costs.

``report.json`` is this dict, derived from the :class:`parcomp.compile.program.Program`
(which holds every fact as a field).  Bytes are bytes sent per rank by a ring
algorithm (:func:`parcomp.ir.redistribute.step_bytes`); shapes are per-rank.
"""
from __future__ import annotations

from ..cost.load_plan import checkpoint_load
from ..passes.lowering.dp_buckets import grad_buckets
from ..units import format_bytes, plural
from .moe_report import moe_exchange


def memory(program, model_params) -> dict:
    """Per-rank bytes: weights, gradients, optimizer state, saved activations, peak live.

    ``program`` is a :class:`parcomp.compile.program.Program`.  Saved activations are
    values computed before the backward pass (phase ``forward`` or ``loss``, not
    params) that a backward node reads: what autograd would keep alive between
    forward and backward, plus the float32 logsumexp per query row an attention's fused
    kernel keeps for its backward (:func:`parcomp.ir.liveness.saved_attention`) and the mean and
    rstd per row of a layer norm's (:func:`parcomp.ir.liveness.saved_layer_norm`; not in
    ``peak_live``, which counts graph values only). ``peak_live`` is the most bytes live at once while the
    (lowered) program runs, by the liveness the interpreter and program.py's ``del``
    lines follow (:func:`parcomp.ir.liveness.peak_bytes`).
    """
    from ..ir.liveness import (attention_saved_bytes, layer_norm_saved_bytes, peak_bytes, saved_attention,
                               saved_layer_norm)

    graph, phase = program.graph, program.phases
    # the values some backward node reads (what read_by_backward asked of each value's users)
    read_by_backward = {i for n in graph.nodes if phase[n.name] == "backward" for i in n.inputs}
    grads = {v for p, v in graph.named_outputs() if p.endswith(".grad") and p[:-5] in model_params}

    def nbytes(names):
        return int(sum(graph[n].type.nbytes for n in set(names)))

    saved = [n.name for n in graph.nodes if n.op not in ("input", "param")
             and phase[n.name] in ("forward", "loss") and n.name in read_by_backward]
    saved += [n.name for n in graph.inputs if n.name in read_by_backward]
    # an attention's fused kernel keeps its logsumexp for the backward (program.py's attention_forward)
    kernel = sum(attention_saved_bytes(graph[v].type, graph[v].type.nbytes) for v in saved_attention(graph))
    # a layer norm's kernel keeps its mean and rstd per row (program.py's layer_norm_forward)
    kernel += sum(layer_norm_saved_bytes(graph[v].type, graph[v].type.nbytes) for v in saved_layer_norm(graph))
    return {"weights": nbytes(p for p in model_params if p in graph),
            "gradients": nbytes(grads),
            "optimizer_state": nbytes(n.name for n in graph.params if n.name not in model_params),
            "saved_activations": nbytes(saved) + kernel, "peak_live": peak_bytes(graph)}


def options_record(opts) -> dict:
    """The training options as report.json writes them."""
    name, args = opts.schedule
    from ..passes.train.precision import precision_record

    mixed = getattr(opts, "precision", "fp32") != "fp32"  # mixed precision
    return {"clip_grad_norm": opts.clip_grad_norm, "accumulate": opts.accumulate,
            "lr_schedule": {"name": name, **dict(args)}, **(precision_record(opts) if mixed else {})}


def training_summary(program) -> dict | None:
    """Loss, optimizer and batch arithmetic (global batch = microbatch x dp), or None."""
    t = program.train
    if t is None:
        return None
    k = t.options.accumulate if t.options else 1  # accumulate=K microbatches per step
    micro = None if t.batch is None else t.batch // (t.dp * k)
    acc = f" x accumulate {k}" if k > 1 else ""
    return {"loss": t.loss, "optimizer": t.optimizer, "hyperparameters": dict(t.hyperparameters),
            "zero": t.zero, "steps": t.steps, "dp": t.dp, "global_batch": t.batch,
            "microbatch_per_dp_rank": micro,
            "batch_note": f"global batch {t.batch} = microbatch {micro}{acc} x dp {t.dp}",
            **({"options": options_record(t.options)} if t.options else {})}


def build_report(program, model_params=()) -> dict:
    """The whole report of a :class:`parcomp.compile.program.Program`: mesh, collectives, per-axis
    totals, memory, training (derived from the Program, never the other way round)."""
    recs = [c.record() for c in program.collectives]
    totals = {}
    for r in recs:
        t = totals.setdefault(r["axis"], {"count": 0, "bytes": 0})
        t["count"] += 1
        t["bytes"] += r["bytes"]
    return {
        "mesh": dict(program.mesh.axes),
        "world_size": program.mesh.size,
        "spec": program.spec_file,
        "collectives": recs,
        "totals_per_axis": totals,
        "memory_bytes_per_rank": memory(program, set(model_params)),
        "checkpoint_load": checkpoint_load(program, set(model_params)),
        "training": training_summary(program),
        "search": (_with_note(program.search, recs, weight_values(program.graph))
                   if program.train or (program.search or {}).get("data_parallel") is False else program.search),
        "grad_buckets": grad_buckets(program),  # passes/lowering/dp_buckets.py
        **({"moe_exchange": moe} if (moe := moe_exchange(program.graph, recs)) else {}),
    }


def weight_values(graph) -> frozenset:
    """The names of the values of ``graph`` computed from params and constants alone (no model
    input among their ancestors): a param, its low-precision copy, its transpose. Gathering one
    over dp is ZeRO's (or a dp-split rule's) parameter gather, not an activation's."""
    data = set()
    for n in graph.nodes:
        if n.op == "input" or any(i in data for i in n.inputs):
            data.add(n.name)
    return frozenset(n.name for n in graph.nodes if n.name not in data)


def _with_note(search, recs, weights=frozenset()):
    """The search record, with a note when activations are gathered over a batch axis (``dp``,
    or ``ep`` where it splits the batch: parcomp/passes/search/keep_dp.py) or no plan keeps the batch
    split: a reader of "data parallel" expects gradient all_reduce, so the report says why it
    is not, naming the op that forces it where the search found one (``batch_gathered_by``).
    A gather of one of ``weights`` (:func:`weight_values`: ZeRO's parameter gathers) is no
    activation's and is not counted."""
    if search is None:
        return search
    axes = search.get("batch_axes") or ["dp"]
    gathers = [r for r in recs if set(axes) & set(r["axis"].split(",")) and r["kind"] == "all_gather"
               and r["phase"] in ("forward", "loss") and r["producer"] not in weights]
    kept = search.get("data_parallel") is not False
    if kept and not gathers:
        return search
    over = " and ".join(axes)
    moved = sum(r["bytes"] for r in gathers)
    head = (f"activations are all-gathered over {over} ({plural(len(gathers), 'all_gather')}, "
            f"{format_bytes(moved)} per rank), so every {over} rank holds and computes on the whole "
            "batch of those values" if gathers else
            f"the batch is not kept split over {over} (every {over} rank computes on the whole batch "
            "of some values)")
    if kept:
        note = (f"{head}: the search keeps the batch split over {over} wherever a plan can, so the "
                "spec pins these gathered layouts (an output or activation rule)")
    else:
        by = search.get("batch_gathered_by")
        cause = ("a pinned layout, or dims no strategy splits evenly" if by is None else
                 by["why"] + (f" (module {by['module']})" if by.get("module") else ""))
        note = (f"{head}: the search keeps the batch split over {over} wherever a plan can, but no "
                f"plan here can: {cause}")
    return {**search, "note": note}


def format_collectives(recs) -> str:
    """A plain-text table of collectives, one row each, then the reasons (bytes in human units)."""
    if not recs:
        return "collectives: none"
    head = ("#", "kind", "axis", "dim", "local shape", "bytes/rank", "phase", "value")
    rows = [(str(i), r["kind"], r["axis"], "-" if r["dim"] is None else str(r["dim"]),
             "x".join(map(str, r["local_shape"])), format_bytes(r["bytes"]), r["phase"], r["producer"])
            for i, r in enumerate(recs)]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines = [f"collectives: {len(recs)}", "  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines += [f"  [{i}] why: {r['reason']}" for i, r in enumerate(recs)]
    return "\n".join(lines)


def format_memory(report) -> str:
    """One line of per-rank memory in human units (:func:`format_bytes`), plus the batch
    arithmetic when training. A pipeline (``report["pipeline"]``): one line per stage (pp
    coordinate), what one of its ranks holds, instead of the unpipelined program's line."""
    m = report["memory_bytes_per_rank"]
    line = "memory per rank: " + ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in m.items())
    if (report.get("pipeline") or {}).get("ranks"):
        line = "\n".join(
            f"memory per rank of {_stage_words(r)}: weights {format_bytes(r['weight_bytes'])}, gradients "
            f"{format_bytes(r['grad_bytes'])}, optimizer state {format_bytes(r['optimizer_state_bytes'])}, "
            f"stashed activations at peak {format_bytes(r['stash_peak_bytes'])}"
            for r in report["pipeline"]["ranks"])
    if report.get("training"):
        line += "\n" + report["training"]["batch_note"]
    return line


def _stage_words(rank) -> str:
    """``stage 1``, or ``pp=0 (stages 0, 2)`` for a rank holding several (interleaved)."""
    if len(rank["stages"]) == 1:
        return f"stage {rank['stages'][0]}"
    return f"pp={rank['pp']} (stages {', '.join(map(str, rank['stages']))})"


def format_load(load, pipeline=None) -> str:
    """One line: what each rank reads of the checkpoint and the host memory that takes.
    ``pipeline`` (report.json's record of a pp spec): one line per stage, what a rank of it
    reads (its stages' params only, its tp block of each)."""
    if not load or not load["checkpoint_bytes"]:
        return "checkpoint load per rank: no params"
    if pipeline and pipeline.get("ranks"):
        total = load["checkpoint_bytes"]
        return "\n".join(f"checkpoint load per rank of {_stage_words(r)}: reads "
                         f"{format_bytes(r['checkpoint_bytes_read'])} of {format_bytes(total)} "
                         f"({r['checkpoint_bytes_read'] / total:.1%}, its stage's params only)"
                         for r in pipeline["ranks"])
    share = load["bytes_read"] / load["checkpoint_bytes"]
    return (f"checkpoint load per rank: reads {format_bytes(load['bytes_read'])} of "
            f"{format_bytes(load['checkpoint_bytes'])} ({share:.1%}, its own "
            f"slices only); host memory for it: {format_bytes(load['peak_host_bytes_cpu'])} with "
            f"--device cpu (the params stay there), {format_bytes(load['peak_host_bytes_accelerator'])} "
            f"on an accelerator (one slice at a time)")


_SEARCHES = {"dp": "dynamic program (exact: every value is read once)",
             "ilp": "integer program (HiGHS)", "heuristic": "DP + greedy + local moves"}


def format_search(search, training: bool | None = None) -> str:
    """One line: which search chose the layouts, its estimated cost, and whether it is
    proven optimal under the cost model (then the note on dp gathers, if any).  ``training``:
    whether the searched graph is a training step (the estimate then covers forward, backward
    and update, each gradient reduction priced on its own: ``parcomp plan``'s figure covers
    the forward pass it chose the parameters on, so the two differ; ``parcomp explain``
    prices the program's collectives per link class, without compute)."""
    if not search:
        return ""
    proof = ("proven optimal under the cost model" if search["proven_optimal"]
             else "not proven optimal (time budget ran out; best plan found)")
    if search.get("solver_skipped"):  # shard_prop: too large for the integer program
        proof = (f"not proven optimal ({search['solver_skipped']} strategies: too many for the "
                 f"integer program's budget, the heuristic's plan is kept)")
    if search.get("solver_skipped_columns"):  # shard_prop: its integer program has too many columns
        proof = (f"not proven optimal ({search['solver_skipped_columns']} columns: too many for the "
                 f"integer program's budget, the heuristic's plan is kept)")
    covers = {True: " per training step (forward, backward, update; gradient reductions before bucketing)",
              False: " for the forward pass", None: " per step"}[training]
    return (f"layouts: {_SEARCHES[search['search']]}, {proof}; search estimate (compute + layout "
            f"changes) {search['cost_s'] * 1e6:.1f} us{covers}, searched in {search['seconds']:.2f} s"
            + (f"\n  why: {search['note']}" if search.get("note") else ""))
