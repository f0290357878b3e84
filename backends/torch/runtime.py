"""The fixed parts of every emitted ``program.py``: its runtime, as source text.

:data:`RUNTIME` (process facts, collectives, loading) goes after the generated
constants, :data:`MAIN` (outputs, benchmark, argument parsing, ``main``) after
the generated ``forward``.  Both use only names the emitter defines: ``MESH``,
``GROUP_RANKS``, ``PARAMS``, ``INPUTS``, ``OUTPUT_LAYOUTS``,
``OUTPUT_GLOBAL_SHAPES``, ``SHARDED_OUTPUT``, ``RUN_HINT``, ``PROFILE``,
``DIST_BACKEND``, ``PRELUDE``, ``profile_device``, ``load_params``,
``load_inputs``, ``forward``.

A training program (one whose outputs feed its own params) uses
:data:`TRAIN_RUNTIME` and :data:`TRAIN_MAIN` instead: the same pieces, with a
loop of ``train_step`` calls, ``--steps`` and per-step inputs; besides the names
above they use ``STATE``, ``CARRIED``, ``STEP_INPUT``, ``TRAIN_STEPS`` and
``train_step``.  Both kinds are assembled from the same chunks below, so a
forward program's text does not depend on the training parts.

The collectives follow ``parcomp/reference/interpreter.py`` exactly (groups in
coordinate order, concatenation never sums) and never modify their inputs.
Single-tensor gathers and scatters always work on dim 0 of a ``movedim`` copy:
gloo accepts only the concatenated dim-0 form of ``all_gather_single``.

:func:`read_losses` and :func:`assemble_training_outputs` run on the host: they
read back what a training program wrote.
"""
from __future__ import annotations

import os

from parcomp.passes.train_config import MAX_STEPS  # the bound of --steps, as in the spec

# ---- chunks of program text, joined by blank lines into RUNTIME, MAIN, TRAIN_* (at the end) ----
_PROCESS = '''\
RANK = int(os.environ.get("RANK", "0"))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "0"))
MESH_SIZE = math.prod(MESH.values())
MESH_TEXT = " ".join(f"{axis}={size}" for axis, size in MESH.items())
AXIS = {axis: i for i, axis in enumerate(MESH)}
DEVICE = torch.device("cpu")  # set by main()
GROUPS = {}  # mesh axis -> this rank's process group, set by make_groups()
FILES = {}  # "checkpoint" / "input" -> the path read (for messages), set by read_tensors()


def fail(message):
    """Print ``message`` on stderr (one write, so ranks' lines do not interleave) and exit 2."""
    sys.stderr.write(f"program.py (rank {RANK}): error: {message}\\n")
    sys.stderr.flush()
    sys.exit(2)


def mesh_coords(rank):
    """Mesh coordinates of a global rank (row-major: the last axis varies fastest)."""
    coords = []
    for size in reversed(list(MESH.values())):
        coords.append(rank % size)
        rank //= size
    return tuple(reversed(coords))


COORD = mesh_coords(RANK)


def make_groups():
    """One process group per line of each mesh axis; every rank creates all of them, in order."""
    for axis, lines in GROUP_RANKS.items():
        for ranks in lines:
            group = dist.new_group(ranks)
            if RANK in ranks:
                GROUPS[axis] = group


# ---- layout changes; semantics: parcomp/reference/interpreter.py (_LAYOUT_OPS) ----
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce(x, axis):
    """P -> R: the sum over the group of mesh axis ``axis`` (``x`` is left unchanged)."""
    y = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(y, op=dist.ReduceOp.SUM, group=GROUPS[axis])
    return y


def all_reduce_(x, axis):
    """P -> R in place: for a fresh contiguous value nothing else reads (saves a copy)."""
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=GROUPS[axis])
    return x


def all_reduce_start(x, axis):
    """Start all_reduce(x, axis) without waiting; ``wait(handle)`` returns the sum."""
    return all_reduce_start_(x.clone(memory_format=torch.contiguous_format), axis)


def all_reduce_start_(x, axis):
    """Start an in-place all_reduce of a fresh contiguous value nothing else reads."""
    return x, dist.all_reduce(x, op=dist.ReduceOp.SUM, group=GROUPS[axis], async_op=True)


def wait(handle):
    """The value of a started collective, once it has arrived."""
    x, work = handle
    work.wait()
    return x


def all_gather(x, dim, axis):
    """S(dim) -> R: concatenate the group's shards along ``dim``, in coordinate order."""
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((MESH[axis] * x0.shape[0],) + tuple(x0.shape[1:]))
    _all_gather_single(out, x0, group=GROUPS[axis])
    return out.movedim(0, dim).contiguous()


def reduce_scatter(x, dim, axis):
    """P -> S(dim): sum over the group, keep this rank's chunk of ``dim``."""
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((x0.shape[0] // MESH[axis],) + tuple(x0.shape[1:]))
    _reduce_scatter_single(out, x0, op=dist.ReduceOp.SUM, group=GROUPS[axis])
    return out.movedim(0, dim).contiguous()


def all_to_all(x, src_dim, dim, axis):
    """S(src_dim) -> S(dim): chunk j of ``dim`` goes to coordinate j; concatenate along ``src_dim``."""
    send = [c.contiguous() for c in x.chunk(MESH[axis], dim)]
    recv = [torch.empty_like(c) for c in send]
    dist.all_to_all(recv, send, group=GROUPS[axis])
    return torch.cat(recv, dim=src_dim)


def shard_slice(x, dim, axis):
    """R -> S(dim): keep this rank's chunk of ``dim`` (local, no communication)."""
    return x.chunk(MESH[axis], dim)[COORD[AXIS[axis]]].contiguous()


def partial_mask(x, axis):
    """R -> P: coordinate 0 of ``axis`` keeps the value, the others hold zeros (local)."""
    return x if COORD[AXIS[axis]] == 0 else torch.zeros_like(x)


# ---- loading ----
def read_tensors(path, what):
    """{name: tensor} (on CPU) from a .safetensors or torch .pt file; exits 2 if unreadable."""
    FILES[what] = path
    if not os.path.isfile(path):
        fail(f"{what} file {path} does not exist")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file
            return load_file(path, device="cpu")
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any reader error becomes one clear message
        fail(f"cannot read {what} file {path}: {type(e).__name__}: {e}")'''

