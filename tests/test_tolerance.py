"""The error bounds behind every numerical comparison (parcomp/tolerance.py, parcomp/rules/error.py).

- every op that computes has an error rule;
- the bound is sound: float32 runs stay within it of the same graph run in float64;
- it is tight enough to catch real sharding bugs by orders of magnitude;
- inf/NaN never pass unless both sides match exactly, and ``check`` never calls an
  overflowed result OK.
"""
import re

import numpy as np
import pytest
from hypothesis import given, strategies as st

from parcomp.cli import main
from parcomp.compiler import compile_graph
from parcomp.ir import parse_graph, print_graph
from parcomp.ir.ops import OPS
from parcomp.reference.interpreter import run_spmd
from parcomp.reference.numpy_ops import run_unsharded
from parcomp.reference.training import data_for, numpy_train
from parcomp.rules.error import ERROR_RULES
from parcomp.tolerance import compare, loss_errors, output_bounds, propagate, training_bounds

from graphs import megatron_spec, mlp_graph, random_feeds, spec
from test_properties import mlp_case
from test_training import _feeds, train_case

NO_COMPUTE = ("source", "collective", "local")


def test_every_computing_op_has_an_error_rule():
    missing = sorted(op for op, d in OPS.items() if d.kind not in NO_COMPUTE and op not in ERROR_RULES)
    assert not missing, f"ops without an error rule in parcomp/rules/error.py: {missing}"
    assert not set(ERROR_RULES) - set(OPS), "error rules for ops that do not exist"


def _in_float64(graph):
    return parse_graph(print_graph(graph).replace("f32[", "f64["))


def _within_bound(graph, feeds):
    """max over outputs of |f32 - f64| / (bound_f32 + bound_f64): <= 1 if the rules are sound."""
    env32, err32 = propagate(graph, feeds)
    g64 = _in_float64(graph)
    env64, err64 = propagate(g64, {k: np.asarray(v, np.float64) if np.asarray(v).dtype.kind == "f" else v
                                   for k, v in feeds.items()})
    worst = 0.0
    for _, v in graph.named_outputs():
        err = np.abs(env32[v].astype(np.float64) - env64[v])
        bound = err32[v] + err64[v]
        assert np.all(np.isfinite(bound)), v
        worst = max(worst, float(np.max(np.where(err > 0, err / np.where(bound > 0, bound, 1e-300), 0.0))))
    return worst


@given(mlp_case(), st.integers(0, 2**16), st.sampled_from([0.1, 1.0, 30.0]))
def test_forward_bound_holds_against_float64(case, seed, scale):
    g, text = case
    c = compile_graph(g, spec(text))
    assert _within_bound(c.logical, random_feeds(g, seed, scale)) <= 1.0


@given(train_case(), st.integers(0, 2**16))
def test_training_step_bound_holds_against_float64(case, seed):
    g, text = case
    c = compile_graph(g, spec(text))
    feeds = _feeds(c, seed)
    if "labels" in feeds:
        feeds["labels"] = np.random.default_rng(seed).integers(0, 4, c.logical["labels"].type.shape)
    assert _within_bound(c.logical, feeds) <= 1.0


@given(train_case(), st.integers(0, 2**16))
def test_three_training_steps_stay_within_the_carried_bound(case, seed):
    """From zero optimizer state (as check/run train), the float32 steps stay within
    training_bounds of the float64 steps: losses of every step and the final outputs."""
    g, text = case
    c = compile_graph(g, spec(text))
    feeds = random_feeds(c.unsharded, seed)
    feeds.update(data_for(c.logical, seed))
    f64 = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in feeds.items()}
    run32, run64 = numpy_train(c.logical, feeds, 3), numpy_train(_in_float64(c.logical), f64, 3)
    bounds = training_bounds(c.logical, feeds, 3)
    assert np.all(np.abs(np.subtract(run32["losses"], run64["losses"])) <= bounds["losses"])
    for k, want in run64["outputs"].items():
        assert np.all(np.abs(run32["outputs"][k] - want) <= bounds["outputs"][k]), k


def test_bound_grows_with_the_computation():
    """Not a fixed number: scaling the weights by 10 scales a 2-matmul output's bound by ~100."""
    g = mlp_graph((2, 8), [16, 64, 16], [False, False], ["none"])
    feeds = random_feeds(g)
    big = {k: v * (10 if "weight" in k else 1) for k, v in feeds.items()}
    ratio = output_bounds(g, big)["output"].max() / output_bounds(g, feeds)["output"].max()
    assert 90 < ratio < 110


def _bugged(program_text, bug):
    """The Megatron MLP's local program with a classic sharding bug written in."""
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
def test_a_real_sharding_bug_exceeds_the_bound_by_orders_of_magnitude(bug):
    g = mlp_graph((4,), [4, 8, 4], [True, True], ["relu"])
    c = compile_graph(g, megatron_spec())
    feeds = random_feeds(g)
    want, bound = run_unsharded(g, feeds)["output"], output_bounds(c.logical, feeds)["output"]
    good = run_spmd(c.program, feeds).outputs(c.program)["output"]
    assert compare(good, want, bound)["ok"]
    bad = parse_graph(_bugged(print_graph(c.program), bug))
    res = compare(run_spmd(bad, feeds).outputs(bad)["output"], want, bound)
    assert not res["ok"] and res["err_over_tol"] > 1e3, res


INF, NAN = np.inf, np.nan


