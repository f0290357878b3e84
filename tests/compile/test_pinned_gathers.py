"""The warning for a split weight the plan gathers whole: one warning per
weight (a tied table gathered for its lookup and its LM head is one), and its advice is a rule
that works: ``activation embedding [P]`` keeps the tied table split (vocab-parallel lookup,
column-parallel LM head), where ``output output [S(2)]`` and ``memory`` do not."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from parcomp.cli.main import main
from parcomp.compile.compiler import compile_graph
from parcomp.spec import parse_spec

pytest.importorskip("torch")

MODEL = str(Path(__file__).resolve().parents[1] / "handwritten_gpt.py") + ":gpt"
BLOCKS = ("mesh tp=2\nblocks.*.attn.qkv.weight colwise\nblocks.*.attn.proj.weight rowwise\n"
          "blocks.*.mlp.w1.weight colwise\nblocks.*.mlp.w3.weight colwise\nblocks.*.mlp.w2.weight rowwise\n"
          "tok.weight [S(0)]\n")
TRAIN = "train loss=cross_entropy optimizer=adamw(lr=0.001) steps=2\n"
ADVICE = "`activation embedding [P]`"


def _compile(text):
    from parcomp.frontends.loader import load_model

    return compile_graph(load_model(MODEL)[0], parse_spec(text, "v.pcs"))


@pytest.mark.parametrize("extra", ["output output [S(2)]\n", "memory 216KiB\n"])
def test_one_warning_per_gathered_weight_naming_the_rule_that_keeps_it_split(extra):
    c = _compile(BLOCKS + extra + TRAIN)
    gathers = [x for x in c.report["collectives"] if x["kind"] == "all_gather" and x["phase"] == "forward"
               and x["producer"] in ("head.weight", "linear_10_wt")]
    assert gathers  # these plans gather the tied table (the cost model's choice at these sizes)
    warned = [w for w in c.report["warnings"] if "the plan all-gathers it whole" in w]
    assert len(warned) == 1, warned
    assert warned[0].startswith("head.weight: the spec splits it (v.pcs:7:1)") and ADVICE in warned[0]
    assert "embedding %embedding" in warned[0]


def _advice(warning) -> str:
    """The spec lines the warning advises (its backticked rules)."""
    return "".join(part + "\n" for part in warning.split("`")[1::2])


@pytest.mark.parametrize("extra", ["output output [S(2)]\n", "memory 216KiB\n"])
def test_the_advised_rules_keep_the_tied_table_split(extra):
    warned = _compile(BLOCKS + extra + TRAIN).report["warnings"]
    c = _compile(BLOCKS + extra + _advice(warned[0]) + TRAIN)
    assert c.report["warnings"] == []
    assert not [x for x in c.report["collectives"] if x["producer"] in ("head.weight", "linear_10_wt")]
    assert str(c.sharded["head.weight"].layout[0]) == "S(0)"


def test_the_advised_spec_is_a_vocab_parallel_embedding_and_lm_head(tmp_path, capsys):
    """The spec with ``output output [S(2)]`` and the advice: its collectives, pinned, and
    ``check`` passes."""
    warned = _compile(BLOCKS + "output output [S(2)]\n" + TRAIN).report["warnings"]
    assert _advice(warned[0]) == "activation embedding [P]\nactivation output [S(2)]\n"
    text = BLOCKS + "output output [S(2)]\n" + _advice(warned[0]) + TRAIN
    c = _compile(text)
    got = [(x["kind"], x["producer"], x["phase"]) for x in c.report["collectives"]]
    assert got == [  # no gather of the table: each rank looks up and multiplies its own rows
        ("all_reduce", "embedding", "forward"), ("all_reduce", "add_1", "forward"),
        # the last block's two sums are all_reduced after their residual add, not at the
        # row-parallel linear: the same bytes, and the plan's search estimate is the same
        # (1115.6 us, proven optimal) either way; the integer program's pairwise read terms
        # (layout_ilp.tighten) make HiGHS reach this one of the equal-cost optima
        ("all_reduce", "add_3", "forward"), ("all_reduce", "add_5", "forward"),
        ("all_reduce", "add_7", "forward"),
        ("all_gather", "output", "forward"),  # the logits, for the loss: the cost model's choice here
        ("all_reduce", "bw.output.matmul", "backward"), ("all_reduce", "bw.rms_norm_4.add", "backward"),
        ("all_reduce", "bw.rms_norm_3.add_2", "backward"), ("all_reduce", "bw.rms_norm_2.add", "backward"),
        ("all_reduce", "bw.rms_norm.add_2", "backward")]
    spec = tmp_path / "v.pcs"
    spec.write_text(text)
    assert main(["check", MODEL, "--spec", str(spec), "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["ok"], res
