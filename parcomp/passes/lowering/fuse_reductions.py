"""fuse-reductions (lowering, reductions part): the forms of
:mod:`parcomp.passes.decompose` that nothing split become one op again in the local program.

``div(e, expand(sum(e)))`` with ``e = exp(x - expand(amax(x){detach}))`` -> ``softmax(x)``;
``(x - m) - expand(log(sum(exp(x - m))))`` -> ``log_softmax(x)``;
``argmax_index(argmax_key(x))`` -> ``argmax(x)``. Only when every value in between is read by
the form alone (a training program's backward reads them: it stays decomposed) and no
collective sits inside (the operands are the ops' own outputs).
"""
from __future__ import annotations

from dataclasses import replace

from parcomp.ir.graph import Graph, make_attrs


def _match_softmax(g, users, n):
    """``(x, dim, the form's other nodes)`` if ``n`` ends a softmax / log_softmax form."""
    def node(name, op):
        m = g[name] if name in g else None
        return m if m is not None and m.op == op else None

    if n.op == "div":
        ex, sb = node(n.inputs[0], "exp"), node(n.inputs[1], "expand")
        s = node(sb.inputs[0], "sum") if sb else None
        if ex is None or s is None or s.inputs[0] != ex.name:
            return None
        z, group = node(ex.inputs[0], "sub"), [ex, sb, s]
    elif n.op == "sub":
        lb = node(n.inputs[1], "expand")
        lg = node(lb.inputs[0], "log") if lb else None
        s = node(lg.inputs[0], "sum") if lg else None
        ex = node(s.inputs[0], "exp") if s else None
        if ex is None or ex.inputs[0] != n.inputs[0]:
            return None
        z, group = node(n.inputs[0], "sub"), [lb, lg, s, ex]
    else:
        return None
    mb = node(z.inputs[1], "expand") if z else None
    m = node(mb.inputs[0], "amax") if mb else None
    if m is None or not m.attr("detach", False) or m.inputs[0] != z.inputs[0]:
        return None
    dims = tuple(m.attr("dims"))
    if any(tuple(k.attr("dims")) != dims for k in (s, mb) + ((sb,) if n.op == "div" else (lb,))):
        return None
    group += [z, mb, m]
    inside = {k.name for k in group} | {n.name}
    if any(u not in inside for k in group for u in users[k.name]):
        return None
    return m.inputs[0], dims[0], group


def fuse_reductions(graph: Graph) -> Graph:
    """Write the unsplit softmax / log_softmax / argmax forms back as one op each."""
    users = graph.users()
    drop, fused = set(), {}
    for n in graph.nodes:
        if n.op == "argmax_index":
            k = graph[n.inputs[0]]
            if k.op == "argmax_key" and users[k.name] == [n.name] and k.name not in graph.outputs:
                drop.add(k.name)
                fused[n.name] = replace(n, op="argmax", inputs=k.inputs, attrs=make_attrs(dim=k.attr("dim")))
            continue
        found = _match_softmax(graph, users, n)
        if found is None or any(k.name in graph.outputs for k in found[2]):
            continue
        x, dim, group = found
        drop.update(k.name for k in group)
        op = "softmax" if n.op == "div" else "log_softmax"
        fused[n.name] = replace(n, op=op, inputs=(x,), attrs=make_attrs(dim=dim))
    return graph.with_nodes(fused.get(n.name, n) for n in graph.nodes if n.name not in drop)
