"""MoE under mixed precision: the float64 check of an fp16/bf16 MoE step is OK (no float32 left
in it), check names the run's precision, and an MoE plan keeps its tokens split over ep without
pins."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from parcomp.check.train_check import compute_dtype, lockstep
from parcomp.cli import commands
from parcomp.cli.main import main

MOE = "specs/models.py:moe_block"
MOE_SPEC = Path(__file__).resolve().parents[2] / "specs" / "moe_ep2_train.pcs"
PINS = ("activation moe_dispatch", "activation reshape", "activation permute_1")


def _moe(tmp_path, train_opts="", pins=True):
    text = MOE_SPEC.read_text().replace("batch=4", "batch=4" + train_opts)
    if not pins:
        text = "".join(ln for ln in text.splitlines(True) if not ln.startswith(PINS))
    path = tmp_path / "moe.pcs"
    path.write_text(text)
    return path


def _compile(path, model=MOE):
    return commands.compile_model(SimpleNamespace(model=model, spec=str(path)), numeric="check")


# ---- the float64 check of a mixed-precision MoE step ------------------------------------------

@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_float64_check_of_a_mixed_precision_ep2_moe_step_is_ok(tmp_path, precision):
    """The router's gradient is a partial sum over ep widened by grad_upcast before its
    all_reduce: the widening kept float32 in the float64 run, rounding each rank's partial
    (an error of 2**-31, far over the float64 threshold). It widens to the graph's dtype now.
    The step in its own precision equals the unsharded one within that dtype's tolerance."""
    c, module, example = _compile(_moe(tmp_path, f" precision={precision}"))
    feeds = commands.training_feeds(c, module, example, 0)
    r = lockstep(c, None, example, feeds, 1)
    assert r["vs_unsharded"]["ok"] and r["vs_unsharded"]["err_over_tol"] <= 1, r["vs_unsharded"]["why"]
    assert r["native"]["ok"], r["native"]["why"]


def test_grad_upcast_and_nonfinite_compute_in_the_nodes_dtype():
    from parcomp.ir.types import TensorType
    from parcomp.reference.train_ops import TRAIN_NUMPY_OPS

    node = SimpleNamespace(type=TensorType((2,), "float64"))
    x = np.array([1 + 2.0 ** -40, np.inf])
    assert TRAIN_NUMPY_OPS["grad_upcast"]([x], node).dtype == np.float64
    assert TRAIN_NUMPY_OPS["grad_upcast"]([x], node)[0] == x[0]  # not rounded to float32
    assert TRAIN_NUMPY_OPS["nonfinite"]([x], node).dtype == np.float64


# ---- check names the run's precision -----------------------------------------------------------

def test_check_of_fp16_moe_is_ok_in_float64_and_in_float16(tmp_path, capsys):
    assert main(["check", MOE, "--spec", str(_moe(tmp_path, " precision=fp16"))]) == 0
    out = capsys.readouterr().out
    assert "in float64" in out and next(ln for ln in out.splitlines() if "in float16, vs unsharded:" in ln)
    assert out.rstrip().endswith("OK")


def test_compute_dtype_names_the_dtype(tmp_path):
    assert compute_dtype(_compile(_moe(tmp_path, " precision=bf16"))[0]) == "bfloat16"
    assert compute_dtype(_compile(_moe(tmp_path))[0]) is None


# ---- an MoE plan keeps the tokens split over ep, pins or not ---------------------------------

def test_moe_without_pins_moves_the_tokens_by_all_to_all_and_warns_of_nothing(tmp_path, capsys):
    """The slot-buffer pins of moe_ep2_train.pcs are not needed: ep splits the batch, so the
    search keeps each rank's tokens and sends them to their experts by all_to_all (the
    gather warning of parcomp/compile/moe_warnings.py is left for a plan that cannot)."""
    c = _compile(_moe(tmp_path, pins=False))[0]
    kinds = [(x["kind"], x["phase"]) for x in c.report["collectives"]]
    assert ("all_to_all", "forward") in kinds and not [k for k in kinds if k[0] == "all_gather"]
    assert c.report["warnings"] == [] and "warning: MoE layer" not in capsys.readouterr().err
    assert _compile(_moe(tmp_path, pins=True))[0].report["warnings"] == []
