"""One MoE layer (8 experts, top-2) training step: the dropless program against the dense slot buffer.

Model: ``specs/models.py:moe_block`` (Mixtral's block through parcomp's MoE ops) with 8
experts, top-2, hidden ``--hidden`` (256), expert intermediate ``--inter`` (512), x of shape
(``--batch`` 8, ``--seq`` 128, hidden), fp32, MSE loss against zeros, SGD lr=0.1. Both
variants are program.py's ``train_step`` of the same layer, world size 1 (``mesh ep=1``),
imported as modules into this one process (1 intra-op thread):

  dropless   the default spec (no ``moe`` line): the routed tokens packed and sorted by
             expert, one matmul per expert over exactly its count (backends/torch/emit/moe_dropless.py)
  dense      the same spec plus ``moe capacity_factor=4`` (= E/k: the capacity is the row's
             tokens, nothing dropped, so the same function): the [B, E, C, H] slot buffer,
             every expert computing every slot, as program.py did without a capacity before

Printed: matmul FLOPs of one step (torch's FlopCounterMode; the router's included) and the
bytes of the dispatch buffers (what ``moe_dispatch`` / ``moe_pack`` return, the tokens
forward and their gradients backward), each over the routed work (18 H F FLOPs per routed
(token, expert) pair: 3 matmuls forward, 6 backward; H floats per pair per dispatch); the
step time of both, timed interleaved in this run (rounds of k steps, the order reversed every
other round; median, min, max), and dense / dropless. Correctness: the two steps' loss and
gradients from the same weights (max abs difference).

Run:  .venv/bin/python bench/moe_layer.py [--quick] [--hidden 256] [--inter 512] [--batch 8] [--seq 128]
          [--json out.json] [--plain]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402,I001  (sets the thread environment before torch is imported)

import importlib.util  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "specs"))

from parcomp.compile.compiler import compile_graph  # noqa: E402
from parcomp.frontends.torch.export import import_torch  # noqa: E402
from parcomp.spec import parse_spec  # noqa: E402
from parcomp_backends.torch.emit import emit_program  # noqa: E402

import models  # noqa: E402

EXPERTS, TOP_K = 8, 2
SPEC = "mesh ep=1\nexperts.* ep=S(0)\ninput x ep=S(0)\n{moe}train loss=mse optimizer=sgd(lr=0.1) batch={batch}\n"


def _program(graph, spec_text, folder, name):
    text = emit_program(compile_graph(graph, parse_spec(spec_text, f"{name}.pcs")), "cpu")
    path = os.path.join(folder, f"{name}.py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location(f"moe_layer_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _step(mod, params, x, target):
    return mod.train_step({k: v.clone() for k, v in params.items()}, {"x": x, "target": target})


def _work(mod, params, x, target, h, f):
    """(matmul FLOPs, dispatch bytes) of one step, each over the routed work."""
    made = []
    saved = {fn: getattr(mod, fn) for fn in ("moe_dispatch", "moe_pack") if hasattr(mod, fn)}

    def counting(orig):
        def counted(*args):
            out = orig(*args)
            made.append(out.numel() * out.element_size())
            return out
        return counted

    for fn, orig in saved.items():
        setattr(mod, fn, counting(orig))
    try:
        with FlopCounterMode(display=False) as flops:
            _step(mod, params, x, target)
    finally:
        for fn, orig in saved.items():
            setattr(mod, fn, orig)
    pairs = x.shape[0] * x.shape[1] * TOP_K
    return (flops.get_total_flops() / (pairs * 18 * h * f),
            sum(made) / (len(made) * pairs * h * x.element_size()), flops.get_total_flops(), sum(made))


def main():
    quick = "--quick" in sys.argv
    h = int(C.arg_value("--hidden", 64 if quick else 256))
    f = int(C.arg_value("--inter", 128 if quick else 512))
    batch = int(C.arg_value("--batch", 4 if quick else 8))
    seq = int(C.arg_value("--seq", 32 if quick else 128))
    rounds, per_round, warmup = (3, 2, 1) if quick else (6, 3, 2)
    torch.set_num_threads(1)
    print(C.env_line())
    module, (x,), names = models.moe_block(batch=batch, seq=seq, experts=EXPERTS, top_k=TOP_K, hidden=h, inter=f)
    graph = import_torch(module, (x,), names)
    target = torch.zeros_like(x)
    params = {k: v.detach().clone() for k, v in module.named_parameters()}
    with tempfile.TemporaryDirectory() as folder:
        mods = {"dropless": _program(graph, SPEC.format(moe="", batch=batch), folder, "dropless"),
                "dense": _program(graph, SPEC.format(moe=f"moe capacity_factor={EXPERTS / TOP_K}\n", batch=batch),
                                  folder, "dense")}
        outs = {k: _step(m, params, x, target) for k, m in mods.items()}
        err = max(C.max_abs(outs["dropless"][k], outs["dense"][k]) for k in outs["dense"]
                  if k == "loss" or k.endswith(".grad"))
        work = {k: _work(m, params, x, target, h, f) for k, m in mods.items()}
        times = {k: [] for k in mods}
        order = list(mods)
        for _ in range(warmup):
            for k in order:
                _step(mods[k], params, x, target)
        for r in range(rounds):
            for k in (order if r % 2 == 0 else order[::-1]):
                for _ in range(per_round):
                    t0 = time.perf_counter()
                    _step(mods[k], params, x, target)
                    times[k].append(time.perf_counter() - t0)
    rows = []
    for k in mods:
        s = C.stats_ms(times[k])
        rows.append({"variant": k, "flops": work[k][2] / 1e9, "flops_ratio": work[k][0],
                     "bytes": work[k][3] / 2 ** 20, "bytes_ratio": work[k][1],
                     "median": s["median"], "min": s["min"], "max": s["max"], "n": s["n"]})
    C.print_table(f"MoE layer train step: {EXPERTS} experts top-{TOP_K}, hidden {h}, inter {f}, "
                  f"x ({batch}, {seq}, {h}) fp32, world size 1",
                  [("variant", "variant"), ("flops", "matmul GFLOP"), ("flops_ratio", "FLOPs / routed"),
                   ("bytes", "dispatch MiB"), ("bytes_ratio", "dispatch bytes / routed"),
                   ("median", "step ms (median)"), ("min", "min"), ("max", "max"), ("n", "n")], rows)
    speed = rows[1]["median"] / rows[0]["median"]
    print(f"dense / dropless step time: {speed:.2f}x; dropless FLOPs {rows[0]['flops_ratio']:.3f}x and dispatch "
          f"bytes {rows[0]['bytes_ratio']:.3f}x the routed work (goal <= 1.3x: "
          f"{'met' if max(rows[0]['flops_ratio'], rows[0]['bytes_ratio']) <= 1.3 else 'NOT met'}); "
          f"max abs difference of loss and gradients {err:.2e}")
    C.dump_json({"rows": rows, "dense_over_dropless": speed, "max_abs_diff": err, "env": C.env_line()})


if __name__ == "__main__":
    main()
