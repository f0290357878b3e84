"""Vocab padding: a vocab table split over ranks that do not divide the vocab.

GPT-2's vocab (50257) is odd; Megatron pads the embedding table and the LM head to a
multiple of tp (``--make-vocab-size-divisible-by``) and masks the padded logits. parcomp does
the same, in the pass ``pad-vocab`` (after ``bind-layouts``), for a parameter whose rule splits a
dim the mesh does not divide, when that dim is a vocab:

- the parameter is an ``embedding`` table (the split dim its rows), and/or
- it reaches a matmul as the right operand (through a permute) whose output's last dim is
  the split dim and which is a model output, directly or through the add of a bias ``[V]``
  (the LM head, ``nn.Linear`` with or without a bias, padded with it; a tied table is
  both). An untied LM head counts when its output is logits: in a ``train loss=cross_entropy`` step, or
  when it makes as many classes as an embedding table of the model has rows (the same
  vocab: an untied head at inference, or under the model's own loss, ``loss=output``).
  Any other uneven split stays a located error.

The parameter becomes ``V_pad`` rows (the next multiple of the ranks splitting it), the
padded rows zero: ``stored_shape`` keeps the checkpoint's shape, and every loader (program.py,
the interpreter, the checks' comparisons; see ``fused.to_view_shapes``) pads it on the way in and
trims it on the way out. The LM head's matmul then makes ``V_pad`` logits; ``mask_pad {size=V}``
makes the padded ones the lowest finite number (they never win a max or argmax, their exp is
0, and their gradient is 0, so the padded rows stay 0 under any optimizer), and a ``slice``
back to ``V`` gives the model's logits their own shape under their own name. A training loss
on those logits is taken on the masked, padded ones (autodiff's ``model_output``), so the
cross-entropy stays vocab-parallel. A loss the model computes itself (``loss=output``) is
decomposed before this pass and reads the sliced logits: correct, but the slice of the
split vocab dim gathers them. Ids and labels index the real vocab only.
"""
from __future__ import annotations

from dataclasses import replace

from ..ir.graph import Graph, Node, make_attrs
from ..ir.names import NameGen
from ..ir.types import Shard, TensorType


