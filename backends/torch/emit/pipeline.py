"""``program.py`` for a pipelined training step (a spec with a ``pp`` mesh axis).

The program holds, as plain Python: the placement table, every rank's action list
(``ACTIONS``, the schedule parcomp simulated), and per stage three functions printed from
the stage's graphs (``stage0_forward``, ``stage0_backward``, ``stage0_optimizer``, one
statement per node, with the same op table as :mod:`parcomp_backends.torch.emit`).  ``main`` walks this rank's
action list: ``recv_*`` is a blocking ``dist.recv``, ``send_*`` an ``isend`` waited for
before the update, gradients are summed over microbatches and ``all_reduce``-d over ``dp``,
then scaled once by 1/(microbatches x dp).  The rank of ``dp`` (and ``tp``) coordinate 0 of
each stage writes the stage's outputs of the last step to ``OUTPUT.stageK``.  Nothing in it imports
parcomp.  With ``tp`` inside the stages the functions are the per-rank programs
(:mod:`parcomp.passes.pipeline.stage_shard`) and the SPMD runtime's collectives are pasted in; tied
weights' gradients are summed over their stages' ranks (``TIED_SETS``) before ``dp``;
``--steps K`` runs K free-running steps.  ``--timeout``, ``--save`` and ``--resume`` are
:mod:`parcomp_backends.torch.runtime.pipeline_checkpoint`'s (with the SPMD program's checks, pasted); ``CARRIED`` lists per stage
what they write and read.
"""
from __future__ import annotations

import json
import re
from dataclasses import replace

from parcomp.compile.program import ParcompError, format_placement, placement_table

from parcomp.ir.types import Replicate

from ..runtime import sections
from ..runtime.pipeline_checkpoint import CHECKPOINT as _CHECKPOINT
from ..runtime.pipeline_main import MAIN as _MAIN
from .cluster import DEFAULT_TIMEOUT_S
from .norms import runtime_sections
from .reduce import reduce_sections

__all__ = ["check_pipeline_profile", "emit_pipeline_program", "pipeline_emittable", "PipelineEmitError"]


class PipelineEmitError(ParcompError):
    """The pipeline cannot be printed (a mesh axis this module does not emit inside a stage)."""



# pasted from the non-pipelined program: --timeout's check, --save's and --resume's checks, and
# the entry point (exit without C++ static destructors: a gloo teardown at exit can abort)
_CHECKS = (sections("program_cluster")["timeout"], sections("program_train")["checkpoint_checks"])
_ENTRY = sections("program_common")["entry"]


def _ident(name: str, taken: set) -> str:
    base = re.sub(r"\W", "_", name)
    base = base if re.match(r"[A-Za-z_]", base) else "v" + base
    out, k = base, 1
    while out in taken:
        k += 1
        out = f"{base}_{k}"
    taken.add(out)
    return out


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


def _function(fn: str, graph, doc: str, code) -> str:
    """A function computing ``graph``: params from ``p``, inputs from ``inp``, one line per node
    (``code(node, operand variables, graph)``: :func:`parcomp_backends.torch.emit._code`, the torch op table)."""
    taken = {"p", "inp", "torch", "dist"}
    local = graph if graph.stage == "local" else None  # per-rank: block offsets read COORD
    names = {n.name: _ident(n.name, taken) for n in graph.nodes}
    lines = [f"def {fn}(p, inp):", f'    """{doc}"""']
    for n in graph.nodes:
        var = names[n.name]
        if n.op in ("input", "param"):
            src = "p" if n.op == "param" else "inp"
            lines.append(f"    {var} = {src}[{json.dumps(n.name)}]  # {n.type}")
        else:
            lines.append(f"    {var} = {code(n, [names[i] for i in n.inputs], local)}  # {n.type}")
    ret = ", ".join(f"{json.dumps(pub)}: {names[v]}" for pub, v in graph.named_outputs())
    lines.append(f"    return {{{ret}}}")
    return "\n".join(lines)


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
    """The pipelined program runs on CPU ranks under gloo only (its p2p and collectives are
    gloo's, its tensors are never moved to a device).

    Raises:
        PipelineEmitError: ``profile`` is not ``cpu`` (``--profile cuda``, ``--target
            ascend``): a cuda or ascend program would silently run on the CPU.
    """
    if profile != "cpu":
        raise PipelineEmitError(
            f"a pipelined program (a pp mesh axis) is emitted for the cpu profile only (gloo, "
            f"tensors on the CPU); profile {profile} is not supported yet: compile with "
            f"--profile cpu, or drop pp from the mesh", where="--profile")


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


