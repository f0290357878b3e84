"""``context-parallel``: attention over a sequence split across the ranks of one mesh axis.

The statement (``parcomp/spec/ctxpar.py``) pins, for every ``sdpa``, its q, k and v operands and
its output to ``S(seq)`` (dim 2 of ``[batch, heads, seq, head_dim]``) on the context-parallel
axis, **and their gradients to the same layout** (``relayout {grad=true}``, as
``sequence-parallel`` pins the norms), and marks the ``sdpa`` with ``cp=LOWERING``. The mark
lets the sharding rules keep the query rows of a *causal* ``sdpa`` split
(``parcomp/rules/attention.py``): each rank then computes its rows against the whole K/V, with
the causal mask taken at its global row offset (``q_start``: where its block of q starts,
from the layout, :func:`parcomp.reference.cp_ops.at_rank`; ``COORD`` in program.py). So:

- ``lowering=ring``: the sdpa (and its sdpa_grads) keep q, k, v and the result ``S(seq)``
  (the rule's ``(S(2), S(2), S(2))`` strategy, offered only to a ring-marked sdpa) and pass
  K/V blocks around the ring inside the op: no collective of the search, point-to-point
  shifts listed per node (``parcomp/passes/attention/cp_ring.py``).
- ``lowering=all_gather``: with q and k/v split, the only way to the rule's ``(S(2), R, R)``
  is one all_gather of K and one of V over the axis (forward); backward, ``sdpa_grad`` for k
  and v gives every rank a partial sum over its own queries, and the pin of the gradient to
  ``S(seq)`` turns it into one reduce_scatter each: dK/dV return to the keys' owners.
- ``lowering=all_to_all`` (DeepSpeed-Ulysses): :func:`parcomp.passes.attention.cp_ulysses.pin_ulysses`
  pins seq split -> heads split around each sdpa instead (no mark: whole rows, plain mask).

Positions (RoPE's ``arange``) are replicated and sliced locally where a split value needs them,
so angles come from global positions; the loss is the global sum over the global token count
(``autodiff``), never a mean of per-rank means. On the other mesh axes a pin takes ``S(0)``
where a model input's dim 0 is split over that axis (data parallel), ``S(1)`` (heads) where the
value's heads arrive split by colwise projections (tensor parallel: Megatron's cp x tp,
``parcomp/passes/attention/cp_heads.py``), else ``R``.
"""
from __future__ import annotations

from dataclasses import replace

from parcomp.errors import SpecError
from parcomp.ir.graph import Graph, Node, make_attrs
from parcomp.ir.names import NameGen
from parcomp.ir.types import Replicate, Shard, divisibility_problem, shard_axes
from .cp_balance import mark_balanced
from .cp_heads import heads_axes, with_heads  # CP x TP: heads split over tp
from .cp_ulysses import pin_ulysses  # lowering=all_to_all

SEQ = 2  # the sequence dim of sdpa's [batch, heads, seq, head_dim]


def pin_context_parallel(graph: Graph, spec) -> Graph:
    """Pin every sdpa's q, k, v and output (and their gradients) split along the sequence over
    the CP axis, and mark the sdpa with the lowering.

    Args:
        graph: the unsharded graph after bind-layouts' rules (mesh set).
        spec: the spec; ``spec.context_parallel`` (a ContextParallel) or None (no change).

    Raises:
        SpecError: at the statement, when the model has no sdpa, or a sequence length does not
            divide by the axis size (names the sdpa, its operand and its module).
    """
    cp = getattr(spec, "context_parallel", None)
    if cp is None:
        return graph
    a = graph.mesh.axis_index(cp.axis)
    sdpas = [n for n in graph.nodes if n.op == "sdpa"]
    if not sdpas:
        raise SpecError("context-parallel splits the sequence of attention, but the model has no "
                        "scaled-dot-product attention (sdpa)", cp.loc)
    batch = {ax for n in graph.inputs for ax in shard_axes(n.layout or (), 0)}
    lay = tuple(Shard(SEQ) if i == a else Shard(0) if i in batch else Replicate()
                for i in range(len(graph.mesh.axes)))
    for n in sdpas:
        for what, ty in [("output", n.type)] + [(w, graph[i].type) for w, i in zip("qkv", n.inputs)]:
            problem = divisibility_problem(ty, lay, graph.mesh)
            if problem:
                raise SpecError(f"context-parallel over {cp.axis}: sdpa %{n.name} {what} {ty} "
                                f"(module {n.source or '?'}): {problem}", cp.loc)
    where = f"the spec's context-parallel at {cp.loc.file.rsplit('/', 1)[-1]}:{cp.loc.line}"
    if cp.lowering == "all_to_all":  # DeepSpeed-Ulysses: seq split <-> heads split (cp_ulysses.py)
        return pin_ulysses(graph, {n.name for n in sdpas}, lay, cp, where, _repeat_source)
    graph = _pin_all(graph, {n.name for n in sdpas}, lay, cp, where, {a} | batch)
    if cp.chunking == "balanced":  # load-balanced causal chunking: passes/attention/cp_balance.py
        graph = graph.with_nodes(mark_balanced(graph, cp, {graph[n.inputs[0]].type.shape[SEQ] for n in sdpas}),
                                 graph.outputs)
    return graph


