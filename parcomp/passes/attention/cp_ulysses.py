"""``context-parallel lowering=all_to_all``: DeepSpeed-Ulysses attention.

q, k and v arrive split along the sequence over the context-parallel axis (``S(2)`` of
``[batch, heads, seq, head_dim]``, as for every lowering). One all_to_all each turns them into
a heads split (``S(1)``: the whole sequence, heads/cp heads per rank); attention then runs with
the **unsharded** causal mask (each rank holds whole rows of its heads, so no ``q_start`` and
no mark on the sdpa: it keeps its plain heads-split rule); one all_to_all turns the output back
into the sequence split. Every pin is ``relayout {grad=true}``, so backward mirrors it: dO is
exchanged seq -> heads, ``sdpa_grad`` runs on whole sequences of its heads, and dQ/dK/dV are
exchanged heads -> seq. All four exchanges per direction are planned by the ordinary layout
search (``S(2) -> S(1)`` on one axis is one ``all_to_all``, ``parcomp/ir/transitions.py``), so
the interpreter and program.py need nothing new.

Grouped-query attention (the frontend's ``expand`` + ``reshape`` repeat of kv heads):

- kv heads divisible by cp: K/V are exchanged with their kv heads only, before the repeat
  (the repeat then runs locally on the heads split: rank r's q heads need exactly the kv
  heads it holds);
- fewer kv heads than cp ranks (or not divisible): the repeat runs on the sequence split
  (local) and the repeated K/V are exchanged, so every rank receives the kv head its q heads
  need; backward, the copies' gradients come back sequence-split and the repeat's VJP (a sum
  over the copies) adds them locally.

Q heads not divisible by cp is a located :class:`~parcomp.errors.SpecError` at the statement.

With tensor parallel (heads split over tp by colwise projections, ``cp_heads.py``) Ulysses runs
inside each tp group: the heads pins are ``S(1)`` on tp and on cp, tp the outer axis, so a rank's
heads are a sub-block of its tp rank's and each exchange stays within the cp group. A tp axis
after cp in the mesh (the rank would need heads another tp rank holds), or q heads not divisible
by tp x cp, is a located error; kv heads that do not split over tp x cp are repeated first.
"""
from __future__ import annotations

import math
from dataclasses import replace

from parcomp.errors import SpecError
from parcomp.ir.graph import Graph, Node, make_attrs
from parcomp.ir.names import NameGen
from parcomp.ir.types import Shard, divisibility_problem
from .cp_heads import heads_axes, with_heads  # CP x TP: Ulysses inside each tp group

SEQ, HEADS = 2, 1  # dims of sdpa's [batch, heads, seq, head_dim]


def pin_ulysses(graph: Graph, names: set, lay, cp, origin: str, repeat_source) -> Graph:
    """Pin every sdpa in ``names`` for the all_to_all lowering (see the module docstring).

    Args:
        graph: the unsharded graph after bind-layouts' rules.
        names: the sdpa nodes' names.
        lay: the sequence-split layout (``S(2)`` on the CP axis, ``S(0)``/``R`` elsewhere).
        cp: the ContextParallel statement (axis, loc).
        origin: the words every pin's reason starts with.
        repeat_source: ``(graph, operand) -> (consumer, index) | None``, the edge where a GQA
            repeat of kv heads starts (``parcomp.passes.attention.ctxpar._repeat_source``).

    Raises:
        SpecError: at the statement, when an sdpa's heads do not divide by the CP axis size
            (times the tp axes splitting them), or a tp axis splitting them comes after the CP
            axis in the mesh.
    """
    a = graph.mesh.axis_index(cp.axis)
    skip = {i for i, p in enumerate(lay) if isinstance(p, Shard)}  # the CP and batch axes
    order = [n.name for n in graph.nodes if n.name in names]  # graph order: the same names every compile
    tp = {name: heads_axes(graph, graph[name].inputs[0], skip) for name in order}  # q's heads split (CP x TP)
    for name in order:
        _check_order(graph, graph[name], tp[name], a, cp)
        _check_heads(graph, graph[name], _heads(lay, a, tp[name]), cp)
    fresh = NameGen(n.name for n in graph.nodes).fresh
    edges = {}  # (consumer, operand index) -> [(pin name, layout, why)], outermost first
    for name in order:
        seq, heads = with_heads(lay, tp[name]), _heads(lay, a, tp[name])
        for i, (w, operand) in enumerate(zip("qkv", graph[name].inputs)):
            src = repeat_source(graph, operand) if w != "q" else None
            seq_pin = (fresh(f"{name}.cp_{w}"), seq, _SEQ_WHY)
            head_pin = (fresh(f"{name}.cp_{w}_heads"), heads, _HEADS_WHY)
            if src is None:
                edges[(name, i)] = [seq_pin, head_pin]
            elif not _split_before_repeat(graph, src, a, tp[name], skip):  # repeat on the sequence split
                kv = with_heads(lay, heads_axes(graph, graph[src[0]].inputs[src[1]], skip))
                edges[src] = [(seq_pin[0], kv, _SEQ_WHY)]
                edges[(name, i)] = [(fresh(f"{name}.cp_{w}_repeated"), seq, _SEQ_WHY), head_pin]
            else:  # the kv heads split evenly: exchange them before the repeat
                edges[src] = [seq_pin, head_pin]
    outs = {name: [(fresh(f"{name}.cp_out_heads"), _heads(lay, a, tp[name]), _OUT_WHY),
                   (fresh(f"{name}.cp_out"), with_heads(lay, tp[name]), _BACK_WHY)] for name in order}
    return graph.with_nodes(_rewrite(graph, edges, outs, cp, origin),
                            [outs[o][-1][0] if o in outs else o for o in graph.outputs])


