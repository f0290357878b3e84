"""``program.py`` for a pipelined training step (a spec with a ``pp`` mesh axis).

The program holds, as plain Python: the placement table, every rank's action list
(``ACTIONS``, the schedule parcomp simulated), and per stage three functions printed from
the stage's graphs (``stage0_forward``, ``stage0_backward``, ``stage0_optimizer``, one
statement per node, with the same op table as :mod:`.emit`).  ``main`` walks this rank's
action list: ``recv_*`` is a blocking ``dist.recv``, ``send_*`` an ``isend`` waited for
before the update, gradients are summed over microbatches and ``all_reduce``-d over ``dp``,
then scaled once by 1/(microbatches x dp).  The rank of ``dp`` (and ``tp``) coordinate 0 of
each stage writes the stage's outputs of the last step to ``OUTPUT.stageK``.  Nothing in it imports
parcomp.  With ``tp`` inside the stages the functions are the per-rank programs
(:mod:`parcomp.passes.stage_shard`) and the SPMD runtime's collectives are pasted in; tied
weights' gradients are summed over their stages' ranks (``TIED_SETS``) before ``dp``;
``--steps K`` runs K free-running steps.
"""
from __future__ import annotations

import json
import re
from dataclasses import replace

from parcomp.program import ParcompError, format_placement, placement_table

from parcomp.ir.types import Replicate

from .emit_norms import runtime_sections
from .emit_reduce import reduce_sections
from .runtime import sections

__all__ = ["emit_pipeline_program", "pipeline_emittable", "PipelineEmitError"]


class PipelineEmitError(ParcompError):
    """The pipeline cannot be printed (a mesh axis this module does not emit inside a stage)."""

