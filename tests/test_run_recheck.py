"""``parcomp run``'s verdict agrees with ``check``'s: when the float32 comparison of the torchrun
result cannot vouch (a bound too loose to resolve the LM's outputs), the plan is re-checked in
float64 on the numpy interpreter, as ``check`` does (parcomp/run64.py). A real mismatch, in
the torchrun result or in the float64 re-check, still fails. Tiny GPT-2 / Llama, 2 gloo ranks."""
import json
import os

import numpy as np
import pytest

from parcomp.cli import main
from test_cli import write  # the suite's one file-writing helper

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "specs", "models.py")
LLAMA_TP2 = "mesh tp=2\n" + "".join(
    f"model.layers.*.{m}.weight {kind}\n" for m, kind in (
        ("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"), ("self_attn.v_proj", "colwise"),
        ("self_attn.o_proj", "rowwise"), ("mlp.gate_proj", "colwise"), ("mlp.up_proj", "colwise"),
        ("mlp.down_proj", "rowwise")))


def _json(capsys) -> tuple:
    cap = capsys.readouterr()
    return json.loads(cap.out.strip().splitlines()[-1]), cap.out, cap.err


def test_gpt2_training_run_is_ok_as_check_says(capsys):
    spec = os.path.join(ROOT, "specs", "gpt2_lm_tp2_train.pcs")
    code = main(["run", f"{MODELS}:gpt2_lm", "--spec", spec, "--nproc", "2"])
    out = capsys.readouterr().out
    assert code == 0 and out.rstrip().endswith("OK"), out[-3000:]
    assert "re-checked in float64 is OK" in out and "too loose to resolve" in out, out[-3000:]


def test_llama_forward_run_is_ok_with_the_float64_recheck(tmp_path, capsys):
    spec = write(tmp_path, "llama.pcs", LLAMA_TP2)
    assert main(["run", f"{MODELS}:llama_lm", "--spec", spec, "--nproc", "2", "--json"]) == 0
    res, _, err = _json(capsys)
    assert res["ok"] and res["verdict"] == "OK", (res, err[-2000:])
    assert res["float64"]["ok"] and res["float64"]["err_over_tol"] <= 1, res["float64"]
    assert res["err_over_tol"] <= 1  # the torchrun result itself is within its float32 bound
    assert "re-checked in float64 is OK" in res["note"]


def test_torchrun_error_beyond_its_bound_is_a_mismatch(tmp_path, capsys, monkeypatch):
    """An error past a finite float32 bound is run's MISMATCH; no float64 re-check hides it."""
    import parcomp_backends.torch.launch as cr

    real = cr.assemble_outputs

    def wrong(path, program):
        got = real(path, program)
        got["logits"] = got["logits"].copy()
        got["logits"][0, 0, 0] += 1e3  # beyond the bound (~40 here): not rounding
        return got

    monkeypatch.setattr(cr, "assemble_outputs", wrong)
    spec = write(tmp_path, "llama.pcs", LLAMA_TP2)
    assert main(["run", f"{MODELS}:llama_lm", "--spec", spec, "--nproc", "2", "--json"]) == 1
    res, _, _ = _json(capsys)
    assert res["verdict"] == "MISMATCH" and "float64" not in res, res


def test_float64_recheck_that_differs_is_a_mismatch(tmp_path, capsys, monkeypatch):
    """A plan that is wrong by less than the float32 bound resolves: float64 sees it."""
    import parcomp.commands_check as cc

    real = cc.run_spmd

    def off(program, feeds):
        run = real(program, feeds)
        outs = run.outputs(program)
        wide = any(np.asarray(v).dtype == np.float64 for v in outs.values())
        run.outputs = lambda _p: {k: v * (1.001 if wide else 1.0) for k, v in outs.items()}
        return run

    monkeypatch.setattr(cc, "run_spmd", off)
    spec = write(tmp_path, "llama.pcs", LLAMA_TP2)
    assert main(["run", f"{MODELS}:llama_lm", "--spec", spec, "--nproc", "2", "--json"]) == 1
    res, _, _ = _json(capsys)
    assert res["verdict"] == "MISMATCH" and not res["float64"]["ok"], res
    assert res["why"].startswith("float64 re-check:")
