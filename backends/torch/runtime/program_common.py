"""The fixed part of every emitted ``program.py`` that forward and training programs share.

Real, importable Python (tested directly: tests/backends/test_runtime.py); the emitter
(:mod:`parcomp_backends.torch.runtime`) pastes the sections between ``# >>> program.py: NAME`` and
``# <<< program.py`` into each program, in the order it needs.  Nothing else of
this file reaches a program: the names below the imports stand for what the
emitter generates before the runtime (the mesh, the params, the PROFILE block),
so that this module imports and runs on its own as a one-rank program.

The collectives follow ``parcomp/reference/interpreter.py`` exactly (groups in
coordinate order, concatenation never sums) and never modify their inputs
(``all_reduce_`` aside).  Single-tensor gathers and scatters always work on dim 0
of a ``movedim`` copy: gloo accepts only the concatenated dim-0 form of
``all_gather_single``.
"""
# flake8: noqa: E402 (the sections keep program.py's layout; argparse is imported by the modules that parse)
import argparse
import datetime
import importlib
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from .program_loading import *  # the loading section (program.py holds it too)

# ---- stand-ins for what the emitter generates (never pasted): a one-rank program ----
PROFILE = "cpu"
DIST_BACKEND = "gloo"
PRELUDE = ()
MESH = {"x": 1}
GROUP_RANKS = {"x": [[0]]}
COMM_AXES = ("x",)
PARAMS = ()
INPUTS = ()
INDEX_BOUNDS = {}  # {input name: [size, ignore_index or None, what]}
OUTPUT_LAYOUTS = {}
OUTPUT_GLOBAL_SHAPES = {}
SHARDED_OUTPUT = False
RUN_HINT = "torchrun --nproc-per-node 1 program.py --output out.pt"


def profile_device():
    """Stand-in: the PROFILE block's device binding."""
    return torch.device("cpu")


def load_params(ckpt):
    """Stand-in: program.py's generated parameter loader."""
    return {}


def load_inputs(feeds):
    """Stand-in: program.py's generated input loader."""
    return {}


def parse_args(argv):
    """Stand-in: :mod:`.program_forward` or :mod:`.program_train` defines it."""
    raise NotImplementedError("program_common alone parses nothing; see program_forward/program_train")


def run(args):
    """Stand-in: :mod:`.program_forward` or :mod:`.program_train` defines it."""
    raise NotImplementedError("program_common alone runs nothing; see program_forward/program_train")


# >>> program.py: process
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
# <<< program.py


# >>> program.py: onnx
# the checkpoint may be the model's .onnx file (pasted into programs compiled from one)
ONNX_TORCH_DTYPES = {1: torch.float32, 11: torch.float64, 10: torch.float16, 16: torch.bfloat16,
                     7: torch.int64, 6: torch.int32, 9: torch.bool}
read_tensors_file = read_tensors


def read_tensors(path, what):
    """{name: tensor} of an .onnx file's initializers (:func:`read_onnx`), else of a
    .safetensors or torch .pt file; exits 2 if unreadable."""
    if not path.endswith(".onnx"):
        return read_tensors_file(path, what)
    FILES[what] = path
    if not os.path.isfile(path):
        fail(f"{what} file {path} does not exist")
    try:
        import numpy
        import onnx
    except ImportError as e:
        fail(f"reading the {what} file {path} needs the onnx package ({e}): pip install onnx")
    try:
        return read_onnx(path, numpy, onnx)
    except Exception as e:  # noqa: BLE001 - any reader error becomes one clear message
        fail(f"cannot read {what} file {path}: {type(e).__name__}: {e}")


def read_onnx(path, numpy, onnx):
    """The initializers of the ONNX file ``path``, named as parcomp imports them (a character
    outside [A-Za-z0-9_.-] reads as _). External data is memory-mapped, so a rank reads only
    the pages of the slices it keeps; embedded data is read with the file."""
    model = onnx.load(path, load_external_data=False)
    base, out = os.path.dirname(os.path.abspath(path)), {}
    for t in model.graph.initializer:
        dtype = ONNX_TORCH_DTYPES.get(t.data_type)
        if dtype is None:
            continue
        name = "".join(c if c.isascii() and (c.isalnum() or c in "_.-") else "_" for c in t.name)
        out[name or "_"] = onnx_tensor(t, dtype, base, numpy, onnx)
    return out


