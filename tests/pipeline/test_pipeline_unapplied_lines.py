"""Spec lines a pipeline's stage programs do not apply are located errors, never dropped.

The stage programs are built from the model as given and take only the params' layouts
inside a stage: ``context-parallel`` (any lowering), ``sequence-parallel`` and an
``input``/``activation``/``output`` rule that splits a value over an axis inside a stage
would be ignored, the step equal to the unsharded one with every rank of the axis repeating
the same work (docs/design/pipeline.md, "What a stage does not run"). Each is a SpecError at
its line; through the CLI, exit code 2, no traceback and no output directory."""
import pytest

from parcomp.cli.main import main
from parcomp.compile.compiler import compile_graph
from parcomp.errors import SpecError

from graphs import spec
from test_pipeline import ROOT, chain_graph

TRAIN = "train loss=mse optimizer=sgd(lr=0.1) microbatches=2"
LM_TRAIN = "train loss=cross_entropy optimizer=sgd(lr=0.1) microbatches=2"


@pytest.fixture(scope="module")
def llama():
    pytest.importorskip("transformers")
    from test_pipeline_models import model64

    return model64("llama_lm")


def _refused(graph, text):
    with pytest.raises(SpecError) as e:
        compile_graph(graph, spec(text))
    return str(e.value)


@pytest.mark.parametrize("lowering", ["ring", "ulysses", "all_gather"])
def test_context_parallel_in_a_pipeline_is_refused_at_its_line(llama, lowering):
    line = f"context-parallel over cp lowering={lowering}"
    msg = _refused(llama, f"mesh pp=2 cp=2\n{line}\n{LM_TRAIN}\n")
    assert msg.startswith("test.pcs:2:1\n") and line in msg
    assert "context-parallel over cp is not supported inside pipeline stages yet" in msg


def test_sequence_parallel_in_a_pipeline_is_refused_at_its_line(llama):
    tp = "".join(f"model.layers.*.self_attn.{w}_proj.weight colwise\n" for w in "qkv")
    msg = _refused(llama, f"mesh pp=2 tp=2\n{tp}sequence-parallel\n{LM_TRAIN}\n")
    assert msg.startswith("test.pcs:5:1\n")
    assert "sequence-parallel over tp is not supported inside pipeline stages yet" in msg


@pytest.mark.parametrize("mesh,rule,what", [
    ("pp=2 tp=2", "input x [R, S(1)]", "input rule x lays out x [R, S(1)] (tp=S(1))"),
    ("pp=2 tp=2", "activation linear_1 [R, S(2)]", "activation rule linear_1 lays out"),
    ("pp=2 tp=2", "output output [R, S(1)]", "output rule output lays out output [R, S(1)] (tp=S(1))"),
    ("dp=2 pp=2", "input x [S(1), R]", "(dp=S(1))"),
])
def test_a_rule_splitting_a_value_inside_a_stage_is_refused_at_the_rule(mesh, rule, what):
    msg = _refused(chain_graph(blocks=2), f"mesh {mesh}\n{rule}\n{TRAIN}\n")
    col = len(rule.split()[0]) + 2  # the rule's pattern
    assert msg.startswith(f"test.pcs:2:{col}\n") and what in msg and "pipeline stages do not apply" in msg


def test_replicated_rules_and_the_batch_split_over_dp_still_compile():
    g = chain_graph(blocks=2)
    compile_graph(g, spec(f"mesh pp=2 dp=2\ninput x [R, S(0)]\noutput output replicated\n{TRAIN}\n"))
    compile_graph(g, spec(f"mesh pp=2 tp=2\ninput x replicated\nactivation linear_1 replicated\n{TRAIN}\n"))


def test_the_cli_exits_2_with_no_output(tmp_path, capsys):
    pytest.importorskip("transformers")
    (tmp_path / "cp.pcs").write_text(f"mesh pp=2 cp=2\ncontext-parallel over cp lowering=ring\n{LM_TRAIN}\n")
    out = tmp_path / "out"
    rc = main(["compile", f"{ROOT / 'specs' / 'models.py'}:llama_lm", "--spec", str(tmp_path / "cp.pcs"),
               "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists()
    assert "cp.pcs:2:1" in err and "not supported inside pipeline stages yet" in err
    assert "Traceback" not in err
