"""Every shipped spec's collectives, counted per phase: ``(phase, kind, mesh axis) -> count``
from the compiled Program's report (``report.json["collectives"]``, each record with its
``phase``), as DTensor's tests count them with CommDebugMode. A pipelined spec (a ``pp`` axis)
is counted per pp coordinate from ``report.json["pipeline"]["collectives"]``: what one rank of
each stage runs in one step.

The expected counts are derived from the layouts (Megatron's f/g, sequence parallel, DDP), not
copied from a run; where the compiler emits more than that minimum the entry says why (a
documented choice of the compiler), so a change either way shows here.
"""
from __future__ import annotations

import collections
import functools
import re
from pathlib import Path

import pytest

from parcomp.compile.compiler import compile_graph
from parcomp.spec import load_spec

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1].parent
SPECS = ROOT / "specs"
MODELS = str(SPECS / "models.py")
SHIPPED = sorted(p.stem for p in SPECS.glob("*.pcs"))


def c(text: str) -> dict:
    """``"forward all_reduce tp 4, backward all_reduce dp,tp 4"`` as ``{(phase, kind, axis): n}``
    (items end at a comma after a count)."""
    out = {}
    for item in filter(None, (s.strip() for s in re.split(r"(?<=\d),", text))):
        phase, kind, axis, n = item.split()
        out[phase, kind, axis] = int(n)
    return out


# Megatron's tensor parallel block: a column-parallel matmul (identity forward, all_reduce of
# the input gradient backward: f) then a row-parallel one (all_reduce of the partial output
# forward: g). Attention and MLP are one such pair each, so a training block has 2 all_reduce
# forward and 2 backward.
MEGATRON_2_BLOCKS = c("forward all_reduce tp 4, backward all_reduce tp 4")
# Sequence parallel: per block all_gather before each column-parallel pair and reduce_scatter
# after each row-parallel one (2 + 2 forward, the mirror pairs backward); the final norm runs on
# the split sequence, so the LM head's input is gathered once more each way; the norm-weight
# gradients (partial over tp: the norms ran on slices) in one all_reduce.
SEQUENCE_PARALLEL_2_BLOCKS = c("forward all_gather tp 5, forward reduce_scatter tp 4,"
                               "backward all_gather tp 5, backward reduce_scatter tp 4,"
                               "backward all_reduce tp 1")
# Context parallel (the causal attention layer, one sdpa): the 5 all_gathers over cp of x and
# the attention output (forward) and of the q/k/v projections' output gradients (backward), the
# operands of the 4 weight gradients, and the loss's all_gather, are the cost model's choice at
# this size (2 x 16 tokens: gathering them moves fewer bytes than all-reducing the weight
# gradients; docs/design/search.md,
# "Consequence worth knowing"); the minimum in calls would be one bucketed all_reduce of the
# weight gradients over cp and a scalar loss all_reduce.
CP_WEIGHT_GRAD_GATHERS = c("forward all_gather cp 2, loss all_gather cp 1, backward all_gather cp 3")


def plus(*tables) -> dict:
    out = collections.Counter()
    for t in tables:
        out.update(t)
    return dict(out)