_SEQ_WHY = "q/k/v arrive, and their gradients leave, split along the sequence"
_OUT_WHY = "all_to_all lowering: the attention output, and its gradient, heads split"
_HEADS_WHY = "all_to_all lowering: sequence split -> heads split (whole sequence, heads/cp per rank)"
_BACK_WHY = "all_to_all lowering: heads split -> back to the sequence split"


def _rewrite(graph, edges, outs, cp, origin) -> list:
    """The node list with each pin chain on its edge and after each sdpa."""
    last = {name: chain[-1][0] for name, chain in outs.items()}

    def chain(value, ty, pins, src):
        nodes = []
        for pin, lay, why in pins:
            nodes.append(Node(pin, "relayout", (value,), ty, make_attrs(origin=f"{origin} ({why})", grad=True),
                              lay, source=src.source, spec_loc=cp.loc))
            value = pin
        return nodes, value

    nodes = []
    for n in graph.nodes:
        inputs = [last.get(i, i) for i in n.inputs]
        for i, x in enumerate(n.inputs):
            if (n.name, i) in edges:
                made, inputs[i] = chain(inputs[i], graph[x].type, edges[(n.name, i)], n)
                nodes += made
        nodes.append(replace(n, inputs=tuple(inputs)) if inputs != list(n.inputs) else n)
        if n.name in outs:
            nodes += chain(n.name, n.type, outs[n.name], n)[0]
    return nodes


def _heads(lay, a, tp) -> tuple:
    """The heads-split layout: ``S(heads)`` on the CP axis ``a`` and on the tp axes ``tp``."""
    return with_heads(lay, (a, *tp))


def _split_before_repeat(graph, edge, a, tp, skip) -> bool:
    """Whether the kv heads entering the GQA repeat at ``edge`` split evenly over the CP axis
    inside each tp group (they arrive split over the same tp axes as q's heads), so K/V are
    exchanged before the repeat."""
    value = graph[graph[edge[0]].inputs[edge[1]]]
    parts = graph.mesh.sizes[a] * math.prod(graph.mesh.sizes[t] for t in tp)
    return heads_axes(graph, value.name, skip) == tp and value.type.shape[HEADS] % parts == 0


def _check_order(graph, node, tp, a, cp) -> None:
    """A located error when q's heads are split over a tp axis that comes after the CP axis in
    the mesh: a rank's heads would then be block ``cp * tp + t`` of the heads, which its tp group
    does not hold, and the exchange would have to cross tp groups (one axis is outer: first)."""
    late = [graph.mesh.names[t] for t in tp if t > a]
    if late:
        order = " ".join(f"{n}={graph.mesh.sizes[graph.mesh.axis_index(n)]}" for n in (*late, cp.axis))
        raise SpecError(f"context-parallel over {cp.axis} lowering=all_to_all: sdpa %{node.name} "
                        f"(module {node.source or '?'}) has its heads split over {', '.join(late)} "
                        f"(tensor parallel), and Ulysses splits each tp rank's heads further over "
                        f"{cp.axis}, which needs {', '.join(late)} before {cp.axis} in the mesh "
                        f"(write the mesh as '... {order}'), or use lowering=all_gather or ring", cp.loc)


def _check_heads(graph, node, heads, cp) -> None:
    """A located error when sdpa ``node``'s q (and so output) heads do not divide by the axis."""
    for what, ty in (("q", graph[node.inputs[0]].type), ("output", node.type)):
        problem = divisibility_problem(ty, heads, graph.mesh)
        if problem:
            raise SpecError(f"context-parallel over {cp.axis} lowering=all_to_all: sdpa %{node.name} "
                            f"{what} {ty} (module {node.source or '?'}) has {ty.shape[HEADS]} heads, "
                            f"which do not split over the axis: {problem}; use lowering=all_gather",
                            cp.loc)
