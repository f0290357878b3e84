"""The structured VJP bounds (parcomp/rules/vjp_bounds.py) stay sound and are tighter.

sdpa_grad (dq, dk) and the norms' input gradients are linear in the incoming gradient, so
moving it by ``e`` with the signs of the Jacobian's row reaches ``|J| e`` exactly: the
adversarial samples below come within a few percent of the bound (a bound one term too
tight fails), random samples of every operand within its error stay within it, and the
bound is below the expansion the op-by-op rules used before (``p (e + <p, e>)``).
"""
from __future__ import annotations

import numpy as np
import pytest

from parcomp.ir import parse_graph
from parcomp.reference.numpy_ops import NUMPY_OPS
from parcomp.rules import vjp_bounds
from parcomp.tolerance import op_bound

QKV = "".join(f"%{x}: f64[2,2,6,4] = input()\n" for x in ("g", "q", "k", "v"))
CASES = {
    **{f"sdpa_grad_{w}{'_causal' if c else ''}":
       QKV + f"%y: f64[2,2,6,4] = sdpa_grad(%g, %q, %k, %v) {{causal={str(c).lower()}, scale=0.5, wrt=\"{w}\"}}"
       for w in "qk" for c in (True, False)},
    "layer_norm_grad": ("%g: f64[5,8] = input()\n%x: f64[5,8] = input()\n%w: f64[8] = input()\n"
                        "%y: f64[5,8] = layer_norm_grad(%g, %x, %w) {eps=1e-05}"),
    "rms_norm_grad": ("%g: f64[5,8] = input()\n%x: f64[5,8] = input()\n%w: f64[8] = input()\n"
                      "%y: f64[5,8] = rms_norm_grad(%g, %x, %w) {eps=1e-06}"),
}


def _case(name, rng):
    g = parse_graph(CASES[name] + "\nreturn %y\n")
    node = g["y"]
    vals = [rng.standard_normal(g[i].type.shape) * (2.0 if name.startswith("sdpa") else 1.0)
            for i in node.inputs]
    return node, vals


def _f(node, vals):
    return np.asarray(NUMPY_OPS[node.op]([np.asarray(v, np.float64) for v in vals], node), np.float64)


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradient_error_moved_along_the_jacobian_signs_reaches_but_never_exceeds_the_bound(name):
    rng = np.random.default_rng(0)
    node, vals = _case(name, rng)
    eg = 1e-6 * (1 + rng.random(vals[0].shape))
    errs = [eg] + [np.zeros_like(v) for v in vals[1:]]
    y, bound = op_bound(node, vals, errs)
    y = _f(node, vals)
    # the Jacobian in g column by column (f is linear in g), then each output's worst signs
    flat = vals[0].reshape(-1)
    cols = []
    for j in range(flat.size):
        d = np.zeros_like(flat)
        d[j] = 1.0
        cols.append((_f(node, [(flat + d).reshape(vals[0].shape), *vals[1:]]) - y).reshape(-1))
    jac = np.stack(cols, axis=1)  # [out, in]
    worst = np.abs(jac) @ eg.reshape(-1)  # reached by g + eg * sign(J[row])
    b = np.asarray(bound).reshape(-1)
    assert (worst <= b * (1 + 1e-9)).all(), (worst / b).max()
    live = worst > 1e-3 * worst.max()
    assert (worst[live] / b[live]).max() > 0.9  # tight: the expansion was not
    for row in rng.choice(np.flatnonzero(live), 5):  # the adversarial point itself
        moved = _f(node, [vals[0] + (eg.reshape(-1) * np.sign(jac[row])).reshape(eg.shape), *vals[1:]])
        assert abs(moved.reshape(-1)[row] - y.reshape(-1)[row]) <= b[row]


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("rel", [1e-6, 1e-3, 3e-2])
def test_every_operand_moved_within_its_error_stays_within_the_bound(name, rel):
    rng = np.random.default_rng(1)
    node, vals = _case(name, rng)
    errs = [rel * np.abs(v) + rel * 0.1 for v in vals]
    y, bound = op_bound(node, vals, errs)
    y = _f(node, vals)
    for _ in range(100):
        moved = [v + e * rng.choice([-1.0, 1.0], v.shape) * rng.uniform(0.5, 1.0, v.shape)
                 for v, e in zip(vals, errs)]
        assert (np.abs(_f(node, moved) - y) <= bound).all()


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_structured_bound_is_tighter_than_the_expansion(name, monkeypatch):
    rng = np.random.default_rng(2)
    node, vals = _case(name, rng)
    errs = [1e-6 * np.abs(vals[0])] + [np.zeros_like(v) for v in vals[1:]]
    tight = op_bound(node, vals, errs)[1]
    monkeypatch.setattr(vjp_bounds, "MAX_ELEMENTS", 0)  # the expansion (the fallback)
    loose = op_bound(node, vals, errs)[1]
    assert (tight <= loose * (1 + 1e-12)).all()
    assert tight.sum() < (0.95 if name.startswith("rms") else 0.8) * loose.sum()  # rms: no mean g


NORMS = {"layer_norm": "%x: f64[5,8] = input()\n%y: f64[5,8] = layer_norm(%x) {eps=1e-05}",
         "rms_norm": "%x: f64[5,8] = input()\n%y: f64[5,8] = rms_norm(%x) {eps=1e-06}"}


def _norm(name, rng):
    node = parse_graph(NORMS[name] + "\nreturn %y\n")["y"]
    return node, rng.standard_normal((5, 8)) * 3 + (1.0 if name == "layer_norm" else 0.0)


@pytest.mark.parametrize("name", sorted(NORMS))
def test_norm_input_moved_along_the_jacobian_signs_reaches_but_never_exceeds_the_bound(name):
    """xhat's bound: rstd |J| e plus a rigorous second-order rest (rules/norms.py _xhat_move)."""
    rng = np.random.default_rng(3)
    node, x = _norm(name, rng)
    ex = 1e-7 * (1 + rng.random(x.shape))
    y, bound = op_bound(node, [x], [ex])
    y = _f(node, [x])
    for row in range(x.shape[0]):
        for i in range(x.shape[1]):
            h = np.zeros_like(x)
            jac = np.zeros(x.shape[1])
            for j in range(x.shape[1]):  # central differences along the row
                h[row, j] = 1e-4
                jac[j] = (_f(node, [x + h])[row, i] - _f(node, [x - h])[row, i]) / 2e-4
                h[row, j] = 0.0
            worst = np.abs(jac) @ ex[row]
            moved = x.copy()
            moved[row] += ex[row] * np.sign(jac)
            assert abs(_f(node, [moved])[row, i] - y[row, i]) <= bound[row, i]
            assert worst <= bound[row, i] <= 1.1 * worst + 1e-12  # tight: the old bound was not


@pytest.mark.parametrize("name", sorted(NORMS))
@pytest.mark.parametrize("rel", [1e-6, 1e-2, 0.1, 0.3])
def test_norm_input_moved_within_a_large_error_stays_within_the_bound(name, rel):
    """Second order matters once the error is a sizeable part of the row's spread."""
    rng = np.random.default_rng(4)
    node, x = _norm(name, rng)
    ex = rel * (np.abs(x) + 0.5)
    y, bound = op_bound(node, [x], [ex])
    y = _f(node, [x])
    for _ in range(300):
        moved = x + ex * rng.choice([-1.0, 1.0], x.shape) * rng.uniform(0.8, 1.0, x.shape)
        assert (np.abs(_f(node, [moved]) - y) <= bound).all()
