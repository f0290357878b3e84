"""``program.py`` for a pipelined training step (a spec with a ``pp`` mesh axis).

The program holds, as plain Python: the PROFILE block (the SPMD program's, for every device
profile), the placement table, every rank's actions (``ACTIONS``: the schedule parcomp simulated,
each run of sends and receives one slot, a ``batch_isend_irecv`` whose order on both ranks
:func:`parcomp.passes.pipeline.schedule.p2p_slots` checked), and per stage three functions printed
from the stage's lowered programs (``stage0_forward``, ``stage0_backward``, ``stage0_optimizer``:
``plan.lowered``, printed from ``Program.stages`` by the SPMD step's printer,
:func:`parcomp_backends.torch.emit.step_function`: one statement per node, its layout, type and
spec rule, a reason above each collective, ``del`` where values die); each point-to-point slot
and each all_reduce ``step()`` runs has its reason in a comment too.  The runtime is
the SPMD program's (:mod:`parcomp_backends.torch.runtime`: ``--device``, ``--key-map``,
``--load-report``, ``--compile``, ``--placement``, ``--print-launch``, ``--timeout`` on every
group, failures agreed by every rank, checkpoint loading where each rank reads only its stages'
bytes) with :mod:`parcomp_backends.torch.runtime.pipeline_main`'s step and loop: gradients are
summed over microbatches and ``all_reduce``-d over ``dp``, then scaled once by
1/(microbatches x dp).  The rank of ``dp`` (and ``tp``) coordinate 0 of each stage writes the
stage's outputs of the last step to ``OUTPUT.stageK``.  Nothing in it imports parcomp.  With
``tp`` inside the stages the functions are the per-rank programs
(:mod:`parcomp.passes.pipeline.stage_shard`); tied weights' gradients are summed over their
stages' ranks (``TIED_SETS``) before ``dp``.  ``--save`` and ``--resume`` are
:mod:`parcomp_backends.torch.runtime.pipeline_checkpoint`'s (with the SPMD program's checks);
``CARRIED`` lists per stage what they write and read.  ``--data``, ``--replay`` and the stop
on SIGTERM with ``--save`` are the SPMD training program's (:mod:`parcomp_backends.torch.runtime.program_train`).
"""
from __future__ import annotations

import json
import math
from dataclasses import replace

from parcomp.compile.program import MAX_STEPS, ParcompError, format_placement, placement_table

from parcomp.ir.index_inputs import index_inputs
from parcomp.ir.types import DTYPE_BYTES, Replicate

from parcomp.ir.ops import COLLECTIVES

from ..profiles import get_profile
from ..runtime import CLUSTER_HELP, IMPORTS, TRAIN_HELP, sections
from ..runtime.pipeline_checkpoint import CHECKPOINT as _CHECKPOINT
from .attention import attention_sections, stash_key, stashed_forwards
from .cluster import DEFAULT_PLACEMENT, DEFAULT_TIMEOUT_S, HOST_AXIS
from .moe import moe_sections
from .moe_dropless import DroplessPlan, dropless_plan
from .norms import runtime_sections, stash_key as norm_stash_key, stashed_norms
from .reduce import reduce_sections
from .sections import PARCOMP_VERSION, RUNTIME_MARK, comment_lines, profile_block, python_names

KINDS = ("forward", "backward", "backward_input", "backward_weight", "stats", "optimizer")

__all__ = ["check_pipeline_profile", "emit_pipeline_program", "pipeline_emittable", "PipelineEmitError"]


class PipelineEmitError(ParcompError):
    """The pipeline cannot be printed (a mesh axis this module does not emit inside a stage)."""



# the SPMD program's runtime, pasted whole: process facts, collectives, loading (each rank reads
# only its bytes), the cluster checks, --save/--resume's checks, main and the entry point
_COMMON, _TRAIN = sections("program_common"), sections("program_train")
_LOADING = sections("program_loading")["loading"]
_CLUSTER = "\n\n\n".join(sections("program_cluster").values())
_PIPELINE = sections("pipeline_main")["pipeline"]  # the step and the loop of a pipelined program


