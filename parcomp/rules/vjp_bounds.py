"""Structured bounds of how far an incoming gradient's error moves a VJP (issue 17).

A VJP that is linear in its incoming gradient ``g`` moves by exactly ``J (g' - g)`` when
``g`` moves (``J``: the Jacobian in ``g`` at the exact operands), so ``|J| e_g`` bounds
that move elementwise, and no bound built from the same ``e_g`` alone is smaller (Higham,
"Accuracy and Stability of Numerical Algorithms", 2nd ed., ch. 3: componentwise
condition numbers). The op-by-op rules expand ``J``'s factors first, e.g. the softmax
VJP ``p (g - <p, g>)`` as ``p (e_g + <p, e_g>)`` and LayerNorm's
``rstd (g - mean g - xhat mean(g xhat))`` as ``rstd (e_g + mean e_g + |xhat| mean(|xhat| e_g))``,
which loses the cancellation inside ``J``: over a few transformer blocks the backward bound
grows many times the actual error. The helpers here return ``|J| e_g`` itself; the rules
(:mod:`parcomp.rules.attention`, :mod:`parcomp.rules.norms`) use it for the first-order
``e_g`` term in place of the expansion and keep every other term (the operands' own errors,
the products of two errors, rounding) as before, so the bound stays a bound: ``|J| e_g`` is
at most the expansion it replaces, term by term.

Each helper returns None when building ``|J|`` would take more than :data:`MAX_ELEMENTS`
float64 entries or multiply-adds (the caller then keeps the expansion).
"""
from __future__ import annotations

import numpy as np

#: the largest ``|J|`` (float64 entries) built; beyond it the rules keep the expansion
MAX_ELEMENTS = 1 << 24


def _fits(*shape) -> bool:
    return int(np.prod([int(s) for s in shape], dtype=np.int64)) <= MAX_ELEMENTS


def sdpa_dy_move(p, v, other, edy, wrt: str):
    """``|J| e_dy`` of ``sdpa_grad`` for ``wrt`` in ``("q", "k")``, without the scale ``c``.

    ``p``: the attention probabilities ``[..., Sq, Sk]`` (exact operands); ``v``: ``[..., Sk, Dv]``;
    ``other``: ``k`` ``[..., Sk, D]`` for ``wrt="q"``, ``q`` ``[..., Sq, D]`` for ``wrt="k"``;
    ``edy``: ``[..., Sq, Dv]``. With ``vbar_i = sum_l p_il v_l`` and ds_ij =
    ``p_ij sum_d dy_id (v_jd - vbar_id)``:

    - dq_im = c sum_j ds_ij k_jm: ``sum_d e_id |sum_j p_ij (v_jd - vbar_id) k_jm|``;
    - dk_jm = c sum_i ds_ij q_im: ``sum_i p_ij |q_im| sum_d e_id |v_jd - vbar_id|``.

    Returns ``[..., Sq, D]`` (q) or ``[..., Sk, D]`` (k), or None when too large."""
    lead, (sq, sk), dv, d = p.shape[:-2], p.shape[-2:], v.shape[-1], other.shape[-1]
    n = int(np.prod(lead, dtype=np.int64))
    if not _fits(n, sq, sk, dv, d if wrt == "q" else 1):  # the einsum's work
        return None
    vbar = np.matmul(p, v)                                  # [..., Sq, Dv]
    dev = v[..., None, :, :] - vbar[..., :, None, :]        # [..., Sq, Sk, Dv]: v_j - vbar_i
    if wrt == "q":
        t = np.einsum("...ij,...ijd,...jm->...idm", p, dev, other)  # [..., Sq, Dv, D]
        return np.einsum("...id,...idm->...im", np.broadcast_to(edy, vbar.shape), np.abs(t))
    spread = np.einsum("...id,...ijd->...ij", np.broadcast_to(edy, vbar.shape), np.abs(dev))
    return np.matmul(np.swapaxes(p * spread, -1, -2), np.abs(other))


def norm_dg_move(xhat, eg, rms: bool):
    """``|J| e_g`` of a norm's input gradient ``rstd (g - mean g - xhat mean(g xhat))`` (layer
    norm; rms norm without ``mean g``) in its ``g = dy w``, without the factor ``rstd``:
    ``sum_j |delta_ij - a - xhat_i xhat_j / n| e_j`` over the last dim (n entries; ``a``: 1/n,
    0 for rms). ``xhat``, ``eg``: ``[..., n]``. None when ``[..., n, n]`` is too large."""
    n = xhat.shape[-1]
    if not _fits(np.prod(xhat.shape, dtype=np.int64), n):
        return None
    coef = np.eye(n) - (0.0 if rms else 1.0 / n) - xhat[..., :, None] * xhat[..., None, :] / n
    return np.einsum("...ij,...j->...i", np.abs(coef), np.broadcast_to(eg, xhat.shape))
