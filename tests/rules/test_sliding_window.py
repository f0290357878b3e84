"""Sliding-window causal attention: ``sdpa {causal=true, window=w}`` keeps key j for query i
when i - w < j <= i, in global positions (Mistral's ``sliding_window``, Gemma-2's local layers).

The numpy op and its gradients against torch's sdpa with the band mask (float64, hypothesis),
the emitted torch expression against numpy, exact small integers where a window crosses the
boundary between two context-parallel ranks (all_gather, ring contiguous and balanced,
all_to_all), every lowering's training step equal to the unsharded one in float64, and
transformers' Mistral with a window shorter than the sequence: its import equal to the module
and its TP=2 program equal to the unsharded steps.
"""
from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from parcomp.check.check64 import promote_compiled
from parcomp.check.training import numpy_train, train_steps
from parcomp.compile.compiler import compile_graph
from parcomp.ir import Node, TensorType, make_attrs, parse_graph
from parcomp.reference.interpreter import run_spmd
from parcomp.reference.numpy_attn import sdpa_grads
from parcomp.reference.numpy_ops import NUMPY_OPS, run_unsharded

from graphs import spec

torch = pytest.importorskip("torch")
ROOT = pathlib.Path(__file__).resolve().parents[1].parent


def _band(s, w):
    return torch.ones(s, s, dtype=torch.bool).tril() & ~torch.ones(s, s, dtype=torch.bool).tril(-w)


def _node(op, shape, w, **extra):
    n = 4 if op == "sdpa_grad" else 3
    return Node("y", op, tuple(f"a{i}" for i in range(n)), TensorType(shape, "float64"),
                make_attrs(causal=True, scale=0.5, window=w, **extra))


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 2), h=st.integers(1, 3), s=st.integers(1, 9), d=st.integers(1, 4),
       w=st.integers(1, 10), seed=st.integers(0, 1000))
def test_numpy_sdpa_and_its_gradients_equal_torch_with_the_band_mask(b, h, s, d, w, seed):
    from parcomp_backends.torch.emit.nodes import node_code

    rng = np.random.default_rng(seed)
    q, k, v, dy = (rng.standard_normal((b, h, s, d)) for _ in range(4))
    node = _node("sdpa", (b, h, s, d), w)
    got = NUMPY_OPS["sdpa"]([q, k, v], node)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=_band(s, w), scale=0.5)
    np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-12, atol=1e-13)
    want.backward(torch.tensor(dy))
    grads = sdpa_grads(dy, q, k, v, node)
    for name, t in zip("qkv", (tq, tk, tv)):
        np.testing.assert_allclose(grads[name], t.grad.numpy(), rtol=1e-11, atol=1e-12, err_msg=name)
    # the emitted expressions (one node, whole operands) compute the same
    env = {"torch": torch, "DEVICE": torch.device("cpu"),
           **{f"a{i}": torch.tensor(x) for i, x in enumerate((dy, q, k, v))}}
    out = eval(node_code(node, ["a1", "a2", "a3"]), env)  # noqa: S307 - our own table
    np.testing.assert_allclose(out.numpy(), got, rtol=1e-12, atol=1e-13)
    for wrt in "qkv":
        g = eval(node_code(_node("sdpa_grad", (b, h, s, d), w, wrt=wrt), ["a0", "a1", "a2", "a3"]), env)  # noqa: S307
        np.testing.assert_allclose(g.numpy(), grads[wrt], rtol=1e-11, atol=1e-12, err_msg=wrt)


# ---- exact: a window crossing the boundary between two context-parallel ranks ----------------

EXACT = """\
%q: f64[1,2,8,1] = input()
%k: f64[1,2,8,1] = input()
%v: f64[1,2,8,1] = input()
%o: f64[1,2,8,1] = sdpa(%q, %k, %v) {causal=true, scale=1.0, window=2}
return %o as output
"""
# q = k = 0: each query averages the values of the keys it sees, v = 1..8: row i sees rows
# i-1 and i (halves: exact). With cp=2 (contiguous), rank 1's row 4 needs rank 0's row 3
# (balanced: rank 0's row 3 needs rank 1's row 2, rank 1's row 4 rank 0's row 3). Under the
# plain causal mask row 4 would be 3.0; a window at local row 0 (own keys only) 5.0.
WINDOWED = [1.0, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5]


@pytest.mark.parametrize("lowering, chunking", [("all_gather", "contiguous"), ("ring", "contiguous"),
                                                ("all_gather", "balanced"), ("ring", "balanced"),
                                                ("all_to_all", "contiguous")])