def cp_marks(cp) -> dict:
    """The attributes a pinned sdpa gets: ``cp=LOWERING``; the ring lowering (which communicates
    inside the op, parcomp/reference/cp_ring.py) also its axis, ``cp_axis``."""
    return {"cp": cp.lowering, **({"cp_axis": cp.axis} if cp.lowering == "ring" else {})}


def _repeat_source(graph, name):
    """``(consumer, operand)`` of the edge where a GQA repeat of kv heads (``expand`` on a new dim
    + ``reshape``, made by the frontend) starts under sdpa operand ``name``, or None: pinning
    there lets K/V be gathered with their kv heads only, before the copies are made."""
    want, node = graph[name].type.shape, graph[name]
    while node.op in ("reshape", "expand"):
        src = graph[node.inputs[0]]
        s = src.type.shape
        if src.type.rank == 4 and (s[0], s[2], s[3]) == (want[0], want[2], want[3]):
            return node.name, 0
        node = src
    return None


def _pin_all(graph, names, lay, cp, origin, skip):
    """``relayout {grad=true}`` on each pinned sdpa's operands (for that use only: at the start
    of a GQA repeat when there is one) and on its output (for every consumer); the sdpa itself
    gets ``cp=LOWERING``. A pin keeps the heads split on the axes (not in ``skip``: the CP and
    batch axes) where its value's heads arrive split (tensor parallel, ``cp_heads.py``); the
    output pin takes q's."""
    fresh = NameGen(n.name for n in graph.nodes).fresh
    out_of, edges = {}, {}  # sdpa -> (pin, layout); (consumer, operand index) -> (pin, layout)
    for name in [n.name for n in graph.nodes if n.name in names]:  # graph order: stable names
        for i, (w, operand) in enumerate(zip("qkv", graph[name].inputs)):
            edge = (_repeat_source(graph, operand) if w != "q" else None) or (name, i)
            value = graph[edge[0]].inputs[edge[1]]
            edges[edge] = (fresh(f"{name}.cp_{w}"), with_heads(lay, heads_axes(graph, value, skip)))
        out_of[name] = (fresh(f"{name}.cp_out"), edges[(name, 0)][1])

    def relayout(pin, operand, src):
        return Node(pin[0], "relayout", (operand,), graph[operand].type, make_attrs(origin=origin, grad=True),
                    pin[1], source=src.source, spec_loc=cp.loc)

    nodes = []
    for n in graph.nodes:
        n = replace(n, inputs=tuple(out_of[i][0] if i in out_of else i for i in n.inputs)) \
            if any(i in out_of for i in n.inputs) else n
        mine = {i: edges[(n.name, i)] for i in range(len(n.inputs)) if (n.name, i) in edges}
        if mine:
            nodes += [relayout(pin, graph[n.name].inputs[i], n) for i, pin in mine.items()]
            n = replace(n, inputs=tuple(mine[i][0] if i in mine else x for i, x in enumerate(n.inputs)))
        if n.name in names:
            nodes += [n.with_attrs(**cp_marks(cp)), relayout(out_of[n.name], n.name, n)]
        else:
            nodes.append(n)
    return graph.with_nodes(nodes, [out_of[o][0] if o in out_of else o for o in graph.outputs])