def emit_pipeline_program(program, model, code) -> str:
    """The text of ``program.py`` for a :class:`parcomp.compile.program.Program` whose ``pipeline``
    is set; ``model``: what it was imported from (for the docstring) or None; ``code``: the op
    printer, :func:`parcomp_backends.torch.emit._code` (emit.py passes it, so this module does not import emit.py).
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
    table = placement_table(mesh)
    dp_groups = table["groups"].get("dp", [])
    inner = [a for a, _ in mesh.axes if a not in ("pp", "dp")]
    head = [f'"""parcomp pipelined training step: {program.spec_name or "spec"}'
            f"{f', model {model}' if model else ''}.",
            "", f"mesh {mesh}, schedule {plan.schedule}"
            f"{f' ({plan.virtual} model chunks per rank)' if plan.virtual > 1 else ''}, "
            f"{plan.microbatches} microbatch(es) of "
            f"{plan.micro_batch}, global batch {plan.batch} = {plan.micro_batch} x "
            f"{plan.microbatches} x dp {plan.dp}; bubble {plan.analytic_bubble:.3f} (analytic), "
            f"{plan.simulation.bubble:.3f} (simulated).", "", format_placement(table), "",
            f"torchrun --nproc-per-node {mesh.size} program.py --checkpoint model.pt "
            f"--input inputs.pt --output out.pt [--steps K] [--save DIR] [--resume DIR] [--timeout S]",
            '"""', "import argparse", "import datetime", "import difflib", "import math", "import os",
            "import sys", "import time", "", "import torch", "import torch.distributed as dist", ""]
    groups = {a: table["groups"][a] for a in inner if a in table["groups"]}
    consts = [f"MESH = {dict(mesh.axes)!r}", f"WORLD = {mesh.size}",
              f"GROUP_RANKS = {groups!r}  # the groups of the axes inside a stage",
              f"COMM_AXES = {tuple(a for a in inner if dict(mesh.axes)[a] > 1)!r}",
              f"MICROBATCHES = {plan.microbatches}", f"MICRO_BATCH = {plan.micro_batch}",
              f"SCALE = 1.0 / {plan.microbatches * plan.dp}  # 1 / (microbatches x dp)",
              f"DP_GROUPS = {dp_groups!r}",
              f"STAGES = {({r: list(range(r, len(plan.stages), plan.pp)) for r in range(plan.pp)})!r}"
              "  # per pp coordinate, the (virtual) stages it holds"]
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
    consts += [f"PARAMS = {params!r}", f"STATE_SHAPES = {state!r}", f"BATCH_INPUTS = {batch!r}",
               "# what --checkpoint and --input must hold: full (unsharded) shapes and dtypes;",
               "# an input holds the global batch, microbatches x dp of the stages' microbatch",
               f"PARAM_SHAPES = {full_params!r}", f"INPUT_SHAPES = {full_inputs!r}",
               f"GRADS = {grads!r}", f"SEND = {sends!r}", f"RECV = {recvs!r}",
               "# [(dim, axis), ...] of every value split inside a stage: params (loaded as this",
               "# rank's block), optimizer state, gradients, the step's outputs (gathered whole)",
               f"SPLITS = {splits!r}",
               "# per stage, the values each step updates: what --save writes and --resume reads",
               f"CARRIED = {carried!r}",
               f"TIMEOUT_S = {(getattr(program, 'launch', None) or {}).get('timeout', DEFAULT_TIMEOUT_S)!r}"
               "  # seconds a send, recv or collective may wait (--timeout)"]
    ranks_of = [(q, tuple(sorted({plan.rank_of_stage(t) for t in held}))) for q, held in plan.tied]
    ranks_of = [(q, held) for q, held in ranks_of if len(held) > 1]  # one rank's chunks: one sum
    sets = sorted({held for _, held in ranks_of})
    tied = {s: [(f"grad.{q}", sets.index(held)) for q, held in ranks_of if s in held]
            for s in range(plan.pp)}
    consts += ["# tied weights: per set of stages, the rank groups (one rank per stage, same dp/tp",
               "# coordinates) whose gradient contributions are summed before the dp all_reduce",
               f"TIED_SETS = {[_tied_groups(mesh, held) for held in sets]!r}",
               f"TIED = {({s: v for s, v in tied.items() if v})!r}", "TIED_GROUP = {}",
               "STEP = [1.0]  # the step counter k of main()'s loop (AdamW's bias corrections)",
               f"PP_GROUPS = {table['groups'].get('pp', [])!r}  # STATS' sums over the stages",
               "PP_GROUP = {}"]
    runtime = "# ---- process facts and collectives (the SPMD program's runtime) ----\n" + \
        sections("program_common")["process"]
    acts = ["# every rank's action list, (action, microbatch, peer rank, stage), run in order by main();",
            "# parcomp simulated all of them together: every send meets its recv, no deadlock",
            "ACTIONS = {"]
    for r in range(mesh.size):
        coord = table["ranks"][r]["stage"]
        row = [(a.kind, a.micro, a.peer, a.chunk * plan.pp + coord) for a in plan.rank_actions(mesh, r)]
        acts.append(f"    {r}: [  # stage {table['ranks'][r]['stage']}")
        acts += [f"        {x!r}," for x in row]
        acts.append("    ],")
    acts.append("}")
    fns, graphs = [], []
    for st in plan.stages:
        s = st.index
        g = plan.local[s] if plan.local else st
        f, b, o = (_on_full_mesh(x, mesh) if plan.local else x
                   for x in (g.forward, g.backward, g.optimizer))
        graphs += [f, b, o]
        fns += [_function(f"stage{s}_forward", f, f"Stage {s}: forward of one microbatch.", code),
                _function(f"stage{s}_backward", b, f"Stage {s}: backward of one microbatch.", code),
                _function(f"stage{s}_optimizer", o, f"Stage {s}: the update.", code)]
        if st.stats is not None:  # what every stage agrees on before the update (clip_grad_norm)
            x = _on_full_mesh(g.stats, mesh) if plan.local else g.stats
            graphs.append(x)
            fns.append(_function(f"stage{s}_stats", x, f"Stage {s}: its share of the sums every "
                                 f"stage's update reads (summed over pp).", code))
        if plan.split:  # ZB-H1: the backward cut into input- and weight-gradient programs
            bi, bw = (_on_full_mesh(x, mesh) if plan.local else x
                      for x in (plan.split[s].backward_input, plan.split[s].backward_weight))
            graphs += [bi, bw]
            fns += [_function(f"stage{s}_backward_input", bi, f"Stage {s}: input gradients of one "
                              f"microbatch (ZB-H1's B), and what W reads (wstash.*).", code),
                    _function(f"stage{s}_backward_weight", bw, f"Stage {s}: parameter gradients of "
                              f"one microbatch (ZB-H1's W).", code)]
    helpers = {text for x in graphs for text in runtime_sections(x) + reduce_sections(x)}
    runtime = "\n\n\n".join([runtime, *sorted(helpers)])
    n = len(plan.stages)
    fns += [f"FORWARD = {{{', '.join(f'{s}: stage{s}_forward' for s in range(n))}}}",
            f"BACKWARD = {{{', '.join(f'{s}: stage{s}_backward' for s in range(n))}}}",
            f"OPTIMIZER = {{{', '.join(f'{s}: stage{s}_optimizer' for s in range(n))}}}",
            f"STATS = {{{', '.join(f'{s}: stage{s}_stats' for s in range(n) if plan.stages[s].stats is not None)}}}"]
    if plan.split:
        fns += [f"BACKWARD_{k.upper()} = {{{', '.join(f'{s}: stage{s}_backward_{k}' for s in range(n))}}}"
                for k in ("input", "weight")]
    body = ["\n".join(head), "\n".join(consts), runtime, "\n".join(acts), "\n\n\n".join(fns),
            _CHECKPOINT.strip("\n"), *_CHECKS, _MAIN.strip("\n"), _ENTRY]
    return "\n\n\n".join(body) + "\n"
