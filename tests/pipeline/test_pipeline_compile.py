"""Compile time of pipeline specs: the layout search never splits a tensor over
``pp`` (stages split the model), and a problem too large for one integer program keeps the
heuristic's plan without calling the solver (the solver would stop at its root with it)."""
import pytest

import parcomp.passes.search.layout_ilp as layout_ilp
import parcomp.passes.shard_prop as shard_prop
from parcomp.compile.compiler import compile_graph
from parcomp.ir.types import R
from parcomp.passes.autodiff import add_training_step
from parcomp.passes.pass_list import bind_layouts
from parcomp.rules.sharding import mesh_strategies

from graphs import mlp_graph, spec

TRAIN = "train loss=mse optimizer=sgd(lr=0.1)\n"


def _strategies(mesh_line):
    s = spec(f"mesh {mesh_line}\n")
    g = bind_layouts(mlp_graph((4,), (8, 8, 8), (True, True), ("gelu",)), s)
    mm = next(n for n in g.nodes if n.op == "matmul")
    return mesh_strategies(mm, [g[i].type for i in mm.inputs], g.mesh), g.mesh


def test_pp_axis_carries_only_the_replicated_strategy():
    with_pp, mesh = _strategies("dp=2 pp=2 tp=2")
    without, _ = _strategies("dp=2 tp=2")
    pp = mesh.names.index("pp")
    assert all(out[pp] == R and all(lay[pp] == R for lay in ins) for ins, out in with_pp)
    # the same choices as on the mesh without pp: pp multiplies nothing
    drop = [(tuple(lay[:pp] + lay[pp + 1:] for lay in ins), out[:pp] + out[pp + 1:]) for ins, out in with_pp]
    assert drop == without


def _train_graph():
    s = spec("mesh dp=2 tp=2\nl0.weight colwise over tp\nl1.weight rowwise over tp\n"
             "input x [S(0), R]\n" + TRAIN)
    g = mlp_graph((4,), (8, 16, 8), (True, True), ("gelu",))
    return g, s


def test_a_problem_over_the_solver_size_keeps_the_heuristic_plan(monkeypatch):
    g, s = _train_graph()
    exact = compile_graph(g, s)
    assert exact.sharded.search["search"] == "ilp"  # small: the solver runs
    calls = []
    monkeypatch.setattr(shard_prop, "solve_ilp", lambda *a, **k: calls.append(a) or pytest.fail("solved"))
    monkeypatch.setattr(layout_ilp, "MAX_STRATEGIES", 10)
    big = compile_graph(g, s)
    assert not calls and big.sharded.search["search"] == "heuristic"
    assert not big.sharded.search["proven_optimal"]
    from parcomp.report.report import format_search

    assert "too many for the integer program" in format_search(big.report["search"])
    assert big.sharded.search["cost_s"] >= exact.sharded.search["cost_s"] - 1e-15


def test_too_large_counts_every_strategy():
    g, s = _train_graph()
    prob = shard_prop.ShardProblem(add_training_step(bind_layouts(g, s), s))
    count = sum(len(o) for o in prob.options.values())
    assert layout_ilp.too_large(prob) == (count > layout_ilp.MAX_STRATEGIES)
    assert 100 < count < layout_ilp.MAX_STRATEGIES  # this graph is under the bound, a 48-block chain over


def test_pipeline_report_has_per_stage_memory_and_one_microbatch_latency():
    from parcomp.passes.pipeline.pipeline_plan import format_pipeline

    g = mlp_graph((8,), (4, 8, 8, 4), (True, True, True), ("relu", "relu"))
    c = compile_graph(g, spec("mesh dp=2 pp=2\ntrain optimizer=sgd(lr=0.1, momentum=0.9) input_grads=no "
                              "microbatches=2\n"))
    rep = c.report["pipeline"]
    total = sum(n.type.nbytes for n in g.params)  # (4*8+8 + 8*8+8 + 8*4+4) floats
    assert total == 592
    assert sum(s["weight_bytes"] for s in rep["stages"]) == total
    assert sum(s["grad_bytes"] for s in rep["stages"]) == total
    assert sum(s["optimizer_state_bytes"] for s in rep["stages"]) == total  # one momentum buffer each
    assert all(s["weight_bytes"] > 0 for s in rep["stages"])
    flops = c.program_.pipeline.stage_flops
    assert rep["latency_one_microbatch"] == pytest.approx(sum(flops) / max(flops))
    assert 1 < rep["latency_one_microbatch"] <= 2
    assert "one microbatch's latency" in format_pipeline(c.report)


@pytest.mark.parametrize("mesh,micro,line", [
    ("pp=2", 4, "global batch 8 = 4 microbatches of 2 x dp 1"),
    ("dp=2 pp=2", 2, "global batch 8 = 2 microbatches of 2 x dp 2"),
    ("pp=2", 1, "global batch 8 = 1 microbatch of 8 x dp 1"),
])
def test_the_batch_line_of_a_pipeline_counts_the_microbatches(mesh, micro, line):
    """check/compile's batch line (format_memory) and report.json's training record say the
    true microbatch size and count: batch = microbatches x microbatch x dp."""
    from parcomp.report.report import format_memory

    g = mlp_graph((8,), (4, 8, 8, 4), (True, True, True), ("relu", "relu"))
    c = compile_graph(g, spec(f"mesh {mesh}\n{TRAIN.strip()} microbatches={micro}\n"))
    t, p = c.report["training"], c.report["pipeline"]
    assert t["batch_note"] == line and line in format_memory(c.report).splitlines()
    assert (t["microbatch_per_dp_rank"], t["microbatches"]) == (p["micro_batch"], micro)
    assert p["micro_batch"] * micro * p["dp"] == t["global_batch"] == 8


@pytest.mark.parametrize("option", [
    "zero=2",
])
def test_a_train_option_the_pipeline_does_not_run_is_refused_at_the_option(option):
    """Every option the pipelined step does not implement is a SpecError at its own column,
    never silently dropped (``precision=bf16`` under pp would compile a float32 program that
    check calls OK)."""
    from parcomp.errors import SpecError

    g = mlp_graph((8,), (4, 8, 8, 4), (True, True, True), ("relu", "relu"))
    line = f"train loss=mse optimizer=sgd(lr=0.1) microbatches=2 {option}"
    with pytest.raises(SpecError) as e:
        compile_graph(g, spec(f"mesh dp=2 pp=2\ninput x [S(0), R]\n{line}\n"))
    key = option.split()[-1].split("=")[0]
    assert f"{key}= is not supported with a pp mesh axis" in str(e.value)
    assert str(e.value).startswith(f"test.pcs:3:{line.index(key + '=') + 1}\n")


def test_a_default_valued_option_and_a_smoothed_loss_under_pp():
    """Writing an option's default is harmless; a cross_entropy option is refused at loss=."""
    from parcomp.errors import SpecError

    g = mlp_graph((8,), (4, 8, 8, 4), (True, True, True), ("relu", "relu"))
    compile_graph(g, spec("mesh pp=2\ntrain loss=mse precision=fp32 accumulate=1 zero=0 microbatches=2\n"))
    with pytest.raises(SpecError, match="loss=cross_entropy\\(label_smoothing=...\\) is not supported"):
        compile_graph(g, spec("mesh pp=2\ntrain loss=cross_entropy(label_smoothing=0.1) microbatches=2\n"))
