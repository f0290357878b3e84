"""DTensor plan dicts as parcomp specs: the same collectives as parcomp's own spec."""
import sys
from pathlib import Path

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

import parcomp
from parcomp.errors import ParcompError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "specs"))
from models import gpt2_mlp, llama_lm  # noqa: E402

TRAIN = "train loss=cross_entropy optimizer=adamw(lr=0.001) steps=2"

# the DTensor tutorial's Llama block plan, in transformers' module names
BLOCK = "model.layers.*"
TP_PLAN = {
    f"{BLOCK}.self_attn.q_proj": ColwiseParallel(),
    f"{BLOCK}.self_attn.k_proj": ColwiseParallel(),
    f"{BLOCK}.self_attn.v_proj": ColwiseParallel(),
    f"{BLOCK}.self_attn.o_proj": RowwiseParallel(),
    f"{BLOCK}.mlp.gate_proj": ColwiseParallel(),
    f"{BLOCK}.mlp.up_proj": ColwiseParallel(),
    f"{BLOCK}.mlp.down_proj": RowwiseParallel(),
}
SP_PLAN = {
    f"{BLOCK}.input_layernorm": SequenceParallel(),
    f"{BLOCK}.self_attn": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
    **{k: v for k, v in TP_PLAN.items() if "o_proj" not in k and "down_proj" not in k},
    f"{BLOCK}.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
    f"{BLOCK}.post_attention_layernorm": SequenceParallel(),
    f"{BLOCK}.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
}


def _kinds(x):
    return [(c.kind, c.axis, c.phase) for c in x.collectives]


def test_the_tutorial_tp_plan_gives_parcomps_own_collectives_four_all_reduces_per_block():
    m, ex, names = llama_lm()
    text = parcomp.spec_from_plan(TP_PLAN, {"tp": 2}, m, ex, train=TRAIN, input_names=names)
    got = parcomp.explain(m, ex, text, input_names=names)
    own = parcomp.explain(m, ex, str(ROOT / "specs/llama_lm_tp2_train.pcs"), input_names=names)
    assert _kinds(got) == _kinds(own)
    assert got.count("all_reduce") == 4 * 2 == len(got.collectives)  # 2 blocks


def test_the_tutorial_sequence_parallel_plan_gives_parcomps_sequence_parallel():
    m, ex, names = llama_lm()
    text = parcomp.spec_from_plan(SP_PLAN, {"tp": 2}, m, ex, train=TRAIN, input_names=names)
    assert "sequence-parallel" in text
    got = parcomp.explain(m, ex, text, input_names=names)
    own = parcomp.explain(m, ex, str(ROOT / "specs/llama_lm_tp2_sp_train.pcs"), input_names=names)
    assert _kinds(got) == _kinds(own)


def test_a_plan_with_its_mesh_is_a_spec_for_check():
    m, ex, names = gpt2_mlp()
    plan = {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()}
    assert parcomp.check(m, ex, (plan, {"tp": 2}), input_names=names).ok
    text = parcomp.spec_from_plan(plan, {"tp": 2}, m)
    assert "c_fc.weight [S(1)]" in text and "c_fc.bias [S(0)]" in text and "c_proj.weight [S(0)]" in text


def test_a_plan_key_naming_no_module_is_an_error():
    m, ex, names = gpt2_mlp()
    with pytest.raises(ParcompError, match="plan key 'c_fcc' names no module"):
        parcomp.check(m, ex, ({"c_fcc": ColwiseParallel()}, {"tp": 2}), input_names=names)


def test_explain_of_a_plan_says_where_dtensor_would_issue_more_collectives():
    """DTensor run on the tutorial's plan (a fake process group of 2) reduces the gradient of
    each ColwiseParallel input by itself: 5 backward all_reduces per block (q, k, v, gate, up)
    where parcomp's program issues 2; forward they agree (o_proj and down_proj)."""
    m, ex, names = llama_lm()
    x = parcomp.explain(m, ex, (TP_PLAN, {"tp": 2}), input_names=names, train=TRAIN)
    cmp = x.dtensor
    assert cmp.ran and cmp.blocks == ("model.layers.0", "model.layers.1"), cmp
    blocks = {"model.layers.0": 2, "model.layers.1": 2}
    assert cmp.per_block("forward", "all_reduce") == cmp.per_block("forward", "all_reduce", "parcomp") == blocks
    assert cmp.per_block("backward", "all_reduce") == {b: 5 for b in blocks}
    assert cmp.per_block("backward", "all_reduce", "parcomp") == blocks
    assert [(c.block, c.phase, c.kind, c.dtensor, c.parcomp) for c in cmp.more] == [
        ("model.layers.0", "backward", "all_reduce", 5, 2), ("model.layers.1", "backward", "all_reduce", 5, 2)]
    assert str(cmp) == ("DTensor's plan issues more: model.layers.* (2 blocks), backward: 5 all_reduce over tp "
                        "each where parcomp's program issues 2")
    assert x.raw["dtensor_comparison"]["lines"] == [str(cmp)]
    assert _kinds(x) == _kinds(parcomp.explain(m, ex, str(ROOT / "specs/llama_lm_tp2_train.pcs"), input_names=names))


