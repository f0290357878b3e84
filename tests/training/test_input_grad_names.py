"""``input_grads=PATTERN``: only the named float inputs get a gradient, and the backward
computes nothing for the others (torch computes the gradients of the inputs that require grad)."""
import numpy as np
import pytest

from parcomp.compile.compiler import compile_graph
from parcomp.errors import SpecError
from parcomp.ir import parse_graph
from parcomp.reference.interpreter import run_spmd
from parcomp.reference.numpy_ops import run_unsharded
from parcomp_backends.torch import emit_program

from graphs import spec
from test_megatron import W1, W2
from test_training import TINY_VJP

RULES = ("mesh tp=2\nfc1.weight colwise\nfc2.weight rowwise\ninput x replicated\n"
         "output l replicated\ntrain loss=output optimizer=sgd(lr=0.0) input_grads={}")
FEEDS = {"x": np.array([[1, 2]], "f4"), "dy": np.array([[2, -1]], "f4"), "fc1.weight": W1.T, "fc2.weight": W2.T}


def _compiled(grads):
    return compile_graph(parse_graph(TINY_VJP), spec(RULES.format(grads)))


def _backward_ops(c):
    ops = {}
    for n in c.program.nodes:
        if n.phase == "backward":
            ops[n.op] = ops.get(n.op, 0) + 1
    return ops


def test_named_input_gets_its_gradient_and_the_other_none():
    every, only_x = _compiled("yes"), _compiled("x")
    assert {"x.grad", "dy.grad"} <= set(every.program.output_names)
    assert "x.grad" in only_x.program.output_names and "dy.grad" not in only_x.program.output_names
    # dy.grad = output * d(loss)/d(ydy): one multiply of the backward that input_grads=x leaves out
    ops_every, ops_x = _backward_ops(every), _backward_ops(only_x)
    assert ops_every.get("mul", 0) - ops_x.get("mul", 0) == 1
    assert sum(ops_every.values()) > sum(ops_x.values())
    src = emit_program(only_x, "cpu")
    assert "dy.grad" not in src and "x.grad" in src
    got = run_spmd(only_x.program, FEEDS).outputs(only_x.program)
    want = run_unsharded(every.logical, FEEDS)
    for k in ("x.grad", "fc1.weight.grad", "fc2.weight.grad", "loss"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6)


def test_wildcard_pattern_and_no():
    assert "x.grad" in _compiled('"*"').program.output_names
    assert "dy.grad" in _compiled('"*"').program.output_names
    none = _compiled("no").program.output_names
    assert "x.grad" not in none and "dy.grad" not in none


def test_pattern_naming_no_float_input_is_a_located_error():
    with pytest.raises(SpecError, match=r"input_grads='xx' names no float input.*did you mean 'x'") as e:
        _compiled("xx")
    assert e.value.loc is not None and e.value.loc.col > 1
