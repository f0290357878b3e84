"""Memory budgets of ``parcomp check`` and ``parcomp run``: refuse before allocating.

``check`` runs every rank of the mesh in one process (the numpy interpreter of
:mod:`parcomp.reference.interpreter` keeps every value of every rank until the
end) next to the unsharded reference; ``run`` starts one torch process per rank
on this machine, each reading the whole checkpoint.  A model or mesh that does
not fit used to die inside numpy (``ArrayMemoryError``) or drive the machine
into swap.  Both commands now estimate their peak memory from the compiled
program first and stop with a :class:`~parcomp.errors.ParcompError` giving the
estimate, what it is made of, the largest value, and the limit.

The limit is :data:`MEMORY_FRACTION` of the memory this machine has available
now (``MemAvailable`` of ``/proc/meminfo``, else ``os.sysconf``), or
:data:`FALLBACK_LIMIT_BYTES` where neither can be read.  The estimates are
upper bounds of what is held at once, plus a fixed cost per array (numpy
header) and per process (Python + torch + gloo).  See docs/design/cost.md, "Limits".
"""
from __future__ import annotations

import os

from ..errors import ParcompError
from ..ir.types import TensorType
from ..units import format_bytes, plural

#: The share of the available memory a command may plan to use.
MEMORY_FRACTION = 0.5
#: The limit when the available memory cannot be read (no /proc, no sysconf).
FALLBACK_LIMIT_BYTES = 4 * 1024 ** 3
#: Bytes a small numpy array costs beyond its data (object header, dict slot).
ARRAY_OVERHEAD_BYTES = 128
#: Bytes one interpreter rank costs beyond its arrays (its dict of values): about 1 KiB
#: measured with 65536 ranks of a 9-value program (2.4 KiB per rank in all).
RANK_OVERHEAD_BYTES = 1024
#: Bytes one torchrun worker costs before any tensor (Python, torch, gloo): about
#: 235 MiB measured for ``import torch, torch.distributed`` (torch 2.13 CPU), rounded up.
PROCESS_OVERHEAD_BYTES = 256 * 1024 ** 2

#: Seconds ``parcomp check`` may plan to spend (its estimate, :func:`check_seconds`); above it
#: check refuses and names a ``--steps`` that fits.
CHECK_SECONDS_BUDGET = 600.0
#: Above this estimate check says on stderr how long it expects to take (and, training,
#: prints a progress line every :data:`PROGRESS_EVERY_S` seconds).
CHECK_SECONDS_ANNOUNCE = 10.0
PROGRESS_EVERY_S = 10.0
#: Seconds per op evaluation (one node on one rank, or one node of the unsharded graph)
#: and per element it touches: measured about 10-30 us and 1-3 ns on a 2020 laptop core,
#: rounded up.
OP_SECONDS, ELEMENT_SECONDS = 3e-5, 5e-9

__all__ = ["CHECK_SECONDS_BUDGET", "check_seconds", "check_time", "MEMORY_FRACTION", "available_memory", "memory_limit", "check_estimate",
           "run_estimate", "check_memory"]


def available_memory() -> int | None:
    """Bytes of memory available to new allocations now, or None if unknown.

    ``MemAvailable`` from ``/proc/meminfo`` (Linux: free memory plus reclaimable
    caches), else free physical pages from ``os.sysconf``.
    """
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, AttributeError):
        return None


def memory_limit(available: int | None) -> int:
    """The budget in bytes: :data:`MEMORY_FRACTION` of ``available`` bytes, or
    :data:`FALLBACK_LIMIT_BYTES` when ``available`` is None."""
    return FALLBACK_LIMIT_BYTES if available is None else int(available * MEMORY_FRACTION)


def _values(graph) -> int:
    """Bytes of every value of ``graph`` (its types' shapes) held at once, with array overhead."""
    return sum(n.type.nbytes + ARRAY_OVERHEAD_BYTES for n in graph.nodes)


def _full_sources(program) -> int:
    """Bytes of the full (unsharded) inputs and params of a local ``program``."""
    return sum(TensorType(n.attr("global_shape") or n.type.shape, n.type.dtype).nbytes
               for n in program.nodes if n.op in ("input", "param"))


def check_estimate(compiled) -> dict:
    """Peak bytes of ``parcomp check``: ``{"total", "per_rank", "ranks", "reference"}``.

    ``per_rank``: every value of the local program (the interpreter keeps them all) and
    :data:`RANK_OVERHEAD_BYTES`;
    ``reference``: the unsharded program's values (the answer to compare with),
    the full inputs and params the ranks are cut from, and for training the
    torch.optim reference as much again.
    """
    ranks = compiled.program.mesh.size
    per_rank = RANK_OVERHEAD_BYTES + _values(compiled.program)
    reference = _values(compiled.logical) + _full_sources(compiled.program)
    if compiled.report.get("training"):
        reference *= 2
    return {"total": ranks * per_rank + reference, "per_rank": per_rank, "ranks": ranks,
            "reference": reference}