_READ_INPUTS = '''\
def read_inputs(path):
    """The inputs file as {input name: tensor}; a bare tensor is the model's only input."""
    feeds = read_tensors(path, "input")
    if isinstance(feeds, torch.Tensor) and len(INPUTS) == 1:
        feeds = {INPUTS[0]: feeds}
    if not isinstance(feeds, dict):
        fail(f"input file {path} must hold a dict {{input name: tensor}} for inputs {list(INPUTS)}")
    note_unused(feeds, INPUTS, "input")
    return feeds'''

_TAKE_PLACE = '''\
def take(tensors, name, shape, dtype):
    """The full tensor ``name`` of a loaded file, checked against its full (unsharded) shape
    and the dtype the program was compiled for (never cast: a mismatch exits 2)."""
    what = "param" if name in PARAMS else "input"
    if name not in tensors:
        have = ", ".join(sorted(map(str, tensors))[:10]) or "nothing"
        fail(f"{what} {name!r} (full shape {list(shape)}) is missing; the file has: {have}")
    t = tensors[name]
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
        got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        fail(f"{what} {name!r} has shape {got}, expected the full (unsharded) shape {list(shape)}")
    if t.dtype != dtype:
        source = FILES.get("checkpoint" if what == "param" else "input", "the file")
        fail(f"{what} {name!r} in {source} has dtype {t.dtype}, but the program was compiled for "
             f"{dtype}; nothing is cast: save it as {dtype} (tensor.to({dtype})) or compile a "
             f"model whose {what} is {t.dtype}")
    return t


def place(t):
    """A compact copy of ``t`` on DEVICE (so the full tensor it was cut from can be freed)."""
    return torch.empty(t.shape, dtype=t.dtype, device=DEVICE).copy_(t)


def note_unused(tensors, used, what):
    """Rank 0 lists, on one line of stderr, the keys of a loaded ``what`` file that the
    program does not read (a note, not an error)."""
    if RANK != 0 or not isinstance(tensors, dict):
        return
    unused = sorted(str(k) for k in tensors if k not in used)
    if unused:
        shown = ", ".join(unused[:20]) + (", ..." if len(unused) > 20 else "")
        keys = "1 key" if len(unused) == 1 else f"{len(unused)} keys"
        sys.stderr.write(f"program.py: note: {what} file {FILES.get(what)} has {keys} this program "
                         f"does not use: {shown}\\n")
        sys.stderr.flush()


def load_checkpoint(path):
    """This rank's slices of the params in the checkpoint at ``path`` (unused keys noted)."""
    ckpt = read_tensors(path, "checkpoint")
    note_unused(ckpt, PARAMS, "checkpoint")
    return load_params(ckpt)'''

