"""ZB-H1 (backward split into input- and weight-gradient programs) and interleaved 1F1B
(pp x virtual model chunks) executed on the numpy interpreter: one training step
equals the unsharded step for every schedule, every schedule gives the same numbers, and the
report gives each schedule's bubble.  The torchrun runs are tests/pipeline/test_pipeline_schedules_torch.py."""
import numpy as np
import pytest

from parcomp.errors import SpecError
from parcomp.passes.pass_list import plan_pipeline
from parcomp.passes.pipeline.schedule import analytic_bubble
from parcomp.passes.pipeline.stage_train import grad_name
from parcomp.passes.pipeline.zb_split import WSTASH, _needs
from parcomp.reference.numpy_ops import run_unsharded

from graphs import random_feeds, spec
from numerics import assert_all_equivalent
from test_pipeline import TRAIN, assert_detects_a_wrong_scale, chain_graph, pipelined

ALL = ("gpipe", "1f1b", "zb-h1", "interleaved")
STAGED = "stage 0: 0-5\nstage 1: 6-11\n"  # stage lines (interleaved balances its chunks)


def head(name, mesh="mesh pp=2\n"):
    return mesh if name == "interleaved" else mesh + STAGED


def assert_same_numbers(outs: dict, rounding=()) -> None:
    """Every schedule's outputs equal the first's bit for bit (same sums, same order); the
    schedules named in ``rounding`` to the last bits of float64 (another kernel's sums)."""
    first = next(iter(outs.values()))
    for name, got in outs.items():
        assert sorted(got) == sorted(first), name
        for k in first:
            if name in rounding:
                np.testing.assert_allclose(got[k], first[k], rtol=1e-13, atol=1e-17, err_msg=f"{name}: {k}")
            else:
                np.testing.assert_array_equal(got[k], first[k], err_msg=f"{name}: {k}")


@pytest.mark.parametrize("name", ALL)
def test_pp2_step_of_every_schedule_equals_the_unsharded_step(name):
    got, want, plan = pipelined(chain_graph(blocks=4), head(name), f"{TRAIN} microbatches=4 schedule={name}")
    assert_all_equivalent(got, want)  # loss, every grad, param and momentum
    assert_detects_a_wrong_scale(got, want)
    assert len(plan.stages) == (4 if name == "interleaved" else 2)
    assert bool(plan.split) == (name == "zb-h1")


def test_every_schedule_gives_the_same_numbers_pp2_and_pp4_virtual2():
    g = chain_graph(blocks=4)
    outs = {n: pipelined(g, head(n), f"{TRAIN} microbatches=4 schedule={n}")[0] for n in ALL}
    outs.update({f"{n} pp=4": pipelined(g, "mesh pp=4\n", f"{TRAIN} microbatches=4 schedule={n}")[0]
                 for n in ALL})
    assert_same_numbers(outs)


