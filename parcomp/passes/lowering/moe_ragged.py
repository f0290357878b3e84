"""``moe-ragged``: the all_to_all of an expert-parallel MoE sends only what routing filled.

A dispatch buffer ``[B, E, C, H]`` (parcomp/reference/moe_ops.py) holds C slots per expert per
row, and routing fills only some: the rest are zero rows, as are the experts' outputs of them
(``silu(0) * 0 = 0``). An ``all_to_all`` on a value between a ``moe_dispatch`` and a
``moe_combine`` (the tokens to their experts and back, forward and backward) gets
``ragged=true``: each rank first exchanges which rows of each chunk are nonzero (the per-rank
split sizes, one byte per row), then sends only those rows (``all_to_all_single`` with split
sizes); the receiver puts them back into zeros. The result equals the dense all_to_all's for
any value (a zero row arrives as +0.0), so this is a lowering, not a layout change; what it changes is the bytes: those of the routed
tokens, which the interpreter logs per rank (``sent_bytes``) and report.json's ``bytes`` bounds.
"""
from __future__ import annotations

from dataclasses import replace

from parcomp.ir.graph import Graph


def _reach(graph: Graph, starts, forward: bool) -> set:
    users = {}
    for n in graph.nodes:
        for i in n.inputs:
            users.setdefault(i, []).append(n.name)
    seen, todo = set(), list(starts)
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        todo += users.get(v, []) if forward else list(graph[v].inputs)
    return seen


def moe_ragged(graph: Graph) -> Graph:
    """Mark ``ragged=true`` every all_to_all downstream of a moe_dispatch and upstream of a
    moe_combine (a graph without both is returned unchanged)."""
    after = _reach(graph, [n.name for n in graph.nodes if n.op == "moe_dispatch"], True)
    before = _reach(graph, [n.name for n in graph.nodes if n.op == "moe_combine"], False)
    marked = {n.name for n in graph.nodes if n.op == "all_to_all" and n.name in after & before}
    if not marked:
        return graph
    nodes = tuple(n.with_attrs(ragged=True) if n.name in marked else n for n in graph.nodes)
    return replace(graph, nodes=nodes)
