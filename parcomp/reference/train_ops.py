"""numpy of the training-option ops (issue 13): ``clip_coef``."""
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
                   "grad_upcast": lambda a, n: np.asarray(a[0]).astype(np.float32)}  # exact widening
