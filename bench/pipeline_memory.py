"""Peak memory per rank of a pipelined program.py against the tp=2 program of the same model.

Model: ``specs/models.py:mlp_chain(2, H)``, two blocks of (Linear(H, 4H), GELU, Linear(4H, H)),
fp32: at the default H=2048, 256 MiB of parameters.  Two specs, both 2 gloo ranks, SGD, MSE:

  pp=2   ``mesh pp=2``, block 0 on stage 0, block 1 on stage 1, 1F1B, 2 microbatches
  tp=2   ``mesh tp=2``, each block's first Linear colwise and second rowwise (Megatron)

Either holds half of the weights per rank.  Each program.py is compiled here, then run
under torchrun on a .safetensors checkpoint of the model (``--steps 3``); a launcher records
each rank's peak resident memory (``ru_maxrss``) as the program exits.  Printed: each rank's
peak, the peak of a process that only imports torch and joins a gloo group (the floor every
rank pays), and the ratio pp/tp of the worst rank, raw and above that floor.

Run:  .venv/bin/python bench/pipeline_memory.py [--hidden 2048] [--steps 3]
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402,I001  (sets the thread environment before torch is imported)

import importlib.util  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402

HIDDEN = int(C.arg_value("--hidden", 2048))
STEPS = int(C.arg_value("--steps", 3))
BATCH = 4  # rows of x: f32[4, 8, H], 2 microbatches of 2 under pp

# runs program.py (or, with FLOOR set, only torch + a gloo group) and writes this rank's peak
# resident memory to PEAK.rank{r}.json when it leaves (program.py leaves through os._exit)
LAUNCHER = """\
import json, os, resource, runpy, sys
def record():
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(os.environ["PEAK"] + ".rank" + os.environ["RANK"] + ".json", "w") as f:
        json.dump({"rank": int(os.environ["RANK"]), "peak_rss_bytes": peak}, f)
if os.environ.get("FLOOR"):
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    dist.barrier()
    dist.destroy_process_group()
    record()
    sys.exit(0)
exit_now = os._exit
def leave(code):
    record()
    exit_now(code)
os._exit = leave
sys.argv[0] = "program.py"
runpy.run_path("program.py", run_name="__main__")
"""


def _models():
    spec = importlib.util.spec_from_file_location("bench_models", os.path.join(HERE, "..", "specs", "models.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SPECS = {
    "pp=2": "mesh pp=2\nstage 0: 0-2\nstage 1: 3-5\n"
            "train loss=mse optimizer=sgd(lr=0.01) input_grads=no microbatches=2 schedule=1f1b\n",
    "tp=2": "mesh tp=2\n0.weight colwise\n2.weight rowwise\n3.weight colwise\n5.weight rowwise\n"
            "input x replicated\ntrain loss=mse optimizer=sgd(lr=0.01) input_grads=no\n",
}


def _write(work, name, graph):
    from parcomp.compile.compiler import compile_graph
    from parcomp.spec import parse_spec
    from parcomp_backends.torch import emit_program

    d = os.path.join(work, name.replace("=", ""))
    os.makedirs(d)
    with open(os.path.join(d, "program.py"), "w") as f:
        f.write(emit_program(compile_graph(graph, parse_spec(SPECS[name], "bench.pcs"))))
    with open(os.path.join(d, "launch.py"), "w") as f:
        f.write(LAUNCHER)
    return d


def _peaks(d, ckpt, inputs, env=None) -> list:
    from parcomp_backends.torch.launch import run_torchrun

    peak = os.path.join(d, "peak")
    res = run_torchrun(d, 2, ckpt, inputs, os.path.join(d, "out.pt"), ("--steps", STEPS), timeout=900,
                       program="launch.py", env={"PEAK": peak, **(env or {})})
    if res.returncode != 0:
        sys.exit(f"{d}: the program failed:\n{res.stdout[-2000:]}{res.stderr[-4000:]}")
    return [json.load(open(f"{peak}.rank{r}.json"))["peak_rss_bytes"] for r in range(2)]


def main():
    from safetensors.torch import save_file

    from parcomp.frontends.torch.export import import_torch

    module = _models().mlp_chain(2, HIDDEN)[0]
    x = torch.randn(BATCH, 8, HIDDEN)
    graph = import_torch(module, (x,), ["x"])
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    mib = 1 << 20
    with tempfile.TemporaryDirectory(prefix="pcbench-ppmem-") as work:
        ckpt = os.path.join(work, "model.safetensors")
        save_file({k: v.contiguous() for k, v in module.state_dict().items()}, ckpt)
        inputs = os.path.join(work, "inputs.pt")
        torch.save({"x": x, "target": torch.randn(BATCH, 8, HIDDEN)}, inputs)
        del module
        dirs = {name: _write(work, name, graph) for name in SPECS}
        floor = max(_peaks(dirs["tp=2"], ckpt, inputs, {"FLOOR": "1"}))
        peaks = {name: _peaks(d, ckpt, inputs) for name, d in dirs.items()}
    print(f"pipeline_memory: mlp_chain(2, {HIDDEN}), {params / mib:.0f} MiB of fp32 params, "
          f"x f32[{BATCH},8,{HIDDEN}], SGD, {STEPS} steps on 2 gloo ranks; {C.loadavg()}")
    print(f"floor (torch + a gloo group, no model): {floor / mib:.0f} MiB per rank")
    for name, ps in peaks.items():
        print(f"{name}: peak RSS per rank {', '.join(f'{p / mib:.0f}' for p in ps)} MiB; "
              f"above the floor {', '.join(f'{(p - floor) / mib:.0f}' for p in ps)} MiB")
    pp, tp = max(peaks["pp=2"]), max(peaks["tp=2"])
    print(f"pp=2 / tp=2, worst rank: {pp / tp:.2f}x raw, {(pp - floor) / max(tp - floor, 1):.2f}x above "
          f"the floor (target: within ~1.3x)")


if __name__ == "__main__":
    main()
