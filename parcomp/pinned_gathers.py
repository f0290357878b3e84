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


def pinned_gather_warnings(sharded, report: dict) -> list:
    """One message per forward all_gather (``report["collectives"]``) of a parameter whose
    split layout a spec rule set (``Node.spec_loc``) in ``sharded``: the parameter, its rule's
    location, the axis, the consumers and the bytes per rank, and how to keep it split."""
    out = []
    for c in report.get("collectives", ()):
        if c["kind"] != "all_gather" or c["phase"] != "forward":
            continue
        p = _param_of(sharded, c["producer"])
        if p is None or p.spec_loc is None:
            continue
        out.append(f"{p.name}: the spec splits it ({p.spec_loc}), but the plan all-gathers it whole "
                   f"over {c['axis']} ({format_bytes(c['bytes'])} per rank) for {', '.join(c['consumers'])}: "
                   f"at these sizes gathering the weight is cheaper in the cost model than moving the "
                   f"activations, so every rank holds and multiplies the whole weight; a `memory` "
                   f"limit, or an `activation`/`output` rule on its result, keeps it split")
    return out
