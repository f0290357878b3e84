"""localize: global types -> per-rank types (an SPMD program).

Every value's type becomes the shape one rank holds under its layout (even
shards).  Sources keep their full shape in the ``global_shape`` attribute so
an emitter can slice checkpoints and inputs.
"""
from __future__ import annotations


from ..errors import ShardingError
from ..ir.graph import Graph, evolve
from ..ir.types import divisibility_problem, layout_str, local_shape


def localize(graph: Graph) -> Graph:
    """Per-rank types for every node. Raises ShardingError on an uneven shard."""
    out, local = [], {}  # (global type, layout) -> local type: repeated blocks repeat them
    for n in graph.nodes:
        key = (n.type, n.layout)
        ty = local.get(key)
        if ty is None:
            problem = divisibility_problem(n.type, n.layout, graph.mesh)
            if problem:
                raise ShardingError(f"%{n.name} ({n.op}, {n.type}) cannot be laid out as "
                                    f"{layout_str(n.layout)} on mesh {graph.mesh}: {problem}")
            ty = local[key] = n.type.with_shape(local_shape(n.type, n.layout, graph.mesh))
        node = evolve(n, type=ty)
        if n.op in ("input", "param"):
            node = node.with_attrs(global_shape=tuple(n.type.shape))
        out.append(node)
    return graph.with_nodes(out, stage="local")
