"""numpy semantics of the MoE ops, merged into ``NUMPY_OPS``.

Routing (Mixtral's ``MixtralTopKRouter``): the top-k experts of each token by logit (ties: the
lower expert index first, as a stable descending sort), weights ``softmax`` over the top-k only
(= softmax over all experts, renormalised over the top-k). With ``capacity`` > 0, an expert
takes at most that many tokens of one row (row = routing group), in token order; a later
token's slot is dropped: its weight becomes 0 (not renormalised again, as GShard / Switch).

Slots: token s of row b is in slot ``pos[b, s, e]`` of expert e (the number of earlier tokens
of the row routed to e), where ``c[b, s, e] != 0``; slots past the buffer are dropped.
Every function here works per row and per expert, so a block of rows or of experts computes
its block of the result (what the sharding rules of parcomp/rules/moe.py rely on).
"""
from __future__ import annotations

import numpy as np


def top_mask(z, top_k: int, capacity: int = 0):
    """(top-k mask, kept mask) of logits ``z[..., S, E]``: bool arrays of z's shape."""
    order = np.argsort(-z, axis=-1, kind="stable")[..., :top_k]
    top = np.zeros(z.shape, bool)
    np.put_along_axis(top, order, True, axis=-1)
    kept = top
    if capacity:
        kept = top & (np.cumsum(top, axis=-2) <= capacity)
    return top, kept


def _weights(z, top):
    zs = np.where(top, z, -np.inf)
    e = np.where(top, np.exp(z - np.max(zs, axis=-1, keepdims=True)), 0).astype(z.dtype)
    return e / np.sum(e, axis=-1, keepdims=True)


def route(z, top_k: int, capacity: int = 0):
    """Combine weights [..., S, E]: softmax over each token's top-k logits, 0 elsewhere and
    on dropped slots."""
    top, kept = top_mask(z, top_k, capacity)
    return np.where(kept, _weights(z, top), 0).astype(z.dtype)


def route_grad(g, z, top_k: int, capacity: int = 0):
    """VJP of :func:`route`: ``w (g' - sum(g' w))`` over the top-k, g' = g on kept slots."""
    top, kept = top_mask(z, top_k, capacity)
    w = _weights(z, top)
    gk = np.where(kept, g, 0).astype(z.dtype)
    s = np.sum(gk * w, axis=-1, keepdims=True)
    return np.where(top, w * (gk - s), 0).astype(z.dtype)


def slots(c, capacity: int):
    """``(b, s, e, pos)`` index arrays of the routed (token, expert) pairs that fit."""
    sel = c != 0
    pos = np.cumsum(sel, axis=1) - 1
    b, s, e = np.nonzero(sel & (pos < capacity))
    return b, s, e, pos[b, s, e]


def dispatch(x, c, capacity: int, weighted: bool = False):
    """[B, E, capacity, H]: each routed token's row in its expert's slot (times c if weighted)."""
    out = np.zeros((x.shape[0], c.shape[2], capacity, x.shape[2]), x.dtype)
    b, s, e, pos = slots(c, capacity)
    rows = x[b, s] * c[b, s, e][:, None] if weighted else x[b, s]
    out[b, e, pos] = rows
    return out


def combine(y, c, weighted: bool = True):
    """[B, S, H]: each token's sum of its experts' slots (times c if weighted)."""
    out = np.zeros((c.shape[0], c.shape[1], y.shape[3]), y.dtype)
    b, s, e, pos = slots(c, y.shape[2])
    rows = y[b, e, pos] * c[b, s, e][:, None] if weighted else y[b, e, pos]
    np.add.at(out, (b, s), rows)
    return out


def combine_grad_c(g, y, c):
    """[B, S, E]: ``g[b, s] . y[b, e, slot]`` on routed pairs, 0 elsewhere."""
    out = np.zeros(c.shape, c.dtype)
    b, s, e, pos = slots(c, y.shape[2])
    out[b, s, e] = np.sum(g[b, s] * y[b, e, pos], axis=-1)
    return out


MOE_NUMPY_OPS = {
    "moe_route": lambda a, n: route(a[0], n.attr("top_k"), n.attr("capacity", 0)),
    "moe_route_grad": lambda a, n: route_grad(a[0], a[1], n.attr("top_k"), n.attr("capacity", 0)),
    "moe_dispatch": lambda a, n: dispatch(a[0], a[1], n.attr("capacity"), n.attr("weighted", False)),
    "moe_combine": lambda a, n: combine(a[0], a[1], n.attr("weighted", True)),
    "moe_combine_grad_c": lambda a, n: combine_grad_c(a[0], a[1], a[2]),
}


def ragged_all_to_all(xs, node, sent: dict, group) -> list:
    """The ``all_to_all{ragged=true}`` of one group, as program.py's ``all_to_all_ragged``
    runs it: chunk j of ``dim`` of each rank's value goes to rank j, but only its nonzero rows
    (along the last dim) travel, after a one-byte-per-row mask of them (the split sizes); the
    receiver zero-fills the rest and concatenates along ``src_dim``. Adds to ``sent[rank]``
    the bytes each rank of ``group`` sends to the others (mask and rows)."""
    n, dim, src = len(xs), node.attr("dim"), node.attr("src_dim")
    got = [[None] * n for _ in range(n)]
    for i, x in enumerate(xs):
        for j, chunk in enumerate(np.split(x, n, axis=dim)):
            rows = chunk.reshape(-1, chunk.shape[-1]) if chunk.ndim else chunk.reshape(1, 1)
            mask = np.any(rows != 0, axis=1)
            packed = rows[mask]
            back = np.zeros_like(rows)
            back[mask] = packed
            got[j][i] = back.reshape(chunk.shape)
            if j != i:
                sent[group[i]] = sent.get(group[i], 0) + int(packed.nbytes) + int(mask.size)
    return [np.concatenate(parts, axis=src) for parts in got]
