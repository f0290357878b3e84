"""A warning when the plan gathers whole a parameter the spec splits (docs/design/cost.md, "Memory").

The layout search may all-gather a weight instead of moving activations when the weight is
the smaller of the two (tiny models: a vocab-parallel LM head's [V, H] table against
[B*S, V] logits). The result is still equal to the unsharded model, but the user's
``colwise``/``rowwise`` (or explicit) split of that weight is undone in the forward pass:
every rank holds and computes with the whole weight. That is worth saying, once per
weight (a tied table gathered for its lookup and for the LM head is one warning), with the
rule that keeps it split where one does:

- a table split on the vocab read by an ``embedding``: ``activation LOOKUP [P]`` pins the
  lookup's result to a partial sum, which only the vocab-parallel lookup makes (Megatron's
  VocabParallelEmbedding: each rank its own rows, one all_reduce); a tied LM head then reads
  the split table too (column-parallel logits: tests/compile/test_pinned_gathers.py). An
  ``output`` rule on the logits does not: the search serves it by slicing gathered logits;
- otherwise an ``activation``/``output`` rule splitting the result keeps the weight split
  only where nothing else (a loss, the next layer) wants that result whole.
"""
from __future__ import annotations

from ..ir.ops import LAYOUT_OPS
from ..ir.types import Partial, Shard, layout_str
from ..units import format_bytes

# ops that only view or re-lay their single operand: a gather of their result gathers the param
_VIEWS = ("permute", "reshape", "transpose", "view", "relayout", "expand", "slice", "mask_pad")


def _param_of(graph, name: str):
    """The param node ``name`` views (through :data:`_VIEWS`), or None."""
    node = graph[name] if name in graph else None
    while node is not None and node.op in _VIEWS and node.inputs:
        node = graph[node.inputs[0]]
    return node if node is not None and node.op == "param" else None


def pinned_gather_warnings(sharded, report: dict, cp_axis: str | None = None) -> list:
    """One message per parameter whose split layout a spec rule set (``Node.spec_loc``) in
    ``sharded`` and that forward all_gathers (``report["collectives"]``) make whole: the
    parameter, its rule's location, the axis, the consumers, the bytes per rank (summed over
    its gathers), and the rule that keeps it split (module docstring).
    ``cp_axis``: the spec's ``context-parallel`` axis; a gather over it is that statement's
    doing (CP keeps weights whole over its axis), not the cost model's, and says so."""
    groups = {}  # (param, axis) -> its forward all_gathers, in program order
    for c in report.get("collectives", ()):
        if c["kind"] != "all_gather" or c["phase"] != "forward":
            continue
        p = _param_of(sharded, c["producer"])
        if p is not None and p.spec_loc is not None:
            groups.setdefault((p.name, c["axis"]), (p, []))[1].append(c)
    return [_message(sharded, p, axis, cs, cp_axis) for (_, axis), (p, cs) in groups.items()]


def _message(sharded, p, axis: str, cs: list, cp_axis) -> str:
    consumers = [u for c in cs for u in c["consumers"]]
    calls = f"{len(cs)} all_gathers, " if len(cs) > 1 else ""
    head = (f"{p.name}: the spec splits it ({p.spec_loc}), but the plan all-gathers it whole "
            f"over {axis} ({calls}{format_bytes(sum(c['bytes'] for c in cs))} per rank) for "
            f"{', '.join(dict.fromkeys(consumers))}: ")
    if axis == cp_axis:  # context parallel keeps weights whole over cp: not the cost model's choice
        return (head + f"context-parallel over {cp_axis} keeps every weight whole over that axis "
                f"(each rank holds its own tokens and the whole weights), so this split is undone; "
                f"split the weight over another mesh axis (e.g. tp) instead")
    why = ("at these sizes gathering the weight is cheaper in the cost model than the exchanges "
           "a split weight needs, so every rank holds and multiplies the whole weight; ")
    lookups = _vocab_lookups(sharded, p, axis, consumers)
    if lookups:
        rules = [f"`activation {name} {lay}`" for name, lay in lookups] + _head_rules(sharded, p, axis)
        return (head + why + "to keep it split, pin the lookup's result to a partial sum and the logits "
                "to the vocab split: " + " with ".join(rules) + " (Megatron's VocabParallelEmbedding: "
                "each rank looks up its own rows, one all_reduce; the tied LM head multiplies its own "
                "rows into its part of the logits). A rule on the logits alone does not keep it split: "
                "the search slices them from logits it computed whole")
    return (head + why + "an `activation`/`output` rule splitting its result keeps it split only where "
            "nothing else (a loss, the next layer) needs that result whole")


def _head_rules(sharded, p, axis: str) -> list:
    """The rules splitting on the vocab (last) dim over ``axis`` the result of each forward
    ``matmul`` reading table ``p`` (through views) as its weight: a tied LM head's logits,
    ``output PUB`` where they are a model output, else ``activation NAME``."""
    a, users = sharded.mesh.names.index(axis), sharded.users()
    outs = {v: pub for pub, v in sharded.named_outputs()}
    frontier, out = [p.name], []
    while frontier:
        cur = frontier.pop()
        for u in users[cur]:
            n = sharded[u]
            if n.phase != "forward":
                continue
            if n.op in _VIEWS or n.op in LAYOUT_OPS:  # the gather itself too
                frontier.append(u)
            elif n.op == "matmul" and n.inputs[1] == cur:
                lay = layout_str(tuple(Shard(n.type.rank - 1) if i == a else q for i, q in enumerate(n.layout)))
                out.append(f"`output {outs[u]} {lay}`" if u in outs else f"`activation {u} {lay}`")
    return list(dict.fromkeys(out))


def _vocab_lookups(sharded, p, axis: str, consumers: list) -> list:
    """``(embedding value, layout with P on axis)`` of the ``embedding`` consumers reading
    table ``p`` split on its rows (dim 0) over ``axis``."""
    a = sharded.mesh.names.index(axis) if axis in sharded.mesh.names else None
    if a is None or p.layout[a] != Shard(0):
        return []
    out = []
    for text in consumers:
        name = text.split("%", 1)[-1]
        node = sharded[name] if name in sharded else None
        if node is not None and node.op == "embedding" and node.phase == "forward":
            lay = tuple(Partial() if i == a else q for i, q in enumerate(node.layout))
            out.append((name, layout_str(lay)))
    return list(dict.fromkeys(out))
