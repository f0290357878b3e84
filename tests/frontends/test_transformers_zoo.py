"""The model zoo: each family as transformers builds it from a tiny config (random weights,
no edits to the model; ``specs/models.py``), planned at TP=2 for training with the in-process
API (``parcomp.plan.planner.plan``, as ``parcomp plan --mesh tp=2 --train ...``), compiled, and
checked two AdamW steps against the unsharded model and torch.optim (``check``'s lockstep),
with its collectives pinned per phase. 2 blocks each: Megatron's plan is 4 all_reduce forward
and 4 backward (``MEGATRON``); where the planned step differs the entry says why."""
from __future__ import annotations

import collections
import os
import sys

import pytest

from parcomp.check.differential import verdict
from parcomp.check.train_check import lockstep, train_feeds
from parcomp.cli.commands import feeds_for
from parcomp.compile.compiler import compile_graph
from parcomp.frontends.torch.export import import_torch
from parcomp.plan.planner import plan
from parcomp.spec import parse_spec

pytest.importorskip("torch")
pytest.importorskip("transformers")
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..")
sys.path.insert(0, os.path.join(ROOT, "specs"))
import models  # noqa: E402

TRAIN = "train loss=cross_entropy optimizer=adamw(lr=0.001) steps=2"
MEGATRON = {("all_reduce", "forward"): 4, ("all_reduce", "backward"): 4}

#: factory -> collectives of the planned TP=2 training step, (kind, phase) -> count
ZOO = {
    "llama_lm": MEGATRON,
    "qwen2_lm": MEGATRON,
    "mistral_lm": MEGATRON,  # a sliding window shorter than the sequence
    "gemma_lm": MEGATRON,  # padding_idx, tied embeddings
    "gemma2_lm": MEGATRON,  # eager attention with soft-capping, local and global layers
    "opt_lm": MEGATRON,
    "gpt2_lm": MEGATRON,  # fused c_attn split per part and head
    # the MLM head's dense layer is column parallel, its LayerNorm needs the whole row: one
    # all_gather forward, and its input gradient one more all_reduce backward
    "bert_mlm": {("all_reduce", "forward"): 4, ("all_gather", "forward"): 1, ("all_reduce", "backward"): 5},
    # the classifier reads the class token: its row gathered once; one more gradient all_reduce
    "vit_classifier": {("all_gather", "forward"): 1, ("all_reduce", "forward"): 4,
                       ("all_reduce", "backward"): 5},
    # parallel residual: attention and MLP partial sums added first, one all_reduce a block
    # forward; backward the two branches' input gradients each
    "gpt_neox_lm": {("all_reduce", "forward"): 2, ("all_reduce", "backward"): 4},
    # fused qkv_proj (4 query | 2 key | 2 value heads) split per part and per kv group, fused
    # gate_up_proj per part (before: qkv_proj and o_proj's weights gathered every block)
    "phi3_lm": MEGATRON,
    # multi-query attention in one fused query_key_value, cut into its query rows (colwise,
    # per head) and its one kv head's rows (replicated); parallel attention and MLP: one
    # all_reduce a block forward, backward the kv heads' gradient and the block input's
    # (before: the fused weight whole, the attention output's gradient gathered every block)
    "falcon_lm": {("all_reduce", "forward"): 2, ("all_reduce", "backward"): 4},
    # experts split over tp (each rank 2 of 4), the router replicated (planner._router, as
    # Megatron: before, split and its logits gathered for the softmax every block); the experts'
    # outputs gathered for the combine
    "mixtral_lm": {("all_reduce", "forward"): 2, ("all_gather", "forward"): 2, ("all_reduce", "backward"): 4},
    # the same, and the one-feature shared_expert_gate replicated (before, rowwise and gathered)
    "qwen2_moe_lm": {("all_reduce", "forward"): 4, ("all_gather", "forward"): 2, ("all_reduce", "backward"): 4},
    # MLA: the low-rank q_a_proj / kv_a_proj_with_mqa stay replicated (before, split and
    # gathered: 12 all_gather forward); at this size (16 tokens, hidden 64) gathering q_b_proj,
    # kv_b_proj and o_proj's weights costs less than splitting the heads, whose backward
    # all-reduces each latent's gradient (test_mla_splits_heads_after_the_low_rank_projections);
    # the group-limited sigmoid router replicated (planner._router)
    "deepseek_v3_lm": {("all_gather", "forward"): 7, ("all_reduce", "forward"): 2, ("all_gather", "backward"): 1,
                       ("all_reduce", "backward"): 2},
    # the same with a complex rotary embedding (real arithmetic) and a softmax router
    "deepseek_v2_lm": {("all_gather", "forward"): 7, ("all_reduce", "forward"): 2, ("all_gather", "backward"): 1,
                       ("all_reduce", "backward"): 2},
}


