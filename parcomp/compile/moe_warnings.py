"""A warning when an MoE layer's tokens reach their experts by gathers, not all_to_all.

With the experts split over a mesh axis (``experts.* ep=S(0)``) and nothing pinning the slot
buffers, the layout search may gather every token onto every rank (all_gather of the tokens,
each rank running its own experts on every token, a reduce_scatter of dx: Megatron's
"allgather dispatcher") rather than expert parallel's all_to_all of the slot buffer: at toy
sizes the gather is cheaper in the cost model than the padded all_to_all (docs/design/moe.md,
"Expert parallel MoE"). The program still equals the unsharded model, but a user who split the
experts expects the all_to_all, so the plan says what it did and which pins give the
all_to_all (``specs/moe_ep2_train.pcs``).
"""
from __future__ import annotations

from ..ir.types import Shard

#: ops that only view or re-lay their operand between the dispatch and the experts' matmuls
_VIEWS = ("permute", "reshape", "transpose", "view")


def _last_view(graph, name: str) -> str:
    """The last of the single-consumer views that follow ``name`` in ``graph`` (``name`` if none)."""
    users = graph.users()
    while len(users.get(name, ())) == 1 and graph[users[name][0]].op in _VIEWS:
        name = users[name][0]
    return name


def _gathered_over(sharded, value: str, split_axes: set) -> list:
    """The names of the mesh axes (indices ``split_axes``) an all_gather producing ``value`` gathers over."""
    node = sharded[value] if value in sharded else None
    if node is None or node.op != "all_gather":
        return []
    return [sharded.mesh.names[a] for a in sharded.mesh.axes_of(node.attr("axis")) if a in split_axes]


def moe_gather_warnings(unsharded, sharded) -> list:
    """One message per ``moe_dispatch`` of ``sharded`` whose experts are split over a mesh
    axis (its slot buffer ``[B, E, C, H]`` is ``S(1)`` there) while its tokens arrive by an
    all_gather over that axis: the axis, and the three ``activation`` pins (dispatch output,
    the experts' view of it, the experts' output before combine) that give the all_to_all.
    ``unsharded``: the model's graph (for the pins' names)."""
    out = []
    for d in sharded.by_op("moe_dispatch"):
        experts_split = {a for a, p in enumerate(d.layout) if p == Shard(1)}
        axes = _gathered_over(sharded, d.inputs[0], experts_split)
        if not axes or d.name not in unsharded:
            continue
        combines = [n for n in unsharded.by_op("moe_combine") if n.inputs[1] == unsharded[d.name].inputs[1]]
        pins = [d.name, _last_view(unsharded, d.name)] + [c.inputs[0] for c in combines[:1]]
        a = axes[0]
        pin_text = ", ".join(f"`activation {p} {a}=S(0)`" for p in dict.fromkeys(pins))
        out.append(f"MoE layer %{d.name}: its experts are split over {a}, but the plan moves the tokens "
                   f"by all_gather over {a} (every rank runs its own experts on every token), not by "
                   f"expert parallel's all_to_all: at these sizes gathering is cheaper in the cost "
                   f"model than the padded slot buffer; for the all_to_all, pin the slot buffers: "
                   f"{pin_text} (as specs/moe_ep2_train.pcs does)")
    return out
