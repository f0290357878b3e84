"""Promotion to float64: how ``parcomp check`` runs a compiled program for its verdict.

The sharding itself (which collective, which layout, which rank holds what) does not depend
on the dtype, so ``check`` runs the compiled programs with every float value promoted to
float64 against the unsharded graph promoted the same way (not the torch module: a model's
explicit float32 casts, Llama's RoPE, stay float32 in torch), where rounding is 2**29 times
smaller than in float32 and a sharding bug stands far above it (:mod:`parcomp.check.differential`).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

WIDE = "float64"


def _wide(t):
    return replace(t, dtype=WIDE) if t.dtype.startswith(("float", "bfloat")) and t.dtype != WIDE else t


def promote_graph(graph):
    """``graph`` with every floating-point value's type (and a ``type`` attr) made float64."""
    def node(n):
        attrs = tuple((k, _wide(v) if k == "type" and hasattr(v, "dtype") else v) for k, v in n.attrs)
        return replace(n, type=_wide(n.type), attrs=attrs)
    return graph.with_nodes([node(n) for n in graph.nodes])


def promote_compiled(compiled):
    """A :class:`parcomp.compile.compiler.Compiled` whose graphs compute in float64 (same layouts,
    same collectives, same report)."""
    return replace(compiled, unsharded=promote_graph(compiled.unsharded),
                   logical=promote_graph(compiled.logical), sharded=promote_graph(compiled.sharded),
                   program=promote_graph(compiled.program))


def promote_feeds(feeds: dict) -> dict:
    """Float arrays as float64; integer and bool arrays (ids, labels) unchanged."""
    return {k: np.asarray(v, np.float64) if np.asarray(v).dtype.kind == "f" else v for k, v in feeds.items()}


def narrow_feeds(feeds: dict, graph) -> dict:
    """The inverse of :func:`promote_feeds` for ``graph``'s sources: each float array of
    ``feeds`` that names an input or param of ``graph`` in that value's dtype (a torch.optim
    reference starts from the float64 run's state in the model's own dtypes)."""
    out = dict(feeds)
    for n in graph.nodes:
        if n.op in ("input", "param") and n.name in feeds and np.asarray(feeds[n.name]).dtype.kind == "f":
            out[n.name] = np.asarray(feeds[n.name]).astype(n.type.dtype)
    return out
