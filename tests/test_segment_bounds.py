"""The backward's bounds by exact linear maps between cuts (parcomp/segment_bounds.py) stay
sound and are what makes Llama's float64 training check resolve.

On the Llama LM of specs/models.py (float64, the first step's state): the cuts are the
residual stream's gradients between half-blocks; moving the cut's value along the signs of
a row of the segment's linear map reaches the linear term exactly (a bound 30% smaller
fails); moving the cut's value and every forward value the segment reads randomly within
their bounds stays within the refined bound; and float32 against float64 stays within the
refined float32 bound at every value of the backward.
"""
from __future__ import annotations

import os
import types

import numpy as np
import pytest

from parcomp.check64 import promote_compiled, promote_feeds
from parcomp.commands_common import _compile, _train_feeds
from parcomp.reference.numpy_ops import NUMPY_OPS
from parcomp.reference.training import initial_state
from parcomp.segment_bounds import linear_bounds, segments
from parcomp.tolerance import propagate

from bound_checks import assert_random_moves_stay_within, float32_within_its_bound, run_segment

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _state(graph, feeds):
    st = initial_state(graph, feeds)
    st.update({k: v for k, v in feeds.items() if k not in {n.name for n in graph.params}})
    if "step" in graph:
        st["step"] = np.array(1.0, graph["step"].type.dtype)
    return st


@pytest.fixture(scope="module")
def llama():
    args = types.SimpleNamespace(model=os.path.join(ROOT, "specs", "models.py") + ":llama_lm",
                                 spec=os.path.join(ROOT, "specs", "llama_lm_tp2_train.pcs"), seed=0)
    compiled, module, example = _compile(args, numeric="check")
    feeds = _train_feeds(compiled, module, example, 0)
    wide = promote_compiled(compiled).logical
    st64 = _state(wide, promote_feeds(feeds))
    env, err = propagate(wide, st64)
    return types.SimpleNamespace(graph=wide, narrow=compiled.logical, feeds=feeds, state=st64, env=env, err=err)


def _segment(llama, cut):
    return dict(segments(llama.graph))[cut]


def test_the_cuts_are_the_residual_streams_gradients(llama):
    cuts = [c for c, _ in segments(llama.graph)]
    assert {"bw.add_12.add", "bw.add_8.add", "bw.add_6.add"} <= set(cuts)
    assert not any(c.startswith("bw.linear") for c in cuts)  # no weight's gradient is a cut


@pytest.mark.parametrize("target", ["bw.linear_1_wt.permute", "bw.rms_norm.sum", "bw.linear.matmul_2"])
def test_the_cut_moved_along_a_rows_signs_reaches_the_linear_term(llama, target):
    """Layer 0's attention (cut: its residual gradient): the linear term is attained, and it
    is most of the refined bound there, so a refined bound 30% smaller fails."""
    cut = "bw.add_6.add"
    seg = _segment(llama, cut)
    env, ec = llama.env, np.asarray(llama.err[cut])
    lin = linear_bounds(seg, cut, env, ec)[target]
    base = run_segment(llama.graph, seg, env, env[cut], cut)[target].reshape(-1)
    bound = np.asarray(llama.err[target]).reshape(-1)
    flat = np.asarray(lin).reshape(-1)
    for row in np.argsort(flat)[-3:]:
        jac = np.zeros(ec.size)  # row `row` of the linear map, column by column
        for k in range(ec.size):
            unit = np.zeros(ec.size)
            unit[k] = 1.0
            jac[k] = run_segment(llama.graph, seg, env, unit.reshape(ec.shape), cut)[target].reshape(-1)[row]
        moved = run_segment(llama.graph, seg, env, env[cut] + ec * np.sign(jac).reshape(ec.shape), cut)[target]
        move = abs(moved.reshape(-1)[row] - base[row])
        assert move == pytest.approx(flat[row], rel=1e-6)   # |L| e reached
        assert move <= bound[row]                            # within the refined bound
        assert move > 0.7 * bound[row]                       # 30% less would fail


def test_tangents_in_batches_are_the_tangents_one_by_one(llama):
    for cut, seg in segments(llama.graph)[4:8]:
        ec = np.asarray(llama.err[cut])
        one, many = linear_bounds(seg, cut, llama.env, ec, batch=1), linear_bounds(seg, cut, llama.env, ec)
        for n in seg:
            np.testing.assert_allclose(many[n.name], one[n.name], rtol=1e-12, atol=0)


def test_the_refined_bound_is_thousands_of_times_tighter_where_llama_needed_it(llama, monkeypatch):
    from parcomp import segment_bounds

    names = ["bw.rms_norm.sum", "bw.linear_1_wt.permute"]
    tight = {k: np.asarray(llama.err[k]).max() for k in names}
    monkeypatch.setattr(segment_bounds, "MAX_WORK", 0)  # the op-by-op boxes
    _, loose = propagate(llama.graph, llama.state)
    for k in names:
        assert tight[k] < np.asarray(loose[k]).max() / 100


@pytest.mark.parametrize("cut", ["bw.add_12.add", "bw.add_6.add"])
def test_cut_and_forward_values_moved_within_their_bounds_stay_within_the_refined_bound(llama, cut):
    assert_random_moves_stay_within(llama.graph, _segment(llama, cut), llama.env, llama.err, cut)


def test_float32_against_float64_stays_within_the_refined_float32_bound(llama):
    region = {n.name for _, s in segments(llama.narrow) for n in s}
    assert len(region) > 150
    worst = float32_within_its_bound(llama.narrow, llama.state, llama.env, region)
    print(f"float32 vs float64, worst error/bound over the backward: {worst:.3g}")


