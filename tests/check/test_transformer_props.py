"""Hypothesis over whole random small transformer LMs on the numpy interpreter:
heads and kv heads (GQA, fewer kv heads than ranks included), head dim, layers, sequence,
batch, a vocab not divisible by tp (padded, `mask_pad`), LayerNorm or RMSNorm, GELU or
SiLU-gated MLP, tied or untied LM head, vocab-parallel or not, `sequence-parallel` or not,
tp in {2, 4}, dp x tp, forward or a training step. The sharded program must equal the
unsharded graph as ``parcomp check`` compares them: both in float64, every output (training:
the lockstep check of parcomp/check/train_check.py, every gradient and parameter) within the
threshold of its scale (parcomp/check/differential.py)."""
from __future__ import annotations

import os

from hypothesis import given, settings, strategies as st

from parcomp.check.differential import verdict
from parcomp.check.train_check import lockstep
from parcomp.compile.compiler import compile_graph
from parcomp.ir import parse_graph
from parcomp.spec import parse_spec

from numerics import assert_program_equivalent
from transformer_cases import Config, feeds, model_text, spec_text

#: a whole model per example (compile + all ranks + the unsharded run): bounded in CI
MAX_EXAMPLES = 12 if os.environ.get("CI") else 40


@st.composite
def configs(draw):
    tp = draw(st.sampled_from([2, 4]))
    dp = draw(st.sampled_from([1, 2])) if tp == 2 else 1
    heads = tp * draw(st.sampled_from([1, 2]))
    kv = draw(st.sampled_from([k for k in (1, 2, 4, 8) if heads % k == 0 and (k % tp == 0 or tp % k == 0)]))
    sp = draw(st.booleans())
    seq = draw(st.sampled_from([s for s in (2, 3, 4, 8) if not sp or s % tp == 0]))
    return Config(tp=tp, dp=dp, batch=dp * draw(st.sampled_from([1, 2])), seq=seq, heads=heads, kv_heads=kv,
                  head_dim=draw(st.sampled_from([2, 4])), layers=draw(st.sampled_from([1, 2])),
                  vocab=draw(st.integers(5, 19)), norm=draw(st.sampled_from(["layer_norm", "rms_norm"])),
                  mlp=draw(st.sampled_from(["gelu", "swiglu"])), tied=draw(st.booleans()),
                  vocab_parallel=draw(st.booleans()), sequence_parallel=sp, train=draw(st.booleans()))


def check_config(cfg: Config, seed: int = 0) -> None:
    """Compile ``cfg``'s LM with its spec and compare the sharded run with the unsharded one."""
    c = compile_graph(parse_graph(model_text(cfg)), parse_spec(spec_text(cfg), "case.pcs"))
    f = feeds(c.logical, cfg, seed)
    if cfg.train:
        r = lockstep(c, None, None, f, 1)["vs_unsharded"]  # in float64
        assert verdict(r) == "OK", (cfg, r["why"])
        return
    assert_program_equivalent(c, f)


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(configs(), st.integers(0, 3))
def test_random_transformer_sharded_equals_unsharded(cfg, seed):
    check_config(cfg, seed)


def test_gqa_fewer_kv_heads_than_ranks_padded_vocab_sp_and_vocab_parallel_train():
    """The hardest corner as a fixed case: 1 kv head on tp=4, vocab 13 padded to 16 and split,
    sequence parallel, tied head, SiLU-gated MLP, two layers, a training step."""
    check_config(Config(tp=4, dp=1, batch=2, seq=4, heads=4, kv_heads=1, head_dim=2, layers=2, vocab=13,
                        norm="rms_norm", mlp="swiglu", tied=True, vocab_parallel=True,
                        sequence_parallel=True, train=True))