@pytest.mark.parametrize("factory", sorted(ZOO))
def test_a_family_as_transformers_builds_it_plans_and_checks_at_tp2(factory):
    module, example, names = getattr(models, factory)()
    graph = import_torch(module, example, names)
    text, _ = plan(graph, "tp=2", train=TRAIN, seconds=5.0)
    compiled = compile_graph(graph, parse_spec(text, f"{factory}_plan.pcs"))
    feeds = train_feeds(compiled, module, example, 0, feeds_for)
    ls = lockstep(compiled, module, example, feeds, 2)
    parts = [ls["vs_unsharded"]] + [ls[k] for k in ("native", "vs_torch") if ls[k] is not None]
    assert verdict(*parts) == "OK", [p.get("why") for p in parts]
    assert ls["vs_torch"] is not None and ls["vs_torch"]["ok"]
    counts = collections.Counter((r["kind"], r["phase"]) for r in compiled.report["collectives"])
    assert dict(counts) == ZOO[factory]


def test_kv_projections_of_multi_query_attention_stay_replicated_never_gathered():
    """Llama with one kv head at tp=2: the planner may keep k_proj / v_proj replicated (the
    ranks do not divide the kv heads), so no block gathers them or their keys and values (before,
    both weights were split and gathered every block). Where the query heads and o_proj go is
    the cost model's choice at this size: it gathers the rotated queries and o_proj's weight
    (attention replicated) rather than all-reduce o_proj's partial sums."""
    from transformers import LlamaConfig, LlamaForCausalLM
    import torch

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                         bos_token_id=0, eos_token_id=1, pad_token_id=None, use_cache=False,
                         attn_implementation="sdpa")
    module = LlamaForCausalLM(config).eval()
    example = (torch.randint(0, 128, (2, 8)),)
    graph = import_torch(module, example, ["input_ids"])
    text, _ = plan(graph, "tp=2", train=TRAIN, seconds=5.0)
    rules = [ln.split()[0] for ln in text.splitlines() if ln and not ln.startswith(("#", " "))]
    assert not [r for r in rules if "k_proj" in r or "v_proj" in r]  # no rule: replicated
    compiled = compile_graph(graph, parse_spec(text, "mqa_plan.pcs"))
    counts = collections.Counter((r["kind"], r["phase"]) for r in compiled.report["collectives"])
    # per block: the queries and o_proj's weight gathered, the MLP's all_reduce each way (with
    # k_proj / v_proj split, 4 all_gather a block)
    assert dict(counts) == {("all_gather", "forward"): 4, ("all_reduce", "forward"): 2,
                            ("all_reduce", "backward"): 2}
    feeds = train_feeds(compiled, module, example, 0, feeds_for)
    ls = lockstep(compiled, module, example, feeds, 2)
    assert verdict(*[ls["vs_unsharded"]] + [ls[k] for k in ("native", "vs_torch") if ls[k] is not None]) == "OK"


