"""program.py: one rank's forward pass, emitted by parcomp (torch backend). Do not edit.

model: models.py:gpt2_mlp
spec:  gpt2_mlp_tp2.pcs
mesh:  tp=2 (2 ranks; row-major, the last axis varies fastest)
collectives per forward step: 1, 2048 bytes/rank in all: all_reduce over tp

Run one process per rank:
    torchrun --nproc-per-node 2 program.py --checkpoint model.pt --input x.pt --output out.pt [--device cpu]

--checkpoint  torch state_dict (.pt) or .safetensors with the full (unsharded) parameters;
              each rank keeps only its own slice
--input       .pt or .safetensors dict {input name: full tensor} (or one tensor: one input)
--output      rank 0 writes {output name: full tensor}
--device cpu  run on CPU with gloo whatever the profile (see the PROFILE block)
--bench N     N warm-up + N timed forward steps; rank 0 prints {"step_ms": [...]}
"""
import argparse
import importlib
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist


# ---- PROFILE cuda: the only lines that differ between device profiles ----
PROFILE = "cuda"
DIST_BACKEND = "nccl"
PRELUDE = ()  # imported first; skipped under --device cpu


def profile_device():
    """Bind this process to its device under profile cuda and return it."""
    if not (torch.cuda.is_available() and torch.cuda.device_count() > LOCAL_RANK):
        fail(f"profile cuda: CUDA is not available or has too few GPUs: torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees {torch.cuda.device_count()} GPUs, LOCAL_RANK {LOCAL_RANK} needs {LOCAL_RANK + 1}; install a CUDA build of torch, check CUDA_VISIBLE_DEVICES, or rerun with --device cpu (CPU/gloo, no GPU)")
    torch.cuda.set_device(LOCAL_RANK)
    return torch.device(f"cuda:{LOCAL_RANK}")
# ---- end of PROFILE ----


MESH = {"tp": 2}  # mesh axes in order; ranks are row-major
GROUP_RANKS = {"tp": [[0, 1]]}  # each axis's rank groups, in coordinate order
PARAMS = ("c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias")
INPUTS = ("x",)
OUTPUT_LAYOUTS = {"output": "[R]"}
OUTPUT_GLOBAL_SHAPES = {"output": [2, 8, 32]}
SHARDED_OUTPUT = False  # True: every rank writes its own slices
RUN_HINT = "torchrun --nproc-per-node 2 program.py --checkpoint model.pt --input x.pt --output out.pt"


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
    sys.stderr.write(f"program.py (rank {RANK}): error: {message}\n")
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


def group_size(axis):
    """Ranks in one group of ``axis``: a mesh axis, or a joint group such as ``"dp,tp"``."""
    return math.prod(MESH[a] for a in axis.split(","))


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
    out = x0.new_empty((group_size(axis) * x0.shape[0],) + tuple(x0.shape[1:]))
    _all_gather_single(out, x0, group=GROUPS[axis])
    return out.movedim(0, dim).contiguous()