OPS_CASES = {  # (graph text, operand index that carries the tangent)
    "matmul_vector_right": ("%a: f64[4,4] = input()\n%b: f64[4] = input()\n%y: f64[4] = matmul(%a, %b)", 1),
    "matmul_vector_left": ("%a: f64[4] = input()\n%b: f64[4,3] = input()\n%y: f64[3] = matmul(%a, %b)", 0),
    "matmul_batched_forward": ("%a: f64[4,3] = input()\n%b: f64[2,3,5] = input()\n%y: f64[2,4,5] = matmul(%a, %b)", 0),
    "mul_broadcast": ("%a: f64[4] = input()\n%b: f64[3,4] = input()\n%y: f64[3,4] = mul(%a, %b)", 0),
    "permute": ("%a: f64[2,3,4] = input()\n%y: f64[4,2,3] = permute(%a) {perm=(2,0,1)}", 0),
    "sum": ("%a: f64[2,3,4] = input()\n%y: f64[2,4] = sum(%a) {dims=(1,)}", 0),
    "expand": ("%a: f64[2,4] = input()\n%y: f64[2,3,4] = expand(%a) {dims=(1,)}", 0),
    "rms_norm_grad": ("%g: f64[3,8] = input()\n%x: f64[3,8] = input()\n%y: f64[3,8] = rms_norm_grad(%g, %x) {eps=1e-06}", 0),
}


@pytest.mark.parametrize("case", sorted(OPS_CASES))
def test_an_op_on_a_batch_of_tangents_is_the_op_on_each(case):
    from parcomp.ir import parse_graph
    from parcomp.segment_ops import run_batched

    text, which = OPS_CASES[case]
    g = parse_graph(text + "\nreturn %y\n")
    node = g["y"]
    rng = np.random.default_rng(5)
    ops = [rng.standard_normal(g[i].type.shape) for i in node.inputs]
    batch = ops[which].shape[0] if ops[which].ndim else 3  # a batch as long as a dim: no accidental fit
    tans = rng.standard_normal((batch, *ops[which].shape))
    flags = [k == which for k in range(len(ops))]
    got = run_batched(node, [tans if f else x for f, x in zip(flags, ops)], flags, batch)
    for b in range(batch):
        want = NUMPY_OPS[node.op]([tans[b] if f else x for f, x in zip(flags, ops)], node)
        np.testing.assert_allclose(got[b], want, rtol=1e-13, atol=1e-14)


def test_a_forward_value_added_to_the_gradient_is_an_offset_not_part_of_the_map():
    """add(g, x): the map from g is the identity whatever x is (x's error is B0's)."""
    from parcomp.ir import parse_graph

    g = parse_graph("%x: f64[2,3] = input()\n%s: f64[2,3] = ones()\n%c: f64[2,3] = scale(%s) {value=2.0}\n"
                    "%y: f64[2,3] = add(%c, %x)\n%z: f64[2,3] = scale(%c) {value=3.0}\nreturn %y, %z\n")
    x = np.full((2, 3), 100.0)
    ec = np.full((2, 3), 1e-3)
    lin = linear_bounds([g["y"]], "c", {"x": x, "c": np.full((2, 3), 2.0)}, ec)
    np.testing.assert_allclose(lin["y"], ec)


def _counting(monkeypatch):
    """Counts the cuts :func:`linear_bounds` runs (their names, in order)."""
    from parcomp import segment_bounds

    runs, real = [], segment_bounds.linear_bounds

    def counted(segment, cut, *a, **k):
        runs.append(cut)
        return real(segment, cut, *a, **k)
    monkeypatch.setattr(segment_bounds, "linear_bounds", counted)
    return runs


def test_refining_for_some_values_runs_only_the_cuts_they_depend_on(llama, monkeypatch):
    """Layer 1's weight gradients depend on the cuts above layer 1 only: layer 0's cuts are
    not run, and those gradients get the bound that refining everything gives them."""
    from parcomp.tolerance import refine_bounds

    runs = _counting(monkeypatch)
    env, box = propagate(llama.graph, llama.state, refined=False)
    full = refine_bounds(llama.graph, env, box)
    every = list(runs)
    outs = dict(llama.graph.named_outputs())
    wanted = [outs[k] for k in outs if k.startswith("model.layers.1.") and k.endswith(".grad")]
    runs.clear()
    some = refine_bounds(llama.graph, env, box, set(wanted))
    assert "bw.add_6.add" in every and "bw.add_6.add" not in runs  # layer 0's attention cut
    assert set(runs) < set(every) and "bw.add_12.add" in runs
    for v in wanted:
        np.testing.assert_array_equal(some[v], full[v])
    assert any((full[v] < box[v]).any() for v in wanted)  # and refining did tighten them


@pytest.mark.parametrize("factory,refines", [("gpt2_lm", False), ("llama_lm", True)])
def test_the_check_refines_only_when_the_boxes_cannot_vouch(monkeypatch, factory, refines):
    """The float64 lockstep step: GPT-2's op-by-op boxes vouch, so no linear map is run;
    Llama's do not (layer 0's gradients), so the maps run and then vouch (OK either way)."""
    from parcomp.train_check import lockstep

    args = types.SimpleNamespace(model=os.path.join(ROOT, "specs", "models.py") + f":{factory}",
                                 spec=os.path.join(ROOT, "specs", f"{factory}_tp2_train.pcs"), seed=0)
    compiled, module, example = _compile(args, numeric="check")
    feeds = promote_feeds(_train_feeds(compiled, module, example, 0))
    runs = _counting(monkeypatch)
    out = lockstep(promote_compiled(compiled), None, example, feeds, 1)["vs_unsharded"]
    assert out["ok"], out["why"]
    assert bool(runs) == refines, runs
