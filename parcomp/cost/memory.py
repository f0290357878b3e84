"""Memory in the layout search: the `memory` limit, what a plan holds per rank, the check.

Two estimates, both per rank, in bytes:

- **resident** (what the search constrains, linear in the layout choice): the sources
  (weights, optimizer state, inputs) and, in a training step, the saved activations
  (values of the forward or loss phase that a backward node reads: what autograd keeps
  between the passes), each at its local size under its layout (a partial sum is whole),
  plus, for an attention whose gradients the step computes, the float32 logsumexp per query
  row its fused kernel keeps for its backward (:func:`parcomp.ir.liveness.saved_attention`;
  the output it keeps too is the buffer the output projection's weight gradient reads
  through views, already counted there), and for a layer norm whose dx it computes, the mean
  and rstd per row its kernel keeps (:func:`parcomp.ir.liveness.saved_layer_norm`).
- **peak** (what the compiled plan is checked against): the Program's liveness peak,
  ``report["memory_bytes_per_rank"]["peak_live"]`` (:func:`parcomp.ir.liveness.peak_bytes`),
  the same model the interpreter and program.py's ``del`` lines follow.

The resident bytes are a lower bound of the peak, so a plan the search calls feasible may
still peak over the limit; :func:`check_peak` then stops the compile and says by how much.
"""
from __future__ import annotations

import math
import re

import numpy as np

from ..errors import ParcompError
from ..ir.liveness import attention_saved_bytes, layer_norm_saved_bytes, saved_attention, saved_layer_norm
from ..ir.types import DTYPE_BYTES, local_shape
from ..units import format_bytes

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
#: the largest ``memory`` a spec may give (1024 TiB): far above any one device's memory, and
#: exact in the search's float arithmetic; a larger value is a typo in the unit or the number
MAX_MEMORY = 2**50
_SIZE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)$")


def parse_size(text: str, err) -> int:
    """Bytes of ``80GiB``, ``512MiB``, ``1.5GB``, ``4096B`` (binary and decimal units).

    Raises:
        whatever ``err(message)`` returns: not a size, a size below 1 B or above
        :data:`MAX_MEMORY` (1024 TiB).
    """
    m = _SIZE.match(text.strip())
    if not m:
        raise err(f"{text!r} is not a memory size; write a number and a unit, such as 80GiB "
                  f"(units: {', '.join(_UNITS)})")
    value = float(m.group(1)) * _UNITS[m.group(2)]
    if not math.isfinite(value) or value < 1:
        raise err(f"memory {text} is below 1 B; give the device's memory, such as 80GiB")
    if value > MAX_MEMORY:
        raise err(f"memory {text} is above {format_bytes(MAX_MEMORY)}, more than any one device "
                  f"holds (the limit is per device); give the device's memory, such as 80GiB")
    return int(value)


def local_bytes(ty, layout, mesh) -> int:
    """Bytes one rank holds of a value of global type ``ty`` in ``layout``."""
    return int(np.prod(local_shape(ty, layout, mesh), dtype=np.int64)) * DTYPE_BYTES[ty.dtype] \
        if ty.rank else DTYPE_BYTES[ty.dtype]


def resident_values(graph) -> list:
    """Names of the values the resident estimate counts: sources, and forward/loss values
    a backward (or optimizer) node reads (saved activations)."""
    users = graph.users()
    late = ("backward", "optimizer")
    return [n.name for n in graph.nodes if n.op in ("input", "param")
            or (n.phase in ("forward", "loss") and any(graph[u].phase in late for u in users[n.name]))]


def kernel_saved(graph) -> list:
    """Names of the ``sdpa`` values whose fused kernel keeps a logsumexp for the backward, and of
    the ``layer_norm`` values whose kernel keeps a mean and rstd per row (:func:`kernel_saved_bytes`)."""
    return list(saved_attention(graph)) + list(saved_layer_norm(graph))


def kernel_saved_bytes(graph, name, layout) -> int:
    """Bytes per rank of what the kernel of ``sdpa`` / ``layer_norm`` ``name`` keeps, its output in
    ``layout``: a float32 logsumexp per query row; a mean and rstd per row."""
    ty = graph[name].type
    saved = layer_norm_saved_bytes if graph[name].op == "layer_norm" else attention_saved_bytes
    return saved(ty, local_bytes(ty, layout, graph.mesh))


def resident_bytes(graph, layouts: dict) -> int:
    """Resident bytes per rank of ``graph`` with ``layouts`` (name -> layout; a name not in
    it keeps ``graph[name].layout``)."""
    return sum(local_bytes(graph[v].type, layouts.get(v, graph[v].layout), graph.mesh)
               for v in resident_values(graph)) + \
        sum(kernel_saved_bytes(graph, v, layouts.get(v, graph[v].layout)) for v in kernel_saved(graph))


class MemoryLimitError(ParcompError):
    """A plan over the spec's ``memory`` limit; ``need``: the bytes per rank it needs, or None;
    ``peak``: ``need`` is the compiled plan's liveness peak (else the search's resident bound)."""

    def __init__(self, message: str, loc=None, *, where: str | None = None, need: int | None = None,
                 peak: bool = False):
        super().__init__(message, loc, where=where)
        self.need, self.peak = need, peak


def over_limit(limit: int, need: int, what: str) -> str:
    """The message of a plan that needs ``need`` bytes per rank under a ``limit``."""
    return (f"{what} needs {format_bytes(need)} per rank ({need:,} B), over the memory limit "
            f"{format_bytes(limit)} by {format_bytes(need - limit)} ({need - limit:,} B)")


def check_peak(report: dict, spec) -> None:
    """Stop when the compiled plan's liveness peak exceeds the spec's ``memory``.

    Raises:
        MemoryLimitError: at the ``memory`` statement, with the peak (``need``), the limit and
            the excess.
    """
    limit = getattr(spec, "memory", None)
    if limit is None:
        return
    mem = report["memory_bytes_per_rank"]
    if mem["peak_live"] > limit:
        parts = ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in mem.items() if k != "peak_live")
        raise MemoryLimitError(over_limit(limit, mem["peak_live"], "the plan's peak of live values")
                               + f" ({parts}); use more ranks, a smaller batch, or ZeRO (train ... zero=1)",
                               spec.memory_loc, need=mem["peak_live"], peak=True)
