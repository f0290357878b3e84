"""The step-by-step (lockstep) training check: each step from the unsharded state, in float64,
and it can fail."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from parcomp.check import train_check
from parcomp.cli import commands

SPEC = "specs/gpt2_mlp_dp2_tp2_train.pcs"  # AdamW, dp2 x tp2, 3 steps
MODEL = "specs/models.py:gpt2_mlp"


@pytest.fixture(scope="module")
def compiled():
    args = SimpleNamespace(model=MODEL, spec=SPEC)
    compiled, module, example = commands.compile_model(args, numeric="check")
    return compiled, module, example, commands.training_feeds(compiled, module, example, 0)


def test_lockstep_passes_and_names_each_side(compiled):
    c, module, example, feeds = compiled
    r = train_check.lockstep(c, module, example, feeds, 3)
    assert r["vs_unsharded"]["ok"] and r["vs_torch"]["ok"], (r["vs_unsharded"]["why"], r["vs_torch"]["why"])
    assert len(r["losses"]) == 3 and r["vs_unsharded"]["worst"].startswith("step ")
    assert train_check.verdict(r["vs_unsharded"], r["vs_torch"]) == "OK"


def test_lockstep_catches_a_wrong_step(compiled, monkeypatch):
    """A sharded step that moves one weight by 1e-5 in step 2 only is a MISMATCH naming step 2."""
    c, module, example, feeds = compiled
    real = train_check.run_spmd
    calls = {"k": 0}

    class Wrong:
        def __init__(self, run):
            self.run = run

        def outputs(self, prog):
            out = self.run.outputs(prog)
            if calls["k"] == 2:
                out["c_proj.weight"] = out["c_proj.weight"].copy()
                out["c_proj.weight"][3, 5] += np.float32(1e-5)
            return out

    def spy(prog, state):
        calls["k"] += 1
        return Wrong(real(prog, state))

    monkeypatch.setattr(train_check, "run_spmd", spy)
    r = train_check.lockstep(c, None, None, feeds, 3)
    v = r["vs_unsharded"]
    assert not v["ok"] and train_check.verdict(v) == "MISMATCH"
    assert v["why"].startswith("step 2:") and "step 1" not in v["why"] and "step 3" not in v["why"]
    assert "c_proj.weight[3,5]" in v["worst"]


def test_run_replays_each_step_and_reports_the_free_run_too(tmp_path, capsys):
    """``run`` launches program.py free-running and with ``--replay`` (each step from the
    unsharded run's state); both are reported, the verdict needs both."""
    import json

    from parcomp.cli.main import main

    spec = tmp_path / "t.pcs"
    spec.write_text(open(SPEC).read())
    assert main(["run", MODEL, "--spec", str(spec), "--nproc", "4", "--json"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["verdict"] == "OK" and last["ok"] and len(last["losses"]) == 3
    assert last["free_running"]["ok"] and last["err_over_tol"] <= 1
    # the step-by-step comparison judges every carried value, the free run its losses
    assert last["free_running"]["worst"].startswith("losses") and "drift" in last["free_running"]


def test_replay_file_with_the_wrong_number_of_steps_exits_2(tmp_path, monkeypatch, capsys):
    import torch

    from parcomp_backends.torch.runtime import program_train

    path = tmp_path / "replay.pt"
    torch.save([{}, {}], path)
    with pytest.raises(SystemExit) as e:
        program_train.read_replay(str(path), 3)
    assert e.value.code == 2
    assert "holds 2 checkpoints but --steps is 3" in capsys.readouterr().err
    torch.save({"a": torch.zeros(1)}, path)
    with pytest.raises(SystemExit):
        program_train.read_replay(str(path), 1)
    assert "must hold a list of one checkpoint dict per step" in capsys.readouterr().err
