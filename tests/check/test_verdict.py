"""How ``parcomp check`` decides (parcomp/check/differential.py; docs/design/check.md, "How check decides").

- the comparison: scale-relative per value and per row, a module's gradients at their
  module's scale, non-finite values matched exactly and then passed, integers exactly, a
  discrete choice on a near tie the one CANNOT VOUCH, naming it;
- ``check`` is OK on every shipped spec, and each fault of tests/faults.py (one collective
  times 1 + 1e-6, a bias added on every rank, one partial sum dropped, two shards swapped)
  injected into its compiled program is a MISMATCH;
- edge cases: AdamW with a tiny eps on a gradient that is zero up to rounding, bf16/fp16
  programs, a skipped fp16 step, a model that overflows, a sharding bug written into the
  program text.
"""
from __future__ import annotations

import functools
import json
from types import SimpleNamespace

import numpy as np
import pytest

from parcomp.check import train_check
from parcomp.check.differential import THRESHOLD, compare, compare_all, near_ties, tie_verdict, verdict
from parcomp.cli import commands
from parcomp.cli.main import main
from parcomp.compile.compiler import compile_graph
from parcomp.ir import parse_graph, print_graph
from parcomp.reference.interpreter import run_spmd
from parcomp.reference.numpy_ops import run_unsharded

from faults import KINDS, SHIPPED, SPECS, injected, model_of, target
from graphs import megatron_spec, mlp_graph, random_feeds
from numerics import assert_program_equivalent
from train_models import MODELS

INF, NAN = np.inf, np.nan


# ---- the comparison -----------------------------------------------------------------------

@pytest.mark.parametrize("got,want", [
    ([1.0, INF], [1.0, 1.0]),       # inf on one side
    ([1.0, 1.0], [NAN, 1.0]),       # NaN on one side
    ([INF, 1.0], [-INF, 1.0]),      # infs of opposite sign
    ([NAN, 1.0], [1.0, NAN]),       # NaNs in different places
])
def test_non_finite_values_that_differ_fail(got, want):
    res = compare(np.array(got), np.array(want))
    assert not res["ok"] and "inf/NaN" in res["why"] and verdict(res) == "MISMATCH"


def test_matching_non_finite_values_pass():
    """A skipped fp16 step's gradients: the same inf and NaN on both sides is right."""
    a = np.array([NAN, -INF, INF, 2.0])
    res = compare(a, a.copy())
    assert res["ok"] and res["nonfinite"] == 3


def test_integers_and_bools_compare_exactly():
    assert compare(np.array([3, 4]), np.array([3, 4]))["ok"]
    assert not compare(np.array([3, 4]), np.array([3, 5]))["ok"]
    assert not compare(np.array([True, False]), np.array([True, True]))["ok"]
    key = np.array([(1 << 62) + 3])  # int64 argmax keys beyond float64's 53 bits
    assert not compare(key, key - 1)["ok"]


def test_the_tolerance_is_relative_to_the_values_scale():
    x = np.linspace(-1, 1, 10) * 1e6
    assert compare(x * (1 + 0.5 * THRESHOLD), x)["ok"]
    assert not compare(x * (1 + 2 * THRESHOLD), x)["ok"]
    assert compare(x * 1e-20 * (1 + 0.5 * THRESHOLD), x * 1e-20)["ok"]  # no absolute floor


def test_an_error_confined_to_a_row_of_small_elements_is_caught():
    """Row 3 of a [64, 64] value is 1e-5 of the others: an error of 1e-6 of that row's own
    scale is 1e-11 of the value's, below the threshold of a per-value scale, and caught at the
    row's scale."""
    rng = np.random.default_rng(0)
    want = rng.standard_normal((64, 64))
    want[3] *= 1e-5
    got = want.copy()
    got[3] *= 1 + 1e-6
    res = compare(got, want)
    assert not res["ok"] and res["worst"][0] == 3, res
    assert compare(got.ravel(), want.ravel())["ok"]  # one row: the value's scale cannot see it