def reduce_scatter(x, dim, axis):
    """P -> S(dim): sum over the group, keep this rank's chunk of ``dim``."""
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((x0.shape[0] // group_size(axis),) + tuple(x0.shape[1:]))
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
        fail(f"cannot read {what} file {path}: {type(e).__name__}: {e}")


def read_inputs(path):
    """The inputs file as {input name: tensor}; a bare tensor is the model's only input."""
    feeds = read_tensors(path, "input")
    if isinstance(feeds, torch.Tensor) and len(INPUTS) == 1:
        feeds = {INPUTS[0]: feeds}
    if not isinstance(feeds, dict):
        fail(f"input file {path} must hold a dict {{input name: tensor}} for inputs {list(INPUTS)}")
    note_unused(feeds, INPUTS, "input")
    return feeds


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
                         f"does not use: {shown}\n")
        sys.stderr.flush()


def load_checkpoint(path):
    """This rank's slices of the params in the checkpoint at ``path`` (unused keys noted)."""
    ckpt = read_tensors(path, "checkpoint")
    note_unused(ckpt, PARAMS, "checkpoint")
    return load_params(ckpt)


def load_params(ckpt):
    """This rank's slice of every parameter, on DEVICE (full tensors are not kept)."""
    out = {}
    # c_fc.weight: full f32[32,128] [S(1)] -> f32[32,64]; dim 1 split over tp: this rank's 64 of 128 columns
    out["c_fc.weight"] = place(take(ckpt, "c_fc.weight", (32, 128), torch.float32).narrow(1, COORD[0] * 64, 64))  # gpt2_mlp_tp2.pcs:4
    # c_fc.bias: full f32[128] [S(0)] -> f32[64]; dim 0 split over tp: this rank's 64 of 128 entries
    out["c_fc.bias"] = place(take(ckpt, "c_fc.bias", (128,), torch.float32).narrow(0, COORD[0] * 64, 64))  # gpt2_mlp_tp2.pcs:4
    # c_proj.weight: full f32[128,32] [S(0)] -> f32[64,32]; dim 0 split over tp: this rank's 64 of 128 rows
    out["c_proj.weight"] = place(take(ckpt, "c_proj.weight", (128, 32), torch.float32).narrow(0, COORD[0] * 64, 64))  # gpt2_mlp_tp2.pcs:5
    # c_proj.bias: full f32[32] [R] -> f32[32]; replicated: every rank keeps all of it
    out["c_proj.bias"] = place(take(ckpt, "c_proj.bias", (32,), torch.float32))
    return out


def load_inputs(feeds):
    """This rank's slice of every input, on DEVICE (full tensors are not kept)."""
    out = {}
    # x: full f32[2,8,32] [R] -> f32[2,8,32]; replicated: every rank keeps all of it
    out["x"] = place(take(feeds, "x", (2, 8, 32), torch.float32))  # gpt2_mlp_tp2.pcs:6
    return out


def forward(p, inp):
    """One forward step on this rank: local slices in, {output name: local value} out."""
    c_fc_weight = p["c_fc.weight"]  # [S(1)] f32[32,64]; gpt2_mlp_tp2.pcs:4
    c_fc_bias = p["c_fc.bias"]  # [S(0)] f32[64]; gpt2_mlp_tp2.pcs:4
    c_proj_weight = p["c_proj.weight"]  # [S(0)] f32[64,32]; gpt2_mlp_tp2.pcs:5
    c_proj_bias = p["c_proj.bias"]  # [R] f32[32]
    x = inp["x"]  # [R] f32[2,8,32]; gpt2_mlp_tp2.pcs:6
    c_fc_reshape = x.reshape((16, 32))  # [R] f32[16,32]
    c_fc_addmm = torch.addmm(c_fc_bias, c_fc_reshape, c_fc_weight)  # [S(1)] f32[16,64]
    del c_fc_reshape
    c_fc = c_fc_addmm.reshape((2, 8, 64))  # [S(2)] f32[2,8,64]
    del c_fc_addmm
    act_scale = c_fc * 0.5  # [S(2)] f32[2,8,64]
    act_pow = torch.pow(c_fc, 3.0)  # [S(2)] f32[2,8,64]
    act_scale_1 = act_pow * 0.044715  # [S(2)] f32[2,8,64]
    del act_pow
    act_add = c_fc.add_(act_scale_1)  # [S(2)] f32[2,8,64]
    del c_fc, act_scale_1
    act_scale_2 = act_add * 0.7978845608028654  # [S(2)] f32[2,8,64]
    del act_add
    act_tanh = torch.tanh(act_scale_2)  # [S(2)] f32[2,8,64]
    del act_scale_2
    act_add_scalar = act_tanh + 1.0  # [S(2)] f32[2,8,64]
    del act_tanh
    act = act_scale * act_add_scalar  # [S(2)] f32[2,8,64]
    del act_scale, act_add_scalar
    c_proj_reshape = act.reshape((16, 64))  # [S(1)] f32[16,64]
    del act
    c_proj_matmul = torch.matmul(c_proj_reshape, c_proj_weight)  # [P] f32[16,32]
    del c_proj_reshape
    # all_reduce over tp [P] -> [R], bytes/rank 2048: c_proj_matmul: its matmul contracts a dim split over
    #   tp (row-parallel), so each rank holds a partial sum; add c_proj_add needs the full value [R]: sum
    #   once
    c_proj_all_reduce = all_reduce_(c_proj_matmul, "tp")  # [R] f32[16,32]; gpt2_mlp_tp2.pcs:5
    del c_proj_matmul
    c_proj_add = c_proj_all_reduce.add_(c_proj_bias)  # [R] f32[16,32]
    del c_proj_all_reduce
    c_proj = c_proj_add.reshape((2, 8, 32))  # [R] f32[2,8,32]
    del c_proj_add
    return {"output": c_proj}


def rank_path(path, rank):
    """``out.pt`` -> ``out.rank{rank}.pt``: where a rank writes its slices of sharded outputs."""
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"


def write_outputs(outputs, path):
    """Rank 0 writes {name: full tensor}; with a sharded output every rank writes its slices."""
    local = {name: value.detach().cpu() for name, value in outputs.items()}
    if not SHARDED_OUTPUT:
        if RANK == 0:
            torch.save(local, path)
        return
    torch.save({"rank": RANK, "coords": list(COORD), "outputs": local, "layouts": OUTPUT_LAYOUTS,
                "global_shapes": OUTPUT_GLOBAL_SHAPES}, rank_path(path, RANK))


def sync():
    """Wait for the device to finish queued work (no-op on CPU)."""
    if DEVICE.type != "cpu":
        getattr(torch, DEVICE.type).synchronize()


MAX_BENCH = 100_000  # --bench N runs 2N steps: bounded, as --steps is


def bench_count(text):
    """``--bench N``: 0 (off) to MAX_BENCH timed steps, else an argparse error giving the range."""
    try:
        count = int(text)
    except ValueError:
        count = -1
    if not 0 <= count <= MAX_BENCH:
        raise argparse.ArgumentTypeError(f"{text}: give 0 to {MAX_BENCH:_} timed steps")
    return count


def bench(step_fn, params, inputs, steps):
    """``steps`` warm-up then ``steps`` timed steps of ``step_fn``; rank 0 prints the max over ranks (ms)."""
    times = []
    for i in range(2 * steps):
        dist.barrier()
        start = time.perf_counter()
        step_fn(params, inputs)
        sync()
        elapsed = torch.tensor([(time.perf_counter() - start) * 1e3], device=DEVICE)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= steps:
            times.append(round(elapsed.item(), 4))
    if RANK == 0:
        print(json.dumps({"step_ms": times}), flush=True)


def parse_args(argv):
    """Command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=f"parcomp program for mesh {MESH_TEXT}; run: {RUN_HINT}")
    ap.add_argument("--checkpoint", required=bool(PARAMS), help=".pt state_dict or .safetensors")
    ap.add_argument("--input", required=bool(INPUTS), help=".pt or .safetensors dict of inputs")
    ap.add_argument("--output", help="where to write the outputs (.pt)")
    ap.add_argument("--device", choices=sorted({"cpu", PROFILE}), default=PROFILE)
    ap.add_argument("--bench", type=bench_count, default=0, metavar="N", help="time N forward steps")
    return ap.parse_args(argv)


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
            fail(f"profile {PROFILE} needs the module {name} ({e}); install it or rerun with --device cpu")


def run(args):
    """Everything between init_process_group and destroy_process_group."""
    make_groups()
    params = load_checkpoint(args.checkpoint) if PARAMS else {}
    inputs = load_inputs(read_inputs(args.input)) if INPUTS else {}
    with torch.inference_mode():
        outputs = forward(params, inputs)
        if args.bench > 0:
            bench(forward, params, inputs, args.bench)
    if args.output:
        write_outputs(outputs, args.output)


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
    main()
