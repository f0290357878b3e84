"""The `sequence-parallel` spec statement: parsing, located errors, the pins it adds
(norm inputs and outputs split along the sequence, their gradients too) and the plan they give.
The whole-model cases (GPT-2, Llama; exact collective lists) are in tests/compile/test_lm_specs.py."""
import pytest

from parcomp.compile.compiler import compile_graph
from parcomp.errors import SpecError
from parcomp.ir import parse_graph
from parcomp.ir.types import Shard, layout_str
from parcomp.reference.interpreter import run_spmd
from parcomp.reference.numpy_ops import run_unsharded

from graphs import random_feeds, spec
from numerics import assert_all_equivalent

# a pre-norm residual MLP block: x -> layer_norm -> colwise -> gelu -> rowwise -> + x
BLOCK = """\
%x: f32[2,8,16] = input()
%ln.weight: f32[16] = param()
%ln.bias: f32[16] = param()
%h: f32[2,8,16] = layer_norm(%x, %ln.weight, %ln.bias) {eps=1e-05}
%fc.weight: f32[32,16] = param()
%fc.wt: f32[16,32] = permute(%fc.weight) {perm=(1, 0)}
%a: f32[2,8,32] = matmul(%h, %fc.wt)
%g: f32[2,8,32] = gelu(%a)
%proj.weight: f32[16,32] = param()
%proj.wt: f32[32,16] = permute(%proj.weight) {perm=(1, 0)}
%m: f32[2,8,16] = matmul(%g, %proj.wt)
%r: f32[2,8,16] = add(%x, %m)
return %r as output
"""
RULES = "fc.weight colwise\nproj.weight rowwise\ninput x split-seq\noutput output split-seq\n"
TRAIN = "train loss=mse optimizer=sgd(lr=0.1)\n"


def _kinds(c):
    return [(r["kind"], r["phase"]) for r in c.report["collectives"]]


def test_statement_parses_with_its_axis_and_location():
    s = spec("mesh dp=2 tp=2\nsequence-parallel\n")
    assert s.sequence_parallel[0] == "tp" and s.sequence_parallel[1].line == 2
    assert spec("mesh dp=2 tp=2\nsequence-parallel over dp\n").sequence_parallel[0] == "dp"
    assert spec("mesh tp=2\n").sequence_parallel is None


@pytest.mark.parametrize("text,where,match", [
    ("mesh tp=2\nsequence-parallel over xx\n", (2, 24), "unknown mesh axis 'xx'"),
    ("mesh tp=2\nsequence-parallel\nsequence-parallel\n", (3, 1), "given twice"),
    ("mesh tp=2\nsequence-parallel tp\n", (2, 19), "over AXIS"),
])
def test_statement_errors_are_located(text, where, match):
    with pytest.raises(SpecError, match=match) as e:
        spec(text)
    assert (e.value.loc.line, e.value.loc.col) == where


def test_a_model_without_norms_is_a_located_error():
    text = "%x: f32[2,8,16] = input()\n%y: f32[2,8,16] = gelu(%x)\nreturn %y as output\n"
    with pytest.raises(SpecError, match="no layer_norm or rms_norm") as e:
        compile_graph(parse_graph(text), spec("mesh tp=2\n\nsequence-parallel\n"))
    assert e.value.loc.line == 3


@pytest.mark.parametrize("mesh,seq,padded", [("tp=2", 7, 8), ("tp=4", 5, 8)])
def test_a_sequence_the_axis_does_not_divide_is_padded_at_each_norm(mesh, seq, padded):
    """7 tokens at tp=2 (a ViT's class token makes the count odd): the norm runs on 8
    positions, zeros at the end, split 4 per rank, and its output is cut back to 7 before the
    MLP reads it, so the padding reaches nothing else (before: a located error). The outputs
    equal the unpadded model's (training: the ViT in tests/frontends/test_conv_patches.py)."""
    block = BLOCK.replace("2,8,", f"2,{seq},")
    rules = RULES.replace("input x split-seq\noutput output split-seq\n", "")
    c = compile_graph(parse_graph(block), spec(f"mesh {mesh}\nsequence-parallel\n" + rules + TRAIN))
    pad = [n for n in c.logical.nodes if n.op == "pad"]
    assert [(n.inputs[0], n.attr("after"), n.type.shape[1]) for n in pad] == [("x", padded - seq, padded)]
    norm = c.sharded["h"]
    assert norm.type.shape == (2, padded, 16) and norm.layout == (Shard(1),)
    # the collectives of the same block with a sequence the axis divides (8 tokens at tp=2)
    assert sorted(_kinds(c)) == [("all_gather", "backward"), ("all_gather", "forward"), ("all_reduce", "backward"),
                                 ("all_reduce", "forward"), ("reduce_scatter", "backward")]
    fwd = compile_graph(parse_graph(block), spec(f"mesh {mesh}\nsequence-parallel\n" + rules))
    feeds = random_feeds(fwd.logical, 0)
    want = run_unsharded(parse_graph(block), feeds)  # the model as written: no padding anywhere
    assert_all_equivalent(run_spmd(fwd.program, feeds).outputs(fwd.program), want)


def test_norm_input_output_and_their_gradients_are_pinned_split_seq():
    c = compile_graph(parse_graph(BLOCK), spec("mesh tp=2\nsequence-parallel\n" + RULES + TRAIN))
    pins = [n for n in c.logical.nodes if n.op == "relayout" and "sequence-parallel" in n.attr("origin")]
    assert sorted(n.name for n in pins) == ["bw.h.seq_in.relayout", "bw.h.seq_out.relayout",
                                            "h.seq_in", "h.seq_out"]
    assert all(layout_str(n.layout) == "[S(1)]" for n in pins)
    assert {n.phase for n in pins} == {"forward", "backward"}
    norm = c.sharded["h"]
    assert norm.layout == (Shard(1),)


def test_sequence_parallel_changes_the_plan_to_megatrons():
    """Without the statement the search keeps the norm replicated; with it: all_gather before the
    colwise matmul, reduce_scatter after the rowwise one, their mirrors backward, and the norm
    weights' gradients all_reduced (bucketed into one)."""
    plain = compile_graph(parse_graph(BLOCK), spec("mesh tp=2\n" + RULES + TRAIN))
    sp = compile_graph(parse_graph(BLOCK), spec("mesh tp=2\nsequence-parallel\n" + RULES + TRAIN))
    assert ("all_gather", "forward") in _kinds(plain) and plain.sharded["h"].layout != (Shard(1),)
    # the loss gathers the (split) output once: its gradient then reaches the rowwise matmul whole
    assert _kinds(sp) == [("all_gather", "forward"), ("reduce_scatter", "forward"), ("all_gather", "loss"),
                          ("reduce_scatter", "backward"), ("all_reduce", "backward")]
    feeds = random_feeds(sp.logical, 0)
    run = run_spmd(sp.program, feeds)
    assert_all_equivalent(run.outputs(sp.program), run_unsharded(sp.logical, feeds))


def test_data_parallel_axis_keeps_the_batch_split():
    c = compile_graph(parse_graph(BLOCK), spec("mesh dp=2 tp=2\nsequence-parallel\n"
                                               + RULES.replace("colwise", "colwise over tp")
                                               .replace("rowwise", "rowwise over tp")
                                               .replace("split-seq", "[S(0), S(1)]") + TRAIN))
    assert c.sharded["h"].layout == (Shard(0), Shard(1))  # not gathered over dp for the norm
    assert [r["axis"] for r in c.report["collectives"] if r["kind"] == "reduce_scatter"] == ["tp", "tp"]
