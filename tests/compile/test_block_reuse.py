"""Block-plan reuse (parcomp/repeat*.py): a model of many repeated blocks compiled
from a 5-block compile stamped to every block gives, byte for byte, the whole-graph compile's
program.py, report and logical/sharded/program IR; where the stamp does not fit, the whole
graph is compiled.

The depth (14) is one where the whole graph's own search is the heuristic too (over
MAX_STRATEGIES), as at 48 blocks, where the bench (bench/lm_compile_time.py) measures it. At 12
blocks GPT-2's training step (its spelt-out GELU imported as one op) has 11,634
strategies, under MAX_STRATEGIES (12,000): its whole graph is solved by the ILP, so reuse rightly
declines there; 14 blocks keep a margin over it.
"""
from __future__ import annotations

import os
from functools import lru_cache

import pytest

from parcomp.compile.compiler import compile_graph
from parcomp.compile.repeat import Blocks, find_blocks, reduced
from parcomp.compile.repeat_stamp import Stamper
from parcomp.ir.graph import evolve
from parcomp.ir.text import print_graph
from parcomp.spec import load_spec, parse_spec

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

SPECS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "specs")
DEPTH = 14


@lru_cache(maxsize=None)
def _model(family: str, n: int):
    from parcomp.frontends.torch.export import import_torch

    torch.manual_seed(0)
    if family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=101, n_positions=64, n_embd=32, n_layer=n, n_head=4,
                            bos_token_id=0, eos_token_id=0, use_cache=False, attn_implementation="sdpa")
        module, vocab = GPT2LMHeadModel(config).eval(), 101
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=n,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             bos_token_id=0, eos_token_id=1, pad_token_id=None, use_cache=False,
                             attn_implementation="sdpa")
        module, vocab = LlamaForCausalLM(config).eval(), 128
    return import_torch(module, (torch.randint(0, vocab, (2, 8)),), ["input_ids"])


def _spec(name):
    return load_spec(os.path.join(SPECS, name))


def _texts(compiled) -> dict:
    """Everything a user sees of a compile, timing aside."""
    from parcomp_backends.torch.emit import emit_program

    report = dict(compiled.report)
    report["search"] = {k: v for k, v in report["search"].items() if k != "seconds"}
    out = {what: print_graph(getattr(compiled, what)) for what in ("logical", "sharded", "program")}
    out["report"] = repr(report)
    out["program.py"] = emit_program(compiled, "cpu")
    return out


CASES = [("gpt2", "gpt2_lm_tp2_train.pcs"), ("gpt2", "gpt2_lm_tp2_sp_train.pcs"),
         ("llama", "llama_lm_tp2_train.pcs"), ("llama", "llama_lm_tp2_sp_train.pcs"),
         ("gpt2", "gpt2_lm_dp2_tp2_train.pcs")]


@pytest.mark.parametrize("family,spec_name", CASES)
def test_reuse_gives_the_whole_graph_compile_byte_for_byte(family, spec_name):
    graph, spec = _model(family, DEPTH), _spec(spec_name)
    whole = compile_graph(graph, spec, reuse=False)
    reused = compile_graph(graph, spec)
    assert not whole.reused and reused.reused  # the reuse path ran (else this test proves nothing)
    assert whole.sharded.search["search"] == "heuristic"  # the search reuse forces, at this depth too
    a, b = _texts(whole), _texts(reused)
    for key in a:
        assert a[key] == b[key], f"{key} differs"


def test_an_after_callback_or_reuse_false_compiles_the_whole_graph():
    graph, spec = _model("gpt2", DEPTH), _spec("gpt2_lm_tp2_train.pcs")
    seen = []
    assert not compile_graph(graph, spec, after=lambda name, g: seen.append(name)).reused
    assert "shard-prop" in seen
    assert not compile_graph(graph, spec, reuse=False).reused


@pytest.mark.parametrize("rule", ["transformer.h.7.mlp.c_fc.bias  replicated",
                                  "transformer.h.1*.mlp.c_fc.bias  replicated"])  # blocks 1, 10-13
def test_a_spec_rule_telling_blocks_apart_falls_back(rule):
    graph = _model("gpt2", DEPTH)
    text = open(os.path.join(SPECS, "gpt2_lm_tp2_train.pcs")).read().replace(
        "transformer.h.*.mlp.c_fc.weight     colwise",
        f"transformer.h.*.mlp.c_fc.weight     colwise\n{rule}")
    spec = parse_spec(text, "some_blocks.pcs")
    compiled = compile_graph(graph, spec)
    assert not compiled.reused
    assert compile_graph(graph, _spec("gpt2_lm_tp2_train.pcs")).reused  # the spec without it reuses


def test_a_block_unlike_the_others_falls_back():
    """Block 7's first norm with another eps: the windows are found, but the stamped input
    graph is not the model's, so the whole graph is compiled (and block 7 keeps its eps)."""
    graph = _model("gpt2", DEPTH)
    blocks = find_blocks(graph)
    odd = blocks.window(7)[0]
    assert graph[odd].op == "layer_norm"
    changed = graph.with_nodes([evolve(x, attrs=(("eps", 1e-3),)) if x.name == odd else x
                                for x in graph.nodes])
    compiled = compile_graph(changed, _spec("gpt2_lm_tp2_train.pcs"))
    assert not compiled.reused
    assert compiled.logical[odd].attr("eps") == 1e-3


