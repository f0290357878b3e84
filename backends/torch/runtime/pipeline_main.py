"""The pipelined ``program.py``'s own part (sections pasted by :mod:`parcomp_backends.torch.emit.pipeline`).

A pipelined program is the SPMD program's runtime (:mod:`.program_common`, :mod:`.program_loading`,
:mod:`.program_cluster`: the PROFILE block and ``--device``, checkpoint loading where each rank
reads only its own bytes, ``--key-map``, ``--load-report``, the cluster checks, failure agreement,
``--timeout`` on every group, ``--print-launch``, ``main``) with the sections below in place of
the SPMD program's step and loop:

- ``load_params``: this rank's stages' params only (the other stages' bytes are never read),
  each as this rank's block inside the stage (``SPLITS``, tp), fused weights read whole and
  viewed per part, tied weights from whichever of their names the checkpoint holds;
- ``step``: this rank's entries of ``ACTIONS`` in order: a compute entry runs a stage function,
  a slot ``("p2p", ops)`` posts its sends and receives in one ``batch_isend_irecv`` (the order
  :func:`parcomp.passes.pipeline.schedule.p2p_slots` checked against every other rank's) and
  waits for all of them, so a boundary tensor lives until its slot ends and no ``Work`` handle
  outlives its slot; what the schedule no longer needs (sent activations, a stash after its
  backward) is dropped at once;
- ``stage_programs``: with ``--compile``, each stage program one ``torch.compile(fullgraph=True)``
  graph, compiled once and run by every microbatch, the loop and its slots eager around them;
- ``load_inputs``: this rank's dp rows of the inputs its stages read (the first stage's inputs,
  the last stage's labels), from ``--input``'s global batch or a ``--data`` step's samples
  (the SPMD program's DataSource, StepData: only those samples are read);
- ``parse_args`` / ``run``: the SPMD training program's options, run under ``main``, with its
  ``--replay`` (read_replay) and its stop on SIGTERM with ``--save`` (stop_after, stopped).

Real, importable Python; it runs with the stand-ins below for what the emitter generates.
"""
# flake8: noqa: E402,F403,F405 (program.py is one namespace: the common sections are in it)
import argparse
import importlib
import os

import torch
import torch.distributed as dist

from .program_cluster import *
from .program_common import *
from .program_train import (DATA_HELP, REPLAY_HELP, DataSource, StepData, check_input_args, check_save,
                            read_replay, resume_location, saved_steps, step_count, stop_after, stop_wait,
                            stopped)

# ---- stand-ins for what the emitter generates (never pasted): a one-stage, one-rank program ----
STAGE_PARAMS = {0: []}
STATE_SHAPES = {}
BATCH_INPUTS = {0: []}
PARAM_SHAPES = {}
INPUT_SHAPES = {}
STORED_SHAPES = {}
STORED_ORDER = {}
ALIASES = {}
CONSTANT_PARAMS = ()
GRADS = {0: []}
SEND = {0: []}
RECV = {0: []}
SPLITS = {}
CARRIED = {0: []}
STAGES = {0: [0]}
DP_GROUPS = []
PP_GROUPS = [[0]]
TIED_SETS = []
TIED = {}
TIED_GROUP = {}
DP_BUCKETS = {}
DP_REDUCE_DTYPE = None
STEP = [1.0]
MICROBATCHES = 1
MICRO_BATCH = 1
SCALE = 1.0
TRAIN_STEPS = 1
ACTIONS = {0: [("optimizer", None, None, 0)]}
FORWARD, BACKWARD, OPTIMIZER, BACKWARD_INPUT, BACKWARD_WEIGHT, STATS = {}, {}, {}, {}, {}, {}


def resume_stages(path, where, p, coord):
    """Stand-in: :mod:`.pipeline_checkpoint`'s."""
    raise NotImplementedError


def save_stages(path, p, coord, step):
    """Stand-in: :mod:`.pipeline_checkpoint`'s."""
    raise NotImplementedError


# >>> program.py: pipeline
def coords(rank):
    """``{axis: coordinate}`` of a global rank (row-major, the last axis fastest)."""
    return dict(zip(MESH, mesh_coords(rank)))


