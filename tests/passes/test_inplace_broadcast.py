"""No in-place write into a broadcast view: torch refuses ``x.add_(y)`` when ``x`` is an
``expand`` (stride 0: "more than one element of the written-to tensor refers to a single
memory location"), so the in-place pass never marks such a node and the reference
interpreter refuses a program that has one (a hand-written ``.pcir``) instead of
computing a value the emitted program.py could never produce."""
import numpy as np
import pytest

from parcomp.errors import VerifyError
from parcomp.ir import parse_graph
from parcomp.passes.lowering.lower import in_place
from parcomp.reference.interpreter import run_spmd

HEAD = """\
mesh tp=2
stage local
%a: f32[4] [R] = input() {global_shape=(4,)}
%b: f32[3,4] [R] = input() {global_shape=(3,4)}
%h: f32[4] [R] = relu(%a)
%e: f32[3,4] [R] = expand(%h) {dims=(0,)}
"""
FEEDS = {"a": np.arange(4, dtype="f4") - 1, "b": np.ones((3, 4), "f4")}


@pytest.mark.parametrize("body, node, into, expand", [
    ("%y: f32[3,4] [R] = add(%e, %b) {inplace=true}\nreturn %y\n", "y", "e", None),
    ("%r: f32[12] [R] = reshape(%e) {shape=(12,)}\n%c: f32[12] [R] = reshape(%b) {shape=(12,)}\n"
     "%y: f32[12] [R] = add(%r, %c) {inplace=true}\nreturn %y\n", "y", "r", "e"),
    ("%y: f32[3,4] [R] = add(%e, %b) {inplace=true}\n%z: f32[3,4] [R] = add(%y, %b) {inplace=true}\n"
     "return %z\n", "y", "e", None),
])
def test_the_interpreter_refuses_an_in_place_write_into_a_broadcast_view(body, node, into, expand):
    prog = parse_graph(HEAD + body)
    with pytest.raises(VerifyError) as info:
        run_spmd(prog, FEEDS)
    msg = str(info.value)
    assert f"%{node} (add, inplace=true) writes into %{into}" in msg and "single memory location" in msg
    assert (f"a view of the broadcast %{expand}" in msg) == (expand is not None)
    assert info.value.node == node


def test_an_in_place_write_into_a_fresh_sum_with_a_broadcast_runs():
    body = "%y: f32[3,4] [R] = add(%b, %e)\n%z: f32[3,4] [R] = add(%y, %b) {inplace=true}\nreturn %z\n"
    got = run_spmd(parse_graph(HEAD + body), FEEDS).outputs(parse_graph(HEAD + body))["z"]
    np.testing.assert_array_equal(got, 2 + np.maximum(FEEDS["a"], 0)[None, :] * np.ones((3, 1)))


def test_the_in_place_pass_never_marks_a_write_into_an_expand():
    """A fresh value (relu) is written in place; its expand, or a reshape of that, never."""
    body = ("%r: f32[12] [R] = reshape(%e) {shape=(12,)}\n%c: f32[12] [R] = reshape(%b) {shape=(12,)}\n"
            "%y: f32[12] [R] = add(%r, %c)\n%g: f32[3,4] [R] = relu(%b)\n%w: f32[3,4] [R] = add(%e, %b)\n"
            "%v: f32[3,4] [R] = add(%g, %w)\nreturn %y, %v\n")
    g = in_place(parse_graph(HEAD + body))
    assert not g["y"].attr("inplace") and not g["w"].attr("inplace")
    assert g["v"].attr("inplace")  # the control: a fresh, dead first operand is written in place
    run_spmd(g, FEEDS)  # and the interpreter runs what the pass made


def test_torch_refuses_the_statement_the_interpreter_refuses():
    """The model of torch the check encodes: the emitted ``expand`` then ``add_``."""
    torch = pytest.importorskip("torch")
    from parcomp_backends.torch.emit import node_code

    prog = parse_graph(HEAD + "%y: f32[3,4] [R] = add(%e, %b) {inplace=true}\nreturn %y\n")
    env = {"torch": torch, "h": torch.ones(4), "b": torch.ones(3, 4)}
    env["e"] = eval(node_code(prog["e"], ["h"]), env)  # noqa: S307 - our own table
    with pytest.raises(RuntimeError, match="single memory location"):
        eval(node_code(prog["y"], ["e", "b"]), env)  # noqa: S307