def onnx_tensor(t, dtype, base, numpy, onnx):
    """One initializer as a tensor (a view of the mapped file for external data)."""
    shape = tuple(int(d) for d in t.dims)
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if t.data_location == onnx.TensorProto.EXTERNAL:
        info = {e.key: e.value for e in t.external_data}
        raw = numpy.memmap(os.path.join(base, info["location"]), dtype=numpy.uint8, mode="c",
                           offset=int(info.get("offset", 0)), shape=(size,))
        return torch.from_numpy(raw).view(dtype).reshape(shape)
    if t.raw_data:
        return torch.frombuffer(bytearray(t.raw_data), dtype=dtype).reshape(shape)
    return torch.from_numpy(onnx.numpy_helper.to_array(t).copy()).reshape(shape)
# <<< program.py


# >>> program.py: read_inputs
def read_inputs(path):
    """The inputs file as {input name: tensor}; a bare tensor is the model's only input."""
    feeds = read_tensors(path, "input")
    if isinstance(feeds, torch.Tensor) and len(INPUTS) == 1:
        feeds = {INPUTS[0]: feeds}
    if not isinstance(feeds, dict):
        fail(f"input file {path} must hold a dict {{input name: tensor}} for inputs {list(INPUTS)}")
    note_unused(feeds, INPUTS, "input")
    return feeds
# <<< program.py


# >>> program.py: constants
# the constants parcomp computed from the model at import (position ids, RoPE's cos/sin):
# not weights of the model's state_dict, so compile writes them beside this program
CONSTANTS_FILE = "constants.safetensors"
_CONSTANTS = []  # the opened CONSTANTS_FILE (a Checkpoint), once needed


def take_constant(tensors, name, shape, dtype):
    """Like ``take``, for a param parcomp computed at import: from the checkpoint if it holds
    it, else from CONSTANTS_FILE beside this program (a LoadError names both when neither)."""
    if name in tensors:
        return take(tensors, name, shape, dtype)
    if not _CONSTANTS:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), CONSTANTS_FILE)
        if not os.path.isfile(path):
            raise LoadError(f"param {name!r} is a constant parcomp computed from the model (not a "
                            f"weight of its state_dict); the checkpoint lacks it and {path} does not "
                            f"exist: keep {CONSTANTS_FILE} beside program.py (parcomp compile wrote it)")
        _CONSTANTS.append(open_checkpoint(path))
    if name not in _CONSTANTS[0]:
        raise LoadError(f"param {name!r} is neither in the checkpoint nor in {_CONSTANTS[0].path}; "
                        f"compile the model again to write both files")
    return _CONSTANTS[0].take(name, shape, dtype)
# <<< program.py


# >>> program.py: tied
def take_tied(tensors, names, shape, dtype):
    """Like ``take``, for a tied weight: ``names`` are its names (the program's first), read
    from the first the checkpoint holds (``save_pretrained`` writes one of GPT-2's
    ``lm_head.weight`` / ``transformer.wte.weight``); none there: the LoadError of the first."""
    return take(tensors, next((n for n in names if n in tensors), names[0]), shape, dtype)
# <<< program.py


# >>> program.py: take_place
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
# <<< program.py


# >>> program.py: rank_path
def rank_path(path, rank):
    """``out.pt`` -> ``out.rank{rank}.pt``: where a rank writes its slices of sharded outputs."""
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"
# <<< program.py


# >>> program.py: sync
def sync():
    """Wait for the device to finish queued work (no-op on CPU)."""
    if DEVICE.type != "cpu":
        getattr(torch, DEVICE.type).synchronize()
# <<< program.py


# >>> program.py: bench
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
# <<< program.py


# >>> program.py: world
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
# <<< program.py


# >>> program.py: main
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
# <<< program.py


# >>> program.py: entry
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
# <<< program.py
