"""Training options: clip_grad_norm, lr_schedule, accumulate.

Each is checked step by step (lockstep) against the unsharded step and against torch using
the same option (torch.nn.utils.clip_grad_norm_, torch.optim.lr_scheduler, one backward()
per microbatch), as ``parcomp check`` compares them; each has a broken variant that must fail.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from parcomp.check import train_check
from parcomp.check import torch_options
from parcomp.cli import commands
from parcomp.errors import SpecError
from parcomp.ir.types import layout_str
from parcomp.reference.train_ops import clip_coef
from parcomp.spec import train_options
from parcomp.spec.train_config import train_config

from graphs import spec as parse
from numerics import assert_equivalent
from train_models import MODELS


def _compiled(tmp_path, model, text):
    path = tmp_path / "t.pcs"
    path.write_text(text)
    args = SimpleNamespace(model=model, spec=str(path))
    c, module, example = commands.compile_model(args, numeric="check")
    return c, module, example, commands.training_feeds(c, module, example, 0)


def _lockstep(compiled, steps):
    c, module, example, feeds = compiled
    return train_check.lockstep(c, module, example, feeds, steps)


def _ok(r):
    assert r["vs_unsharded"]["ok"] and r["vs_torch"]["ok"], (r["vs_unsharded"]["why"], r["vs_torch"]["why"])


# ---- gradient clipping ----

CLIP_SPEC = ("mesh tp=2\n0.weight rowwise\ninput x [S(1)]\n"
             "train loss=mse optimizer=sgd(lr=0.1) clip_grad_norm=0.05 input_grads=no steps=2\n")


@pytest.fixture(scope="module")
def clip_case(tmp_path_factory):
    return _compiled(tmp_path_factory.mktemp("clip"), f"{MODELS}:rowwise_linear", CLIP_SPEC)


def test_clip_norm_of_a_split_and_a_replicated_param_equals_torch(clip_case):
    """The exact case: 0.weight split over tp, 0.bias replicated (x arrives split, so the
    weight's gradient is only ever held split). The global norm is one 4-byte all_reduce
    over tp of the weight's partial sum of squares plus the bias's, counted on one rank; the clipped gradients and updated params equal
    torch.nn.utils.clip_grad_norm_ on the unsharded model, and clipping is active."""
    c, module, example, feeds = clip_case
    lay = {n.name: layout_str(n.layout) for n in c.logical.params}
    assert lay["0.weight"] == "[S(1)]" and lay["0.bias"] == "[R]"
    opt = [(r["kind"], r["axis"], r["bytes"]) for r in c.report["collectives"] if r["phase"] == "optimizer"]
    assert opt == [("all_reduce", "tp", 4)]
    assert c.report["training"]["options"]["clip_grad_norm"] == 0.05
    _ok(_lockstep(clip_case, 2))
    _, want = train_check.torch_reference(c, module, example, feeds, 1)
    norm = math.sqrt(sum(float(np.sum(want[f"{p}.grad"].astype(np.float64) ** 2)) for p in ("0.weight", "0.bias")))
    assert norm < 0.05 * (1 + 1e-3), "the clipped gradients' norm is max_norm: clipping is active"


def test_clip_counting_the_replicated_bias_per_rank_is_caught(tmp_path, monkeypatch):
    """The bug peers shipped: a replicated parameter's squares counted once per tp rank. A
    norm built that way fails against torch."""
    real = train_options.clip_gradients

    def doubled(b, grads, max_norm):
        return real(b, {**grads, "0.bias_again": grads["0.bias"]}, max_norm)

    def without_extra(b, grads, max_norm):
        out = doubled(b, grads, max_norm)
        out.pop("0.bias_again")
        return out

    import parcomp.passes.autodiff as ad

    monkeypatch.setattr(ad, "clip_gradients", without_extra)
    r = _lockstep(_compiled(tmp_path, f"{MODELS}:rowwise_linear", CLIP_SPEC), 1)
    assert not r["vs_torch"]["ok"] and train_check.verdict(r["vs_torch"]) == "MISMATCH"


def test_clip_coef_equals_torch():
    """clip_coef is the factor torch.nn.utils.clip_grad_norm_ scales by, and exactly 1 below
    the threshold."""
    import torch

    torch.manual_seed(0)
    grads = [torch.randn(5, 3, dtype=torch.float64), torch.randn(7, dtype=torch.float64)]
    params = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, 1.5)
    want = float(params[0].grad[0, 0] / grads[0][0, 0])
    s = np.float64(sum(float((g * g).sum()) for g in grads))
    got = clip_coef(s, 1.5)
    assert got < 1
    assert_equivalent(got, want, what="clip factor vs torch")
    assert clip_coef(np.float64(0.25), 1.5) == 1.0


# ---- LR schedules ----

SCHEDULES = ["linear(start_factor=0.25, total_iters=4)", "linear(start_factor=0.5, end_factor=0.1, total_iters=3)",
             "cosine(T_max=5)", "cosine(T_max=4, eta_min=0.01, warmup=3, start_factor=0.2)"]


def _cfg(line, mesh="mesh tp=2\n"):
    return train_config(parse(mesh + line + "\n"))


@pytest.mark.parametrize("sched", SCHEDULES)
def test_lr_closed_form_equals_the_torch_scheduler(sched):
    """lr_at(k) is torch.optim.lr_scheduler's lr after k - 1 scheduler steps, past the end
    of warmup and of T_max (cosine goes back up, as torch's does)."""
    import torch

    cfg = _cfg(f"train optimizer=sgd(lr=0.1) lr_schedule={sched}")
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    for k in range(1, 14):
        want = torch_options.make_scheduler(opt, cfg, k).get_last_lr()[0]
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        got = train_options.lr_at(cfg.options.schedule, 0.1, k)
        assert_equivalent(np.float64(got), np.float64(want), what=f"{sched} step {k}")


@pytest.mark.parametrize("sched", SCHEDULES)
def test_lr_factor_in_the_graph_follows_the_step_counter(sched):
    """The graph computes lr_k / lr from its ``step`` input (float32), within float32's tolerance."""
    from parcomp.compile.compiler import compile_graph
    from parcomp.reference.numpy_ops import run_unsharded
    from graphs import mlp_graph

    c = compile_graph(mlp_graph((2, 8), [8, 8], [False], ["relu"]),
                      parse(f"mesh tp=2\ntrain optimizer=sgd(lr=0.1) lr_schedule={sched}\n"))
    g = c.logical
    factor = next(n.name for n in reversed(g.nodes) if n.name.startswith("opt.lr."))
    feeds = {n.name: np.ones(n.type.shape, n.type.dtype) for n in g.nodes if n.op in ("input", "param")}
    cfg = train_config(c.spec)
    for k in range(1, 12):
        feeds["step"] = np.array(float(k), "float32")
        env = {}
        run_unsharded(g, feeds, env=env)
        want = train_options.lr_at(cfg.options.schedule, 0.1, k) / 0.1
        assert_equivalent(env[factor], np.float64(want), what=f"{sched} factor at step {k}")


SCHED_SPEC = ("mesh tp=2\n0.weight colwise\n2.weight rowwise\n"
              "train loss=mse optimizer={opt} lr_schedule={sched} input_grads=no steps=3\n")


@pytest.mark.parametrize("opt,sched", [("sgd(lr=0.1, momentum=0.9)", "linear(start_factor=0.25, total_iters=2)"),
                                       ("adamw(lr=0.01)", "cosine(T_max=2, warmup=1, eta_min=0.001)")])
def test_scheduled_training_equals_torch_lr_scheduler(tmp_path, opt, sched):
    from parcomp.check import training

    case = _compiled(tmp_path, "specs/models.py:torch_mlp", SCHED_SPEC.format(opt=opt, sched=sched))
    _ok(_lockstep(case, 3))
    # torch without the scheduler is a different run: the check sees it
    real = training.make_scheduler
    training.make_scheduler = lambda o, cfg, first=1: None
    try:
        r = _lockstep(case, 3)
    finally:
        training.make_scheduler = real
    assert not r["vs_torch"]["ok"] and r["vs_unsharded"]["ok"]


# ---- gradient accumulation ----

ACC_SPEC = ("mesh dp=2 tp=2\nc_fc.weight colwise over tp\nc_proj.weight rowwise over tp\ninput x [S(0), R]\n"
            "train loss=mse optimizer=adamw(lr=0.01) accumulate=2 batch=4 steps=2 {extra}\n")


def test_accumulation_equals_torch_running_each_microbatch(tmp_path, monkeypatch):
    """accumulate=2 on dp=2 x tp=2 (ZeRO-1): the step's input holds 2 microbatches; the
    gradient is torch's after one backward() per microbatch (loss sum over the global
    count), not torch's on one microbatch."""
    case = _compiled(tmp_path, "specs/models.py:gpt2_mlp", ACC_SPEC.format(extra="zero=1"))
    c, module, example, feeds = case
    assert feeds["x"].shape[0] == 2 * example[0].shape[0]
    assert c.report["training"]["batch_note"] == "global batch 4 = microbatch 1 x accumulate 2 x dp 2"
    _ok(_lockstep(case, 2))
    real = train_check.microbatches
    monkeypatch.setattr(train_check, "microbatches", lambda compiled, data: [real(compiled, data)[0]] * 2)
    r = _lockstep(case, 1)  # torch on microbatch 0 twice: the check sees the other one is missing
    assert not r["vs_torch"]["ok"] and r["vs_unsharded"]["ok"]


def test_accumulated_gradients_are_reduced_once_per_step_not_per_microbatch():
    """Data parallel with a batch where reducing gradients beats gathering activations:
    accumulate=2 reduces each of the 4 parameters' accumulated gradient once (not once per
    microbatch), and equals the unsharded step."""
    from parcomp.compile.compiler import compile_graph
    from parcomp.reference.interpreter import run_spmd
    from parcomp.reference.numpy_ops import run_unsharded
    from graphs import mlp_graph, random_feeds
    from numerics import assert_all_equivalent

    c = compile_graph(mlp_graph((4096, 8), [16, 32, 16], [True, True], ["gelu"]),
                      parse("mesh dp=2\ninput x [S(0)]\ntrain loss=mse optimizer=sgd(lr=0.1) accumulate=2\n"))
    bwd = sorted((r["kind"], r["producer"]) for r in c.report["collectives"] if r["phase"] == "backward")
    assert bwd == [("all_reduce", "bw.grad_bucket0.dp")]  # the 4 accumulated gradients, one bucket
    (bucket,) = c.report["grad_buckets"]["buckets"]
    assert sorted(bucket["members"]) == ["l0.bias", "l0.weight", "l1.bias", "l1.weight"]
    assert sorted(c.program[bucket["all_reduce"].replace(".all_reduce", "")].inputs) == [
        f"bw.{p}.accumulated" for p in ("l0.bias", "l0.weight", "l1.bias", "l1.weight")]
    feeds = random_feeds(c.logical)
    got, want = run_spmd(c.program, feeds).outputs(c.program), run_unsharded(c.logical, feeds)
    assert_all_equivalent(got, want)


CE_SPEC = ("mesh dp=2\ninput x [S(0)]\n"
           "train loss=cross_entropy optimizer=sgd(lr=0.5) accumulate=2 batch=8 steps=2\n")


def test_accumulated_cross_entropy_divides_by_the_labels_counted_in_all_microbatches(tmp_path, monkeypatch):
    """Microbatches with different numbers of ignored labels: the loss is the mean over the
    counted tokens of the global batch (torch: reduction="sum" per microbatch / the global
    count). Each microbatch's own mean, summed, is another step, and the check says so."""
    from parcomp.check import training
    from parcomp.check.microbatches import micro

    c, module, example, feeds = _compiled(tmp_path, f"{MODELS}:classifier", CE_SPEC)
    labels = feeds["labels"].copy()
    labels[[0, 1, 4]] = -100  # microbatch k is rows {2k, 2k+1, 2k+4, 2k+5} (dp=2: D=2 chunks)
    assert [int(np.sum(micro(labels, k, 2, 2) != -100)) for k in (0, 1)] == [1, 4]
    feeds = {**feeds, "labels": labels}
    _ok(train_check.lockstep(c, module, example, feeds, 2))
    real = training.accumulate_backward
    monkeypatch.setattr(training, "accumulate_backward", lambda m, mbs, *a: sum(real(m, [mb], *a) for mb in mbs))
    r = train_check.lockstep(c, module, example, feeds, 1)
    assert not r["vs_torch"]["ok"] and r["vs_unsharded"]["ok"]


# ---- recompute ----

def test_selective_recompute_lowers_saved_activations_and_the_peak_and_changes_no_value():
    """Three GELU layers: their outputs are recomputed in backward (rc.* nodes), so the
    report's saved activations and liveness peak drop; every output of the step equals the
    step without recomputation (same ops on the same values) and the sharded step."""
    from parcomp.compile.compiler import compile_graph
    from parcomp.reference.interpreter import run_spmd
    from parcomp.reference.numpy_ops import run_unsharded
    from graphs import mlp_graph, random_feeds
    from numerics import assert_all_equivalent

    def build(extra):
        g = mlp_graph((64, 8), [16, 64, 64, 64, 16], [True] * 4, ["gelu"] * 3)
        return compile_graph(g, parse("mesh tp=2\nl0.weight colwise\nl1.weight rowwise\n"
                                      f"train loss=mse optimizer=sgd(lr=0.1) input_grads=no {extra}\n"))

    plain, rc = build(""), build("recompute=selective")
    assert sorted(n.name for n in rc.logical.nodes if n.name.startswith("rc.")) == [
        "rc.l0.act", "rc.l1.act", "rc.l2.act"]
    m0, m1 = plain.report["memory_bytes_per_rank"], rc.report["memory_bytes_per_rank"]
    assert m1["saved_activations"] < m0["saved_activations"] and m1["peak_live"] < m0["peak_live"]
    feeds = random_feeds(rc.logical)
    want = run_unsharded(plain.logical, feeds)
    assert_all_equivalent(run_unsharded(rc.logical, feeds), want)
    assert_all_equivalent(run_spmd(rc.program, feeds).outputs(rc.program), want)


# ---- the train line's checks ----

@pytest.mark.parametrize("line,msg", [
    ("train clip_grad_norm=0", "clip_grad_norm=0.0 must be positive"),
    ("train clip_grad_norm=-1", "must be positive"),
    ("train clip_grad_norm=fast", "clip_grad_norm must be a number"),
    ("train lr_schedule=step", "lr_schedule 'step' is not supported; supported: constant, linear, cosine"),
    ("train lr_schedule=cosine()", "lr_schedule cosine needs T_max="),
    ("train lr_schedule=cosine(T_max=0)", "cosine(T_max=0) must not be below 1"),
    ("train lr_schedule=linear(start_factor=0)", "needs 0 < start_factor <= 1"),
    ("train lr_schedule=linear(start_factor=2)", "must be at most 1"),
    ("train lr_schedule=linear(warmup=3)", "lr_schedule linear has no argument 'warmup'"),
    ("train optimizer=sgd(lr=0.01) lr_schedule=cosine(T_max=9, eta_min=0.1)", "is above the optimizer's lr=0.01"),
    ("train accumulate=0", "accumulate=0 is out of range: 1 to 64"),
    ("train accumulate=1.5", "accumulate must be a whole number"),
    ("train clip_grad_nrom=1", "did you mean 'clip_grad_norm'"),
    ("train recompute=layers", "recompute='layers' is not supported; supported: none, selective, all"),
])
def test_option_errors_are_located_at_the_train_line(line, msg):
    with pytest.raises(SpecError) as e:
        parse(f"mesh tp=2\n{line}\n")
    assert msg in str(e.value) and e.value.loc.line == 2


def test_accumulate_errors_name_the_batch_and_input_grads():
    from parcomp.compile.compiler import compile_graph
    from graphs import mlp_graph

    g = mlp_graph((4, 8), [8, 8], [False], ["relu"])
    with pytest.raises(SpecError, match=r"batch=4 but input x f32\[4,8,8\] has batch 4 x accumulate=2 = 8"):
        compile_graph(g, parse("mesh tp=2\ntrain accumulate=2 batch=4\n"))
    with pytest.raises(SpecError, match="accumulate=2 with input_grads=yes"):
        compile_graph(g, parse("mesh tp=2\ntrain accumulate=2 input_grads=yes\n"))


# ---- the emitted program under torchrun (the canonical launches; the rest is interpreter) ----

RUN_SPEC = ("mesh dp=2 tp=2\nc_fc.weight colwise over tp\nc_proj.weight rowwise over tp\ninput x [S(0), R]\n"
            "train loss=mse optimizer=adamw(lr=0.01) clip_grad_norm=0.5 lr_schedule=cosine(T_max=3, warmup=1) "
            "accumulate=2 recompute=selective batch=4 steps=3 zero=1\n")


@pytest.mark.slow
@pytest.mark.parametrize("model,text", [
    ("specs/models.py:gpt2_mlp", RUN_SPEC),  # DP=2 x TP=2, ZeRO-1: all three options at once
    (f"{MODELS}:rowwise_linear", CLIP_SPEC.replace("steps=2", "steps=3")),  # TP=2: clipping's exact case
])
def test_program_py_with_the_options_equals_torch_on_gloo_ranks(tmp_path, capsys, model, text):
    """program.py, 3 steps under torchrun: each step from the unsharded state (--replay) and
    free-running, against torch with clip_grad_norm_, the lr scheduler and per-microbatch
    backward."""
    import json

    from parcomp.cli.main import main

    spec = tmp_path / "t.pcs"
    spec.write_text(text)
    nproc = "4" if "dp=2" in text else "2"
    assert main(["run", model, "--spec", str(spec), "--nproc", nproc, "--json"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["verdict"] == "OK" and last["ok"] and len(last["losses"]) == 3
    assert last["free_running"]["ok"]


# ---- a train option's error points at the option ----

OPTION_TRAIN = "train loss=mse optimizer=sgd(lr=0.1) "


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
    path.write_text("mesh tp=2\nc_fc.weight colwise\nc_proj.weight rowwise\n" + OPTION_TRAIN + opts + "\n")
    with pytest.raises(SpecError, match=message) as e:
        commands.compile_model(SimpleNamespace(model="specs/models.py:gpt2_mlp", spec=str(path)), numeric="check")
    line = (OPTION_TRAIN + opts)
    assert (e.value.loc.line, e.value.loc.col) == (4, line.index(key + "=") + 1)
