"""Gradient bucketing of dp reductions: parcomp/passes/lowering/dp_buckets.py.

The collective lists of the tiny ReLU MLP at dp=2 and of an MLP at dp=2 x tp=2 are pinned,
bucketed and not (``bucket_cap_mb=0``); the interpreter runs the same flatten -> all_reduce
-> unflatten as program.py and must equal the unsharded step; a small cap cuts the
gradients into buckets that start while backward still runs; the cost model keeps large
gradients apart; one torchrun run on 2 gloo ranks equals the unsharded step.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from parcomp.compile.compiler import compile_graph
from parcomp.errors import SpecError
from parcomp.ir import parse_graph
from parcomp.passes.lowering.dp_buckets import costs
from parcomp.reference.interpreter import run_spmd
from parcomp.reference.numpy_ops import run_unsharded
from parcomp.spec import parse_spec

from graphs import mlp_graph, random_feeds, spec
from numerics import assert_all_equivalent

SPECS = Path(__file__).resolve().parents[1].parent / "specs"
# the worked example with a batch of 8, so dp=2 splits it; h pinned split over dp keeps the
# step data-parallel (at this size the search would rather gather x: docs/design/search.md)
TINY_DP2 = ("mesh dp=2\ninput x split-seq\nactivation h split-seq\noutput output split-seq\n"
            "train loss=mse optimizer=sgd(lr=0.1) input_grads=no {extra}\n")
DP_TP = ("mesh dp=2 tp=2\nl0.weight colwise over tp\nl1.weight rowwise over tp\ninput x [S(0), R]\n"
         "train loss=mse optimizer=sgd(lr=0.1, momentum=0.9) {extra}\n")


def tiny(batch=8):
    return parse_graph((SPECS / "tiny_relu_mlp.pcir").read_text().replace("f32[1,", f"f32[{batch},"),
                       "tiny_relu_mlp.pcir")


def dp_collectives(c):
    return [(r["kind"], r["phase"], r["bytes"], r["from"], r["to"])
            for r in c.report["collectives"] if r["axis"] == "dp"]


def equal_to_unsharded(c, seed=0):
    feeds = random_feeds(c.logical, seed)
    run = run_spmd(c.program, feeds)
    assert_all_equivalent(run.outputs(c.program), run_unsharded(c.logical, feeds))
    return run


def test_tiny_relu_mlp_dp2_one_bucket_for_both_gradients():
    c = compile_graph(tiny(), parse_spec(TINY_DP2.format(extra=""), "tiny_dp2.pcs"))
    assert dp_collectives(c) == [("all_reduce", "loss", 4, "[P]", "[R]"),
                                 ("all_reduce", "backward", 64, "[P]", "[R]")]  # 8 + 8 floats, one call
    buckets = c.report["grad_buckets"]
    assert buckets["decision"] == "bucketed" and buckets["unbucketed"] == []
    (b,) = buckets["buckets"]
    assert b["members"] == ["fc2.weight", "fc1.weight"]  # backward order: fc2's gradient comes first
    assert "one all_reduce instead of 2" in b["reason"]
    ops = [n.op for n in c.program.nodes]
    assert ops.count("bucket_cat") == 1 and ops.count("bucket_part") == 2
    run = equal_to_unsharded(c)
    assert [(e["kind"], e["bytes"]) for e in run.log] == [("all_reduce", 4), ("all_reduce", 64)]


def test_tiny_relu_mlp_dp2_per_parameter_when_the_cap_is_zero():
    c = compile_graph(tiny(), parse_spec(TINY_DP2.format(extra="bucket_cap_mb=0"), "tiny_dp2.pcs"))
    assert dp_collectives(c) == [("all_reduce", "loss", 4, "[P]", "[R]"),
                                 ("all_reduce", "backward", 32, "[P]", "[R]"),
                                 ("all_reduce", "backward", 32, "[P]", "[R]")]
    buckets = c.report["grad_buckets"]
    assert buckets["decision"] == "one all_reduce per gradient" and buckets["buckets"] == []
    assert all("bucket_cap_mb=0" in u["reason"] for u in buckets["unbucketed"]) and len(buckets["unbucketed"]) == 2
    assert not any(n.op.startswith("bucket") for n in c.program.nodes)
    equal_to_unsharded(c)


def test_dp2_tp2_tp_split_gradients_share_a_bucket_the_replicated_bias_does_not():
    """One all_reduce reduces over one dp group; the flat buffer is one value with one
    layout: tp-split gradients (any dim) make it [P, S(0)], the row-parallel bias's
    gradient is replicated over tp ([P, R]) and is reduced on its own."""
    c = compile_graph(mlp_graph((4096, 8), [16, 32, 16], [True, True], ["gelu"]), spec(DP_TP.format(extra="")))
    tp = [(r["kind"], r["phase"]) for r in c.report["collectives"] if r["axis"] == "tp"]
    assert tp == [("all_reduce", "forward"), ("all_reduce", "backward")]
    assert dp_collectives(c) == [("all_reduce", "backward", 2112, "[P, S(0)]", "[R, S(0)]"),  # 16x8 x2 + 8
                                 ("all_reduce", "backward", 64, "[P, R]", "[R, R]")]
    # the loss: one all_reduce over the joint dp,tp group
    assert [(r["kind"], r["phase"]) for r in c.report["collectives"] if r["axis"] == "dp,tp"] == [("all_reduce", "loss")]
    (b,) = c.report["grad_buckets"]["buckets"]
    assert b["members"] == ["l1.weight", "l0.bias", "l0.weight"]
    (u,) = c.report["grad_buckets"]["unbucketed"]
    assert u["all_reduce"].startswith("bw.l1.out.sum") and "[P, R]" in u["reason"]
    run = equal_to_unsharded(c)
    got = sorted((e["axis"], e["bytes"]) for e in run.log)
    assert got == sorted((r["axis"], r["bytes"]) for r in c.report["collectives"])  # report = what ran
    per_param = compile_graph(mlp_graph((4096, 8), [16, 32, 16], [True, True], ["gelu"]),
                              spec(DP_TP.format(extra="bucket_cap_mb=0")))
    assert len(dp_collectives(per_param)) == 4  # 4 gradients (the loss goes over dp,tp)


def test_small_cap_buckets_start_while_backward_runs_and_wait_before_the_optimizer():
    g = mlp_graph((4096, 8), [16, 16, 16, 16, 16], [True] * 4, ["relu"] * 3)
    c = compile_graph(g, spec("mesh dp=2\ninput x [S(0)]\ntrain loss=mse optimizer=sgd(lr=0.1) input_grads=no "
                              "bucket_cap_mb=0.002\n"))  # 2097 bytes: a weight (1024) and a bias or two
    buckets = c.report["grad_buckets"]["buckets"]
    assert len(buckets) >= 2 and all(b["bytes_per_rank"] <= 2097 for b in buckets)
    members = [m for b in buckets for m in b["members"]]
    assert members[:2] == ["l3.bias", "l3.weight"]  # backward order
    order = [n.name for n in c.program.nodes]
    first, last = buckets[0]["all_reduce"], buckets[-1]["all_reduce"]
    node = c.program[first]
    assert node.attr("async_op")  # started, waited for later
    wait = order.index(f"{first}.wait")
    grad_l0 = next(i for i, n in enumerate(c.program.nodes) if n.op == "bucket_cat" and n.name in
                   c.program[last].inputs)
    assert order.index(first) < grad_l0 < wait  # started before the last gradients exist
    # the SGD updates are one fused call (group-updates): every bucket is waited for after the
    # backward's last matmul and before that call, which reads them all
    update = min(i for i, n in enumerate(c.program.nodes) if n.phase == "optimizer")
    assert all(n.phase == "optimizer" for n in c.program.nodes[update:])
    for b in buckets:
        at = order.index(f"{b['all_reduce']}.wait")
        reads = [i for i, n in enumerate(c.program.nodes) if n.phase == "optimizer"
                 and any(c.program[x].op == "bucket_part" and c.program[c.program[x].inputs[0]].inputs[0]
                         == b["all_reduce"] for x in n.inputs)]
        assert reads and grad_l0 < at < update
    equal_to_unsharded(c)


def test_cost_model_keeps_gradients_apart_when_copying_costs_more_than_the_calls():
    class M:  # a gradient all_reduce: its local type
        def __init__(self, numel):
            self.type = type("T", (), {"numel": numel, "nbytes": 4 * numel})()

    small, big = [M(1024)] * 3, [M(1 << 24)] * 2
    per, one = costs(small, 2)
    assert one < per  # latency-bound: 3 calls cost more than copying 3k elements
    per, one = costs(big, 2)
    assert one > per  # 2 x 64 MiB: copying 33M elements costs more than one call


def test_large_gradients_alone_are_not_bucketed_and_the_report_says_why():
    g = mlp_graph((4096, 8), [16, 32, 16], [True, True], ["gelu"])
    c = compile_graph(g, spec(DP_TP.format(extra="bucket_cap_mb=0.0001")))  # 104 bytes
    notes = [u["reason"] for u in c.report["grad_buckets"]["unbucketed"]]
    assert any("larger than the bucket cap" in n for n in notes)
    equal_to_unsharded(c)


@pytest.mark.parametrize("value", ["-1", "off", "2e6"])
def test_bad_cap_is_a_located_spec_error(value):
    text = TINY_DP2.format(extra=f"bucket_cap_mb={value}")
    with pytest.raises(SpecError, match="bucket_cap_mb") as e:
        compile_graph(tiny(), parse_spec(text, "tiny_dp2.pcs"))
    line = text.splitlines()[4]
    assert e.value.loc.line == 5 and line[e.value.loc.col - 1:].startswith("bucket_cap_mb")


@pytest.mark.slow
def test_bucketed_dp2_step_on_two_gloo_ranks_equals_unsharded(tmp_path):
    torch = pytest.importorskip("torch")
    from parcomp_backends.torch import assemble_training_outputs, run_torchrun
    from parcomp_backends.torch.launch import write_program

    c = compile_graph(tiny(), parse_spec(TINY_DP2.format(extra=""), "tiny_dp2.pcs"))
    feeds = random_feeds(c.logical, 3)
    write_program(c, tmp_path, "cpu")
    params = {n.name: torch.from_numpy(feeds[n.name]) for n in c.logical.params}
    inputs = {n.name: torch.from_numpy(feeds[n.name]) for n in c.logical.inputs}
    res = run_torchrun(tmp_path, 2, params, inputs, tmp_path / "out.pt", ("--device", "cpu", "--steps", "1"),
                       timeout=120)
    assert res.returncode == 0, res.stderr[-4000:]
    out, losses = assemble_training_outputs(tmp_path / "out.pt", c.program)
    text = (tmp_path / "program.py").read_text()
    assert "gradient bucket 1 of 1 over dp" in text and "torch.cat([" in text
    want = run_unsharded(c.logical, feeds)
    got = {k: v for k, v in out.items()}
    assert_all_equivalent(got, want)
    np.testing.assert_allclose(losses[0], got["loss"], rtol=0, atol=0)
