"""Tied weights in the backward's linear-map bounds: a late gradient sum does not block the cuts.

:func:`parcomp.segment_bounds.refine` bounds the backward by exact linear maps between
*cuts*: values through which all of the gradient flows (the residual stream's gradient
between half-blocks). A tied weight (a hand-written GPT's ``head.weight = tok.weight``)
gets two gradient contributions: the LM head's, computed first from the logits'
gradient, and the embedding's, computed last; they are summed by one ``add`` at the end.
The head's contribution is pending over the whole backward, so no residual gradient is a
cut, the whole backward is one segment from the logits' gradient, and its op-by-op part
(the forward values' errors and the roundings, ~130 ops) compounds: on the 2-layer
RMSNorm GPT of tests/test_tied_lm.py the float64 bound of ``blocks.0.ln1.weight.grad``
was 11x its value (untied: 0.2%).

:func:`refine_detached` runs the refinement a second time on a *bounding view* of the
graph in which each such early operand ``p`` of a terminal gradient sum (an ``add`` of the
backward whose users are the optimizer and the step's output only) is read through a
source value ``p@detached`` that holds ``p``'s value and a bound of ``p``: the first
refinement's (on the graph as it is), or where the view bounds ``p`` itself better (``p``
is still computed there, in its own segment), that, in a third run.
Sound: the sum's operand is then a value known to within that bound, which is exactly
what the bound says of ``p``, and ``p`` itself is still computed and bounded in the view.
The view has the same values; only which operands count as seed-dependent changes, so
its cuts are the residual stream's again. Each value keeps the smaller of the two
refinements' bounds (both are bounds). Nothing changes for graphs without such a sum.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .ir.graph import Node

SUFFIX = "@detached"


def _terminal(node, users) -> bool:
    """Whether ``node`` is a gradient sum no other backward op reads (its users: the
    optimizer, and relayouts to the step's outputs that nothing else of the backward reads)."""
    for u in users.get(node.name, ()):
        if u.phase == "backward" and not (u.op == "relayout" and _terminal_view(u, users)):
            return False
    return True


def _terminal_view(node, users) -> bool:
    return all(u.phase != "backward" for u in users.get(node.name, ()))


def early_operands(graph) -> dict:
    """``{sum node name: [operand names]}``: for each terminal gradient sum of the
    backward (``add`` whose users are not backward ops), its backward operands other than
    the one computed last (graph order)."""
    users, pos = {}, {}
    for k, n in enumerate(graph.nodes):
        pos[n.name] = k
        for i in n.inputs:
            users.setdefault(i, []).append(n)
    out = {}
    for n in graph.nodes:
        if n.op != "add" or n.phase != "backward" or not _terminal(n, users):
            continue
        ops = [i for i in n.inputs if graph[i].phase == "backward"]
        if len(ops) > 1:
            last = max(ops, key=pos.get)
            out[n.name] = [i for i in ops if i != last]
    return out


def detached_view(graph, early: dict):
    """The bounding view: ``graph`` with each operand in ``early`` (see :func:`early_operands`)
    of its sum replaced by a ``param`` node ``<operand>@detached`` of the same type (placed
    first). Returns ``(view graph, {alias: operand})``."""
    alias = {p + SUFFIX: p for ps in early.values() for p in ps}
    sources = [Node(a, "param", (), graph[p].type, phase="backward") for a, p in sorted(alias.items())]
    nodes = [replace(n, inputs=tuple(i + SUFFIX if i in early[n.name] else i for i in n.inputs))
             if n.name in early else n for n in graph.nodes]
    return graph.with_nodes([*sources, *nodes]), alias


def refine_detached(refine, graph, env, err, bound_op, graph_rule, *args, **kw) -> dict:
    """``refine(graph, env, err, bound_op, graph_rule, *args, **kw)``
    (:func:`parcomp.segment_bounds.refine`), and where the graph has terminal gradient sums
    with early operands (a tied weight), the elementwise smaller of that and the same
    refinement of :func:`detached_view` (module docstring). Returns ``{value: bound}`` over
    ``err``'s keys; ``err`` is not changed."""
    first = refine(graph, env, err, bound_op, graph_rule, *args, **kw)
    early = early_operands(graph)
    if not early:
        return first
    view, alias = detached_view(graph, early)
    env2 = {**env, **{a: env[p] for a, p in alias.items()}}
    known = {a: _nan_inf(first[p]) for a, p in alias.items()}  # p as the first refinement bounds it
    second = refine(view, env2, {**err, **known}, bound_op, graph_rule, *args, **kw)
    better = {a: np.minimum(b, _nan_inf(second[alias[a]])) for a, b in known.items()}
    if any((better[a] < known[a]).any() for a in alias):  # p refined better in the view: once more
        second = refine(view, env2, {**err, **better}, bound_op, graph_rule, *args, **kw)
    with np.errstate(invalid="ignore"):
        return {k: np.minimum(_nan_inf(v), _nan_inf(second[k])) if k in second else v
                for k, v in first.items()}


def _nan_inf(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return np.where(np.isnan(x), np.inf, x)