def test_a_gradient_zero_up_to_rounding_is_compared_at_its_modules_scale():
    """A key bias's gradient is zero up to rounding (softmax cancels it): two correct runs
    differ at its own scale by 100%, at its module's (the key weight's gradient) by 1e-16. A
    small but real gradient in a module of its own keeps its own scale."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 8)) * 1e-2
    b = rng.standard_normal(8) * 1e-18
    want = {"attn.k.weight.grad": w, "attn.k.bias.grad": b, "deep.weight.grad": w * 1e-10}
    got = {**want, "attn.k.bias.grad": -b}
    assert compare_all(got, want)["ok"]
    assert not compare(got["attn.k.bias.grad"], b)["ok"]  # alone, at its own scale
    got = {**want, "deep.weight.grad": w * 1e-10 * (1 + 1e-6)}
    assert not compare_all(got, want)["ok"]  # a vanishing gradient's 1e-6 error is seen


ARGMAX = "%x: f64[2,4] = input()\n%i: i64[2] = argmax(%x) {dim=1}\nreturn %i\n"


def test_a_choice_on_a_near_tie_is_cannot_vouch_and_names_the_element():
    g = parse_graph(ARGMAX)
    x = np.array([[1.0, 3.0, 3.0 + 1e-14, 0.0], [1.0, 2.0, 5.0, 0.0]])
    env = {}
    want = run_unsharded(g, {"x": x}, env=env)["i"]
    ties = near_ties(g, env)
    assert len(ties) == 1 and ties[0].startswith("%i (argmax) at [0]"), ties
    wrong = compare(np.array([1, 2]), want)  # the other candidate taken in row 0
    res = tie_verdict(wrong, ties)
    assert verdict(res) == "CANNOT VOUCH" and "%i (argmax) at [0]" in res["why"]
    x[0, 2] = 4.0  # no tie: a different choice is a MISMATCH
    env = {}
    run_unsharded(g, {"x": x}, env=env)
    assert verdict(tie_verdict(wrong, near_ties(g, env))) == "MISMATCH"


# ---- check on every shipped spec, and every fault caught -----------------------------------

@functools.lru_cache(maxsize=None)
def _shipped(name):
    args = SimpleNamespace(model=model_of(name), spec=str(SPECS / f"{name}.pcs"))
    c, module, example = commands.compile_model(args, numeric="check")
    training = bool(c.report.get("training"))
    feeds = (commands.training_feeds(c, module, example, 0) if training
             else commands.feeds_for(c.unsharded, module, example, 0))
    return c, feeds, training


def _verdict(c, feeds, training) -> dict:
    """``check``'s float64 comparison of one step (training) or one forward pass."""
    if training:
        return train_check.lockstep(c, None, None, feeds, 1)["vs_unsharded"]
    return commands.forward_check(c, None, None, feeds)


