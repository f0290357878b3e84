"""Megatron MLP forward step, TP=2 on 2 gloo ranks: parcomp's emitted program vs its peers.

Model: ``nn.Sequential(Linear(h, 4h), GELU(), Linear(4h, h))`` with biases, input x of
shape (8, 128, h), fp32, forward only (``torch.no_grad()``), h in {256, 1024}.

Variants, all timed in ONE ``torch.multiprocessing`` spawn of 2 gloo ranks, interleaved
(rounds of k steps per variant, the order reversed every other round):

  parcomp      the program.py that parcomp emits for the spec
               ``mesh tp=2 / 0.weight colwise / 2.weight rowwise``; it is imported as a
               module inside the worker: ``make_groups()``, ``load_params(state_dict)``,
               ``load_inputs({"x": x})``, then ``forward(params, inputs)`` is the step
               (exactly the function its own ``--bench`` times)
  dtensor      ``parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})``
  hand         hand-written torch.distributed Megatron: column shard of W1/b1, row shard of
               W2, ``F.linear`` on the shards, in-place ``dist.all_reduce``, b2 after the reduce
  ref-1t       the unsharded module in one process with 1 thread (rank 0 runs it while
               rank 1 waits in a barrier)
Diagnostic variants (not products; they explain where parcomp's time goes):
  ref-2t       the unsharded module with 2 intra-op threads (what one process gets from 2 cores)
  hand-nocomm  hand's local compute with the all_reduce skipped (wrong numbers: compute floor)
  hand-mm      hand with parcomp's op sequence: ``torch.matmul(x, W.t())`` + separate bias
               add, ``clone()`` then in-place all_reduce, out-of-place ``+ b2``
  parcomp-ar0  the same emitted program with its runtime ``all_reduce`` replaced by an
               in-place one (no defensive clone); everything else unchanged

All variants run under ``torch.no_grad()`` (the program's own ``main`` uses
``torch.inference_mode()``; the ``--torchrun`` check below runs it that way). Every step
reads one element of its output, so DTensor's asynchronous collective
(AsyncCollectiveTensor) is waited on inside the step. Each step's wall time is the max over
the two ranks; the "CPU ms" column is the process CPU time the step used, summed over the
ranks (not inflated when another process takes the core, so more robust on a shared
machine; time blocked in gloo costs ~no CPU). Correctness: every variant's output is compared with the unsharded
module's output on every rank (max abs error, worst over ranks). One extra untimed step
per TP variant runs under torch.profiler to count the ProcessGroup calls.

Page faults: every step also records the minor page faults it caused (sum over ranks). With
glibc's default malloc, large temporaries (>= 128 KiB, dynamically raised) are mmap'd and
returned to the OS when freed, so a step that allocates more temporaries pays kernel time
for fresh zeroed pages; ``--malloc-tuned`` reruns everything with
``MALLOC_MMAP_THRESHOLD_=32MiB MALLOC_TRIM_THRESHOLD_=256MiB`` to show the numbers without it.

A second table ("emitted-code pieces") times, in the parent process with 1 thread and no
communication, the emitted ``forward`` (its ``all_reduce`` replaced by just its clone, or by
nothing) next to the hand-written local compute and the individual ops the emitter uses
vs. the ones hand-written code uses (min over interleaved calls, page faults per call).

With ``--torchrun`` (default in the full run, off with ``--quick``) the emitted program is
ALSO launched on its own with ``torchrun ... --bench N`` (a separate launch, its own
process group, a barrier before every step), to check that the in-process number matches
what the program reports about itself.

Run:  .venv/bin/python bench/tp_mlp.py [--quick] [--json out.json] [--no-torchrun] [--plain] [--malloc-tuned]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402,I001  (sets the thread environment before torch is imported)

import copy  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

B, S = 8, 128
QUICK = "--quick" in sys.argv
HIDDENS = [256] if QUICK else [256, 1024]
WARMUP = 1 if QUICK else 3
ROUNDS = {256: (2, 3)} if QUICK else {256: (10, 5), 1024: (5, 4)}  # (rounds, steps/round)
TORCHRUN = ("--torchrun" in sys.argv) or (not QUICK and "--no-torchrun" not in sys.argv)
TORCHRUN_STEPS = {256: 30, 1024: 10}
MICRO_REPS = {256: 15} if QUICK else {256: 60, 1024: 20}
SPEC = """\
mesh tp=2
0.weight  colwise     # Linear(h, 4h): column parallel, 0.bias follows
2.weight  rowwise     # Linear(4h, h): row parallel, partial sums, 2.bias after the sum
input  x      replicated
output output replicated
"""
MAIN = ["parcomp", "dtensor", "hand", "ref-1t"]
DIAG = ["ref-2t", "hand-nocomm", "hand-mm", "parcomp-ar0"]


def build_model(h: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)).eval()


def make_input(h: int) -> torch.Tensor:
    return torch.randn(B, S, h, generator=torch.Generator().manual_seed(1))


def emit(h: int, directory: str) -> tuple:
    """Compile the h-MLP under SPEC; write program.py; return (path, compile report)."""
    from parcomp.compile.compiler import compile_graph
    from parcomp.frontends.torch.export import import_torch
    from parcomp.spec import parse_spec
    from parcomp_backends.torch import emit_program

    model = build_model(h)
    graph = import_torch(model, (make_input(h),), ["x"])
    compiled = compile_graph(graph, parse_spec(SPEC, "tp_mlp.pcs"))
    path = os.path.join(directory, "program.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(emit_program(compiled, "cpu", f"bench/tp_mlp.py h={h}"))
    return path, compiled.report


def import_program(path: str, name: str):
    """Import an emitted program.py as a module (RANK/WORLD_SIZE are already in os.environ)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.make_groups(C.PG_TIMEOUT_S)  # collective: every rank creates the program's groups in the same order
    return mod


