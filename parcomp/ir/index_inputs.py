"""The graph inputs whose values index a table: token ids of an embedding lookup and the labels
of a cross-entropy. An id outside the table makes torch raise (IndexError, "Target out of
bounds") while a vocab-split lookup returns zero rows; program.py and the numpy check refuse
such inputs instead (docs/design/backends.md, "Out-of-range token ids and labels").

:func:`index_inputs` follows each integer input through the ops that move values without
changing them (views, slices, padding, collectives) to the lookups that read it.
"""
from __future__ import annotations

# ops whose first input's values reach the output unchanged (moved, copied, padded)
MOVES = frozenset({"reshape", "permute", "slice", "expand", "pad", "cat", "relayout", "all_gather",
                   "shard_slice", "wait", "all_to_all", "cast"})
INT_DTYPES = ("int64", "int32")


def global_shape(graph, node) -> tuple:
    """``node``'s whole (unsharded) shape: its ``global_shape`` attr, else its type's shape
    times the mesh sizes of the axes its layout splits."""
    if node.attr("global_shape") is not None:
        return tuple(node.attr("global_shape"))
    shape = list(node.type.shape)
    for a, p in enumerate(node.layout or ()):
        if hasattr(p, "dim") and graph.mesh is not None:
            shape[p.dim] *= graph.mesh.sizes[a]
    return tuple(shape)


def _table_rows(graph, name) -> int:
    """The rows of the embedding table behind value ``name`` (the stored rows of a table
    padded for a vocab split)."""
    node = graph[name]
    while node.op in MOVES and node.inputs:
        node = graph[node.inputs[0]]
    stored = node.attr("stored_shape")
    return int(stored[0]) if stored else global_shape(graph, node)[0]


def _classes(graph, name) -> int:
    """The classes of the logits behind value ``name``: a vocab pad's real size (``mask_pad``'s
    ``size``) where one is upstream, else the logits' last dim."""
    seen, todo = set(), [name]
    while todo and len(seen) < 64:
        n = graph[todo.pop()]
        if n.name in seen:
            continue
        seen.add(n.name)
        if n.op == "mask_pad":
            return int(n.attr("size"))
        todo += list(n.inputs)
    return global_shape(graph, graph[name])[-1]


def index_inputs(graph) -> dict:
    """``{input name: (size, ignore_index or None, what)}`` for each integer input of ``graph``
    that indexes a table: its values must lie in ``0 .. size - 1`` (or equal ``ignore_index``);
    ``what`` names the lookup ("embedding table wte.weight", "cross-entropy labels")."""
    users, found = graph.users(), {}
    for inp in graph.inputs:
        if inp.type.dtype not in INT_DTYPES:
            continue
        bounds, seen, todo = [], set(), [inp.name]
        while todo:
            v = todo.pop()
            if v in seen:
                continue
            seen.add(v)
            for u in users.get(v, ()):
                n = graph[u]
                if n.op in MOVES and n.inputs and n.inputs[0] == v and n.type.dtype in INT_DTYPES:
                    todo.append(u)
                elif n.op == "embedding" and n.inputs[0] == v:
                    table = graph[n.inputs[1]]
                    while table.op in MOVES and table.inputs:
                        table = graph[table.inputs[0]]
                    bounds.append((_table_rows(graph, n.inputs[1]), None, f"embedding table {table.name}"))
                elif n.op in ("pick", "cross_entropy") and len(n.inputs) > 1 and n.inputs[1] == v:
                    bounds.append((_classes(graph, n.inputs[0]), n.attr("ignore_index", -100),
                                   "cross-entropy labels"))
        if bounds:
            found[inp.name] = min(bounds, key=lambda b: b[0])
    return found