def test_pp4_interleaved_virtual2_holds_eight_chunks_two_per_rank():
    got, want, plan = pipelined(chain_graph(blocks=4), "mesh pp=4\n",
                                        f"{TRAIN} microbatches=4 schedule=interleaved virtual=2")
    assert plan.virtual == 2 and len(plan.stages) == 8 and plan.pp == 4
    assert [plan.rank_of_stage(s) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert {a.chunk for acts in plan.actions for a in acts} == {0, 1}
    assert_all_equivalent(got, want)


def test_dp2_interleaved_and_zb_h1_equal_the_unsharded_step():
    g = chain_graph(blocks=4)
    for name in ("zb-h1", "interleaved"):
        got, want, _ = pipelined(g, "mesh dp=2 pp=2\n", f"{TRAIN} microbatches=2 schedule={name}")
        assert_all_equivalent(got, want)
        assert_detects_a_wrong_scale(got, want)


def test_dp2_pp2_tp2_every_schedule_same_numbers_and_equal_unsharded():
    from test_pipeline_tp import HEAD

    g = chain_graph(blocks=4)
    outs = {}
    for name in ALL:
        got, want, plan = pipelined(g, HEAD, f"{TRAIN} microbatches=2 schedule={name}")
        assert len(plan.local) == len(plan.stages)
        assert_all_equivalent(got, want)
        outs[name] = got
    assert_same_numbers(outs)


def test_gpt2_tied_embedding_every_schedule_same_numbers():
    """Interleaved puts the embedding on chunk 0 (rank 0) and the LM head on chunk 3 (rank 1):
    the tied gradient is summed over those two virtual stages."""
    pytest.importorskip("transformers")
    from test_pipeline_tied import STAGES, TRAIN as LM_TRAIN, gpt2_64, lm_pipelined

    g, outs = gpt2_64(), {}
    for name in ALL:
        h = "mesh pp=2\n" if name == "interleaved" else f"mesh pp=2\n{STAGES}"
        got, want, plan, _, _ = lm_pipelined(g, h, f"{LM_TRAIN} microbatches=2 schedule={name}")
        assert_all_equivalent(got, want)
        outs[name] = got
        if name == "interleaved":
            assert plan.tied == (("lm_head.weight", (0, 3)),)
    assert_same_numbers(outs)


# ---- the split backward ----

def _stage1(name="zb-h1"):
    return plan_pipeline(chain_graph(blocks=4), spec(f"{head(name)}{TRAIN} microbatches=2 schedule={name}\n"))


def test_split_backward_b_then_w_equals_the_whole_backward():
    plan = _stage1()
    st, sp = plan.stages[1], plan.split[1]
    feeds = random_feeds(st.backward, 3)
    whole = run_unsharded(st.backward, feeds)
    b = run_unsharded(sp.backward_input, feeds)
    w = run_unsharded(sp.backward_weight, {**feeds, **{k[len(WSTASH):]: v for k, v in b.items()
                                                        if k.startswith(WSTASH)}})
    assert sorted(k for k in b if not k.startswith(WSTASH)) == [grad_name(v) for v in st.recv]
    assert sorted(w) == sorted(grad_name(p) for p in st.params)
    for k in whole:
        np.testing.assert_array_equal({**b, **w}[k], whole[k], err_msg=k)


def test_weight_gradient_reads_the_stashed_activation_and_output_gradient():
    """W's matmuls (dW = x^T dy) read a stashed forward value and an output gradient B made;
    B computes no parameter gradient and every backward node runs in exactly one of the two."""
    plan = _stage1()
    st, sp = plan.stages[1], plan.split[1]
    b_nodes = {n.name for n in sp.backward_input.nodes if n.op not in ("input", "param")}
    w_nodes = {n.name for n in sp.backward_weight.nodes if n.op not in ("input", "param")}
    live = _needs(st.backward, st.backward.outputs)  # less dead nodes (the target's gradient)
    whole = {n.name for n in st.backward.nodes if n.op not in ("input", "param") and n.name in live}
    assert b_nodes | w_nodes == whole and not b_nodes & w_nodes
    w_inputs = {n.name for n in sp.backward_weight.inputs}
    assert set(sp.carried) <= w_inputs and sp.carried
    assert set(st.saved) & w_inputs  # the stashed activations
    assert any(n.op == "matmul" for n in sp.backward_weight.nodes)  # dW = x^T dy
    assert any(n.op == "matmul" for n in sp.backward_input.nodes)  # dx = dy W^T
    assert not any(k.startswith("grad.") and k[5:] in st.params
                   for k in sp.backward_input.output_names)


def test_first_stage_input_gradient_is_empty_its_weight_gradient_is_everything():
    plan = _stage1()
    sp = plan.split[0]
    assert sp.backward_input.output_names == () and sp.carried == ()
    assert sorted(sp.backward_weight.output_names) == sorted(grad_name(p) for p in plan.stages[0].params)


def test_split_with_tp_inside_the_stage_keeps_the_collectives():
    from test_pipeline_tp import HEAD

    plan = plan_pipeline(chain_graph(blocks=4), spec(f"{HEAD}{TRAIN} microbatches=2 schedule=zb-h1\n"))
    for local, sp in zip(plan.local, plan.split):
        ops = sorted(n.name for n in local.backward.nodes if n.op == "all_reduce")
        split_ops = sorted(n.name for g in (sp.backward_input, sp.backward_weight) for n in g.nodes
                           if n.op == "all_reduce")  # each once: a carried one is W's input
        assert ops == split_ops and ops


# ---- the report and the spec ----

@pytest.mark.parametrize("name,pp,micro,virtual,want", [
    ("gpipe", 2, 4, 1, 1 / 5), ("1f1b", 2, 4, 1, 1 / 5), ("zb-h1", 2, 4, 1, 1 / 13),
    ("interleaved", 2, 4, 2, 1 / 9), ("zb-h1", 4, 4, 1, 3 / 15), ("interleaved", 4, 4, 2, 3 / 11)])
def test_report_gives_each_schedules_bubble(name, pp, micro, virtual, want):
    from parcomp.compile.compiler import compile_graph
    from parcomp.passes.pipeline.pipeline_plan import format_pipeline

    h = f"mesh pp={pp}\n" + (STAGED if name != "interleaved" and pp == 2 else "")
    c = compile_graph(chain_graph(blocks=4), spec(f"{h}{TRAIN} microbatches={micro} schedule={name}\n"))
    rep = c.report["pipeline"]
    assert rep["bubble_analytic"] == pytest.approx(want, rel=1e-12)
    if pp * virtual <= 4:  # 4 blocks: equal stages, the simulation is the analytic bubble
        assert rep["bubble_simulated"] == pytest.approx(want, rel=1e-12)
    else:
        assert 0 < rep["bubble_simulated"] < analytic_bubble(pp, micro)
    assert rep["virtual"] == virtual and len(rep["stages"]) == pp * virtual
    assert f"schedule {name}" in format_pipeline(c.report)


@pytest.mark.parametrize("text,where,msg", [
    ("mesh pp=2\ntrain schedule=gpipe virtual=2\n", "2:22", "chunk count of schedule=interleaved"),
    ("mesh pp=2\ntrain schedule=interleaved virtual=0 microbatches=2\n", "2:28", "virtual=0 is out of range"),
    ("mesh pp=2\ntrain schedule=interleaved microbatches=3\n", "2:28", "multiple of pp (2)"),
    ("mesh pp=2\nstage 0: a\nstage 1: b\ntrain schedule=interleaved microbatches=2\n", "2:1",
     "drop the stage statements"),
    ("mesh pp=2\ntrain schedule=zb-h2\n", "2:7", "did you mean 'zb-h1'"),
    ("mesh tp=2\ntrain virtual=2\n", "2:7", "no 'pp' axis"),
])
def test_bad_schedule_options_are_located(text, where, msg):
    with pytest.raises(SpecError) as e:
        spec(text)
    assert f"test.pcs:{where}" in str(e.value) and msg in str(e.value)


@pytest.mark.parametrize("pp,virtual,can", [(2, "", "too few to interleave"), (2, " virtual=8", "too few to interleave"),
                                            (1, " virtual=4", "give virtual=3 or fewer")])
def test_interleaved_needs_a_module_per_chunk(pp, virtual, can):
    """Too few modules for pp x virtual chunks: an error at virtual= (at schedule= when
    virtual= is not written: the default 2), saying how many chunks per rank the model makes."""
    from graphs import mlp_graph

    g = mlp_graph((8,), [4, 8, 8, 4], [True] * 3, ["relu", "relu", "none"])  # 3 modules: l0, l1, l2
    line = f"{TRAIN} microbatches={2 * pp} schedule=interleaved{virtual}"
    with pytest.raises(SpecError, match=f"3 module.s. .l0, l1, l2.*{3 // pp} chunk.s. per rank; {can}") as e:
        plan_pipeline(g, spec(f"mesh pp={pp}\n{line}\n"))
    key = "virtual=" if virtual else "schedule="
    assert (e.value.loc.line, e.value.loc.col) == (2, line.index(key) + 1), str(e.value)


def test_balanced_units_keep_ln_f_apart_from_the_blocks():
    """GPT-2's ``transformer.ln_f`` is its own unit, not ``transformer`` (the embeddings):
    otherwise balancing would put it before the blocks and break the data flow."""
    from parcomp.passes.pipeline.split_stages import _above_numbered, _unit

    above = _above_numbered(["transformer.h.0.attn", "transformer.wte", "transformer.ln_f"])
    assert above == {"transformer", "transformer.h"}
    assert _unit("transformer.ln_f", above) == "transformer.ln_f"
    assert _unit("transformer.h.1.mlp", above) == "transformer.h.1" and _unit("lm_head", above) == "lm_head"
    assert _unit("transformer", above) == "transformer"


def test_shipped_gpt2_dp2_pp2_tp2_spec_with_zb_h1_equals_1f1b():
    """The shipped 8-rank GPT-2 spec (tp inside the stages, tied embedding) with
    schedule=zb-h1: the split per-rank backward gives 1F1B's numbers."""
    pytest.importorskip("transformers")
    from test_pipeline_tied import gpt2_64, lm_pipelined, shipped

    h, train = shipped()
    g = gpt2_64()
    zb, want, plan, _, _ = lm_pipelined(g, h, train.replace("schedule=1f1b", "schedule=zb-h1"))
    assert plan.split and len(plan.local) == 2 and plan.dp == 2
    assert_all_equivalent(zb, want)
    assert_same_numbers({"1f1b": lm_pipelined(g, h, train)[0], "zb-h1": zb})