def pad_vocab_tables(graph: Graph, mesh, layouts: dict, logits_loss: bool = False) -> Graph:
    """``graph`` with every unevenly split vocab table padded (see the module docstring).

    ``layouts`` maps param names to the layouts the spec's rules gave them; a param whose
    split is uneven but that is not a vocab table is left alone (check-even then reports
    the uneven split, as before). ``logits_loss``: the step's loss is a cross-entropy on the
    model output (an untied LM head's output is then logits). An ``S(d)`` naming a dim the
    param does not have is left alone too (bind-layouts reports it at the rule).
    """
    for name, lay in list(layouts.items()):
        node = graph[name]
        if node.op != "param" or node.attr("stored_shape"):
            continue
        for d in sorted({p.dim for p in lay if isinstance(p, Shard) and 0 <= p.dim < node.type.rank}):
            ranks = 1
            for a, p in enumerate(lay):
                if p == Shard(d):
                    ranks *= mesh.sizes[a]
            if node.type.shape[d] % ranks == 0:
                continue
            heads = _vocab_uses(graph, name, d, logits_loss)
            if heads is not None:
                graph = _pad(graph, node, d, -(-node.type.shape[d] // ranks) * ranks, heads)
                break
    return graph


def _vocab_uses(graph, name, d, logits_loss):
    """The LM-head matmuls of table ``name`` split on dim ``d`` (and the permutes on the
    way), or None when it is no vocab table: some use is neither an embedding lookup of rows
    ``d == 0`` nor such a matmul (making a model output, or as many classes as an embedding
    table has rows: a gradient program reads the logits, it does not return them), or it has
    no embedding use and neither has the step a cross-entropy on its output nor has the
    matmul an embedding's vocab."""
    users, heads, embedded, outputs = graph.users(), [], False, set(graph.outputs)
    for u in users[name]:
        n = graph[u]
        if n.op == "embedding" and n.inputs[1] == name and d == 0:
            embedded = True
            continue
        if n.op == "permute" and n.type.rank == 2:
            dim = list(n.attr("perm")).index(d)
            mms = [graph[m] for m in users[u]]
            ends = [_head_end(graph, users, m, outputs) for m in mms if m.op == "matmul" and m.inputs[1] == u]
            if dim == 1 and mms and len(ends) == len(mms) and all(
                    _is_output(graph, users, e, outputs) or _logits(graph, m) for m, e in zip(mms, ends)):
                heads.append((n, list(zip(mms, ends))))
                continue
        return None
    logits = heads and (logits_loss or any(_logits(graph, m) for _, ms in heads for m, _ in ms))
    return heads if embedded or logits else None


def _logits(graph, mm) -> bool:
    """Whether matmul ``mm`` makes logits: as many classes as an embedding table has rows."""
    v = mm.type.shape[-1]
    return any(n.op == "embedding" and _rows(graph[n.inputs[1]]) == v for n in graph.nodes)


def _rows(table) -> int:
    """The rows of an embedding table, as the checkpoint has them (before any padding)."""
    return (table.attr("stored_shape") or table.type.shape)[0]


def _is_output(graph, users, node, outputs) -> bool:
    """Whether ``node`` is a model output (directly or through the output's relayout)."""
    return node.name in outputs or any(graph[u].op == "relayout" and u in outputs for u in users[node.name])


def _head_end(graph, users, mm, outputs):
    """The node that ends head matmul ``mm``: the ``add`` of its bias (a param ``[V]``,
    ``nn.Linear(bias=True)``) when only that add reads ``mm`` (and ``mm`` is no output), else ``mm``."""
    if _is_output(graph, users, mm, outputs) or len(users[mm.name]) != 1 or graph[users[mm.name][0]].op != "add":
        return mm
    add = graph[users[mm.name][0]]
    bias = [graph[i] for i in add.inputs if i != mm.name]
    ok = len(bias) == 1 and bias[0].op == "param" and bias[0].type.shape == mm.type.shape[-1:]
    return add if ok and add.type == mm.type else mm


def _pad(graph, node, d, vp, heads):
    """Pad ``node`` to ``vp`` rows on dim ``d``; each head (its matmul, or the add of its bias,
    padded too) gets mask_pad + slice."""
    v, fresh = node.type.shape[d], NameGen(n.name for n in graph.nodes).fresh
    shape = list(node.type.shape)
    shape[d] = vp
    new = {node.name: replace(node, type=TensorType(tuple(shape), node.type.dtype),
                              attrs=make_attrs(**dict(node.attrs), stored_shape=tuple(node.type.shape)))}
    after = {}
    for perm, mms in heads:
        pshape = list(perm.type.shape)
        pshape[1] = vp
        new[perm.name] = replace(perm, type=TensorType(tuple(pshape), perm.type.dtype))
        for mm, end in mms:
            padded, masked = fresh(f"{end.name}.padded"), fresh(f"{end.name}.masked")
            last = mm.type.rank - 1
            ty = TensorType(mm.type.shape[:-1] + (vp,), mm.type.dtype)
            if end is not mm:  # the bias add: the matmul and the bias [V] are padded too
                new[mm.name] = replace(mm, type=ty)
                bias = graph[next(i for i in end.inputs if i != mm.name)]
                new[bias.name] = replace(bias, type=TensorType((vp,), bias.type.dtype),
                                         attrs=make_attrs(**dict(bias.attrs), stored_shape=bias.type.shape))
            new[end.name] = replace(end, name=padded, type=ty)
            after[end.name] = [Node(masked, "mask_pad", (padded,), ty, make_attrs(size=v), source=end.source),
                               Node(end.name, "slice", (masked,), end.type,
                                    make_attrs(dim=last, start=0, stop=v, step=1), source=end.source)]
    nodes = []
    for n in graph.nodes:
        nodes.append(new.get(n.name, n))
        nodes += after.get(n.name, [])
    return graph.with_nodes(nodes)


def padded_logits(graph, value):
    """The masked, padded logits behind ``value`` when it is the slice this pass made (a
    loss is taken on those: vocab-parallel), else ``value``."""
    n = graph[value]
    if n.op == "slice" and graph[n.inputs[0]].op == "mask_pad" and n.inputs[0].endswith(".masked"):
        return n.inputs[0]
    return value
