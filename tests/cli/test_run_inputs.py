"""What ``parcomp run`` writes into inputs.pt: the program's inputs, never the training step
number program.py feeds itself (a kept inputs.pt then has no key the program does not use)."""
from __future__ import annotations

import numpy as np
import pytest

from graphs import mlp_text

from parcomp.cli.common import input_feeds
from parcomp.compile.compiler import compile_graph
from parcomp.ir.text import parse_graph
from parcomp.spec import parse_spec


@pytest.mark.parametrize("head", ["mesh pp=2\n", "mesh tp=2\n"])
def test_inputs_file_has_no_step_number(head):
    g = parse_graph(mlp_text((8,), [4, 8, 8, 4], [True] * 3, ["relu", "relu", "none"]))
    pipe = " microbatches=2" if "pp" in head else ""
    c = compile_graph(g, parse_spec(f"{head}train loss=mse optimizer=adamw(lr=0.001) input_grads=no{pipe}\n",
                                    "t.pcs"))
    assert "step" in [n.name for n in c.program.inputs]  # AdamW's step number is an input
    feeds = {"x": np.zeros((8, 4), "float32"), "target": np.zeros((8, 4), "float32"),
             "step": np.array(1.0, "float32")}
    assert sorted(input_feeds(c, feeds)) == ["target", "x"]
    assert sorted(input_feeds(c, feeds, c.logical)) == ["target", "x"]