def test_rows_see_the_window_across_the_ranks_exactly(lowering, chunking):
    g = parse_graph(EXACT)
    c = compile_graph(g, spec(f"mesh cp=2\ncontext-parallel lowering={lowering} chunking={chunking}\n"
                              "input * split-seq\noutput output split-seq\n"))
    feeds = {"q": np.zeros((1, 2, 8, 1)), "k": np.zeros((1, 2, 8, 1)),
             "v": np.broadcast_to(np.arange(1.0, 9.0).reshape(1, 1, 8, 1), (1, 2, 8, 1)).copy()}
    want = np.broadcast_to(np.reshape(WINDOWED, (1, 1, 8, 1)), (1, 2, 8, 1))  # both heads
    np.testing.assert_array_equal(run_spmd(c.program, feeds).outputs(c.program)["output"], want)
    np.testing.assert_array_equal(run_unsharded(g, feeds)["output"], want)


# ---- every lowering's training step equals the unsharded one (float64) -----------------------

def _attn(seq, batch, heads, w):
    """x [batch, heads, seq, 4] -> q, k, v projections -> windowed causal sdpa -> output."""
    t = f"{batch},{heads},{seq},4"
    lines = [f"%x: f64[{t}] = input()"]
    for p in "qkv":
        lines += [f"%w{p}: f64[4,4] = param()", f"%{p}: f64[{t}] = matmul(%x, %w{p})"]
    lines += [f"%o: f64[{t}] = sdpa(%q, %k, %v) {{causal=true, scale=0.5, window={w}}}",
              "return %o as output"]
    return "\n".join(lines) + "\n"


@settings(max_examples=25, deadline=None)
@given(cp=st.sampled_from([2, 4]), blocks=st.integers(1, 2), w=st.integers(1, 9), dp=st.booleans(),
       way=st.sampled_from([("all_gather", "contiguous"), ("ring", "contiguous"), ("all_gather", "balanced"),
                            ("ring", "balanced"), ("all_to_all", "contiguous")]),
       seed=st.integers(0, 1000))
def test_context_parallel_training_equals_unsharded_in_float64(cp, blocks, w, dp, way, seed):
    lowering, chunking = way
    seq = cp * blocks * 2
    heads = cp if lowering == "all_to_all" else 1
    io = ("input x [S(0), S(2)]\noutput output [S(0), S(2)]\n" if dp
          else "input x split-seq\noutput output split-seq\n")
    c = compile_graph(parse_graph(_attn(seq, 2, heads, w)),
                      spec(f"mesh {'dp=2 ' if dp else ''}cp={cp}\ncontext-parallel lowering={lowering} "
                           f"chunking={chunking}\n{io}train loss=mse optimizer=sgd(lr=0.1) steps=2\n"))
    rng = np.random.default_rng(seed)
    feeds = {n.name: rng.standard_normal(n.type.shape) for n in c.logical.nodes if n.op in ("input", "param")}
    prog = c.program
    got = train_steps(lambda s: run_spmd(prog, s).outputs(prog), c.logical, feeds, 2)
    want = numpy_train(c.logical, feeds, 2)
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-12)
    for k, v in {**want["state"], **want["outputs"]}.items():
        np.testing.assert_allclose({**got["state"], **got["outputs"]}[k], v, rtol=1e-10, atol=1e-12, err_msg=k)


def test_the_program_masks_the_band_at_each_ranks_rows():
    from parcomp_backends.torch.emit import emit_program

    s = "input x split-seq\noutput output split-seq\ntrain loss=mse optimizer=sgd(lr=0.1)\n"
    gather = emit_program(compile_graph(parse_graph(_attn(16, 1, 1, 3)),
                                        spec(f"mesh cp=2\ncontext-parallel\n{s}")))
    assert gather.count(".tril(COORD[0] * 8).triu(COORD[0] * 8 - 2)") == 2  # sdpa, and one call for its 3 grads
    ring = emit_program(compile_graph(parse_graph(_attn(16, 1, 1, 3)),
                                      spec(f"mesh cp=2\ncontext-parallel lowering=ring\n{s}")))
    assert ring.count("window=3)") == 1 and ring.count("window=3, saved=") == 1  # forward; backward on its statistics
    plain = emit_program(compile_graph(parse_graph(_attn(16, 1, 1, 3)), spec(f"mesh dp=2\n{s}")))
    assert plain.count(".tril(0).triu(-2)") == 2 and "is_causal=True" not in plain


# ---- transformers' Mistral with a window shorter than the sequence ---------------------------

