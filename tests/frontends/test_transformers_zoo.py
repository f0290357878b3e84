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
    # fused qkv_proj / gate_up_proj: the plan gathers the attention and MLP inputs' parts
    "phi3_lm": {("all_gather", "forward"): 4, ("all_reduce", "forward"): 2, ("all_reduce", "backward"): 2},
    # multi-query attention in one fused query_key_value
    "falcon_lm": {("all_gather", "forward"): 2, ("all_reduce", "forward"): 2, ("all_gather", "backward"): 2,
                  ("all_reduce", "backward"): 2},
    # experts split over tp (each rank 2 of 4); the router's logits gathered for its softmax
    "mixtral_lm": {("all_reduce", "forward"): 2, ("all_gather", "forward"): 4, ("all_reduce", "backward"): 4},
    "qwen2_moe_lm": {("all_reduce", "forward"): 4, ("all_gather", "forward"): 6, ("all_reduce", "backward"): 4},
    # MLA's low-rank projections and the group-limited sigmoid router
    "deepseek_v3_lm": {("all_gather", "forward"): 12, ("all_reduce", "forward"): 2, ("all_gather", "backward"): 1,
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
