"""A warning when the plan gathers whole a parameter the spec splits (docs/design.md, "Memory").

The layout search may all-gather a weight instead of moving activations when the weight is
the smaller of the two (tiny models: a vocab-parallel LM head's [V, H] table against
[B*S, V] logits). The result is still equal to the unsharded model, but the user's
``colwise``/``rowwise`` (or explicit) split of that weight is undone in the forward pass:
every rank holds and computes with the whole weight. That is worth saying.
"""
from __future__ import annotations

from .report import format_bytes

# ops that only view or re-lay their single operand: a gather of their result gathers the param
_VIEWS = ("permute", "reshape", "transpose", "view", "relayout", "expand", "slice", "mask_pad")


def _param_of(graph, name: str):
    """The param node ``name`` views (through :data:`_VIEWS`), or None."""
    node = graph[name] if name in graph else None
    while node is not None and node.op in _VIEWS and node.inputs:
        node = graph[node.inputs[0]]
    return node if node is not None and node.op == "param" else None


def pinned_gather_warnings(sharded, report: dict, cp_axis: str | None = None) -> list:
    """One message per forward all_gather (``report["collectives"]``) of a parameter whose
    split layout a spec rule set (``Node.spec_loc``) in ``sharded``: the parameter, its rule's
    location, the axis, the consumers and the bytes per rank, and how to keep it split.
    ``cp_axis``: the spec's ``context-parallel`` axis; a gather over it is that statement's
    doing (CP keeps weights whole over its axis), not the cost model's, and says so."""
    out = []
    for c in report.get("collectives", ()):
        if c["kind"] != "all_gather" or c["phase"] != "forward":
            continue
        p = _param_of(sharded, c["producer"])
        if p is None or p.spec_loc is None:
            continue
        head = (f"{p.name}: the spec splits it ({p.spec_loc}), but the plan all-gathers it whole "
                f"over {c['axis']} ({format_bytes(c['bytes'])} per rank) for {', '.join(c['consumers'])}: ")
        if c["axis"] == cp_axis:  # userM trial: the old text blamed the cost model
            out.append(head + f"context-parallel over {cp_axis} keeps every weight whole over that axis "
                       f"(each rank holds its own tokens and the whole weights), so this split is undone; "
                       f"split the weight over another mesh axis (e.g. tp) instead")
            continue
        out.append(head + "at these sizes gathering the weight is cheaper in the cost model than moving the "
                   "activations, so every rank holds and multiplies the whole weight; a `memory` "
                   "limit, or an `activation`/`output` rule on its result, keeps it split")
    return out
