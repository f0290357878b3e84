"""Tied weights across pipeline stages and a tiny GPT-2 pipeline.

GPT-2's LM head is tied to its token embedding (torch.export keeps one param,
``lm_head.weight``): the first stage embeds with it, the last projects with it.  Each holds
a copy, and the two gradient contributions are summed over exactly those stages' ranks
before the dp reduction.  The comparisons run the model promoted to float64
(parcomp/check/check64.py), as ``parcomp check`` does."""
import pytest

from parcomp.check.check64 import promote_graph
from parcomp.passes.pass_list import plan_pipeline

from graphs import spec
from numerics import assert_all_equivalent
from test_pipeline import ROOT, reference
from test_pipeline_tp import collectives

pytest.importorskip("transformers")

TRAIN = "train loss=cross_entropy optimizer=sgd(lr=0.1, momentum=0.9) input_grads=no"
STAGES = "stage 0: transformer transformer.h.0\nstage 1: transformer.h.1 transformer.ln_f lm_head\n"
SPEC = ROOT / "specs" / "gpt2_lm_dp2_pp2_tp2_train.pcs"


def gpt2_64():
    from parcomp.frontends.loader import load_model

    g, _, _ = load_model(str(ROOT / "specs" / "models.py") + ":gpt2_lm")
    return promote_graph(g)


def lm_pipelined(g, head, train, seed=0):
    """:func:`test_pipeline.pipelined` with random token ids and labels (its feeds hold
    zeros for integer inputs: one embedding row only)."""
    import numpy as np

    from parcomp.reference.numpy_ops import run_unsharded
    from parcomp.check.pipeline import run_pipeline_step

    ref, feeds, _ = reference(g, train, seed)
    rng = np.random.default_rng(seed)
    for k in ("input_ids", "labels"):
        feeds[k] = rng.integers(0, 101, np.shape(feeds[k])).astype("int64")
    plan = plan_pipeline(g, spec(f"{head}{train}\n"))
    return run_pipeline_step(plan, feeds), run_unsharded(ref, feeds), plan, ref, feeds


def shipped():
    """The shipped spec's text split into (everything but the train line, the train line)."""
    lines = SPEC.read_text().splitlines()
    train = next(x for x in lines if x.startswith("train "))
    return "\n".join(x for x in lines if x != train) + "\n", train


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpt2_pp2_with_tied_embedding_equals_the_unsharded_step(name):
    got, want, plan, _, feeds = lm_pipelined(gpt2_64(), f"mesh pp=2\n{STAGES}",
                                                     f"{TRAIN} microbatches=2 schedule={name}")
    assert len(set(feeds["input_ids"].ravel().tolist())) > 8  # many embedding rows take gradients
    assert plan.tied == (("lm_head.weight", (0, 1)),)
    assert all("lm_head.weight" in st.params for st in plan.stages)
    assert_all_equivalent(got, want)


def test_one_stage_share_of_a_tied_gradient_is_caught():
    """Both stages contribute to the tied weight's gradient: either share alone fails."""
    from parcomp.check.differential import compare_all

    got, want, plan, _, _ = lm_pipelined(gpt2_64(), f"mesh pp=2\n{STAGES}", f"{TRAIN} microbatches=2")
    first, last = (plan.stages[s].forward.nodes for s in (0, 1))
    assert any(n.op == "embedding" and "lm_head.weight" in n.inputs for n in first)
    assert any(n.op != "embedding" and "lm_head.weight" in n.inputs for n in last)  # the head
    for scale in (0.0, 2.0):
        wrong = {**got, "lm_head.weight.grad": got["lm_head.weight.grad"] * scale}
        assert not compare_all(wrong, want, sorted(got))["ok"]


def test_shipped_gpt2_dp2_pp2_tp2_spec_equals_the_unsharded_step():
    head, train = shipped()
    got, want, plan, _, _ = lm_pipelined(gpt2_64(), head, train)
    assert_all_equivalent(got, want)
    assert plan.tied == (("lm_head.weight", (0, 1)),) and plan.dp == 2 and len(plan.local) == 2
    ar = ("all_reduce", "tp")  # Megatron: 2 per block forward (attn, mlp), 2 backward
    assert collectives(plan) == [{"forward": [ar, ar], "backward": [ar, ar], "optimizer": []}] * 2


def test_shipped_gpt2_spec_pins_its_p2p_and_tied_groups():
    from parcomp.compile.compiler import compile_graph
    from parcomp.frontends.loader import load_model
    from parcomp.spec import load_spec
    from parcomp_backends.torch.emit import emit_program

    g, _, _ = load_model(str(ROOT / "specs" / "models.py") + ":gpt2_lm")
    s = load_spec(str(SPEC))
    plan = plan_pipeline(g, s)
    p2p = {(r, a.kind, a.peer) for r in range(8) for a in plan.rank_actions(s.mesh, r)
           if a.kind.startswith("send")}
    assert p2p == {(0, "send_fwd", 2), (1, "send_fwd", 3), (4, "send_fwd", 6), (5, "send_fwd", 7),
                   (2, "send_bwd", 0), (3, "send_bwd", 1), (6, "send_bwd", 4), (7, "send_bwd", 5)}
    text = emit_program(compile_graph(g, s))
    assert "TIED_SETS = [[[0, 2], [1, 3], [4, 6], [5, 7]]]" in text
    assert "TIED = {0: [('grad.lm_head.weight', 0)], 1: [('grad.lm_head.weight', 0)]}" in text


def test_report_lists_the_tied_weights():
    from parcomp.compile.compiler import compile_graph

    c = compile_graph(gpt2_64(), spec(f"mesh pp=2\n{STAGES}{TRAIN} microbatches=2\n"))
    assert c.report["pipeline"]["tied"] == {"lm_head.weight": [0, 1]}