#: spec -> (model, expected counts); a pp spec's counts are one table per pp coordinate
EXPECTED = {
    # forward only: one row-parallel output summed (Megatron's g); x replicated
    "tiny_relu_mlp_tp2": ("tiny_relu_mlp.pcir", c("forward all_reduce tp 1")),
    "torch_mlp_tp2": ("torch_mlp", c("forward all_reduce tp 1")),
    "torch_mlp_tp4": ("torch_mlp", c("forward all_reduce tp 1")),
    "gpt2_mlp_tp2": ("gpt2_mlp", c("forward all_reduce tp 1")),
    # the output split along the sequence: the partial sum reduce-scattered instead
    "gpt2_mlp_tp2_seq": ("gpt2_mlp", c("forward reduce_scatter tp 1")),
    # dp splits the batch; weights replicated over dp: nothing over dp in a forward
    "gpt2_mlp_dp2_tp2": ("gpt2_mlp", c("forward all_reduce tp 1")),
    # training: g forward, f backward (x's gradient, input_grads by default)
    "gpt2_mlp_tp2_train": ("gpt2_mlp", c("forward all_reduce tp 1, backward all_reduce tp 1")),
    # + dp: the MSE's scalar sum over the batch (split over dp; the loss's elementwise part also
    # runs on token slices over tp, free after the forward all_reduce); the gradients over dp in
    # DDP buckets, one per layout: c_fc.weight, c_fc.bias and c_proj.weight ([P, S] over dp, tp)
    # in one, c_proj.bias ([P, R]) alone (docs/design/lowering.md, "Gradient buckets for dp reductions":
    # Megatron's DDP puts both in one buffer, so 1 over DDP's minimum)
    "gpt2_mlp_dp2_tp2_train": ("gpt2_mlp", c("forward all_reduce tp 1, loss all_reduce dp,tp 1,"
                                             "backward all_reduce tp 1, backward all_reduce dp 2")),
    # transformer LMs, 2 blocks each: Megatron's 4 per block; the vocab is not split, the token
    # ids have no gradient
    "gpt2_lm_tp2_train": ("gpt2_lm", MEGATRON_2_BLOCKS),
    "llama_lm_tp2_train": ("llama_lm", MEGATRON_2_BLOCKS),
    "qwen2_lm_tp2_train": ("qwen2_lm", MEGATRON_2_BLOCKS),
    "gemma_lm_tp2_train": ("gemma_lm", MEGATRON_2_BLOCKS),
    "mistral_lm_tp2_train": ("mistral_lm", MEGATRON_2_BLOCKS),
    "gemma2_lm_tp2_train": ("gemma2_lm", MEGATRON_2_BLOCKS),
    "opt_lm_tp2_train": ("opt_lm", MEGATRON_2_BLOCKS),
    "bert_mlm_tp2_train": ("bert_mlm", MEGATRON_2_BLOCKS),
    "vit_style_tp2_train": ("vit_style", MEGATRON_2_BLOCKS),
    "vit_classifier_tp2_train": ("vit_classifier", MEGATRON_2_BLOCKS),
    "gpt2_lm_tp2_sp_train": ("gpt2_lm", SEQUENCE_PARALLEL_2_BLOCKS),
    "llama_lm_tp2_sp_train": ("llama_lm", SEQUENCE_PARALLEL_2_BLOCKS),
    # dp x tp: Megatron's 4 over tp a block, but the first block's input gradient is also the
    # position embedding's gradient (a sum over the dp-split batch): one all_reduce over dp,tp at
    # once. The loss: the token count (cross-entropy's mean over the global batch) and the loss
    # sum, two scalars over dp. The LM head and the final norm run on token slices over tp as
    # well as dp, so their gradients (lm_head, tied to wte; ln_f's 2) are summed over dp,tp: the
    # head alone, the norms in one buffer. The blocks' 16 matmul weight and bias gradients go
    # over dp in DDP buckets, one per layout (the 12 split over tp, the 4 row-parallel biases
    # replicated over tp), and the block norms' 8 in one buffer of their own
    # (bucket-norm-grads). DDP's minimum: one bucket per group (dp, dp,tp), so the 5 gradient
    # reductions are 3 over it (documented choices: a bucket holds one layout; the
    # norm-gradient buffer is a separate pass).
    "gpt2_lm_dp2_tp2_train": ("gpt2_lm", c(
        "forward all_reduce tp 4, loss all_reduce dp 2, backward all_reduce tp 3,"
        "backward all_reduce dp,tp 3, backward all_reduce dp 3")),
    # context parallel, all_gather lowering: K and V gathered (forward), dK and dV
    # reduce-scattered to their owners (backward), plus the weight-gradient gathers above
    "attention_cp2_train": ("causal_attention", plus(CP_WEIGHT_GRAD_GATHERS, c(
        "forward all_gather cp 2, backward reduce_scatter cp 2"))),
    # + tp: heads split over tp, so each tp rank gathers its own kv head; Megatron's one
    # all_reduce over tp after o_proj and one for x's gradient
    "attention_cp2_tp2_train": ("causal_attention", plus(CP_WEIGHT_GRAD_GATHERS, c(
        "forward all_gather cp 2, backward reduce_scatter cp 2,"
        "forward all_reduce tp 1, backward all_reduce tp 1"))),
    # Ulysses: all_to_all of Q, K, V and the output forward, the 4 mirrored backward
    "attention_cp2_a2a_train": ("causal_attention", plus(CP_WEIGHT_GRAD_GATHERS, c(
        "forward all_to_all cp 4, backward all_to_all cp 4"))),
    # ring, cp=2: one K/V pass forward; backward one ring for dq, dk, dv on the statistics the
    # forward kept: a K/V pass and the partial dK/dV's pass home
    "attention_cp2_ring_train": ("causal_attention", plus(CP_WEIGHT_GRAD_GATHERS, c(
        "forward send_recv cp 1, backward send_recv cp 2"))),
    "attention_cp2_ring_balanced_train": ("causal_attention", plus(CP_WEIGHT_GRAD_GATHERS, c(
        "forward send_recv cp 1, backward send_recv cp 2"))),
    # expert parallel: each ep rank keeps its own rows (ep splits the batch as dp does); tokens
    # to their experts' ranks and back (2 all_to_all forward, their transposes backward), the
    # scalar loss summed over ep, the router's gradient summed (it ran on split rows): the
    # textbook 2 + 2 all_to_all, the router-gradient all_reduce and a scalar loss all_reduce
    "moe_ep2_train": ("moe_block", c("forward all_to_all ep 2, loss all_reduce ep 1,"
                                     "backward all_to_all ep 2, backward all_reduce ep 1")),
    # ep x tp: the same all_to_all pair each way; Megatron's all_reduce over tp of the experts'
    # row-parallel partial outputs forward, and of the column-parallel input gradient (x's)
    # backward; the loss (its elementwise part on token slices over tp too) and the router's
    # gradient summed over ep,tp at once
    "moe_ep2_tp2_train": ("moe_block", c(
        "forward all_to_all ep 2, forward all_reduce tp 1, loss all_reduce ep,tp 1,"
        "backward all_to_all ep 2, backward all_reduce ep,tp 1, backward all_reduce tp 1")),
    # shared expert, ep: rows kept split, 2 all_to_all each way, the loss over ep; the 5
    # gradients of the router, the shared expert's 3 projections and its gate (all ran on split
    # rows) over ep one by one: DDP's minimum is one bucket (buckets are built over the dp axis
    # alone, docs/design/lowering.md "Gradient buckets"), so 4 over it
    "moe_shared_ep2_train": ("moe_block_shared", c(
        "forward all_to_all ep 2, loss all_reduce ep 1, backward all_to_all ep 2,"
        "backward all_reduce ep 5")),
    # a whole MoE LM (2 blocks), ep=2: each block's tokens to their experts and back (2
    # all_to_all a block each way); the cross-entropy's sum and token count over ep; the 13
    # gradients of what every ep rank holds whole (the embedding, lm_head, each block's q, k, v,
    # o and router, the norms' in one buffer) over ep one by one (no dp bucket: 12 over DDP's
    # minimum, as above); no expert weight's gradient over ep
    "moe_lm_ep2_train": ("moe_lm", c(
        "forward all_to_all ep 4, loss all_reduce ep 2, backward all_to_all ep 4,"
        "backward all_reduce ep 13")),
    # transformers' own Mixtral (its topk router, its fused expert tensors): the same exchanges
    # as the rewritten block's
    "mixtral_lm_ep2_train": ("mixtral_lm", c(
        "forward all_to_all ep 4, loss all_reduce ep 2, backward all_to_all ep 4,"
        "backward all_reduce ep 13")),
    # a model computing its own loss, dp: transformers' sum over the counted tokens and their
    # count all-reduced once each, in the forward where the model computes them (gpt2_lm with
    # loss=cross_entropy has the same two in the loss phase); backward the position
    # embedding's gradient (a sum over the batch), the norms' buffer and one DDP bucket
    "gpt2_lm_loss_dp2_train": ("gpt2_lm_loss", c("forward all_reduce dp 2, backward all_reduce dp 3")),
    # dp x ep: 2 all_to_all each way; the scalar loss over dp,ep; the routed experts'
    # gradients over dp (one bucket); the 5 gradients of the router, the shared expert's 3
    # projections and its gate over dp,ep one by one: DDP's minimum is one bucket there
    # (buckets are built over the dp axis alone, docs/design/lowering.md "Gradient buckets"), so 4 over it
    "moe_shared_dp2_ep2_train": ("moe_block_shared", c(
        "forward all_to_all ep 2, loss all_reduce dp,ep 1, backward all_to_all ep 2,"
        "backward all_reduce dp 1, backward all_reduce dp,ep 5")),
    # pipelines, one table per pp coordinate (one microbatch): Megatron's all_reduces inside
    # each stage's programs; one activation sent forward and its gradient back; after the
    # microbatches the gradients all-reduced over dp in buckets of bucket_cap_mb (25 MiB: one a
    # stage here, as DDP's; parcomp/passes/pipeline/dp_buckets.py), a tied gradient alone after
    # its stages' sum; the loss over dp on the last stage.
    # 48 blocks, 24 a stage; stage 0's first block has no input gradient (input_grads=no)
    "mlp_chain_dp2_pp2_tp2_train": ("mlp_chain", [
        c("forward all_reduce tp 24, backward all_reduce tp 23, forward send pp 1,"
          "backward recv pp 1, optimizer all_reduce dp 1"),
        c("forward all_reduce tp 24, backward all_reduce tp 24, forward recv pp 1,"
          "backward send pp 1, optimizer all_reduce dp 1, loss all_reduce dp 1")]),
    # GPT-2, one block a stage: 2 + 2 over tp each; the tied wte/lm_head gradient summed over
    # its two stages' ranks (pp) before dp, then over dp alone; the other 13 gradients of stage
    # 0 (wpe, block 0) and 14 of stage 1 (block 1, ln_f) in one bucket each
    "gpt2_lm_dp2_pp2_tp2_train": ("gpt2_lm", [
        c("forward all_reduce tp 2, backward all_reduce tp 2, forward send pp 1,"
          "backward recv pp 1, optimizer all_reduce pp 1, optimizer all_reduce dp 2"),
        c("forward all_reduce tp 2, backward all_reduce tp 2, forward recv pp 1,"
          "backward send pp 1, optimizer all_reduce pp 1, optimizer all_reduce dp 2,"
          "loss all_reduce dp 1")]),
}


