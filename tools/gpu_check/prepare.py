"""Prepare the GPU check: cuda-profile programs (world size 1), run here on CPU/gloo.

Usage (repo root, the repo's venv): ``.venv/bin/python tools/gpu_check/prepare.py [DIR]``
(DIR defaults to ``.gpu_check``, which .gitignore ignores). For each case it writes
DIR/CASE/ with program.py (``--profile cuda``), model.pt, inputs.pt, the CPU/gloo run's
outputs.pt and case.json: the steps and the float32 tolerance (``rtol``, a fraction of each
value's scale, :data:`parcomp.check.differential.DTYPE_TOLERANCE`) the GPU run must meet.
Then copy DIR and ``tools/gpu_check/gpu_run.py`` to a GPU machine and run
``python3 gpu_run.py`` inside DIR (torch with CUDA and NCCL; parcomp is not needed there).
"""
import json
import os
import shutil
import subprocess
import sys

from parcomp.check.differential import DTYPE_TOLERANCE

HERE = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else ".gpu_check")
os.makedirs(HERE, exist_ok=True)
CASES = {
    "gpt2_fwd": ("specs/models.py:gpt2_mlp", "mesh tp=1\nc_fc.weight colwise\nc_proj.weight rowwise\ninput x replicated\noutput output replicated\n", None),
    "torch_fwd": ("specs/models.py:torch_mlp", "mesh tp=1\n0.weight colwise\n2.weight rowwise\n", None),
    "gpt2_train": ("specs/models.py:gpt2_mlp", "mesh tp=1\nc_fc.weight colwise\nc_proj.weight rowwise\ninput x replicated\ntrain loss=mse optimizer=adamw(lr=0.01) steps=3\n", 3),
    "torch_train": ("specs/models.py:torch_mlp", "mesh dp=1 tp=1\n0.weight colwise over tp\n2.weight rowwise over tp\ntrain loss=mse optimizer=sgd(lr=0.1, momentum=0.9) steps=3\n", 3),
}
for name, (model, spec_text, steps) in CASES.items():
    d = os.path.join(HERE, name)
    shutil.rmtree(d, ignore_errors=True)
    spec_path = os.path.join(HERE, name + ".pcs")
    open(spec_path, "w").write(spec_text)
    cmd = [sys.executable, "-m", "parcomp.cli.main", "run", model, "--spec", spec_path, "--nproc", "1",
           "--profile", "cuda", "--keep", d, "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    print(name, "cpu run rc", p.returncode, p.stdout.strip().splitlines()[-1][:300] if p.stdout.strip() else p.stderr[-2000:])
    json.dump({"steps": steps, "rtol": DTYPE_TOLERANCE["float32"]}, open(os.path.join(d, "case.json"), "w"))