def _models():
    sys.path.insert(0, str(ROOT / "specs"))
    try:
        import models
    finally:
        sys.path.remove(str(ROOT / "specs"))
    return models


def test_mistral_window_shorter_than_the_sequence_equals_torch_and_trains_at_tp2():
    pytest.importorskip("transformers")
    import copy

    from parcomp.frontends.torch.export import import_torch
    from parcomp.spec import load_spec

    m, (ids,), names = _models().mistral_lm()
    wide = copy.deepcopy(m).double()
    g = import_torch(wide, (ids,), names)
    assert {n.attr("window") for n in g.by_op("sdpa")} == {4}
    feeds = {**{k: v.detach().numpy() for k, v in wide.state_dict().items() if k in g}, "input_ids": ids.numpy()}
    from parcomp.frontends.torch.fold import folded_constants

    feeds.update({k: v.detach().numpy() for k, v in folded_constants(wide).items()})
    # transformers computes RoPE's angles in float32 even in a float64 model: 1e-7 apart
    np.testing.assert_allclose(run_unsharded(g, feeds)["logits"], wide(ids).logits.detach().numpy(),
                               rtol=0, atol=1e-6)
    # a plain causal mask is 1e-2 away: the window is what makes the two equal
    plain = g.with_nodes([n.with_attrs(window=0) if n.op == "sdpa" else n for n in g.nodes], g.outputs)
    assert np.abs(run_unsharded(plain, feeds)["logits"] - wide(ids).logits.detach().numpy()).max() > 1e-3
    c = promote_compiled(compile_graph(import_torch(m, (ids,), names),
                                       load_spec(ROOT / "specs" / "mistral_lm_tp2_train.pcs")))
    feeds = {**{k: v.detach().double().numpy() for k, v in m.state_dict().items() if k in c.logical},
             **{k: v.detach().double().numpy() for k, v in folded_constants(m).items()},
             "input_ids": ids.numpy(), "labels": np.random.default_rng(0).integers(0, 128, (2, 8))}
    prog = c.program
    got = train_steps(lambda s: run_spmd(prog, s).outputs(prog), c.logical, feeds, 2)
    want = numpy_train(c.logical, feeds, 2)
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-12)
    for k, v in want["state"].items():
        np.testing.assert_allclose(got["state"][k], v, rtol=1e-10, atol=1e-12, err_msg=k)


# ---- program.py's helpers (ring and balanced chunking) against the numpy masks -----------------

@pytest.mark.parametrize("n, start, w", [(2, 0, 3), (2, 8, 3), (4, 4, 1), (4, 12, 6), (2, 0, 16)])
def test_the_helpers_band_equals_the_interpreters(n, start, w):
    from parcomp.reference.cp_ops import causal_keep
    from parcomp.reference.cp_ring import positions
    from parcomp_backends.torch.runtime import sections

    env = {"torch": torch, "DEVICE": torch.device("cpu")}
    for text in sections("program_ring").values():
        exec(text, env)  # noqa: S102 - the helpers program.py pastes
    lk, lq = 16, 16 // n
    node = _node("sdpa", (1, 1, lq, 1), w, balanced_mask=True, cp_size=n, q_start=start)
    np.testing.assert_array_equal(env["balanced_keep"](lq, lk, start, n, w).numpy(), causal_keep(node, lq, lk))
    # the ring: this rank's rows against each owner's block, by global positions
    q = torch.zeros(1, 1, lq, 1)
    for chunking in ("contiguous", "balanced"):
        qpos = positions(chunking, n, start // lq, lq)
        for owner in range(n):
            kpos = positions(chunking, n, owner, lq)
            s, empty = env["ring_scores"](q, q, 1.0, True, torch.tensor(qpos), torch.tensor(kpos), w)
            keep = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - w)
            np.testing.assert_array_equal(s[0, 0].numpy() == 0, keep)
            assert empty == (not keep.any())


@pytest.mark.slow
def test_ring_with_a_window_runs_on_two_gloo_ranks_like_unsharded(tmp_path, capsys):
    import json

    from parcomp.cli.main import main

    model = tmp_path / "attn.pcir"
    model.write_text(_attn(16, 2, 2, 3).replace("f64", "f32"))
    path = tmp_path / "s.pcs"
    path.write_text("mesh cp=2\ncontext-parallel lowering=ring chunking=balanced\ninput x split-seq\n"
                    "output output split-seq\ntrain loss=mse optimizer=sgd(lr=0.1)\n")
    rc = main(["run", str(model), "--spec", str(path), "--nproc", "2", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["ok"], out
