"""`parcomp check` vouches for a hand-written Megatron-style GPT with a tied embedding/LM head
(``tests/handwritten_gpt.py``), and a wrong collective there is a MISMATCH. The tied weight's two gradient
contributions are summed at the end of the backward; the float64 differential check compares
that sum like any other gradient.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from parcomp.cli.main import main
from parcomp.reference import interpreter

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(HERE, "handwritten_gpt.py")
SPEC = """# Megatron TP=2 training
mesh tp=2
blocks.*.attn.qkv.weight   colwise
blocks.*.attn.proj.weight  rowwise
blocks.*.mlp.w1.weight     colwise
blocks.*.mlp.w3.weight     colwise
blocks.*.mlp.w2.weight     rowwise
train loss=cross_entropy optimizer=adamw(lr=0.001) steps=2
"""


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    path = tmp_path_factory.mktemp("tied") / "tp2_train.pcs"
    path.write_text(SPEC)
    return str(path)


def _check(capsys, factory, spec) -> dict:
    main(["check", f"{MODEL}:{factory}", "--spec", spec, "--json"])
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("factory", ["rms_small_init", "gpt_ln"])
def test_check_vouches_for_the_tied_gpt(capsys, spec, factory):
    out = _check(capsys, factory, spec)
    assert out["verdict"] == "OK", out


def _inject(monkeypatch, collective: str, factor: float):
    """The interpreter's all_reduce whose node name contains ``collective`` is off by ``factor``."""
    right = interpreter._LAYOUT_OPS["all_reduce"]

    def wrong(xs, n):
        out = right(xs, n)
        return [x * factor for x in out] if collective in n.name and n.attr("reduce_op") != "max" else out
    monkeypatch.setitem(interpreter._LAYOUT_OPS, "all_reduce", wrong)


@pytest.mark.parametrize("collective,factor", [("linear_1", 1.01),  # block 0's attention output, forward
                                               ("bw.rms_norm.add_2", 1.1)])  # block 0's qkv input gradient
def test_a_wrong_all_reduce_in_the_tied_gpt_is_a_mismatch(capsys, monkeypatch, spec, collective, factor):
    _inject(monkeypatch, collective, factor)
    out = _check(capsys, "rms_small_init", spec)
    assert out["verdict"] == "MISMATCH", out


def test_a_mismatch_over_many_values_is_one_line_per_value_not_one_6kb_line():
    """A failing line lists each failing value once, not every value with its whole explanation."""
    from parcomp.check.differential import compare_all, verdict
    from parcomp.check.train_check import merge_steps, verdict_text

    want = {f"blocks.{k}.w.grad": np.array([1.0, -0.5]) for k in range(40)}
    got = {k: v + 1e-6 for k, v in want.items()}
    r = compare_all(got, want)
    assert not r["ok"]
    step = {**r, "max_loss_err": 0.0, "max_grad_err": 0.0, "max_param_err": 0.0}
    merged = merge_steps([step, step])
    text = verdict_text(verdict(merged), [("vs unsharded step", merged["why"])])
    lines = text.splitlines()
    assert lines[0].startswith("  MISMATCH: vs unsharded step: step 1: blocks.0.w.grad: error 1.000e-06 at [")
    assert sum("blocks." in ln for ln in lines) == 3 + 1  # three values of step 1, step 2's first
    assert any(ln.strip() == "and 37 more values" for ln in lines)
    assert len(text) < 1000 and max(map(len, lines)) < 200
