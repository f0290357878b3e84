"""The pass ``group-updates``: each group of per-parameter optimizer updates that one
multi-tensor call can run (:func:`parcomp.ir.update_groups.update_groups`: AdamW, SGD with the
same hyperparameters and dtype) made contiguous, so an emitter prints the group as one call
(torch's ``_fused_adamw_`` / ``_fused_sgd_``, torch.optim's fused kernels).

The group's nodes move to where its last one was (every gradient it reads is there by then),
in their order; a node between them that reads one of them (ZeRO's all_gather of an updated
shard) moves after them. A group that cannot move so (one of its nodes reads a value that
reads another of its nodes) is left as it is. Only the order changes: the values and the
reference interpreter's numbers are the same. It runs after ``overlap-collectives`` (each
gradient's ``wait`` stays before the group, not inside it) and before ``in-place`` and
``free-dead``, so buffer reuse and ``frees`` are decided on the new order.
"""
from __future__ import annotations

from parcomp.ir.graph import Graph
from parcomp.ir.update_groups import update_groups


def group_updates(graph: Graph) -> Graph:
    """``graph`` with the nodes of each update group next to each other (module docstring)."""
    if not any(n.phase == "optimizer" for n in graph.nodes):
        return graph
    order = [n.name for n in graph.nodes]
    changed = False
    for units in update_groups(graph):
        got = _gathered(graph, order, {m for u in units for m in u.nodes})
        if got is not None and got != order:
            order, changed = got, True
    if not changed:
        return graph
    return graph.with_nodes([graph[m] for m in order])


def _gathered(graph, order, members) -> list | None:
    """``order`` with ``members`` moved to the last one's place and the nodes between that read
    them after it; None where a member reads such a node."""
    pos = [i for i, m in enumerate(order) if m in members]
    first, last = pos[0], pos[-1]
    if last - first + 1 == len(pos):
        return order
    held, moved = [], []
    later = set()  # members and the nodes between that read them
    for m in order[first:last + 1]:
        reads = graph[m].inputs
        if m in members:
            if any(i in later and i not in members for i in reads):
                return None
            held.append(m)
            later.add(m)
        elif any(i in later for i in reads):
            moved.append(m)
            later.add(m)
    kept = [m for m in order[first:last + 1] if m not in later]
    return order[:first] + kept + held + moved + order[last + 1:]