def block(t, splits, shape):
    """This rank's block of a full tensor or checkpoint Slice ``t`` of full ``shape``:
    ``splits`` = ``[(dim, axis), ...]`` of its layout inside the stage, the first axis outer."""
    shape = list(shape)
    for dim, axis in splits:
        shape[dim] //= MESH[axis]
        t = t.narrow(dim, COORD[AXIS[axis]] * shape[dim], shape[dim])
    return t


def whole_value(t, splits):
    """The full tensor from this rank's block (an all_gather per split axis, every rank of
    the group calls it)."""
    for dim, axis in reversed(splits):
        t = all_gather(t, dim, axis)
    return t


def held_shape(ckpt, name):
    """The shape ``ckpt`` (a Checkpoint or a dict of tensors) holds param ``name`` in, or None."""
    if isinstance(ckpt, Checkpoint):
        entry = ckpt.entries.get(ckpt.key(name))
        return None if entry is None else tuple(entry[2] if len(entry) == 5 else entry[1].shape)
    t = ckpt.get(name)
    return tuple(t.shape) if isinstance(t, torch.Tensor) else None


def load_params(ckpt):
    """This rank's block of every param of the stages it holds, on DEVICE: only those
    params' bytes are read (a Slice is read by place()); optimizer state starts at zeros
    unless the checkpoint holds it. A fused weight is read in the shape the model stores it
    (transformers' ``state_dict()``) or in the program's view of it (a parcomp checkpoint)."""
    coord, out = coords(RANK)["pp"], {}
    for t in STAGES[coord]:
        for name in STAGE_PARAMS[t]:
            if name in out:
                continue
            if name in STATE_SHAPES:  # optimizer state: the checkpoint's, else zeros
                shape, dtype = STATE_SHAPES[name]
                if name not in ckpt:
                    out[name] = torch.zeros(shape, dtype=getattr(torch, dtype), device=DEVICE)
                    continue
                shape = list(shape)
                for dim, axis in SPLITS.get(name, []):
                    shape[dim] *= MESH[axis]
            else:
                shape, dtype = PARAM_SHAPES[name]
            dtype = getattr(torch, dtype)
            if name in ALIASES:  # a tied weight: any of its names
                src = take_tied(ckpt, (name, *ALIASES[name]), tuple(shape), dtype)
            elif name in STORED_SHAPES and held_shape(ckpt, name) != tuple(shape):
                # a fused weight as the model stores it (c_attn's [96]), viewed per part ([3, 32])
                src = stored_view(take(ckpt, name, tuple(STORED_SHAPES[name]), dtype), STORED_SHAPES[name],
                                  shape, STORED_ORDER.get(name))
            elif name in CONSTANT_PARAMS:
                src = take_constant(ckpt, name, tuple(shape), dtype)
            else:
                src = take(ckpt, name, tuple(shape), dtype)
            out[name] = place(block(src, SPLITS.get(name, []), shape))
    return out


