"""View ops of the attention part: slice, cat, reshape remaps, the aten view ops.

Views move values without arithmetic, so every comparison here is exact: small-integer
cases pin which split survives which view (and which forces a redistribution), and a
hypothesis property runs random view chains over shapes x layouts x meshes.
"""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from parcomp.compile.compiler import compile_graph
from parcomp.frontends.torch.export import import_torch
from parcomp.ir import parse_graph
from parcomp.reference.interpreter import run_spmd
from parcomp.reference.numpy_ops import run_unsharded

from graphs import spec


def _run(text, spec_text, feeds=None):
    """(collective kinds, sharded outputs, unsharded outputs) of a .pcir body on a spec."""
    g = parse_graph(text)
    c = compile_graph(g, spec(spec_text))
    feeds = feeds or {n.name: np.arange(np.prod(n.type.shape), dtype="f4").reshape(n.type.shape)
                      for n in g.inputs}
    run = run_spmd(c.program, feeds)
    return [e["kind"] for e in run.log], run.outputs(c.program), run_unsharded(g, feeds)


def _exact(got, want):
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


# (pcir body, spec, collectives that must run); "x" is split by the spec's input rule
CASES = {
    "slice of another dim keeps the split": (
        "%x: f32[4,6] = input()\n%y: f32[4,3] = slice(%x) {dim=1, start=1, stop=6, step=2}\nreturn %y\n",
        "mesh tp=2\ninput x [S(0)]\noutput y [S(0)]", []),
    "whole slice of the split dim keeps the split": (
        "%x: f32[8,4] = input()\n%y: f32[8,4] = slice(%x) {dim=0, start=0, stop=8, step=1}\nreturn %y\n",
        "mesh tp=2\ninput x [S(0)]\noutput y [S(0)]", []),
    "cat along another dim keeps the split": (
        "%x: f32[4,2] = input()\n%z: f32[4,3] = input()\n%y: f32[4,5] = cat(%x, %z) {dim=1}\nreturn %y\n",
        "mesh tp=2\ninput x [S(0)]\ninput z [S(0)]\noutput y [S(0)]", []),
    "merge with the split dim outermost keeps it": (
        "%x: f32[4,6] = input()\n%y: f32[24] = reshape(%x)\nreturn %y\n",
        "mesh tp=2\ninput x [S(0)]\noutput y [S(0)]", []),
    "heads split out of hidden (H % tp == 0) keeps it": (
        "%x: f32[2,3,8] = input()\n%y: f32[2,3,4,2] = reshape(%x)\nreturn %y\n",
        "mesh tp=2\ninput x [S(2)]\noutput y [S(2)]", []),
    "partial through slice and cat stays partial": (
        "%x: f32[4,6] = input()\n%s: f32[4,2] = slice(%x) {dim=1, start=0, stop=2}\n"
        "%y: f32[4,8] = cat(%s, %x) {dim=1}\nreturn %y\n",
        "mesh tp=2\ninput x partial-sum\noutput y partial-sum", []),
}
REDISTRIBUTED = {  # the split cannot survive: some collective runs, the values still match
    "part of the split dim": (
        "%x: f32[8,4] = input()\n%y: f32[4,4] = slice(%x) {dim=0, start=2, stop=6}\nreturn %y\n",
        "mesh tp=2\ninput x [S(0)]\noutput y [S(0)]"),
    "cat along the split dim": (
        "%x: f32[4,2] = input()\n%z: f32[4,4] = input()\n%y: f32[4,6] = cat(%x, %z) {dim=1}\nreturn %y\n",
        "mesh tp=2\ninput x [S(1)]\ninput z [S(1)]\noutput y [S(1)]"),
    "merge with the split dim inner": (
        "%x: f32[4,6] = input()\n%y: f32[24] = reshape(%x)\nreturn %y\n",
        "mesh tp=2\ninput x [S(1)]\noutput y [S(0)]"),
    "heads split out of hidden with H % tp != 0": (
        "%x: f32[2,3,8] = input()\n%y: f32[2,3,2,4] = reshape(%x)\nreturn %y\n",
        "mesh tp=4\ninput x [S(2)]\noutput y [S(3)]"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_view_that_keeps_the_split_needs_no_collective(case):
    text, spec_text, want_kinds = CASES[case]
    kinds, got, want = _run(text, spec_text)
    assert kinds == want_kinds
    _exact(got, want)


@pytest.mark.parametrize("case", sorted(REDISTRIBUTED))
def test_a_view_that_breaks_the_split_redistributes(case):
    kinds, got, want = _run(*REDISTRIBUTED[case])
    assert kinds, "a split that no rank can keep must be redistributed"
    _exact(got, want)


def test_slice_of_the_split_dim_gives_each_rank_the_right_rows():
    # x rows 0..7 split 4/4; rows 2..5 split 2/2: rank 0 needs rows 2,3 (its own), rank 1 rows 4,5
    g = parse_graph("%x: f32[8,1] = input()\n%y: f32[4,1] = slice(%x) {dim=0, start=2, stop=6}\nreturn %y\n")
    c = compile_graph(g, spec("mesh tp=2\ninput x [S(0)]\noutput y [S(0)]"))
    run = run_spmd(c.program, {"x": np.arange(8, dtype="f4").reshape(8, 1)})
    assert [run.env[r][c.program.outputs[0]].ravel().tolist() for r in (0, 1)] == [[2, 3], [4, 5]]


# ---- random view chains: shapes x layouts x meshes, exact ---------------------------

def _view_ops(shape, draw):
    """One view step on ``shape``: (pcir op + attrs, numpy of it)."""
    rank = len(shape)
    d = draw(st.integers(0, rank - 1))
    kind = draw(st.sampled_from(["slice", "cat", "merge", "split", "expand", "permute"]))
    if kind == "slice":
        lo = draw(st.integers(0, shape[d] - 1))
        hi = draw(st.integers(lo + 1, shape[d]))
        step = draw(st.sampled_from([1, 1, 2]))
        idx = tuple(slice(lo, hi, step) if i == d else slice(None) for i in range(rank))
        return f"slice(%v) {{dim={d}, start={lo}, stop={hi}, step={step}}}", lambda x: x[idx]
    if kind == "cat":
        return f"cat(%v, %v) {{dim={d}}}", lambda x: np.concatenate([x, x], axis=d)
    if kind == "merge" and d + 1 < rank:
        new = shape[:d] + (shape[d] * shape[d + 1],) + shape[d + 2:]
        return "reshape(%v)", lambda x: x.reshape(new)
    if kind == "split" and shape[d] % 2 == 0:
        new = shape[:d] + (2, shape[d] // 2) + shape[d + 1:]
        return "reshape(%v)", lambda x: x.reshape(new)
    if kind == "expand" and rank < 4:
        new = shape[:d] + (2,) + shape[d:]
        return f"expand(%v) {{dims=({d},)}}", lambda x: np.broadcast_to(np.expand_dims(x, d), new)
    perm = tuple(draw(st.permutations(range(rank))))
    return f"permute(%v) {{perm={perm}}}", lambda x: np.transpose(x, perm)


@st.composite
def view_chain(draw):
    shape = tuple(draw(st.sampled_from([2, 4, 6])) for _ in range(draw(st.integers(2, 3))))
    mesh = draw(st.sampled_from(["tp=2", "tp=4", "dp=2 tp=2"]))
    axes = len(mesh.split())
    x = np.arange(np.prod(shape), dtype="f4").reshape(shape)
    lines, cur, val = [f"%x: f32[{','.join(map(str, shape))}] = input()"], "x", x
    for i in range(draw(st.integers(1, 4))):
        op, fn = _view_ops(val.shape, draw)
        val = np.ascontiguousarray(fn(val))
        lines.append(f"%v{i}: f32[{','.join(map(str, val.shape))}] = {op.replace('%v', '%' + cur)}")
        cur = f"v{i}"
    lines.append(f"return %{cur} as y")

    def placement(rank, n):
        ps = ["R"] + [f"S({d})" for d in range(rank)]
        return "[" + ", ".join(draw(st.sampled_from(ps)) for _ in range(n)) + "]"
    spec_text = f"mesh {mesh}\ninput x {placement(len(shape), axes)}\noutput y {placement(val.ndim, axes)}"
    return "\n".join(lines) + "\n", spec_text, x


@settings(max_examples=60, deadline=None)
@given(view_chain())
def test_random_view_chains_sharded_equal_unsharded_exactly(case):
    text, spec_text, x = case
    try:
        kinds, got, want = _run(text, spec_text, {"x": x})
    except Exception as e:  # an uneven split is refused up front, with a located error
        assert "not divisible" in str(e), e
        return
    _exact(got, want)


# ---- the aten view ops through torch.export ---------------------------------------

class Views(torch.nn.Module):
    def forward(self, x):  # x [4, 6, 8]
        a, b, c = x.split([2, 2, 4], dim=2)
        s = torch.stack([a, b], dim=1)  # [4, 2, 6, 2]
        t = s.transpose(2, 3).unsqueeze(0).squeeze(0)  # [4, 2, 2, 6]
        u = torch.cat([t.reshape(4, 24), c.reshape(4, 24)], dim=1)  # [4, 48]
        q, r = u.chunk(2, dim=1)
        e = x[:, :1, :].expand(4, 3, 8)  # broadcast a size-1 dim
        return (q * r + x[:, 1:, 3:].reshape(4, 25)[:, :24] + torch.cat([e.select(1, 2).unbind(0)[3]] * 3)
                + x[..., ::3].reshape(4, 18)[:, -1:])


def test_aten_view_ops_lower_and_run_sharded_over_the_batch():
    x = torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8) % 7
    g = import_torch(Views(), (x,))
    want = Views()(x).numpy()
    ops = {n.op for n in g.nodes}
    assert {"slice", "cat", "reshape", "permute", "expand"} <= ops, ops
    c = compile_graph(g, spec("mesh tp=2\ninput x [S(0)]"))
    got = run_spmd(c.program, {"x": x.numpy()}).outputs(c.program)["output"]
    np.testing.assert_array_equal(got, want)


def test_a_slice_is_a_view_so_nothing_adds_into_it_in_place():
    """torch's slice is a view of its operand: an in-place add into it would change the
    operand, which is read again later (parcomp/passes/lowering/lower.py VIEW_OPS)."""
    g = parse_graph("%x: f32[4,6] = input()\n%b: f32[4,3] = input()\n%h: f32[4,6] = relu(%x)\n"
                    "%s: f32[4,3] = slice(%h) {dim=1, start=0, stop=3}\n%y: f32[4,3] = add(%s, %b)\n"
                    "%t: f32[4,3] = slice(%h) {dim=1, start=3, stop=6}\n%z: f32[4,3] = add(%y, %t)\n"
                    "return %z\n")
    c = compile_graph(g, spec("mesh tp=2\ninput x [S(0)]\ninput b [S(0)]\noutput z [S(0)]"))
    assert not c.program["y"].attr("inplace")
    assert c.program["z"].attr("inplace")  # y is a fresh buffer: adding into it is fine
