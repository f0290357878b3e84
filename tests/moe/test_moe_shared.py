"""Shared experts (Qwen-MoE) and dp x ep: specs/models.py:moe_block_shared equals
transformers' Qwen2MoeSparseMoeBlock; its ep=2 and dp=2 x ep=2 training steps equal the
unsharded step, with the exact collectives: the tokens travel by all_to_all over ep (on dp x ep
too, where dp splits the same rows), the routed experts' gradients are reduced over dp only,
the router's and the shared expert's over the joint dp,ep group."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from parcomp.check.differential import verdict
from parcomp.check.train_check import lockstep, train_feeds
from parcomp.cli.commands import feeds_for
from parcomp.cli.main import main
from parcomp.compile.compiler import compile_graph
from parcomp.frontends.loader import load_model
from parcomp.frontends.torch.export import import_torch
from parcomp.ir import parse_graph
from parcomp.spec import load_spec, parse_spec

from moe_cases import MoeCase, feeds, model_text, spec_text
from numerics import assert_equivalent, assert_check_ok

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..")
MODELS = os.path.join(ROOT, "specs", "models.py")
SPECS = os.path.join(ROOT, "specs")
sys.path.insert(0, SPECS)
import models  # noqa: E402

SHARED = ["shared_expert.gate_proj.weight", "shared_expert.up_proj.weight", "shared_expert.down_proj.weight",
          "shared_expert_gate.weight"]


@pytest.mark.parametrize("routing", ["random", "skewed"])
def test_moe_block_shared_equals_transformers_qwen2_moe_forward_and_backward(routing):
    """Output and every gradient of an MSE step of our block against transformers'
    Qwen2MoeSparseMoeBlock (norm_topk_prob=True), within float32's tolerance. As for Mixtral
    (test_moe.py), Qwen's router logits' gradient off the top-k is a float32 rounding residue
    (0 in exact arithmetic, exactly 0 in ours), far below the gradients' scale."""
    qwen = models.qwen_moe()
    ours, (x,), _ = models.moe_block_shared(routing)
    if routing == "skewed":
        models.skew_routing(qwen, x.clone())
    module, example, names = models.moe_block_shared(routing)  # the same block, for the feeds
    graph = import_torch(module, example, names)
    c = compile_graph(graph, load_spec(os.path.join(SPECS, "moe_shared_ep2_train.pcs")))
    f = train_feeds(c, module, example, 0, feeds_for)
    got = {}
    for name, m in (("qwen", qwen), ("ours", ours)):
        xx = torch.from_numpy(f["x"]).requires_grad_(True)
        m.zero_grad()
        out = m(xx)
        torch.nn.functional.mse_loss(out, torch.from_numpy(f["target"])).backward()
        got[name] = out.detach().numpy(), xx.grad.numpy(), {k: p.grad.numpy() for k, p in m.named_parameters()}
    assert_equivalent(got["ours"][0], got["qwen"][0], what="output")
    assert_equivalent(got["ours"][1], got["qwen"][1], what="x.grad")
    gu, f_ = got["qwen"][2]["experts.gate_up_proj"], ours.experts.gate_proj.shape[1]
    want = {**got["qwen"][2], "experts.gate_proj": gu[:, :f_], "experts.up_proj": gu[:, f_:]}
    for name, g in got["ours"][2].items():
        assert_equivalent(g, want[name], what=name + ".grad")
    assert set(SHARED) <= set(got["ours"][2])


def _collectives(spec):
    graph, _, _ = load_model(f"{MODELS}:moe_block_shared")
    c = compile_graph(graph, load_spec(os.path.join(SPECS, spec)))
    return c, [(e["kind"], e["axis"], e["phase"], e["name"]) for e in c.report["collectives"]]


# dp=2 x ep=2: the tokens' all_to_all over ep both ways (forward, and their gradients backward);
# the loss summed over every rank; one dp bucket of the routed experts' gradients; the router's
# (linear_4) and the shared expert's (linear_1..3) and its gate's (linear) over dp,ep
DP2_EP2 = [("all_to_all", "ep", "forward", "moe_dispatch.all_to_all_ep"),
           ("all_to_all", "ep", "forward", "reshape_1.all_to_all_ep"),
           ("all_reduce", "dp,ep", "loss", "loss.sum.all_reduce_dp_ep"),
           ("all_to_all", "ep", "backward", "bw.moe_combine.moe_dispatch.all_to_all_ep"),
           ("all_reduce", "dp", "backward", "bw.grad_bucket0.dp.all_reduce"),
           ("all_to_all", "ep", "backward", "bw.reshape.reshape.all_to_all_ep"),
           ("all_reduce", "dp,ep", "backward", "bw.linear_4.matmul_2.all_reduce_dp_ep"),
           ("all_reduce", "dp,ep", "backward", "bw.linear_3.matmul_2.all_reduce_dp_ep"),
           ("all_reduce", "dp,ep", "backward", "bw.linear_2.matmul_2.all_reduce_dp_ep"),
           ("all_reduce", "dp,ep", "backward", "bw.linear_1.matmul_2.all_reduce_dp_ep"),
           ("all_reduce", "dp,ep", "backward", "bw.linear.matmul_2.all_reduce_dp_ep")]