def _on_full_mesh(graph, mesh):
    """``graph`` (a stage program, on the mesh less pp/dp) with its layouts written on the full
    ``mesh`` (replicated over pp and dp), so a printed block offset reads ``COORD`` of the
    program's whole mesh; a graph of the full mesh already is returned as is."""
    if graph.mesh is None or tuple(graph.mesh.axes) == tuple(mesh.axes):
        return graph
    inner = graph.mesh.names

    def full(layout):
        if layout is None:
            return None
        by = dict(zip(inner, layout))
        return tuple(by.get(a, Replicate()) for a in mesh.names)
    return replace(graph, nodes=tuple(replace(n, layout=full(n.layout)) for n in graph.nodes), mesh=mesh)


#: the docstring of each stage function (the programs of :data:`KINDS`)
_DOCS = {"forward": "Stage {s}: forward of one microbatch.",
         "backward": "Stage {s}: backward of one microbatch; ready(name, value): each parameter gradient once final.",
         "backward_input": "Stage {s}: input gradients of one microbatch (ZB-H1's B), and what W reads (wstash.*).",
         "backward_weight": "Stage {s}: parameter gradients of one microbatch (ZB-H1's W), each to ready() once final.",
         "stats": "Stage {s}: its share of the sums every stage's update reads (summed over pp).",
         "optimizer": "Stage {s}: the update."}


def _specs(stage, values) -> list:
    g = stage.forward
    types = {n.name: n.type for n in g.nodes}
    return [(v, tuple(types[v].shape), types[v].dtype) for v in values]


def _file_shapes(plan) -> tuple:
    """``({param: (full shape, dtype)}, {input: (global shape, dtype)})`` over every stage:
    what program.py checks ``--checkpoint`` and ``--input`` against before it runs (the
    unsharded stage graphs hold full params and one microbatch of each input, dim 0
    ``micro_batch``; the input file holds ``microbatches x dp`` of them along dim 0)."""
    params, inputs = {}, {}
    for st in plan.stages:
        batch = {n.name for g in (st.forward, st.backward) for n in g.inputs} - set(st.recv) \
            - {f"grad.{v}" for v in st.send} - set(st.saved)
        for g in (st.forward, st.backward, st.optimizer):
            for n in g.nodes:
                if n.op == "param" and n.phase != "optimizer":
                    params[n.name] = (list(n.type.shape), n.type.dtype)
                elif n.op == "input" and n.name in batch:
                    shape = list(n.type.shape)
                    shape[0] *= plan.microbatches * plan.dp
                    inputs[n.name] = (shape, n.type.dtype)
    return dict(sorted(params.items())), dict(sorted(inputs.items()))


def check_pipeline_profile(profile: str) -> None:
    """Every device profile emits a pipelined program (its PROFILE block is the SPMD
    program's: cuda runs NCCL, ascend HCCL through torch_npu, cpu gloo; ``--device cpu`` runs
    any of them on CPU ranks under gloo).

    Raises:
        ProfileError: an unknown profile name.
    """
    get_profile(profile)


def pipeline_emittable(program) -> bool:
    """Whether this module can print ``program``'s pipeline: the mesh has no axis but ``pp``
    and ``dp`` larger than 1, or the plan holds the stages' programs sharded over those axes
    (``plan.local``, tp inside a stage)."""
    plan = program.pipeline
    return bool(plan is not None and plan.local) or all(
        a in ("pp", "dp") or n == 1 for a, n in program.mesh.axes)


def _splits(layout, mesh_names) -> list:
    """``[(dim, axis), ...]`` of a layout on the inner mesh (its Shard placements)."""
    return [(p.dim, a) for a, p in zip(mesh_names, layout) if hasattr(p, "dim")]


def _tied_groups(mesh, held) -> list:
    """For stages ``held``: one rank list per rank of stage ``held[0]``, the ranks with the
    same coordinates on every other axis in the stages of ``held``."""
    a = mesh.axis_index("pp")
    out = []
    for r in range(mesh.size):
        c = list(mesh.coords(r))
        if c[a] == held[0]:
            out.append([mesh.rank_of(tuple(c[:a]) + (t,) + tuple(c[a + 1:])) for t in held])
    return out


