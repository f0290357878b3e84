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
--compile     run the step under torch.compile
--timeout S   seconds a collective may wait (default: TIMEOUT_S below)
--placement   refuse (default: PLACEMENT below) or warn when a tp group spans hosts
--print-launch [NODESxDEVICES]  print each node's environment and torchrun line, then exit
"""
import argparse
import datetime
import importlib
import json
import math
import os
import socket
import sys
import time

import torch
import torch.distributed as dist


# ---- PROFILE cuda: the only lines that differ between device profiles ----
PROFILE = "cuda"
DIST_BACKEND = "nccl"
PRELUDE = ()  # imported first; skipped under --device cpu
BIND_DEVICE_ID = True  # init_process_group(device_id=DEVICE)
LAUNCH_ENV = (  # --print-launch: set on every node before torchrun
    "export NCCL_SOCKET_IFNAME=eth0  # the interface for bootstrap and socket traffic",
    "export NCCL_IB_HCA=mlx5  # the InfiniBand/RoCE adapters (ibv_devices lists them)",
    "export NCCL_DEBUG=WARN  # INFO prints the rings and transports NCCL picked",
)


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
COMM_AXES = ("tp",)  # the axes whose process groups the program uses
HOST_AXES = ("tp",)  # axes whose groups must sit on one host (checked at start)
PLACEMENT = "refuse"  # a HOST_AXES group on several hosts: refuse | warn (--placement)
TIMEOUT_S = 600  # seconds a collective may wait (--timeout)
TOPOLOGY = None  # the spec's nodes, devices per node (--print-launch)
COLLECTIVE_DTYPES = ("float32",)  # what the collectives carry


RANK = int(os.environ.get("RANK", "0"))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "0"))
MESH_SIZE = math.prod(MESH.values())
MESH_TEXT = " ".join(f"{axis}={size}" for axis, size in MESH.items())
AXIS = {axis: i for i, axis in enumerate(MESH)}
DEVICE = torch.device("cpu")  # set by main()
GROUPS = {}  # mesh axis -> this rank's process group, set by make_groups()
FILES = {}  # "checkpoint" / "input" -> the path read (for messages), set by read_tensors()
FAILED = []  # the messages fail() printed on this rank (agree() gathers the last one)


def fail(message):
    """Print ``message`` on stderr (one write, so ranks' lines do not interleave) and exit 2."""
    FAILED.append(message)
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
    """The process group of each axis the program communicates over (COMM_AXES): WORLD when
    the axis spans every rank, else one group per line of the axis, made by every rank in order."""
    for axis in COMM_AXES:
        lines = GROUP_RANKS[axis]
        if len(lines) == 1:  # one line holds every rank: no second communicator
            GROUPS[axis] = dist.group.WORLD
            continue
        for ranks in lines:
            group = dist.new_group(ranks)
            if RANK in ranks:
                GROUPS[axis] = group


# ---- layout changes; semantics: parcomp/reference/interpreter.py (_LAYOUT_OPS) ----
def collective(new, old):
    """The torch.distributed function to call, looked up when called (after the PRELUDE
    imports): a replacement of ``old`` that a device module installed (torch_npu, torchair)
    wins; else ``new`` where this torch has it, else ``old``."""
    replaced = getattr(dist, old, None)
    if replaced is not None and getattr(replaced, "__module__", "").startswith("torch.distributed"):
        return getattr(dist, new, None) or replaced
    return replaced or getattr(dist, new)


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
    collective("all_gather_single", "all_gather_into_tensor")(out, x0, group=GROUPS[axis])
    return out.movedim(0, dim).contiguous()


def reduce_scatter(x, dim, axis):
    """P -> S(dim): sum over the group, keep this rank's chunk of ``dim``."""
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((x0.shape[0] // MESH[axis],) + tuple(x0.shape[1:]))
    collective("reduce_scatter_single", "reduce_scatter_tensor")(out, x0, op=dist.ReduceOp.SUM,
                                                                 group=GROUPS[axis])
    return out.movedim(0, dim).contiguous()


def all_to_all(x, src_dim, dim, axis):
    """S(src_dim) -> S(dim): chunk j of ``dim`` goes to coordinate j; concatenate along ``src_dim``.
    One contiguous ``all_to_all_single`` (chunk j at row j), HCCL's robust path."""
    send = torch.stack(x.chunk(MESH[axis], dim))
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=GROUPS[axis])
    return torch.cat(recv.unbind(0), dim=src_dim)


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
    add_cluster_args(ap)
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


HOSTS = []  # every rank's host, by rank, set by check_placement()


def add_cluster_args(ap):
    """The options every program has for running on a cluster."""
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, metavar="S",
                    help=f"seconds a collective may wait for the other ranks (default {TIMEOUT_S:g})")
    ap.add_argument("--placement", choices=("refuse", "warn"), default=PLACEMENT,
                    help=f"a {'/'.join(HOST_AXES) or 'tp'} group on several hosts: stop, or only warn "
                         f"(default {PLACEMENT})")
    ap.add_argument("--compile", action="store_true",
                    help="run the step under torch.compile (capture, fuse and reorder it)")
    ap.add_argument("--print-launch", nargs="?", const="", metavar="NODESxDEVICES",
                    help="print the environment and the torchrun line of every node, then exit "
                         f"(default topology: {TOPOLOGY_TEXT})")


def compiled_step(step, args):
    """``step`` under torch.compile with ``--compile`` (fullgraph on a functional program), else ``step``."""
    return torch.compile(step, fullgraph="funcol" in globals()) if args.compile else step


def launch_request(argv):
    """The value of ``--print-launch`` ("" without a topology), or None when not given."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--print-launch", nargs="?", const="")
    return ap.parse_known_args(argv)[0].print_launch


def init_dist(backend, args):
    """init_process_group with an explicit timeout, bound to DEVICE where the profile allows
    (the communicators then start now, not at the first collective after loading)."""
    bind = BIND_DEVICE_ID and args.device != "cpu"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout),
                            device_id=DEVICE if bind else None)


def check_output(path):
    """Exit 2 unless the directory of ``--output`` exists (run under agree())."""
    if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        fail(f"--output {path}: its directory does not exist")


def this_host():
    """This rank's host name; tests simulate hosts on one machine with PARCOMP_SIM_NODE
    (set by parcomp_backends.torch.launch.run_torchrun_multinode)."""
    node = os.environ.get("PARCOMP_SIM_NODE")
    return f"sim-node{node}" if node is not None else socket.gethostname()


def check_placement(mode):
    """Gather every rank's host (once, at start); a group of a HOST_AXES axis on more than one
    host exits 2 on every rank (``mode`` refuse) or is reported by rank 0 (``mode`` warn)."""
    HOSTS[:] = [None] * WORLD_SIZE
    dist.all_gather_object(HOSTS, this_host())
    for axis in HOST_AXES:
        for ranks in GROUP_RANKS[axis]:
            if len({HOSTS[r] for r in ranks}) > 1:
                message = spanning_message(axis, ranks)
                if mode == "refuse":
                    fail(message + "; or rerun with --placement warn to run it anyway")
                if RANK == 0:
                    sys.stderr.write(f"program.py: warning: {message}\n")
                    sys.stderr.flush()
                return


def spanning_message(axis, ranks):
    """Why a group of ``axis`` must not span hosts, with the hosts and the launch that fits."""
    where = ", ".join(f"rank {r} on {HOSTS[r]}" for r in ranks)
    block = MESH[axis] * math.prod(list(MESH.values())[AXIS[axis] + 1:])
    local = os.environ.get("LOCAL_WORLD_SIZE", "?")
    return (f"the {axis} group {ranks} spans hosts ({where}); {axis} communicates in every layer "
            f"and needs the links inside one host, but torchrun started LOCAL_WORLD_SIZE={local} "
            f"per node: start a multiple of {block} ranks per host (--nproc-per-node; see "
            f"--print-launch)")


def agree(step, what):
    """``step()`` on every rank, then every rank learns whether every rank succeeded.

    Returns ``step()``'s value when every rank succeeded.  Otherwise every rank prints which
    ranks failed ``what`` and why (their messages, gathered) and exits 2; a rank's own failure
    (fail() or any exception) does not leave the others waiting in a collective.  The flags
    and messages go through the launcher's key-value store, not the device communicator: it
    works when that is broken, and no collective is in flight when a rank exits.
    """
    error = None
    try:
        result = step()
    except SystemExit as e:
        if e.code != 2:
            raise
        error = FAILED[-1] if FAILED else f"{what} failed"
    except Exception as e:  # noqa: BLE001 - any failure becomes this rank's message
        error = f"{type(e).__name__}: {e}"
        sys.stderr.write(f"program.py (rank {RANK}): error: {what}: {error}\n")
    store, key = dist.distributed_c10d._get_default_store(), f"parcomp/agree/{what}/"
    if error is not None:
        store.set(f"{key}error{RANK}", error)
        store.append(f"{key}failed", f"{RANK} ")
    if store.add(f"{key}arrived", 1) == WORLD_SIZE:  # the last rank to arrive opens the gate
        store.set(f"{key}done", "1")
    store.wait([f"{key}done"])  # at most the store's timeout (--timeout)
    if not store.check([f"{key}failed"]):
        return result
    failed = sorted(int(r) for r in store.get(f"{key}failed").decode().split())
    messages = {r: store.get(f"{key}error{r}").decode(errors="replace") for r in failed[:64]}
    fail(failure_summary(what, failed, messages))


def failure_summary(what, failed, messages):
    """One line: the ``failed`` ranks, then ``messages`` ({rank: text}) grouped by text (4 shown)."""
    by_message = {}
    for rank, message in sorted(messages.items()):
        by_message.setdefault(message, []).append(rank)
    parts = [f"{rank_text(ranks, hosts=False)}: {message}" for message, ranks in list(by_message.items())[:4]]
    more = "; and other messages" if len(by_message) > 4 or len(messages) < len(failed) else ""
    return (f"{what} failed on {rank_text(failed)} of {WORLD_SIZE}, so every rank stops: "
            + "; ".join(parts) + more)


def rank_text(ranks, hosts=True):
    """``rank 3`` / ``ranks 0-3, 6 (on host-a, host-b)``: sorted ranks as ranges, with hosts."""
    spans, start = [], ranks[0]
    for prev, cur in zip(ranks, ranks[1:] + [None]):
        if cur != prev + 1:
            spans.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    hosts = sorted({HOSTS[r] for r in ranks}) if hosts and len(HOSTS) == WORLD_SIZE else []
    on = f" (on {', '.join(hosts[:4])}{', ...' if len(hosts) > 4 else ''})" if hosts else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(spans)}{on}"


TOPOLOGY_TEXT = f"{TOPOLOGY[0]}x{TOPOLOGY[1]}" if TOPOLOGY else f"1x{MESH_SIZE}"


def print_launch(text):
    """``--print-launch [NODESxDEVICES]``: the environment to set and one torchrun line per node."""
    nodes, per_node = parse_topology(text or TOPOLOGY_TEXT)
    program_args = RUN_HINT.split(" program.py", 1)[1]
    lines = [f"# mesh {MESH_TEXT} on {nodes} node(s) x {per_node} devices, profile {PROFILE} "
             f"({DIST_BACKEND}); rank r runs on node r // {per_node}",
             "# on every node, before torchrun (see docs/deploy.md):",
             *(line.format(devices=",".join(map(str, range(per_node))), timeout=f"{TIMEOUT_S:g}")
               for line in LAUNCH_ENV)]
    if nodes == 1:
        lines.append(f"torchrun --standalone --nproc-per-node {per_node} program.py{program_args}")
    for node in range(nodes if nodes > 1 else 0):
        lines += [f"# node {node}: ranks {node * per_node}-{(node + 1) * per_node - 1}",
                  f"torchrun --nnodes {nodes} --node-rank {node} --nproc-per-node {per_node} "
                  f"--master-addr NODE0_ADDR --master-port 29500 program.py{program_args}"]
    print("\n".join(lines), flush=True)


def parse_topology(text):
    """``NODESxDEVICES`` -> (nodes, devices per node); exits 2 unless it holds MESH_SIZE ranks
    with every HOST_AXES group inside one node."""
    try:
        nodes, per_node = (int(v) for v in text.lower().split("x"))
    except ValueError:
        fail(f"--print-launch {text}: give NODESxDEVICES, such as 2x8")
    if nodes < 1 or per_node < 1 or nodes * per_node != MESH_SIZE:
        fail(f"--print-launch {text}: {nodes}x{per_node} devices, but mesh {MESH_TEXT} has "
             f"{MESH_SIZE} ranks")
    for axis in HOST_AXES:
        for ranks in GROUP_RANKS[axis]:
            if len({r // per_node for r in ranks}) > 1:
                fail(f"--print-launch {text}: the {axis} group {ranks} would span nodes; give "
                     f"each node a multiple of its ranks")
    return nodes, per_node


def load(args):
    """This rank's params and inputs (``--output``'s directory checked first); under agree()."""
    check_output(args.output)
    params = load_checkpoint(args.checkpoint) if PARAMS else {}
    inputs = load_inputs(read_inputs(args.input)) if INPUTS else {}
    return params, inputs


def run(args):
    """Everything between init_process_group and destroy_process_group."""
    make_groups()
    params, inputs = agree(lambda: load(args), "loading")
    step = compiled_step(forward, args)
    with torch.inference_mode():
        outputs = step(params, inputs)
        if args.bench > 0:
            bench(step, params, inputs, args.bench)
    if args.output:
        agree(lambda: write_outputs(outputs, args.output), "writing the outputs")


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
    """Check the world, pick the device, start torch.distributed, check the placement, run,
    always shut it down (``--print-launch``: print the launch lines instead)."""
    global DEVICE
    if launch_request(argv) is not None:  # before parse_args: it needs no --checkpoint
        return print_launch(launch_request(argv))
    args = parse_args(argv)
    check_world()
    keep_freed_memory()
    if args.device == "cpu":
        backend, DEVICE = "gloo", torch.device("cpu")
    else:
        import_prelude()
        backend, DEVICE = DIST_BACKEND, profile_device()
    init_dist(backend, args)  # then every failure is agreed on: no rank waits for one that left
    try:
        check_placement(args.placement)
        run(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