_RANK_PATH = '''\
def rank_path(path, rank):
    """``out.pt`` -> ``out.rank{rank}.pt``: where a rank writes its slices of sharded outputs."""
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"'''

_WRITE_OUTPUTS = '''\
def write_outputs(outputs, path):
    """Rank 0 writes {name: full tensor}; with a sharded output every rank writes its slices."""
    local = {name: value.detach().cpu() for name, value in outputs.items()}
    if not SHARDED_OUTPUT:
        if RANK == 0:
            torch.save(local, path)
        return
    torch.save({"rank": RANK, "coords": list(COORD), "outputs": local, "layouts": OUTPUT_LAYOUTS,
                "global_shapes": OUTPUT_GLOBAL_SHAPES}, rank_path(path, RANK))'''

_SYNC = '''\
def sync():
    """Wait for the device to finish queued work (no-op on CPU)."""
    if DEVICE.type != "cpu":
        getattr(torch, DEVICE.type).synchronize()'''

# STEP_FN, STEP_WHAT: the step function and what it does, filled in by _bench()
_BENCH = '''\
def bench(params, inputs, steps):
    """``steps`` warm-up then ``steps`` timed STEP_WHAT; rank 0 prints the max over ranks (ms)."""
    times = []
    for i in range(2 * steps):
        dist.barrier()
        start = time.perf_counter()
        STEP_FN(params, inputs)
        sync()
        elapsed = torch.tensor([(time.perf_counter() - start) * 1e3], device=DEVICE)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= steps:
            times.append(round(elapsed.item(), 4))
    if RANK == 0:
        print(json.dumps({"step_ms": times}), flush=True)'''

_PARSE_ARGS = '''\
def parse_args(argv):
    """Command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=f"parcomp program for mesh {MESH_TEXT}; run: {RUN_HINT}")
    ap.add_argument("--checkpoint", required=bool(PARAMS), help=".pt state_dict or .safetensors")
    ap.add_argument("--input", required=bool(INPUTS), help=".pt or .safetensors dict of inputs")
    ap.add_argument("--output", help="where to write the outputs (.pt)")
    ap.add_argument("--device", choices=sorted({"cpu", PROFILE}), default=PROFILE)
    ap.add_argument("--bench", type=int, default=0, metavar="N", help="time N forward steps")
    return ap.parse_args(argv)'''

_WORLD = '''\
def check_world():
    """Exit 2 unless started by torchrun with exactly one process per mesh rank."""
    if "WORLD_SIZE" not in os.environ:
        fail(f"start this program with torchrun, one process per rank: {RUN_HINT}")
    if WORLD_SIZE != MESH_SIZE:
        ranks = "1 rank" if MESH_SIZE == 1 else f"{MESH_SIZE} ranks"
        fail(f"program compiled for mesh {MESH_TEXT} ({ranks}) but started with "
             f"WORLD_SIZE={WORLD_SIZE}; run: {RUN_HINT}")


def import_prelude():
    """Import the profile's device modules (e.g. torch_npu); exit 2 naming a missing one."""
    for name in PRELUDE:
        try:
            importlib.import_module(name)
        except ImportError as e:
            fail(f"profile {PROFILE} needs the module {name} ({e}); install it or rerun with --device cpu")'''

_RUN = '''\
def run(args):
    """Everything between init_process_group and destroy_process_group."""
    make_groups()
    params = load_checkpoint(args.checkpoint) if PARAMS else {}
    inputs = load_inputs(read_inputs(args.input)) if INPUTS else {}
    with torch.inference_mode():
        outputs = forward(params, inputs)
        if args.bench > 0:
            bench(params, inputs, args.bench)
    if args.output:
        write_outputs(outputs, args.output)'''

_MAIN_FN = '''\
def keep_freed_memory():
    """glibc only: keep freed activation buffers in the allocator instead of returning them to
    the OS, so each step does not page-fault them in again (measured in bench/tp_mlp.py)."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: 32 MiB
        libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD: 256 MiB
    except (OSError, AttributeError):
        pass  # not glibc: the default allocator behaviour is kept


def main(argv=None):
    """Check the world, pick the device, start torch.distributed, run, always shut it down."""
    global DEVICE
    args = parse_args(argv)
    check_world()
    if args.output and not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        fail(f"--output {args.output}: its directory does not exist")
    keep_freed_memory()
    if args.device == "cpu":
        backend, DEVICE = "gloo", torch.device("cpu")
    else:
        import_prelude()
        backend, DEVICE = DIST_BACKEND, profile_device()
    dist.init_process_group(backend)
    try:
        run(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()'''