_MAIN = '''
def coords(rank):
    """``{axis: coordinate}`` of a global rank (row-major, the last axis fastest)."""
    return dict(zip(MESH, mesh_coords(rank)))


def local_shard(t, splits):
    """This rank's block of a full tensor: ``splits`` = ``[(dim, axis), ...]`` of its layout."""
    for dim, axis in splits:
        t = t.chunk(MESH[axis], dim)[COORD[AXIS[axis]]]
    return t.contiguous()


def whole_value(t, splits):
    """The full tensor from this rank's block (an all_gather per split axis, every rank of
    the group calls it)."""
    for dim, axis in reversed(splits):
        t = all_gather(t, dim, axis)
    return t


def tag(m, direction, j):
    """The p2p tag of value j of microbatch m, direction 0 forward, 1 backward."""
    return (m * 2 + direction) * 1000 + j


def send(tensors, peer, m, direction):
    return [dist.isend(t.contiguous(), peer, tag=tag(m, direction, j)) for j, t in enumerate(tensors)]


def recv(specs, peer, m, direction):
    out = {}
    for j, (name, shape, dtype) in enumerate(specs):
        buf = torch.empty(shape, dtype=getattr(torch, dtype))
        dist.recv(buf, peer, tag=tag(m, direction, j))
        out[name] = buf
    return out


def setup(rank):
    """This rank's stage, dp coordinate and dp group (every rank creates every group)."""
    c = coords(rank)
    stage, d = c["pp"], c.get("dp", 0)
    dp_group = None
    for ranks in DP_GROUPS:  # every rank creates every group, in the same order
        g = dist.new_group(ranks)
        if rank in ranks:
            dp_group = g
    make_groups()  # the groups of the axes inside a stage (tp): COMM_AXES
    for i, lines in enumerate(TIED_SETS):  # tied weights: the ranks of the stages holding a copy
        for ranks in lines:
            g = dist.new_group(ranks)
            if rank in ranks:
                TIED_GROUP[i] = g
    return stage, d, dp_group


def step(rank, stage, d, dp_group, p, data):
    """One training step of this rank: its action list in order; the updated state (and the
    loss on the last stage)."""
    rows = MICRO_BATCH * MICROBATCHES

    def micro(m):
        lo = d * rows + m * MICRO_BATCH
        return {k: data[k][lo:lo + MICRO_BATCH] for k in BATCH_INPUTS[stage]}

    stash, got, grads_in, grads_out, sums, handles, losses = {}, {}, {}, {}, {}, [], []
    result = {}
    for kind, m, peer in ACTIONS[rank]:
        if kind == "recv_fwd":
            got[m] = recv(RECV[stage], peer, m, 0)
        elif kind == "forward":
            stash[m] = FORWARD[stage](p, {**micro(m), **got.pop(m, {})})
            if "loss" in stash[m]:
                losses.append(stash[m]["loss"])
        elif kind == "send_fwd":
            handles += send([stash[m][v] for v, _, _ in SEND[stage]], peer, m, 0)
        elif kind == "recv_bwd":
            grads_in[m] = recv([("grad." + v, s, t) for v, s, t in SEND[stage]], peer, m, 1)
        elif kind == "backward":
            saved = {k[len("saved."):]: v for k, v in stash.pop(m).items() if k.startswith("saved.")}
            out = BACKWARD[stage](p, {**micro(m), **saved, **grads_in.pop(m, {})})
            for k in GRADS[stage]:
                sums[k] = out[k] if k not in sums else sums[k] + out[k]
            grads_out[m] = [out["grad." + v] for v, _, _ in RECV[stage]]
        elif kind == "send_bwd":
            handles += send(grads_out.pop(m), peer, m, 1)
        elif kind == "optimizer":
            for h in handles:
                h.wait()
            for k in GRADS[stage]:  # collectives reduce in place: a strided sum (a transpose's) is copied
                sums[k] = sums[k].contiguous()
            for k, i in TIED.get(stage, []):  # a tied weight: its stages' sum, before dp
                dist.all_reduce(sums[k], group=TIED_GROUP[i])
            for k in GRADS[stage]:  # the gradient of the global batch: sum, then scale once
                if dp_group is not None:
                    dist.all_reduce(sums[k], group=dp_group)
                sums[k] = sums[k] * SCALE
            result = OPTIMIZER[stage](p, {**sums, "step": torch.tensor(STEP[0])})
    if losses:
        loss = torch.stack(losses).sum()
        if dp_group is not None:
            dist.all_reduce(loss, group=dp_group)
        result["loss"] = loss * SCALE
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--steps", type=int, default=1, help="training steps, each from the last one's state")
    ap.add_argument("--bench", type=int, default=0, help="then time N more steps (ms per step)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != WORLD:
        sys.exit(f"this program needs {WORLD} ranks, got {world}")
    stage, d, dp_group = setup(rank)
    sd = torch.load(args.checkpoint)
    p = {k: local_shard(sd[k], SPLITS.get(k, [])) if k in sd else
         torch.zeros(STATE_SHAPES[k][0], dtype=getattr(torch, STATE_SHAPES[k][1])) for k in PARAMS[stage]}
    data = torch.load(args.input)
    losses = []
    for k in range(1, args.steps + 1):  # free-running: updated params and state carry over
        STEP[0] = float(k)
        result = step(rank, stage, d, dp_group, p, data)
        losses += [result["loss"]] if "loss" in result else []
        p.update({q: result[q] for q in PARAMS[stage] if q in result})
    if losses:
        result["losses"] = torch.stack(losses)
    result = {k: whole_value(v, SPLITS.get(k, [])) for k, v in result.items()}
    if all(c == 0 for a, c in coords(rank).items() if a != "pp"):  # one rank per stage writes
        torch.save({k: v.detach().clone() for k, v in result.items()}, f"{args.output}.stage{stage}")
    if args.bench:  # every step from the same state: the time of one step, not a trajectory
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.bench):
            step(rank, stage, d, dp_group, p, data)
        dist.barrier()
        if rank == 0:
            print(f"bench: {(time.perf_counter() - t0) * 1e3 / args.bench:.3f} ms per step")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''


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
    (``code(node, operand variables, graph)``: :func:`.emit._code`, the torch op table)."""
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
    """The text of ``program.py`` for a :class:`parcomp.program.Program` whose ``pipeline``
    is set; ``model``: what it was imported from (for the docstring) or None; ``code``: the op
    printer, :func:`.emit._code` (emit.py passes it, so this module does not import emit.py).
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
            "", f"mesh {mesh}, schedule {plan.schedule}, {plan.microbatches} microbatch(es) of "
            f"{plan.micro_batch}, global batch {plan.batch} = {plan.micro_batch} x "
            f"{plan.microbatches} x dp {plan.dp}; bubble {plan.analytic_bubble:.3f} (analytic), "
            f"{plan.simulation.bubble:.3f} (simulated).", "", format_placement(table), "",
            f"torchrun --nproc-per-node {mesh.size} program.py --checkpoint model.pt "
            f"--input inputs.pt --output out.pt", '"""', "import argparse", "import math", "import os",
            "import sys", "import time", "", "import torch", "import torch.distributed as dist", ""]
    groups = {a: table["groups"][a] for a in inner if a in table["groups"]}
    consts = [f"MESH = {dict(mesh.axes)!r}", f"WORLD = {mesh.size}",
              f"GROUP_RANKS = {groups!r}  # the groups of the axes inside a stage",
              f"COMM_AXES = {tuple(a for a in inner if dict(mesh.axes)[a] > 1)!r}",
              f"MICROBATCHES = {plan.microbatches}", f"MICRO_BATCH = {plan.micro_batch}",
              f"SCALE = 1.0 / {plan.microbatches * plan.dp}  # 1 / (microbatches x dp)",
              f"DP_GROUPS = {dp_groups!r}"]
    params, state, batch, grads, sends, recvs, splits = {}, {}, {}, {}, {}, {}, {}
    for st in plan.stages:
        opt = plan.local[st.index].optimizer if plan.local else st.optimizer
        params[st.index] = sorted({n.name for g in (st.forward, st.backward, opt) for n in g.params})
        state.update({n.name: (tuple(n.type.shape), n.type.dtype) for n in opt.params
                      if n.phase == "optimizer"})
        batch[st.index] = sorted({n.name for g in (st.forward, st.backward) for n in g.inputs}
                                 - set(st.recv) - {f"grad.{v}" for v in st.send} - set(st.saved))
        grads[st.index] = [f"grad.{q}" for q in st.params]
        sends[st.index], recvs[st.index] = _specs(st, st.send), _specs(st, st.recv)
        if plan.local:
            splits.update({k: _splits(v, inner) for k, v in plan.local[st.index].layouts.items()
                           if _splits(v, inner)})
    consts += [f"PARAMS = {params!r}", f"STATE_SHAPES = {state!r}", f"BATCH_INPUTS = {batch!r}",
               f"GRADS = {grads!r}", f"SEND = {sends!r}", f"RECV = {recvs!r}",
               "# [(dim, axis), ...] of every value split inside a stage: params (loaded as this",
               "# rank's block), optimizer state, gradients, the step's outputs (gathered whole)",
               f"SPLITS = {splits!r}"]
    sets = sorted({held for _, held in plan.tied})
    tied = {s: [(f"grad.{q}", sets.index(held)) for q, held in plan.tied if s in held]
            for s in range(len(plan.stages))}
    consts += ["# tied weights: per set of stages, the rank groups (one rank per stage, same dp/tp",
               "# coordinates) whose gradient contributions are summed before the dp all_reduce",
               f"TIED_SETS = {[_tied_groups(mesh, held) for held in sets]!r}",
               f"TIED = {({s: v for s, v in tied.items() if v})!r}", "TIED_GROUP = {}",
               "STEP = [1.0]  # the step counter k of main()'s loop (AdamW's bias corrections)"]
    runtime = "# ---- process facts and collectives (the SPMD program's runtime) ----\n" + \
        sections("program_common")["process"]
    acts = ["# every rank's action list, (action, microbatch, peer rank), run in order by main();",
            "# parcomp simulated all of them together: every send meets its recv, no deadlock",
            "ACTIONS = {"]
    for r in range(mesh.size):
        row = [(a.kind, a.micro, a.peer) for a in plan.rank_actions(mesh, r)]
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
    helpers = {text for x in graphs for text in runtime_sections(x) + reduce_sections(x)}
    runtime = "\n\n\n".join([runtime, *sorted(helpers)])
    n = len(plan.stages)
    fns += [f"FORWARD = {{{', '.join(f'{s}: stage{s}_forward' for s in range(n))}}}",
            f"BACKWARD = {{{', '.join(f'{s}: stage{s}_backward' for s in range(n))}}}",
            f"OPTIMIZER = {{{', '.join(f'{s}: stage{s}_optimizer' for s in range(n))}}}"]
    body = ["\n".join(head), "\n".join(consts), runtime, "\n".join(acts), "\n\n\n".join(fns), _MAIN.strip("\n")]
    return "\n\n\n".join(body) + "\n"