@functools.lru_cache(maxsize=None)
def _compiled(spec_name):
    from parcomp.frontends.loader import load_model

    model = EXPECTED[spec_name][0]
    if model not in ("tiny_relu_mlp.pcir", "torch_mlp", "mlp_chain"):
        pytest.importorskip("transformers")
    path = str(SPECS / model) if model.endswith(".pcir") else f"{MODELS}:{model}"
    return compile_graph(load_model(path)[0], load_spec(SPECS / f"{spec_name}.pcs"))


def counts(records) -> dict:
    """``{(phase, kind, axis): count}`` of report.json collective records."""
    return dict(collections.Counter((r["phase"], r["kind"], r["axis"]) for r in records))


def per_rank(lists) -> list:
    """``report.json["pipeline"]["collectives"]`` as one ``{(phase, kind, axis): count}`` per pp
    coordinate."""
    return [{(r["phase"], r["kind"], r["axis"]): r["count"] for r in rank} for rank in lists]


def test_every_shipped_spec_has_its_counts():
    assert sorted(EXPECTED) == SHIPPED


@pytest.mark.parametrize("spec_name", SHIPPED)
def test_collectives_per_phase(spec_name):
    want = EXPECTED[spec_name][1]
    report = _compiled(spec_name).report
    if isinstance(want, list):  # pipelined: per pp coordinate
        assert per_rank(report["pipeline"]["collectives"]) == want
    else:
        assert counts(report["collectives"]) == want
        assert all(r["phase"] in ("forward", "loss", "backward", "optimizer") for r in report["collectives"])


