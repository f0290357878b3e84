"""Error bound of gradient clipping's factor (issue 13, ``clip_grad_norm=C``).

``clip_coef(S) = min(1, C / (sqrt(S) + 1e-6))`` where ``S`` is the sum of squares of every
gradient element of the unsharded model. Sharded, ``S`` is assembled from partial sums
(one per tp shard, per ZeRO slice, per parameter) in an order the unsharded run does not
use; the ``sum``/``add`` rules of :mod:`parcomp.rules.error` already bound ``S`` for *every*
summation order (gamma_n sum |x|, Higham ch. 3), so the sharded order is covered by the
bound ``e_S`` of ``S``, never by a separate tolerance.

The factor is a non-increasing function of ``S`` (the ``min`` is 1-Lipschitz and the
quotient decreasing), so its propagated error is exact interval arithmetic rather than a
first-order slope: ``max |f(S +- e_S) - f(S)|`` evaluated in float64 (``S - e_S`` clamped at
0). That stays valid at the clipping threshold (the kink of ``min``) and for errors that are
not small against ``S``. Rounding of the computation: sqrt, the ``+ 1e-6``, the division and
the constant ``C`` in the working precision, ``4 u |out|`` (the clamp is exact).
"""
from __future__ import annotations

import numpy as np

from ..reference.train_ops import clip_coef


def _clip_coef(vals, errs, node, out, u):
    s = np.asarray(vals[0], np.float64)
    e = np.broadcast_to(errs[0], np.shape(s)).astype(np.float64)
    c = float(node.attr("max_norm"))
    f0 = clip_coef(s, c)
    lo, hi = clip_coef(s + e, c), clip_coef(np.maximum(s - e, 0.0), c)
    prop = np.maximum(np.abs(f0 - lo), np.abs(hi - f0))
    return prop + 4 * u * np.abs(out) + np.finfo(np.float64).tiny


CLIP_ERROR_RULES = {"clip_coef": _clip_coef,
                    # mixed precision: widening to float32 is exact, the error moves with the value
                    "grad_upcast": lambda vals, errs, node, out, u: np.broadcast_to(errs[0], np.shape(out)),
                    # fp16 loss scaling: flags and counters are exact; a select moves the chosen error
                    "nonfinite": lambda vals, errs, node, out, u: np.zeros(np.shape(out)),
                    "amp_select": lambda vals, errs, node, out, u: np.where(
                        np.asarray(vals[0]) > 0, np.broadcast_to(errs[2], np.shape(out)),
                        np.broadcast_to(errs[1], np.shape(out))).astype(np.float64),
                    "amp_ratio": lambda vals, errs, node, out, u: np.zeros(np.shape(out)),
                    "amp_tracker": lambda vals, errs, node, out, u: np.zeros(np.shape(out))}