def test_dp2_ep2_collectives_pinned():
    """The exact collectives of dp=2 x ep=2: the routed experts' gradients in one bucket over
    dp (never over ep), every replicated weight's (router, shared expert, its gate) over the
    joint dp,ep group, the tokens by the ragged all_to_all over ep, no gather of them."""
    c, got = _collectives("moe_shared_dp2_ep2_train.pcs")
    assert got == DP2_EP2
    (bucket,) = c.report["grad_buckets"]["buckets"]
    assert bucket["axis"] == "dp" and sorted(bucket["members"]) == ["experts.down_proj", "experts.gate_proj",
                                                                     "experts.up_proj"]
    reduced = {n.inputs[0]: n.attr("axis") for n in c.sharded.nodes if n.op == "all_reduce"}
    grads = {p: next((ax for v, ax in reduced.items() if v.startswith(f"bw.{w}.")), None)
             for p, w in (("gate.weight", "linear_4"), ("shared_expert_gate.weight", "linear"),
                          ("shared_expert.gate_proj.weight", "linear_1"), ("shared_expert.up_proj.weight", "linear_2"),
                          ("shared_expert.down_proj.weight", "linear_3"))}
    assert all(ax == "dp,ep" for ax in grads.values()), grads
    ragged = [n.name for n in c.program.nodes if n.op == "all_to_all" and n.attr("ragged")]
    assert len(ragged) == 4  # all four token exchanges send only the routed rows


@pytest.mark.parametrize("spec", ["moe_shared_ep2_train.pcs", "moe_shared_dp2_ep2_train.pcs"])
def test_shared_expert_specs_train_like_unsharded_on_the_interpreter(capsys, spec):
    rc = main(["check", f"{MODELS}:moe_block_shared", "--spec", os.path.join(SPECS, spec), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["verdict"] == "OK", out.get("why")
    assert_check_ok(out)
    fwd = [(c["kind"], c["axis"]) for c in out["collectives"] if c["phase"] == "forward"]
    assert fwd.count(("all_to_all", "ep")) == 2  # the tokens to their experts and back


@pytest.mark.slow
def test_shared_expert_dp2_ep2_trains_under_torchrun_like_unsharded(capsys):
    """dp=2 x ep=2 on 4 gloo ranks: the ragged all_to_all inside each ep group of a dp x ep mesh."""
    rc = main(["run", f"{MODELS}:moe_block_shared", "--spec", os.path.join(SPECS, "moe_shared_dp2_ep2_train.pcs"),
               "--nproc", "4", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["verdict"] == "OK" and out["world_size"] == 4, out.get("why")
    assert np.isfinite(out["err_over_tol"])


@settings(max_examples=6 if os.environ.get("CI") else 20, deadline=None)
@given(st.sampled_from([1, 2]), st.integers(1, 4), st.sampled_from([0, 1, 2]), st.sampled_from([0.0, 3.0]),
       st.integers(0, 3))
def test_random_dp2_ep2_steps_exchange_tokens_by_all_to_all_and_equal_unsharded(per, top_k, capacity, skew, seed):
    """dp=2 x ep=2 over expert counts, top-k, capacities and routings: the tokens travel by
    all_to_all over ep (never gathered over ep), the step equals the unsharded one. top_k < E
    (with k = E the router's gradient is zero up to rounding, in a module of its own: see
    test_moe.py)."""
    experts = 2 * per
    case = MoeCase(experts=experts, top_k=min(top_k, experts - 1), batch=4, seq=4, hidden=4, inter=4,
                   capacity=capacity, ep=2, dp=2, skew=skew)
    c = compile_graph(parse_graph(model_text(case)), parse_spec(spec_text(case), "case.pcs"))
    f = feeds(c.logical, case, seed)
    r = lockstep(c, None, None, f, 1)["vs_unsharded"]  # in float64, as `parcomp check`
    assert verdict(r) == "OK", (case, r["why"])
    fwd = [(e["kind"], e["axis"]) for e in c.report["collectives"] if e["phase"] == "forward"]
    assert fwd.count(("all_to_all", "ep")) == 2 and ("all_gather", "ep") not in fwd, fwd