def _header(program, model, plan, mesh, table) -> list:
    """The module docstring: what the program is, its schedule, placement and options."""
    hint = _run_hint(mesh)
    return [f'"""parcomp pipelined training step: {program.spec_name or "spec"}'
            f"{f', model {model}' if model else ''}.",
            f"Emitted by parcomp {PARCOMP_VERSION} (torch backend). Below: the constants, the action lists and the",
            "stage functions; then, after the runtime line, the runtime.",
            "", f"mesh {mesh}, schedule {plan.schedule}"
            f"{f' ({plan.virtual} model chunks per rank)' if plan.virtual > 1 else ''}, "
            f"{plan.microbatches} microbatch(es) of "
            f"{plan.micro_batch}, global batch {plan.batch} = {plan.micro_batch} x "
            f"{plan.microbatches} x dp {plan.dp}; bubble {plan.analytic_bubble:.3f} (analytic), "
            f"{plan.simulation.bubble:.3f} (simulated).", "", format_placement(table), "",
            "Run one process per rank:", f"    {hint} [--device cpu]", "",
            *TRAIN_HELP.format(out="OUTPUT.stageK: each stage's outputs, written by the stage's first rank",
                               steps=program.train.steps if program.train else 1, step="",
                               cluster=CLUSTER_HELP).split("\n"),
            '"""']


def _attention_stash(progs) -> dict:
    """``{kind: {node: stash key}}`` for a stage's programs ``progs`` (``{kind: Program}``): each
    forward attention whose backward (or ZB-H1's B or W, whichever differentiates it: W's
    inputs hold B's, the stash's entries too) keeps its kernel's output and logsumexp in the
    microbatch's stash (emit/attention.py), so the backward runs the kernel's own backward on
    them instead of computing the forward again; likewise each forward layer norm's mean and
    rstd (emit/norms.py), read by the statement of its gradients in each program computing some."""
    out, fwd = {}, progs["forward"].graph
    for kind in ("backward", "backward_input", "backward_weight"):
        if kind in progs:
            pairs = stashed_forwards(fwd, progs[kind].graph)
            out.setdefault("forward", {}).update({src: stash_key(src) for src in pairs})
            out[kind] = {grad: stash_key(src) for src, grad in pairs.items()}
            norms = stashed_norms(fwd, progs[kind].graph)
            out["forward"].update({src: norm_stash_key(src) for src in norms})
            out[kind].update({at: norm_stash_key(src) for src, at in norms.items()})
    return out


def _run_hint(mesh) -> str:
    return (f"torchrun --nproc-per-node {mesh.size} program.py --checkpoint model.pt "
            f"--input inputs.pt --output out.pt")


def _collective_dtypes(plan) -> tuple:
    """The dtypes the program's collectives and point-to-point carry (a profile's dtype check)."""
    graphs = [g for st in (plan.local or plan.stages) for g in (st.forward, st.backward, st.optimizer)]
    out = {g[n.inputs[0]].type.dtype for g in graphs for n in g.nodes if n.op in COLLECTIVES}
    out |= {dt for st in plan.stages for _, _, dt in _specs(st, st.send)}
    out |= {plan.dp_reduce_dtype} - {None}
    return tuple(sorted(out))


