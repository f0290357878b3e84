"""Attention's backward in program.py against one autograd backward, one process, 1 thread.

program.py's training step runs an attention's forward as ``attention_forward`` (runtime
``program_attention.py``, pasted into every program whose training step differentiates an
``sdpa``): the fused kernel torch's sdpa would pick, called directly, keeping its output and
logsumexp; the backward is ``attention_backward``, that kernel's own backward on them (no
forward again). Where no such kernel runs, the backward falls back to ``attention_grads``: one
``torch.func.vjp`` over ``scaled_dot_product_attention``, i.e. the forward once more and one
backward. Variants, timed interleaved (``_common.interleaved`` rounds, order reversed every
other round), causal, fp32, B x heads x S x head_dim:

  autograd-bwd      ``torch.autograd.grad(y, (q, k, v), dy, retain_graph=True)`` on a forward
                    done once, outside the timing: what one autograd backward costs when
                    the forward saved what it needs (the target's denominator)
  autograd-fwd+bwd  the forward and that backward: what a step pays for attention
  parcomp           ``attention_backward(dy, q, k, v, saved, "qkv", is_causal=True)`` on what
                    ``attention_forward`` kept (done once, outside the timing): program.py's
                    backward of one attention
  parcomp-vjp       ``attention_grads(dy, q, k, v, "qkv", is_causal=True)``: the fallback (the
                    forward is recomputed inside)
  kernel-bwd        the CPU flash kernel's own backward given the saved output and
                    logsumexp (``aten._scaled_dot_product_flash_attention_for_cpu_backward``)
                    called directly: the floor

Ratios printed: parcomp / autograd-bwd (target <= 1.2), parcomp / autograd-fwd+bwd and
parcomp-vjp / autograd-bwd. Gradients of every variant are compared with autograd's (max |err|).

Run:  .venv/bin/python bench/attention_backward.py [--quick] [--json out.json] [--plain]
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import _common as C  # noqa: E402,I001  (sets the thread environment before torch is imported)

import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

QUICK = "--quick" in sys.argv
SHAPES = [(8, 4, 128, 64)] if QUICK else [(8, 4, 128, 64), (8, 4, 128, 256), (2, 8, 512, 64)]
ROUNDS, PER_ROUND, WARMUP = (3, 3, 2) if QUICK else (8, 5, 3)


def runtime():
    """program.py's attention helpers (the runtime module, the text program.py holds)."""
    from parcomp_backends.torch.runtime import program_attention

    return program_attention


def variants(b, nh, s, hd):
    g = torch.Generator().manual_seed(0)
    q, k, v, dy = (torch.randn(b, nh, s, hd, generator=g) for _ in range(4))
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    y = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
    rt = runtime()
    scale = hd ** -0.5
    with torch.no_grad():
        saved = rt.attention_forward(q, k, v, is_causal=True)[1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True, scale=scale)[:2]
    res = {}

    def autograd_bwd():
        res["autograd-bwd"] = torch.autograd.grad(y, (qr, kr, vr), dy, retain_graph=True)

    def autograd_fwd_bwd():
        yy = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
        res["autograd-fwd+bwd"] = torch.autograd.grad(yy, (qr, kr, vr), dy)

    def parcomp():
        with torch.no_grad():
            res["parcomp"] = rt.attention_backward(dy, q, k, v, saved, "qkv", is_causal=True)

    def parcomp_vjp():
        with torch.no_grad():
            res["parcomp-vjp"] = rt.attention_grads(dy, q, k, v, "qkv", is_causal=True)

    def kernel_bwd():
        res["kernel-bwd"] = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dy, q, k, v, out, lse, 0.0, True, scale=scale)

    return [("autograd-bwd", autograd_bwd), ("autograd-fwd+bwd", autograd_fwd_bwd), ("parcomp", parcomp),
            ("parcomp-vjp", parcomp_vjp), ("kernel-bwd", kernel_bwd)], res


def timed(fns):
    """name -> {"wall": [...], "cpu": [...]} seconds per call, interleaved rounds."""
    rec = {n: {"wall": [], "cpu": []} for n, _ in fns}
    for _, fn in fns:
        for _ in range(WARMUP):
            fn()
    for r in range(ROUNDS):
        for name, fn in (fns if r % 2 == 0 else fns[::-1]):
            for _ in range(PER_ROUND):
                c0, t0 = time.process_time(), time.perf_counter()
                fn()
                rec[name]["wall"].append(time.perf_counter() - t0)
                rec[name]["cpu"].append(time.process_time() - c0)
    return rec


def main():
    torch.set_num_threads(1)
    print(f"attention_backward: causal sdpa, fp32, one process; {C.env_line()}", flush=True)
    rows, results = [], {}
    for shape in SHAPES:
        fns, res = variants(*shape)
        rec = timed(fns)
        ref = res["autograd-bwd"]
        med = {n: statistics.median(rec[n]["cpu"]) * 1e3 for n, _ in fns}
        for n, _ in fns:
            got = res[n][:3]
            rows.append({"shape": "x".join(map(str, shape)), "variant": n,
                         "wall": statistics.median(rec[n]["wall"]) * 1e3, "cpu": med[n],
                         "min": min(rec[n]["cpu"]) * 1e3, "vs_bwd": med[n] / med["autograd-bwd"],
                         "err": max(C.max_abs(a, b) for a, b in zip(got, ref))})
        results["x".join(map(str, shape))] = {"cpu_ms": med, "ratios": {
            "parcomp/autograd-bwd": med["parcomp"] / med["autograd-bwd"],
            "parcomp/autograd-fwd+bwd": med["parcomp"] / med["autograd-fwd+bwd"],
            "parcomp-vjp/autograd-bwd": med["parcomp-vjp"] / med["autograd-bwd"],
            "kernel-bwd/autograd-bwd": med["kernel-bwd"] / med["autograd-bwd"]}}
    C.print_table("attention backward (ms per call; CPU = process time, the column the ratios use)",
                  [("shape", "B x heads x S x hd"), ("variant", "variant"), ("wall", "wall median"),
                   ("cpu", "CPU median"), ("min", "CPU min"), ("vs_bwd", "x autograd-bwd"), ("err", "max|err| vs autograd")],
                  rows)
    for shape, r in results.items():
        print(f"{shape}: " + ", ".join(f"{k} = {v:.3f}" for k, v in r["ratios"].items()))
    C.dump_json(results)


if __name__ == "__main__":
    main()
