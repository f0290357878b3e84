"""Shape rules of the MoE ops (declared in :mod:`parcomp.ir.ops`).

``x[B, S, H]`` tokens in rows (a row is one routing group: capacity counts per row),
``c[B, S, E]`` combine weights, ``y[B, E, C, H]`` the dispatch buffer (C slots per expert).
Each raises ValueError on operands that do not fit (the verifier locates it).
"""
from __future__ import annotations

from .types import TensorType


def _check(x, c, what):
    if x.rank != 3 or c.rank != 3 or x.shape[:2] != c.shape[:2]:
        raise ValueError(f"{what} needs [B, S, H] tokens and [B, S, E] weights, got {x} and {c}")


def moe_dispatch_type(ts, n):
    """(x[B, S, H], c[B, S, E]) {capacity} -> [B, E, capacity, H]."""
    x, c = ts
    _check(x, c, "moe_dispatch")
    cap = n.attr("capacity")
    if not isinstance(cap, int) or cap < 1:
        raise ValueError(f"moe_dispatch needs capacity >= 1, got {cap!r}")
    return TensorType((x.shape[0], c.shape[2], cap, x.shape[2]), x.dtype)


def moe_combine_type(ts, n):
    """(y[B, E, C, H], c[B, S, E]) -> [B, S, H]."""
    y, c = ts
    if y.rank != 4 or c.rank != 3 or y.shape[:2] != (c.shape[0], c.shape[2]):
        raise ValueError(f"moe_combine needs [B, E, C, H] slots and [B, S, E] weights, got {y} and {c}")
    return TensorType((c.shape[0], c.shape[1], y.shape[3]), y.dtype)


def moe_combine_grad_c_type(ts, n):
    """(g[B, S, H], y[B, E, C, H], c[B, S, E]) -> [B, S, E]."""
    g, y, c = ts
    _check(g, c, "moe_combine_grad_c")
    moe_combine_type((y, c), n)
    return c
