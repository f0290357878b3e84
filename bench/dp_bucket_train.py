"""DP=2 training step on 2 gloo ranks: bucketed vs per-parameter dp gradient reduction.

Model: ``nn.Sequential`` of L Linear(h, h) layers with ReLU between (2L parameters), x and a
fixed target of shape (B, h), fp32, MSE loss (mean), SGD lr=0.01. The spec is data parallel
(``mesh dp=2``, ``input x split-seq``; every activation pinned split over dp, so the step is
DDP's: local forward and backward, gradients all-reduced over dp).

Variants, all timed in ONE ``torch.multiprocessing`` spawn of 2 gloo ranks, interleaved
(rounds of k steps per variant, the order reversed every other round; ``_common.py``):

  parcomp-bucketed   program.py for the spec (``bucket_cap_mb`` at its default, 25 MiB):
                     one flat all_reduce per bucket, started as soon as its last gradient
                     exists, waited for before the optimizer
  parcomp-per-param  program.py for the spec plus ``bucket_cap_mb=0``: one all_reduce per
                     parameter (what parcomp emitted before gradient buckets)
  ddp                hand-written torch: ``DistributedDataParallel`` (gloo, bucket_cap_mb=25),
                     ``F.mse_loss`` on the local half of the batch, ``torch.optim.SGD``

Each step reads the loss (``.item()``). Printed: per-step wall time (max over ranks; median,
min, max), CPU time summed over ranks, collectives counted with torch.profiler on one
untimed step (DDP's: its reducer's bucket count, since it calls gloo from C++, unseen by
the profiler), and the ratios parcomp per-param / bucketed and parcomp bucketed / DDP.
Correctness: one step of every variant from the same weights is compared with DDP's (max
abs difference of the updated parameters, worst over ranks).

Run:  .venv/bin/python bench/dp_bucket_train.py [--quick] [--layers 8] [--hidden 256] [--batch 64]
          [--json out.json] [--plain]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402,I001  (sets the thread environment before torch is imported)

import copy  # noqa: E402
import importlib.util  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

QUICK = "--quick" in sys.argv
L = int(C.arg_value("--layers", "8"))
H = int(C.arg_value("--hidden", "256"))
B = int(C.arg_value("--batch", "64"))
LR = 0.01
WARMUP, ROUNDS, PER_ROUND = (1, 3, 3) if QUICK else (2, 8, 5)
VARIANTS = ["parcomp-bucketed", "parcomp-per-param", "ddp"]


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for i in range(L):
        layers += [nn.Linear(H, H)] + ([nn.ReLU()] if i < L - 1 else [])
    return nn.Sequential(*layers)


def make_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, H, generator=g), torch.randn(B, H, generator=g)


def spec_text(extra: str) -> str:
    """The data-parallel spec: every forward value pinned split over dp (torch.export's names)."""
    lin = ["linear"] + [f"linear_{i}" for i in range(1, L - 1)]
    relu = ["relu"] + [f"relu_{i}" for i in range(1, L - 1)]
    pins = "".join(f"activation {n} split-seq\n" for n in lin + [f"{n}_mm" for n in lin] + relu)
    return (f"mesh dp=2\ninput x split-seq\n{pins}output output split-seq\n"
            f"train loss=mse optimizer=sgd(lr={LR}) input_grads=no {extra}\n")


def emit(directory: str) -> dict:
    """Write program_bucketed.py / program_per_param.py; return their compile reports."""
    from parcomp.compile.compiler import compile_graph
    from parcomp.frontends.torch.export import import_torch
    from parcomp.spec import parse_spec
    from parcomp_backends.torch import emit_program

    x, _ = make_data()
    graph = import_torch(build_model(), (x,), ["x"])
    reports = {}
    for name, extra in (("bucketed", ""), ("per_param", "bucket_cap_mb=0")):
        c = compile_graph(graph, parse_spec(spec_text(extra), f"dp_bucket_{name}.pcs"))
        with open(os.path.join(directory, f"program_{name}.py"), "w", encoding="utf-8") as f:
            f.write(emit_program(c, "cpu", f"bench/dp_bucket_train.py ({name})"))
        reports[name] = c.report
    return reports


def load_program(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.make_groups(C.PG_TIMEOUT_S)
    return mod


class ParcompStep:
    """The emitted train_step, carried values fed back like program.py's own train() loop."""

    def __init__(self, prog, sd, x, target):
        self.prog, self.params = prog, prog.load_params(sd)
        self.inputs = prog.load_inputs({"x": x, "target": target})

    def __call__(self):
        with torch.no_grad():
            out = self.prog.train_step(self.params, self.inputs)
            self.params = {**self.params, **{n: out[n] for n in self.prog.CARRIED}}
        return out["loss"].item()

    def weights(self):
        return {n: self.params[n].detach() for n in sorted(self.params) if "." in n and "grad" not in n}


class DDPStep:
    """DistributedDataParallel + F.mse_loss on this rank's half of the batch + torch.optim.SGD."""

    def __init__(self, model, x, target, rank, world, cap_mb):
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.model = DDP(model, bucket_cap_mb=cap_mb)
        self.x, self.target = x.chunk(world)[rank], target.chunk(world)[rank]
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)

    def __call__(self):
        self.opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(self.model(self.x), self.target)
        loss.backward()
        self.opt.step()
        return loss.item()  # the local half's loss (DDP averages the gradients, not the loss)

    def weights(self):
        return {n: p.detach() for n, p in sorted(self.model.module.named_parameters())}


def worker(rank, world, directory):
    x, target = make_data()
    model = build_model()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    progs = {v: load_program(os.path.join(directory, f"program_{v.split('-', 1)[1].replace('-', '_')}.py"),
                             f"prog_{v}") for v in VARIANTS[:2]}

    def make(v):
        if v.startswith("parcomp"):
            return ParcompStep(progs[v], sd, x, target)
        return DDPStep(copy.deepcopy(model), x, target, rank, world, 25)

    # correctness: one step of each from the same weights, updated params compared
    fresh = {v: make(v) for v in VARIANTS}
    for v in VARIANTS:
        fresh[v]()
    ref = fresh["ddp"].weights()
    diff = {v: max(C.max_abs(fresh[v].weights()[n], ref[n]) for n in ref) for v in VARIANTS}
    steps = {v: make(v) for v in VARIANTS}
    counts = {v: C.count_collectives(steps[v])["c10d"] for v in VARIANTS}
    for v in ("ddp",):  # DDP's reducer calls gloo from C++, unseen by the profiler: one per bucket
        counts[v] = {"allreduce (DDP buckets)": len(steps[v].model.reducer._get_zeros_like_grad_buckets())}
    times = C.interleaved([(v, steps[v], None) for v in VARIANTS], WARMUP, ROUNDS, PER_ROUND)
    return {"diff": diff, "counts": counts, "times": times}


def main():
    print(C.env_line())
    print(f"model: {L} x Linear({H}, {H}) + ReLU, batch {B} (split over dp=2), fp32, MSE, SGD lr={LR}")
    with tempfile.TemporaryDirectory() as d:
        reports = emit(d)
        results = C.spawn(worker, 2, (d,), deadline_s=600)
    gb = reports["bucketed"]["grad_buckets"]
    print(f"parcomp's decision: {gb['decision']}; "
          + "; ".join(f"{b['all_reduce']}: {len(b['members'])} gradients, {b['bytes_per_rank']} bytes"
                      for b in gb["buckets"]))
    if gb["buckets"]:
        print(f"  why: {gb['buckets'][0]['reason']}")
    times = results[0]["times"]
    rows, med = [], {}
    for v in VARIANTS:
        s = C.stats_ms(times[v]["wall"])
        med[v] = s["median"]
        cpu = statistics.median(times[v]["cpu"]) * 1e3
        diff = max(r["diff"][v] for r in results)
        rows.append({"variant": v, "median": s["median"], "min": s["min"], "max": s["max"], "cpu": cpu,
                     "colls": C.fmt_counts(results[0]["counts"][v]), "diff": diff})
    C.print_table("dp=2 training step (ms per step, wall = max over ranks)",
                  [("variant", "variant"), ("median", "median ms"), ("min", "min"), ("max", "max"),
                   ("cpu", "cpu ms (sum of ranks)"), ("colls", "collectives / step"),
                   ("diff", "max |param - ddp's| after 1 step")], rows)
    cpu = {r["variant"]: r["cpu"] for r in rows}
    ratios = {}
    for k, (a, b) in {"parcomp per-param / bucketed": ("parcomp-per-param", "parcomp-bucketed"),
                      "parcomp bucketed / ddp": ("parcomp-bucketed", "ddp")}.items():
        ratios[k] = {"wall": med[a] / med[b], "cpu": cpu[a] / cpu[b]}
        print(f"ratio {k}: {ratios[k]['wall']:.2f} (median wall), {ratios[k]['cpu']:.2f} (median cpu)")
    C.dump_json({"layers": L, "hidden": H, "batch": B, "ratios": ratios, "rows": rows,
                 "grad_buckets": gb, "times": times})


if __name__ == "__main__":
    main()