def test_mla_splits_heads_after_the_low_rank_projections():
    """DeepSeek-V3's MLA at tp=2: the planner keeps the low-rank q_a_proj and
    kv_a_proj_with_mqa replicated (no rule; before, both split and their latents gathered
    every block) and splits q_b_proj / kv_b_proj by heads, o_proj by rows. Compiled with the
    attention split by heads, each block's attention is one all_reduce forward and, backward,
    one per latent whose norm needs the whole row (q's, kv's) and one for the rotary key shared
    by every head: MLA's floor, 3 more than Megatron's MHA block (docs/design/plan.md)."""
    module, example, names = models.deepseek_v3_lm()
    graph = import_torch(module, example, names)
    text, _ = plan(graph, "tp=2", train=TRAIN, seconds=5.0)
    rules = dict(ln.split()[:2] for ln in text.splitlines() if ln and not ln.startswith(("#", " ", "mesh",
                                                                                       "input", "output", "train")))
    attn = {k.rsplit(".", 2)[-2]: v for k, v in rules.items() if ".self_attn." in k and k.endswith("_proj.weight")}
    assert attn == {"q_b_proj": "colwise", "kv_b_proj": "colwise", "o_proj": "rowwise"}, rules
    heads = "".join(f"activation {n.name} [S(1)]\n" for n in graph.nodes if n.op == "sdpa")
    compiled = compile_graph(graph, parse_spec(text + heads, "mla_plan.pcs"))
    counts = collections.Counter((r["kind"], r["phase"]) for r in compiled.report["collectives"])
    # + backward, the routing weights' gradient (split with the experts) gathered for the top-k's
    # take_along; the router itself replicated (planner._router: before, its scores were gathered
    # for the group-limited top-k, one all_gather forward)
    assert dict(counts) == {("all_reduce", "forward"): 4, ("all_reduce", "backward"): 8,
                            ("all_gather", "backward"): 1}
    feeds = train_feeds(compiled, module, example, 0, feeds_for)
    ls = lockstep(compiled, module, example, feeds, 2)
    assert verdict(*[ls["vs_unsharded"]] + [ls[k] for k in ("native", "vs_torch") if ls[k] is not None]) == "OK"


