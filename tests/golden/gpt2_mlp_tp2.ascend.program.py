"""program.py: one rank's forward pass, emitted by parcomp 0.1.0 (torch backend). Do not edit.

model: models.py:gpt2_mlp
spec:  gpt2_mlp_tp2.pcs
mesh:  tp=2 (2 ranks; row-major, the last axis varies fastest)
collectives per forward step: 1, 2048 bytes/rank in all: all_reduce over tp

Below: this model's constants, parameter loading and step (forward); then, after the runtime line, the runtime.

Run one process per rank:
    torchrun --nproc-per-node 2 program.py --checkpoint model.pt --input x.pt --output out.pt [--device cpu]

--checkpoint  .safetensors, torch state_dict (.pt), or transformers' sharded layout (a directory
              or model.safetensors.index.json) with the full (unsharded) parameters; each rank
              reads only its own slices (docs/deploy.md, "Loading checkpoints")
--key-map     PARAM_PREFIX=KEY_PREFIX,...: checkpoint keys that differ from the param names
--load-report FILE: each rank writes its load (bytes read, peak memory) to FILE.rank{r}.json
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
import shlex
import signal
import socket
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist


MESH = {"tp": 2}  # mesh axes in order; ranks are row-major
GROUP_RANKS = {"tp": [[0, 1]]}  # each axis's rank groups, in coordinate order
PARAMS = ("c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias")
INPUTS = ("x",)
# inputs that index a table: {name: [size, ignore_index or None, what]}; values outside
# 0..size-1 are refused at load (take, SampleSlice.read) as torch would raise
INDEX_BOUNDS = {}
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
    act = torch.nn.functional.gelu(c_fc, approximate="tanh")  # [S(2)] f32[2,8,64]
    del c_fc
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


# ======== runtime (parcomp_backends/torch/runtime): profile, collectives, loading, main ========


# ---- PROFILE ascend: the only lines that differ between device profiles ----
PROFILE = "ascend"
DIST_BACKEND = "hccl"
PRELUDE = ("torch_npu",)  # imported first; skipped under --device cpu
BIND_DEVICE_ID = False  # init_process_group(device_id=DEVICE)
LAUNCH_ENV = (  # --print-launch: set on every node before torchrun
    "source /usr/local/Ascend/ascend-toolkit/set_env.sh  # the CANN environment",
    "export HCCL_IF_IP=THIS_NODE_IP  # or HCCL_SOCKET_IFNAME=eth0: the host interface",
    "export HCCL_CONNECT_TIMEOUT=600  # seconds to build links (default 120)",
    "export HCCL_EXEC_TIMEOUT={timeout}  # seconds a collective may wait (default 1836)",
    "export HCCL_BUFFSIZE=200  # MB per communicator buffer (default 200)",
    "# export HCCL_DETERMINISTIC=true  # reproducible reductions, slower",
    "export ASCEND_RT_VISIBLE_DEVICES={devices}  # the NPUs of this node",
    "export HCCL_ASYNC_ERROR_HANDLING=1  # torch_npu: a failed or timed-out collective aborts the process",
    "export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True  # torch_npu: less fragmentation",
    "# export HCCL_RDMA_TC=132 HCCL_RDMA_SL=4  # RoCE: the traffic class and service level of the lossless queue",
)


def profile_device():
    """Bind this process to its device under profile ascend and return it."""
    if not (torch.npu.device_count() > LOCAL_RANK):
        fail(f"profile ascend: torch_npu sees {torch.npu.device_count()} NPUs, LOCAL_RANK {LOCAL_RANK} needs {LOCAL_RANK + 1}; check ASCEND_RT_VISIBLE_DEVICES and the CANN environment (source set_env.sh), or rerun with --device cpu (CPU/gloo, no NPU)")
    torch.npu.set_device(LOCAL_RANK)
    if not ("bfloat16" not in COLLECTIVE_DTYPES or not torch.npu.get_device_name().startswith(('Ascend910A', 'Ascend910Pro', 'Ascend910Premium', 'Ascend310'))):
        fail(f"profile ascend: this program's collectives carry bfloat16, which HCCL supports on Atlas A2 (Ascend910B) and newer, not on {torch.npu.get_device_name()}; compile the model in float32 or float16, or rerun with --device cpu")
    return torch.device(f"npu:{LOCAL_RANK}")
# ---- end of PROFILE ----


RANK = int(os.environ.get("RANK", "0"))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "0"))
MESH_SIZE = math.prod(MESH.values())
MESH_TEXT = " ".join(f"{axis}={size}" for axis, size in MESH.items())
AXIS = {axis: i for i, axis in enumerate(MESH)}
DEVICE = torch.device("cpu")  # set by main()
GROUPS = {}  # mesh axis -> this rank's process group, set by make_groups()
LINE_GROUPS = {"timeout": None}  # the groups line_group() made (and their timeout)
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


def make_groups(timeout):
    """The process group of each axis the program communicates over (COMM_AXES), each made by
    one call per rank (:func:`line_group`), waiting at most ``timeout`` seconds per collective."""
    LINE_GROUPS["timeout"] = datetime.timedelta(seconds=timeout)
    for axis in COMM_AXES:
        GROUPS[axis] = line_group(GROUP_RANKS[axis])


def line_group(lines):
    """This rank's process group among ``lines`` (the same rank lists on every rank), or None
    when no line holds this rank. One line of every rank: WORLD, no second communicator.
    Otherwise one call makes it, with make_groups' timeout: ``split_group`` of WORLD, one
    communicator split for all the lines, where WORLD is bound to an NCCL device (every rank
    calls it); else ``new_group`` of this rank's line alone, synchronised only among its ranks
    (gloo, HCCL), so no rank takes part in the other lines' creation. A line made before
    (another axis with the same ranks) is reused."""
    mine = next((tuple(r) for r in lines if RANK in r), None)
    if mine is not None and len(mine) == WORLD_SIZE:
        return dist.group.WORLD
    split = getattr(dist.group.WORLD, "bound_device_id", None) is not None and dist.get_backend() == "nccl"
    key = tuple(map(tuple, lines)) if split else mine
    if key not in LINE_GROUPS:
        if split:
            LINE_GROUPS[key] = dist.split_group(split_ranks=[list(r) for r in lines],
                                                timeout=LINE_GROUPS["timeout"])
        elif mine is not None:
            LINE_GROUPS[key] = dist.new_group(list(mine), timeout=LINE_GROUPS["timeout"],
                                              use_local_synchronization=True)
    return LINE_GROUPS.get(key)


def device_mesh(axes):
    """A DeviceMesh of the mesh axes ``axes`` (in mesh order: all of MESH, or the axes inside a
    pipeline stage) through this rank, on the groups of :func:`line_group`: DTensor's and
    torch.distributed.checkpoint's view of the mesh, with no process group of its own."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(MESH_SIZE).reshape(tuple(MESH.values()))
    ranks = ranks[tuple(slice(None) if axis in axes else COORD[AXIS[axis]] for axis in MESH)]
    return DeviceMesh.from_group([line_group(GROUP_RANKS[axis]) for axis in axes], DEVICE.type,
                                 mesh=ranks, mesh_dim_names=tuple(axes))