def test_explain_of_a_plan_with_loss_parallel_runs_dtensor_on_its_module_styles_only():
    """"loss_parallel" names no module: DTensor is run on the other entries (torch's
    parallelize_module warned that the key could not be resolved, printing the whole model)."""
    import warnings

    m, ex, names = llama_lm()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = parcomp.explain(m, ex, ({**TP_PLAN, "loss_parallel": True}, {"tp": 2}), input_names=names)
    assert x.dtensor.ran, x.dtensor
    assert not [w for w in caught if "could not be resolved" in str(w.message)]


def test_a_plan_dtensor_cannot_run_is_said_so():
    m, ex, names = gpt2_mlp()  # transformers' Conv1D: DTensor's ColwiseParallel takes nn.Linear only
    x = parcomp.explain(m, ex, ({"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()}, {"tp": 2}),
                        input_names=names)
    assert not x.dtensor.ran and "nn.Linear" in x.dtensor.why
    assert str(x.dtensor).startswith("DTensor's plan: not run (NotImplementedError")


def test_loss_parallel_keeps_the_logits_split_over_the_vocabulary():
    from torch.distributed.tensor.parallel import loss_parallel

    m, ex, names = llama_lm()
    lm_head = {"lm_head": ColwiseParallel()}
    for entry in ({"loss_parallel": True}, {"loss_parallel": loss_parallel}):
        text = parcomp.spec_from_plan({**TP_PLAN, **lm_head, **entry}, {"tp": 2}, m, ex, input_names=names)
        assert "output logits [S(2)]" in text and "lm_head.weight [S(0)]" in text, text
    # without lm_head in the plan, loss_parallel alone keeps the logits split
    assert "output logits" not in parcomp.spec_from_plan(TP_PLAN, {"tp": 2}, m, ex, input_names=names)
    text = parcomp.spec_from_plan({**TP_PLAN, "loss_parallel": True}, {"tp": 2}, m, ex, input_names=names)
    assert "output logits [S(2)]" in text
    with pytest.raises(ParcompError, match="plan key 'loss_parallel': give True"):
        parcomp.spec_from_plan({**TP_PLAN, "loss_parallel": "yes"}, {"tp": 2}, m, ex, input_names=names)


@pytest.mark.slow
def test_loss_parallel_cross_entropy_equals_the_unsharded_loss_and_gradients(tmp_path):
    """The tutorial's Llama plan, lm_head ColwiseParallel(Shard(-1)) and loss_parallel on 2 gloo
    ranks: the logits come back split ([2, 8, 64] of vocab 128), par.cross_entropy (some labels
    ignored) equals torch's loss of the unsharded model, and every gradient equals torch's."""
    from gloo_ranks import run_ranks

    for r in run_ranks("api_workers:loss_parallel_equal", 2, cache_dir=str(tmp_path)):
        assert r["layout"] == "[S(2)]" and r["local_shape"] == [2, 8, 64], r
        assert abs(r["loss"] - r["want"]) <= 1e-5 * abs(r["want"]), r
        assert r["grad_err"] <= 1e-5 and r["compared"] == 21, r


def test_parcomps_count_is_of_the_calls_its_program_makes():
    """A bucket's members after its first are steps of 0 bytes in the explanation (its one
    all_reduce carries them): the comparison counts the calls, 2 here, not the 4 steps."""
    from parcomp.api.dtensor_compare import block_regex, parcomp_counts
    from parcomp.api.results import Collective, LayoutChange

    def change(module, nbytes):
        step = Collective("all_reduce", "tp", "backward", nbytes, (8, 32), None, "gradient", 1e-4)
        return LayoutChange("g", module, "backward", "[P]", "[R]", "all_reduce", nbytes, 1e-4, (step,), ())

    changes = (change("model.layers.0.mlp", 4096), change("model.layers.0.mlp", 0),
               change("model.layers.0.self_attn", 4096), change("model.layers.0.self_attn", 0))
    x = type("Explanation", (), {"changes": changes})()
    counts = parcomp_counts(x, "tp", block_regex(TP_PLAN))
    assert counts == {("model.layers.0", "backward", "all_reduce"): 2}