def _deepseek_v3(hidden, seq, batch):
    """:func:`models.deepseek_v3_lm` scaled with ``hidden``: hidden/16 heads, q rank hidden/2,
    kv rank hidden/4 (the zoo's proportions), ``batch`` x ``seq`` tokens."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    import torch

    torch.manual_seed(0)
    s = hidden // 64
    config = DeepseekV3Config(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden,
                              moe_intermediate_size=hidden // 2, num_hidden_layers=2, first_k_dense_replace=1,
                              num_attention_heads=4 * s, num_key_value_heads=4 * s, n_routed_experts=4,
                              num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                              q_lora_rank=32 * s, kv_lora_rank=16 * s, qk_rope_head_dim=8, qk_nope_head_dim=16,
                              v_head_dim=16, max_position_embeddings=max(64, seq), bos_token_id=0, eos_token_id=1,
                              pad_token_id=None, use_cache=False, attn_implementation="sdpa")
    module = models._draw_moe(DeepseekV3ForCausalLM(config).eval())
    return module, (torch.randint(0, 128, (batch, seq)),), ["input_ids"]


def _attention_weights_gathered(graph, compiled):
    """The MLA weights (``q_b_proj``, ``kv_b_proj``, ``o_proj``) whose all_gather the step runs."""
    out = []
    for r in compiled.report["collectives"]:
        n = graph[r["producer"]] if r["producer"] in graph else None
        if r["kind"] == "all_gather" and n is not None and n.op == "permute" and graph[n.inputs[0]].op == "param" \
                and ".self_attn." in n.inputs[0]:
            out.append(n.inputs[0])
    return out


@pytest.mark.parametrize("hidden,seq,batch", [(64, 8, 2), (128, 64, 2), (1024, 512, 1)])
def test_mla_heads_stay_split_at_a_realistic_size_without_pins(hidden, seq, batch):
    """Plan and compile only (no run). At the zoo's size (hidden 64, 16 tokens) the training
    step gathers q_b_proj, kv_b_proj and o_proj's weights every block (3 all_gather, 11.9 us
    each under the cost model's NVLink latency at tp=2) rather than keep the heads split (one
    all_reduce forward and three backward, 13.8 us each): the bytes are a few KB either way and
    the replicated attention costs well under a microsecond, so the call latencies decide, and
    3 calls beat 4 (docs/design/plan.md, "MLA"). From 128 tokens at hidden 128 on, the
    attention split by heads wins with no pin: none of those weights is gathered; at 128 tokens
    the step is exactly the pinned per-head plan's (test_mla_splits_heads_after_the_low_rank_projections),
    and at hidden 1024 and 512 tokens each block's attention keeps o_proj's one all_reduce forward."""
    module, example, names = _deepseek_v3(hidden, seq, batch)
    graph = import_torch(module, example, names)
    text, _ = plan(graph, "tp=2", train=TRAIN, seconds=5.0)
    rules = dict(ln.split()[:2] for ln in text.splitlines() if ".self_attn." in ln and not ln.startswith(("#", " ")))
    heads = ("q_b_proj", "kv_b_proj", "o_proj")  # (the low-rank projections: the cost model's choice)
    attn = {k.rsplit(".", 2)[-2]: v for k, v in rules.items() if k.rsplit(".", 2)[-2] in heads}
    assert attn == {"q_b_proj": "colwise", "kv_b_proj": "colwise", "o_proj": "rowwise"}, rules
    compiled = compile_graph(graph, parse_spec(text, "mla_plan.pcs"))
    gathered = _attention_weights_gathered(graph, compiled)
    if hidden == 64:  # the zoo's size: the three weights of each block gathered, nothing else in it
        assert [w.rsplit(".", 2)[-2] for w in gathered] == list(heads) * 2, gathered
        return
    assert gathered == []
    counts = collections.Counter((r["kind"], r["phase"]) for r in compiled.report["collectives"])
    if hidden == 128:
        assert dict(counts) == {("all_reduce", "forward"): 4, ("all_reduce", "backward"): 8,
                                ("all_gather", "backward"): 1}
    o_proj = [r for r in compiled.report["collectives"] if r["producer"] in graph
              and (graph[r["producer"]].source or "").endswith("self_attn.o_proj")]
    assert [(r["kind"], r["phase"]) for r in o_proj] == [("all_reduce", "forward")] * 2


def _mixtral(hidden, seq, batch, experts):
    """:func:`models.mixtral_lm` scaled: ``hidden`` wide (hidden/64 kv heads, 2x query heads, head
    dim 32 from hidden 64 on), ``experts`` experts top-2 of intermediate ``hidden``, ``batch`` x
    ``seq`` tokens, 2 blocks."""
    from transformers import MixtralConfig, MixtralForCausalLM
    import torch

    torch.manual_seed(0)
    heads = max(4, hidden // 32)
    config = MixtralConfig(vocab_size=128, hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=2,
                           num_attention_heads=heads, num_key_value_heads=heads // 2, num_local_experts=experts,
                           num_experts_per_tok=2, max_position_embeddings=max(64, seq), router_jitter_noise=0.0,
                           bos_token_id=0, eos_token_id=1, pad_token_id=None, use_cache=False,
                           attn_implementation="sdpa")
    module = models._draw_moe(MixtralForCausalLM(config).eval())
    return module, (torch.randint(0, 128, (batch, seq)),), ["input_ids"]


@pytest.mark.parametrize("hidden,seq,batch,experts", [(16, 8, 4, 4), (1024, 512, 1, 8)])
def test_moe_router_stays_replicated_at_a_realistic_size_without_pins(hidden, seq, batch, experts):
    """Plan and compile only (no run). The planner lets an MoE router (a matmul whose logits
    reach a top-k: planner._router) stay replicated, and the search keeps it so at the zoo's size
    and at hidden 1024 with 512 tokens and 8 experts: no rule for it, and neither its logits nor
    its weight is gathered or reduced. Split, either way costs a collective a block (colwise:
    the logits gathered for the softmax over all experts; rowwise: their partial sums reduced),
    one call's latency (100 us under the cost model) against the replicated router's extra
    compute, 2 x 512 x 1024 x 8 FLOPs (84 us at 1e-11 s a FLOP) of which a split saves half.
    Before, the planner had to split every matrix on tp and the plan gathered the logits every
    block (docs/design/plan.md, "MoE routers")."""
    module, example, names = _mixtral(hidden, seq, batch, experts)
    graph = import_torch(module, example, names)
    text, _ = plan(graph, "tp=2", train=TRAIN, seconds=5.0)
    rules = [ln.split()[0] for ln in text.splitlines() if ln and not ln.startswith(("#", " "))]
    assert not [r for r in rules if r.endswith("mlp.gate.weight")], rules
    assert [r for r in rules if "mlp.experts" in r], rules  # the experts split (each rank half of them)
    compiled = compile_graph(graph, parse_spec(text, "router_plan.pcs"))
    router = [r for r in compiled.report["collectives"] if r["producer"] in graph
              and (graph[r["producer"]].source or "").endswith("mlp.gate")]
    assert router == [], router