def stored_view(t, stored, view, order=None):
    """A fused weight read whole in its stored shape, as the program's view of it: a grouped
    q|k|v's head units taken in ``order`` first (the SPMD loader's reorder), then reshaped."""
    if order:
        a = next(d for d in range(len(stored)) if d >= len(view) or view[d] != stored[d])
        units = t.reshape(tuple(stored[:a]) + (len(order), stored[a] // len(order)) + tuple(stored[a + 1:]))
        t = units.index_select(a, torch.tensor(order))
    return t.reshape(tuple(view))


def load_batch(path):
    """The input file, every batch input checked against its global shape and dtype (never
    cast), on the host; exit 2 naming what is wrong."""
    feeds = read_tensors(path, "input")
    if not isinstance(feeds, dict):
        fail(f"input file {path} holds a {type(feeds).__name__}, not a dict {{input name: tensor}} "
             f"for inputs {list(INPUTS)}")
    note_unused(feeds, INPUTS, "input")
    out = {}
    for name, (shape, dtype) in INPUT_SHAPES.items():
        t = feeds.get(name)
        if not isinstance(t, torch.Tensor):
            fail(f"input {name!r} (global shape {shape}) is missing from {path}; it has: "
                 f"{', '.join(sorted(map(str, feeds))[:8]) or 'nothing'}")
        if list(t.shape) != shape:
            fail(f"input {name!r} in {path} has shape {list(t.shape)}, expected the global batch's "
                 f"shape {shape} (microbatches x dp x the micro batch along dim 0)")
        if t.dtype != getattr(torch, dtype):
            fail(f"input {name!r} in {path} is {str(t.dtype).replace('torch.', '')}, compiled for "
                 f"{dtype}; convert the file (program.py never casts)")
        out[name] = t
    return out


def stage_inputs(coord):
    """The batch inputs the stages of pp coordinate ``coord`` read (the first stage's inputs,
    the last stage's labels; none in between)."""
    return sorted({name for t in STAGES[coord] for name in BATCH_INPUTS[t]})


def load_inputs(feeds):
    """This rank's rows of one step's global batch ``feeds`` (a dict from load_batch, or a
    --data step's DataBatch, whose samples outside those rows are never read): the inputs its
    stages read, rows d*R .. (d+1)*R-1 for dp coordinate d (R = MICROBATCHES x MICRO_BATCH:
    its microbatches, cut by step()), on DEVICE."""
    c, rows = coords(RANK), MICRO_BATCH * MICROBATCHES
    out = {}
    for name in stage_inputs(c["pp"]):
        shape, dtype = INPUT_SHAPES[name]
        full = take(feeds, name, tuple(shape), getattr(torch, dtype))  # a SampleSlice: nothing read yet
        out[name] = place(full.narrow(0, c.get("dp", 0) * rows, rows))
    return out


def check_stage_outputs(args):
    """Exit 2 unless ``--output``'s directory exists and no file it writes (``OUT.stageK``,
    one per stage) is one this run reads."""
    if not args.output:
        return
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        fail(f"--output {args.output}: its directory does not exist")
    reads = {os.path.realpath(f): flag for f, flag in ((args.checkpoint, "--checkpoint"),
             (args.input, "--input"), (args.replay, "--replay"), (__file__, "program.py")) if f}
    for t in range(len(FORWARD)):
        target = os.path.realpath(f"{args.output}.stage{t}")
        if target in reads:
            fail(f"--output {args.output}: it would write {args.output}.stage{t}, which is "
                 f"{reads[target]}; give another name")


def setup(timeout):
    """This rank's pp coordinate, dp coordinate, dp group and pp group; each group made by one
    call per rank (line_group) with ``timeout``; the pp group's communicator started by one
    all_reduce of its ranks (a first point-to-point batch may involve only some of them)."""
    c = coords(RANK)
    make_groups(timeout)  # the groups of the axes inside a stage (tp): COMM_AXES
    dp_group = line_group(DP_GROUPS) if DP_GROUPS else None
    for i, lines in enumerate(TIED_SETS):  # tied weights: the ranks of the stages holding a copy
        group = line_group(lines)
        if group is not None:
            TIED_GROUP[i] = group
    pp_group = line_group(PP_GROUPS)
    dist.all_reduce(torch.zeros(1, device=DEVICE), group=pp_group)
    return c["pp"], c.get("dp", 0), dp_group, pp_group


def describe(op):
    """``recv_fwd of microbatch 0 for stage 1 from rank 0``: one send or receive of a slot."""
    kind, m, peer, s = op
    return f"{kind} of microbatch {m} for stage {s} {'to' if kind.startswith('send') else 'from'} rank {peer}"


def tag(m, direction, stage, j):
    """The p2p tag of value j of microbatch m to virtual stage ``stage``, direction 0
    forward, 1 backward (gloo matches by tag; NCCL and HCCL by order, which the slots keep)."""
    return ((m * 2 + direction) * len(FORWARD) + stage) * 1000 + j


def exchange(ops, k, pp_group, stash, grads_out, got, grads_in):
    """One slot: its sends (activations of ``stash``, gradients of ``grads_out``, dropped from
    them) and receives (into ``got`` / ``grads_in``) posted in one batch_isend_irecv, in the
    order every rank's slots were checked in, then every one of them waited for."""
    FAULT["where"] = f"step {k}: " + ", ".join(map(describe, ops))
    batch, arrived = [], []
    for kind, m, peer, s in ops:
        if kind == "send_fwd":
            out = [stash[s, m].pop(v).contiguous() for v, _, _ in SEND[s]]
            batch += [dist.P2POp(dist.isend, t, peer, group=pp_group, tag=tag(m, 0, s + 1, j))
                      for j, t in enumerate(out)]
        elif kind == "send_bwd":
            out = [t.contiguous() for t in grads_out.pop((s, m))]
            batch += [dist.P2POp(dist.isend, t, peer, group=pp_group, tag=tag(m, 1, s - 1, j))
                      for j, t in enumerate(out)]
        else:
            fwd = kind == "recv_fwd"
            specs = RECV[s] if fwd else [("grad." + v, sh, dt) for v, sh, dt in SEND[s]]
            bufs = {name: torch.empty(shape, dtype=getattr(torch, dtype), device=DEVICE)
                    for name, shape, dtype in specs}
            batch += [dist.P2POp(dist.irecv, b, peer, group=pp_group, tag=tag(m, 0 if fwd else 1, s, j))
                      for j, b in enumerate(bufs.values())]
            arrived.append((got if fwd else grads_in, (s, m), bufs))
    for work in dist.batch_isend_irecv(batch):
        work.wait()
    for where, key, bufs in arrived:
        where[key] = bufs


def add_grad(sums, k, g):
    """Add one microbatch's gradient ``g`` of ``k`` to the step's sum (in place: the sum is
    this step's own tensor, the first microbatch's)."""
    if k in sums:
        sums[k].add_(g)
    else:
        sums[k] = g


def grad_ready(sums, buckets, started, dp_group):
    """``(ready, done)``: the ``ready(name, value)`` a stage's parameter-gradient program
    calls with each gradient the moment it is final (the statement after the one computing
    it), and the names it was called with. ``ready`` adds the gradient to the step's sums;
    ``buckets``: the DP_BUCKETS this backward is the last to add to, each started (async,
    appended to ``started``) as soon as its last gradient is ready, while the backward goes
    on (DDP's per-gradient hooks)."""
    pending, done = list(buckets), set()

    def ready(name, value):
        add_grad(sums, name, value)
        done.add(name)
        for b in [b for b in pending if done.issuperset(b[1])]:
            pending.remove(b)
            started.append(start_bucket(b, sums, dp_group))
    return ready, done


def reduce_over(t, group, k, what, lines):
    """``all_reduce`` of ``t`` (in place) over ``group``, the line of ``lines`` holding this rank."""
    ranks = next(r for r in lines if RANK in r)
    FAULT["where"] = f"step {k}: the {what} all_reduce with ranks {ranks}"
    dist.all_reduce(t, group=group)


def dp_split(name):
    """The dim ``zero=1`` splits gradient ``name`` along over dp (``SPLITS``), or None: a
    gradient all_reduced whole over dp."""
    return next((dim for dim, axis in SPLITS.get(name, ()) if axis == "dp"), None)


def scatter_over(t, dim, k):
    """``zero=1``: the sum over the dp group of ``t`` (float32), this rank's chunk of ``dim``
    kept (reduce_scatter, the SPMD program's), for the update of this rank's part."""
    ranks = next(r for r in DP_GROUPS if RANK in r)
    FAULT["where"] = f"step {k}: the dp reduce_scatter with ranks {ranks}"
    return reduce_scatter(t, dim, "dp")


def bucket_starts():
    """``{index in ACTIONS[RANK]: [bucket, ...]}``: each of this rank's DP_BUCKETS at the last
    backward (or ZB-H1 backward_weight) of the stages holding its gradients; it starts inside
    that backward, when its last gradient is final (:func:`grad_ready`)."""
    last = {}
    for i, (kind, _, _, s) in enumerate(ACTIONS[RANK]):
        if kind in ("backward", "backward_weight"):
            last[s] = i
    out = {}
    for stages, kind, names in DP_BUCKETS.get(coords(RANK)["pp"], []):
        out.setdefault(max(last[s] for s in stages), []).append((kind, names))
    return out


def start_bucket(bucket, sums, dp_group):
    """Start one bucket's dp reduction (async): its gradients (taken out of ``sums``) copied
    into one flat buffer, all_reduce-d, or with zero=1 reduce_scatter-ed (the buffer holds
    chunk j of every gradient, along the dim SPLITS names, before chunk j + 1: rank j gets
    its chunks); ``finish_bucket`` waits and gives them back."""
    kind, names = bucket
    grads = [sums.pop(n) for n in names]
    if kind == "all_reduce":
        flat = narrowed(torch.cat([g.reshape(-1) for g in grads]))
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=dp_group, async_op=True)
        return kind, names, [g.shape for g in grads], flat, work, grads[0].dtype
    n = MESH["dp"]
    chunks = [g.chunk(n, dp_split(name)) for g, name in zip(grads, names)]
    flat = narrowed(torch.cat([c[j].reshape(-1) for j in range(n) for c in chunks]))
    out = flat.new_empty(flat.numel() // n)
    work = collective("reduce_scatter_single", "reduce_scatter_tensor")(
        out, flat, op=dist.ReduceOp.SUM, group=dp_group, async_op=True)
    return kind, names, [c[0].shape for c in chunks], out, work, grads[0].dtype


def narrowed(t):
    """``t`` as the dp reduction sends it: in DP_REDUCE_DTYPE (grad_reduce=compute: the
    compute dtype, half the bytes; widened back after) or ``t`` itself."""
    return t.to(getattr(torch, DP_REDUCE_DTYPE)) if DP_REDUCE_DTYPE else t


def finish_bucket(started, sums, k, i):
    """Wait for a bucket started by start_bucket; each gradient (this rank's part with
    zero=1) back in ``sums`` as a view of the reduced buffer, scaled once."""
    kind, names, shapes, flat, work, dtype = started
    ranks = next(r for r in DP_GROUPS if RANK in r)
    FAULT["where"] = f"step {k}: the dp {kind} of gradient bucket {i} ({len(names)} gradients) with ranks {ranks}"
    work.wait()
    flat = flat.to(dtype)  # the sums' dtype again (a copy only after a narrowed reduction)
    flat.mul_(SCALE)
    at = 0
    for name, shape in zip(names, shapes):
        size = math.prod(shape)
        sums[name] = flat.narrow(0, at, size).view(shape)
        at += size
    return set(names)


def stage_programs(compile_them=False):
    """``{kind: {stage: function}}``: the stage programs step() runs (FORWARD, BACKWARD,
    BACKWARD_INPUT, BACKWARD_WEIGHT, STATS, OPTIMIZER).  With ``compile_them`` (``--compile``)
    each is its own ``torch.compile(fullgraph=True)`` graph, compiled at its first call and
    reused by every microbatch and step (one graph per stage function, no graph break); the
    schedule loop, the point-to-point slots (``batch_isend_irecv``, which the compiler cannot
    trace) and the dp buckets stay eager around them (:func:`compiled_stage`)."""
    tables = {"forward": FORWARD, "backward": BACKWARD, "backward_input": BACKWARD_INPUT,
              "backward_weight": BACKWARD_WEIGHT, "stats": STATS, "optimizer": OPTIMIZER}
    if not compile_them:
        return tables
    importlib.import_module("torch.distributed._functional_collectives")  # tp collectives trace as these
    compile_settings()
    return {kind: {s: compiled_stage(fn, kind in ("backward", "backward_weight")) for s, fn in table.items()}
            for kind, table in tables.items()}


READY = {}  # a compiled backward's gradients, in the order it made them final (collect_ready)


def collect_ready(name, value):
    """The ``ready`` a compiled stage backward is traced with: it records the gradient (the
    graph returns it) instead of adding it to the sums and starting dp buckets, which the
    compiler cannot trace (an async collective)."""
    READY[name] = value


def compiled_stage(fn, takes_ready):
    """Stage program ``fn`` under ``torch.compile(fullgraph=True)``: one graph, an error (not a
    silent break) if any statement cannot be traced.  A backward that hands each gradient to
    ``ready`` is traced with :func:`collect_ready` (one function, so one guard and no
    recompile per call); its gradients are then handed to the caller's ``ready`` in the same
    order, right after the graph (dp buckets start at the end of that backward, not inside it)."""
    graph = torch.compile(fn, fullgraph=True)
    if not takes_ready:
        return graph

    def run(p, inp, ready):
        READY.clear()
        try:
            out = graph(p, inp, collect_ready)
            made = list(READY.items())
        finally:
            READY.clear()
        for name, value in made:
            ready(name, value)
        return out
    return run


def step(k, state, p, data, progs=None):
    """Training step ``k`` of this rank: its ACTIONS in order; the updated state (and the loss
    on the last stage).  An action names its virtual stage (the pp coordinate unless
    interleaved: STAGES[coord], the model chunks this rank holds).  ``state``: what setup()
    returned; ``data``: this rank's rows of the step's batch (load_inputs); ``progs``: the
    stage programs (:func:`stage_programs`; None: the plain functions)."""
    coord, d, dp_group, pp_group = state
    progs = progs or stage_programs()

    def micro(m, s):
        lo = m * MICRO_BATCH
        return {name: data[name][lo:lo + MICRO_BATCH] for name in BATCH_INPUTS[s]}

    stash, got, grads_in, grads_out, wstash, sums, losses, result = {}, {}, {}, {}, {}, {}, [], {}
    starts, started = (bucket_starts() if dp_group is not None else {}), []
    for i, (kind, m, peer, s) in enumerate(ACTIONS[RANK]):
        FAULT["where"] = f"step {k}"
        if kind == "p2p":  # m: the slot's sends and receives
            exchange(m, k, pp_group, stash, grads_out, got, grads_in)
        elif kind == "forward":
            stash[s, m] = progs["forward"][s](p, {**micro(m, s), **got.pop((s, m), {})})
            if "loss" in stash[s, m]:
                losses.append(stash[s, m].pop("loss"))
        elif kind in ("backward", "backward_input"):
            saved = {n[len("saved."):]: v for n, v in stash[s, m].items() if n.startswith("saved.")}
            inp = {**micro(m, s), **saved, **grads_in.pop((s, m), {})}
            del saved
            if kind == "backward":
                del stash[s, m]
                ready, readied = grad_ready(sums, starts.pop(i, ()), started, dp_group)
                out = progs["backward"][s](p, inp, ready)  # what it handed to ready it does not return, but
                for n in readied:  # a gradient a later statement reads: already in the sums
                    out.pop(n, None)
            else:  # ZB-H1: the input gradient now; W reads the stash and the output gradients
                out = progs["backward_input"][s](p, dict(inp))  # W reads inp too
                wstash[s, m] = {**inp, **{n[len("wstash."):]: v for n, v in out.items()
                                          if n.startswith("wstash.")}}
            if RECV[s]:
                grads_out[s, m] = [out["grad." + v] for v, _, _ in RECV[s]]
            del inp, out
        elif kind == "backward_weight":
            del stash[s, m]
            ready = grad_ready(sums, starts.pop(i, ()), started, dp_group)[0]
            progs["backward_weight"][s](p, wstash.pop((s, m)), ready)
        elif kind == "optimizer":
            done = set()  # the buckets' gradients: reduced over dp and scaled
            for j, bucket in enumerate(started):
                done |= finish_bucket(bucket, sums, k, j)
            started.clear()
            mine = sorted(set(sums) - done)  # the others (tied) of every chunk (a param twice: one sum)
            for n in mine:  # collectives reduce in place: a strided sum (a transpose's) is copied
                sums[n] = sums[n].contiguous()
            for n, j in TIED.get(coord, []):  # a tied weight: its stages' sum, before dp
                reduce_over(sums[n], TIED_GROUP[j], k, "tied-weight", TIED_SETS[j])
            for n in mine:  # the gradient of the global batch: sum, then scale once
                if dp_group is not None and dp_split(n) is not None:  # zero=1: this rank's part
                    sums[n] = scatter_over(narrowed(sums[n]), dp_split(n), k).to(sums[n].dtype)
                elif dp_group is not None:
                    sent = narrowed(sums[n])
                    reduce_over(sent, dp_group, k, "dp", DP_GROUPS)
                    sums[n] = sent.to(sums[n].dtype)
                sums[n].mul_(SCALE)
            number, held = torch.tensor(STEP[0], device=DEVICE), STAGES[coord]
            agreed = {}  # clip_grad_norm's sum of squares, fp16's overflow count: every stage's
            for t in held:  # share (this rank's chunks', then summed over pp), read by every update
                for n, v in (progs["stats"][t](p, dict(sums)).items() if t in STATS else ()):  # (it pops inp)
                    agreed[n] = v if n not in agreed else agreed[n] + v
            for n in sorted(agreed):
                reduce_over(agreed[n], pp_group, k, "pp", PP_GROUPS)
            for i, t in enumerate(held):  # each update takes its gradients out of sums (and frees
                later = {n for u in held[i + 1:] for n in GRADS[u]}  # them) but a later chunk's
                grads = {n: sums[n] if n in later else sums.pop(n) for n in GRADS[t] if n in sums}
                result.update(progs["optimizer"][t](p, {**grads, **agreed, "step": number}))
                del grads
            sums.clear()
    if losses:
        loss = torch.stack(losses).sum()
        if dp_group is not None:
            reduce_over(loss, dp_group, k, "dp", DP_GROUPS)
        result["loss"] = loss * SCALE
    return result


def host_copy(t):
    """``t`` as ``--output`` writes it: on the host, copied only where it is a view of a larger
    storage (torch.save writes a view's whole storage), so writing the outputs (the params and
    gradients) does not hold a second copy of them all."""
    t = t.detach().cpu()
    whole = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole else t.clone()


def parse_args(argv):
    """Command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=f"parcomp pipelined program for mesh {MESH_TEXT}; run: {RUN_HINT}")
    ap.add_argument("--checkpoint", required=True,
                    help=".safetensors, .pt state_dict, or a sharded checkpoint (directory or index.json)")
    ap.add_argument("--key-map", type=key_map_arg, default=(), metavar="RULES", help=KEY_MAP_HELP)
    ap.add_argument("--load-report", metavar="FILE", help=LOAD_REPORT_HELP)
    ap.add_argument("--input", help=".pt or .safetensors dict {input name: the global batch}")
    ap.add_argument("--data", metavar="MODULE:FUNCTION", help=DATA_HELP)
    ap.add_argument("--output", help="each stage's outputs of the last step (and its losses) go to "
                                     "OUTPUT.stageK, written by the stage's first rank")
    ap.add_argument("--steps", type=step_count, default=TRAIN_STEPS, metavar="K",
                    help="training steps, each from the last one's state")
    ap.add_argument("--device", choices=sorted({"cpu", PROFILE}), default=PROFILE)
    ap.add_argument("--bench", type=bench_count, default=0, metavar="N",
                    help="then N warm-up + N timed steps from the trained state (not applied); "
                         "rank 0 prints {\"step_ms\": [...]}")
    ap.add_argument("--log-every", type=step_count, default=1, metavar="N",
                    help="the last stage's first rank prints the loss of every N-th step and the last "
                         "(default 1)")
    ap.add_argument("--save", metavar="DIR",
                    help="after the last step, save every stage's params and optimizer state and the "
                         "step number as a torch.distributed.checkpoint in DIR/step-K (atomic: "
                         "DIR/latest names it; DIR/step-K/stages.json names each stage's ranks)")
    ap.add_argument("--save-every", type=step_count, metavar="N",
                    help="with --save: also save after every step whose number is a multiple of N (resumed "
                         "runs count on from the saved step), so a run that dies resumes from the last one")
    ap.add_argument("--resume", metavar="DIR",
                    help="start from the checkpoint DIR/latest names, or DIR itself if it is a step-K "
                         "directory: its params, optimizer state and step; --steps more steps follow")
    ap.add_argument("--replay", metavar="FILE", help=REPLAY_HELP)
    add_cluster_args(ap)
    args = ap.parse_args(argv)
    if args.save_every and not args.save:
        ap.error("--save-every N needs --save DIR (where the checkpoints go)")
    check_input_args(ap, args)
    return args


def load(args):
    """This rank's params, every step's inputs (its rows of them: load_inputs) and the --replay
    starts (``--output`` checked first); under agree()."""
    check_stage_outputs(args)
    params = load_checkpoint(args.checkpoint, args.key_map, args.load_report)
    if args.data:
        batches = StepData(DataSource(args.data), args.steps)
        batches[0]  # the first step's batch read (and checked) now, under agree(); read again at its step
    else:
        batches = [load_inputs(load_batch(args.input))] * args.steps
    with torch.no_grad():
        starts = read_replay(args.replay, args.steps) if args.replay else None
    return params, batches, starts


def first_of_stage():
    """Whether this rank is its stage's first (dp and tp coordinates 0): it prints and writes."""
    return all(c == 0 for a, c in coords(RANK).items() if a != "pp")


def train(args, state, p, batches, first, starts=None, after_step=None, progs=None):
    """``--steps`` steps numbered from ``first`` (updated params and state carry over in
    ``p``; with ``starts`` (--replay), step k starts from ``starts[k-first]``), step k on
    ``batches[k-first]``; the last step's result, with "losses". The last stage's first rank
    prints the loss of every ``--log-every``-th step and the last (the only reads of a loss to
    the host); ``after_step(k)``, when given, runs after step k has updated ``p`` (--save,
    --save-every), and its True ends the loop after that step (a SIGTERM: stop_after).
    ``progs``: the stage programs (:func:`stage_programs`; None: compiled with ``--compile``)."""
    losses, result = [], {}
    progs = progs or stage_programs(args.compile)
    last, printer = first + args.steps - 1, first_of_stage()
    for k in range(first, last + 1):
        STEP[0] = float(k)
        if starts is not None:
            p.update(starts[k - first])
        result.clear()  # the last step's outputs (its gradients) are not kept through this one
        result = step(k, state, p, batches[k - first], progs)
        if "loss" in result:
            losses.append(result["loss"])
            if printer and (k % args.log_every == 0 or k == last):
                print(f"step {k} loss {float(result['loss']):.6g}", flush=True)
        p.update({q: result[q] for q in p if q in result})
        if after_step is not None and after_step(k):
            break
    if losses:
        result["losses"] = torch.stack(losses)
    return result


def run(args):
    """Everything between init_process_group and destroy_process_group."""
    FAULT["where"] = "loading"
    state = setup(args.timeout)
    coord = state[0]
    p, batches, starts = agree(lambda: load(args), "loading")
    first = 1
    if args.resume:
        where = agree(lambda: resume_location(args.resume), "reading --resume")  # every rank exits 2 on damage
        first = agree(lambda: resume_stages(args.resume, where, p, coord), "loading --resume")
    if isinstance(batches, StepData):  # a resumed run reads on from the saved step's next batch
        batches.offset = first - 1
    last = first + args.steps - 1
    saves = saved_steps(first, last, args.save_every) if args.save else []
    if args.save:  # before the first step: a save that cannot succeed is found now
        agree(lambda: check_save(args.save, saves), "checking --save")

    done = []  # the steps run

    def save_during(k):  # --save-every: atomic, so a run killed later resumes from step k
        done.append(k)
        if k in saves and k != last:
            FAULT["where"] = f"saving the checkpoint of step {k}"
            save_stages(args.save, p, coord, k)
        return k != last and stop_after(k)  # a SIGTERM: save step k (below) and exit

    STOP["armed"] = bool(args.save)  # from here a SIGTERM ends the step and saves it
    with torch.no_grad():  # the backward pass is explicit in the stage functions
        progs = stage_programs(args.compile)  # --compile: one graph per stage function, kept for --bench
        result = train(args, state, p, batches, first, starts, save_during if args.save else None, progs)
        stop_wait()  # the last step's flag: the run has ended anyway
    if done and done[-1] != last:
        k = done[-1]
        stopped(args.save, k, None if k in saves else lambda: save_stages(args.save, p, coord, k))
    if args.save:
        FAULT["where"] = "saving the checkpoint"
        save_stages(args.save, p, coord, last)
    FAULT["where"] = "writing the outputs"
    result = {n: whole_value(v, SPLITS.get(n, [])) for n, v in result.items()}
    if args.output and first_of_stage():
        for t in STAGES[coord]:  # one rank per stage writes each (virtual) stage's file
            torch.save({n: host_copy(v) for n, v in result.items()}, f"{args.output}.stage{t}")
    if args.bench:  # every step from the same state: the time of one step, not a trajectory
        with torch.no_grad():
            bench(lambda params, inputs: step(first, state, params, inputs, progs), p, batches[0], args.bench)
    dist.barrier()
# <<< program.py