# ------------------------------------------------------------------- hand-written Megatron
def hand_shards(model, rank, world):
    n = model[0].out_features // world
    sl = slice(rank * n, (rank + 1) * n)
    return (model[0].weight.detach()[sl].clone(), model[0].bias.detach()[sl].clone(),
            model[2].weight.detach()[:, sl].contiguous(), model[2].bias.detach().clone())


def hand_forward(x, w1, b1, w2, b2, comm=True):
    y = F.linear(F.gelu(F.linear(x, w1, b1)), w2)
    if comm:
        dist.all_reduce(y)  # y is a fresh buffer: reduce in place
    return y.add_(b2)


def hand_mm_forward(x, w1, b1, w2, b2):
    """The op sequence parcomp emits, written by hand (diagnostic)."""
    a = torch.nn.functional.gelu(torch.matmul(x, w1.permute(1, 0)) + b1)
    y = torch.matmul(a, w2.permute(1, 0)).clone(memory_format=torch.contiguous_format)
    dist.all_reduce(y)
    return y + b2


def worker(rank, world, h, program_path, rounds, per_round, warmup):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)  # forward only, every variant
    ref = build_model(h)
    x = make_input(h)
    y_ref = ref(x)

    # (a) parcomp: the emitted program, imported twice (the second copy is patched: parcomp-ar0)
    prog = import_program(program_path, f"parcomp_program_h{h}")
    params = prog.load_params(ref.state_dict())
    inputs = prog.load_inputs({"x": x})
    prog0 = import_program(program_path, f"parcomp_program_h{h}_ar0")

    def all_reduce_inplace(t, axis):
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=prog0.GROUPS[axis])
        return t

    prog0.all_reduce = all_reduce_inplace
    params0, inputs0 = prog0.load_params(ref.state_dict()), prog0.load_inputs({"x": x})

    # (b) DTensor
    mesh = init_device_mesh("cpu", (world,))
    dt = parallelize_module(copy.deepcopy(ref), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    # (c) hand-written
    shards = hand_shards(ref, rank, world)

    def touch(y):
        y.reshape(-1)[0].item()  # reads the output: forces DTensor's AsyncCollectiveTensor wait
        return y

    fns = {
        "parcomp": lambda: touch(prog.forward(params, inputs)["output"]),
        "dtensor": lambda: touch(dt(x)),
        "hand": lambda: touch(hand_forward(x, *shards)),
        "ref-1t": lambda: touch(ref(x)),
        "ref-2t": lambda: touch(ref(x)),
        "hand-nocomm": lambda: touch(hand_forward(x, *shards, comm=False)),
        "hand-mm": lambda: touch(hand_mm_forward(x, *shards)),
        "parcomp-ar0": lambda: touch(prog0.forward(params0, inputs0)["output"]),
    }
    solo = {"ref-1t": 1, "ref-2t": 2}

    out = {}
    for name, fn in fns.items():
        y = fn()
        y = y.wait() if hasattr(y, "wait") else y
        y = y.full_tensor() if hasattr(y, "full_tensor") else y
        out[name] = {"err": C.max_abs(y, y_ref) if name != "hand-nocomm" else float("nan")}
    for name in ("parcomp", "dtensor", "hand", "hand-mm", "parcomp-ar0"):
        out[name]["coll"] = C.count_collectives(fns[name])

    times = C.interleaved([(n, fns[n], solo.get(n)) for n in MAIN + DIAG], warmup, rounds, per_round)
    for name, ts in times.items():
        out[name]["time"] = C.stats_ms(ts["wall"])
        out[name]["cpu"] = C.stats_ms(ts["cpu"])
        out[name]["raw_ms"] = [t * 1e3 for t in ts["wall"]]
        out[name]["raw_cpu_ms"] = [t * 1e3 for t in ts["cpu"]]
        out[name]["faults"] = statistics.median(ts["faults"])
    return out


def micro(h: int, program_path: str, reps: int) -> dict:
    """Single-process, 1-thread costs of the pieces of the emitted forward (no communication).

    Runs in the parent: the emitted program is imported (no process group; its
    ``all_reduce`` is replaced by what it does locally: the defensive clone, or nothing),
    next to hand-written equivalents and the individual ops. Interleaved, one call per
    variant per round; min and median. The min is robust to other load on the machine.
    """
    import time as _t

    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    ref, x = build_model(h), make_input(h)
    w1, b1, w2, b2 = hand_shards(ref, 0, 2)
    spec = importlib.util.spec_from_file_location(f"parcomp_program_h{h}_micro", program_path)
    prog = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prog)
    params, inputs = prog.load_params(ref.state_dict()), prog.load_inputs({"x": x})
    a = F.gelu(F.linear(x, w1, b1))
    y = F.linear(a, w2)

    def emitted(clone):
        prog.all_reduce = ((lambda t, axis: t.clone(memory_format=torch.contiguous_format)) if clone
                           else (lambda t, axis: t))
        prog.all_reduce_ = prog.all_reduce  # the in-place variant (emitted for unshared values)
        return lambda: prog.forward(params, inputs)

    cases = [
        ("emitted forward, all_reduce = its clone only", emitted(True)),
        ("emitted forward, all_reduce = nothing", emitted(False)),
        ("hand forward (F.linear, add_), no comm", lambda: hand_forward(x, w1, b1, w2, b2, comm=False)),
        ("  y.clone() [8,128,h] (all_reduce's copy)", lambda: y.clone(memory_format=torch.contiguous_format)),
        ("  torch.matmul(x, W1.permute(1,0)) + b1 (emitted)", lambda: torch.matmul(x, w1.permute(1, 0)) + b1),
        ("  F.linear(x, W1, b1) (fused bias)", lambda: F.linear(x, w1, b1)),
        ("  torch.matmul(a, W2.permute(1,0)) (emitted)", lambda: torch.matmul(a, w2.permute(1, 0))),
        ("  F.linear(a, W2)", lambda: F.linear(a, w2)),
        ("  y + b2 (emitted, new tensor)", lambda: y + b2),
        ("  y.add_(b2) (in place)", lambda: y.add_(b2)),
    ]
    ts = {name: [] for name, _ in cases}
    faults = {name: [] for name, _ in cases}
    for fn in (f for _, f in cases):
        fn()
    for r in range(reps):
        for name, fn in (cases if r % 2 == 0 else cases[::-1]):
            f0, t0 = C.minflt(), _t.perf_counter()
            fn()
            ts[name].append(_t.perf_counter() - t0)
            faults[name].append(C.minflt() - f0)
    return {name: dict(C.stats_ms(v), faults=statistics.median(faults[name])) for name, v in ts.items()}


