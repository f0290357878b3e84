"""insert-collectives: make every producer/consumer layout mismatch explicit.

For each operand whose producer layout differs from the layout the consumer's
strategy needs, the redistribution plan (:func:`parcomp.ir.redistribute.plan`)
becomes a chain of collective / local nodes, each carrying ``axis``, ``dim`` and
a ``reason`` a person can read.  A conversion of the same value to the same
layout is made once and shared.  ``relayout`` nodes disappear: their consumers
and the graph outputs use the converted value.
"""
from __future__ import annotations


from ..ir.graph import Graph, Node, evolve, make_attrs
from ..ir.names import NameGen
from ..ir.redistribute import plan
from ..ir.types import Partial, R, Replicate, layout_str


def insert_collectives(graph: Graph) -> Graph:
    """Replace ``in_layouts`` annotations by explicit layout-change nodes."""
    graph = drop_unit_axes(graph)
    st = _State(graph)
    for n in graph.nodes:
        if n.in_layouts is None:  # nothing to convert: the node as it is
            st.out.append(n)
            continue
        new_inputs = tuple(st.convert(i, lay, n) for i, lay in zip(n.inputs, n.in_layouts))
        if n.op == "relayout":
            st.alias[n.name] = new_inputs[0]
            continue
        st.out.append(evolve(n, inputs=new_inputs, in_layouts=None))
    outputs = [st.alias.get(o, o) for o in graph.outputs]
    return graph.with_nodes(st.out, outputs)


def drop_unit_axes(graph: Graph) -> Graph:
    """``graph`` with every placement (``layout`` and ``in_layouts``) on a mesh axis of size 1
    written as ``R``: the same data, and no layout change over that axis is left to plan."""
    unit = {a for a, n in enumerate(graph.mesh.sizes) if n == 1}
    if not unit:
        return graph

    def canon(lay):
        return None if lay is None else tuple(R if a in unit else p for a, p in enumerate(lay))

    return graph.with_nodes(evolve(n, layout=canon(n.layout), in_layouts=None if n.in_layouts is None
                                    else tuple(canon(x) for x in n.in_layouts)) for n in graph.nodes)


class _State:
    def __init__(self, graph):
        self.graph, self.out, self.alias, self.memo = graph, [], {}, {}
        self.names = NameGen(n.name for n in graph.nodes)
        self.types = {n.name: n.type for n in graph.nodes}
        self.layouts = {n.name: n.layout for n in graph.nodes}

    def convert(self, name, target, consumer) -> str:
        name = self.alias.get(name, name)
        if (name, target) in self.memo:
            return self.memo[(name, target)]
        src_node = self.graph[name] if name in self.graph else None
        lay, cur, ty = self.layouts[name], name, self.types[name]
        for step in plan(lay, target, ty.rank):
            names = [self.graph.mesh.names[a] for a in step.axes]
            axis = ",".join(names)  # a joint group: "dp,tp" (redistribute.py)
            new = self.names.fresh(f"{name}.{step.kind}_{'_'.join(names)}")
            attrs = dict(axis=axis, reason=_reason(step, axis, name, src_node, consumer, self.graph))
            if step.dim is not None:
                attrs["dim"] = step.dim
            if step.src_dim is not None:
                attrs["src_dim"] = step.src_dim
            if step.reduce_op != "sum":  # a P(max) (reductions part)
                attrs["reduce_op"] = step.reduce_op
            self.out.append(Node(new, step.kind, (cur,), ty, make_attrs(**attrs), step.after,
                                 phase=src_node.phase if src_node else "forward",
                                 source=src_node.source if src_node else None,
                                 spec_loc=consumer.spec_loc or _cause(self.graph, src_node, step.axis)))
            self.types[new], self.layouts[new] = ty, step.after
            cur = new
        self.memo[(name, target)] = cur
        return cur


def _who(consumer) -> str:
    if consumer.op == "relayout":
        return consumer.attr("origin", f"the spec's layout for %{consumer.name}")
    return f"{consumer.op} %{consumer.name}"


def _cause(graph, node, a):
    """The spec rule behind ``node``'s layout on mesh axis ``a``: the nearest node at or
    before it (operands first, in order) with a rule's location and not replicated on ``a``."""
    seen, frontier = set(), [node] if node is not None else []
    while frontier:
        n = frontier.pop(0)
        if n.spec_loc is not None and n.layout is not None and not isinstance(n.layout[a], Replicate):
            return n.spec_loc
        for i in n.inputs:
            if i not in seen:
                seen.add(i)
                frontier.append(graph[i])
    return None


def _partial_origin(graph, node, a):
    """Follow partial-sum operands back to the op that created the partial sum."""
    while node.op not in ("matmul", "input", "param") and node.in_layouts is not None:
        nxt = [graph[i] for i, lay in zip(node.inputs, node.in_layouts)  # not a value made partial
               if isinstance(lay[a], Partial) and isinstance((graph[i].layout or lay)[a], Partial)]
        if not nxt:
            break
        node = nxt[0]
    return node


def _why_partial(src_node, axis) -> str:
    if src_node is None:
        return "partial sums"
    if src_node.op == "matmul":
        return f"its matmul contracts a dim split over {axis} (row-parallel), so each rank holds a partial sum"
    if src_node.op in ("input", "param"):
        return f"the spec declares it partial-sum over {axis}"
    if src_node.op == "sum":  # reductions part
        return f"its sum runs over a dim split over {axis}, so each rank holds a partial sum"
    if src_node.op == "pick":
        return f"only the rank of {axis} holding the picked column has it (the others hold 0)"
    return f"{src_node.op} of partial sums over {axis} is a partial sum"


def _reason(step, axis, name, src_node, consumer, graph) -> str:
    who, tgt = _who(consumer), layout_str(step.after)
    if src_node is not None and step.kind in ("all_reduce", "reduce_scatter"):
        origin = _partial_origin(graph, src_node, step.axis)
        if origin is not src_node:
            src_node = origin
            name = f"{name} (partial since %{origin.name})"
    if step.kind == "all_reduce" and step.reduce_op == "max":
        return (f"%{name}: each rank holds the max of its chunk over {axis} (P(max)); {who} needs "
                f"the full value {tgt}: take the max once (never summed)")
    if step.kind == "all_reduce":
        return f"%{name}: {_why_partial(src_node, axis)}; {who} needs the full value {tgt}: sum once"
    if step.kind == "reduce_scatter":
        return (f"%{name}: {_why_partial(src_node, axis)}; {who} needs it split along dim "
                f"{step.dim} {tgt}: sum and split in one step")
    if step.kind == "all_gather":
        return (f"%{name} is split along dim {step.dim} over {axis}; {who} needs that dim whole "
                f"{tgt}: concatenate the shards (never sum)")
    if step.kind == "all_to_all":
        return (f"%{name} is split along dim {step.src_dim} over {axis}; {who} needs it split "
                f"along dim {step.dim} instead {tgt}: exchange chunks")
    if step.kind == "shard_slice":
        return f"%{name} is whole on each rank of {axis}; {who} needs dim {step.dim} split: keep own chunk"
    if step.kind == "partial_mask" and step.reduce_op == "max":
        return f"{who} takes %{name} as a partial max over {axis}: every rank keeps it (max(x, x) = x)"
    if step.kind == "partial_mask":
        return (f"{who} adds %{name} to partial sums over {axis}: keep it on coordinate 0 and "
                f"zeros elsewhere, so it is counted once")
    raise ValueError(step.kind)

