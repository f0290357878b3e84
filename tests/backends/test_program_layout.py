"""``program.py`` reads top down: a header (model, spec, mesh, parcomp version, how to run it),
then the model (constants, parameter loading, the step), then one marked line, then the runtime.

Checked on the text of a forward program, a training program and a pipelined program: the
header names the parcomp version; before the runtime line the program defines only the model's
loaders and step functions; the step comes before the first runtime helper.
"""
from __future__ import annotations

import ast
import re

import pytest

pytest.importorskip("torch")

import parcomp  # noqa: E402
from parcomp.compile.compiler import compile_graph  # noqa: E402
from parcomp_backends.torch.emit import RUNTIME_MARK, emit_program  # noqa: E402

from graphs import spec  # noqa: E402
from test_pipeline import chain_graph  # noqa: E402
from test_torch_backend import tiny_compiled  # noqa: E402

#: the functions the model part may define, per kind of program
STEP_FUNCTIONS = re.compile(r"(load_params|load_inputs|forward|train_step|stage\d+_\w+)$")


def layout(text: str) -> tuple:
    """(header docstring, top-level def names before the runtime line, those after it)."""
    tree = ast.parse(text)
    header = ast.get_docstring(tree, clean=False)
    lines = text.splitlines()
    assert lines.count(RUNTIME_MARK) == 1, "program.py has one runtime line"
    mark = lines.index(RUNTIME_MARK) + 1
    defs = [(n.lineno, n.name) for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    return header, [d for line, d in defs if line < mark], [d for line, d in defs if line > mark]


def check_top_down(text: str, step: str, shared=()) -> None:
    """``shared``: step-like functions the runtime defines for every model (the pipelined
    program's ``load_params`` and ``load_inputs`` are runtime loaders, driven by the constants
    above)."""
    header, model, runtime = layout(text)
    assert f"parcomp {parcomp.__version__}" in header, header
    assert "torchrun --nproc-per-node" in header  # how to run it
    assert model and step in model, model
    assert all(STEP_FUNCTIONS.match(d) for d in model), f"runtime before the runtime line: {model}"
    assert runtime and not any(STEP_FUNCTIONS.match(d) and d not in shared for d in runtime), runtime
    assert text.index(f"def {step}(") < text.index(f"def {runtime[0]}(")


def test_forward_program_reads_top_down():
    text = emit_program(tiny_compiled(), "cpu", model="tiny_relu_mlp.pcir")
    check_top_down(text, "forward")
    header, model, _ = layout(text)
    assert model == ["load_params", "load_inputs", "forward"]
    assert "model: tiny_relu_mlp.pcir" in header and "spec:  tiny_relu_mlp_tp2.pcs" in header
    assert "mesh:  tp=2" in header
    compile(text, "program.py", "exec")


def test_training_program_reads_top_down():
    g = chain_graph(blocks=2)
    text = emit_program(compile_graph(g, spec("mesh dp=2\ntrain optimizer=adamw(lr=0.01)\n")))
    check_top_down(text, "train_step")
    compile(text, "program.py", "exec")


def test_pipelined_program_reads_top_down():
    g = chain_graph(blocks=4)
    text = emit_program(compile_graph(g, spec("mesh pp=2\ntrain optimizer=adamw(lr=0.01) microbatches=2\n")))
    # load_params / load_inputs: the pipelined runtime's loaders, driven by the constants above
    check_top_down(text, "stage0_forward", shared=("load_params", "load_inputs"))
    _, model, _ = layout(text)
    assert model[0] == "stage0_forward"
    compile(text, "program.py", "exec")


def test_the_layout_check_can_fail():
    text = emit_program(tiny_compiled(), "cpu", model="tiny_relu_mlp.pcir")
    runtime_first = text.replace("def forward(", "def forward_moved(").replace(
        RUNTIME_MARK, RUNTIME_MARK + "\n\n\ndef forward(p, inp):\n    return {}\n")
    with pytest.raises(AssertionError):
        check_top_down(runtime_first, "forward")
    with pytest.raises(AssertionError):
        check_top_down(text.replace(f"parcomp {parcomp.__version__}", "parcomp"), "forward")