def test_few_blocks_or_no_blocks_compile_the_whole_graph():
    spec = _spec("gpt2_lm_tp2_train.pcs")
    assert find_blocks(_model("gpt2", 4)) is None
    assert not compile_graph(_model("gpt2", 4), spec).reused


def test_blocks_whose_whole_graph_gets_the_ilp_are_compiled_whole():
    """8 blocks of GPT-2 are under MAX_STRATEGIES: the whole graph's search is the ILP, which a
    stamped heuristic plan must not stand in for (counted before the reduced shard-prop)."""
    compiled = compile_graph(_model("gpt2", 8), _spec("gpt2_lm_tp2_train.pcs"))
    assert not compiled.reused
    assert compiled.sharded.search["search"] != "heuristic"


def test_tokens_respect_digit_boundaries_and_one_token_per_word():
    names = tuple(f"{op}_{k}" for k in range(1, 13) for op in ("view", "addmm"))
    blocks = Blocks(prefix="h", n=12, start=0, length=2, compute=names)
    st = Stamper(blocks, 5)
    # window b is (view_{b+1}, addmm_{b+1}); the stamper knows blocks 1..4
    assert st.owner("view_1") is None  # block 0's names are not tokens
    assert st.owner("bw.view_3.reshape") == 2 and st.owner("bw.view_30") is None
    assert st.owner("view_3_0") is None  # a pass-made counter after a token is not that token
    assert st.owner("xview_3") is None and st.owner("view_6") is None
    assert st.parts("bw.addmm_4_mm.view_3") == ("bw.", "addmm_4", "_mm.view_3")  # first token only
    assert st.parts('frees="view_3,addmm_5"') == ('frees="', "view_3", ",", "addmm_5", '"')
    assert st.parts("opt.h.2.mlp.bias") == ("opt.", "h.2", ".mlp.bias") and st.owner("h.20.x") is None
    shift = st.shift_map((1, 2, 3), 4)
    assert shift["view_3"] == "view_7" and shift["h.2"] == "h.6"


def test_a_stage_reading_every_block_does_not_stamp():
    """A node outside the blocks reading the template's value (a bucket of every block's
    gradients) is refused by ``fits``: the passes from there run on the whole graph."""
    from parcomp.compile.repeat_stamp import fits

    graph = _model("gpt2", DEPTH)
    blocks = find_blocks(graph)
    st, small = Stamper(blocks, 5), reduced(graph, blocks, 5)
    assert fits(st, small)
    template = blocks.window(2)[-1]
    bad = small.with_nodes([*small.nodes, evolve(small.nodes[-1], name="everything", inputs=(template,))])
    assert not fits(st, bad)


def test_the_sequence_parallel_norm_bucket_is_stamped_not_rerun():
    """Under sp one bucket_cat reads every block's norm-weight gradients: it stamps (operands,
    frees, flat size, reason count, part offsets; byte identity above), so no lowering pass
    reruns on the whole graph; a bucket whose parts are not in offset order does not stamp."""
    from parcomp.passes.pass_list import passes_for, run_passes
    from parcomp.compile.repeat_stamp import fits, stamp

    graph, spec = _model("gpt2", DEPTH), _spec("gpt2_lm_tp2_sp_train.pcs")
    blocks = find_blocks(graph)
    st = Stamper(blocks, 5)
    stages = run_passes(reduced(graph, blocks, 5), spec, passes_for(spec), heuristic=True)
    final = stages["free-dead"]
    assert final.by_op("bucket_cat") and all(fits(st, g) for g in stages.values())
    big = stamp(st, final, DEPTH)
    cat = big.by_op("bucket_cat")[0]
    assert len(cat.inputs) == 4 * DEPTH + 2  # 2 norms a block, weight and bias; ln_f and cat.type.shape == (32 * len(cat.inputs),)
    parts = [x for x in final.nodes if x.op == "bucket_part"]
    a, b = parts[0].attr("offset"), parts[1].attr("offset")
    swapped = {parts[0].name: parts[0].with_attrs(offset=b), parts[1].name: parts[1].with_attrs(offset=a)}
    assert stamp(st, final.with_nodes([swapped.get(x.name, x) for x in final.nodes]), DEPTH) is None


def test_the_final_verify_passes_copies_and_catches_a_copy_across_blocks():
    """The stamped program verifies (copies are alike to their template node, checked once);
    a copy reading another block's value whose layout is corrupted is caught."""
    from parcomp.errors import VerifyError
    from parcomp.passes.pass_list import passes_for, run_passes
    from parcomp.passes.verify import verify
    from parcomp.compile.repeat_stamp import stamp

    graph, spec = _model("gpt2", DEPTH), _spec("gpt2_lm_tp2_train.pcs")
    blocks = find_blocks(graph)
    st = Stamper(blocks, 5)
    final = run_passes(reduced(graph, blocks, 5), spec, passes_for(spec), heuristic=True)["free-dead"]
    big = stamp(st, final, DEPTH)
    verify(big)
    t = st.t  # a template node reading the block before or after it, and its copy at block 6
    x = next(x for x in final.nodes if st.owner(x.name) == t and x.layout
             and any(st.owner(i) in (t - 1, t + 1) for i in x.inputs))
    p, shift = st.parts(x.name), st.shift_map((t - 1, t, t + 1), 6 - t)
    cross = big[p[0] + shift[p[1]] + "".join(p[2:])]
    assert cross.name != x.name
    bad = big.with_nodes([evolve(x, layout=x.layout + x.layout) if x is cross else x for x in big.nodes])
    with pytest.raises(VerifyError):
        verify(bad)
