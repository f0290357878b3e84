"""Expert parallel MoE: Mixtral's block through the MoE ops, ep=2 / ep=2 x tp=2 /
dp x ep training steps on the interpreter and under torchrun, the ragged all_to_all, and
hypothesis over expert counts, top-k, capacities and routings."""
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
from parcomp.ir import parse_graph
from parcomp.reference import moe_ops
from parcomp.reference.interpreter import _LAYOUT_OPS, run_spmd
from parcomp.spec import parse_spec

from moe_cases import MoeCase, feeds, model_text, spec_text
from numerics import assert_equivalent, assert_check_ok

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..")
MODELS = os.path.join(ROOT, "specs", "models.py")
SPECS = os.path.join(ROOT, "specs")
MAX_EXAMPLES = 10 if os.environ.get("CI") else 30
sys.path.insert(0, SPECS)
import models  # noqa: E402


def _spec(name):
    path = os.path.join(SPECS, name)
    with open(path) as f:
        return parse_spec(f.read(), path)


def _mixtral_and_ours(routing):
    moe = models.mixtral_moe()
    ours, (x,), _ = models.moe_block(routing)
    if routing == "skewed":
        models.skew_routing(moe, x.clone())
    return moe, ours, x


@pytest.mark.parametrize("routing", ["random", "skewed"])
def test_moe_block_equals_transformers_mixtral_forward_and_backward(routing):
    """specs/models.py:moe_block (the MoE custom ops) computes transformers'
    MixtralSparseMoeBlock: outputs and every gradient of an MSE step, within float32's tolerance.

    Mixtral differentiates softmax over all experts, then the top-k renormalisation: the
    router logits' gradient off the top-k is 0 in exact arithmetic but a rounding residue in
    float32 (ours is exactly 0), far below the gradients' scale."""
    moe, ours, x = _mixtral_and_ours(routing)
    graph, module, example = load_model(f"{MODELS}:moe_block" + ("_skewed" if routing == "skewed" else ""))
    c = compile_graph(graph, _spec("moe_ep2_train.pcs"))
    f = train_feeds(c, module, example, 0, feeds_for)
    target = torch.from_numpy(f["target"])
    got = {}
    for name, m in (("mixtral", moe), ("ours", ours)):
        xx = torch.from_numpy(f["x"]).requires_grad_(True)
        m.zero_grad()
        out = m(xx)
        torch.nn.functional.mse_loss(out, target).backward()
        got[name] = out.detach().numpy(), xx.grad.numpy()
    assert_equivalent(got["ours"][0], got["mixtral"][0], what="output")
    assert_equivalent(got["ours"][1], got["mixtral"][1], what="x.grad")
    gu, f_ = moe.experts.gate_up_proj.grad.numpy(), ours.experts.gate_proj.shape[1]
    pairs = {"gate.weight": moe.gate.weight.grad.numpy(), "experts.gate_proj": gu[:, :f_],
             "experts.up_proj": gu[:, f_:], "experts.down_proj": moe.experts.down_proj.grad.numpy()}
    for name, want in pairs.items():
        mine = dict(ours.named_parameters())[name].grad.numpy()
        assert_equivalent(mine, want, what=name + ".grad")


def test_skewed_routing_starves_one_expert_and_floods_another():
    _, ours, x = _mixtral_and_ours("skewed")
    c = moe_ops.route(torch.nn.functional.linear(x, ours.gate.weight).detach().numpy(), 2)
    tokens = (c != 0).sum(axis=(0, 1))
    assert tokens[-1] == 0 and tokens[0] >= 0.9 * x.shape[0] * x.shape[1], tokens


def test_export_keeps_routing_dispatch_and_combine_as_single_ops():
    graph, _, _ = load_model(f"{MODELS}:moe_block")
    ops = [n.op for n in graph.nodes]
    assert ops.count("moe_route") == ops.count("moe_dispatch") == ops.count("moe_combine") == 1


def _collectives(c):
    return [(e["kind"], e["axis"], e["phase"]) for e in c.report["collectives"]]


