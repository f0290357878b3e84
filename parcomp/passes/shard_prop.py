"""shard-prop: choose a layout for every value and a strategy for every op.

Input: a graph whose sources (params, inputs) and ``relayout`` nodes carry the
layouts the spec fixes.  Output: every node has ``layout`` (what it produces)
and ``in_layouts`` (what its op consumes); ``insert-collectives`` turns the
differences into collectives.

Method: a dynamic program in topological order.  ``best[v][O]`` is the least
cost (alpha-beta seconds of redistribution, :mod:`parcomp.redistribute`) of
producing ``v`` natively in layout ``O``; an op's candidate strategies come from
:mod:`parcomp.rules.sharding`; an input is charged its cheapest way to reach the
layout the strategy wants.  A reverse pass then fixes each node's strategy
given the layouts its consumers ask of it.  Exact on trees and chains (checked
against brute-force enumeration in the tests); on DAGs with fan-out a shared
producer is charged once per consumer during the forward pass.
"""
from __future__ import annotations

from dataclasses import replace

from ..errors import ShardingError
from ..ir.graph import Graph, describe
from ..ir.types import layout_str
from ..redistribute import plan_cost
from ..rules.sharding import mesh_strategies

_TOL = 1e-15


def shard_prop(graph: Graph) -> Graph:
    """Complete the layouts of ``graph`` with the least redistribution cost.

    Raises:
        ShardingError: an op has no strategy whose shards are all even (names the
            node and its shapes) or a pinned layout no strategy can produce.
    """
    mesh = graph.mesh
    best, cands = {}, {}
    for n in graph.nodes:
        if n.op in ("input", "param"):
            best[n.name] = {n.layout: 0.0}
            continue
        in_types = [graph[i].type for i in n.inputs]
        options = mesh_strategies(n, in_types, mesh)
        if n.layout is not None:
            options = [o for o in options if o[1] == n.layout]
        if not options:
            raise ShardingError(_no_strategy(graph, n))
        scored = []
        for ins, out in options:
            cost = sum(_cost_to(best, graph, i, lay) for i, lay in zip(n.inputs, ins))
            scored.append((cost, ins, out))
        cands[n.name] = scored
        table = {}
        for cost, _, out in scored:
            if out not in table or cost < table[out] - _TOL:
                table[out] = cost
        best[n.name] = table
    return _reconstruct(graph, best, cands)


def _cost_to(best, graph, name, layout) -> float:
    ty = graph[name].type
    return min(c + plan_cost(o, layout, ty, graph.mesh) for o, c in best[name].items())


def _reconstruct(graph, best, cands) -> Graph:
    required = {n.name: [] for n in graph.nodes}
    chosen = {}
    for n in reversed(graph.nodes):
        if n.op in ("input", "param"):
            chosen[n.name] = n
            continue
        pick, pick_cost = None, None
        for cost, ins, out in cands[n.name]:
            total = cost + sum(plan_cost(out, lay, n.type, graph.mesh) for lay in required[n.name])
            if pick is None or total < pick_cost - _TOL:
                pick, pick_cost = (ins, out), total
        ins, out = pick
        chosen[n.name] = replace(n, layout=out, in_layouts=ins)
        for i, lay in zip(n.inputs, ins):
            required[i].append(lay)
    return graph.with_nodes([chosen[n.name] for n in graph.nodes])


def _no_strategy(graph, n) -> str:
    shapes = ", ".join(f"%{i}: {graph[i].type}" for i in n.inputs)
    mesh = graph.mesh
    pinned = f" producing the pinned layout {layout_str(n.layout)}" if n.layout else ""
    return (f"no sharding strategy for {describe(n)}{pinned} on mesh {mesh}: every way to split "
            f"it leaves an uneven shard (operands {shapes}). Make the dims divisible by the "
            f"mesh axis sizes or replicate the operands.")