def _dropless_plans(progs: dict, split: bool) -> list:
    """``[(kind, program, python names, DroplessPlan)]`` of one stage's programs: MoE layers on
    the routed tokens only (emit/moe_dropless.py), as in the SPMD program. The forward's slot
    values stashed for the backward stay packed when the backward's statements on them are
    packed too, else both programs keep the dense slot buffer. A backward split in two
    (ZB-H1) chains three programs: the input half reads the forward's packed stash and hands
    its packed slot values (``wstash.*``) to the weight half, which reads both; all packed or
    all dense."""
    names = {k: python_names(p) for k, p in progs.items()}
    plans = {k: dropless_plan(p, names[k]) for k, p in progs.items()}
    if "forward" in progs and "backward" in progs:
        fwd = dropless_plan(progs["forward"], names["forward"], stash_out=True)
        if fwd.active and fwd.stash:
            later = {"backward": dropless_plan(progs["backward"], names["backward"], stash_in=fwd.stash)}
            if split:
                routes = {c for _, c in fwd.stash.values()}
                half = dropless_plan(progs["backward_input"], names["backward_input"], stash_out=True,
                                     stash_in=fwd.stash, prefix="wstash.", kept_routes=routes)
                later["backward_input"] = half
                later["backward_weight"] = dropless_plan(progs["backward_weight"], names["backward_weight"],
                                                         stash_in={**fwd.stash, **half.stash})
            dense = next((q for q in later.values() if q.why), None)
            if not later["backward"].active:
                dense = dense or later["backward"]
            if dense is None:
                plans.update({"forward": fwd, **later})
            else:
                plans.update({k: DroplessPlan(why=dense.why) for k in ("forward", *later)})
        elif fwd.active:
            plans["forward"] = fwd
    return [(k, p, names[k], plans[k]) for k, p in progs.items()]


def _load_facts(plan) -> tuple:
    """``(STORED_SHAPES, STORED_ORDER, ALIASES)``: fused weights' stored shapes, a grouped
    q|k|v weight's head units in the order its view takes them (parcomp/passes/fused_weights.py,
    as the SPMD loader applies it), tied weights' other names."""
    stored, order, aliases = {}, {}, {}
    for st in plan.stages:
        for g in (st.forward, st.backward, st.optimizer):
            for n in g.params:
                if n.attr("part_of"):  # its loader reads params by their own names
                    raise PipelineEmitError(f"param {n.name}: a part of the multi-query fused weight "
                                            f"{n.attr('part_of')} (its rows read on load) is not built for "
                                            f"pipeline stages; compile it without a pp axis (tp splits its query rows)")
                if n.attr("stored_shape"):
                    stored[n.name] = list(n.attr("stored_shape"))
                if n.attr("stored_order"):
                    order[n.name] = list(n.attr("stored_order"))
                if n.attr("aliases"):
                    aliases[n.name] = tuple(n.attr("aliases").split(","))
    return dict(sorted(stored.items())), dict(sorted(order.items())), dict(sorted(aliases.items()))


def _nbytes(specs) -> int:
    return sum(math.prod(shape) * DTYPE_BYTES[dtype] for _, shape, dtype in specs)


def _p2p_reason(plan, ops) -> str:
    """The comment above a point-to-point slot: its bytes and why each send or receive is there."""
    sent, why = 0, []
    for kind, m, peer, s in ops:
        st = plan.stages[s]
        if kind in ("send_fwd", "recv_bwd"):
            names, size = ", ".join(v for v in st.send), _nbytes(_specs(st, st.send))
        else:
            names, size = ", ".join(v for v in st.recv), _nbytes(_specs(st, st.recv))
        if kind == "send_fwd":
            sent += size
            why.append(f"send_fwd m={m} -> rank {peer}: stage {s + 1}'s forward of microbatch {m} starts "
                       f"from stage {s}'s output {names}")
        elif kind == "recv_fwd":
            why.append(f"recv_fwd m={m} <- rank {peer}: this stage's forward of microbatch {m} starts from "
                       f"stage {s - 1}'s output {names}")
        elif kind == "send_bwd":
            sent += size
            why.append(f"send_bwd m={m} -> rank {peer}: stage {s - 1}'s backward of microbatch {m} starts "
                       f"from the loss's gradient with respect to {names}, which stage {s}'s backward made")
        else:
            why.append(f"recv_bwd m={m} <- rank {peer}: this stage's backward of microbatch {m} starts from "
                       f"the loss's gradient with respect to its output {names}")
    return f"send/recv over pp, bytes/rank {sent}: " + "; ".join(why)


