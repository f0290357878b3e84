"""bucket-norm-grads: one all_reduce for all norm-weight gradients of a mesh axis.

Megatron sequence parallel runs the norms on split-seq activations, so every norm weight
and bias gradient (``sum`` over the tokens of ``dy * xhat`` / ``dy``, which the norm VJPs
of ``parcomp/rules/norms.py`` mark ``bucket="norm"``) is a partial sum over tp that needs
its own all_reduce: 2 per LayerNorm, 2 LayerNorms a block. This lowering (run on the local
program, after ``fuse-updates``, before ``overlap-collectives``) replaces the all_reduces of
one axis with the same layouts and dtype by Megatron's bucket
(``_allreduce_layernorm_grads``): flatten and concatenate the partial sums
(``bucket_cat``), all_reduce the one flat buffer, take each gradient back
(``bucket_part``: a view, under the old all_reduce's name, so its users are unchanged).

The bucket sits right after the last of its operands; a member whose result is used before
that point stays on its own. Members must hold no split dim (their local value is then
the global one, so bytes and the interpreter's assembly are those of the flat buffer).
"""
from __future__ import annotations

from dataclasses import replace

from parcomp.ir.graph import Graph
from parcomp.ir.types import Shard, TensorType

BUCKET_KINDS = ("norm",)
#: the name every norm-gradient bucket's ``bucket_cat`` starts with (then its axis)
NORM_BUCKET = "bw.norm_grads."
#: the start of its all_reduce's reason, up to the member count
NORM_REASON = "one all_reduce for "


def _traces_to_norm_grad(graph, name) -> bool:
    """A marked norm-weight gradient, or its reduction over an earlier axis (bucketed or not)."""
    n = graph[name]
    if n.op in ("all_reduce", "bucket_part"):
        return _traces_to_norm_grad(graph, n.inputs[0])
    if n.op == "bucket_cat":
        return all(_traces_to_norm_grad(graph, i) for i in n.inputs)
    return n.attr("bucket") in BUCKET_KINDS


def _members(graph) -> dict:
    """(axis, layouts, dtype) -> all_reduces of norm-weight gradients, in program order."""
    groups = {}
    for n in graph.by_op("all_reduce"):
        src = graph[n.inputs[0]]
        if n.attr("async_op") or not _traces_to_norm_grad(graph, src.name):
            continue
        if any(isinstance(p, Shard) for p in tuple(src.layout) + tuple(n.layout)):
            continue
        groups.setdefault((n.attr("axis"), src.layout, n.layout, n.type.dtype), []).append(n)
    return groups


def _placeable(graph, members) -> list:
    """The members whose results are first used after the last member's operand is computed."""
    pos = {n.name: i for i, n in enumerate(graph.nodes)}
    users = graph.users()
    members = list(members)
    while len(members) > 1:
        last = max(pos[m.inputs[0]] for m in members)
        late = [m for m in members if all(pos[u] > last for u in users[m.name])]
        if len(late) == len(members):
            return members
        members = late
    return members


def _bucket(graph, members) -> Graph:
    pos = {n.name: i for i, n in enumerate(graph.nodes)}
    first, axis = members[0], members[0].attr("axis")
    total = sum(m.type.numel for m in members)
    names = {n.name for n in graph.nodes}
    base = NORM_BUCKET + axis.replace(",", "_")  # a joint group "dp,tp": dp_tp
    cat_name, ar_name = base, f"{base}.all_reduce"
    while cat_name in names or ar_name in names:
        cat_name, ar_name = cat_name + "_", ar_name + "_"
    flat = TensorType((total,), first.type.dtype)
    src = graph[first.inputs[0]]
    cat = replace(first, name=cat_name, op="bucket_cat", inputs=tuple(m.inputs[0] for m in members),
                  type=flat, attrs=(), layout=src.layout, in_layouts=None)
    reason = (f"{NORM_REASON}{len(members)} norm-weight gradients (partial sums over {axis}: "
              f"the norms ran on split activations), flattened into one buffer")
    ar = replace(first, name=ar_name, inputs=(cat_name,), type=flat,
                 attrs=(("axis", axis), ("reason", reason)))
    parts, offset = [], 0
    for m in members:
        parts.append(replace(m, op="bucket_part", inputs=(ar_name,),
                             attrs=(("numel", m.type.numel), ("offset", offset))))
        offset += m.type.numel
    gone = {m.name for m in members}
    last = max(pos[m.inputs[0]] for m in members)
    nodes = []
    for i, n in enumerate(graph.nodes):
        if n.name not in gone:
            nodes.append(n)
        if i == last:
            nodes += [cat, ar] + parts
    return graph.with_nodes(nodes)


def bucket_norm_grads(graph: Graph) -> Graph:
    """Each group of >= 2 norm-weight-gradient all_reduces of one axis as one (docstring)."""
    done = set()
    while True:
        todo = [(k, ms) for k, ms in _members(graph).items() if k not in done]
        if not todo:
            return graph
        key, members = todo[0]
        done.add(key)
        members = _placeable(graph, members)
        if len(members) >= 2:
            graph = _bucket(graph, members)


def bucketed_members(local, name) -> tuple:
    """``(bucket all_reduce, its bucket_part names)`` if collective ``name`` of the sharded
    graph became a part of a bucket in the lowered ``local`` program, else None."""
    if name not in local or local[name].op != "bucket_part":
        return None
    src = local[local[name].inputs[0]]
    ar = local[src.inputs[0]] if src.op == "wait" else src  # started async by overlap-collectives
    return ar, local.memo("bucket.parts", _parts_by_source).get(src.name, ())


def _parts_by_source(local) -> dict:
    """``{source name: its bucket_part names, in program order}`` (one pass over ``local``;
    a part reads exactly one value)."""
    parts = {}
    for n in local.nodes:
        if n.op == "bucket_part" and len(n.inputs) == 1:
            parts.setdefault(n.inputs[0], []).append(n.name)
    return {k: tuple(v) for k, v in parts.items()}
