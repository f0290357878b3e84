"""examples/train_loop.py runs under torchrun on CPU gloo, checkpoints, and resumes from the
latest checkpoint with the compiled program read from the cache."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gloo_ranks import free_port

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _run(tmp_path, steps):
    env = {**os.environ, "PARCOMP_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([str(TORCHRUN), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                          "--master-port", str(free_port()),
                          str(ROOT / "examples/train_loop.py"), "--steps", str(steps), "--ckpt-every", "2",
                          "--ckpt-dir", str(tmp_path / "ckpt")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return [line for line in out.stdout.splitlines() if line.startswith(("step", "mesh"))]


@pytest.mark.slow
def test_the_example_trains_checkpoints_and_resumes(tmp_path):
    first = _run(tmp_path, 3)
    assert first[0].startswith("mesh {'tp': 2}; compiled program") and first[0].endswith("starting at step 1")
    assert [line.split()[1] for line in first[1:]] == ["1", "2", "3"]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step-2", "step-3"]
    again = _run(tmp_path, 4)
    assert "; cached program" in again[0] and again[0].endswith("starting at step 4")
    assert [line.split()[1] for line in again[1:]] == ["4"]