# each ep rank keeps its own batch rows (parcomp/passes/search/keep_dp.py: ep splits the batch as dp
# does): the tokens go to their experts and back by all_to_all both ways, forward and backward,
# the loss's sum and the router's gradient are summed over the joint ep,tp group, no row is gathered
# tp's all_reduce of the experts' down_proj output runs before the all_to_all back (on the
# rows each ep rank got), not after it: the same 4,096 bytes and the same search estimate
# (804.7 us, proven optimal) either way; the integer program's pairwise read terms
# (layout_ilp.tighten) make HiGHS reach this one of the equal-cost optima
EP2_TP2 = [("all_to_all", "ep", "forward"), ("all_reduce", "tp", "forward"), ("all_to_all", "ep", "forward"),
           ("all_reduce", "ep,tp", "loss"), ("all_to_all", "ep", "backward"), ("all_to_all", "ep", "backward"),
           ("all_reduce", "ep,tp", "backward"), ("all_reduce", "tp", "backward")]


@pytest.mark.parametrize("spec,factory", [("moe_ep2_train.pcs", "moe_block"), ("moe_ep2_train.pcs", "moe_block_skewed"),
                                          ("moe_ep2_tp2_train.pcs", "moe_block_skewed")])
def test_moe_specs_train_like_unsharded_on_the_interpreter(capsys, spec, factory):
    """ep=2 (random and skewed routing) and ep=2 x tp=2 (skewed; its collectives pinned: the
    ep all_to_all pair, tp's all_reduce of the row-parallel down_proj output forward, dx
    summed over the joint ep,tp group backward)."""
    rc = main(["check", f"{MODELS}:{factory}", "--spec", os.path.join(SPECS, spec), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["verdict"] == "OK", out.get("why")
    assert_check_ok(out)
    fwd = [(c["kind"], c["axis"]) for c in out["collectives"] if c["phase"] == "forward"]
    assert [f for f in fwd if f[0] == "all_to_all"][:2] == [("all_to_all", "ep")] * 2  # tokens to experts and back
    if "tp2" in spec:
        assert [(c["kind"], c["axis"], c["phase"]) for c in out["collectives"]] == EP2_TP2


def test_ep2_collectives_pinned():
    """ep=2: two ragged all_to_all forward and their transposes backward, the loss's sum and the
    router's gradient all_reduced over ep, no expert weight's gradient reduced over ep (each rank
    owns its experts), no batch row gathered (each ep rank keeps its own rows)."""
    graph, _, _ = load_model(f"{MODELS}:moe_block")
    c = compile_graph(graph, _spec("moe_ep2_train.pcs"))
    assert _collectives(c) == [("all_to_all", "ep", "forward"), ("all_to_all", "ep", "forward"),
                               ("all_reduce", "ep", "loss"), ("all_to_all", "ep", "backward"),
                               ("all_to_all", "ep", "backward"), ("all_reduce", "ep", "backward")]
    ragged = [n.name for n in c.program.nodes if n.op == "all_to_all" and n.attr("ragged")]
    assert len(ragged) == 4
    assert [e["name"] for e in c.report["collectives"] if "ragged: only the routed" in e["reason"]] == ragged
    reduced = [e["name"] for e in c.report["collectives"] if e["kind"] == "all_reduce" and e["phase"] == "backward"]
    assert reduced == ["bw.linear.matmul_2.all_reduce_ep"]  # gate.weight's gradient only


def _check_case(case: MoeCase, seed: int):
    c = compile_graph(parse_graph(model_text(case)), parse_spec(spec_text(case), "case.pcs"))
    f = feeds(c.logical, case, seed)
    r = lockstep(c, None, None, f, 1)["vs_unsharded"]  # in float64, as `parcomp check`
    assert verdict(r) == "OK", (case, r["why"])
    return c


@st.composite
def cases(draw):
    ep = draw(st.sampled_from([2, 4]))
    experts = ep * draw(st.sampled_from([1, 2]))
    skew = draw(st.sampled_from([0.0, 0.0, 1.0, 3.0]))
    # top_k = E under a skewed router: the router's gradient is zero up to rounding (every
    # expert kept, the weights renormalised), and the router is a module of its own: no scale
    # but its rounding to compare it at (docs/design/check.md, "How check decides"), so k < E there
    top_k = draw(st.integers(1, max(1, experts - 1) if skew else experts))
    seq = draw(st.sampled_from([3, 4, 6]))
    return MoeCase(experts=experts, top_k=top_k, batch=ep * draw(st.sampled_from([1, 2])), seq=seq,
                   hidden=draw(st.sampled_from([4, 8])), inter=draw(st.sampled_from([4, 8])),
                   capacity=draw(st.sampled_from([0, 1, 2, seq])), ep=ep, skew=skew)


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(cases(), st.integers(0, 3))
def test_random_moe_ep_training_step_equals_unsharded(case, seed):
    _check_case(case, seed)


def test_dp2_ep2_expert_gradients_never_reduced_over_ep():
    """dp=2 x ep=2: the router's gradient is summed over dp and ep; no expert weight's
    gradient is reduced over ep (dp inside ep). The step equals the unsharded one."""
    c = _check_case(MoeCase(experts=4, top_k=2, batch=8, seq=4, hidden=8, inter=8, capacity=2, ep=2, dp=2), 0)
    grads = [(e["name"], e["axis"], e["kind"]) for e in c.report["collectives"]
             if e["phase"] == "backward" and e["kind"] in ("all_reduce", "reduce_scatter")]
    assert not [g for g in grads if "experts" in g[0] and "ep" in g[1].split(",")], grads
    # the expert weights' gradients: one dp bucket, never over ep
    buckets = c.report["grad_buckets"]["buckets"]
    assert [(b["axis"], sorted(b["members"])) for b in buckets] == [
        ("dp", ["experts.down_proj", "experts.gate_proj", "experts.up_proj"])]
    # the router's gradient (from the logits' gradient) is the one all_reduce over both axes:
    # the joint dp,ep group
    assert {(g.split(".")[1], a) for g, a, k in grads if k == "all_reduce"} == {("logits", "dp,ep"),
                                                                                ("grad_bucket0", "dp")}


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(st.integers(2, 4), st.integers(0, 2 ** 16), st.floats(0.0, 0.9))
def test_ragged_all_to_all_equals_dense_and_sends_only_nonzero_rows(n, seed, sparsity):
    rng = np.random.default_rng(seed)
    xs = []
    for _ in range(n):
        x = rng.standard_normal((n * 2, 3, 5)).astype(np.float32)
        x[rng.random(x.shape[:2]) < sparsity] = 0
        xs.append(x)
    from parcomp.ir.graph import Node
    from parcomp.ir.types import TensorType
    node = Node("y", "all_to_all", ("x",), TensorType((2, 3 * n, 5)),
                (("axis", "ep"), ("dim", 0), ("ragged", True), ("src_dim", 1)))
    sent = {}
    got = moe_ops.ragged_all_to_all(xs, node, sent, list(range(n)))
    want = _LAYOUT_OPS["all_to_all"](xs, node)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    for i, x in enumerate(xs):
        chunks = np.split(x, n, axis=0)
        rows = sum(int(np.any(ch != 0, axis=-1).sum()) for j, ch in enumerate(chunks) if j != i)
        masks = sum(ch.shape[0] * ch.shape[1] for j, ch in enumerate(chunks) if j != i)
        assert sent.get(i, 0) == rows * 5 * 4 + masks


def test_interpreter_logs_the_routed_bytes_of_each_rank():
    case = MoeCase(experts=4, top_k=1, batch=2, seq=4, hidden=4, inter=4, capacity=0, ep=2, skew=3.0)
    c = compile_graph(parse_graph(model_text(case)), parse_spec(spec_text(case, train=False), "case.pcs"))
    run = run_spmd(c.program, feeds(c.logical, case, 0))
    first = [e for e in run.log if e["kind"] == "all_to_all"][0]
    # top-1 with expert 0 favoured: every token goes to rank 0's expert 0, so rank 1 sends
    # all its rows (4 tokens x 4 floats) and rank 0 none, plus each its mask: 2 experts x 4 slots
    assert first["sent_bytes"] == {0: 8, 1: 8 + 4 * 4 * 4}, first


@pytest.mark.slow
@pytest.mark.parametrize("spec,nproc", [("moe_ep2_train.pcs", 2), ("moe_ep2_tp2_train.pcs", 4)])
def test_moe_trains_under_torchrun_like_unsharded(capsys, spec, nproc):
    """A skewed routing (expert 3 gets no token, expert 0 nearly all) on gloo ranks."""
    rc = main(["run", f"{MODELS}:moe_block_skewed", "--spec", os.path.join(SPECS, spec),
               "--nproc", str(nproc), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["verdict"] == "OK" and out["world_size"] == nproc, out.get("why")
    assert out["err_over_tol"] <= 1


def test_explain_compares_tp_inside_experts_with_ep_from_the_routing(capsys):
    """explain's MoE comparison for the skewed routing: tokens per expert as routed, EP's
    bytes per rank those program.py's dropless exchange sends (the routed rows the
    interpreter's ragged all_to_all sends, without its masks, forward and x2 for the backward,
    plus the counts), TP's the all_reduce ring bytes; EP's load is imbalanced, TP's is not."""
    rc = main(["explain", f"{MODELS}:moe_block_skewed", "--spec", os.path.join(SPECS, "moe_ep2_train.pcs"),
               "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0
    (rec,) = out["moe"]
    assert rec["tokens_per_expert"][-1] == 0 and sum(rec["tokens_per_expert"]) == 2 * rec["tokens"]
    graph, module, example = load_model(f"{MODELS}:moe_block_skewed")
    with open(os.path.join(SPECS, "moe_ep2_train.pcs")) as f:
        text = "".join(line for line in f if not line.startswith("train"))
    c = compile_graph(graph, parse_spec(text, "moe_ep2.pcs"))
    run = run_spmd(c.program, feeds_for(c.unsharded, module, example))
    sent = [e["sent_bytes"] for e in run.log if e.get("sent_bytes") is not None]
    assert len(sent) == 2
    # program.py runs the layer dropless: the routed rows only (the interpreter's ragged
    # exchange less its mask byte per slot), after one all_to_all of the int64 counts
    assert rec["dropless"] and rec["ep"]["collective"] == "all_to_all (dropless)"
    slots = 2 * 2 * rec["capacity"]  # (n-1) peers x 2 rows each x 2 experts there x capacity
    counts = 1 * 2 * 8  # (n-1) peers x 2 experts there, int64
    assert rec["ep"]["bytes_per_rank"] == [2 * (sent[0][r] - slots + sent[1][r] - slots) + counts for r in range(2)]
    assert rec["tp"]["bytes_per_rank"] == [2 * 2 * (2 - 1) * rec["tokens"] * 16 * 4 // 2] * 2
    assert rec["ep"]["imbalance"] > 1.2 and rec["tp"]["imbalance"] == 1.0
    assert sum(rec["ep"]["load_per_rank"]) == 2 * rec["tokens"]


@pytest.mark.parametrize("capacity", [0, 2])
def test_route_and_its_vjp_equal_mixtral_formula_with_drops(capacity):
    """moe_route / moe_route_grad against torch autograd of Mixtral's formula (softmax over all
    experts, top-k, renormalised) times the kept mask, in float64: a dropped slot's weight is
    0 but its logit still gets a gradient through the renormalisation (the kept slots')."""
    rng = np.random.default_rng(3)
    z = torch.tensor(rng.standard_normal((2, 6, 4)), requires_grad=True)
    g = torch.tensor(rng.standard_normal((2, 6, 4)))
    top, kept = moe_ops.top_mask(z.detach().numpy(), 2, capacity)
    p = torch.softmax(z, -1)
    vals, idx = torch.topk(p, 2, dim=-1)
    w = torch.zeros_like(p).scatter(-1, idx, vals / vals.sum(-1, keepdim=True)) * torch.from_numpy(kept)
    w.backward(g)
    got = moe_ops.route(z.detach().numpy(), 2, capacity)
    dz = moe_ops.route_grad(g.numpy(), z.detach().numpy(), 2, capacity)
    u = np.finfo(np.float64).eps
    np.testing.assert_allclose(got, w.detach().numpy(), rtol=0, atol=64 * u)
    np.testing.assert_allclose(dz, z.grad.numpy(), rtol=0, atol=64 * u * np.abs(g.numpy()).max())
    if capacity:
        dropped = top & ~kept
        reached = dropped & kept.any(-1, keepdims=True)  # a token that kept its other slot
        assert reached.any() and np.all(got[dropped] == 0) and np.all(dz[reached] != 0)


def test_capacity_factor_drops_tokens_and_ep2_still_equals_unsharded_and_torch():
    """capacity_factor=1.0 on the skewed routing: C = ceil(1.0 * 8 * 2 / 4) = 4 slots, expert 0
    wanted by every token of a row, so slots are dropped; the ep=2 step equals the unsharded
    step and torch's (the custom ops' autograd)."""
    from parcomp.frontends.torch.export import import_torch

    m, ex, names = models.moe_block("skewed", capacity_factor=1.0)
    assert m.capacity == 4
    z = torch.nn.functional.linear(ex[0], m.gate.weight).detach().numpy()
    top, kept = moe_ops.top_mask(z, 2, m.capacity)
    assert (top & ~kept).sum() > 0
    c = compile_graph(import_torch(m, ex, names), _spec("moe_ep2_train.pcs"))
    r = lockstep(c, m, ex, train_feeds(c, m, ex, 0, feeds_for), 1)
    assert verdict(r["vs_unsharded"]) == "OK" and verdict(r["vs_torch"]) == "OK", r["vs_unsharded"]["why"]
