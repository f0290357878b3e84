"""Run on the GPU machine, inside the directory tools/gpu_check/prepare.py wrote: run each prepared cuda-profile program.py with torchrun (1 rank, NCCL, CUDA)
and compare its outputs with the CPU/gloo run of the same program: every element within ``rtol``
(case.json: parcomp's float32 tolerance) of its value's scale, max |cpu| over the value."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

HERE = os.getcwd()
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0),
      "nccl", torch.cuda.nccl.version(), "tf32 matmul", torch.backends.cuda.matmul.allow_tf32)
ok_all = True
for name in sorted(os.listdir(HERE)):
    d = os.path.join(HERE, name)
    if not os.path.isfile(os.path.join(d, "case.json")):
        continue
    case = json.load(open(os.path.join(d, "case.json")))
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", "29533",
            "program.py", "--checkpoint", "model.pt", "--input", "inputs.pt", "--output", "gpu.pt"]
    if case["steps"]:
        args += ["--steps", str(case["steps"])]
    t = time.time()
    p = subprocess.run(args, cwd=d, capture_output=True, text=True, timeout=240)
    print(f"== {name}: rc {p.returncode} in {time.time() - t:.1f}s")
    if p.returncode:
        print(p.stdout[-3000:], p.stderr[-3000:]); ok_all = False; continue
    print("   ", (p.stdout.strip().splitlines() or [""])[-1][:200])
    gpu = torch.load(os.path.join(d, "gpu.pt"), map_location="cpu", weights_only=True)
    cpu = torch.load(os.path.join(d, "outputs.pt"), map_location="cpu", weights_only=True)
    assert sorted(gpu) == sorted(cpu), (sorted(gpu), sorted(cpu))
    worst = 0.0
    for k in sorted(cpu):
        g = np.asarray(gpu[k], np.float64) if not torch.is_tensor(gpu[k]) else gpu[k].double().numpy()
        c = np.asarray(cpu[k], np.float64) if not torch.is_tensor(cpu[k]) else cpu[k].double().numpy()
        tol = case["rtol"] * float(np.abs(c).max() if c.size else 0.0)
        err = np.abs(g - c)
        finite = np.isfinite(g).all() and np.isfinite(c).all()
        ratio = float(err.max() / tol) if tol > 0 else (0.0 if not err.size or err.max() == 0 else np.inf)
        worst = max(worst, ratio)
        print(f"   {k}: max|gpu-cpu| {err.max():.3e} tol {tol:.3e} err/tol {ratio:.4f} finite {finite}")
        ok_all &= finite and ratio <= 1
    print(f"   worst err/tol {worst:.4f}")
print("ALL OK" if ok_all else "SOME FAILED")