# ---- layout changes; semantics: parcomp/reference/interpreter.py (_LAYOUT_OPS) ----
def collective(new, old):
    """The torch.distributed function to call, looked up when called (after the PRELUDE
    imports): a replacement of ``old`` that a device module installed (torch_npu, torchair)
    wins; else ``new`` where this torch has it, else ``old``."""
    replaced = getattr(dist, old, None)
    if replaced is not None and getattr(replaced, "__module__", "").startswith("torch.distributed"):
        return getattr(dist, new, None) or replaced
    return replaced or getattr(dist, new)


def group_size(axis):
    """Ranks in one group of ``axis``: a mesh axis, or a joint group such as ``"dp,tp"``."""
    size = 1
    for a in axis.split(","):  # a loop, not math.prod of a generator: torch.compile traces it
        size *= MESH[a]
    return size


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
    """Start an in-place all_reduce of a fresh contiguous value nothing else reads. Under
    torch.compile (``--compile``) the functional all_reduce instead: the compiler cannot trace
    ``async_op=True`` (a graph break), and places the wait where :func:`wait` is."""
    if torch.compiler.is_compiling():
        return dist._functional_collectives.all_reduce(x, "sum", GROUPS[axis])
    return x, dist.all_reduce(x, op=dist.ReduceOp.SUM, group=GROUPS[axis], async_op=True)


def wait(handle):
    """The value of a started collective, once it has arrived (a gather along a dim other
    than 0 interleaves its shards then: one copy)."""
    if torch.compiler.is_compiling() and isinstance(handle, torch.Tensor):
        return dist._functional_collectives.wait_tensor(handle)  # a functional collective's tensor
    x, work = handle[:2]
    work.wait()
    return handle[2](x) if len(handle) > 2 else x


def all_gather(x, dim, axis):
    """S(dim) -> R: concatenate the group's shards along ``dim``, in coordinate order. The
    shards arrive stacked ``[n, *shard]``; along a dim other than 0 one copy interleaves them
    (the shard is sent as it is, not moved to dim 0 first)."""
    n = group_size(axis)
    x = x.contiguous()
    out = x.new_empty((n * x.shape[0],) + tuple(x.shape[1:]))  # the shards one after another
    collective("all_gather_single", "all_gather_into_tensor")(out, x, group=GROUPS[axis])
    if dim == 0:
        return out
    return out.view((n,) + tuple(x.shape)).movedim(0, dim).flatten(dim, dim + 1)


def all_gather_start(x, dim, axis):
    """Start all_gather(x, dim, axis) without waiting; ``wait(handle)`` returns the gathered value
    (under torch.compile the functional all_gather, as :func:`all_reduce_start_`)."""
    if torch.compiler.is_compiling():
        return dist._functional_collectives.all_gather_tensor(x.contiguous(), dim, GROUPS[axis])
    n = group_size(axis)
    x = x.contiguous()
    out = x.new_empty((n * x.shape[0],) + tuple(x.shape[1:]))
    work = collective("all_gather_single", "all_gather_into_tensor")(out, x, group=GROUPS[axis], async_op=True)
    if dim == 0:
        return out, work
    shape = tuple(x.shape)
    return out, work, lambda o: o.view((n,) + shape).movedim(0, dim).flatten(dim, dim + 1)


