"""Small helpers shared by parcomp's benchmarks (self-contained: torch + stdlib, optional rich).

Method (the same as the peer measurements in ``shared/anchors``):

* every process runs with 1 intra-op thread (``OMP_NUM_THREADS=1``, ``MKL_NUM_THREADS=1``
  and ``torch.set_num_threads(1)``);
* multi-rank runs are ``torch.multiprocessing`` spawn workers on gloo
  (``MASTER_ADDR=127.0.0.1``, a free port, a process-group timeout, and a hard deadline in
  the parent that kills stuck workers; ``destroy_process_group`` in a ``finally``);
* variants are timed *interleaved* in one run: rounds of k steps per variant, the order
  reversed every other round, so drift of the machine hits all variants alike;
* a step's time is ``time.perf_counter()`` around it, taken on every rank, and the
  reported per-step time is the max over ranks; we report median, min and max;
* single-process references ("solo" variants) run on rank 0 while the other ranks wait
  in a gloo barrier (a blocked gloo rank uses ~no CPU).

Importing this module sets the thread environment, so import it before torch.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # keep the profiler quiet
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")

import sys  # noqa: E402

# --malloc-tuned: rerun the script with glibc's malloc told to keep freed memory (as
# program.py's main() does with mallopt); spawned workers inherit it. Done here, before
# torch is imported, for every benchmark that imports this module.
MALLOC_TUNED = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}
if "--malloc-tuned" in sys.argv and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
    os.environ.update(MALLOC_TUNED)
    os.execv(sys.executable, [sys.executable] + sys.argv)

import json  # noqa: E402
import platform  # noqa: E402
import queue  # noqa: E402
import resource  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

PG_TIMEOUT_S = 60  # every process group's timeout (an emitted program's make_groups(PG_TIMEOUT_S))

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)


# --------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=PG_TIMEOUT_S))
        results.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def spawn(fn, world: int = 2, args: tuple = (), deadline_s: float = 150.0) -> list:
    """``fn(rank, world, *args)`` in ``world`` spawned gloo processes; per-rank results.

    Raises RuntimeError (a worker raised; its traceback is included) or TimeoutError (the
    deadline passed or a worker died silently; the workers are killed).
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, q), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline_s
    got, errors = {}, {}
    while len(got) + len(errors) < world and time.monotonic() < end:
        try:
            rank, ok, payload = q.get(timeout=1.0)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead and len(dead) + len(got) + len(errors) >= world:
                break
            continue
        (got if ok else errors)[rank] = payload
    for p in procs:
        p.join(timeout=max(0.1, min(5.0, end - time.monotonic())))
        if p.is_alive():
            p.kill()
            p.join(1)
    if errors:
        raise RuntimeError("worker failed:\n" + "\n".join(f"[rank {r}]\n{t}" for r, t in errors.items()))
    if len(got) < world:
        raise TimeoutError(f"{len(got)}/{world} workers reported before the deadline "
                           f"(exit codes {[p.exitcode for p in procs]})")
    return [got[r] for r in range(world)]


