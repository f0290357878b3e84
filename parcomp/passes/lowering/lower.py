"""Lowering: the local program rewritten into the op sequence every backend runs.

Pure ``Graph -> Graph`` passes, run after ``localize`` in the order of the one pass list
(:mod:`parcomp.passes.pass_list`, group ``lower``), each verified.  They replace patterns of
the op vocabulary by the lowered ops of :mod:`parcomp.ir.ops` (kind ``lowered``) and
annotate where buffers are reused and freed, so the reference interpreter executes exactly
the statements an emitter prints (one statement per node, plus ``del``):

- ``fuse-matmuls``: ``matmul(a, permute(w){perm=(1, 0)}) [+ b]`` -> ``dense(a, w[, b])`` (F.linear);
  ``add(matmul(a, w), b)`` (2-D, 1-D bias) -> ``addmm(b, a, w)``; ``permute(matmul(a, b))``
  -> ``matmul_t(a, b)`` (the weight gradient comes out in the weight's own layout);
- ``fuse-mse``: ``sum(pow(y - t, 2))`` -> ``mse_sum(y, t)`` and its gradient
  ``pow_grad(expand(dl), y - t)`` -> ``mse_grad(dl, y, t)``;
- ``fuse-updates``: the optimizer's ``p - scale(g)``, ``scale(m) + g``, ``scale(m) + scale(g)``
  -> ``add_scaled`` / ``axpby`` (only nodes of the optimizer phase, ``Node.phase``);
- ``overlap-collectives``: an ``all_reduce``, ``all_gather`` or ``reduce_scatter`` with
  independent work after it becomes ``OP{async_op=true}`` (started as early as its operand
  allows) plus a ``wait`` placed just before the first use (program order otherwise kept:
  deterministic): DDP's and tensor parallel's sums, ZeRO's gradient reduce_scatters during the
  backward and its param all_gathers during the next params' update, sequence parallel's
  gathers and scatters where independent work follows;
- ``in-place``: ``inplace=true`` on an ``all_reduce`` of a fresh buffer, and on an ``add`` or
  update whose first operand (a parameter, optimizer state or a fresh value) nothing reads
  afterwards: the result is written into that operand's buffer, as ``torch.optim`` does
  (and hand-written Megatron's ``y.add_(b)`` after the reduce);
- ``free-dead``: ``frees="a b"`` on the node after which values die (``del a, b``).

:func:`storage_roots` and :func:`peak_bytes` are the liveness model shared by the
interpreter and the report (views and in-place results share their operand's buffer;
parameters and inputs are held by the caller and never freed; temporaries inside one
statement are not counted).
"""
from __future__ import annotations

from dataclasses import replace

from parcomp.ir.graph import Graph, Node, evolve
from parcomp.ir.liveness import IN_PLACE_OPS, MAYBE_VIEW_OPS, SOURCES, broadcast_view, is_view


def _rebuild(graph: Graph, new: dict, maybe_dead: set, order=None) -> Graph:
    """``graph`` with nodes replaced by ``new`` (same names), then the nodes of
    ``maybe_dead`` nobody reads any more removed (repeatedly)."""
    nodes = [new.get(n.name, n) for n in (order or graph.nodes)]
    outs = set(graph.outputs)
    while True:
        used = {i for n in nodes for i in n.inputs}
        keep = [n for n in nodes if n.name in used or n.name in outs or n.name not in maybe_dead]
        if len(keep) == len(nodes):
            return graph.with_nodes(keep)
        nodes = keep


def _lowered(n: Node, op: str, inputs, **attrs) -> Node:
    """``n`` as another op; its phase, source and spec rule stay (dataclasses.replace)."""
    return replace(n, op=op, inputs=tuple(inputs), attrs=tuple(sorted(attrs.items())))


