"""`parcomp plan` on the transformer LMs: Megatron's hand-written specs
rediscovered (collective for collective), the written spec in Megatron's words, and
sequence parallel chosen when (and only when) the memory limit asks for it."""
from __future__ import annotations

import json
import os

import pytest

from parcomp.cli.main import main
from parcomp.compile.compiler import compile_graph
from parcomp.errors import ParcompError
from parcomp.frontends.loader import load_model
from parcomp.ir import parse_graph
from parcomp.ir.types import R, Shard
from parcomp.plan.planner import may_stay_replicated, plan
from parcomp.plan.spec_text import bound_params, param_lines
from parcomp.spec import load_spec, parse_spec
from parcomp.units import format_bytes

from numerics import assert_check_ok

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..")
MODELS = os.path.join(ROOT, "specs", "models.py")
TRAIN = "train loss=cross_entropy optimizer=adamw(lr=0.001) steps=2"


def _rows(compiled):
    return [(r["kind"], r["axis"], r["dim"], r["phase"], tuple(r["local_shape"]), r["bytes"])
            for r in compiled.report["collectives"]]


@pytest.mark.parametrize("factory, megatron, words", [
    ("gpt2_lm", "gpt2_lm_tp2_train.pcs", ["transformer.h.*.attn.c_attn.weight  colwise",
                                          "transformer.h.*.attn.c_proj.weight  rowwise",
                                          "transformer.h.*.mlp.c_fc.weight     colwise",
                                          "transformer.h.*.mlp.c_proj.weight   rowwise"]),
    ("llama_lm", "llama_lm_tp2_train.pcs", ["model.layers.*.self_attn.q_proj.weight  colwise",
                                            "model.layers.*.mlp.down_proj.weight     rowwise"]),
])
def test_plan_of_an_lm_is_megatrons_hand_spec(tmp_path, factory, megatron, words):
    """The planned training step has exactly the collectives of Megatron's spec (8: per block
    2 all_reduce forward, 2 backward); embeddings, the LM head and RoPE tables stay
    replicated (gathering or splitting them only adds collectives), and the spec reads as
    the hand-written one: one colwise / rowwise rule per kind of block weight."""
    out = tmp_path / "plan.pcs"
    assert main(["plan", f"{MODELS}:{factory}", "--mesh", "tp=2", "--train", TRAIN, "-o", str(out)]) == 0
    graph = load_model(f"{MODELS}:{factory}")[0]
    planned = compile_graph(graph, load_spec(str(out)))
    want = compile_graph(graph, load_spec(os.path.join(ROOT, "specs", megatron)))
    assert _rows(planned) == _rows(want) and len(_rows(want)) == 8
    text = out.read_text()
    for line in words:
        assert any(ln.startswith(line + "  # 2 alike") for ln in text.splitlines()), line
    assert "# no rule needed" in text and "lm_head.weight" in text.split("# no rule needed")[1]


def test_the_forward_plan_of_gpt2_has_megatrons_four_all_reduce():
    graph = load_model(f"{MODELS}:gpt2_lm")[0]
    text, _ = plan(graph, "tp=2")
    kinds = [(r["kind"], r["phase"]) for r in compile_graph(graph, parse_spec(text, "p.pcs")).report["collectives"]]
    assert kinds == [("all_reduce", "forward")] * 4


def test_what_may_stay_replicated_is_the_model_ends_and_buffers():
    gpt2 = load_model(f"{MODELS}:gpt2_lm")[0]
    # the tied wte/lm_head table, the position table, the position ids (an integer buffer)
    assert may_stay_replicated(gpt2) == {"lm_head.weight", "transformer.wpe.weight", "transformer.arange"}
    llama = load_model(f"{MODELS}:llama_lm")[0]
    assert may_stay_replicated(llama) == {"model.embed_tokens.weight", "lm_head.weight",
                                          "model.rotary_emb.cos", "model.rotary_emb.sin"}


MLP = ("%x: f32[8,16] = input()\n%w: f32[16,32] = param()\n%h: f32[8,32] = matmul(%x, %w)\n"
       "%b: f32[32] = param()\n%hb: f32[8,32] = add(%h, %b)\n%r: f32[8,32] = relu(%hb)\n"
       "%v: f32[32,16] = param()\n%output: f32[8,16] = matmul(%r, %v)\nreturn %output\n")


@pytest.mark.parametrize("bias, written", [(Shard(0), False), (R, True)])
def test_a_rule_is_left_out_only_when_the_spec_binds_the_same_layout_without_it(bias, written):
    """A bias following its colwise weight needs no rule; a replicated bias of a colwise
    weight does (left out, it would follow the weight): the written rules bind exactly
    the chosen layouts either way."""
    g = parse_graph(MLP)
    head, tail = ["mesh tp=2"], ["input x replicated", "output output replicated"]
    layouts = {"w": (Shard(1),), "b": (bias,), "v": (Shard(0),)}

    def binds(rules):
        return bound_params(g, "\n".join(head + rules + tail) + "\n")

    lines = param_lines(g, layouts, parse_spec("mesh tp=2\n", "m.pcs").mesh, binds)
    rules = [ln.split()[:2] for ln in lines if ln and not ln.startswith("#")]
    assert ["w", "colwise"] in rules and ["v", "rowwise"] in rules
    assert (["b", "replicated"] in rules) == written
    assert binds(lines) == layouts


# ---- sequence parallel when memory says so -------------------------------------------------

LONG = """\
import importlib.util

_spec = importlib.util.spec_from_file_location("parcomp_models", {models!r})
_models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_models)


def gpt2_lm_seq16():
    return _models.gpt2_lm(batch=2, seq=16)
"""


