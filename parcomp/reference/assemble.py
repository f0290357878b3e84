"""A full array rebuilt from the ranks' local blocks under a layout (what a rank's outputs
assemble into): shards placed, partial sums added, replicas checked bit-identical.
"""
from __future__ import annotations

import numpy as np

from ..ir.types import Partial, R, Replicate, TensorType, shard_offsets


def _reduce_max_axes(locals_by_rank, layout, mesh):
    """Per-rank locals with every P(max) axis reduced by max (then treated as R)."""
    locs = list(locals_by_rank)
    for a, p in enumerate(layout):
        if isinstance(p, Partial) and p.op == "max":
            for group in mesh.groups(a):
                top = np.maximum.reduce([np.asarray(locs[r]) for r in group])
                for r in group:
                    locs[r] = top
    return locs, tuple(R if isinstance(p, Partial) and p.op == "max" else p for p in layout)


def assemble(locals_by_rank, layout, global_shape, mesh, dtype="float32") -> np.ndarray:
    """Rebuild the full array from per-rank locals; replicas must be bit-identical.
    Partial-sum axes are summed, partial-max axes combined by max.

    Raises:
        ValueError: two replicas of the same block differ (a rank diverged).
    """
    locals_by_rank, layout = _reduce_max_axes(locals_by_rank, layout, mesh)
    ty = TensorType(tuple(global_shape), dtype)
    wide = dtype if np.dtype(dtype).kind in "iu" else np.result_type(dtype, np.float64)  # int64 keys: exact
    full, seen = np.zeros(global_shape, dtype=wide), {}
    for r, local in enumerate(locals_by_rank):
        coords = mesh.coords(r)
        key = tuple(c if not isinstance(p, Replicate) else 0 for c, p in zip(coords, layout))
        if key in seen:
            if any(isinstance(p, Replicate) for p in layout) and not np.array_equal(seen[key], local, equal_nan=True):
                raise ValueError(f"replicas differ: rank {r} vs another rank at coords {key}")
            continue
        seen[key] = local
        idx = tuple(slice(s, s + n) for s, n in shard_offsets(ty, layout, mesh, coords))
        full[idx] += local
    return full.astype(dtype)