# ---- training programs only (see :data:`TRAIN_MAIN`) ----
_TRAIN_WRITE_OUTPUTS = '''\
def write_outputs(outputs, losses, path):
    """The last step's outputs, written as a forward program writes its outputs, plus
    "losses": [every step's loss] in the file (rank 0's) or in every rank's file."""
    local = {name: value.detach().cpu() for name, value in outputs.items()}
    if not SHARDED_OUTPUT:
        if RANK == 0:
            torch.save({**local, "losses": losses}, path)
        return
    torch.save({"rank": RANK, "coords": list(COORD), "outputs": local, "layouts": OUTPUT_LAYOUTS,
                "global_shapes": OUTPUT_GLOBAL_SHAPES, "losses": losses}, rank_path(path, RANK))'''

_TRAIN_PARSE_ARGS = '''\
def step_count(text):
    """The value of --steps: a whole number of steps from 1 to MAX_STEPS."""
    steps = int(text)  # argparse reports a ValueError as an invalid value
    if not 1 <= steps <= MAX_STEPS:
        raise argparse.ArgumentTypeError(f"{text}: give 1 to MAX_STEPS training steps")
    return steps


def parse_args(argv):
    """Command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=f"parcomp program for mesh {MESH_TEXT}; run: {RUN_HINT}")
    ap.add_argument("--checkpoint", required=True, help=".pt state_dict or .safetensors")
    ap.add_argument("--input", required=bool(INPUTS),
                    help=".pt dict of inputs for every step, or a list of one dict per step")
    ap.add_argument("--output", help="where to write the last step's outputs and the losses (.pt)")
    ap.add_argument("--steps", type=step_count, default=TRAIN_STEPS, metavar="K",
                    help=f"training steps (default {TRAIN_STEPS})")
    ap.add_argument("--device", choices=sorted({"cpu", PROFILE}), default=PROFILE)
    ap.add_argument("--bench", type=int, default=0, metavar="N",
                    help="time N training steps from the loaded parameters (not applied)")
    return ap.parse_args(argv)'''

_TRAIN_LOOP = '''\
def read_batches(path, steps):
    """This rank's slices of every step's inputs: one dict {input name: tensor} serves
    every step; a list holds one such dict per step."""
    feeds = read_tensors(path, "input")
    if isinstance(feeds, torch.Tensor) and len(INPUTS) == 1:
        feeds = {INPUTS[0]: feeds}
    if isinstance(feeds, dict):
        note_unused(feeds, INPUTS, "input")
        return [load_inputs(feeds)] * steps
    if not isinstance(feeds, (list, tuple)) or not all(isinstance(f, dict) for f in feeds):
        fail(f"input file {path} must hold a dict {{input name: tensor}} for inputs {list(INPUTS)} "
             f"or a list of one such dict per step")
    if len(feeds) != steps:
        fail(f"input file {path} holds the inputs of {len(feeds)} steps but --steps is {steps}")
    note_unused(feeds[0] if feeds else {}, INPUTS, "input")
    return [load_inputs(f) for f in feeds]


def with_step(inputs, k):
    """The inputs of step ``k`` (counted from 1), with the step number the optimizer reads."""
    if STEP_INPUT is None:
        return inputs
    return {**inputs, STEP_INPUT: torch.tensor(float(k), dtype=torch.float32, device=DEVICE)}


def train(params, batches):
    """One train_step per batch; the CARRIED outputs are the next step's params and state.

    Rank 0 prints each step's loss. Returns the last step's outputs and every loss (floats).
    """
    outputs, losses = {}, []
    for k, inputs in enumerate(batches, start=1):
        outputs = train_step(params, with_step(inputs, k))
        params = {**params, **{name: outputs[name] for name in CARRIED}}
        losses.append(outputs["loss"])
        if RANK == 0:
            print(f"step {k} loss {outputs['loss'].item():.6g}", flush=True)
    return outputs, [loss.item() for loss in losses]


def run(args):
    """Everything between init_process_group and destroy_process_group."""
    make_groups()
    params = load_checkpoint(args.checkpoint)
    batches = read_batches(args.input, args.steps) if INPUTS else [{}] * args.steps
    with torch.no_grad():  # the backward pass is explicit in train_step: no autograd state
        outputs, losses = train(params, batches)
        if args.bench > 0:  # on copies: train_step updates params and state in place
            bench({k: v.clone() for k, v in params.items()}, with_step(batches[0], 1), args.bench)
    if args.output:
        write_outputs(outputs, losses, args.output)'''


