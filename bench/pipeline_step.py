"""A 2-stage pipelined training step: parcomp's program.py vs torch.distributed.pipelining.

Model: ``specs/models.py:mlp_chain(blocks=4, hidden=H)`` cut after block 2 (modules 0-5 |
6-11); global batch (B, 8, H) in 4 microbatches of B/4; MSE loss; SGD(lr=0.01); 2 gloo ranks
(spawned processes, 1 thread each). Per schedule (GPipe, 1F1B; ZB-H1 and interleaved 1F1B
with 2 chunks per rank: parcomp only, measured bubble vs the report's estimate):

  parcomp   the program.py parcomp emits for ``mesh pp=2`` + the stage lines: its ``step``
            function (this rank's simulated action list: isend / blocking recv, microbatch
            gradients summed, scaled once, SGD update)
  torch     torch.distributed.pipelining: a ``PipelineStage`` over the same ``nn.Sequential``
            slice on each rank, ``ScheduleGPipe`` / ``Schedule1F1B`` with the same loss and
            microbatches, then ``torch.optim.SGD.step()``

Every step starts from the same weights (parcomp's step returns new weights; torch's updates
in place: the difference is one optimizer step of 8 small tensors). Reported: median ms per
step over ``--steps`` after 3 warm-up steps, parcomp / torch, the analytic bubble
(``(pp-1)/(m+pp-1)``; ZB-H1 ``(pp-1)/(3m+pp-1)``, interleaved ``(pp-1)/(vm+pp-1)``) and a measured one, ``1 - serial / (pp x step)``, where ``serial`` is the
unsharded step (forward, backward, SGD) of the whole model in one process: the fraction of
the two ranks' time not spent on the model's own compute (bubble plus p2p and overheads).

``--hidden H --batch B`` (default 32 and 8) scale the model and the batch: at the default the
unsharded step is ~1 ms and the measured bubble is p2p latency and Python overhead; at
``--hidden 256 --batch 32`` compute dominates and the measured bubble can be read against the
analytic one.

``--rounds R`` runs every schedule's parcomp and torch measurements R times, alternated, and
reports the median of each round's parcomp / torch ratio (on a shared machine whose load drifts
between two measurements a minute apart); ``--schedules 1f1b`` measures only the ones named.

Run:  .venv/bin/python bench/pipeline_step.py [--steps 20] [--hidden 32] [--batch 8] [--rounds 1]
      [--schedules gpipe,1f1b,zb-h1,interleaved]
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402,I001  (sets the thread environment before torch is imported)

import importlib.util  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

STEPS = int(C.arg_value("--steps", 20))
WARMUP, MICRO, BLOCKS = 3, 4, 4
HIDDEN = int(C.arg_value("--hidden", 32))  # --hidden 256 --batch 32: ~100x the compute per step
BATCH = int(C.arg_value("--batch", 8))  # a multiple of MICRO
CUT = 6  # modules 0-5 on stage 0, 6-11 on stage 1
ROUNDS = int(C.arg_value("--rounds", 1))  # parcomp and torch alternated, R times: a drifting load hits both
SCHEDULES = tuple(C.arg_value("--schedules", "gpipe,1f1b,zb-h1,interleaved").split(","))
if BATCH % MICRO:
    sys.exit(f"--batch {BATCH}: not a multiple of the {MICRO} microbatches")


def _models():
    spec = importlib.util.spec_from_file_location("bench_models", os.path.join(HERE, "..", "specs", "models.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _data():
    torch.manual_seed(3)
    return torch.randn(BATCH, 8, HIDDEN), torch.randn(BATCH, 8, HIDDEN)


def _timed(step, barrier=True) -> float:
    for _ in range(WARMUP):
        step()
    ts = []
    for _ in range(STEPS):
        if barrier:
            dist.barrier()
        t0 = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def parcomp_worker(rank, world, program_path):
    spec = importlib.util.spec_from_file_location("pipeline_program", program_path)
    prog = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prog)
    state = prog.setup(prog.TIMEOUT_S)  # (pp coordinate, dp coordinate, dp group, pp group)
    p = prog.load_params(_models().mlp_chain(BLOCKS, HIDDEN)[0].state_dict())  # this rank's chunks
    x, y = _data()
    data = {"x": x, "target": y}
    with torch.no_grad():
        return _timed(lambda: prog.step(1, state, p, data))


def torch_worker(rank, world, schedule):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    layers = list(_models().mlp_chain(BLOCKS, HIDDEN)[0])
    part = torch.nn.Sequential(*(layers[:CUT] if rank == 0 else layers[CUT:]))
    stage = PipelineStage(part, rank, world, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = cls(stage, n_microbatches=MICRO, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(part.parameters(), lr=0.01)
    x, y = _data()

    def step():
        opt.zero_grad()
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y)
        opt.step()

    return _timed(step)


def serial_ms() -> float:
    model = _models().mlp_chain(BLOCKS, HIDDEN)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = _data()

    def step():
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()

    return _timed(step, barrier=False)


def _program(schedule, work) -> str:
    from parcomp.compile.compiler import compile_graph
    from parcomp.frontends.torch.export import import_torch
    from parcomp.spec import parse_spec
    from parcomp_backends.torch import emit_program

    module, _, names = _models().mlp_chain(BLOCKS, HIDDEN)
    graph = import_torch(module, (_data()[0],), names)
    stages = "" if schedule == "interleaved" else f"stage 0: 0-{CUT - 1}\nstage 1: {CUT}-{3 * BLOCKS - 1}\n"
    spec = parse_spec(f"mesh pp=2\n{stages}"  # interleaved: 4 balanced chunks, 2 per rank
                      f"train loss=mse optimizer=sgd(lr=0.01) input_grads=no microbatches={MICRO} "
                      f"schedule={schedule}{' virtual=2' if schedule == 'interleaved' else ''}\n", "bench.pcs")
    path = os.path.join(work, f"program_{schedule}.py")
    with open(path, "w") as f:
        f.write(emit_program(compile_graph(graph, spec)))
    return path


def main():
    from parcomp.passes.pipeline.schedule import analytic

    torch.set_num_threads(1)
    serial = serial_ms()
    rows, runs = [], {}
    with tempfile.TemporaryDirectory(prefix="pcbench-pp-") as work:
        programs = {schedule: _program(schedule, work) for schedule in SCHEDULES}
        runs = {schedule: [] for schedule in SCHEDULES}
        for _ in range(ROUNDS):  # each round: parcomp then torch, back to back, per schedule
            for schedule in SCHEDULES:
                ours = max(C.spawn(parcomp_worker, 2, (programs[schedule],)))
                # torch.distributed.pipelining's ZB / interleaved schedules need several stages per
                # rank and other stage objects: parcomp's alone, measured against its estimate
                theirs = max(C.spawn(torch_worker, 2, (schedule,))) if schedule in ("gpipe", "1f1b") else float("nan")
                runs[schedule].append((ours, theirs))
        for schedule in SCHEDULES:
            ours = statistics.median(o for o, _ in runs[schedule])
            theirs = statistics.median(t for _, t in runs[schedule])
            ratio = statistics.median(o / t for o, t in runs[schedule])  # of each round's pair
            bubble = analytic(schedule, 2, MICRO, 2 if schedule == "interleaved" else 1)
            rows.append((schedule, ours, theirs, ratio, bubble,
                         1 - serial / (2 * ours), 1 - serial / (2 * theirs)))
    print(f"pipeline_step: mlp_chain({BLOCKS}), hidden {HIDDEN}, batch {BATCH} in {MICRO} microbatches, "
          f"pp=2 on 2 gloo ranks, median of {STEPS} steps, {ROUNDS} round(s) (ms: median over rounds; "
          f"parcomp/torch: median of each round's ratio); unsharded step in one process "
          f"{serial:.3f} ms; {C.loadavg()}")
    print("schedule  parcomp ms  torch ms  parcomp/torch  bubble analytic  measured parcomp  measured torch")
    for r in rows:
        print(f"{r[0]:8}  {r[1]:10.3f}  {r[2]:8.3f}  {r[3]:13.2f}  {r[4]:15.3f}  {r[5]:16.3f}  {r[6]:14.3f}")
    if ROUNDS > 1:
        for schedule in SCHEDULES:
            print(f"{schedule} rounds (parcomp ms / torch ms): "
                  + ", ".join(f"{o:.1f}/{t:.1f}" for o, t in runs[schedule]))


if __name__ == "__main__":
    main()
