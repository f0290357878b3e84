"""Sharding rules and VJPs of the attention part.

``sdpa(q, k, v)`` works on ``[batch, heads, seq, head_dim]``; every (batch, head) pair
is independent, so splitting batch or heads on all three operands is exact (Megatron's
tensor-parallel attention splits heads). Its output is linear in ``v`` (``R, R, P -> P``)
and its columns are ``v``'s (``R, R, S(3) -> S(3)``). Without a causal mask, query rows
are independent too (``S(2), R, R -> S(2)``); with one, a rank's rows would need their
global offset, so the query sequence is not split. ``sdpa_grad(dy, q, k, v)`` follows
the same batch/head splits, is linear in ``dy``, and without a mask the gradient of q
follows a query-sequence split while those of k and v become partial sums over it.

The VJP of ``sdpa`` is three ``sdpa_grad`` nodes (q, k, v), each recomputing the
attention probabilities (no extra op or value of the softmax reaches the graph).

Also here: the pointwise ops RoPE's cos/sin tables need (``cos``, ``sin``, ``cast``,
``arange``): their VJPs.
"""
from __future__ import annotations

from ..ir.types import P, R, Shard


def sdpa_strategies(node, ts):
    """Single-axis strategies of ``sdpa(q, k, v)`` (see the module docstring)."""
    out = [((R, R, R), R), ((R, R, P), P), ((R, R, Shard(3)), Shard(3))]
    out += [((Shard(d),) * 3, Shard(d)) for d in (0, 1)]
    if node.attr("cp") == "ring":  # K/V blocks around the ring inside the op
        out.append(((Shard(2),) * 3, Shard(2)))
    elif not node.attr("causal", False) or node.attr("cp"):  # cp: mask at q_start
        out.append(((Shard(2), R, R), Shard(2)))
    return out


def sdpa_grad_strategies(node, ts):
    """Single-axis strategies of ``sdpa_grad(dy, q, k, v)``."""
    out = [((R,) * 4, R), ((P, R, R, R), P)] + [((Shard(d),) * 4, Shard(d)) for d in (0, 1)]
    if node.attr("cp") == "ring":  # dq at its queries, dk/dv returned to their owners
        out.append(((Shard(2),) * 4, Shard(2)))
    elif not node.attr("causal", False) or node.attr("cp"):  # query rows independent: dq split, dk/dv summed over them
        out.append(((Shard(2), Shard(2), R, R), Shard(2) if node.attr("wrt") == "q" else P))
    return out


def _sdpa_vjp(b, n, g):
    attrs = {"causal": n.attr("causal", False), "scale": n.attr("scale")}
    for key in ("window", "cp", "cp_axis", "chunking", "cp_size"):  # context parallel: the grads keep the split too
        if n.attr(key):
            attrs[key] = n.attr(key)
    return tuple(b.op("sdpa_grad", [g, *n.inputs], wrt=w, **attrs) for w in "qkv")


def _float_input(b, x) -> bool:
    return b.type(x).dtype.startswith("float") or b.type(x).dtype.startswith("bfloat")


ATTENTION_STRATEGIES = {"sdpa": sdpa_strategies, "sdpa_grad": sdpa_grad_strategies,
                        "arange": lambda node, ts: [((), R)]}  # values depend on the global index
ATTENTION_VJPS = {
    "sdpa": _sdpa_vjp,
    "cos": lambda b, n, g: (b.op("mul", [g, b.op("neg", [b.op("sin", [n.inputs[0]])])]),),
    "sin": lambda b, n, g: (b.op("mul", [g, b.op("cos", [n.inputs[0]])]),),
    "cast": lambda b, n, g: (b.op("cast", [g], type=b.type(n.inputs[0]))
                             if _float_input(b, n.inputs[0]) else None,),
    "arange": lambda b, n, g: (),
}
