"""The joint error bounds of the decomposed softmax family (parcomp/rules/softmax_bounds.py):
finite where the op-by-op bounds overflow, and sound: logits moved anywhere within their
error bound give softmax / cross-entropy values (float64) within the propagated bound."""
from __future__ import annotations

import numpy as np
import pytest

from parcomp.compiler import compile_graph
from parcomp.ir import parse_graph
from parcomp.spec import parse_spec
from parcomp.tolerance import propagate

GRAPH = """\
%z: f32[4,6] = input()
%labels: i64[4] = input()
%p: f32[4,6] = softmax(%z) {dim=1}
%l: f32[4] = cross_entropy(%z, %labels)
return %p as probs, %l as loss
"""


def _exact(z, labels):
    z = z.astype(np.float64)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    return p, np.log(e.sum(axis=1)) - (z - z.max(axis=1, keepdims=True))[np.arange(len(z)), labels]


@pytest.mark.parametrize("delta", [1e-4, 0.3, 50.0])
def test_softmax_and_cross_entropy_bounds_hold_for_any_logits_within_the_input_error(delta):
    g = compile_graph(parse_graph(GRAPH), parse_spec("mesh tp=2\n", "t.pcs")).logical
    rng = np.random.default_rng(0)
    z = (rng.standard_normal((4, 6)) * 3).astype("f4")
    labels = rng.integers(0, 6, 4)
    env, err = propagate(g, {"z": z, "labels": labels}, {"z": np.full((4, 6), delta)})
    out = dict(g.named_outputs())
    bp, bl = np.asarray(err[out["probs"]]), np.asarray(err[out["loss"]])
    assert np.isfinite(bp).all() and np.isfinite(bl).all()
    assert bp.max() <= 1.0 + 1e-5 and bl.max() <= 4 * delta + 1e-3  # Lipschitz, never overflowing
    got_p, got_l = np.asarray(env[out["probs"]]), np.asarray(env[out["loss"]])
    for _ in range(200):  # the true values at logits anywhere within the error
        p, l = _exact(z + rng.uniform(-delta, delta, z.shape), labels)
        assert (np.abs(got_p - p) <= bp).all() and (np.abs(got_l - l) <= bl).all()


def test_padded_vocab_entries_do_not_loosen_the_bounds():
    """Padded vocab columns hold the dtype's lowest value (``mask_pad``) with an error bound
    near the dtype's max (``u |x|``); their exp is 0 on both sides, so they are dead and the
    row's bound is that of the live columns (before: log n for every row, and the float64
    re-check of a padded LM training step could never vouch)."""
    g = compile_graph(parse_graph(GRAPH), parse_spec("mesh tp=2\n", "t.pcs")).logical
    rng = np.random.default_rng(1)
    z = rng.standard_normal((4, 6)).astype("f4")
    z[:, 4:] = np.finfo(np.float32).min
    labels = rng.integers(0, 4, 4)
    delta = np.full((4, 6), 1e-6)
    delta[:, 4:] = np.finfo(np.float32).eps * np.finfo(np.float32).max
    env, err = propagate(g, {"z": z, "labels": labels}, {"z": delta})
    out = dict(g.named_outputs())
    bp, bl = np.asarray(err[out["probs"]]), np.asarray(err[out["loss"]])
    assert bl.max() <= 1e-5 and bp.max() <= 1e-5  # ~4x the live columns' delta, not log 6 or 1
    got_p, got_l = np.asarray(env[out["probs"]]), np.asarray(env[out["loss"]])
    for _ in range(200):
        live = z.astype(np.float64) + np.where(z > -1e30, rng.uniform(-1e-6, 1e-6, z.shape), 0.0)
        p, l = _exact(live, labels)
        assert (np.abs(got_p - p) <= bp).all() and (np.abs(got_l - l) <= bl).all()
