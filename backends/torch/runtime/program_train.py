"""The fixed part of a training ``program.py`` (sections pasted by :mod:`parcomp_backends.torch.runtime`).

Real, importable Python; it runs with :mod:`.program_common` (whose sections
program.py holds too) and the stand-ins below for what the emitter generates.
"""
# flake8: noqa: E402,F403,F405 (program.py is one namespace: the common sections are in it)
import argparse

import torch

from .program_cluster import *
from .program_common import *
from .program_loading import Checkpoint, Slice

# ---- stand-ins for what the emitter generates (never pasted) ----
MAX_STEPS = 1_000_000  # parcomp.compile.program.MAX_STEPS, emitted as a constant
STATE = ()
CARRIED = ()
STEP_INPUT = None
TRAIN_STEPS = 1
OUTPUT_LAYOUTS = {}
OUTPUT_GLOBAL_SHAPES = {}


def train_step(params, inputs):
    """Stand-in: program.py's generated training step."""
    return {"loss": torch.zeros(())}


# >>> program.py: updates
def fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, weight_decay, eps):
    """torch.optim.AdamW(fused=True)'s update of every tensor of the lists, in place: its kernel,
    ``torch._fused_adamw_`` (``step``: the step count, one tensor for all). Under torch.compile
    (``--compile``) the same update per tensor, which the compiler fuses: it cannot functionalize
    the fused kernel on the step's inputs (torch 2.13)."""
    if not torch.compiler.is_compiling():
        torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], [step] * len(params), lr=lr, beta1=beta1,
                            beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        return
    size = -lr / (1 - beta1 ** step)
    root = torch.sqrt(1 - beta2 ** step)
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        p.mul_(1 - lr * weight_decay).addcdiv_(m, torch.sqrt(v).div_(root * size).add_(eps / size))


def fused_sgd_(params, grads, momentum_buffers, weight_decay, momentum, lr):
    """torch.optim.SGD(fused=True)'s update of every tensor of the lists, in place: its kernel,
    ``torch._fused_sgd_`` (``momentum_buffers``: empty without momentum; they start at zeros, so
    step 1's ``momentum * 0 + g`` is torch's first step). Under torch.compile the same update per
    tensor, as :func:`fused_adamw_`."""
    if not torch.compiler.is_compiling():
        torch._fused_sgd_(params, grads, momentum_buffers, weight_decay=weight_decay, momentum=momentum, lr=lr,
                          dampening=0.0, nesterov=False, maximize=False, is_first_step=False)
        return
    for i, (p, g) in enumerate(zip(params, grads)):
        if weight_decay:
            g = g.add(p, alpha=weight_decay)
        if momentum_buffers:
            g = momentum_buffers[i].mul_(momentum).add_(g)
        p.add_(g, alpha=-lr)
# <<< program.py


# >>> program.py: write_outputs
def write_outputs(outputs, losses, path):
    """The last step's outputs, written as a forward program writes its outputs, plus
    "losses": [every step's loss] in the file (rank 0's) or in every rank's file."""
    local = {name: value.detach().cpu() for name, value in outputs.items()}
    if not SHARDED_OUTPUT:
        if RANK == 0:
            torch.save({**local, "losses": losses}, path)
        return
    torch.save({"rank": RANK, "coords": list(COORD), "outputs": local, "layouts": OUTPUT_LAYOUTS,
                "global_shapes": OUTPUT_GLOBAL_SHAPES, "losses": losses}, rank_path(path, RANK))
# <<< program.py


# >>> program.py: step_count
def step_count(text):
    """The value of --steps: a whole number of steps from 1 to MAX_STEPS."""
    steps = int(text)  # argparse reports a ValueError as an invalid value
    if not 1 <= steps <= MAX_STEPS:
        raise argparse.ArgumentTypeError(f"{text}: give 1 to {MAX_STEPS:_} training steps")
    return steps


TRAIN_STEPS_HELP = ("train until step N, the steps of the run --resume goes on from counted: a job requeued "
                    "with the same command ends at step N (a run resumed at step N or past it exits 0)")


def check_step_args(ap, args):
    """--steps K (K more steps) or --train-steps N (up to step N), not both; neither: --steps TRAIN_STEPS."""
    if args.steps is not None and args.train_steps is not None:
        ap.error("--steps K (K more steps) and --train-steps N (until step N, resumed steps counted) "
                 "both give the run's length: give one")
    if args.steps is None and args.train_steps is None:
        args.steps = TRAIN_STEPS


def planned_steps(args):
    """``(how many steps' inputs and --replay starts to read, the flag giving it)``: --steps K,
    or --train-steps N (the whole run's steps 1..N: a resumed run takes those after its step)."""
    return (args.steps, "--steps") if args.train_steps is None else (args.train_steps, "--train-steps")


def last_step(args, first):
    """The last step of a run starting at step ``first``: first + K - 1 (--steps K) or N
    (--train-steps N); None when a resumed run is at step N or past it (rank 0 says so)."""
    if args.train_steps is None:
        return first + args.steps - 1
    if first > args.train_steps:
        if RANK == 0:
            print(f"--resume {args.resume}: step {first - 1} is saved, --train-steps is {args.train_steps}: "
                  f"nothing left to train", flush=True)
        return None
    return args.train_steps
# <<< program.py


# >>> program.py: input_args
DATA_HELP = ("the inputs from a dataset instead of --input: FUNCTION() a map-style dataset of samples "
             "(each rank reads only its share of each step's batch), or FUNCTION(shard=, num_shards=) "
             "an iterable of one share's samples")
