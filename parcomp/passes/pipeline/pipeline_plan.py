"""The pipeline plan of a spec with a ``pp`` axis: stages, their programs, schedule, simulation.

:func:`make_plan` (the pass ``split-stages`` of :mod:`parcomp.passes.pass_list`) runs
split-stages (:mod:`.split_stages`), builds each stage's forward / backward / optimizer
programs (:mod:`.stage_train`) for one microbatch, makes the action lists of the spec's schedule (:mod:`.schedule`) and simulates them before
anything is emitted.  The loss is the mean over the global batch: each microbatch's
loss is the mean over the microbatch, gradients are summed over the microbatches (and
over ``dp``) and scaled once by ``1 / (microbatches * dp)`` before the update.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from parcomp.errors import SpecError
from parcomp.ir.graph import Graph
from parcomp.ir.types import layout_str
from parcomp.spec.option_loc import option_loc
from parcomp.spec.train_config import BUCKET_KEY, bucket_cap_bytes, train_config
from ..train.precision import compute_dtype
from ..verify import verify
from .dp_buckets import dp_buckets
from .schedule import Simulation, analytic, build, rank_actions, simulate
from .split_stages import (assign_stages, balanced_rules, node_flops, param_stages, rebatch,
                           split_stages)
from .stage_train import reaching_params, stage_programs

__all__ = ["PipelinePlan", "make_plan", "attach_pipeline", "format_pipeline", "refuse_unpipelined_statements"]


@dataclass(frozen=True, eq=False)
class PipelinePlan:
    """Everything a backend needs to run a pipelined training step.

    Attributes:
        pp, dp: sizes of the ``pp`` and ``dp`` mesh axes (dp 1 without one).
        microbatches, schedule: from the train line (``microbatches`` times ``accumulate=K``:
            the microbatches are the accumulation); ``micro_batch``: dim 0 of one microbatch.
        batch: the global batch, ``micro_batch * microbatches * dp``.
        stage_of: ``{node name: stage}`` of the model graph.
        stages: one :class:`~parcomp.passes.pipeline.stage_train.StagePrograms` per stage.
        actions: one action list per stage (:func:`~parcomp.passes.pipeline.schedule.schedule`).
        simulation: the :class:`~parcomp.passes.pipeline.schedule.Simulation` of ``actions``.
        stage_flops: forward FLOPs of one microbatch per stage (the simulation's times).
        local: one :class:`~parcomp.passes.pipeline.stage_shard.StageLocal` per stage when the mesh
            has axes besides ``pp`` and ``dp`` larger than 1 (tp inside a stage), else ().
        tied: ``((param, (stage, ...)), ...)``: trainable params held by several stages (tied
            weights); their gradients are summed over those stages before the dp reduction.
        virtual: model chunks per rank (interleaved 1F1B; 1 otherwise): ``stages`` (and
            ``local``, ``split``) are the ``pp x virtual`` virtual stages, virtual stage
            ``c * pp + r`` on pp coordinate ``r``; ``actions`` one list per pp coordinate.
        split: ZB-H1: per virtual stage its backward cut into input- and weight-gradient
            programs (:class:`~parcomp.passes.pipeline.zb_split.SplitBackward`; of ``local``'s
            per-rank backward when tp is inside the stages), else ().
        dp_buckets: per pp coordinate the dp gradient buckets (``bucket_cap_mb``; see
            :mod:`.dp_buckets`), () when dp is 1.
        dp_reduce_dtype: ``grad_reduce=compute``: the compute dtype the dp reduction sends
            (each rank's float32 gradient sums rounded to it, summed in it, widened back);
            None: the sums' own dtype (float32).
    """

    pp: int
    dp: int
    microbatches: int
    schedule: str
    micro_batch: int
    batch: int
    stage_of: dict
    stages: tuple
    actions: tuple
    simulation: Simulation
    stage_flops: tuple
    local: tuple = ()
    tied: tuple = ()
    virtual: int = 1
    split: tuple = ()
    dp_buckets: tuple = ()
    lowered: tuple = ()
    dp_reduce_dtype: str | None = None

    @property
    def analytic_bubble(self) -> float:
        """The schedule's idle fraction with equal stages (:func:`.schedule.analytic`)."""
        return analytic(self.schedule, self.pp, self.microbatches, self.virtual)

    def rank_of_stage(self, stage: int) -> int:
        """The pp coordinate holding virtual stage ``stage``."""
        return stage % self.pp

    def rank_actions(self, mesh, rank: int) -> tuple:
        """The action list of global ``rank`` (peers as global ranks)."""
        return rank_actions(mesh, self.actions, rank)

    def latency(self) -> float:
        """One microbatch's forward through every stage, in the simulation's time unit (the
        largest stage's forward): the sum of the stages' times; pp does not shorten it."""
        top = max(self.stage_flops) or 1
        return sum(f / top for f in self.stage_flops)

    def report(self) -> dict:
        """The ``report.json`` record of the pipeline."""
        sim = self.simulation
        return {"pp": self.pp, "dp": self.dp, "schedule": self.schedule, "virtual": self.virtual,
                "microbatches": self.microbatches, "micro_batch": self.micro_batch,
                "global_batch": self.batch,
                "stages": [{"stage": s.index, "params": list(s.params), "recv": list(s.recv),
                            "send": list(s.send), "forward_flops": f,
                            "stash_bytes_per_microbatch": s.saved_bytes,
                            "peak_inflight_microbatches": peak,
                            "peak_inflight_bytes": peak * s.saved_bytes,
                            **stage_memory(s, self.local[s.index] if self.local else None)}
                           for s, f, peak in zip(self.stages, self.stage_flops,
                                                 [sim.peak_inflight[self.rank_of_stage(k)]
                                                  for k in range(len(self.stages))])],
                "latency_one_microbatch": self.latency(),
                "bubble_analytic": self.analytic_bubble, "bubble_simulated": sim.bubble,
                "makespan": sim.makespan,
                "tied": {p: list(held) for p, held in self.tied},
                "actions": [[str(a) for a in acts] for acts in self.actions],
                "collectives": self.collective_counts(), "ranks": self.rank_memory()}

    def rank_memory(self) -> list:
        """Per pp coordinate, what one of its ranks holds (its chunks' together; a param two
        of them hold counted once): ``{"pp", "stages", "weight_bytes", "grad_bytes",
        "optimizer_state_bytes", "stash_peak_bytes", "checkpoint_bytes_read"}``, the last the
        bytes it reads of the checkpoint (every param its stages' programs read, frozen ones
        too, as this rank's tp block)."""
        out = []
        for r in range(self.pp):
            chunks = list(range(r, len(self.stages), self.pp))
            held, trained, state = {}, {}, {}
            for t in chunks:
                st, local = self.stages[t], (self.local[t] if self.local else None)
                progs = local or st
                for g in (progs.forward, progs.backward, progs.optimizer):
                    for n in g.params:
                        (state if n.phase == "optimizer" else held)[n.name] = n.type.nbytes
                trained.update({p: held[p] for p in st.params if p in held})
            peak = self.simulation.peak_inflight[r]
            out.append({"pp": r, "stages": chunks, "weight_bytes": sum(trained.values()),
                        "grad_bytes": sum(trained.values()), "optimizer_state_bytes": sum(state.values()),
                        "stash_peak_bytes": max(peak * self.stages[t].saved_bytes for t in chunks),
                        "checkpoint_bytes_read": sum(held.values())})
        return out

    def collective_counts(self) -> list:
        """What one rank of each pp coordinate communicates in one training step: per pp
        coordinate a list of ``{"kind", "axis", "phase", "count"}``, sorted.

        This is what the pipelined program.py runs (``pipeline_main.step``), not the SPMD
        program's list in ``report["collectives"]``: the collectives inside each of the rank's
        stage programs (tp, ...) once per microbatch, phase ``forward``/``backward``/
        ``optimizer`` by the program; ``send``/``recv`` over ``pp``, one per tensor crossing
        the cut (phase ``forward`` for activations, ``backward`` for their gradients); then in
        phase ``optimizer`` one ``all_reduce`` over ``pp`` per tied gradient the rank holds (its
        group: the ranks of the stages holding the tied weight, same dp and tp coordinates),
        one over ``dp`` per gradient bucket (:mod:`.dp_buckets`; a ``reduce_scatter`` of the
        gradients ``zero=1`` splits), and one per tied gradient (not bucketed); and the loss's
        ``all_reduce`` over ``dp`` (phase ``loss``) on the rank holding the last stage."""
        from collections import Counter

        from parcomp.ir.ops import COLLECTIVES

        m = self.microbatches
        ranks_of = [{self.rank_of_stage(t) for t in held} for _, held in self.tied]
        out = []
        for r in range(self.pp):
            n = Counter()
            chunks = range(r, len(self.stages), self.pp)
            for t in chunks:
                progs = self.local[t] if self.local else self.stages[t]
                for phase, times in (("forward", m), ("backward", m), ("optimizer", 1)):
                    for node in getattr(progs, phase).nodes:
                        if node.op in COLLECTIVES:
                            n[node.op, node.attr("axis"), phase] += times
            for a in self.actions[r]:
                st = self.stages[a.chunk * self.pp + r]
                sizes = {"send_fwd": len(st.send), "recv_fwd": len(st.recv),
                         "send_bwd": len(st.recv), "recv_bwd": len(st.send)}
                if a.kind in sizes and sizes[a.kind]:
                    kind, direction = a.kind.split("_")
                    n[kind, "pp", "forward" if direction == "fwd" else "backward"] += sizes[a.kind]
            tied = sum(1 for held in ranks_of if r in held and len(held) > 1)
            if tied:
                n["all_reduce", "pp", "optimizer"] += tied
            if self.dp > 1:  # one call per bucket (zero=1: a reduce_scatter), tied gradients alone
                held = {p for t in chunks for p in self.stages[t].params}
                bucketed = set()
                for _, kind, names in self.dp_buckets[r]:
                    n[kind, "dp", "optimizer"] += 1
                    bucketed |= {g[len("grad."):] for g in names}
                if held - bucketed:
                    n["all_reduce", "dp", "optimizer"] += len(held - bucketed)
                if len(self.stages) - 1 in chunks:
                    n["all_reduce", "dp", "loss"] += 1
            out.append([{"kind": k, "axis": x, "phase": ph, "count": c}
                        for (k, x, ph), c in sorted(n.items())])
        return out


def stage_memory(stage, local=None) -> dict:
    """Bytes one rank of ``stage`` holds: its weights, their gradients (summed over
    microbatches) and the optimizer's state; with tp inside the stage (``local``, a
    :class:`~parcomp.passes.pipeline.stage_shard.StageLocal`), this rank's shards."""
    opt = local.optimizer if local is not None else stage.optimizer
    types = {n.name: n.type for n in opt.nodes}
    if local is None:
        types = {**{n.name: n.type for n in stage.forward.nodes}, **types}
    weights = sum(types[p].nbytes for p in stage.params)
    state = sum(n.type.nbytes for n in opt.params if n.phase == "optimizer")
    return {"weight_bytes": weights, "grad_bytes": weights, "optimizer_state_bytes": state}


def make_plan(graph: Graph, spec, bound: Graph, shard) -> PipelinePlan:
    """The :class:`PipelinePlan` of a global model ``graph`` under a spec with a ``pp`` axis
    and a ``train`` line. ``bound``: ``graph`` after the binding passes (the param layouts);
    ``shard(graph) -> (sharded, local)``: the list's sharding passes, run on each stage's
    programs when the mesh has axes inside a stage (:mod:`.stage_shard`).

    Raises:
        SpecError: bad stage statements (see :func:`.split_stages.assign_stages`), a batch
            that does not split into ``microbatches * dp`` equal parts, a hand-made
            schedule that cannot run (:class:`~parcomp.passes.pipeline.schedule.ScheduleError`),
            a spec statement or rule the stage programs would not apply
            (:func:`refuse_unpipelined_statements`).
    """
    cfg = train_config(spec)
    refuse_unpipelined_options(spec.train, cfg)
    refuse_unpipelined_statements(spec, bound)
    mesh = spec.mesh
    pp = mesh.sizes[mesh.axis_index("pp")]
    dp = mesh.sizes[mesh.axis_index("dp")] if "dp" in mesh.names else 1
    nvs = pp * cfg.virtual  # interleaved 1F1B: pp x virtual chunks
    at = option_loc(cfg.loc, "virtual" if "virtual=" in (cfg.loc.text or "") else "schedule")
    rules = spec.stages or balanced_rules(graph, nvs, (cfg.virtual, at) if cfg.virtual > 1 else None)
    stage_of = assign_stages(graph, rules, nvs)
    k = cfg.options.accumulate  # the model's batch is one of k (as unpipelined); k x the microbatches
    batch = cfg.batch or graph.inputs[0].type.shape[0] * k
    count = cfg.microbatches * k
    parts = count * dp
    if batch % parts:
        raise SpecError(f"the global batch {batch} does not split into microbatches={cfg.microbatches}"
                        f"{f' x accumulate={k}' if k > 1 else ''} x dp={dp} = {parts} equal parts", cfg.loc)
    micro = rebatch(graph, batch // parts)
    stages = split_stages(micro, stage_of, nvs)
    reaching = reaching_params(micro, cfg)
    first = {p: held[0] for p, held in param_stages(graph, stage_of).items()}  # counts a tied grad
    progs = tuple(stage_programs(st, cfg, st.index == nvs - 1, reaching,
                                 {p for p in st.params if first[p] == st.index}, parts) for st in stages)
    for p in progs:
        for g in (p.forward, p.backward, p.optimizer):
            verify(g)
    types = {n.name: n.type for n in micro.nodes}
    flops = tuple(sum(node_flops(n, types) for n in st.graph.nodes) for st in stages)
    top = max(flops) or 1
    acts = build(cfg.schedule, pp, count, cfg.virtual)
    per_rank = [sum(flops[r::pp]) / top for r in range(pp)]  # a rank's chunks together
    sim = simulate(acts, per_rank, [2 * f for f in per_rank])
    trained = {p for st in progs for p in st.params}
    tied = tuple((p, held) for p, held in param_stages(graph, stage_of).items()
                 if len(held) > 1 and p in trained)
    local = _local(bound, spec, progs, cfg, shard)
    split = _split(progs, local) if cfg.schedule == "zb-h1" else ()
    plan = PipelinePlan(pp, dp, count, cfg.schedule, batch // parts, batch, stage_of,
                        progs, acts, sim, flops, local, tied, cfg.virtual, split)
    cap = bucket_cap_bytes(spec, option_loc(spec.train.loc, BUCKET_KEY))
    return replace(plan, dp_buckets=dp_buckets(plan, cap), dp_reduce_dtype=dp_reduce_dtype(graph, cfg, dp))


def dp_reduce_dtype(graph: Graph, cfg, dp: int) -> str | None:
    """The dtype the dp reduction of the summed gradients sends: with ``grad_reduce=compute``
    and float32 master params, ``precision=``'s compute dtype (torch DDP's
    ``bf16_compress_hook`` / ``fp16_compress_hook``: cast, all_reduce, widen back), else None.
    A pipeline sums each microbatch's widened gradient in float32 before dp (the runtime's
    accumulation), so this is where the compute dtype can apply; a float64 model (``check``'s
    promotion) keeps its own dtype, as every compute-dtype cast it skips."""
    if cfg.options.grad_reduce != "compute" or dp < 2 or not any(p.type.dtype == "float32" for p in graph.params):
        return None
    return compute_dtype(cfg.options)


#: train options the pipelined step does not implement: ``(key, its value in cfg, the default)``
#: readers; given with a value other than the default, they would be silently ignored, so
#: they are refused (``precision=bf16`` under pp would otherwise check OK while the program
#: ran float32)
_NOT_PIPELINED = (
    ("zero", lambda c: 0 if c.zero == 1 else c.zero, 0),  # zero=1 is run (inside each stage)
)


def refuse_unpipelined_options(t, cfg) -> None:
    """Raise SpecError at the option's column for a train option of :data:`_NOT_PIPELINED`
    given with a non-default value, or a cross_entropy ``ignore_index``/``label_smoothing``, on a spec with a
    ``pp`` axis: the pipelined step would run without it."""
    given = {k for k, _ in t.options}
    for key, read, default in _NOT_PIPELINED:
        if key in given and (read(cfg) != default or default is None):
            raise SpecError(f"train option {key}= is not supported with a pp mesh axis: the pipelined "
                            f"step does not implement it and would run without it; remove it (pipelines "
                            f"take loss, optimizer, batch, steps, microbatches, schedule, stages, "
                            f"virtual, trainable, input_grads, output, clip_grad_norm, lr_schedule, "
                            f"accumulate, precision, loss_scale, growth_interval, grad_reduce, bucket_cap_mb, recompute and zero=1)", option_loc(t.loc, key))
    if cfg.loss_args:
        raise SpecError(f"loss={cfg.loss}({', '.join(f'{k}=' for k, _ in cfg.loss_args)}...) is not "
                        f"supported with a pp mesh axis: the pipelined loss is the plain mean cross "
                        f"entropy; remove the loss's options", option_loc(t.loc, "loss"))


def refuse_unpipelined_statements(spec, bound: Graph) -> None:
    """Raise SpecError at the statement or rule for a spec line the pipeline's stage programs
    would not apply: the stage programs are built from the model as given (before the binding
    passes) and take only the params' layouts from ``bound``; every other value of a stage
    (its batch inputs, the values crossing a cut, activations, the loss) is whole over the
    axes inside the stage. So ``context-parallel`` (attention would run on the whole sequence
    on every rank of its axis), ``sequence-parallel`` (norms on the whole sequence), and an
    ``input``/``activation``/``output`` rule that splits a value over an axis other than
    ``dp`` (or over ``dp`` other than the batch dim the runtime splits) would be dropped
    silently: the step would still equal the unsharded one, with the ranks of that axis
    repeating each other's work (docs/design/pipeline.md, "What a stage does not run")."""
    mesh = spec.mesh
    why = ("the stage programs of a pipeline take only the params' layouts inside a stage, so "
           "this line would be ignored (every rank of the axis would compute the same values)")
    cp = getattr(spec, "context_parallel", None)
    if cp is not None:
        raise SpecError(f"context-parallel over {cp.axis} is not supported inside pipeline stages yet "
                        f"(mesh {mesh}): {why}; attention would run on the whole sequence on every "
                        f"{cp.axis} rank. Remove the context-parallel line, or the pp axis", cp.loc)
    sp = getattr(spec, "sequence_parallel", None)
    if sp is not None:
        raise SpecError(f"sequence-parallel over {sp[0]} is not supported inside pipeline stages yet "
                        f"(mesh {mesh}): {why}; the norms would run on the whole sequence. Remove the "
                        f"sequence-parallel line (tensor parallel inside a stage runs without it), or "
                        f"the pp axis", sp[1])
    rules = {id(r.loc): r for r in spec.rules if r.target in ("input", "activation", "output")}
    for n in bound.nodes:
        rule = rules.get(id(n.spec_loc)) if n.spec_loc is not None and n.op in ("input", "relayout") else None
        if rule is None or n.layout is None:
            continue
        bad = [(a, pl) for a, pl in zip(mesh.names, n.layout)
               if str(pl) != "R" and not (a == "dp" and str(pl) == "S(0)")]
        if bad:
            a, pl = bad[0]
            value = n.inputs[0] if n.op == "relayout" else n.name  # the pinned value, not its pin
            what = ("the batch is split over dp along dim 0 by the runtime, whatever the rule says"
                    if a == "dp" else f"values other than params are whole over {a} inside a stage")
            raise SpecError(f"{rule.target} rule {rule.pattern} lays out {value} {layout_str(n.layout)} "
                            f"({a}={pl}), which pipeline stages do not apply (mesh {mesh}): {what}, so "
                            f"the rule would be ignored. Remove it or make it replicated"
                            f"{' (S(0) over dp is the batch split)' if 'dp' in mesh.names else ''}", rule.loc)


def _split(progs, local) -> tuple:
    """ZB-H1: each stage's backward (``local``'s per-rank one when there) cut into input- and
    weight-gradient programs (:mod:`.zb_split`)."""
    from .stage_train import grad_name
    from .zb_split import split_backward

    return tuple(split_backward((local[st.index] if local else st).backward,
                                {grad_name(v) for v in st.recv}) for st in progs)


def _local(bound, spec, progs, cfg, shard) -> tuple:
    """The stages' programs sharded over the mesh less pp and dp (:mod:`.stage_shard`), or ()
    when that mesh has one rank; with ``zero=1`` over dp > 1 the update and stats programs
    sharded over the mesh less pp as well."""
    from .stage_shard import inner_mesh, shard_stages

    zero = bool(cfg.zero) and "dp" in spec.mesh.names and spec.mesh.sizes[spec.mesh.axis_index("dp")] > 1
    if inner_mesh(spec.mesh).size == 1 and not zero:
        return ()
    return shard_stages(progs, bound, spec.mesh, cfg.loc, shard, zero)


def attach_pipeline(plan: PipelinePlan, spec, program, report: dict) -> tuple:
    """``(program with its pipeline field set to ``plan``, report with "pipeline" and
    "placement_table")``."""
    from dataclasses import replace

    from parcomp.cost.placement import placement_table

    training = report.get("training")
    if training:  # the batch arithmetic counts the microbatches too (global = m x micro x dp)
        training = {**training, "microbatch_per_dp_rank": plan.micro_batch, "microbatches": plan.microbatches,
                    "batch_note": f"global batch {plan.batch} = {plan.microbatches} microbatch"
                                  f"{'' if plan.microbatches == 1 else 'es'} of {plan.micro_batch} x dp {plan.dp}"}
    return replace(program, pipeline=plan), {**report, "pipeline": plan.report(), "training": training,
                                             "placement_table": placement_table(spec.mesh, spec.topology)}


def format_pipeline(report: dict) -> str:
    """The pipeline lines of ``parcomp compile``'s summary: schedule, batch, bubble, per-stage
    stash, then the placement table (from ``report.json``'s ``pipeline`` and ``placement_table``)."""
    from parcomp.cost.placement import format_placement

    p = report["pipeline"]
    lines = [f"pipeline: pp={p['pp']} schedule {p['schedule']}, global batch {p['global_batch']} = "
             f"microbatch {p['micro_batch']} x {p['microbatches']} microbatches x dp {p['dp']}; "
             f"bubble {p['bubble_analytic']:.3f} analytic, {p['bubble_simulated']:.3f} simulated"]
    for s in p["stages"]:
        lines.append(f"  stage {s['stage']}: {len(s['params'])} params, sends {len(s['send'])} "
                     f"value(s), peak {s['peak_inflight_microbatches']} microbatch(es) stashed "
                     f"({s['peak_inflight_bytes']} bytes); weights {s['weight_bytes']}, grads "
                     f"{s['grad_bytes']}, optimizer state {s['optimizer_state_bytes']} bytes")
    lines.append(f"  one microbatch's latency: {p['latency_one_microbatch']:.2f} x the largest stage's "
                 f"forward (the sum of the stages: pp does not shorten it)")
    return "\n".join(lines + [format_placement(report["placement_table"])])