def fuse_matmuls(graph: Graph) -> Graph:
    """``dense``, ``addmm`` and ``matmul_t`` for the matmul patterns (module docstring)."""
    users, outs, new, dead = graph.users(), set(graph.outputs), {}, set()
    for n in graph.by_op("matmul"):
        a, w = (graph[i] for i in n.inputs)
        lin = w.op == "permute" and w.attr("perm") == (1, 0) and a.type.rank >= 1
        if not lin and not (a.type.rank == 2 and w.type.rank == 2):
            continue
        wsrc = w.inputs[0] if lin else w.name
        if lin:
            new[n.name] = _lowered(n, "dense", (a.name, wsrc))
            dead.add(w.name)
        add = graph[users[n.name][0]] if len(users[n.name]) == 1 else None
        if add is not None and add.op == "add" and add.inputs[0] == n.name and n.name not in outs:
            b = graph[add.inputs[1]]
            if b.type.rank == 1 and b.type.shape[0] == n.type.shape[-1] and add.type == n.type:
                new[add.name] = (_lowered(add, "dense", (a.name, wsrc, b.name)) if lin
                                 else _lowered(add, "addmm", (b.name, a.name, w.name)))
                dead.add(n.name)
    for n in graph.by_op("permute"):
        src = graph[n.inputs[0]]
        if (n.attr("perm") == (1, 0) and src.op == "matmul" and src.name not in new
                and len(users[src.name]) == 1 and src.name not in outs and src.type.rank == 2
                and all(graph[i].type.rank == 2 for i in src.inputs)):
            new[n.name] = _lowered(n, "matmul_t", src.inputs)
            dead.add(src.name)
    return _rebuild(graph, new, dead)


def fuse_mse(graph: Graph) -> Graph:
    """``mse_sum`` / ``mse_grad`` for autodiff's mean-squared-error loss and its gradient."""
    users, outs, new, dead = graph.users(), set(graph.outputs), {}, set()
    for p in graph.by_op("pow"):
        d = graph[p.inputs[0]]
        total = graph[users[p.name][0]] if len(users[p.name]) == 1 else None
        if (p.attr("exponent") != 2.0 or d.op != "sub" or total is None or total.op != "sum"
                or tuple(total.attr("dims")) != tuple(range(p.type.rank)) or p.name in outs
                or d.name in outs or graph[d.inputs[0]].type != d.type or graph[d.inputs[1]].type != d.type):
            continue
        grads = [graph[u] for u in users[d.name] if u != p.name]
        if not all(g.op == "pow_grad" and g.inputs[1] == d.name and g.attr("exponent") == 2.0 for g in grads):
            continue
        new[total.name] = _lowered(total, "mse_sum", d.inputs)
        dead |= {p.name, d.name}
        for g in grads:
            dl = graph[g.inputs[0]]
            if dl.op == "expand" and graph[dl.inputs[0]].type.rank == 0:
                dead.add(dl.name)
                dl = graph[dl.inputs[0]]
            new[g.name] = _lowered(g, "mse_grad", (dl.name,) + d.inputs)
    return _rebuild(graph, new, dead)


def fuse_updates(graph: Graph) -> Graph:
    """``add_scaled`` / ``axpby`` for the optimizer phase's scaled additions."""
    users, outs, new, dead = graph.users(), set(graph.outputs), {}, set()

    def scaled(name, n):
        s = graph[name]
        ok = s.op == "scale" and users[name] == [n.name] and name not in outs and s.type == n.type
        return s if ok else None

    for n in graph.nodes:
        if n.op not in ("add", "sub") or n.phase != "optimizer":
            continue
        if any(graph[i].type != n.type for i in n.inputs):
            continue
        (x, y), (sx, sy) = n.inputs, (scaled(i, n) for i in n.inputs)
        sign = 1.0 if n.op == "add" else -1.0
        if sx is not None and n.op == "add":
            a = float(sx.attr("value"))
            yy, b = (sy.inputs[0], float(sy.attr("value"))) if sy is not None else (y, 1.0)
            new[n.name] = _lowered(n, "axpby", (sx.inputs[0], yy), a=a, b=b)
        elif sx is None and sy is not None:
            new[n.name] = _lowered(n, "add_scaled", (x, sy.inputs[0]), b=sign * float(sy.attr("value")))
        else:
            continue
        dead |= {s.name for s in (sx, sy) if s is not None}
    return _rebuild(graph, new, dead)


# the collectives overlap-collectives starts early: the dp and tp sums, sequence parallel's
# and ZeRO's gathers (the next bucket's params gathered while the update goes on), the
# reduce_scatters of sequence parallel and of ZeRO's gradients
OVERLAPPED = ("all_reduce", "all_gather", "reduce_scatter")