REPLAY_HELP = ("a .pt list of K full checkpoints (optimizer state included): step k starts "
               "from the k-th instead of step k-1's result (parcomp run's step-by-step check)")


def check_input_args(ap, args):
    """An argparse error unless the inputs are given once: --input FILE or --data MODULE:FUNCTION."""
    if INPUTS and not (args.input or args.data):
        ap.error(f"give the inputs ({', '.join(INPUTS)}): --input FILE.pt or --data MODULE:FUNCTION")
    if args.input and args.data:
        ap.error("--input and --data both give the inputs: give one")
# <<< program.py


# >>> program.py: parse_args
def parse_args(argv):
    """Command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=f"parcomp program for mesh {MESH_TEXT}; run: {RUN_HINT}")
    ap.add_argument("--checkpoint", required=True,
                    help=".safetensors, .pt state_dict, or a sharded checkpoint (directory or index.json)")
    ap.add_argument("--key-map", type=key_map_arg, default=(), metavar="RULES", help=KEY_MAP_HELP)
    ap.add_argument("--load-report", metavar="FILE", help=LOAD_REPORT_HELP)
    ap.add_argument("--input", help=".pt dict of inputs for every step, or a list of one dict per step")
    ap.add_argument("--data", metavar="MODULE:FUNCTION", help=DATA_HELP)
    ap.add_argument("--output", help="where to write the last step's outputs and the losses (.pt)")
    ap.add_argument("--steps", type=step_count, metavar="K",
                    help=f"training steps (default {TRAIN_STEPS}); with --resume, this many more")
    ap.add_argument("--train-steps", type=step_count, metavar="N", help=TRAIN_STEPS_HELP)
    ap.add_argument("--device", choices=sorted({"cpu", PROFILE}), default=PROFILE)
    ap.add_argument("--bench", type=bench_count, default=0, metavar="N",
                    help="time N training steps from the loaded parameters (not applied)")
    ap.add_argument("--log-every", type=step_count, default=1, metavar="N",
                    help="rank 0 prints the loss of every N-th step and the last (default 1)")
    ap.add_argument("--save", metavar="DIR",
                    help="after the last step, save params, optimizer state and the step number as a "
                         "sharded torch.distributed.checkpoint in DIR/step-K (atomic: DIR/latest names it)")
    ap.add_argument("--save-every", type=step_count, metavar="N",
                    help="with --save: also save after every step whose number is a multiple of N (resumed "
                         "runs count on from the saved step), so a run that dies resumes from the last one")
    ap.add_argument("--resume", metavar="DIR",
                    help="start from the checkpoint DIR/latest names, or DIR itself if it is a step-K directory "
                         "(saved by any mesh's program of this model): its params, optimizer state and step; "
                         "--steps more steps follow, or those up to --train-steps")
    ap.add_argument("--replay", metavar="FILE", help=REPLAY_HELP)
    add_cluster_args(ap)
    args = ap.parse_args(argv)
    check_step_args(ap, args)
    if args.save_every and not args.save:
        ap.error("--save-every N needs --save DIR (where the checkpoints go)")
    check_input_args(ap, args)
    return args
# <<< program.py


# >>> program.py: data
class SampleSlice(Slice):
    """Input ``name`` of one step's global batch from a --data source, as the block ``ranges``
    (``(start, length)`` per dim) that load_inputs narrows it to; nothing read until ``read()``,
    which fetches only the samples of its dim-0 range (this rank's dp share)."""

    def __init__(self, batch, name, shape, dtype, ranges):
        self.batch, self.name, self.shape, self.dtype, self.ranges = batch, name, shape, dtype, ranges

    def narrow(self, dim, start, length):
        ranges = list(self.ranges)
        ranges[dim] = (ranges[dim][0] + start, length)
        return SampleSlice(self.batch, self.name, self.shape, self.dtype, ranges)

    def read(self):
        start, length = self.ranges[0]
        parts = [self.batch.source.field(sample, self.name, self.shape[1:], self.dtype)
                 for sample in self.batch.source.samples(self.batch.step, start, length, self.shape[0])]
        out = torch.stack(parts) if parts else torch.empty((0, *self.shape[1:]), dtype=self.dtype)
        for d, (first, size) in list(enumerate(self.ranges))[1:]:
            out = out.narrow(d, first, size)
        self.check_range(out, start)
        return torch.empty(out.shape, dtype=out.dtype).copy_(out)

    def check_range(self, out, start):
        """Exit 2 where this input indexes a table (INDEX_BOUNDS) and a value of ``out`` (this
        rank's samples ``start``.. of the step's batch) lies outside it, naming the first such
        sample (its index in the dataset, or in its shard), the value and where in the sample
        it is. A min and a max on the host first; the search only when one is out of range."""
        bound = INDEX_BOUNDS.get(self.name)
        if bound is None or out.numel() == 0:
            return
        size, ignore, what = bound
        bad = (out < 0) | (out >= size)
        if ignore is not None:
            bad &= out != ignore
        if not bool(bad.any()):
            return
        at = [int(i) for i in bad.nonzero()[0]]
        inner = [first + i for (first, _), i in zip(self.ranges[1:], at[1:])]
        allowed = f"0..{size - 1}" + (f" or {ignore} (ignore_index)" if ignore is not None else "")
        source = self.batch.source
        fail(f"input {self.name!r} of {source.sample_name(self.batch.step, start + at[0], self.shape[0])} "
             f"in --data {source.target} (step {self.batch.step}) holds {int(out[tuple(at)])}"
             f"{' at ' + str(inner) if inner else ''}, outside the {what} of size {size} (allowed: {allowed})")


class DataBatch(Checkpoint):
    """Step ``step``'s global batch in a --data source, read by load_inputs as a checkpoint is:
    each input a SampleSlice, so each rank reads only the samples its slice holds."""

    def __init__(self, source, step):
        self.source, self.step = source, step

    def take(self, name, shape, dtype):
        if not shape:
            fail(f"--data: input {name!r} is a scalar; a dataset's samples stack along dim 0 of every input")
        return SampleSlice(self, name, tuple(shape), dtype, [(0, n) for n in shape])


class DataSource:
    """The samples a --data MODULE:FUNCTION gives: ``FUNCTION()`` a map-style dataset
    (``len`` and ``[i]``: step k's global batch is samples (k-1)*B .. k*B-1, of which each rank
    reads only its share), or, when FUNCTION takes ``shard`` and ``num_shards``,
    ``FUNCTION(shard=i, num_shards=n)`` an iterable of shard i's samples alone (B/n a step).
    A sample is a dict {input name: tensor}, a tuple in INPUTS order, or one tensor."""

    def __init__(self, target):
        self.target, self.fn, self.dataset, self.iterator, self.cache = target, None, None, None, {}
        module, sep, name = target.rpartition(":")
        if not sep or not module or not name:
            fail(f"--data {target}: give MODULE:FUNCTION (a file.py or an importable module, and the "
                 f"function returning the dataset)")
        import importlib.util
        import inspect

        try:
            if module.endswith(".py"):
                spec = importlib.util.spec_from_file_location(f"parcomp_data_{abs(hash(module))}", module)
                if spec is None or not os.path.isfile(module):
                    fail(f"--data {target}: {module} does not exist")
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
            else:
                mod = importlib.import_module(module)
        except ImportError as e:
            fail(f"--data {target}: cannot import {module}: {e}")
        self.fn = getattr(mod, name, None)
        if not callable(self.fn):
            fail(f"--data {target}: {module} has no function {name}")
        params = inspect.signature(self.fn).parameters
        self.sharded = "shard" in params and "num_shards" in params
        if not self.sharded:
            self.dataset = self.fn()
            if not (hasattr(self.dataset, "__getitem__") and hasattr(self.dataset, "__len__")):
                fail(f"--data {target}: {name}() returned a {type(self.dataset).__name__}, not a map-style "
                     f"dataset (len and [i]); for an iterable, let {name} take shard= and num_shards= "
                     f"and return that shard's samples")

    def samples(self, step, start, length, batch):
        """The samples start .. start+length-1 of step ``step``'s global batch of ``batch``."""
        key = (step, start, length)
        if key in self.cache:
            return self.cache[key]
        if self.sharded:
            if batch % length or start % length:
                fail(f"--data {self.target}: this rank's share of the batch ({start}..{start + length - 1} of "
                     f"{batch}) is not one of equal shards")
            if self.iterator is None:
                self.iterator = (iter(self.fn(shard=start // length, num_shards=batch // length)), (start, length))
            elif self.iterator[1] != (start, length):
                fail(f"--data {self.target}: the inputs split the batch differently; a sharded iterable "
                     f"serves one share")
            got = [s for _, s in zip(range(length), self.iterator[0])]
            if len(got) < length:
                fail(f"--data {self.target}: shard {start // length} ran out of samples at step {step}")
        else:
            first = (step - 1) * batch + start
            if first + length > len(self.dataset):
                fail(f"--data {self.target}: step {step} needs samples {(step - 1) * batch}..{step * batch - 1} "
                     f"but the dataset has {len(self.dataset)}")
            got = [self.dataset[i] for i in range(first, first + length)]
        self.cache = {key: got}  # one step's samples kept: the next step's replace them
        return got

    def sample_name(self, step, index, batch):
        """``sample N`` (its index in the dataset) for sample ``index`` of step ``step``'s global
        batch of ``batch``, or ``sample N of shard S`` for a sharded iterable."""
        if not self.sharded:
            return f"sample {(step - 1) * batch + index}"
        length = self.iterator[1][1]
        return f"sample {(step - 1) * length + index % length} of shard {index // length}"

    def field(self, sample, name, shape, dtype):
        """Input ``name`` of one sample, checked against its shape less the batch dim."""
        if isinstance(sample, dict):
            if name not in sample:
                fail(f"--data {self.target}: a sample has no {name!r} (it has {', '.join(map(str, sample))})")
            t = sample[name]
        elif isinstance(sample, (tuple, list)):
            if len(sample) != len(INPUTS):
                fail(f"--data {self.target}: a sample of {len(sample)} values for inputs {', '.join(INPUTS)}")
            t = sample[INPUTS.index(name)]
        else:
            t = sample
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            got = f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            fail(f"--data {self.target}: input {name!r} of a sample is {got}; the program takes "
                 f"{dtype}{list(shape)} per sample (the batch dim is the stacking)")
        return t


class StepData:
    """Every step's inputs from a --data source, read when its step comes (``batches[i]``: step
    ``offset + i + 1``): one step's batch on the device at a time."""

    def __init__(self, source, steps):
        self.source, self.steps, self.offset = source, steps, 0

    def __len__(self):
        return self.steps

    def __getitem__(self, i):
        if not -self.steps <= i < self.steps:
            raise IndexError(i)
        return load_inputs(DataBatch(self.source, self.offset + (i % self.steps) + 1))
# <<< program.py


# >>> program.py: checkpoint
def dtensor_placements(layout):
    """DTensor placements of a layout string such as "[R, S(1)]" (one per mesh axis)."""
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p.strip() == "R" else Shard(int(p.strip()[2:-1]))
            for p in layout.strip("[]").split(",")]


def as_dtensors(values):
    """``values`` (this rank's slices of CARRIED values) as DTensors on the mesh, with their
    global shapes: what torch.distributed.checkpoint needs to save and to reshard on load."""
    from torch.distributed.tensor import DTensor

    if "mesh" not in DEVICE_MESH:
        DEVICE_MESH["mesh"] = device_mesh(tuple(MESH))
    out = {}
    for name, local in values.items():
        shape = torch.Size(OUTPUT_GLOBAL_SHAPES[name])
        stride = torch.empty(shape, device="meta").stride()
        out[name] = DTensor.from_local(local, DEVICE_MESH["mesh"], dtensor_placements(OUTPUT_LAYOUTS[name]),
                                       run_check=False, shape=shape, stride=stride)
    return out


DEVICE_MESH = {}


def save_checkpoint(path, params, step):
    """Save the CARRIED values and ``step`` to ``path``/step-<step> with torch.distributed.checkpoint.
    Atomic: every rank writes into step-<step>.partial, then the checksums of what they wrote
    (:func:`write_checksums`); after all have finished, rank 0 renames
    it and then replaces ``path``/latest (a one-line file naming it), so an interrupted save
    leaves the previous checkpoint the one ``--resume`` loads (a step-<step>.partial such a save
    left is removed first: a resumed run saves that step again)."""
    import torch.distributed.checkpoint as dcp

    final = os.path.join(path, f"step-{step}")
    if os.path.exists(final):
        fail(f"--save {path}: {final} exists; parcomp's program never replaces a checkpoint")
    state = {**as_dtensors({name: params[name] for name in CARRIED}), "step": torch.tensor(step)}
    start_save(final)
    dcp.save(state, checkpoint_id=final + ".partial")
    dist.barrier()
    write_checksums(final + ".partial")  # before the rename: a committed step always has them
    if RANK == 0:
        os.remove(os.path.join(final + ".partial", SAVE_MARK))
        os.rename(final + ".partial", final)
        with open(os.path.join(path, "latest.partial"), "w") as f:
            f.write(f"step-{step}\n")
        os.replace(os.path.join(path, "latest.partial"), os.path.join(path, "latest"))
        print(f"saved step {step} to {final}", flush=True)
        remove_unfinished_saves(path)
    dist.barrier()
# <<< program.py


# >>> program.py: checkpoint_checks
SAVE_MARK = "PARCOMP_SAVING"  # in a step-K.partial from the start of its save until its rename


def start_save(final):
    """Rank 0 makes ``final``.partial afresh, holding SAVE_MARK (a step-K.partial left by a run
    that died while saving this step is removed first: a resumed run saves that step again);
    every rank waits for it."""
    import shutil

    partial = final + ".partial"
    if RANK == 0:
        if os.path.isdir(partial):
            shutil.rmtree(partial)
        os.makedirs(partial)
        with open(os.path.join(partial, SAVE_MARK), "w") as f:
            f.write("a parcomp program is saving this step; left here, the save did not finish, and "
                    "the program's next save in this directory removes it\n")
    dist.barrier()


def remove_unfinished_saves(path):
    """Rank 0, after a save in ``path`` committed: remove every step-K.partial there that holds
    SAVE_MARK (a save a killed run left; none is running now). One without the mark is not
    parcomp's and stays."""
    import shutil

    for name in sorted(os.listdir(path)):
        partial = os.path.join(path, name)
        if (name.startswith("step-") and name.endswith(".partial") and name[5:-8].isdigit()
                and os.path.isfile(os.path.join(partial, SAVE_MARK))):
            shutil.rmtree(partial, ignore_errors=True)
            print(f"removed {partial}: a save that did not finish", flush=True)


def latest_checkpoint(path):
    """``(step directory, None)``: the one ``path``/latest names; or ``(None, what is wrong)``,
    naming the file: no ``latest``, one that is not a step name, or one naming a step that is
    not there (the steps that are listed)."""
    latest = os.path.join(path, "latest")
    if not os.path.isfile(latest):
        return None, f"no checkpoint there ({latest} is missing; --save DIR writes it)"
    try:
        with open(latest, encoding="utf-8") as f:
            name = f.read(4096).strip()
    except (OSError, UnicodeDecodeError) as e:
        return None, f"{latest} cannot be read as the name of a step ({type(e).__name__}: {e})"
    if not name or "\n" in name or os.sep in name or name in (".", ".."):
        return None, f"{latest} does not name a step directory (it holds {name[:40]!r}; --save writes 'step-K')"
    where = os.path.join(path, name)
    if not os.path.isdir(where):
        steps = sorted((d for d in os.listdir(path) if d.startswith("step-") and d[5:].isdigit()
                        and os.path.isdir(os.path.join(path, d))), key=lambda d: int(d[5:]))
        partial = os.path.isdir(where + ".partial")
        return None, (f"{latest} names {name}, but {where} " + ("is not a directory" if os.path.exists(where)
                      else "does not exist") + (f" ({name}.partial is there: a save that did not finish)"
                                                if partial else "")
                      + (f"; the steps there: {', '.join(steps[-6:])}" if steps else "; no step-K is there"))
    return where, None


CHECKSUMS = "checksums.json"  # in a step directory: the crc32 of each saved value's bytes
CRC_CHUNK = 16 << 20  # bytes read at a time while checksumming


def data_items(index):
    """``{data file: [(offset, length, value name), ...]}`` of a checkpoint's index (the file
    system writer's ``storage_data``), or None for an index of another storage writer."""
    files = {}
    for key, item in (getattr(index, "storage_data", None) or {}).items():
        if not hasattr(item, "relative_path"):
            return None
        files.setdefault(item.relative_path, []).append((item.offset, item.length, getattr(key, "fqn", str(key))))
    return files


def file_crcs(file, items):
    """``[[value name, offset, length, crc32], ...]``: the crc32 of each ``(offset, length,
    name)`` byte range of ``file`` (read in CRC_CHUNK pieces)."""
    import zlib

    out = []
    with open(file, "rb") as f:
        for offset, length, name in sorted(items):
            f.seek(offset)
            crc, left = 0, length
            while left > 0:
                chunk = f.read(min(left, CRC_CHUNK))
                if not chunk:
                    break
                crc, left = zlib.crc32(chunk, crc), left - len(chunk)
            out.append([name, offset, length, crc])
    return out


def write_checksums(partial):
    """After dcp.save into ``partial`` (every rank): each rank reads back its share of the data
    files (the sorted files ``RANK::WORLD_SIZE``) and takes the crc32 of every value's bytes in
    them; rank 0 gathers them and writes ``partial``/CHECKSUMS (with the crc32 of ``.metadata``)
    before the rename that commits the step, so the checksums are part of the same atomic save.
    ``--resume`` and ``parcomp export`` compare them (:func:`checkpoint_damage`)."""
    import json
    import zlib

    import torch.distributed.checkpoint as dcp

    files = data_items(dcp.FileSystemReader(partial).read_metadata()) or {}
    mine = {name: file_crcs(os.path.join(partial, name), files[name]) for name in sorted(files)[RANK::WORLD_SIZE]}
    everyone = [None] * WORLD_SIZE if RANK == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    if RANK == 0:
        with open(os.path.join(partial, ".metadata"), "rb") as f:
            meta = zlib.crc32(f.read())
        table = {"algorithm": "crc32", "metadata": meta,
                 "files": {name: crcs for part in everyone for name, crcs in sorted(part.items())}}
        with open(os.path.join(partial, CHECKSUMS), "w", encoding="utf-8") as f:
            f.write(json.dumps(table) + "\n")


def writer_of(name):
    """`` (written by rank R)`` for a data file DCP's file system writer named ``__R_K.distcp``."""
    parts = name.split("_")
    return f" (written by rank {parts[2]})" if name.startswith("__") and len(parts) > 3 and parts[2].isdigit() else ""


def checksum_damage(where, files, share):
    """``(file, message)`` for the first data file of ``share`` (names of ``files``) whose bytes
    differ from ``where``/CHECKSUMS (naming every value whose crc32 differs), ``.metadata``'s
    own bytes changed, or CHECKSUMS unreadable; None when all match or no CHECKSUMS is there
    (a checkpoint saved before checksums were written)."""
    import json
    import zlib

    table_file = os.path.join(where, CHECKSUMS)
    if not os.path.isfile(table_file):
        return None
    try:
        with open(table_file, encoding="utf-8") as f:
            table = json.load(f)
        saved, meta = table["files"], table["metadata"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return table_file, f"{table_file} cannot be read, truncated or corrupt ({type(e).__name__}: {str(e)[:200]})"
    meta_file = os.path.join(where, ".metadata")
    with open(meta_file, "rb") as f:
        if zlib.crc32(f.read()) != meta:
            return meta_file, (f"{meta_file} is corrupt: its bytes differ from the crc32 written when it was "
                               f"saved ({CHECKSUMS})")
    for name in share:
        want = {(offset, length): (value, crc) for value, offset, length, crc in saved.get(name, [])}
        bad = [value for value, offset, length, crc in file_crcs(os.path.join(where, name), files[name])
               if (offset, length) in want and want[offset, length][1] != crc]
        if bad:
            file = os.path.join(where, name)
            return file, (f"{file}{writer_of(name)} is corrupt: the bytes of {', '.join(bad[:4])}"
                          f"{', ...' if len(bad) > 4 else ''} differ from the crc32 written when it was saved "
                          f"({CHECKSUMS}); this copy of the checkpoint cannot be trusted")
    return None


def checkpoint_damage(where, share=None):
    """``(file, message naming it)``: what is wrong with the torch.distributed.checkpoint
    directory ``where``, or None. Its ``.metadata`` (the index, written once every rank has
    saved) missing, empty or unreadable; a data file the index lists missing, or shorter than
    the bytes the index places in it (a truncated copy); then the bytes of the data files,
    ``share`` ``(i, n)`` of them (the sorted files ``i::n``; default all), against the crc32
    of every value written at save (:func:`checksum_damage`)."""
    import torch.distributed.checkpoint as dcp

    if not os.path.isdir(where):
        return where, f"{where} is not a directory"
    meta = os.path.join(where, ".metadata")
    if not os.path.isfile(meta):
        shards = [f for f in os.listdir(where) if f.endswith(".distcp")]
        return meta, (f"{meta} is missing: the checkpoint's index, written once every rank has saved; "
                      + (f"without it the {len(shards)} .distcp file(s) there cannot be read (a save "
                         f"that did not finish, or an incomplete copy?)" if shards else "no checkpoint is there"))
    if os.path.getsize(meta) == 0:
        return meta, f"{meta} is empty (0 bytes): the checkpoint's index is lost"
    try:
        index = dcp.FileSystemReader(where).read_metadata()
    except Exception as e:  # noqa: BLE001 - a truncated or corrupt pickle
        return meta, f"{meta} cannot be read, truncated or corrupt ({type(e).__name__}: {str(e)[:200]})"
    files = data_items(index)
    if files is None:
        return None  # not the file system writer's index: nothing here to check
    for name, items in sorted(files.items()):
        file = os.path.join(where, name)
        if not os.path.isfile(file):
            values = sorted({fqn for _, _, fqn in items})
            return file, (f"{file} is missing: the checkpoint's .metadata places {len(values)} value(s) "
                          f"in it ({', '.join(values[:4])}{', ...' if len(values) > 4 else ''})")
        size, need = os.path.getsize(file), max(offset + length for offset, length, _ in items)
        if size < need:
            cut = sorted({fqn for offset, length, fqn in items if offset + length > size})
            return file, (f"{file} is truncated: it has {size} bytes, the checkpoint's .metadata places "
                          f"{need} bytes in it; lost: {', '.join(cut[:4])}{', ...' if len(cut) > 4 else ''}")
    i, n = share or (0, 1)
    return checksum_damage(where, files, sorted(files)[i::n])


def dcp_failure(error):
    """The first line of what a rank's torch.distributed.checkpoint call raised (its
    CheckpointException wraps each rank's exception and traceback)."""
    failures = getattr(error, "failures", None)
    if failures:
        error = next(iter(failures.values()))[0]
    text = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {text[:300]}"


def resume_location(path):
    """The step directory ``path``/latest names (or ``path`` itself, a step directory: an
    earlier step chosen by hand), its index, file sizes and this rank's share of the data
    files' checksums checked; exit 2 naming the damaged file (:func:`latest_checkpoint`,
    :func:`checkpoint_damage`) and, where ``latest`` named it, the step before it. A damaged
    step is never skipped silently: resuming from an earlier one is the user's choice."""
    step_dir = os.path.isfile(os.path.join(path, ".metadata")) and not os.path.exists(os.path.join(path, "latest"))
    where, problem = (path, None) if step_dir else latest_checkpoint(path)
    damage = checkpoint_damage(where, (RANK, WORLD_SIZE)) if problem is None else None
    if damage is not None:
        problem = damage[1] + ("" if step_dir else earlier_step(path, where))
    if problem:
        fail(f"--resume {path}: {problem}")
    return where


def earlier_step(path, where):
    """``; the step before it ...``: how to resume from the newest complete step in ``path``
    older than the damaged ``where`` (none: nothing to say)."""
    step = int(os.path.basename(where)[5:])
    older = sorted((int(d[5:]) for d in os.listdir(path) if d.startswith("step-") and d[5:].isdigit()
                    and int(d[5:]) < step and os.path.isfile(os.path.join(path, d, ".metadata"))), reverse=True)
    if not older:
        return "; no earlier step is saved there"
    before = os.path.join(path, f"step-{older[0]}")
    return (f"; the newest earlier step is {before}: to go on from it (steps {older[0] + 1}..{step} run "
            f"again), move {where} aside and resume with --resume {before}")


def saved_latest(path):
    """Whether ``path``/latest is what save_checkpoint writes: one line ``step-K`` naming a
    directory ``path``/step-K (so replacing it loses nothing of the user's)."""
    try:
        with open(os.path.join(path, "latest")) as f:
            name = f.read(64).strip()
    except (OSError, UnicodeDecodeError):
        return False
    return (name.startswith("step-") and name[5:].isdigit()
            and os.path.isdir(os.path.join(path, name)))


def saved_steps(first, last, every=None):
    """The steps a run of steps ``first``..``last`` saves: every ``every``-th (with
    --save-every) and the last."""
    return sorted({k for k in range(first, last + 1) if every and k % every == 0} | {last})


def check_save(path, steps):
    """``--save DIR`` before the first step (a failing save would lose the whole run): exit 2
    when DIR is not a directory, ``DIR/step-K`` exists for a step K of ``steps`` (an int or the
    list the run saves), or DIR (or the nearest folder above it that exists, where DIR is still
    to be made) is not writable."""
    if os.path.exists(path) and not os.path.isdir(path):
        fail(f"--save {path}: it exists and is not a directory")
    there = set(os.listdir(path)) if os.path.isdir(path) else set()  # one listing, however many saves
    for step in ([steps] if isinstance(steps, int) else steps):
        if f"step-{step}" in there:  # a .partial of it is a save that never finished: replaced
            final = os.path.join(path, f"step-{step}")
            fail(f"--save {path}: {final} exists; parcomp's program never replaces a checkpoint")
    latest = os.path.join(path, "latest")
    if os.path.lexists(latest) and not saved_latest(path):
        fail(f"--save {path}: {latest} exists but does not name a step-K checkpoint there, so "
             f"a parcomp program did not write it; it is left alone: give another directory")
    folder = os.path.abspath(path)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        fail(f"--save {path}: cannot write there ({folder} is not a writable directory)")


def check_resume(path, where, state):
    """Exit 2 unless the checkpoint ``where`` holds every value of ``state`` with its global
    shape (one located line: a checkpoint of another model, optimizer or spec names what it
    lacks and what it has, instead of DCP's per-rank traceback)."""
    import torch.distributed.checkpoint as dcp

    try:
        saved = dcp.FileSystemReader(where).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - a missing or unreadable .metadata
        fail(f"--resume {path}: cannot read checkpoint {where}: {type(e).__name__}: {e}")
    missing = [k for k in state if k not in saved]
    if missing:
        extra = sorted(k for k in saved if k not in state)
        fail(f"--resume {path}: checkpoint {where} was saved by another program: it lacks "
             f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}"
             f"{'; it has ' + ', '.join(extra[:6]) if extra else ''} (another optimizer or model?)")
    for k, v in state.items():
        size = getattr(saved[k], "size", None)
        if size is not None and list(size) != list(v.shape):
            fail(f"--resume {path}: {k} in checkpoint {where} has shape {list(size)}, this program's "
                 f"is {list(v.shape)}")
# <<< program.py


# >>> program.py: resume
def resume_checkpoint(path, params):
    """``(params, first step)``: the CARRIED values of the checkpoint ``path``/latest names,
    resharded to this program's layouts (any mesh may have saved it), and its step + 1."""
    import torch.distributed.checkpoint as dcp

    where = agree(lambda: resume_location(path), "reading --resume")  # every rank exits 2 on damage
    state = {**as_dtensors({name: params[name] for name in CARRIED}), "step": torch.tensor(0)}
    # agreed: every rank exits 2 on its own message (a watch thread would otherwise find a
    # faster rank's failure first and print that instead)
    agree(lambda: check_resume(path, where, state), "checking --resume")
    try:
        dcp.load(state, checkpoint_id=where)
    except (Exception, dcp.api.CheckpointException) as e:  # BaseException: not an Exception
        fail(f"--resume {path}: cannot load {where} into this program: {dcp_failure(e)}")
    if RANK == 0:
        print(f"resumed from {where} (step {int(state['step'])})", flush=True)
    return {**params, **{name: state[name].to_local() for name in CARRIED}}, int(state["step"]) + 1
# <<< program.py


# >>> program.py: loop
class StepBatches:
    """Every step's inputs, each put on the device when its step reads it (``batches[k]``), so
    one step's batch is on the device at a time; the host keeps the file's tensors."""

    def __init__(self, feeds):
        self.feeds = feeds

    def __len__(self):
        return len(self.feeds)

    def __getitem__(self, k):
        if not -len(self.feeds) <= k < len(self.feeds):
            raise IndexError(k)
        return load_inputs(self.feeds[k])


def read_batches(path, steps, flag="--steps"):
    """This rank's slices of every step's inputs: one dict {input name: tensor} serves
    every step (placed once); a list holds one such dict per step, every one checked now
    (names, shapes, dtypes: under agree()) and placed on the device at its step."""
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
        fail(f"input file {path} holds the inputs of {len(feeds)} steps but {flag} is {steps}")
    note_unused(feeds[0] if feeds else {}, INPUTS, "input")
    CHECK_ONLY["on"] = True
    try:
        for f in feeds:
            load_inputs(f)  # checked, not placed
    finally:
        CHECK_ONLY["on"] = False
    return StepBatches(feeds)


def with_step(inputs, k, numbers=None):
    """The inputs of step ``k`` (counted from 1), with the step number the optimizer reads
    (``numbers[k-1]`` when given: a view of one device tensor, no copy to the device per step)."""
    if STEP_INPUT is None:
        return inputs
    if numbers is not None:
        return {**inputs, STEP_INPUT: numbers[k - 1]}
    return {**inputs, STEP_INPUT: torch.tensor(float(k), dtype=torch.float32, device=DEVICE)}


def train(params, batches, starts=None, step=None, log_every=1, first=1, after_step=None):
    """One ``step`` (default train_step) per batch, numbered from ``first``; the CARRIED outputs
    are the next step's params and state (with ``starts``, step k starts from ``starts[k-first]``);
    ``after_step(k, params)``, when given, runs after step k with its result (--save-every).

    Losses stay on the device: rank 0 prints every ``log_every``-th step's loss and the last
    (the only reads to the host). Returns the last step's outputs and every loss (floats);
    ``after_step`` returning True ends the loop after that step (a SIGTERM: :func:`stop_after`).
    """
    step, outputs, losses = step or train_step, {}, []
    numbers = torch.arange(1, first + len(batches), dtype=torch.float32, device=DEVICE)
    last = first + len(batches) - 1
    for k in range(first, last + 1):
        FAULT["where"] = f"step {k}"  # what a failure's message says this rank was doing
        if starts is not None:
            params = {**params, **starts[k - first]}
        outputs = None  # the last step's gradients and other outputs die before this step runs
        inputs = batches[k - first]  # on the device now (StepBatches), the last step's freed
        outputs = step(params, with_step(inputs, k, numbers))
        del inputs
        params = {**params, **{name: outputs[name] for name in CARRIED}}
        losses.append(outputs["loss"])
        if RANK == 0 and (k % log_every == 0 or k == last):
            print(f"step {k} loss {outputs['loss'].item():.6g}", flush=True)
        if after_step is not None and after_step(k, params):
            break
    return outputs, torch.stack(losses).tolist() if losses else []
# <<< program.py


# >>> program.py: replay
def read_replay(path, steps, flag="--steps"):
    """This rank's slices of the K checkpoints of a --replay file (a list, K = --steps, or N =
    --train-steps: ``flag``)."""
    states = read_tensors(path, "replay")
    if not isinstance(states, (list, tuple)) or not all(isinstance(s, dict) for s in states):
        fail(f"replay file {path} must hold a list of one checkpoint dict per step")
    if len(states) != steps:
        fail(f"replay file {path} holds {len(states)} checkpoints but {flag} is {steps}")
    return [load_params(s) for s in states]
# <<< program.py


# >>> program.py: stop
def stop_after(k):
    """Whether every rank stops after step ``k`` (a SIGTERM on some rank): the flags every rank
    posted after step k-1 (``STOP["asked"]``, set by SIGTERM's handler), combined by one
    all_reduce of one int that ran during step k, so no rank waits for it; then, unless
    stopping, this step's flag is posted for the next. Every rank reads the same maximum, so
    all stop after the same step: each ends the step its SIGTERM came in and at most one more."""
    if stop_wait():
        return True
    flag = torch.tensor([int(STOP["asked"])], dtype=torch.int32, device=DEVICE)
    STOP["flag"] = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True))
    return False


def stop_wait():
    """The posted stop flag's maximum over the ranks (False when none is posted); waits for it
    (at most --timeout, as every collective)."""
    if STOP["flag"] is None:
        return False
    (flag, work), STOP["flag"] = STOP["flag"], None
    work.wait()
    return bool(flag.item())


def stopped(path, k, save=None):
    """The end of a run stopped by SIGTERM after step ``k``: ``save()`` saves step k into the
    --save directory ``path`` (None: --save-every saved it), rank 0's line says how to go on,
    and every rank exits 143 (128 + SIGTERM: the run did not reach its last step; --output is
    not written)."""
    if save is not None:
        FAULT["where"] = f"saving the checkpoint of step {k} (stopped by SIGTERM)"
        save()
    if RANK == 0:
        print(f"stopped by SIGTERM after step {k}: saved {os.path.join(path, f'step-{k}')}; "
              f"go on with --resume {path}", flush=True)
    raise SystemExit(143)
# <<< program.py


# >>> program.py: run
def load(args):
    """This rank's params, every step's inputs and the --replay starts (``--output``'s
    directory checked first); under agree()."""
    check_output(args)
    params = load_checkpoint(args.checkpoint, args.key_map, args.load_report)
    steps, flag = planned_steps(args)
    if INPUTS and args.data:
        batches = StepData(DataSource(args.data), steps)
        batches[0]  # the first step's batch read (and checked) now, under agree(); read again at its step
    else:
        batches = read_batches(args.input, steps, flag) if INPUTS else [{}] * steps
    with torch.no_grad():
        starts = read_replay(args.replay, steps, flag) if args.replay else None
    return params, batches, starts


def run(args):
    """Everything between init_process_group and destroy_process_group."""
    FAULT["where"] = "loading"
    make_groups(args.timeout)
    params, batches, starts = agree(lambda: load(args), "loading")
    first = 1
    if args.resume:  # sharded checkpoint of any mesh's program
        params, first = resume_checkpoint(args.resume, params)
    last = last_step(args, first)
    if last is None:  # --train-steps reached already
        return
    if isinstance(batches, StepData):  # a resumed run reads on from the saved step's next batch
        batches.offset, batches.steps = first - 1, last - first + 1
    elif args.train_steps is not None:  # steps first..N of the whole run's 1..N
        batches = StepBatches(batches.feeds[first - 1:]) if isinstance(batches, StepBatches) else batches[first - 1:]
    if args.train_steps is not None and starts is not None:
        starts = starts[first - 1:]
    saves = saved_steps(first, last, args.save_every) if args.save else []
    if args.save:  # before training: a save that cannot succeed is found now, not after the last step
        agree(lambda: check_save(args.save, saves), "checking --save")

    done = []  # the steps run

    def save_during(k, now):  # --save-every: atomic, so a run killed later resumes from step k
        done.append(k)
        if k in saves and k != last:
            FAULT["where"] = f"saving the checkpoint of step {k}"
            save_checkpoint(args.save, now, k)
        return k != last and stop_after(k)  # a SIGTERM: save step k (below) and exit

    STOP["armed"] = bool(args.save)  # from here a SIGTERM ends the step and saves it
    with torch.no_grad():  # the backward pass is explicit in train_step: no autograd state
        outputs, losses = train(params, batches, starts, compiled_step(train_step, args), args.log_every,
                                first, save_during if args.save else None)
        stop_wait()  # the last step's flag: the run has ended anyway
        if done and done[-1] != last:
            now, k = {**params, **outputs}, done[-1]
            stopped(args.save, k, None if k in saves else lambda: save_checkpoint(args.save, now, k))
        if args.bench > 0:
            # on copies: train_step updates params and state in place
            copies = {k: v.clone() for k, v in params.items()}
            bench(train_step, copies, with_step(batches[0], 1), args.bench)
    if args.save:
        FAULT["where"] = "saving the checkpoint"
        save_checkpoint(args.save, {**params, **outputs}, last)
    if args.output:
        FAULT["where"] = "writing the outputs"
        agree(lambda: write_outputs(outputs, losses, args.output), "writing the outputs")
# <<< program.py