#: the transformers models trained with Megatron's plan: (spec, blocks)
MEGATRON_MODELS = [("gpt2_lm_tp2_train", 2), ("llama_lm_tp2_train", 2), ("qwen2_lm_tp2_train", 2),
                   ("gemma_lm_tp2_train", 2), ("gemma2_lm_tp2_train", 2), ("mistral_lm_tp2_train", 2), ("opt_lm_tp2_train", 2), ("bert_mlm_tp2_train", 2),
                   ("vit_style_tp2_train", 2), ("vit_classifier_tp2_train", 2)]


@pytest.mark.parametrize("spec_name,blocks", MEGATRON_MODELS)
def test_megatron_transformer_block_is_four_all_reduces(spec_name, blocks):
    """Per block: the attention and MLP outputs all-reduced forward, their inputs' gradients
    backward; nothing else (the vocab is not split, the embeddings' gradients need no sum)."""
    recs = _compiled(spec_name).report["collectives"]
    assert {(r["kind"], r["axis"]) for r in recs} == {("all_reduce", "tp")}
    per_phase = collections.Counter(r["phase"] for r in recs)
    assert per_phase == {"forward": 2 * blocks, "backward": 2 * blocks}


@pytest.mark.parametrize("schedule,want", [
    # 2 blocks a stage, 2 microbatches: per microbatch 2 all_reduce over tp forward, 1 backward
    # on stage 0 (its first block has no input gradient: input_grads=no), 2 on stage 1; one
    # activation each way per microbatch; a stage's 8 gradients in one dp bucket; the loss over dp
    ("1f1b", [c("forward all_reduce tp 4, backward all_reduce tp 2, forward send pp 2,"
                "backward recv pp 2, optimizer all_reduce dp 1"),
              c("forward all_reduce tp 4, backward all_reduce tp 4, forward recv pp 2,"
                "backward send pp 2, optimizer all_reduce dp 1, loss all_reduce dp 1")]),
    # 4 virtual stages of one block; rank 0 holds blocks 0 and 2, rank 1 blocks 1 and 3: rank 0
    # sends forward from both chunks and receives into block 2, the mirror backward
    ("interleaved virtual=2", [
        c("forward all_reduce tp 4, backward all_reduce tp 2, forward send pp 4,"
          "forward recv pp 2, backward recv pp 4, backward send pp 2, optimizer all_reduce dp 2"),
        c("forward all_reduce tp 4, backward all_reduce tp 4, forward recv pp 4,"
          "forward send pp 2, backward send pp 4, backward recv pp 2, optimizer all_reduce dp 2,"
          "loss all_reduce dp 1")]),
])
def test_pipeline_counts_scale_with_microbatches_and_chunks(schedule, want):
    from parcomp.passes.pass_list import plan_pipeline

    from graphs import spec
    from test_pipeline import TRAIN, chain_graph

    layouts = "".join(f"{3 * k}.weight colwise\n{3 * k + 2}.weight rowwise\n" for k in range(4))
    plan = plan_pipeline(chain_graph(blocks=4), spec(f"mesh dp=2 pp=2 tp=2\n{layouts}"
                                                     f"{TRAIN} microbatches=2 schedule={schedule}\n"))
    assert per_rank(plan.collective_counts()) == want
