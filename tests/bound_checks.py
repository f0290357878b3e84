"""Soundness checks shared by the linear-map bound tests (tests/test_segment_bounds.py,
tests/test_tied_lm.py): re-running a backward segment on numpy from a moved cut, random moves of
the cut and of every forward value within their bounds, and float32 against float64 within the
refined float32 bound."""
from __future__ import annotations

import numpy as np

from parcomp.reference.numpy_ops import NUMPY_OPS
from parcomp.tolerance import propagate


def run_segment(graph, seg, env, cut_value, cut) -> dict:
    """``{name: value}`` of the nodes of ``seg`` re-run in numpy with ``cut`` set to ``cut_value``
    (every other operand read from ``env``)."""
    vals = {cut: cut_value}
    for n in seg:
        vals[n.name] = NUMPY_OPS[n.op]([vals[i] if i in vals else env[i] for i in n.inputs], graph[n.name])
    return vals


def assert_random_moves_stay_within(graph, seg, env, err, cut, moves: int = 20) -> None:
    """Move the cut and every float value ``seg`` reads to a random corner of its bound
    ``err``, ``moves`` times: every value of ``seg`` moves by at most its bound (plus the
    float64 rounding of the re-run itself, 1e-13 of the value's scale)."""
    rng = np.random.default_rng(0)
    names = {n.name for n in seg} | {cut}
    reads = {i for n in seg for i in n.inputs if i not in names}
    base = run_segment(graph, seg, env, env[cut], cut)
    for _ in range(moves):
        moved_env = dict(env)
        for r in reads:
            if np.asarray(env[r]).dtype.kind == "f":
                moved_env[r] = env[r] + err[r] * rng.choice([-1.0, 1.0], np.shape(env[r]))
        moved = run_segment(graph, seg, moved_env,
                            env[cut] + err[cut] * rng.choice([-1.0, 1.0], np.shape(env[cut])), cut)
        for n in seg:
            allowed = err[n.name] * (1 + 1e-9) + 1e-13 * np.abs(base[n.name]).max()
            assert (np.abs(moved[n.name] - base[n.name]) <= allowed).all(), n.name


def float32_within_its_bound(graph, state64, env64, names) -> float:
    """Run ``graph`` from ``state64`` cast to float32 and assert each value of ``names`` is
    within its refined float32 bound of the float64 run ``env64``; returns the worst
    error/bound (> 0 asserted, so the comparison saw rounding)."""
    st32 = {k: (np.asarray(v, np.float32) if np.asarray(v).dtype.kind == "f" else v) for k, v in state64.items()}
    env32, err32 = propagate(graph, st32)
    worst = 0.0
    for name in names:
        diff = np.abs(np.asarray(env32[name], np.float64) - env64[name])
        assert (diff <= err32[name]).all(), name
        ok = np.isfinite(err32[name]) & (err32[name] > 0)
        worst = max(worst, float((diff[ok] / err32[name][ok]).max()) if ok.any() else 0.0)
    assert worst > 0.0
    return worst