def torchrun_bench(h: int, directory: str, program_path: str, steps: int) -> dict:
    """The emitted program launched by torchrun with --bench (separate launch)."""
    from parcomp_backends.torch import run_torchrun, write_checkpoint, write_inputs

    ckpt = write_checkpoint(build_model(h), os.path.join(directory, "model.pt"))
    xin = write_inputs({"x": make_input(h)}, os.path.join(directory, "x.pt"))
    t0 = time.perf_counter()
    proc = run_torchrun(directory, 2, checkpoint=ckpt, inputs=xin, program=os.path.basename(program_path),
                        extra_args=("--device", "cpu", "--bench", str(steps)), timeout=120,
                        env={"MKL_NUM_THREADS": "1"})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"error": f"rc={proc.returncode}: {proc.stderr.strip()[-500:]}"}
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
    ts = [t / 1e3 for t in json.loads(line)["step_ms"]]
    return {"time": C.stats_ms(ts), "raw_ms": [t * 1e3 for t in ts], "launch_wall_s": wall}


def main():
    t_start = time.perf_counter()
    malloc = ", ".join(f"{k}={os.environ[k]}" for k in C.MALLOC_TUNED if k in os.environ) or "glibc defaults"
    print(f"tp_mlp: Linear(h,4h)+GELU+Linear(4h,h), x {B}x{S}xh, fp32, forward only, TP=2 on gloo; "
          f"{C.env_line()}; malloc: {malloc}")
    results, rows = {"_env": {"loadavg_start": C.loadavg(), "malloc": malloc}}, []
    for h in HIDDENS:
        with tempfile.TemporaryDirectory(prefix=f"tp_mlp_h{h}_") as tmp:
            t0 = time.perf_counter()
            path, report = emit(h, tmp)
            compile_s = time.perf_counter() - t0
            rounds, per_round = ROUNDS[h]
            per_rank = C.spawn(worker, 2, (h, path, rounds, per_round, WARMUP), deadline_s=170)
            res = per_rank[0]
            for name in res:  # errors: worst over ranks (times are already max over ranks)
                res[name]["err"] = max(pr[name]["err"] for pr in per_rank)
            res["_compile_s"] = compile_s
            res["_collectives_in_report"] = [(r["kind"], r["axis"], r["bytes"]) for r in report["collectives"]]
            if TORCHRUN:
                res["parcomp-torchrun"] = torchrun_bench(h, tmp, path, TORCHRUN_STEPS[h])
            res["_micro"] = micro(h, path, MICRO_REPS[h])
        results[h] = res
        base = res["ref-1t"]["time"]["median"]
        for name in MAIN + DIAG + (["parcomp-torchrun"] if TORCHRUN else []):
            d = res[name]
            if "error" in d:
                rows.append({"h": h, "variant": name, "median": d["error"]})
                continue
            t = d["time"]
            rows.append({
                "h": h, "variant": name + (" (diag)" if name in DIAG else ""),
                "median": t["median"], "min": t["min"], "max": t["max"], "n": t["n"],
                "x_ref": t["median"] / base, "x_parcomp": res["parcomp"]["time"]["median"] / t["median"],
                "cpu": d["cpu"]["median"] if "cpu" in d else "-",
                "cpu_x": (res["parcomp"]["cpu"]["median"] / d["cpu"]["median"]) if "cpu" in d else "-",
                "faults": int(d["faults"]) if "faults" in d else "-",
                "coll": C.fmt_counts(d["coll"]["c10d"]) if "coll" in d else "-",
                "err": d.get("err", "-") if name != "parcomp-torchrun" else "(separate launch)",
            })
        print(f"  h={h} done ({time.perf_counter() - t_start:.0f} s so far)", flush=True)

    C.print_table(
        "tp_mlp forward step, ms (per step: max over the 2 ranks; interleaved in one run)",
        [("h", "h"), ("variant", "variant"), ("median", "median ms"), ("min", "min"), ("max", "max"),
         ("n", "n"), ("x_ref", "x ref-1t"), ("x_parcomp", "parcomp / this"),
         ("cpu", "CPU ms (sum of ranks)"), ("cpu_x", "parcomp / this (CPU)"),
         ("faults", "page faults/step"),
         ("coll", "c10d calls/step"), ("err", "max|err| vs unsharded")],
        rows)
    mrows = []
    for h in HIDDENS:
        mic = results[h]["_micro"]
        base = mic["emitted forward, all_reduce = its clone only"]
        for name, t in mic.items():
            mrows.append({"h": h, "what": name, "min": t["min"], "median": t["median"], "n": t["n"],
                          "faults": int(t["faults"]),
                          "dmin": t["min"] - base["min"] if not name.startswith("  ") else ""})
    C.print_table(
        "emitted-code pieces, single process, 1 thread, no communication (ms; interleaved)",
        [("h", "h"), ("what", "what"), ("min", "min ms"), ("median", "median ms"), ("n", "n"),
         ("dmin", "min - emitted(clone) min"), ("faults", "page faults/call")],
        mrows)
    print()
    for h in HIDDENS:
        r = results[h]
        for metric, stat, unit in (("time", "median", "wall median, max over ranks"),
                                   ("time", "min", "wall min, max over ranks"),
                                   ("cpu", "median", "CPU median, sum over ranks")):
            m = {k: v[metric][stat] for k, v in r.items() if isinstance(v, dict) and metric in v}
            line = (f"h={h} [{unit}]: parcomp/dtensor = {m['parcomp'] / m['dtensor']:.3f}, "
                    f"parcomp/hand = {m['parcomp'] / m['hand']:.3f}, "
                    f"parcomp/ref-1t = {m['parcomp'] / m['ref-1t']:.3f}, "
                    f"dtensor/hand = {m['dtensor'] / m['hand']:.3f}; "
                    f"parcomp - hand = {m['parcomp'] - m['hand']:+.2f} ms, "
                    f"parcomp - parcomp-ar0 (the clone) = {m['parcomp'] - m['parcomp-ar0']:+.2f} ms, "
                    f"hand-mm - hand = {m['hand-mm'] - m['hand']:+.2f} ms, "
                    f"hand - hand-nocomm = {m['hand'] - m['hand-nocomm']:+.2f} ms")
            if "parcomp-torchrun" in m:
                line += f"; torchrun --bench {stat} {m['parcomp-torchrun']:.2f} ms"
            print(line)
        print(f"       compile+emit {r['_compile_s']:.2f} s; report collectives: {r['_collectives_in_report']}")
    print(f"total {time.perf_counter() - t_start:.0f} s; load avg at the end {C.loadavg()}")
    results["_env"]["loadavg_end"] = C.loadavg()
    C.dump_json(results)


if __name__ == "__main__":
    main()
