"""Balanced causal chunking's storage order (``context-parallel chunking=balanced``): a feed
put into the order the program holds it, outputs put back in natural order.
"""
from __future__ import annotations

import numpy as np

from .cp_ring import storage_order


def to_storage(x, dim: int, n: int):
    """``x`` (natural order along ``dim``) in balanced storage order."""
    return np.take(np.asarray(x), storage_order(n, np.shape(x)[dim]), axis=dim)


def from_storage(x, dim: int, n: int):
    """Inverse of :func:`to_storage`."""
    x = np.asarray(x)
    out = np.empty_like(x)
    idx = [slice(None)] * x.ndim
    idx[dim] = storage_order(n, x.shape[dim])
    out[tuple(idx)] = x
    return out


def split_dim(layout, axis: int):
    """The dim ``layout`` splits over mesh axis index ``axis``, or None."""
    p = layout[axis] if layout is not None and axis < len(layout) else None
    return getattr(p, "dim", None)


def balanced_of(program):
    """``(mesh axis index, n)`` of a program with balanced chunking (from its sdpa), or None
    (found once per program: :meth:`parcomp.ir.graph.Graph.memo`)."""
    return program.memo("cp_balance.balanced_of", _balanced_of)


def _balanced_of(program):
    for node in program.nodes:
        if node.op == "sdpa" and node.attr("chunking") == "balanced":
            return program.mesh.axis_index(node.attr("cp_axis")), node.attr("cp_size")
    return None


def feed(program, node, full):
    """The feed of source ``node`` as the program holds it: in storage order when the program has
    balanced chunking and ``node`` splits a dim over its axis (a label the train line adds too),
    or is a constant position table (``balanced_dims``)."""
    if node.op == "param" and node.attr("balanced"):
        for d in node.attr("balanced_dims"):
            full = to_storage(full, d, node.attr("balanced"))
        return full
    got = balanced_of(program) if node.op == "input" else None
    dim = split_dim(node.layout, got[0]) if got else None
    return full if dim is None else to_storage(full, dim, got[1])


def outputs(program, full: dict) -> dict:
    """``{public name: assembled array}`` with every output split over the balanced axis back in
    natural order (unchanged without balanced chunking)."""
    got = balanced_of(program)
    if got is None:
        return full
    out = dict(full)
    for public, value in program.named_outputs():
        dim = split_dim(program[value].layout, got[0])
        if dim is not None and public in out:
            out[public] = from_storage(out[public], dim, got[1])
    return out
