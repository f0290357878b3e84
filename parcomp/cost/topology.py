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

Everything here is arithmetic on the axis sizes: nothing enumerates the ranks
of the mesh, so a check costs the same on 2 ranks as on a million.  An axis of
size ``n`` whose later axes hold ``s`` ranks (its *stride*) has groups
``{b + k*s : k < n}`` inside blocks of ``n*s`` consecutive ranks; every such
group stays inside a node exactly when ``n == 1`` or ``n*s`` divides
``devices_per_node`` (any node boundary inside a block cuts some group).
"""
from __future__ import annotations

import itertools
import math

from ..errors import SpecError
from ..units import plural

__all__ = ["check_topology", "axis_groups", "joint_groups", "group_ranks"]


def axis_groups(mesh, axis: int) -> dict:
    """How the ranks of mesh axis ``axis`` form groups, without listing them.

    Returns:
        ``{"size": n, "stride": s, "count": world // n}``: each of the ``count``
        groups holds ``n`` ranks ``b, b + s, ..., b + (n-1)s``, where ``b`` runs
        over the ranks whose coordinate on ``axis`` is 0, in rank order (the
        order of :meth:`parcomp.ir.types.Mesh.groups`).
    """
    n = mesh.sizes[axis]
    return {"size": n, "stride": math.prod(mesh.sizes[axis + 1:]), "count": mesh.size // n}


def joint_groups(mesh, axes: tuple) -> dict:
    """How the ranks of a joint group of mesh axes ``axes`` (indices, mesh order) form groups:
    ``{"size": n, "count": world // n, "axes": [[size, stride], ...]}`` (one pair per axis);
    a group is ``b + sum(c_i * stride_i)`` over coordinates ``c_i``, first axis outermost, for
    each rank ``b`` whose coordinates on ``axes`` are 0. One axis: :func:`axis_groups`."""
    if len(axes) == 1:
        return axis_groups(mesh, axes[0])
    parts = [[mesh.sizes[a], math.prod(mesh.sizes[a + 1:])] for a in axes]
    n = math.prod(p[0] for p in parts)
    return {"size": n, "count": mesh.size // n, "axes": parts}


def group_ranks(groups: dict) -> list:
    """The rank lists an :func:`axis_groups` (or :func:`joint_groups`) dict describes, in rank
    order (as :meth:`parcomp.ir.types.Mesh.groups`); O(world size), for programs and tests."""
    if "axes" in groups:
        parts, world = groups["axes"], groups["size"] * groups["count"]
        offsets = [sum(c * s for c, (_, s) in zip(cs, parts))
                   for cs in itertools.product(*(range(n) for n, _ in parts))]
        bases = [b for b in range(world) if all((b // s) % n == 0 for n, s in parts)]
        return [[b + o for o in offsets] for b in bases]
    n, s, count = groups["size"], groups["stride"], groups["count"]
    return [list(range(block * n * s + j, (block + 1) * n * s, s))
            for block in range(count // s) for j in range(s)]


def check_topology(spec) -> dict:
    """The placement of ``spec``'s mesh ranks on its topology's nodes; rejects a ``tp`` that spans nodes.

    O(number of mesh axes): no rank is enumerated.

    Args:
        spec: a :class:`parcomp.spec.model.Spec` (``spec.topology`` is
            ``(nodes, devices_per_node)`` or None).

    Returns:
        ``{"nodes": N, "devices_per_node": D` (rank r runs on node r // D),
        "groups": {axis: axis_groups(...)} (each mesh axis's groups, see :func:`axis_groups`),
        "intra_node_axes": [axes whose every group is inside one node],
        "cross_node_axes": [axes with a group spanning nodes]}``, axes in mesh order.
        Without a topology, ``nodes`` and ``devices_per_node`` are None and both axis
        lists are empty (placement unknown).

    Raises:
        SpecError: a group of mesh axis ``tp`` spans nodes; the message names the first
            such group, its nodes and the fix, at the ``topology`` statement's location.
    """
    mesh = spec.mesh
    groups = {name: axis_groups(mesh, i) for i, name in enumerate(mesh.names)}
    if spec.topology is None:
        return {"nodes": None, "devices_per_node": None, "groups": groups,
                "intra_node_axes": [], "cross_node_axes": []}
    nodes, per_node = spec.topology
    if nodes * per_node != mesh.size:  # the parser already rejects this
        raise SpecError(f"{spec.file}: topology nodes={nodes} devices_per_node={per_node} has "
                        f"{nodes * per_node} devices but mesh {mesh} has {plural(mesh.size, 'rank')}")
    intra, cross = [], []
    for name, g in groups.items():
        spans = g["size"] > 1 and per_node % (g["size"] * g["stride"]) != 0
        (cross if spans else intra).append(name)
        if spans and name == "tp":
            raise SpecError(_tp_message(spec, _first_spanning(g, per_node), per_node),
                            getattr(spec, "topology_loc", None))
    return {"nodes": nodes, "devices_per_node": per_node, "groups": groups,
            "intra_node_axes": intra, "cross_node_axes": cross}


def _first_spanning(g, per_node) -> range:
    """The lowest-ranked group of ``g`` (an :func:`axis_groups` dict) that spans nodes.

    The first node boundary is at rank ``per_node``; it lies at offset ``o`` inside
    the block of ``n*s`` ranks that holds it, and the first group of that block with
    a rank before ``o`` and one at or after it starts at ``max(0, o - (n-1)s)``.
    """
    n, s = g["size"], g["stride"]
    block, o = divmod(per_node, n * s)
    base = block * n * s + max(0, o - (n - 1) * s)
    return range(base, base + n * s, s)


def _short(xs, unit: str, limit: int = 8) -> str:
    """``0, 1, 2``, or ``0, 1, 2, ..., 99 (100 ranks)`` for a long sequence ``xs``."""
    if len(xs) <= limit:
        return ", ".join(map(str, xs))
    return f"{', '.join(map(str, xs[:limit - 1]))}, ..., {xs[-1]} ({len(xs)} {unit})"


def _tp_message(spec, group, per_node) -> str:
    mesh, (nodes, _) = spec.mesh, spec.topology
    tp = mesh.axis_index("tp")
    first, last = group[0] // per_node, group[-1] // per_node
    spanned = range(first, last + 1) if group.step <= per_node else [r // per_node for r in group]
    inner = math.prod(mesh.sizes[tp:])
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
    return (f"{spec.file}: mesh axis tp group [{_short(group, 'ranks')}] spans nodes "
            f"{_short(spanned, 'nodes')} of topology nodes={nodes} devices_per_node={per_node} "
            f"(rank r runs on node r // {per_node}, as torchrun --nproc-per-node {per_node} "
            f"places it); tensor parallelism must stay inside a node. {fix}")