# ---- the header: imports and the option lines of the docstring ({out}: where outputs go) ----
IMPORTS = """\
import argparse
import importlib
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist"""

# the option lines of the module docstring; {out}: where the outputs go
FORWARD_HELP = """\
--checkpoint  torch state_dict (.pt) or .safetensors with the full (unsharded) parameters;
              each rank keeps only its own slice
--input       .pt or .safetensors dict {{input name: full tensor}} (or one tensor: one input)
--output      {out}
--device cpu  run on CPU with gloo whatever the profile (see the PROFILE block)
--bench N     N warm-up + N timed forward steps; rank 0 prints {{"step_ms": [...]}}\
"""

TRAIN_HELP = """\
--checkpoint  torch state_dict (.pt) or .safetensors with the full (unsharded) parameters;
              each rank keeps only its own slice; optimizer state starts at zeros
--input       .pt dict {{input name: full tensor}} used by every step, or a list of one such
              dict per step (.safetensors: one dict)
--steps K     train steps k = 1..K (default {steps}){step}; rank 0 prints "step k loss L"
--output      the last step's outputs, and "losses": [loss of every step] in the file(s):
              {out}
--device cpu  run on CPU with gloo whatever the profile (see the PROFILE block)
--bench N     N warm-up + N timed training steps (not applied); rank 0 prints {{"step_ms": [...]}}\
"""


def _join(*chunks) -> str:
    """Chunks of program text, two blank lines apart."""
    return "\n\n\n".join(chunks)


def _bench(fn: str, what: str) -> str:
    """``bench`` timing ``fn(params, inputs)``, described as ``what``."""
    return _BENCH.replace("STEP_FN", fn).replace("STEP_WHAT", what)


RUNTIME = _join(_PROCESS, _READ_INPUTS, _TAKE_PLACE)
MAIN = _join(_RANK_PATH, _WRITE_OUTPUTS, _SYNC, _bench("forward", "forward steps"), _PARSE_ARGS,
             _WORLD, _RUN, _MAIN_FN)
TRAIN_RUNTIME = _join(_PROCESS, _TAKE_PLACE)
TRAIN_MAIN = _join(_RANK_PATH, _TRAIN_WRITE_OUTPUTS, _SYNC,
                   _bench("train_step", "training steps"),
                   _TRAIN_PARSE_ARGS.replace("MAX_STEPS", f"{MAX_STEPS:_}"), _WORLD, _TRAIN_LOOP,
                   _MAIN_FN)


def read_losses(output_path) -> list:
    """The per-step losses a training ``program.py --output PATH`` wrote (floats, step 1 first).

    Reads ``PATH`` (replicated outputs) or, if absent, rank 0's ``PATH`` with ``.rank0``.
    """
    import torch

    path = output_path
    if not os.path.exists(path):
        root, ext = os.path.splitext(str(path))
        path = f"{root}.rank0{ext}"
    return list(torch.load(str(path), map_location="cpu", weights_only=True)["losses"])


def assemble_training_outputs(output_path, program) -> tuple:
    """``(outputs, losses)`` from what a training ``program.py --output PATH`` wrote.

    ``outputs`` is :func:`parcomp_backends.torch.launch.assemble_outputs` of the last
    step (``{public name: full np.ndarray}``), ``losses`` is :func:`read_losses`.
    """
    import torch

    from parcomp.ir.types import Replicate

    from .launch import assemble_outputs

    losses = read_losses(output_path)
    outs = program.named_outputs()
    if not all(isinstance(p, Replicate) for _, v in outs for p in program[v].layout):
        return assemble_outputs(output_path, program), losses
    # one file {name: tensor, "losses": [...]}; assemble_outputs wants the names alone
    data = torch.load(str(output_path), map_location="cpu", weights_only=True)
    data.pop("losses", None)
    if sorted(data) != sorted(pub for pub, _ in outs):
        raise ValueError(f"{output_path} holds {sorted(data)}, expected {[p for p, _ in outs]}")
    full = {}
    for pub, _ in outs:
        t = data[pub]
        full[pub] = (t.float() if t.dtype == torch.bfloat16 else t).numpy()
    return full, losses
