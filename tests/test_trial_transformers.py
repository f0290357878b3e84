"""A new user's trial of transformers models through torch.export (GPT-2, Llama and their
neighbours, small configs, random weights): each finding is a test here."""
import json

import pytest

from parcomp.cli import main
from test_cli import write  # the suite's one file-writing helper

pytest.importorskip("torch")

FACTORIES = '''
import torch
from torch import nn
def mlp_dropout():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 128), nn.Dropout(0.5), nn.Linear(128, 32)).train()
    return m, (torch.randn(2, 8, 32),), ["x"]
'''
MLP_TP2 = "mesh tp=2\n0.weight colwise\n2.weight rowwise\n"


@pytest.fixture
def play(tmp_path):
    (tmp_path / "trial.py").write_text(FACTORIES)
    return tmp_path


def _json(capsys) -> tuple:
    cap = capsys.readouterr()
    return json.loads(cap.out.strip().splitlines()[-1]), cap.err


# 1: a model with dropout in training mode was checked against the torch module (in eval
# mode for the forward, torch's own dropout masks for training): a correct sharding read as
# MISMATCH (error 1.0 on a tight bound). The reference is the unsharded graph with parcomp's
# dropout, and a note says why.
def test_training_mode_dropout_forward_check_is_ok_against_parcomps_dropout(play, capsys):
    spec = write(play, "mlp.pcs", MLP_TP2)
    assert main(["check", f"{play}/trial.py:mlp_dropout", "--spec", spec, "--json"]) == 0
    res, err = _json(capsys)
    assert res["ok"] and res["verdict"] == "OK" and res["err_over_tol"] < 1, res
    assert "not from torch's generator" in err and "not the torch module" in err


def test_training_mode_dropout_training_check_is_ok(play, capsys):
    spec = write(play, "mlp_t.pcs", MLP_TP2 + "train loss=mse optimizer=sgd(lr=0.1) steps=2\n")
    assert main(["check", f"{play}/trial.py:mlp_dropout", "--spec", spec, "--json"]) == 0
    res, err = _json(capsys)
    assert res["ok"] and "vs_torch" not in res, res
    assert "not the torch module" in err


def test_training_mode_dropout_still_catches_a_wrong_sharding(play, capsys, monkeypatch):
    """The numpy reference is a real check: a program that drops the all_reduce's sum is a MISMATCH."""
    import parcomp.commands_check as cc

    real = cc.run_spmd

    def halved(program, feeds):
        run = real(program, feeds)
        outs = run.outputs(program)
        run.outputs = lambda _p: {k: v * 0.5 for k, v in outs.items()}
        return run

    monkeypatch.setattr(cc, "run_spmd", halved)
    spec = write(play, "mlp.pcs", MLP_TP2)
    assert main(["check", f"{play}/trial.py:mlp_dropout", "--spec", spec, "--json"]) != 0
    res, _ = _json(capsys)
    assert not res["ok"] and res["verdict"] == "MISMATCH", res
