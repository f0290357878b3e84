"""Data of an ``accumulate=K`` training step: stacking K microbatches into the step's
inputs and taking them apart again, as :mod:`parcomp.passes.train.accumulate` slices them.

Microbatch k of a stacked array X ([K*B, ...], dim 0 split D ways by its layout) is
``X.reshape(D, K, B/D, ...)[:, k].reshape(B, ...)``: on every rank the k-th of K chunks of
its share.
"""
from __future__ import annotations

import numpy as np


def micro_layouts(compiled) -> dict:
    """``{stacked input name: (K, D)}`` of a compiled training step (empty without accumulation)."""
    from ..passes.train.accumulate import micro_split
    from ..spec.train_config import train_config

    K = train_config(compiled.spec).options.accumulate
    if K == 1:
        return {}
    g = compiled.logical
    return {n.name: (K, micro_split(n.layout, g.mesh)) for n in g.inputs if n.phase != "optimizer"}


def micro(x, k: int, K: int, D: int) -> np.ndarray:
    """Microbatch ``k`` of stacked array ``x``."""
    x = np.asarray(x)
    B = x.shape[0] // K
    return np.ascontiguousarray(x.reshape((D, K, B // D) + x.shape[1:])[:, k].reshape((B,) + x.shape[1:]))


def stack(parts: list, D: int) -> np.ndarray:
    """The stacked array whose microbatches are ``parts`` (inverse of :func:`micro`)."""
    B, rest = parts[0].shape[0], parts[0].shape[1:]
    return np.stack([p.reshape((D, B // D) + rest) for p in parts], axis=1).reshape((len(parts) * B,) + rest)


def stacked_feeds(compiled, feeds: dict, seed: int = 0) -> dict:
    """The step's stacked model inputs: microbatch 0 is ``feeds``' (the model's example),
    the others seeded variations of it (floats: normal draws; integers such as token ids:
    the example's values rolled, so every id stays valid). A model's own ``labels`` input
    (``loss=output``) is a model input: stacked too."""
    rng = np.random.default_rng(seed + 2000)
    out, g = {}, compiled.logical
    for name, (K, D) in micro_layouts(compiled).items():
        if name not in feeds or g[name].phase == "loss":  # the loss's target / labels: data_for's
            continue
        x = np.asarray(feeds[name])
        parts = [x] + [rng.standard_normal(x.shape).astype(x.dtype) if x.dtype.kind == "f"
                       else np.roll(x.ravel(), 3 * k + 1).reshape(x.shape) for k in range(1, K)]
        out[name] = stack(parts, D)
    return out


def microbatches(compiled, data: dict) -> list | None:
    """The K microbatches (``{name: array}``) of the stacked arrays in ``data``, or None."""
    lay = micro_layouts(compiled)
    if not lay:
        return None
    K = next(iter(lay.values()))[0]
    return [{n: micro(data[n], k, K, D) for n, (_, D) in lay.items() if n in data} for k in range(K)]
