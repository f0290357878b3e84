"""README.md's worked example "From training to a from_pretrained directory", run exactly as
written (the commands are read out of README.md, so the example cannot rot): ``parcomp run
--keep``, ``torchrun program.py --save``, ``parcomp export``, ``from_pretrained``; a tiny GPT-2 LM
on 2 gloo ranks. The exported weights are the checkpoint's, trained (not the initial ones)."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import numpy as np
import pytest

import parcomp
import parcomp_backends

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..")
MARKER = "<!-- tests/cli/test_readme_export.py runs exactly the commands of the next block -->"


def readme_commands() -> list:
    """The command lines of the fenced block right after :data:`MARKER` in README.md."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        lines = f.read().split("\n")
    at = lines.index(MARKER)
    assert lines[at + 1].startswith("```"), "the marker must sit right above the block"
    end = lines.index("```", at + 2)
    return [ln for ln in lines[at + 2:end] if ln.strip()]


def _tools(bin_dir) -> dict:
    """``parcomp``, ``torchrun`` and ``python`` as the README means them, bound to this test's
    interpreter and this tree's parcomp (PATH first); the environment to run them in."""
    bin_dir.mkdir()
    tools = {"parcomp": f'exec "{sys.executable}" -m parcomp.cli.main "$@"',
             "torchrun": f'exec "{sys.executable}" -m torch.distributed.run "$@"',
             "python": f'exec "{sys.executable}" "$@"'}
    for name, body in tools.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    paths = {os.path.dirname(os.path.dirname(os.path.abspath(m.__file__))) for m in (parcomp, parcomp_backends)}
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join(sorted(paths) + [os.environ.get("PYTHONPATH", "")]))


def test_readme_lists_the_four_steps():
    cmds = readme_commands()
    assert [c.split()[:2] for c in cmds] == [["parcomp", "run"], ["torchrun", "--standalone"],
                                             ["parcomp", "export"], ["python", "-c"]]
    assert "--keep work" in cmds[0] and "--save ckpt" in cmds[1] and "ckpt -o gpt2-tp2" in cmds[2]


@pytest.mark.slow
def test_readme_training_to_from_pretrained_runs_as_written(tmp_path):
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    env = _tools(tmp_path / "bin")
    cwd = tmp_path / "repo"  # "from the repository root": its specs/, outputs kept out of the tree
    cwd.mkdir()
    (cwd / "specs").symlink_to(os.path.join(os.path.abspath(ROOT), "specs"))
    results = []
    for cmd in readme_commands():
        res = subprocess.run(["/bin/sh", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True,
                             timeout=300, start_new_session=True)
        results.append(res)
        said = res.stdout + res.stderr
        assert "Traceback" not in said or cmd.startswith("torchrun"), said[-4000:]
        if cmd.startswith("parcomp run"):  # as the README says: OK; the sharding proven by check
            assert res.returncode == 0 and res.stdout.rstrip().endswith("OK"), said[-4000:]
            assert "proven by the float64 check of the same program" in res.stdout, said[-4000:]
        else:
            assert res.returncode == 0, f"{cmd}\n{said[-4000:]}"
    assert "saved step 2 to ckpt/step-2" in results[1].stdout
    assert "wrote model.safetensors, config.json" in results[2].stdout
    assert results[3].stdout.strip().splitlines()[-1] == "tied: True"
    out = cwd / "gpt2-tp2"
    assert sorted(os.listdir(out)) == [".parcomp-output", "config.json", "model.safetensors"]
    dcp_to_torch_save(str(cwd / "ckpt" / "step-2"), str(tmp_path / "full.pt"))
    full, start = torch.load(tmp_path / "full.pt"), torch.load(cwd / "work" / "model.pt")
    got = load_file(str(out / "model.safetensors"))
    wte = got["transformer.wte.weight"]
    np.testing.assert_array_equal(wte.numpy(), full["lm_head.weight"].numpy())  # tied: written once
    assert not np.array_equal(wte.numpy(), start["lm_head.weight"].numpy())  # trained
    assert int(full["step"]) == 2