@pytest.mark.parametrize("name", SHIPPED)
def test_check_is_ok_on_every_shipped_spec(name, capsys):
    """``parcomp check MODEL --spec specs/NAME.pcs``, the 48-block pipeline chain included."""
    rc = main(["check", model_of(name), "--spec", str(SPECS / f"{name}.pcs"), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["verdict"] == "OK", out.get("why")
    assert out["rtol"] == THRESHOLD and out["err_over_tol"] < 1e-2  # noise: far below the threshold


@pytest.mark.parametrize("name", SHIPPED)
def test_every_injected_fault_is_caught_on_every_shipped_spec(name):
    c, feeds, training = _shipped(name)
    assert _verdict(c, feeds, training)["ok"]
    for kind in KINDS:
        with injected(kind, target(c.program, kind)):
            res = _verdict(c, feeds, training)
        assert not res["ok"] and verdict(res) == "MISMATCH", (name, kind)
        assert res["err_over_tol"] > 10, (name, kind, res["err_over_tol"])  # well past the threshold


def _bugged(program_text, bug):
    """The Megatron MLP's local program with a classic sharding bug written in."""
    import re

    ar = re.search(r"^%l1.mm.all_reduce_tp: .*\n", program_text, re.M).group(0)
    add = re.search(r"^%l1.out: .*\n", program_text, re.M).group(0)
    if bug == "bias on both ranks":
        body = ("%bug: f32[4,4] [P] = add(%l1.mm, %l1.bias)\n"
                "%l1.out: f32[4,4] [R] = all_reduce(%bug) {axis=\"tp\"}\n")
        return program_text.replace(ar, "").replace(add, body)
    # one rank's partial sum dropped before the reduction
    drop = "%bug: f32[4,4] [P] = partial_mask(%l1.mm) {axis=\"tp\"}\n"
    return program_text.replace(ar, drop + ar.replace("all_reduce(%l1.mm)", "all_reduce(%bug)"))


@pytest.mark.parametrize("bug", ["bias on both ranks", "partial sum dropped"])
def test_a_sharding_bug_written_into_the_program_is_far_past_the_threshold(bug):
    g = mlp_graph((4,), [4, 8, 4], [True, True], ["relu"])
    c = compile_graph(g, megatron_spec())
    feeds = random_feeds(g)
    assert_program_equivalent(c, feeds)
    bad = parse_graph(_bugged(print_graph(c.program), bug))
    with pytest.raises(AssertionError, match="error/tolerance"):
        assert_program_equivalent(c, feeds, program=bad)


# ---- edge cases ----------------------------------------------------------------------------

KEY_BIAS_MODEL = '''
import torch
from torch import nn


class Attn(nn.Module):
    """One attention block whose key bias gets a gradient that is zero up to rounding."""
    def __init__(self, d=16, heads=4):
        super().__init__()
        self.h = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, s, d = x.shape
        sh = lambda t: t.view(b, s, self.h, d // self.h).transpose(1, 2)
        a = torch.softmax(sh(self.q(x)) @ sh(self.k(x)).transpose(-1, -2) / 2.0, dim=-1) @ sh(self.v(x))
        return self.o(a.transpose(1, 2).reshape(b, s, d))


def attn():
    torch.manual_seed(0)
    return Attn(), (torch.randn(2, 8, 16),)
'''
KEY_BIAS_SPEC = ("mesh tp=2\nq.weight colwise\nk.weight colwise\nv.weight colwise\no.weight rowwise\n"
                 "train loss=mse optimizer=adamw(lr=0.01, eps=1e-30) steps=2\n")


def test_adamw_with_a_tiny_eps_on_a_zero_gradient_is_ok(tmp_path, capsys, monkeypatch):
    """AdamW's first step is lr g / (|g| + eps): with eps = 1e-30 the key bias, whose gradient
    is rounding on both sides (in different orders), moves by +-lr on each side. The
    optimizer's outputs are compared with the unsharded optimizer run on the sharded step's
    own gradients, so check is OK; compared with the unsharded step's own, it is a MISMATCH
    at the key bias (the comparison is what makes the difference)."""
    (tmp_path / "m.py").write_text(KEY_BIAS_MODEL)
    (tmp_path / "s.pcs").write_text(KEY_BIAS_SPEC)
    argv = ["check", f"{tmp_path / 'm.py'}:attn", "--spec", str(tmp_path / "s.pcs"), "--json"]
    assert main(argv) == 0, capsys.readouterr().out[-3000:]
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["verdict"] == "OK" and out["vs_torch"]["ok"]
    real = train_check.optimizer_on
    monkeypatch.setattr(train_check, "optimizer_on", lambda graph, start, grads, env=None: real(
        graph, start, {k: env[v] for k, v in _grad_values(graph).items()}, env))
    assert main(argv) == 1
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["verdict"] == "MISMATCH" and "k.bias" in out["why"], out["why"]


def _grad_values(graph) -> dict:
    """``{"<param>.grad": the value the unsharded step's gradient output copies}``."""
    return {name: graph[v].inputs[0] if graph[v].op == "relayout" else v
            for name, v in graph.named_outputs() if name.endswith(".grad")}


MLP = "specs/models.py:gpt2_mlp"
TP2 = ("mesh tp=2\nc_fc.weight colwise\nc_proj.weight rowwise\ninput x replicated\n"
       "train loss=mse optimizer=adamw(lr=0.01) steps=2 precision={p}\n")


@pytest.mark.parametrize("precision", ["bf16", "fp16 loss_scale=1024"])
def test_a_mixed_precision_program_is_ok_and_a_fault_in_it_is_caught(tmp_path, precision):
    """The float64 check of a bf16/fp16 program (the sharding) and its run in its own precision
    (within that dtype's tolerance) are OK; one collective off by 1e-6 is a MISMATCH in float64,
    far below what bf16/fp16 rounding could show."""
    (tmp_path / "t.pcs").write_text(TP2.format(p=precision))
    c, module, example = commands.compile_model(SimpleNamespace(model=MLP, spec=str(tmp_path / "t.pcs")),
                                           numeric="check")
    feeds = commands.training_feeds(c, module, example, 0)
    r = train_check.lockstep(c, module, example, feeds, 2)
    assert all(r[k]["ok"] for k in ("vs_unsharded", "native", "vs_torch")), r
    with injected("scale", target(c.program, "scale")):
        bad = train_check.lockstep(c, None, None, feeds, 1)["vs_unsharded"]
    assert verdict(bad) == "MISMATCH"


ROWWISE = ("mesh tp=2\n0.weight rowwise\ninput x [S(1)]\n"
           "train loss=mse optimizer=sgd(lr=50) input_grads=no steps=3 precision=fp16 loss_scale=4096\n")


def test_a_skipped_fp16_step_is_ok_when_both_sides_skip_it(tmp_path, capsys):
    """SGD with lr=50 on tp=2: step 2's and 3's scaled fp16 gradients overflow on both sides
    (the same inf/NaN), both skip the step and halve the scale (GradScaler): check is OK, in
    float64 and in float16 (tests/training/test_precision.py pins the skip itself)."""
    (tmp_path / "t.pcs").write_text(ROWWISE)
    argv = ["check", f"{MODELS}:rowwise_linear", "--spec", str(tmp_path / "t.pcs"), "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["verdict"] == "OK" and out["native"]["ok"] and out["vs_torch"]["ok"], out
    c, module, example = commands.compile_model(SimpleNamespace(model=f"{MODELS}:rowwise_linear",
                                                           spec=str(tmp_path / "t.pcs")), numeric="check")
    from parcomp.check.training import numpy_train

    ref = numpy_train(c.logical, commands.training_feeds(c, module, example, 0), 3)
    assert float(ref["state"]["amp.skipped"]) == 2.0  # the unsharded run skipped two steps


def test_check_of_a_model_that_overflows_in_its_own_dtype_is_a_mismatch(tmp_path, capsys):
    """Weights of 1e30: torch's float32 output is inf where the float64 program's is finite;
    the comparison with the model's own framework says so."""
    (tmp_path / "m.py").write_text(
        "import torch\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))\n"
        "    with torch.no_grad():\n"
        "        m[0].weight.mul_(1e30)\n"
        "        m[2].weight.mul_(1e30)\n"
        "    return m, (torch.ones(2, 4),)\n")
    (tmp_path / "s.pcs").write_text("mesh tp=2\n0.weight colwise\n2.weight rowwise\n")
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        code = main(["check", f"{tmp_path / 'm.py'}:make", "--spec", str(tmp_path / "s.pcs")])
    out = capsys.readouterr().out
    assert code == 1 and "MISMATCH" in out and "inf/NaN" in out
    assert not [w for w in seen if issubclass(w.category, RuntimeWarning)]


def test_check_of_an_overflowing_learning_rate_is_an_error(tmp_path, capsys):
    from test_megatron import TINY

    (tmp_path / "tiny.pcir").write_text(TINY)
    (tmp_path / "inf.pcs").write_text("mesh tp=2\nfc1.weight colwise\nfc2.weight rowwise\ninput x replicated\n"
                                      "train optimizer=sgd(lr=1e400)\n")
    code = main(["check", str(tmp_path / "tiny.pcir"), "--spec", str(tmp_path / "inf.pcs")])
    assert code == 2 and "  OK" not in capsys.readouterr().out

