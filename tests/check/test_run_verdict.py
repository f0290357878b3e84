"""``parcomp run``'s verdict: what program.py computed under torchrun (float32, real ranks)
against the unsharded model in float32, within float32's tolerance of each value's scale; its
note says the sharding itself is proven by the float64 check of the same program. A result off
by more than float32's rounding is a MISMATCH. Tiny GPT-2 / Llama, 2 gloo ranks."""
import json
import os

import numpy as np
import pytest

from parcomp.cli.main import main
from test_cli import write  # the suite's one file-writing helper

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = os.path.join(ROOT, "specs", "models.py")
LLAMA_TP2 = "mesh tp=2\n" + "".join(
    f"model.layers.*.{m}.weight {kind}\n" for m, kind in (
        ("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"), ("self_attn.v_proj", "colwise"),
        ("self_attn.o_proj", "rowwise"), ("mlp.gate_proj", "colwise"), ("mlp.up_proj", "colwise"),
        ("mlp.down_proj", "rowwise")))


def _json(capsys) -> tuple:
    cap = capsys.readouterr()
    return json.loads(cap.out.strip().splitlines()[-1]), cap.out, cap.err


def test_gpt2_training_run_is_ok_and_says_what_proves_the_sharding(capsys):
    spec = os.path.join(ROOT, "specs", "gpt2_lm_tp2_train.pcs")
    code = main(["run", f"{MODELS}:gpt2_lm", "--spec", spec, "--nproc", "2"])
    out = capsys.readouterr().out
    assert code == 0 and out.rstrip().endswith("OK"), out[-3000:]
    assert "the sharding itself is proven by the float64 check of the same program" in out, out[-3000:]


def test_llama_forward_run_is_ok_within_float32s_tolerance(tmp_path, capsys):
    spec = write(tmp_path, "llama.pcs", LLAMA_TP2)
    assert main(["run", f"{MODELS}:llama_lm", "--spec", spec, "--nproc", "2", "--json"]) == 0
    res, _, err = _json(capsys)
    assert res["ok"] and res["verdict"] == "OK", (res, err[-2000:])
    assert res["err_over_tol"] <= 1 and res["rtol"] == 1e-3
    assert "parcomp check" in res["note"]


def test_torchrun_error_beyond_float32s_tolerance_is_a_mismatch(tmp_path, capsys, monkeypatch):
    """An error of 1% of the logits' scale in one element is run's MISMATCH."""
    import parcomp_backends.torch.launch as cr

    real = cr.assemble_outputs

    def wrong(path, program):
        got = real(path, program)
        got["logits"] = got["logits"].copy()
        got["logits"][0, 0, 0] += 0.01 * np.abs(got["logits"]).max()
        return got

    monkeypatch.setattr(cr, "assemble_outputs", wrong)
    spec = write(tmp_path, "llama.pcs", LLAMA_TP2)
    assert main(["run", f"{MODELS}:llama_lm", "--spec", spec, "--nproc", "2", "--json"]) == 1
    res, _, _ = _json(capsys)
    assert res["verdict"] == "MISMATCH" and "logits" in res["why"], res
