"""MoE, context parallel and mixed precision together: the float64 check of an fp16/bf16 MoE step is OK (no float32 left in it) and check names the
run's precision, `context-parallel` without a `cp` axis needs `over`, train option errors
point at the option, an MoE plan keeps its tokens split without pins, program.py's `--print-launch`
keeps the options given with it, and an absurd `memory` is refused."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from parcomp.check.train_check import compute_dtype, lockstep
from parcomp.cli import commands
from parcomp.cli.main import main
from parcomp.errors import SpecError
from parcomp.spec import parse_spec

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


# ---- 1. the float64 check of a mixed-precision MoE step ---------------------------------------

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


# ---- 3. check names the run's precision --------------------------------------------------------

def test_check_of_fp16_moe_is_ok_in_float64_and_in_float16(tmp_path, capsys):
    assert main(["check", MOE, "--spec", str(_moe(tmp_path, " precision=fp16"))]) == 0
    out = capsys.readouterr().out
    assert "in float64" in out and next(ln for ln in out.splitlines() if "in float16, vs unsharded:" in ln)
    assert out.rstrip().endswith("OK")


def test_compute_dtype_names_the_dtype(tmp_path):
    assert compute_dtype(_compile(_moe(tmp_path, " precision=bf16"))[0]) == "bfloat16"
    assert compute_dtype(_compile(_moe(tmp_path))[0]) is None


# ---- 2. context-parallel needs a cp axis or `over` --------------------------------------------

@pytest.mark.parametrize("mesh", ["tp=2", "dp=2"])
def test_context_parallel_on_a_mesh_without_cp_needs_over(mesh):
    with pytest.raises(SpecError, match=r"no 'cp' axis .*say 'context-parallel over AXIS'") as e:
        parse_spec(f"mesh {mesh}\ncontext-parallel\n", "s.pcs")
    assert (e.value.loc.line, e.value.loc.col) == (2, 1)
    assert parse_spec(f"mesh {mesh}\ncontext-parallel over {mesh[:2]}\n", "s.pcs").context_parallel.axis == mesh[:2]
    assert parse_spec("mesh cp=2\ncontext-parallel\n", "s.pcs").context_parallel.axis == "cp"


# ---- 4. train option errors at the option's column --------------------------------------------

TRAIN = "train loss=mse optimizer=sgd(lr=0.1) "


@pytest.mark.parametrize("opts,key,message", [
    ("precision=fp8", "precision", "precision='fp8' is not supported"),
    ("precision=bf16 loss_scale=1024", "loss_scale", "needs precision=fp16"),
    ("precision=fp16 loss_scale=-1", "loss_scale", "loss_scale=-1 must be"),
    ("precision=fp16 growth_interval=-5", "growth_interval", "growth_interval=-5 must be"),
    ("grad_reduce=compute", "grad_reduce", "grad_reduce= needs precision"),
    ("precision=bf16 grad_reduce=int8", "grad_reduce", "grad_reduce='int8'"),
    ("clip_grad_norm=-1", "clip_grad_norm", "clip_grad_norm=-1.0 must be positive"),
    ("accumulate=0", "accumulate", "accumulate=0 is out of range"),
    ("recompute=some", "recompute", "recompute='some' is not supported"),
    ("lr_schedule=cosine(T_max=-3)", "T_max", "cosine"),
    ("lr_schedule=cosine(T_max=3, warm=2)", "warm", "has no argument .warm."),
    ("microbatches=2", "microbatches", "pipeline option"),
])
def test_a_train_option_error_points_at_the_option(tmp_path, opts, key, message):
    path = tmp_path / "t.pcs"
    path.write_text("mesh tp=2\nc_fc.weight colwise\nc_proj.weight rowwise\n" + TRAIN + opts + "\n")
    with pytest.raises(SpecError, match=message) as e:
        _compile(path, "specs/models.py:gpt2_mlp")
    line = (TRAIN + opts)
    assert (e.value.loc.line, e.value.loc.col) == (4, line.index(key + "=") + 1)


# ---- 5. an MoE plan keeps the tokens split over ep, pins or not ------------------------------

def test_moe_without_pins_moves_the_tokens_by_all_to_all_and_warns_of_nothing(tmp_path, capsys):
    """The slot-buffer pins of moe_ep2_train.pcs are not needed: ep splits the batch, so the
    search keeps each rank's tokens and sends them to their experts by all_to_all (the
    gather warning of parcomp/compile/moe_warnings.py is left for a plan that cannot)."""
    c = _compile(_moe(tmp_path, pins=False))[0]
    kinds = [(x["kind"], x["phase"]) for x in c.report["collectives"]]
    assert ("all_to_all", "forward") in kinds and not [k for k in kinds if k[0] == "all_gather"]
    assert c.report["warnings"] == [] and "warning: MoE layer" not in capsys.readouterr().err
    assert _compile(_moe(tmp_path, pins=True))[0].report["warnings"] == []


# ---- 6. --print-launch keeps the options given with it ----------------------------------------

def _program(tmp_path_factory, *profile):
    out = tmp_path_factory.mktemp("launch") / "o"
    assert main(["compile", "specs/models.py:gpt2_mlp", "--spec", "specs/gpt2_mlp_tp2.pcs", *profile,
                 "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def program_dir(tmp_path_factory):
    return _program(tmp_path_factory)


def _launch(program_dir, *args):
    return subprocess.run([sys.executable, "program.py", "--print-launch", *args], cwd=program_dir,
                          capture_output=True, text=True, timeout=120)


def test_print_launch_uses_the_options_given_with_it(program_dir):
    res = _launch(program_dir, "1x2", "--checkpoint", "my model.pt", "--input", "x.pt", "--timeout", "30")
    assert res.returncode == 0, res.stderr
    (run,) = [ln for ln in res.stdout.splitlines() if ln.startswith("torchrun ")]
    assert run.endswith("program.py --checkpoint 'my model.pt' --input x.pt --timeout 30")
    res = _launch(program_dir)  # none given: the run hint's
    assert res.stdout.rstrip().endswith("program.py --checkpoint model.pt --input x.pt --output out.pt")


def test_print_launch_sets_the_timeout_given_with_it(tmp_path_factory):
    ascend = _program(tmp_path_factory, "--profile", "ascend")
    assert "export HCCL_EXEC_TIMEOUT=600 " in _launch(ascend).stdout  # the program's default
    res = _launch(ascend, "--checkpoint", "m.pt", "--input", "x.pt", "--timeout", "30")
    assert res.returncode == 0 and "export HCCL_EXEC_TIMEOUT=30 " in res.stdout, res.stderr


def test_print_launch_rejects_a_bad_option_given_with_it(program_dir):
    res = _launch(program_dir, "--checkpoint", "m.pt", "--input", "x.pt", "--stepz", "3")
    assert res.returncode == 2 and "unrecognized arguments: --stepz 3" in res.stderr
    assert "torchrun" not in res.stdout


# ---- 7. an absurd memory size -------------------------------------------------------------------

@pytest.mark.parametrize("value", ["10000000TiB", "1025TiB", "2000000TB"])
def test_a_memory_size_above_any_device_is_a_located_error(value):
    with pytest.raises(SpecError, match=r"is above 1024.0 TiB, more than any one device holds") as e:
        parse_spec(f"mesh tp=2\nmemory {value}\n", "s.pcs")
    assert (e.value.loc.line, e.value.loc.col) == (2, 8)
    assert parse_spec("mesh tp=2\nmemory 1024TiB\n", "s.pcs").memory == 2**50