@pytest.mark.parametrize("got,want", [
    ([1.0, INF], [1.0, 1.0]),       # inf on one side
    ([1.0, 1.0], [NAN, 1.0]),       # NaN on one side
    ([INF, 1.0], [-INF, 1.0]),      # infs of opposite sign
    ([NAN, 1.0], [1.0, NAN]),       # NaNs in different places
    ([INF, 1.0], [INF, 1.0]),       # the same inf: matches, but an overflowed check proves nothing
])
def test_inf_and_nan_never_pass(got, want):
    res = compare(np.array(got, "f4"), np.array(want, "f4"), np.full(2, 1e30))
    assert not res["ok"] and res["why"]


def test_matching_nonfinite_values_pass_only_when_allowed():
    a = np.array([NAN, -INF, 2.0], "f4")
    assert compare(a, a.copy(), 0.0, allow_nonfinite=True)["ok"]
    assert not compare(a, a.copy(), 0.0)["ok"]
    assert not compare(a, np.array([NAN, INF, 2.0], "f4"), 0.0, allow_nonfinite=True)["ok"]


def test_an_error_where_nothing_is_allowed_fails():
    assert not compare(np.array([1.0]), np.array([1.0 + 1e-12]), 0.0)["ok"]
    assert compare(np.array([1.0]), np.array([1.0]), 0.0)["ok"]
    assert not compare(np.array([1.0]), np.array([2.0]), np.inf)["ok"]  # no finite bound: no vouching


def test_losses_need_one_per_step_and_each_within_its_bound():
    assert loss_errors([1.0, 0.5], [1.0, 0.5], [1e-7, 1e-7])["ok"]
    assert not loss_errors([1.0], [1.0, 0.5], [1e-7, 1e-7])["ok"]
    assert not loss_errors([1.0, 0.5 + 1e-3], [1.0, 0.5], [1e-7, 1e-7])["ok"]


def test_training_bounds_carry_the_state_through_steps():
    g = mlp_graph((4, 2), [4, 8, 4], [True, True], ["tanh"])
    c = compile_graph(g, spec("mesh tp=2\nl0.weight colwise\nl1.weight rowwise\ninput x replicated\n"
                              "train loss=mse optimizer=sgd(lr=0.1, momentum=0.9)\n"))
    feeds = random_feeds(c.logical)
    one, three = training_bounds(c.logical, feeds, 1), training_bounds(c.logical, feeds, 3)
    assert len(three["losses"]) == 3 and three["losses"][0] == one["losses"][0]
    assert np.all(three["outputs"]["l0.weight"] >= 0) and three["outputs"]["l0.weight"].max() > \
        one["outputs"]["l0.weight"].max()


TINY_SPEC = "mesh tp=2\nfc1.weight colwise\nfc2.weight rowwise\ninput x replicated\n"


def test_check_of_an_overflowing_training_step_is_not_ok(tmp_path, capsys):
    from test_megatron import TINY

    (tmp_path / "tiny.pcir").write_text(TINY)
    (tmp_path / "inf.pcs").write_text(TINY_SPEC + "train optimizer=sgd(lr=1e400)\n")
    code = main(["check", str(tmp_path / "tiny.pcir"), "--spec", str(tmp_path / "inf.pcs")])
    out = capsys.readouterr().out
    assert code != 0 and "  OK" not in out  # an error (lr out of range) or a MISMATCH, never OK


def test_check_of_a_model_that_overflows_is_not_ok(tmp_path, capsys):
    pytest.importorskip("torch")
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
    # the verdict says it; numpy's overflow warnings would only repeat it as noise
    assert not [w for w in seen if issubclass(w.category, RuntimeWarning)]


WIDE = {  # op: attrs; every pointwise op, 4096 values per scale, torch's kernel against numpy's
    "gelu": {}, "gelu_grad": {"approximate": "tanh"}, "tanh": {}, "exp": {}, "sigmoid": {}, "silu": {},
    "pow": {"exponent": 3.0}, "silu_grad": {}, "tanh_grad": {}, "sigmoid_grad": {}, "relu_grad": {},
    "pow_grad": {"exponent": 3.0}, "add_scalar": {"value": 0.1}, "scale": {"value": 0.3},
}


@pytest.mark.parametrize("op", sorted(WIDE))
def test_torch_kernels_stay_within_the_rule_over_a_wide_range(op):
    """The few ulps charged to exp/tanh/erf/... cover torch's kernels, not just numpy's."""
    torch = pytest.importorskip("torch")
    from parcomp.ir import Node, TensorType, make_attrs
    from parcomp.tolerance import op_bound
    from parcomp_backends.torch.emit import _code

    rng = np.random.default_rng(0)
    for scale in (0.01, 1.0, 5.0, 30.0):
        xs = [(rng.standard_normal(4096) * scale).astype("f4") for _ in range(2 if "_grad" in op else 1)]
        if op == "exp":
            xs[0] = np.clip(xs[0], -80, 80)  # finite in float32
        if op == "tanh_grad":  # the second operand is the forward output
            xs[1] = np.tanh(xs[1])
        if op == "sigmoid_grad":
            xs[1] = (1 / (1 + np.exp(-xs[1].astype("f8")))).astype("f4")
        names = [f"a{i}" for i in range(len(xs))]
        node = Node("y", op, tuple(names), TensorType((4096,)), make_attrs(**WIDE[op]))
        env = {"torch": torch, "DEVICE": torch.device("cpu")}
        env.update({a: torch.tensor(x) for a, x in zip(names, xs)})
        got = eval(_code(node, names), env).numpy()  # noqa: S307 - our own table
        want, bound = op_bound(node, xs)
        res = compare(got, want, bound)
        assert res["ok"] and res["err_over_tol"] < 0.5, (scale, res)
