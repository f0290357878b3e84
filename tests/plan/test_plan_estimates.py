"""``parcomp plan``'s estimate and ``parcomp check``'s: the plan's search runs on
the forward graph, check's on the training step compiled from the plan; the written spec's
header says which figure covers what, and both are reproduced by compiling the written spec."""
from __future__ import annotations

from pathlib import Path

import pytest

from parcomp.cli.main import main
from parcomp.compile.compiler import compile_graph
from parcomp.report.report import format_search
from parcomp.spec import parse_spec

pytest.importorskip("torch")

MODEL = str(Path(__file__).resolve().parents[1] / "handwritten_gpt.py") + ":gpt"
TRAIN = "train loss=cross_entropy optimizer=adamw(lr=0.001)"


def _us(compiled) -> str:
    return f"{compiled.report['search']['cost_s'] * 1e6:.1f} us"


@pytest.mark.parametrize("mesh", ["tp=2", "dp=2,tp=2"])
def test_plan_header_estimates_are_the_compiled_specs(tmp_path, capsys, mesh):
    from parcomp.frontends.loader import load_model

    out = tmp_path / "planned.pcs"
    assert main(["plan", MODEL, "--mesh", mesh, "--train", TRAIN, "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    text = out.read_text()
    header = " ".join(ln.lstrip("# ") for ln in text.splitlines()[:6])
    graph = load_model(MODEL)[0]
    step = compile_graph(graph, parse_spec(text, "planned.pcs"))  # what check compiles
    forward = compile_graph(graph, parse_spec(text.replace(TRAIN, ""), "planned.pcs"))
    assert f"{_us(forward)} for the forward pass" in header
    assert f"{_us(step)} for the training step compiled from it" in header
    assert f"{_us(step)} for the training step" in printed
    assert _us(step) != _us(forward)  # the two cover different graphs, and say so
    line = format_search(step.report["search"], True)
    assert f"{_us(step)} per training step" in line


def test_plan_without_training_has_one_figure(tmp_path):
    out = tmp_path / "planned.pcs"
    assert main(["plan", MODEL, "--mesh", "tp=2", "-o", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines[2].endswith(" for the forward pass.") and "training" not in lines[2]
