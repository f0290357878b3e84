"""Where the ranks of a spec's mesh sit on the nodes of its ``topology``, and whether TP fits.

``topology nodes=N devices_per_node=D`` says the job runs as N nodes of D
devices, started with ``torchrun --nnodes N --nproc-per-node D``.  torchrun
gives every node a contiguous block of D global ranks, so rank ``r`` runs on
node ``r // D`` (under a c10d rendezvous the rendezvous decides which machine
is node 0, but the blocks are still contiguous, so which ranks share a machine
is the same).  Ranks are mesh coordinates row-major (the last axis fastest,
:class:`parcomp.ir.types.Mesh`), so an axis's groups stay inside a node when
the axis and every axis after it fit in one node.

Tensor parallelism all-reduces activations in every layer and must use the
intra-node links: a ``tp`` group that spans nodes is a :class:`SpecError`.
"""
from __future__ import annotations

from ..errors import SpecError

__all__ = ["check_topology"]


def check_topology(spec) -> dict:
    """The placement of ``spec``'s mesh ranks on its topology's nodes; rejects a ``tp`` that spans nodes.

    Args:
        spec: a :class:`parcomp.spec.model.Spec` (``spec.topology`` is
            ``(nodes, devices_per_node)`` or None).

    Returns:
        ``{"nodes": [[ranks of node 0], [ranks of node 1], ...],
        "groups": {axis: [[ranks], ...]} (each mesh axis's groups, as Mesh.groups),
        "intra_node_axes": [axes whose every group is inside one node],
        "cross_node_axes": [axes with a group spanning nodes]}``, axes in mesh order.
        Without a topology, ``nodes`` is None and both axis lists are empty (placement unknown).

    Raises:
        SpecError: a group of mesh axis ``tp`` spans nodes; the message names the group,
            its nodes and the fix, at the ``topology`` statement's location.
    """
    mesh = spec.mesh
    groups = {name: [list(g) for g in mesh.groups(i)] for i, name in enumerate(mesh.names)}
    if spec.topology is None:
        return {"nodes": None, "groups": groups, "intra_node_axes": [], "cross_node_axes": []}
    nodes, per_node = spec.topology
    if nodes * per_node != mesh.size:  # the parser already rejects this
        raise SpecError(f"{spec.file}: topology nodes={nodes} devices_per_node={per_node} has "
                        f"{nodes * per_node} devices but mesh {mesh} has {mesh.size} ranks")
    intra, cross = [], []
    for name, lines in groups.items():
        spanning = next((g for g in lines if len({r // per_node for r in g}) > 1), None)
        (cross if spanning else intra).append(name)
        if spanning and name == "tp":
            raise SpecError(_tp_message(spec, spanning, per_node), getattr(spec, "topology_loc", None))
    return {"nodes": [list(range(n * per_node, (n + 1) * per_node)) for n in range(nodes)],
            "groups": groups, "intra_node_axes": intra, "cross_node_axes": cross}


def _tp_message(spec, group, per_node) -> str:
    mesh, (nodes, _) = spec.mesh, spec.topology
    tp = mesh.axis_index("tp")
    spanned = sorted({r // per_node for r in group})
    inner = 1
    for size in mesh.sizes[tp:]:
        inner *= size
    if mesh.sizes[tp] > per_node:
        fix = f"tp={mesh.sizes[tp]} is larger than devices_per_node={per_node}: make tp <= {per_node}"
    elif inner > per_node:
        after = " ".join(mesh.names[tp + 1:])
        fix = (f"tp and the axes after it ({after}) hold {inner} ranks, more than devices_per_node="
               f"{per_node}: put tp last in the mesh (Megatron orders tp innermost), "
               f"e.g. 'mesh {' '.join(f'{a}={n}' for a, n in mesh.axes if a != 'tp')} tp={mesh.sizes[tp]}'")
    else:
        fix = (f"devices_per_node={per_node} is not a multiple of the {inner} consecutive ranks of "
               f"a tp group's block, so some group straddles a node boundary: make "
               f"devices_per_node a multiple of {inner}")
    return (f"{spec.file}: mesh axis tp group {group} spans nodes "
            f"{', '.join(map(str, spanned))} of topology nodes={nodes} devices_per_node={per_node} "
            f"(rank r runs on node r // {per_node}, as torchrun --nproc-per-node {per_node} "
            f"places it); tensor parallelism must stay inside a node. {fix}")