@pytest.fixture(scope="module")
def long_gpt2(tmp_path_factory):
    """GPT-2 on 32 tokens (activations outweigh the optimizer step's peak, so the norm
    regions' activations decide the peak) and the peaks of Megatron's two hand specs."""
    folder = tmp_path_factory.mktemp("models")
    (folder / "long.py").write_text(LONG.format(models=MODELS))
    model = f"{folder / 'long.py'}:gpt2_lm_seq16"
    graph = load_model(model)[0]
    peaks = [compile_graph(graph, load_spec(os.path.join(ROOT, "specs", s))).report["memory_bytes_per_rank"]["peak_live"]
             for s in ("gpt2_lm_tp2_train.pcs", "gpt2_lm_tp2_sp_train.pcs")]
    return model, graph, peaks


def test_plan_picks_sequence_parallel_when_the_tp_plan_exceeds_the_memory(tmp_path, capsys, long_gpt2):
    model, graph, (tp_peak, sp_peak) = long_gpt2
    assert sp_peak < tp_peak
    limit = (tp_peak + sp_peak) // 2
    out = tmp_path / "plan.pcs"
    assert main(["plan", model, "--mesh", "tp=2", "--memory", f"{limit}B", "--train", TRAIN, "-o", str(out)]) == 0
    text = out.read_text()
    assert "\nsequence-parallel  # Megatron --sequence-parallel" in text
    assert "without it the plan's peak of live values needs" in text and f"({sp_peak:,} B)" in text
    assert "# activation " not in text  # the search's layouts without the statement are not listed
    planned = compile_graph(graph, load_spec(str(out)))
    want = compile_graph(graph, load_spec(os.path.join(ROOT, "specs", "gpt2_lm_tp2_sp_train.pcs")))
    assert _rows(planned) == _rows(want)
    assert {r[0] for r in _rows(planned)} == {"all_gather", "reduce_scatter", "all_reduce"}
    assert planned.report["memory_bytes_per_rank"]["peak_live"] == sp_peak <= limit
    capsys.readouterr()
    main(["check", model, "--spec", str(out), "--json"])  # as tests/compile/test_lm_specs.py checks Megatron's SP spec:
    assert_check_ok(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))


def test_plan_keeps_plain_tp_when_it_fits_and_finds_a_smaller_plan_when_neither_fits(long_gpt2):
    """Just under Megatron's SP peak neither plan the search makes for the limit fits; the
    planner then falls back on the plans it lays out for the least memory (and without a
    limit), with and without sequence-parallel, and one of those compiles within it."""
    model, graph, (tp_peak, sp_peak) = long_gpt2
    text, _ = plan(graph, "tp=2", f"{tp_peak}B", TRAIN)
    assert "sequence-parallel" not in text
    text, _ = plan(graph, "tp=2", f"{sp_peak - 1}B", TRAIN)
    assert compile_graph(graph, parse_spec(text, "p.pcs")).report["memory_bytes_per_rank"]["peak_live"] < sp_peak


def test_the_smallest_plan_figure_does_not_depend_on_the_limit(long_gpt2):
    """Two limits below every plan (one below even the search's resident bound, one between
    that and the peaks): the error gives the same smallest peak, whole (the sequence-parallel
    part not cut off), no larger than Megatron's hand specs' peaks, over each limit."""
    model, graph, (tp_peak, sp_peak) = long_gpt2
    figures = []
    for limit in (100 * 1024, 280 * 1024):  # the smallest plan peak: 300,104 B
        with pytest.raises(ParcompError, match="no plan fits: the smallest peak of live values") as e:
            plan(graph, "tp=2", f"{limit}B", TRAIN)
        assert e.value.where == "--memory:1:1"
        need = e.value.need
        assert limit < need <= min(tp_peak, sp_peak)
        assert f"needs {format_bytes(need)} per rank ({need:,} B), over the memory limit" in e.value.message
        figures.append((need, e.value.message.split(" over the memory limit")[0]))
    assert figures[0] == figures[1]


def test_choose_seqpar_gives_the_sequence_parallel_figure_whole(long_gpt2):
    from parcomp.cost.memory import MemoryLimitError
    from parcomp.plan.seqpar import choose_seqpar, set_memory

    model, graph, (tp_peak, sp_peak) = long_gpt2
    text, _ = plan(graph, "tp=2", None, TRAIN)
    for limit in (100 * 1024, (sp_peak + min(tp_peak, sp_peak)) // 3):
        with pytest.raises(MemoryLimitError) as e:
            choose_seqpar(graph, set_memory(text, f"{limit}B"), None)
        tail = e.value.message.split("; with sequence-parallel: ")[1]
        assert tail.endswith(" B)") and " needs " in tail and " per rank (" in tail  # not cut off


def test_a_model_without_norms_gets_the_plain_memory_error_at_the_option():
    """No norm over [batch, seq, hidden]: sequence parallel does not apply, so the error is
    the plain plans', located at --memory (not at a plan.pcs nobody wrote)."""
    graph = load_model(f"{MODELS}:torch_mlp")[0]
    text, _ = plan(graph, "tp=2")
    peak = compile_graph(graph, parse_spec(text, "p.pcs")).report["memory_bytes_per_rank"]["peak_live"]
    with pytest.raises(ParcompError, match="the smallest peak of live values") as e:
        plan(graph, "tp=2", f"{peak // 4}B")
    assert e.value.where == "--memory:1:1" and "sequence-parallel" not in e.value.message