def reduce_scatter_start(x, dim, axis):
    """Start reduce_scatter(x, dim, axis) without waiting; ``wait(handle)`` returns this rank's chunk
    (under torch.compile the functional reduce_scatter, as :func:`all_reduce_start_`)."""
    if torch.compiler.is_compiling():
        return dist._functional_collectives.reduce_scatter_tensor(x.contiguous(), "sum", dim, GROUPS[axis])
    n = group_size(axis)
    x0 = x.contiguous() if dim == 0 else x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous()
    out = x.new_empty(tuple(x.shape[:dim]) + (x.shape[dim] // n,) + tuple(x.shape[dim + 1:]))
    x0 = x0.view((n * out.shape[0],) + tuple(out.shape[1:]))
    return out, collective("reduce_scatter_single", "reduce_scatter_tensor")(
        out, x0, op=dist.ReduceOp.SUM, group=GROUPS[axis], async_op=True)


def reduce_scatter(x, dim, axis):
    """P -> S(dim): sum over the group, keep this rank's chunk of ``dim``. Along a dim other
    than 0 one copy puts chunk j first for coordinate j (``[n, *chunk]``); the result needs none."""
    n = group_size(axis)
    x0 = x.contiguous() if dim == 0 else x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous()
    out = x.new_empty(tuple(x.shape[:dim]) + (x.shape[dim] // n,) + tuple(x.shape[dim + 1:]))
    x0 = x0.view((n * out.shape[0],) + tuple(out.shape[1:]))  # the chunks one after another
    collective("reduce_scatter_single", "reduce_scatter_tensor")(out, x0, op=dist.ReduceOp.SUM, group=GROUPS[axis])
    return out


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
    if isinstance(tensors, Checkpoint):  # this rank's bytes only, read by place()
        return tensors.take(name, shape, dtype)
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
    if what == "input":
        check_index_range(name, t, FILES.get("input", "the input file"))
    return t


def check_index_range(name, t, source):
    """Exit 2 where input ``name`` indexes a table (INDEX_BOUNDS: token ids of an embedding,
    cross-entropy labels) and a value of ``t`` (a host tensor) lies outside it: torch raises
    there, a vocab-split lookup would give zero rows. One min/max on the host, no device sync."""
    bound = INDEX_BOUNDS.get(name)
    if bound is None or t.numel() == 0:
        return
    size, ignore, what = bound
    kept = t if ignore is None else t[t != ignore]
    if kept.numel() == 0:
        return
    low, high = int(kept.min()), int(kept.max())
    if low < 0 or high >= size:
        bad = low if low < 0 else high
        allowed = f"0..{size - 1}" + (f" or {ignore} (ignore_index)" if ignore is not None else "")
        fail(f"input {name!r} in {source} holds {bad}, outside the {what} of size {size} "
             f"(allowed: {allowed})")


def whole(t):
    """``t`` as a tensor: a checkpoint Slice is read (a padded vocab table is read whole)."""
    return t.read() if isinstance(t, Slice) else t


def place(t):
    """A compact copy of ``t`` on DEVICE (so the full tensor it was cut from can be freed);
    a checkpoint Slice is read here. While CHECK_ONLY["on"] (inputs checked before the run,
    placed at their step): ``t`` itself, nothing copied."""
    if isinstance(t, Slice):
        return t.read().to(DEVICE)
    if CHECK_ONLY["on"]:
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=DEVICE).copy_(t)


CHECK_ONLY = {"on": False}


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


def load_checkpoint(path, key_map=(), report=None):
    """This rank's slices of the params in the checkpoint at ``path`` (a file, a directory or
    an index.json; keys through ``key_map``), unused keys noted; with ``report``, this rank's
    load report goes to rank_path(report, RANK). Raises LoadError naming the file."""
    start, rss = time.perf_counter(), current_rss()
    ckpt = open_checkpoint(path, key_map, read_tensors)
    FILES["checkpoint"] = path
    note_unused(dict.fromkeys(ckpt.entries), {ckpt.key(n) for n in PARAMS}, "checkpoint")
    params = load_params(ckpt)
    if report:
        with open(rank_path(report, RANK), "w", encoding="utf-8") as f:
            json.dump(load_report(ckpt, time.perf_counter() - start, rss), f)
    return params


def fail_load(error):
    """Exit 2 with a LoadError's message. Every rank finds a broken checkpoint at the same
    point, so each exits 2 on its own: torchrun's SIGTERM to the others once the first has
    exited is ignored from here on, so it cannot turn their exit 2 into -15."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fail(str(error))


class LoadError(Exception):
    """A checkpoint that cannot be loaded; the message names the file (main() exits 2 with it)."""


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                      "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                      "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
                      **{k: getattr(torch, v) for k, v in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
                                                           ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"))
                         if hasattr(torch, v)}}
INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
SINGLE_NAMES = ("model.safetensors", "pytorch_model.bin")
SMALL_RUN = 4096  # bytes: shorter runs are read as whole dim-0 rows, BLOCK bytes at a time
BLOCK = 64 << 20
MAX_HEADER = 100 << 20  # bytes: a larger safetensors header is a corrupt file


def parse_key_map(text):
    """``--key-map``: comma-separated ``PARAM_PREFIX=KEY_PREFIX`` rules, or a .json file
    ``{param prefix: key prefix}``. A parameter is read from the key its longest matching
    prefix maps to (``=transformer.`` prefixes every name). Raises ValueError."""
    if not text:
        return ()
    if text.endswith(".json"):
        try:
            with open(text, encoding="utf-8") as f:
                rules = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read key map file {text}: {e}") from None
        if not isinstance(rules, dict) or not all(isinstance(v, str) for v in rules.values()):
            raise ValueError(f"key map file {text} must hold one JSON object {{param prefix: key prefix}}")
        pairs = list(rules.items())
    else:
        pairs = [rule.split("=", 1) for rule in text.split(",") if rule.strip()]
        bad = [p[0] for p in pairs if len(p) != 2]
        if bad:
            raise ValueError(f"key map rule {bad[0]!r} has no '=': write PARAM_PREFIX=KEY_PREFIX")
    return tuple(sorted(((a.strip(), b.strip()) for a, b in pairs), key=lambda r: -len(r[0])))


KEY_MAP_HELP = ("PARAM_PREFIX=KEY_PREFIX,... (or a .json file of them): read each param from the "
                "checkpoint key its longest matching prefix maps to, e.g. =transformer.")
LOAD_REPORT_HELP = "each rank writes its load (files, bytes read, peak memory) to FILE.rank{r}.json"


def key_map_arg(text):
    """argparse type of ``--key-map``: :func:`parse_key_map`, errors as argparse errors."""
    try:
        return parse_key_map(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def checkpoint_key(name, key_map):
    """The checkpoint key of parameter ``name`` under ``key_map`` (:func:`parse_key_map`)."""
    for prefix, replacement in key_map:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return name


def resolve_layout(path):
    """``(index file or None, {key: shard path} or None, single file or None)`` for a
    checkpoint path: a file, a ``*.index.json``, or a directory holding either."""
    if os.path.isdir(path):
        for name in INDEX_NAMES + SINGLE_NAMES:
            if os.path.isfile(os.path.join(path, name)):
                return resolve_layout(os.path.join(path, name))
        found = sorted(n for n in os.listdir(path) if n.endswith((".safetensors", ".index.json")))
        raise LoadError(f"checkpoint directory {path} holds no {' / '.join(INDEX_NAMES + SINGLE_NAMES)}"
                        f" (it has: {', '.join(found[:10]) or 'no checkpoint files'})")
    if not os.path.isfile(path):
        raise LoadError(f"checkpoint file {path} does not exist")
    if not path.endswith(".index.json"):
        return None, None, path
    try:
        with open(path, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
    except (OSError, ValueError, AttributeError) as e:
        raise LoadError(f"cannot read checkpoint index {path}: {type(e).__name__}: {e}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise LoadError(f"checkpoint index {path} has no \"weight_map\": {{key: shard file name}}")
    base = os.path.dirname(os.path.abspath(path))
    return path, {k: os.path.join(base, v) for k, v in weight_map.items()}, None


def read_safetensors_header(path):
    """``{key: (dtype, shape, first byte, end byte)}`` of a .safetensors file (offsets from
    the start of the file), checked against the file's size: a truncated file is a LoadError."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n <= min(MAX_HEADER, size - 8):
                raise ValueError(f"header length {n} does not fit a file of {size} bytes")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        out = {}
        for key, info in header.items():
            begin, end = (8 + n + int(o) for o in info["data_offsets"])
            dtype = SAFETENSORS_DTYPES.get(info["dtype"], info["dtype"])  # unknown: an error if taken
            out[key] = (dtype, tuple(int(s) for s in info["shape"]), begin, end)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise LoadError(f"cannot read safetensors file {path}: {type(e).__name__}: {e}") from None
    need = max((end for _, _, _, end in out.values()), default=8 + n)
    if size < need:
        raise LoadError(f"safetensors file {path} is truncated: its header needs {need} bytes but "
                        f"the file holds {size}; copy or download it again")
    return out


def read_torch_file(path):
    """``({key: tensor}, mapped)`` of a torch file: memory-mapped (nothing read yet) for the
    zip format, read whole for the legacy pickle format (``mapped`` False)."""
    try:
        with open(path, "rb") as f:
            legacy = f.read(1) == b"\x80"  # a pickle, not a zip archive
        return torch.load(path, map_location="cpu", weights_only=True, mmap=not legacy), not legacy
    except Exception as e:  # noqa: BLE001 - any reader error becomes one clear message
        raise LoadError(f"cannot read torch checkpoint {path} (a truncated or non-zip file?): "
                        f"{type(e).__name__}: {e}") from None


class Checkpoint:
    """The tensors of a checkpoint, by key, with nothing read yet; checks every file at once.

    ``entries[key]``: ``(file, dtype, shape, first byte, end byte)`` for safetensors, or
    ``(file, tensor, mapped)`` for a torch file (``mapped``: its pages may be released)
    or a file read whole by ``fallback``. ``stats`` counts what was read.
    """

    def __init__(self, path, key_map=(), fallback=None):
        self.path, self.key_map, self.entries = path, tuple(key_map), {}
        self.stats = {"checkpoint": path, "files": [], "bytes_read": 0, "bytes_kept": 0, "params": 0}
        index, weight_map, single = resolve_layout(path)
        self.where = f"checkpoint index {index}" if index else f"checkpoint file {single}"
        files = sorted(set(weight_map.values())) if index else [single]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            keys = sorted(k for k, v in weight_map.items() if v == missing[0])
            raise LoadError(f"shard file {missing[0]} does not exist, but {self.where} names it for "
                            f"{len(keys)} key(s) ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"
                            + (f"; {len(missing) - 1} more shard file(s) missing" if len(missing) > 1 else ""))
        for file in files:
            self._add_file(file, fallback, weight_map)
        self.stats["files"] = files

    def _add_file(self, file, fallback, weight_map):
        entries = file_entries(file, fallback)
        if weight_map is not None:
            listed = {k for k, v in weight_map.items() if v == file}
            absent = sorted(listed - set(entries))
            if absent:
                raise LoadError(f"{self.where} puts key {absent[0]!r} in shard file {file}, which "
                                f"does not hold it" + _nearest(absent[0], entries))
            entries = {k: v for k, v in entries.items() if k in listed}
        self.entries.update(entries)

    def key(self, name):
        """The checkpoint key parameter ``name`` is read from."""
        return checkpoint_key(name, self.key_map)

    def __contains__(self, name):
        return self.key(name) in self.entries

    def take(self, name, shape, dtype):
        """A :class:`Slice` of the whole of parameter ``name`` (nothing read), checked
        against the full shape and dtype the program was compiled for (never cast)."""
        key = self.key(name)
        if key not in self.entries:
            mapped = f" (checkpoint key {key!r})" if key != name else ""
            raise LoadError(f"param {name!r}{mapped}, full shape {list(shape)}, is not in "
                            f"{self.where}" + _nearest(key, self.entries))
        entry = self.entries[key]
        got_dtype, got_shape = (entry[1], entry[2]) if len(entry) == 5 else (entry[1].dtype, tuple(entry[1].shape))
        if tuple(got_shape) != tuple(shape):
            raise LoadError(f"param {name!r} has shape {list(got_shape)}, expected the full (unsharded) "
                            f"shape {list(shape)} (key {key!r} in {entry[0]})")
        if got_dtype != dtype:
            raise LoadError(f"param {name!r} in {entry[0]} has dtype {got_dtype}, but the program was "
                            f"compiled for {dtype}; nothing is cast: save it as {dtype} "
                            f"(tensor.to({dtype})) or compile a model whose param is {got_dtype}")
        return Slice(self, entry, [(0, s) for s in shape])


def file_entries(file, fallback):
    """``{key: entry}`` of one checkpoint file (see :class:`Checkpoint`), nothing read but
    headers: .safetensors parsed here, .onnx read whole by ``fallback``, else a torch file."""
    if file.endswith(".safetensors"):
        return {k: (file,) + v for k, v in read_safetensors_header(file).items()}
    if file.endswith(".onnx") and fallback is not None:
        tensors, mapped = fallback(file, "checkpoint"), False
    else:
        tensors, mapped = read_torch_file(file)
    if not isinstance(tensors, dict):
        raise LoadError(f"checkpoint file {file} holds a {type(tensors).__name__}, not a dict {{name: tensor}}")
    return {k: (file, t, mapped) for k, t in tensors.items() if isinstance(t, torch.Tensor)}


def _nearest(key, keys):
    """'; nearest keys: ...' (up to 5 close names), or the first few keys when none is close."""
    import difflib

    close = difflib.get_close_matches(key, list(keys), n=5, cutoff=0.5)
    if close:
        return "; nearest keys: " + ", ".join(close) + " (map names with --key-map PARAM_PREFIX=KEY_PREFIX)"
    return "; it has: " + (", ".join(sorted(keys)[:10]) or "nothing")


class Slice:
    """A block of one checkpoint tensor, not read yet: ``ranges[d] = (start, length)``."""

    def __init__(self, ckpt, entry, ranges):
        self.ckpt, self.entry, self.ranges = ckpt, entry, ranges

    def narrow(self, dim, start, length):
        """The same block narrowed like ``torch.Tensor.narrow`` (still nothing read)."""
        ranges = list(self.ranges)
        ranges[dim] = (ranges[dim][0] + start, length)
        return Slice(self.ckpt, self.entry, ranges)

    def reshape(self, shape):
        """The whole tensor, read, reshaped (a fused weight viewed per part is read whole)."""
        return self.read().reshape(shape)

    def read(self):
        """This block as a compact CPU tensor; adds to the checkpoint's ``stats``."""
        stats = self.ckpt.stats
        if len(self.entry) == 3:
            out = torch_slice(self.entry[1], self.ranges)
            stats["bytes_read"] += out.numel() * out.element_size()
            if self.entry[2]:
                release_pages(self.entry[1])
        else:
            out = read_safetensors_block(self.entry, self.ranges, stats)
        stats["bytes_kept"] += out.numel() * out.element_size()
        stats["params"] += 1
        return out


def torch_slice(tensor, ranges):
    """A compact copy of ``tensor``'s block ``ranges``."""
    view = tensor
    for d, (start, length) in enumerate(ranges):
        view = view.narrow(d, start, length)
    return torch.empty(view.shape, dtype=view.dtype).copy_(view)


def release_pages(tensor):
    """Give back the pages of ``tensor``'s storage, a private map of a torch file that
    copying touched (Linux ``madvise(MADV_DONTNEED)``: they are read from the file again
    if touched again; never for anonymous memory, whose data it would drop)."""
    try:
        import ctypes
        import mmap

        storage = tensor.untyped_storage()
        page = mmap.PAGESIZE
        start = -(-storage.data_ptr() // page) * page
        end = (storage.data_ptr() + storage.nbytes()) // page * page
        if end > start:
            ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)
    except (OSError, AttributeError, ImportError):
        pass


def read_safetensors_block(entry, ranges, stats):
    """Block ``ranges`` of a safetensors tensor, reading only its byte runs (C order: the
    runs land one after another in the result). Runs under SMALL_RUN bytes: whole dim-0
    rows are read, BLOCK bytes at a time, and cut here."""
    import itertools

    file, dtype, shape, begin, _ = entry
    elem = torch.empty((), dtype=dtype).element_size()
    lengths = [n for _, n in ranges]
    narrowed = [d for d, (s, n) in enumerate(ranges) if (s, n) != (0, shape[d])]
    last = narrowed[-1] if narrowed else 0
    inner = math.prod(shape[last + 1:]) * elem
    run = lengths[last] * inner if shape else elem
    out = torch.empty(math.prod(lengths) * elem, dtype=torch.uint8)
    with open(file, "rb", buffering=0) as f:
        if run >= SMALL_RUN or len(narrowed) <= 1 and last == 0:
            strides = [math.prod(shape[d + 1:]) * elem for d in range(len(shape))]
            view = memoryview(out.numpy())
            first = begin + (ranges[last][0] * inner if shape else 0)
            for i, index in enumerate(itertools.product(*(range(s, s + n) for s, n in ranges[:last]))):
                offset = first + sum(j * stride for j, stride in zip(index, strides))
                _read_into(f, offset, view[i * run:(i + 1) * run], file)
            stats["bytes_read"] += out.numel()
        else:
            _read_rows(f, entry, ranges, out.view(dtype).reshape(lengths), elem, stats)
    return out.view(dtype).reshape(lengths)


def _read_rows(f, entry, ranges, out, elem, stats):
    """Read whole dim-0 rows of the block, BLOCK bytes at a time; cut the other dims here."""
    file, dtype, shape, begin, _ = entry
    row = math.prod(shape[1:]) * elem
    step = max(1, BLOCK // max(row, 1))
    start, length = ranges[0]
    for i in range(0, length, step):
        n = min(step, length - i)
        buf = torch.empty(n * row, dtype=torch.uint8)
        _read_into(f, begin + (start + i) * row, memoryview(buf.numpy()), file)
        stats["bytes_read"] += buf.numel()
        rows = buf.view(dtype).reshape((n,) + tuple(shape[1:]))
        for d, (s, k) in enumerate(ranges[1:], start=1):
            rows = rows.narrow(d, s, k)
        out[i:i + n].copy_(rows)


def _read_into(f, offset, view, file):
    """Fill ``view`` from byte ``offset`` of the open file ``f``; a short file is a LoadError."""
    f.seek(offset)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise LoadError(f"checkpoint file {file} ended early at byte {offset + done} (truncated?)")
        done += n


def open_checkpoint(path, key_map=(), fallback=None):
    """The :class:`Checkpoint` at ``path`` (a file, a ``*.index.json`` or a directory),
    every file it names checked; ``fallback(path, "checkpoint")`` reads other formats
    whole. Raises LoadError naming the file."""
    return Checkpoint(path, key_map, fallback)


def load_report(ckpt, seconds, rss_before):
    """This rank's load, for ``--load-report``: files, bytes read and kept, peak memory."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024  # ru_maxrss: KiB on Linux, bytes on macOS
    return {"rank": RANK, **ckpt.stats, "seconds": round(seconds, 4),
            "rss_before_bytes": rss_before, "peak_rss_bytes": peak}


def current_rss():
    """This process's resident bytes now (Linux /proc; 0 where unknown)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


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
    ap.add_argument("--checkpoint", required=bool(PARAMS),
                    help=".safetensors, .pt state_dict, or a sharded checkpoint (directory or index.json)")
    ap.add_argument("--key-map", type=key_map_arg, default=(), metavar="RULES", help=KEY_MAP_HELP)
    ap.add_argument("--load-report", metavar="FILE", help=LOAD_REPORT_HELP)
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
    ap.add_argument("--timeout", type=timeout_arg, default=TIMEOUT_S, metavar="S",
                    help=f"seconds a collective may wait for the other ranks (default {TIMEOUT_S:g})")
    ap.add_argument("--placement", choices=("refuse", "warn"), default=PLACEMENT,
                    help=f"a {'/'.join(HOST_AXES) or 'tp'} group on several hosts: stop, or only warn "
                         f"(default {PLACEMENT})")
    ap.add_argument("--compile", action="store_true",
                    help="run the step under torch.compile (capture, fuse and reorder it)")
    ap.add_argument("--tf32", action="store_true",
                    help="CUDA: float32 matmuls and convolutions in TF32 (10-bit mantissa, faster on "
                         "Ampere and newer); off by default, the float32 rounding parcomp run checks")
    ap.add_argument("--print-launch", nargs="?", const="", metavar="NODESxDEVICES",
                    help="print the environment and the torchrun line of every node (with the options "
                         "given with it, else the run hint's), then exit "
                         f"(default topology: {TOPOLOGY_TEXT})")


FAULT_WAIT_S = 10  # after a collective failed here, how long to wait for the other ranks' reports
FAULT_POLL_S = 5  # how often each rank looks for another rank's report in the launcher's store
FAULT_KEY = "parcomp/fault/"  # the reports' keys in the launcher's store
FAULT = {"store": None, "timeout": None, "where": "starting", "lock": threading.Lock(), "agreeing": False}


def watch_faults(timeout):
    """Make a failure during the run end with one line on every rank naming the ranks that
    failed or stopped answering (:func:`report_fault`). Three paths lead there: main's handler
    of an exception (a collective that timed out after ``timeout`` seconds or lost a peer, or
    this rank's own error), the launcher's SIGTERM (torchrun stops every rank once one has
    exited), and another rank's report found in the launcher's store (every FAULT_POLL_S
    seconds: a rank that failed on its own, such as on a bad --data sample, ends the others
    within seconds even where their collective would wait for it until ``timeout``: NCCL, or a
    rank whose exit hangs). The last two run on a thread: the main thread may be blocked in a
    collective."""
    FAULT.update(store=dist.distributed_c10d._get_default_store(), timeout=timeout)
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.signal(signal.SIGTERM, lambda *_: ask_stop())  # the main thread, when it is free
    signal.set_wakeup_fd(write)  # the signal's number is written here, whatever the main thread does

    def watch():
        import select

        while True:
            if not select.select([read], [], [], FAULT_POLL_S)[0]:
                if peer_reported():
                    report_fault("stopped, since another rank's failure ended the run")
                continue
            if signal.SIGTERM in os.read(read, 64):
                if not ask_stop() or peer_failed():
                    report_fault("stopped by the launcher (SIGTERM)")
                late = threading.Timer(timeout + FAULT_WAIT_S, report_fault,  # every wait is bounded
                                       ["stopped by SIGTERM; the step and its checkpoint did not end in time"])
                late.daemon = True
                late.start()

    threading.Thread(target=watch, name="faults", daemon=True).start()


# SIGTERM (what SLURM and Kubernetes send before they kill a job) while a training loop that
# saves runs: every rank ends the step, saves it and exits (program_train's stop_after)
STOP = {"armed": False, "asked": False, "flag": None}


def ask_stop():
    """Note this rank's SIGTERM for the training loop; whether one runs that can act on it
    (``STOP["armed"]``: training with --save), else the fault path stops this rank."""
    if STOP["armed"]:
        STOP["asked"] = True
    return STOP["armed"]


def peer_failed():
    """Whether another rank has posted a failure (its SIGTERM is then torchrun stopping the
    survivors, not a request to save): those go the fault path, naming it."""
    try:
        return FAULT["store"].check([f"{FAULT_KEY}ranks"])
    except Exception:  # noqa: BLE001 - the store is gone: the launcher is stopping everything
        return True


def peer_reported():
    """Whether a rank has posted its own failure (an error, not a collective that stopped: a
    hung rank must not take its peers' timeouts for a failure and so report itself present)
    while this rank runs on: not while this rank agrees with the others on a step (agree():
    every rank learns that outcome itself), nor once it has failed itself (its own path exits).
    A store that does not answer (the run has ended, the launcher is stopping everything) is no
    report."""
    if FAILED or FAULT["agreeing"]:
        return False
    try:
        return FAULT["store"].check([f"{FAULT_KEY}error"])
    except Exception:  # noqa: BLE001
        return False


def collective_error(error):
    """Whether ``error`` is a collective's failure (it timed out, or a peer closed the
    connection) rather than an error of this rank's own."""
    text = str(error)
    return isinstance(error, dist.DistError) or any(
        word in text for word in ("gloo", "NCCL", "HCCL", "Timed out", "Connection closed", "Connection reset"))


def first_line(error):
    """The first line of an error's message, without the C++ source location gloo puts first."""
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    text = text.split("] ", 1)[1] if text.startswith("[") and "] " in text else text
    return text.split(". ")[0][:300]


def report_fault(cause):
    """Post what stopped this rank (``cause``: an exception, or a text) to the launcher's
    key-value store, learn what stopped the others, print one line and exit; never returns.

    This rank's own error (not a collective's) is printed with its traceback and posted, and
    the rank exits 1 at once. A failed collective or the launcher's SIGTERM waits for the other
    ranks' reports until every rank has posted or none has for FAULT_WAIT_S seconds; the ranks
    that have not posted by then are the ones that stopped answering (hung, or gone without a
    word: killed, crashed). The first rank to decide writes that verdict and every rank uses
    it, so a hung rank that the launcher's SIGTERM wakes later is still named. Exit 2 (143:
    SIGTERM and nothing found wrong). The store's own failure leaves this rank's line alone."""
    if not FAULT["lock"].acquire(blocking=False):  # the other path is reporting: it exits
        while True:
            time.sleep(60)
    own = isinstance(cause, BaseException) and not collective_error(cause)
    text = cause if isinstance(cause, str) else f"{type(cause).__name__}: {first_line(cause)}"
    if own:
        sys.stderr.write("".join(traceback.format_exception(cause)))
    store, key, silent, others = FAULT["store"], FAULT_KEY, [], {}
    try:
        count, quiet = post_fault("error" if own else "stopped", text), time.monotonic()
        while not own and count < WORLD_SIZE and not store.check([f"{key}silent"]) \
                and time.monotonic() - quiet < FAULT_WAIT_S:
            time.sleep(0.5)  # every rank polls: at 1,000 ranks, 2,000 store calls a second
            now = store.add(f"{key}count", 0)
            count, quiet = now, quiet if now == count else time.monotonic()
        reported = {int(r) for r in store.get(f"{key}ranks").decode().split()}
        if not own:
            mine = " ".join(str(r) for r in range(WORLD_SIZE) if r not in reported) or "-"
            silent = [int(r) for r in store.compare_set(f"{key}silent", "", mine).decode().split() if r != "-"]
        others = {r: store.get(f"{key}rank{r}").decode(errors="replace")
                  for r in sorted(reported - {RANK})[:64]}
    except Exception as e:  # noqa: BLE001 - the store is gone too: say what this rank knows
        text += f"; the launcher's store failed too ({type(e).__name__}: {first_line(e)})"
    errors = {r: m[len("error "):] for r, m in others.items() if m.startswith("error ")}
    sys.stderr.write(f"program.py (rank {RANK}): error: {FAULT['where']}: "
                     f"{fault_summary(text, silent, errors)}\n")
    plain_stop = text.startswith("stopped by the launcher") and not silent and not errors
    exit_now(1 if own else 143 if plain_stop else 2)


def post_fault(kind, text):
    """Post this rank's report (``kind`` "error": its own failure, which the others name;
    "stopped": it was stopped) to the launcher's store; the number of reports so far."""
    store = FAULT["store"]
    store.set(f"{FAULT_KEY}rank{RANK}", f"{kind} {text} ({FAULT['where']})")
    store.append(f"{FAULT_KEY}ranks", f"{RANK} ")
    count = store.add(f"{FAULT_KEY}count", 1)
    if kind == "error":  # what the other ranks' watch threads look for (peer_reported)
        store.set(f"{FAULT_KEY}error", str(RANK))
    return count


def note_exit(code):
    """This rank leaves with ``code`` (2: fail() printed why): post fail()'s message as this
    rank's own error, once, so the ranks the launcher then stops name it and why instead of
    counting it as gone without a word. The store's failure is let pass (the line is printed)."""
    if code == 2 and FAILED and FAULT["store"] is not None and FAULT["lock"].acquire(blocking=False):
        try:
            post_fault("error", FAILED[-1])
        except Exception:  # noqa: BLE001 - the store is gone too
            pass


def fault_summary(text, silent, errors):
    """The line of :func:`report_fault`: the ranks that stopped answering, the other ranks'
    own errors (``{rank: message}``), then this rank's ``text``."""
    parts = []
    if silent:
        who = "this rank" if silent == [RANK] else rank_text(silent)
        parts.append(f"{who} stopped answering (hung, or gone without a word: killed or crashed); "
                     f"each collective waits at most --timeout {FAULT['timeout']:g} s")
    if errors:
        parts.append(failure_summary("the run", sorted(errors), errors))
    parts.append(f"this rank: {text}")
    return "; ".join(parts)


def timeout_arg(text):
    """``--timeout S``: seconds, finite, in (0, MAX_TIMEOUT_S], else an argparse error (exit 2)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_TIMEOUT_S:  # NaN fails too
        raise argparse.ArgumentTypeError(f"{text}: give a number of seconds above 0 and at most {MAX_TIMEOUT_S:_}")
    return seconds


MAX_TIMEOUT_S = 10_000_000  # ~116 days; datetime.timedelta and c10d's milliseconds hold it


def compiled_step(step, args):
    """``step`` under torch.compile with ``--compile`` (fullgraph on a functional program), else ``step``.
    The started collectives trace as ``torch.distributed._functional_collectives`` (imported here,
    so the compiler finds it as ``dist._functional_collectives``): a tensor-parallel step is one graph."""
    if not args.compile:
        return step
    importlib.import_module("torch.distributed._functional_collectives")
    compile_settings()
    return torch.compile(step, fullgraph="funcol" in globals())


def compile_settings():
    """The torch.compile settings this program needs: a dropless MoE layer reads its expert
    counts to the host once (``moe_route_plan``), and those ints are captured in the graph
    (unbacked sizes) instead of ending it."""
    if "moe_route_plan" in globals():
        torch._dynamo.config.capture_scalar_outputs = True


def set_tf32(on):
    """``--tf32``: TF32 float32 matmuls and convolutions (CUDA), which the cuda profile turns off
    by default; rank 0 says so, since float32 results then differ from the checked rounding."""
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    if on and RANK == 0:
        print("note: --tf32: float32 matmuls and convolutions run in TF32 (10-bit mantissa); their "
              "results differ from float32 by up to ~1e-3 of their scale", flush=True)


def launch_request(argv):
    """The value of ``--print-launch`` ("" without a topology), or None when not given."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--print-launch", nargs="?", const="")
    return ap.parse_known_args(argv)[0].print_launch


def launch_args(argv):
    """``(options, timeout)`` for the lines of ``--print-launch``: the program's options given
    with it (checked as a run checks them: a bad or missing one is argparse's error, exit 2)
    and their ``--timeout``, else RUN_HINT's options and the default timeout."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--print-launch", nargs="?", const="")
    rest = ap.parse_known_args(argv)[1]
    if not rest:
        return RUN_HINT.split(" program.py", 1)[1], TIMEOUT_S
    return " " + " ".join(shlex.quote(a) for a in rest), parse_args(rest).timeout


def init_dist(backend, args):
    """init_process_group with an explicit timeout, bound to DEVICE where the profile allows
    (the communicators then start now, not at the first collective after loading)."""
    bind = BIND_DEVICE_ID and args.device != "cpu"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout),
                            device_id=DEVICE if bind else None)


def check_output(args):
    """Exit 2 unless the directory of ``--output`` exists and no file this run writes there
    (``out.pt``, or every rank's ``out.rank{r}.pt``) is a file it reads: the checkpoint, the
    inputs, the replay states or program.py itself (run under agree())."""
    path = args.output
    if not path:
        return
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        fail(f"--output {path}: its directory does not exist")
    reads = {os.path.realpath(__file__): "program.py"}
    for flag in ("replay", "input", "checkpoint"):
        if getattr(args, flag, None) and os.path.isfile(getattr(args, flag)):
            reads[os.path.realpath(getattr(args, flag))] = f"--{flag}"
    writes = [rank_path(path, r) for r in range(WORLD_SIZE)] if SHARDED_OUTPUT else [path]
    for target in writes:
        if os.path.realpath(target) in reads:
            fail(f"--output {path}: it would write {target}, the file given as "
                 f"{reads[os.path.realpath(target)]}; give another name")


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
    error, FAULT["agreeing"] = None, True
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
        FAULT["agreeing"] = False
        return result
    failed = sorted(int(r) for r in store.get(f"{key}failed").decode().split())
    messages = {r: store.get(f"{key}error{r}").decode(errors="replace") for r in failed[:64]}
    import signal  # every rank exits 2 now: torchrun's SIGTERM to the others once the first has
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # exited must not turn their exit 2 into -15
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


def print_launch(text, program_args, timeout):
    """``--print-launch [NODESxDEVICES]``: the environment to set and one torchrun line per node,
    each running ``program.py`` with ``program_args`` (``timeout``: seconds; :func:`launch_args`)."""
    nodes, per_node = parse_topology(text or TOPOLOGY_TEXT)
    lines = [f"# mesh {MESH_TEXT} on {nodes} node(s) x {per_node} devices, profile {PROFILE} "
             f"({DIST_BACKEND}); rank r runs on node r // {per_node}",
             "# on every node, before torchrun (see docs/deploy.md):",
             *(line.format(devices=",".join(map(str, range(per_node))), timeout=f"{timeout:g}")
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
    check_output(args)
    params = load_checkpoint(args.checkpoint, args.key_map, args.load_report) if PARAMS else {}
    inputs = load_inputs(read_inputs(args.input)) if INPUTS else {}
    return params, inputs


def run(args):
    """Everything between init_process_group and destroy_process_group."""
    FAULT["where"] = "loading"
    make_groups(args.timeout)
    params, inputs = agree(lambda: load(args), "loading")
    step = compiled_step(forward, args)
    FAULT["where"] = "the forward step"
    with torch.inference_mode():
        outputs = step(params, inputs)
        if args.bench > 0:
            bench(step, params, inputs, args.bench)
    if args.output:
        FAULT["where"] = "writing the outputs"
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
        return print_launch(launch_request(argv), *launch_args(argv))
    args = parse_args(argv)
    check_world()
    keep_freed_memory()
    if args.device == "cpu":
        backend, DEVICE = "gloo", torch.device("cpu")
    else:
        import_prelude()
        backend, DEVICE = DIST_BACKEND, profile_device()
        set_tf32(args.tf32)  # the cuda profile's default is off; --tf32 turns it on
    init_dist(backend, args)  # then every failure is agreed on: no rank waits for one that left
    watch_faults(args.timeout)  # and a rank that hung or died is named by the others
    try:
        check_placement(args.placement)
        run(args)
    except LoadError as e:  # a checkpoint that cannot be loaded: the message names the file
        fail_load(e)
    except Exception as e:  # noqa: BLE001 - a collective that failed, or this rank's own error
        report_fault(e)  # one line naming the ranks that failed or stopped answering; exits
    except SystemExit as e:  # fail() printed why: posted too, so the others name this rank and why
        note_exit(e.code)
        raise
    finally:
        dist.destroy_process_group()


def exit_now(code):
    """Flush and leave with ``code`` without running C++ static destructors: on gloo a
    communicator's threads torn down at interpreter exit sometimes abort the process
    ("terminate called without an active exception", SIGABRT) after a clean run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as e:  # fail(): exit 2; argparse: 2; --help: 0
        if isinstance(e.code, str):
            sys.stderr.write(e.code + "\n")
        exit_now(e.code if isinstance(e.code, int) else (0 if e.code is None else 1))
    exit_now(0)