def overlap_collectives(graph: Graph) -> Graph:
    """Start each collective of :data:`OVERLAPPED` right after its operand (and every other
    reader of it) and wait for it just before its first use, when independent nodes lie in
    between."""
    users, outs = graph.users(), set(graph.outputs)
    order, waits = [n.name for n in graph.nodes], {}
    for n in [m for m in graph.nodes if m.op in OVERLAPPED]:
        rest = order.copy()
        rest.remove(n.name)  # names are unique: order without n
        x = waits.get(n.inputs[0], n.inputs[0])
        after = max(rest.index(m) for m in [x] + [u for u in users[x] if u != n.name])
        later = [rest.index(u) for u in users[n.name]]
        first = min(later) if later else len(rest)
        between = [m for m in rest[after + 1:first] if m in graph and graph[m].op not in SOURCES]
        if n.attr("async_op") or not between or (not later and n.name not in outs):
            continue
        waits[n.name] = f"{n.name}.wait"
        users[waits[n.name]], users[n.name] = users[n.name], [waits[n.name]]
        order = rest[:after + 1] + [n.name] + rest[after + 1:first] + [waits[n.name]] + rest[first:]
    if not waits:
        return graph
    # a node reading no waited value is kept as it is (the verifier's memo then skips it)
    nodes = {n.name: evolve(n, inputs=tuple(waits.get(i, i) for i in n.inputs))
             if any(i in waits for i in n.inputs) else n for n in graph.nodes}
    for name, wait in waits.items():
        nodes[name] = nodes[name].with_attrs(async_op=True)
        nodes[wait] = replace(nodes[name], name=wait, op="wait", inputs=(name,), attrs=())
    return graph.with_nodes([nodes[m] for m in order], outputs=[waits.get(o, o) for o in graph.outputs])


def _same_tensor(done, x, root) -> bool:
    """Is ``x`` the tensor ``root`` itself: ``root``, or reached from it through in-place
    updates only (``a.add_(b)`` returns ``a``: the same shape, strides and buffer), no view?
    ``done``: the nodes before the one asking, as the in-place pass rewrote them."""
    while x != root:
        n = done[x]
        if n.op not in IN_PLACE_OPS or not n.attr("inplace") or n.attr("async_op"):  # async: a handle
            return False
        x = n.inputs[0]
    return True


def _mutable(graph, n, roots, pos, users, outs, members, done) -> bool:
    """May ``n`` write into its first operand's buffer? Nothing reads the buffer after ``n``,
    no output lives in it, no other operand shares it, and it is the optimizer's own
    (a param or state updated in the optimizer phase) or a fresh contiguous value."""
    x = n.inputs[0]
    r = roots[x]
    src = graph[r]
    if graph[x].type != n.type or any(roots[i] == r for i in n.inputs[1:]) or broadcast_view(graph, x, r):
        return False
    if src.op == "input" or src.op in MAYBE_VIEW_OPS or (src.op == "param" and n.phase != "optimizer"):
        return False
    if n.op == "all_reduce" and (not _same_tensor(done, x, r) or src.op in SOURCES):  # a fresh contiguous buffer
        return False
    sharing = members[r]  # the values before n living in r's buffer
    if any(v in outs for v in sharing):
        return False
    return all(pos[u] < pos[n.name] for v in sharing for u in users[v] if u != n.name)


def in_place(graph: Graph) -> Graph:
    """``inplace=true`` on every collective and update that may reuse its operand's buffer."""
    outs, pos = set(graph.outputs), {n.name: i for i, n in enumerate(graph.nodes)}
    users, nodes, roots = graph.users(), [], {}  # roots: of the nodes before n (a later
    members, done = {}, {}                          # alias reads the buffer after n anyway)
    for n in graph.nodes:
        if n.op in IN_PLACE_OPS and not n.attr("inplace") and _mutable(graph, n, roots, pos, users, outs,
                                                                        members, done):
            n = n.with_attrs(inplace=True)
        roots[n.name] = roots[n.inputs[0]] if n.inputs and is_view(n) else n.name
        members.setdefault(roots[n.name], []).append(n.name)
        nodes.append(n)
        done[n.name] = n
    return graph.with_nodes(nodes)


def free_dead(graph: Graph) -> Graph:
    """``frees`` on each node: the non-source, non-output values whose last reader it is."""
    outs, last = set(graph.outputs), {}
    for n in graph.nodes:
        last[n.name] = n.name
        for i in n.inputs:
            last[i] = n.name
    dies = {}
    for n in graph.nodes:
        if n.op not in SOURCES and n.name not in outs:
            dies.setdefault(last[n.name], []).append(n.name)
    return graph.with_nodes([n.with_attrs(frees=" ".join(dies[n.name])) if n.name in dies else n
                             for n in graph.nodes])
