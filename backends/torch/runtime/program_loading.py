"""Checkpoint loading of every emitted ``program.py``: each rank reads only its own bytes.

Real, importable Python (tested directly: tests/backends/test_loading.py); :mod:`parcomp_backends.torch.runtime`
pastes the section below into each program, and :mod:`.program_common` imports
it so that it runs as a one-rank program.  Only the standard library and torch.

One entry point, :func:`open_checkpoint`, resolves the checkpoint layout and checks
every file it names before anything is read (so every rank finds the same fault at
the same point); the generated ``load_params`` then asks for each parameter with
``take(ckpt, name, full shape, dtype).narrow(...)``, which yields a :class:`Slice`
(nothing read yet) whose :meth:`Slice.read` reads this rank's bytes.  Every failure
is a :class:`LoadError` whose message names the file; ``main()`` exits 2 with it.

Formats (docs/deploy.md, "Loading checkpoints"):

- ``.safetensors``: the header is parsed here (8-byte little-endian length, JSON) and
  only this rank's byte runs are read with ``readinto`` into the tensor that is kept:
  no mmap, so no pages of other ranks' slices count in this process's memory.
- ``.pt`` / ``.bin`` (torch zip format): ``torch.load(mmap=True, weights_only=True)``;
  a slice is copied out and the mapped pages it touched are released (``madvise``).
- a directory or a ``*.index.json`` (transformers' sharded layout): ``weight_map``
  names each key's shard file (safetensors or torch).
- anything else (e.g. an ``.onnx`` file): read whole by the program's ``read_tensors``.
"""
# flake8: noqa: E402 (the section keeps program.py's layout)
import argparse
import json
import math
import os
import sys

import torch

RANK = int(os.environ.get("RANK", "0"))  # stand-in: program.py's process section defines it


# >>> program.py: loading
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
# <<< program.py