def run_estimate(compiled) -> dict:
    """Peak bytes of ``parcomp run`` on this machine: ``{"total", "per_rank", "ranks", "reference"}``.

    ``per_rank``: one torch process (:data:`PROCESS_OVERHEAD_BYTES`), the whole
    checkpoint and input file it reads, and every value of its local program;
    ``reference``: this process's full inputs and params (as arrays and as the
    files' tensors) and the unsharded reference run.
    """
    ranks = compiled.program.mesh.size
    full = _full_sources(compiled.program)
    per_rank = PROCESS_OVERHEAD_BYTES + full + _values(compiled.program)
    reference = 2 * full + _values(compiled.logical)
    return {"total": ranks * per_rank + reference, "per_rank": per_rank, "ranks": ranks,
            "reference": reference}


def check_memory(compiled, command: str, available: int | None = None) -> dict:
    """Refuse ``command`` ("check" or "run") when its estimate exceeds the budget.

    Args:
        compiled: a :class:`parcomp.compile.compiler.Compiled`.
        command: ``"check"`` (numpy interpreter) or ``"run"`` (torchrun on this machine).
        available: bytes available; None reads :func:`available_memory`.

    Returns:
        The estimate (see :func:`check_estimate` / :func:`run_estimate`) with ``"limit"``.

    Raises:
        ParcompError: the estimate exceeds :func:`memory_limit`; names the estimate, its
            parts, the largest value of the program and the limit, in human units.
    """
    avail = available_memory() if available is None else available
    est = (check_estimate if command == "check" else run_estimate)(compiled)
    est["limit"] = memory_limit(avail)
    if est["total"] <= est["limit"]:
        return est
    big = max(compiled.logical.nodes, key=lambda n: n.type.nbytes)
    where = ("each holding every value of the numpy interpreter" if command == "check" else
             "each a torch process reading the whole checkpoint")
    source = (f"{MEMORY_FRACTION:.0%} of the {format_bytes(avail)} available on this machine"
              if avail is not None else "a fixed limit: the available memory could not be read")
    raise ParcompError(
        f"parcomp {command} would need about {format_bytes(est['total'])} of memory: "
        f"{plural(est['ranks'], 'rank')} x {format_bytes(est['per_rank'])} ({where}) + "
        f"{format_bytes(est['reference'])} for the unsharded reference; the largest value is "
        f"%{big.name} {big.type} ({format_bytes(big.type.nbytes)}). The limit is "
        f"{format_bytes(est['limit'])} ({source}). Use a smaller model or mesh for "
        f"'parcomp {command}', or compile it and run program.py on machines that hold it")


def check_seconds(compiled, steps: int = 1) -> float:
    """Estimated seconds of ``parcomp check`` for ``steps`` steps (1: a forward check).

    Per step: every node of the local program on every rank, and the unsharded graph
    three times (the float64 reference, torch, and a mixed-precision program's own
    precision), at :data:`OP_SECONDS` per node and
    :data:`ELEMENT_SECONDS` per element.
    """
    prog, logical = compiled.program, compiled.logical
    ranks = prog.mesh.size
    calls = ranks * len(prog.nodes) + 3 * len(logical.nodes)
    elements = (ranks * sum(n.type.numel for n in prog.nodes)
                + 3 * sum(n.type.numel for n in logical.nodes))
    return steps * (calls * OP_SECONDS + elements * ELEMENT_SECONDS)


def check_time(compiled, steps: int = 1) -> float:
    """Refuse a ``parcomp check`` estimated (:func:`check_seconds`) above
    :data:`CHECK_SECONDS_BUDGET`; returns the estimate in seconds.

    Raises:
        ParcompError: naming the estimate, the ranks, ops and steps it comes from, and
            for training the largest ``--steps`` that fits.
    """
    est = check_seconds(compiled, steps)
    if est <= CHECK_SECONDS_BUDGET:
        return est
    ranks, ops = compiled.program.mesh.size, len(compiled.program.nodes)
    hint = ("use a smaller mesh for 'parcomp check', or compile it and run program.py"
            if steps == 1 else
            f"check fewer steps, e.g. --steps {max(1, int(steps * CHECK_SECONDS_BUDGET / est))}")
    times = "" if steps == 1 else " x " + plural(steps, "step")
    raise ParcompError(
        f"parcomp check would take about {est:,.0f} s ({plural(ranks, 'rank')} x {plural(ops, 'op')}"
        f"{times} in the numpy interpreter, plus the "
        f"unsharded reference); the limit is {CHECK_SECONDS_BUDGET:.0f} s: {hint}")