def _reductions(plan) -> list:
    """The comments saying why ``step()`` all_reduces over dp (and over the tied weights'
    stages, and the stats over pp): the collectives of a pipelined step that no stage program
    holds."""
    out = []
    if plan.dp > 1:
        zero = bool(plan.local and plan.local[0].axes)
        kind, ring = ("reduce_scatter", (plan.dp - 1) / plan.dp) if zero else ("all_reduce", 2 * (plan.dp - 1) / plan.dp)
        for st in plan.stages:
            bw = plan.lowered[st.index].backward if plan.lowered else st.backward
            size = sum(bw[v].type.numel * DTYPE_BYTES[plan.dp_reduce_dtype or bw[v].type.dtype]
                       for pub, v in bw.named_outputs()
                       if pub.startswith("grad.") and pub[len("grad."):] in st.params)
            out += comment_lines(
                f"{kind} over dp of stage {st.index}'s {len(st.params)} gradients (GRADS), in the buckets of "
                f"DP_BUCKETS, bytes/rank {round(ring * size)} in all, once per step, each bucket started inside "
                f"the last backward adding to it, once its last gradient is final (ready): each dp replica summed its own microbatches' gradients, and "
                f"the update needs the gradient of the global batch, the sum over dp (then scaled by SCALE)"
                + ("; zero=1: each rank updates its part, so it needs only its part of the sum" if zero else ""), "")
        out += comment_lines(f"all_reduce over dp of the loss on the last stage, bytes/rank "
                             f"{round(2 * (plan.dp - 1) / plan.dp * 4)}: the loss printed is the mean over the "
                             f"global batch, every replica's share summed", "")
    if any(st.stats is not None for st in plan.stages):
        out += comment_lines("all_reduce over pp of the stages' STATS (clip_grad_norm's sum of squares, an fp16 "
                             "overflow count), bytes/rank a few scalars: every stage's update reads the total "
                             "over all stages (one global gradient norm)", "")
    if plan.tied:
        out += comment_lines("all_reduce of each tied weight's gradient over the ranks of the stages holding "
                             "a copy (TIED_SETS), before dp: each copy's update needs the gradient of every "
                             "use of the weight, the sum of its stages' shares", "")
    return out


def _dp_buckets(plan) -> list:
    """``DP_BUCKETS``, one bucket a line: per pp coordinate ``[stages, kind, [gradient, ...]]``."""
    out = ["# per pp coordinate, the dp gradient buckets (bucket_cap_mb): [stages whose last backward",
           "# starts it, all_reduce | reduce_scatter (zero=1), gradients in the order that backward makes",
           "# them final]; it starts inside that backward once its last gradient is (a tied gradient is",
           "# reduced alone, at the optimizer)",
           "DP_BUCKETS = {"]
    if not plan.dp_buckets:
        return out[:-1] + ["DP_BUCKETS = {}"]
    for r, buckets in enumerate(plan.dp_buckets):
        out.append(f"    {r}: [")
        for stages, kind, names in buckets:
            one = f"        [{list(stages)!r}, {kind!r}, {list(names)!r}],"
            if len(one) <= 100:
                out.append(one)
                continue
            out.append(f"        [{list(stages)!r}, {kind!r}, [")  # a long bucket: its gradients wrapped
            line = "           "
            for name in names:
                if len(line) + len(repr(name)) + 2 > 100 and line.strip():
                    out.append(line.rstrip())
                    line = "           "
                line += f" {name!r},"
            out += [line.rstrip(), "        ]],"]
        out.append("    ],")
    return out + ["}"]


def _actions(plan, mesh, table) -> list:
    """``ACTIONS``: every rank's list, each point-to-point slot of
    ``plan.simulation.slots`` (the order the schedule's simulator checked) one entry
    ``("p2p", (op, ...), None, None)``."""
    slots = plan.simulation.slots
    acts = ["# every rank's actions, (action, microbatch, peer rank, stage), run in order by step();",
            "# a (\"p2p\", ops, None, None) slot posts its sends and receives in one batch_isend_irecv and",
            "# waits for them all; parcomp ran every rank's slots together: each send meets its",
            "# receive in the same order on both ranks (NCCL and HCCL match by order), no deadlock",
            "ACTIONS = {"]
    for r in range(mesh.size):
        coord = table["ranks"][r]["stage"]
        mine = plan.rank_actions(mesh, r)

        def one(a):
            return (a.kind, a.micro, a.peer, a.chunk * plan.pp + coord)
        acts.append(f"    {r}: [  # stage {coord}")
        for e in slots[coord]:
            row = ("p2p", tuple(one(mine[k]) for k in e), None, None) if isinstance(e, tuple) else one(mine[e])
            if isinstance(e, tuple):  # why each send and receive is there, as above a collective
                acts += comment_lines(_p2p_reason(plan, row[1]), "        ")
            acts.append(f"        {row!r},")
        acts.append("    ],")
    acts.append("}")
    return acts


