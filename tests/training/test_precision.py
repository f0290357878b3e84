"""Mixed precision: ``train ... precision=bf16 [grad_reduce=fp32|compute]``.

fp32 master parameters (split over dp like the optimizer state under ZeRO), compute and the
forward/backward activation collectives in bfloat16, parameter-gradient reductions in
float32 by default. Each step is checked from the same state as ``parcomp check`` does: the
program promoted to float64 against the unsharded step in float64 (the sharding), the program
in bfloat16 against the unsharded step in bfloat16 and against torch.autocast on the unsharded
model, within bfloat16's tolerance (:mod:`parcomp.check.differential`).
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from parcomp.check import train_check
from parcomp.check.differential import tolerance_for
from parcomp.cli import commands
from parcomp.errors import SpecError
from parcomp.ir.types import Shard
from parcomp.passes.train import precision

from train_models import MODELS

MLP = "specs/models.py:gpt2_mlp"
TP2 = ("mesh tp=2\nc_fc.weight colwise\nc_proj.weight rowwise\ninput x replicated\n"
       "train loss=mse optimizer=sgd(lr=0.1, momentum=0.9) steps=3{opts}\n")
DP2TP2 = ("mesh dp=2 tp=2\nc_fc.weight colwise over tp\nc_proj.weight rowwise over tp\ninput x [S(0), R]\n"
          "train loss=mse optimizer=adamw(lr=0.01) batch=2 steps=3{opts}\n")


def _compile(tmp_path, text, model=MLP):
    path = tmp_path / "t.pcs"
    path.write_text(text)
    return commands.compile_model(SimpleNamespace(model=model, spec=str(path)), numeric="check")


def _lockstep(compiled, steps=2):
    c, module, example = compiled
    feeds = commands.training_feeds(c, module, example, 0)
    return train_check.lockstep(c, module, example, feeds, steps)


def _all_ok(r):
    for side in ("vs_unsharded", "native", "vs_torch"):
        assert r[side]["ok"] and r[side]["err_over_tol"] <= 1, (side, r[side]["why"])


def _collectives(c, phase=None):
    return [(x["kind"], x["axis"], x["dtype"], x["bytes"]) for x in c.report["collectives"]
            if phase is None or x["phase"] == phase]


@pytest.mark.parametrize("opts,message", [
    (" precision=fp8", "precision='fp8' is not supported"),
    (" grad_reduce=compute", "grad_reduce= needs precision=bf16"),
    (" precision=bf16 grad_reduce=half", "grad_reduce='half'"),
    (" loss_scale=1024", "needs precision=fp16"),
    (" precision=fp16 loss_scale=0.5", "loss_scale=0.5 must be a number from 1"),
    (" precision=fp16 growth_interval=0", "growth_interval=0 must be a whole number"),
])
def test_precision_option_errors_are_located_at_the_train_line(tmp_path, opts, message):
    with pytest.raises(SpecError, match=message) as e:
        _compile(tmp_path, TP2.format(opts=opts))
    assert e.value.loc is not None and e.value.loc.line == 5


def test_bf16_tp2_sends_bf16_and_equals_autocast(tmp_path):
    """TP=2: the forward all_reduce and the backward dx all_reduce send bfloat16 (half the
    fp32 program's bytes); parameters, gradients and optimizer state stay float32; each step
    equals torch.autocast(bfloat16) + torch.optim on the unsharded model within bfloat16's tolerance."""
    fp32 = _compile(tmp_path, TP2.format(opts=""))[0]
    compiled = _compile(tmp_path, TP2.format(opts=" precision=bf16"))
    c = compiled[0]
    low = _collectives(c)
    assert [(k, a, d) for k, a, d, _ in low] == [("all_reduce", "tp", "bfloat16")] * 2
    assert [b for *_, b in low] == [b // 2 for *_, b in _collectives(fp32)]
    assert all(n.type.dtype == "float32" for n in c.logical.params)
    assert c.report["training"]["options"]["compute_dtype"] == "bfloat16"
    r = _lockstep(compiled)
    _all_ok(r)
    # autocast is really on: torch's fp32 and bf16 losses differ by more than float32 rounding
    _, _, ex = compiled
    assert abs(r["native_reference_losses"][0] - train_check.lockstep(fp32, *compiled[1:], commands.training_feeds(
        fp32, compiled[1], ex, 0), 1)["reference_losses"][0]) > 64 * 2.0 ** -24  # float32's unit roundoff


def _grad_reductions(c):
    """dtype of every backward reduction over dp of a parameter gradient."""
    return sorted({x["dtype"] for x in c.report["collectives"] if x["phase"] == "backward"
                   and "dp" in x["axis"].split(",") and x["kind"] in ("all_reduce", "reduce_scatter")})


def test_bf16_dp2_tp2_reduces_parameter_gradients_in_fp32(tmp_path):
    """DP=2 x TP=2 (GPT2MLP, AdamW): activations (tp all_reduces) in bfloat16, the parameter
    gradients' dp all_reduces in float32; each step equals torch.autocast within bfloat16's tolerance."""
    compiled = _compile(tmp_path, DP2TP2.format(opts=" precision=bf16"))
    c = compiled[0]
    assert {d for k, a, d, _ in _collectives(c, "forward") if a == "tp"} == {"bfloat16"}
    assert _grad_reductions(c) == ["float32"]
    _all_ok(_lockstep(compiled))


WIDE = ("mesh dp=2 tp=2\n0.weight colwise over tp\n2.weight rowwise over tp\ninput x [S(0), R]\n"
        "train loss=mse optimizer=sgd(lr=0.1) input_grads=no precision=bf16 bucket_cap_mb=0{opts}\n")
# bucket_cap_mb=0: one all_reduce per gradient (bucketing off), so each is seen in its dtype


def test_grad_reduce_compute_sends_the_gradients_in_bfloat16(tmp_path):
    """262144 tokens (weight gradients are all_reduced over dp, activations never gathered):
    ``grad_reduce=fp32`` (the default) reduces them in float32, ``grad_reduce=compute`` in
    bfloat16. The byte counts are not compared one to one: with gradient reductions half as
    dear the exact search picks another plan (weights gathered over tp, gradients summed over
    the joint dp,tp group) instead of Megatron's 2 MiB forward all_reduce."""
    c = _compile(tmp_path, WIDE.format(opts=""), f"{MODELS}:wide_batch_mlp")[0]
    half = _compile(tmp_path, WIDE.format(opts=" grad_reduce=compute"), f"{MODELS}:wide_batch_mlp")[0]
    dp = [(k, b) for k, a, d, b in _collectives(c, "backward") if "dp" in a.split(",")]  # dp or dp,tp
    assert _grad_reductions(c) == ["float32"] and len(dp) == 4
    assert _grad_reductions(half) == ["bfloat16"]
    assert half.report["training"]["options"]["grad_reduce_dtype"] == "bfloat16"


def test_fp32_gradient_reduction_needs_the_partial_over_batch_axes(tmp_path, monkeypatch):
    """Without ``partial_over`` the planner reduces the cheaper bfloat16 partial sums: the
    check of the tests above fails, so it can see the difference."""
    monkeypatch.setattr(precision, "batch_axes", lambda graph: "")
    c = _compile(tmp_path, WIDE.format(opts=""), f"{MODELS}:wide_batch_mlp")[0]
    assert _grad_reductions(c) == ["bfloat16"]


def test_bf16_zero_keeps_fp32_master_slices_split_over_dp(tmp_path):
    """ZeRO-1: each dp rank keeps and updates only its fp32 slice of a trained parameter (laid
    out like its optimizer state); the bf16 copy is gathered; the gradients are reduce-scattered
    in float32 (grad_reduce=fp32, the default). Equal to torch.autocast."""
    compiled = _compile(tmp_path, DP2TP2.format(opts=" precision=bf16 zero=1"))
    c = compiled[0]
    lay = {n.name: n.layout for n in c.logical.params}
    dp = c.logical.mesh.axis_index("dp")
    assert isinstance(lay["c_fc.weight"][dp], Shard) and lay["c_fc.weight"] == lay["c_fc.weight.exp_avg"]
    assert {d for k, a, d, _ in _collectives(c, "forward") if k == "all_gather"} == {"bfloat16"}
    # the gradients' partial sums are widened before the ZeRO reduce_scatter: float32 on the wire
    reductions = [(k, d) for k, a, d, _ in _collectives(c, "backward") if a == "dp"]
    assert ("reduce_scatter", "float32") in reductions and {d for _, d in reductions} == {"float32"}
    _all_ok(_lockstep(compiled))


def test_check_vouches_for_the_sharding_in_float64(tmp_path, capsys):
    """``parcomp check`` of a bf16 step: OK in float64 (the sharding) and in bfloat16."""
    from parcomp.cli.main import main

    path = tmp_path / "t.pcs"
    path.write_text(TP2.format(opts=" precision=bf16").replace("steps=3", "steps=1"))
    assert main(["check", MLP, "--spec", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["ok"] and out["err_over_tol"] <= 1 and out["native"]["ok"]


@pytest.mark.slow
@pytest.mark.parametrize("opts", [" precision=bf16", " precision=fp16 loss_scale=1024"])
@pytest.mark.parametrize("text,nproc,tp_bytes", [(TP2, 2, 16 * 32 * 2), (DP2TP2, 4, 8 * 32 * 2)])
def test_low_precision_program_py_three_steps_on_gloo_equals_autocast(tmp_path, capsys, text, nproc, tp_bytes,
                                                                      opts):
    """program.py, 3 bf16 / fp16 steps under torchrun (TP=2, DP=2 x TP=2): 2-byte collectives
    on gloo, every step (--replay) and the free-running run's losses within the dtype's
    tolerance of torch.autocast (+ GradScaler for fp16)."""
    from parcomp.cli.main import main

    spec = tmp_path / "t.pcs"
    spec.write_text(text.format(opts=opts))
    main(["run", MLP, "--spec", str(spec), "--nproc", str(nproc), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["verdict"] == "OK", out.get("why")
    assert out["err_over_tol"] <= 1 and len(out["losses"]) == 3 and np.all(np.isfinite(out["losses"]))
    tp = {x["bytes"] for x in out["collectives"] if x["axis"] == "tp"}
    assert tp - {4} == {tp_bytes}  # 2 bytes an element (4: fp16's float32 count of inf/NaN gradients)
    # fp16's count of inf/NaN gradients: one float32 all_reduce over tp, or over the joint dp,tp
    # group on DP=2 x TP=2 (6 bytes a rank on 4 ranks)
    counts = [x for x in out["collectives"] if x["phase"] != "loss" and x["bytes"] in (4, 6)
              and "tp" in x["axis"].split(",")]
    assert bool(counts) == ("fp16" in opts)


# ---- fp16 with dynamic loss scaling ----

ROWWISE = ("mesh tp=2\n0.weight rowwise\ninput x [S(1)]\n"
           "train loss=mse optimizer=sgd(lr={lr}) input_grads=no steps=3 precision=fp16 loss_scale=4096\n")


def test_fp16_overflow_in_step_2_skips_that_step_on_every_rank(tmp_path):
    """The exact case: SGD with lr=50 on tp=2 (weight split, bias replicated) takes step 1;
    step 2's scaled fp16 gradients overflow. Every rank counts the same non-finite elements
    (one 4-byte all_reduce of the count), keeps its parameter slices, halves the scale and
    counts a skipped step, as torch.amp.GradScaler does on the unsharded model."""
    from parcomp.reference.interpreter import run_spmd
    from parcomp.check.training import train_steps

    from numerics import assert_equivalent

    c, module, example = _compile(tmp_path, ROWWISE.format(lr=50), f"{MODELS}:rowwise_linear")
    assert ("all_reduce", "tp", "float32", 4) in _collectives(c, "backward")  # the count
    feeds = commands.training_feeds(c, module, example, 0)
    prog = c.program
    runs = train_steps(lambda st: run_spmd(prog, st).outputs(prog), c.logical, feeds, 3, record=True)
    amp = [(float(o["amp.scale_ratio"]), float(o["amp.skipped"])) for o in runs["per_step"]]
    assert amp == [(0.0, 0.0), (-0.5, 1.0), (-0.75, 2.0)]  # scale 4096, 2048, 1024
    step1 = runs["per_step"][0]
    for k in (1, 2):
        run = run_spmd(prog, runs["starts"][k])
        found = [n.inputs[0] for n in prog.nodes if n.op == "amp_select"][0]
        counts = [float(env[found]) for env in run.env]
        assert counts[0] > 0 and counts == [counts[0]] * len(counts), counts  # every rank agrees
        out = run.outputs(prog)
        for p in ("0.weight", "0.bias"):
            np.testing.assert_array_equal(out[p], step1[p])
    _, want = train_check.torch_reference(c, module, example, feeds, 3)
    assert float(want["amp.scale_ratio"]) == -0.75 and float(want["amp.skipped"]) == 2.0
    for p in ("0.weight", "0.bias"):
        assert_equivalent(step1[p], want[p], what=p, rtol=tolerance_for("float16"))


def test_fp16_steps_equal_torch_gradscaler(tmp_path):
    """Without overflow: fp16 compute and collectives, gradients unscaled in float32, each step
    equal to torch.autocast(float16) + GradScaler + torch.optim within fp16's tolerance (TP=2 and
    DP=2 x TP=2 with AdamW, whose bias correction counts taken steps)."""
    for text in (TP2, DP2TP2):
        compiled = _compile(tmp_path, text.format(opts=" precision=fp16 loss_scale=1024"))
        c = compiled[0]
        assert {d for k, a, d, _ in _collectives(c, "forward") if a == "tp"} == {"float16"}
        r = _lockstep(compiled)
        _all_ok(r)
        assert r["losses"] and np.all(np.isfinite(r["losses"]))


def test_bf16_with_the_models_own_loss_takes_the_loss_in_float32(tmp_path):
    """``loss=output`` (transformers computes the loss inside the model): the loss ops run in
    float32 on widened logits, as torch.autocast runs cross_entropy; each step equals
    torch.autocast + AdamW within bfloat16's tolerance, and the sharding is exact in float64."""
    text = (Path("specs/gpt2_lm_loss_dp2_train.pcs").read_text()
            .replace("steps=2", "steps=2 precision=bf16"))
    compiled = _compile(tmp_path, text, model="specs/models.py:gpt2_lm_loss")
    c = compiled[0]
    loss_ops = [n for n in c.logical.nodes if n.op in precision.FLOAT32_OPS]
    assert "label_mask" in {n.op for n in loss_ops}  # cross_entropy is decomposed by now
    assert all(n.type.dtype == "float32" for n in loss_ops)
    assert c.logical[c.logical.outputs[0]].type.dtype == "float32"
    _all_ok(_lockstep(compiled))


def test_adamw_bias_corrections_are_double_precision_whatever_the_step_dtype():
    """The reference's AdamW takes 1 - beta**t in double precision, as torch.optim does (Python
    floats): a float32 step counter (the pipelined stage programs' ``step`` input) once made
    1 - 0.999**1 off by 1.3e-5, and a float64 check of a pp x tp AdamW step a MISMATCH."""
    from parcomp.ir import Node, TensorType, make_attrs
    from parcomp.reference.numpy_ops import NUMPY_OPS

    rng = np.random.default_rng(0)
    p, m = rng.standard_normal(8), rng.standard_normal(8)
    v = np.abs(rng.standard_normal(8))
    node = Node("u", "adamw_param", ("p", "m", "v", "t"), TensorType((8,), "float64"),
                make_attrs(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01))
    f64 = NUMPY_OPS["adamw_param"]([p, m, v, np.array(1.0)], node)
    f32 = NUMPY_OPS["adamw_param"]([p, m, v, np.array(1.0, np.float32)], node)
    assert np.array_equal(f64, f32)
    want = p * (1 - 1e-3 * 0.01) - 1e-3 / (1 - 0.9) * m / (np.sqrt(v) / (1 - 0.999) ** 0.5 + 1e-8)
    assert np.allclose(f64, want, rtol=1e-15, atol=0)
