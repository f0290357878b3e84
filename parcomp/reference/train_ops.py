"""numpy of the training-option ops: ``clip_coef``."""
from __future__ import annotations

import numpy as np

#: torch.nn.utils.clip_grad_norm_'s guard against a zero norm (``total_norm + 1e-6``)
CLIP_EPS = 1e-6


def clip_coef(sumsq, max_norm: float):
    """``min(1, max_norm / (sqrt(sumsq) + 1e-6))`` in ``sumsq``'s dtype: the factor
    torch.nn.utils.clip_grad_norm_ multiplies every gradient by (``sumsq``: the sum of
    squares of every gradient element, 0-d)."""
    t = np.asarray(sumsq).dtype.type
    c = t(max_norm) / (np.sqrt(sumsq) + t(CLIP_EPS))
    return np.minimum(c, t(1.0)).astype(t)


TRAIN_NUMPY_OPS = {"clip_coef": lambda a, n: clip_coef(a[0], n.attr("max_norm")),
                   "grad_upcast": lambda a, n: np.asarray(a[0]).astype(n.type.dtype),  # exact widening (float64 check: f64)
                   # fp16 loss scaling (parcomp/passes/train/amp.py)
                   "nonfinite": lambda a, n: (~np.isfinite(a[0])).astype(n.type.dtype),
                   "amp_select": lambda a, n: np.where(a[0] > 0, a[2], a[1]).astype(a[1].dtype),
                   "amp_ratio": lambda a, n: amp_ratio(a[0], a[1], a[2], n.attr("interval")),
                   "amp_tracker": lambda a, n: np.where(
                       (a[0] > 0) | (a[1] + 1 >= n.attr("interval")), 0, a[1] + 1).astype(np.float32)}


def amp_ratio(found, ratio, tracker, interval: int):
    """The next ``scale / init - 1``: halved on a skipped step, doubled after ``interval``
    clean ones (torch.amp.GradScaler.update), exact for powers of two."""
    f32 = np.float32
    grow = np.where(tracker + 1 >= interval, f32(2) * ratio + f32(1), ratio)
    return np.where(found > 0, f32(0.5) * ratio - f32(0.5), grow).astype(f32)