def emit_pipeline_program(program, model, code, profile="cpu", constants=()) -> str:
    """The text of ``program.py`` for a :class:`parcomp.compile.program.Program` whose ``pipeline``
    is set; ``model``: what it was imported from (for the docstring) or None; ``code``: the op
    printer, :func:`parcomp_backends.torch.emit.node_code` (emit.py passes it, so this module does not import emit.py);
    ``profile``: a :class:`parcomp_backends.torch.profiles.DeviceProfile` (its PROFILE block:
    the same as the SPMD program's); ``constants``: params parcomp computed at import.
    The runtime is the SPMD program's (loading, cluster checks, ``main``) with
    :mod:`parcomp_backends.torch.runtime.pipeline_main`'s step in place of its loop.
    With tp inside a stage the stage functions are the per-rank programs of ``plan.local``
    (their collectives over the inner axes), params are loaded as this rank's shards and the
    outputs gathered whole before they are written.

    Raises:
        PipelineEmitError: a mesh axis besides ``pp`` and ``dp`` larger than 1 without sharded
            stage programs. EmitError: an op without a torch mapping.
    """
    plan, mesh = program.pipeline, program.mesh
    if not pipeline_emittable(program):
        extra = next(a for a, n in mesh.axes if a not in ("pp", "dp") and n > 1)
        raise PipelineEmitError(f"the pipeline has mesh axis {extra} > 1 but no sharded stage "
                                f"programs to print")
    prof = get_profile(profile)
    table = placement_table(mesh)
    dp_groups = table["groups"].get("dp", [])
    inner = [a for a, _ in mesh.axes if a not in ("pp", "dp")]
    if plan.local and plan.local[0].axes:  # zero=1: the update runs on the mesh less pp (dp too)
        inner = list(plan.local[0].axes)
    joint = sorted({n.attr("axis") for st in plan.local for g in (st.optimizer, st.stats) if g is not None
                    for n in g.nodes if n.op in COLLECTIVES and "," in n.attr("axis")})
    head = _header(program, model, plan, mesh, table)
    groups = {a: table["groups"][a] for a in inner if a in table["groups"]}
    groups.update({j: mesh.groups(tuple(j.split(","))) for j in joint})  # "dp,tp": one group of both
    sizes = dict(mesh.axes)
    launch = getattr(program, "launch", None) or {}
    topology = launch.get("topology")
    consts = [f"MESH = {sizes!r}",
              f"GROUP_RANKS = {groups!r}  # the groups of the axes inside a stage",
              f"COMM_AXES = {tuple(a for a in inner if sizes[a] > 1) + tuple(joint)!r}",
              f"HOST_AXES = {tuple(a for a in inner if a == HOST_AXIS and sizes[a] > 1)!r}"
              "  # axes whose groups must sit on one host (checked at start)",
              f"PLACEMENT = {launch.get('placement', DEFAULT_PLACEMENT)!r}"
              "  # a HOST_AXES group on several hosts: refuse | warn (--placement)",
              f"TIMEOUT_S = {launch.get('timeout', DEFAULT_TIMEOUT_S)!r}"
              "  # seconds a point-to-point slot or collective may wait (--timeout)",
              f"TOPOLOGY = {tuple(topology) if topology else None!r}"
              "  # the spec's nodes, devices per node (--print-launch)",
              f"COLLECTIVE_DTYPES = {_collective_dtypes(plan)!r}  # what the collectives and p2p carry",
              f"MICROBATCHES = {plan.microbatches}", f"MICRO_BATCH = {plan.micro_batch}",
              f"SCALE = 1.0 / {plan.microbatches * plan.dp}  # 1 / (microbatches x dp)",
              *_reductions(plan), f"DP_GROUPS = {dp_groups!r}",
              f"PP_GROUPS = {table['groups'].get('pp', [list(range(mesh.size))])!r}"
              "  # the point-to-point groups: one rank per stage",
              f"STAGES = {({r: list(range(r, len(plan.stages), plan.pp)) for r in range(plan.pp)})!r}"
              "  # per pp coordinate, the (virtual) stages it holds",
              f"TRAIN_STEPS = {program.train.steps if program.train else 1}  # default of --steps",
              f"MAX_STEPS = {MAX_STEPS:_}  # the most --steps allows (as a spec's steps=)"]
    params, state, batch, grads, sends, recvs, splits, carried = {}, {}, {}, {}, {}, {}, {}, {}
    for st in plan.stages:
        opt = plan.local[st.index].optimizer if plan.local else st.optimizer
        params[st.index] = sorted({n.name for g in (st.forward, st.backward, opt) for n in g.params})
        state.update({n.name: (tuple(n.type.shape), n.type.dtype) for n in opt.params
                      if n.phase == "optimizer"})
        batch[st.index] = sorted({n.name for g in (st.forward, st.backward) for n in g.inputs}
                                 - set(st.recv) - {f"grad.{v}" for v in st.send} - set(st.saved))
        grads[st.index] = [f"grad.{q}" for q in st.params]
        carried[st.index] = sorted({pub for pub, _ in opt.named_outputs()} & set(params[st.index]))
        sends[st.index], recvs[st.index] = _specs(st, st.send), _specs(st, st.recv)
        if plan.local:
            splits.update({k: _splits(v, inner) for k, v in plan.local[st.index].layouts.items()
                           if _splits(v, inner)})
    full_params, full_inputs = _file_shapes(plan)
    stored, order, aliases = _load_facts(plan)
    consts += [f"PARAMS = {tuple(full_params) + tuple(sorted(state))!r}"
               "  # every stage's params and optimizer state (a rank loads its stages' only)",
               f"INPUTS = {tuple(full_inputs)!r}", f"INDEX_BOUNDS = {_index_bounds(plan)!r}"
               "  # inputs that index a table: [size, ignore_index or None, what]",
               "OUTPUT_LAYOUTS = {}", "OUTPUT_GLOBAL_SHAPES = {}",
               "SHARDED_OUTPUT = False", f"RUN_HINT = {_run_hint(mesh)!r}",
               f"STAGE_PARAMS = {params!r}", f"STATE_SHAPES = {state!r}", f"BATCH_INPUTS = {batch!r}",
               "# what --checkpoint and --input must hold: full (unsharded) shapes and dtypes;",
               "# an input holds the global batch, microbatches x dp of the stages' microbatch",
               f"PARAM_SHAPES = {full_params!r}", f"INPUT_SHAPES = {full_inputs!r}",
               f"GRADS = {grads!r}", f"SEND = {sends!r}", f"RECV = {recvs!r}",
               "# [(dim, axis), ...] of every value split inside a stage: params (loaded as this",
               "# rank's block), optimizer state, gradients, the step's outputs (gathered whole)",
               f"SPLITS = {splits!r}",
               "# per stage, the values each step updates: what --save writes and --resume reads",
               f"CARRIED = {carried!r}",
               "# fused weights (stored whole, viewed per part), tied weights' other names, and the",
               "# params parcomp computed at import (constants.safetensors beside program.py)",
               f"STORED_SHAPES = {stored!r}", f"STORED_ORDER = {order!r}", f"ALIASES = {aliases!r}",
               f"CONSTANT_PARAMS = {tuple(sorted(set(constants) & set(full_params)))!r}"]
    ranks_of = [(q, tuple(sorted({plan.rank_of_stage(t) for t in held}))) for q, held in plan.tied]
    ranks_of = [(q, held) for q, held in ranks_of if len(held) > 1]  # one rank's chunks: one sum
    sets = sorted({held for _, held in ranks_of})
    tied = {s: [(f"grad.{q}", sets.index(held)) for q, held in ranks_of if s in held]
            for s in range(plan.pp)}
    consts += ["# tied weights: per set of stages, the rank groups (one rank per stage, same dp/tp",
               "# coordinates) whose gradient contributions are summed before the dp all_reduce",
               f"TIED_SETS = {[_tied_groups(mesh, held) for held in sets]!r}",
               f"TIED = {({s: v for s, v in tied.items() if v})!r}", "TIED_GROUP = {}",
               *_dp_buckets(plan),
               f"DP_REDUCE_DTYPE = {plan.dp_reduce_dtype!r}  # grad_reduce=compute: the dtype the dp "
               "reduction sends (cast, summed, widened back); None: the gradient sums' own",
               "STEP = [1.0]  # the step counter k of main()'s loop (AdamW's bias corrections)"]
    acts = _actions(plan, mesh, table)
    fns, graphs = [], []
    for st in plan.stages:  # each stage program printed as the SPMD step is (emit.step_function)
        s = st.index
        stash, progs = _attention_stash(program.stages[s]), {}
        for kind in KINDS:
            if kind not in program.stages[s]:
                continue
            prog = program.stages[s][kind]
            if plan.local:  # per-rank: layouts on the program's whole mesh (block offsets read COORD)
                prog = replace(prog, graph=_on_full_mesh(prog.graph, mesh))
            progs[kind] = prog
        for kind, prog, names, dropless in _dropless_plans(progs, plan.split):
            graphs.append((prog.graph, dropless.active))
            ready = grads[s] if kind == ("backward_weight" if plan.split else "backward") else ()
            fns.append(code(prog, f"stage{s}_{kind}", _DOCS[kind].format(s=s), names=names, pop_inputs=True,
                            ready=ready, dropless=dropless, stash=stash.get(kind)))
    helpers = {text for x, packed in graphs  # the runtime helpers the printed statements call, as the SPMD program's
               for text in runtime_sections(x) + reduce_sections(x) + attention_sections(x) + moe_sections(x, packed)}
    runtime = "\n\n\n".join(["# ---- the SPMD program's runtime: process facts, collectives, loading ----",
                              _COMMON["process"], _COMMON["take_place"], _LOADING, _COMMON["constants"],
                              _COMMON["tied"], *sorted(helpers)])
    n = len(plan.stages)
    fns += [f"FORWARD = {{{', '.join(f'{s}: stage{s}_forward' for s in range(n))}}}",
            f"BACKWARD = {{{', '.join(f'{s}: stage{s}_backward' for s in range(n))}}}",
            f"OPTIMIZER = {{{', '.join(f'{s}: stage{s}_optimizer' for s in range(n))}}}",
            f"STATS = {{{', '.join(f'{s}: stage{s}_stats' for s in range(n) if plan.stages[s].stats is not None)}}}"]
    fns += [f"BACKWARD_{k.upper()} = {{{', '.join(f'{s}: stage{s}_backward_{k}' for s in range(n) if plan.split)}}}"
            for k in ("input", "weight")]  # ZB-H1's B and W; empty for the other schedules
    body = ["\n".join(head) + "\n" + IMPORTS, "\n".join(consts), "\n".join(acts), "\n\n\n".join(fns),
            RUNTIME_MARK, profile_block(prof), runtime, _CHECKPOINT.strip("\n"), _TRAIN["checkpoint_checks"],
            _CLUSTER, _COMMON["rank_path"], _COMMON["sync"], _COMMON["bench"], _COMMON["world"],
            _TRAIN["updates"], _TRAIN["step_count"], _TRAIN["input_args"], _TRAIN["data"], _TRAIN["replay"], _TRAIN["stop"],
            _COMMON["main"], _PIPELINE, _COMMON["entry"]]
    return "\n\n\n".join(body) + "\n"


def _index_bounds(plan) -> dict:
    """{input name: [size, ignore_index or None, what]} over every stage's graphs (the ids at
    the first stage's embedding, the labels at the last stage's loss); the smallest bound wins."""
    found = {}
    for st in plan.stages:
        for g in (st.forward, st.backward):
            for name, bound in index_inputs(g).items():
                if name not in found or bound[0] < found[name][0]:
                    found[name] = list(bound)
    return found