# ------------------------------------------------------------------------------ timing
def minflt() -> int:
    """Minor page faults of this process so far (all threads)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def interleaved(variants, warmup: int, rounds: int, per_round: int) -> dict:
    """Time ``variants`` side by side; returns name -> {"wall", "cpu", "faults"} per step.

    ``wall``: per step, the max over ranks of ``perf_counter`` around the step (seconds).
    ``cpu``: per step, the SUM over ranks of the process CPU time (``process_time``, all
    threads) the step used: the work the step put on the machine, which unlike wall time
    is not inflated when another process takes the core (useful on a shared machine;
    time spent blocked in gloo waiting for the peer costs ~no CPU).
    ``faults``: per step, the sum over ranks of minor page faults (fresh memory touched).
    ``variants``: list of ``(name, step, solo)``. ``solo=None``: every rank runs ``step``.
    ``solo=k``: rank 0 alone runs it with k intra-op threads while the others wait in a
    barrier. Every variant gets ``warmup`` untimed steps, then ``rounds`` rounds of
    ``per_round`` steps; odd rounds run the variants in reverse order.
    """
    rank = dist.get_rank()
    rec = {name: {"wall": [], "cpu": [], "faults": []} for name, _, _ in variants}

    def block(step, solo, n, out):
        dist.barrier()
        if solo is None or rank == 0:
            if solo is not None:
                torch.set_num_threads(solo)
            for _ in range(n):
                f0, c0, t0 = minflt(), time.process_time(), time.perf_counter()
                step()
                t1, c1, f1 = time.perf_counter(), time.process_time(), minflt()
                if out is not None:
                    out["wall"].append(t1 - t0)
                    out["cpu"].append(c1 - c0)
                    out["faults"].append(float(f1 - f0))
            if solo is not None:
                torch.set_num_threads(1)
        elif out is not None:
            for k in out:  # the max over ranks is rank 0's time; sums get 0 from this rank
                out[k].extend([0.0] * n)
        dist.barrier()

    for _, step, solo in variants:
        block(step, solo, warmup, None)
    for r in range(rounds):
        for name, step, solo in (variants if r % 2 == 0 else variants[::-1]):
            block(step, solo, per_round, rec[name])
    result = {}
    for name, _, _ in variants:
        result[name] = {}
        for k, op in (("wall", dist.ReduceOp.MAX), ("cpu", dist.ReduceOp.SUM), ("faults", dist.ReduceOp.SUM)):
            t = torch.tensor(rec[name][k], dtype=torch.float64)
            dist.all_reduce(t, op=op)
            result[name][k] = t.tolist()
    return result


def stats_ms(ts: list) -> dict:
    return {"median": statistics.median(ts) * 1e3, "min": min(ts) * 1e3, "max": max(ts) * 1e3,
            "n": len(ts)}


def median_s(fn, n: int = 3):
    """(median seconds over n calls of fn, min, max, last result)."""
    ts, out = [], None
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), min(ts), max(ts), out


# ------------------------------------------------------------------------- collectives
def count_collectives(step) -> dict:
    """Run ``step`` once under torch.profiler; count ProcessGroup calls (``c10d::*``) and
    what gloo ran (``gloo:*``), barriers excluded. Returns {"c10d": {...}, "gloo": {...}}."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    c10d, gloo = {}, {}
    for e in prof.events():
        for prefix, d in (("c10d::", c10d), ("gloo:", gloo)):
            if e.name.startswith(prefix):
                k = e.name[len(prefix):].strip("_")
                if k != "barrier":
                    d[k] = d.get(k, 0) + 1
    return {"c10d": c10d, "gloo": gloo}


def fmt_counts(d: dict) -> str:
    return ", ".join(f"{v} {k}" for k, v in sorted(d.items())) or "-"


# ------------------------------------------------------------------------------ output
def max_abs(a, b) -> float:
    return (a.detach().double() - b.detach().double()).abs().max().item()


def loadavg() -> str:
    """The 1/5/15-minute load averages (the machine may be shared: see the README)."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def env_line() -> str:
    return (f"python {platform.python_version()}, torch {torch.__version__}, "
            f"gloo={dist.is_gloo_available()}, cpus={os.cpu_count()}, 1 thread/process, "
            f"load avg {loadavg()}")


def _cell(v) -> str:
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) < 1e-3:
            return f"{v:.1e}"
        return f"{v:.1f}" if abs(v) >= 100 else f"{v:.3f}" if abs(v) < 10 else f"{v:.2f}"
    return str(v)


def print_table(title: str, cols: list, rows: list) -> None:
    """``cols``: list of (key, header); ``rows``: dicts. Uses rich when installed, else a
    markdown-style table (which is also what ``--plain`` forces)."""
    cells = [[_cell(r.get(k, "")) for k, _ in cols] for r in rows]
    if "--plain" not in sys.argv:
        try:
            from rich.console import Console
            from rich.table import Table

            t = Table(title=title, title_justify="left")
            for _, h in cols:
                t.add_column(h, justify="left")
            for c in cells:
                t.add_row(*c)
            Console(width=220).print(t)
            sys.stdout.flush()
            return
        except ImportError:
            pass
    table = [[h for _, h in cols]] + cells
    w = [max(len(r[i]) for r in table) for i in range(len(cols))]
    print(f"\n## {title}")
    for j, r in enumerate(table):
        print("| " + " | ".join(c.ljust(x) for c, x in zip(r, w)) + " |")
        if j == 0:
            print("|" + "|".join("-" * (x + 2) for x in w) + "|")
    sys.stdout.flush()


def arg_value(flag: str, default=None):
    """The value after ``flag`` on the command line, or ``default``."""
    if flag in sys.argv:
        i = sys.argv.index(flag)
        if i + 1 < len(sys.argv):
            return sys.argv[i + 1]
    return default


def dump_json(obj) -> None:
    path = arg_value("--json")
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1, default=str)
        print(f"(raw numbers written to {path})")
