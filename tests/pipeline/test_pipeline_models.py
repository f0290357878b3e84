"""Stage lines that fit transformers' models as a user builds them: a module every layer reads
(RoPE's cos/sin tables) is held by every stage that reads it without a stage line naming it;
GQA's expand of the kv heads takes the microbatch; a param the loss does not reach (BERT's
pooler under a loss on ``last_hidden_state``) gets no gradient, state or update, as in the
unsharded step; ``h.N-end`` names the last layers. Each pipelined step on the numpy
interpreter, in float64, equals the unsharded step."""
import pytest

from parcomp.check.check64 import promote_graph
from parcomp.passes.pass_list import plan_pipeline

from graphs import spec
from numerics import assert_all_equivalent
from test_pipeline import ROOT, pipelined
from test_pipeline_tied import lm_pipelined

pytest.importorskip("transformers")

TRAIN = "train loss=cross_entropy optimizer=adamw(lr=0.01) input_grads=no microbatches=2 schedule=1f1b"


def model64(name):
    from parcomp.frontends.loader import load_model

    g, _, _ = load_model(str(ROOT / "specs" / "models.py") + f":{name}")
    return promote_graph(g)


@pytest.mark.parametrize("name", ["llama_lm", "qwen2_lm", "mistral_lm"])
def test_llama_family_pp2_balanced_equals_the_unsharded_step(name):
    g = model64(name)
    got, want, plan, _, _ = lm_pipelined(g, "mesh pp=2\n", TRAIN)
    assert_all_equivalent(got, want)
    rope = [n.name for n in g.params if n.source and n.source.endswith("rotary_emb")]
    assert rope and all(p in plan.stages[s].forward for p in rope for s in (0, 1))  # both read it
    assert not any(p in st.params for p in rope for st in plan.stages)  # a buffer: never trained


def test_stage_lines_need_not_name_the_rotary_module_and_may_end_open():
    g = model64("llama_lm")
    head = ("mesh pp=2\nstage 0: model.embed_tokens model.layers.0\n"
            "stage 1: model.layers.1-end model.norm lm_head\n")
    got, want, plan, _, _ = lm_pipelined(g, head, TRAIN)
    assert_all_equivalent(got, want)
    assert "model.layers.1.mlp.up_proj.weight" in plan.stages[1].params
    assert "model.norm.weight" in plan.stages[1].params


def test_an_open_range_past_the_last_layer_is_an_error_at_the_range():
    from parcomp.errors import SpecError

    head = ("mesh pp=2\nstage 0: model.embed_tokens model.layers.0\n"
            "stage 1: model.layers.3-end model.norm lm_head\n")
    with pytest.raises(SpecError) as e:
        plan_pipeline(model64("llama_lm"), spec(f"{head}{TRAIN}\n"))
    assert "test.pcs:3:10" in str(e.value) and "model.layers.3-end matches no module" in str(e.value)
    assert "model.layers.0 to model.layers.1" in str(e.value)


def test_a_module_no_stage_names_is_an_error_at_the_last_stage():
    from parcomp.errors import SpecError

    head = ("mesh pp=2\nstage 0: model.embed_tokens model.layers.0\n"
            "stage 1: model.norm lm_head\n")
    with pytest.raises(SpecError) as e:
        plan_pipeline(model64("llama_lm"), spec(f"{head}{TRAIN}\n"))
    assert "test.pcs:3:1" in str(e.value) and "model.layers.1" in str(e.value) and "in no stage" in str(e.value)


@pytest.mark.parametrize("head,where,msg", [
    ("stage 0: model.embed_tokens model.layer.0-1\nstage 1: model.layers.2-end model.norm lm_head\n",
     "2:29", "model.layer.0 (of model.layer.0-1) matches no module of the model; did you mean model.layers.0?"),
    ("stage 0: model.embed_tokens model.layers.0-1\nstage 1: model.layers.2-5 model.norm lm_head\n",
     "3:10", "model.layers.2 (of model.layers.2-5) matches no module of the model; the model's "
             "model.layers modules are model.layers.0 to model.layers.1"),
])
def test_a_stage_item_that_names_no_module_is_an_error_at_the_item(head, where, msg):
    from parcomp.errors import SpecError

    with pytest.raises(SpecError) as e:
        plan_pipeline(model64("llama_lm"), spec(f"mesh pp=2\n{head}{TRAIN}\n"))
    assert f"test.pcs:{where}" in str(e.value) and msg in str(e.value)


def test_open_range_parses_as_one_item():
    s = spec("mesh pp=2\nstage 0: embed h.0-2\nstage 1: h.3-end ln_f\n")
    assert [r.items for r in s.stages] == [("embed", "h.0", "h.1", "h.2"), ("h.3-end", "ln_f")]


def bert_encoder():
    """transformers' ``BertModel`` (with its pooler) as a user builds it, float64."""
    import torch
    from transformers import BertConfig, BertModel

    from parcomp.frontends.torch.export import import_torch

    torch.manual_seed(0)
    c = BertConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, max_position_embeddings=16, hidden_dropout_prob=0.0,
                   attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    m = BertModel(c).eval()
    return promote_graph(import_torch(m, (torch.randint(0, 128, (2, 8)),), ["input_ids"]))


def test_bert_pooler_the_loss_does_not_reach_is_not_updated():
    train = ("train loss=mse optimizer=adamw(lr=0.01) input_grads=no microbatches=2 schedule=1f1b "
             "output=last_hidden_state")
    got, want, plan = pipelined(bert_encoder(), "mesh pp=2\n", train)
    assert not any(p.startswith("pooler.") for st in plan.stages for p in st.params)
    assert not any(k.startswith("pooler.") for k in got)
    assert_all_equivalent(got, want)
