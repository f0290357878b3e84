"""assign-devices: the placement table of a mesh on its topology (the 8-device example of docs/design/pipeline.md, "Pipeline parallelism").

Ranks are mesh coordinates row-major, the last axis fastest (as the spec writes the
mesh), so ``mesh dp=2 pp=2 tp=2`` puts a tp pair on neighbouring ranks, and torchrun
puts rank ``r`` on node ``r // devices_per_node``.  The table lists every rank's
coordinates, node and pipeline stage, each axis's process groups (the tp groups per
stage), and the point-to-point pairs between neighbouring stages.  O(world size): for
reports, program docstrings and tests, never for the compiler's checks
(:mod:`parcomp.cost.topology` does those by arithmetic).
"""
from __future__ import annotations

from .topology import axis_groups, group_ranks

__all__ = ["placement_table", "format_placement"]


def placement_table(mesh, topology=None) -> dict:
    """The placement of ``mesh`` (a :class:`parcomp.ir.types.Mesh`) on ``topology``
    (``(nodes, devices_per_node)`` or None).

    Returns:
        ``{"ranks": [{"rank", "coords": {axis: c}, "node", "stage"}], "groups": {axis:
        [[ranks]]}, "stage_groups": {axis: {stage: [[ranks]]}} (axes other than pp, split by
        stage; empty without pp), "p2p": [[rank, next stage's rank]]}``; ``node`` is None
        without a topology, ``stage`` 0 without a ``pp`` axis.
    """
    per = topology[1] if topology else None
    pp = mesh.axis_index("pp") if "pp" in mesh.names else None
    ranks = []
    for r in range(mesh.size):
        c = mesh.coords(r)
        ranks.append({"rank": r, "coords": dict(zip(mesh.names, c)),
                      "node": None if per is None else r // per,
                      "stage": 0 if pp is None else c[pp]})
    groups = {a: group_ranks(axis_groups(mesh, i)) for i, a in enumerate(mesh.names)}
    stage_groups, p2p = {}, []
    if pp is not None:
        for a, gs in groups.items():
            if a != "pp":
                stage_groups[a] = {s: [g for g in gs if ranks[g[0]]["stage"] == s]
                                   for s in range(mesh.sizes[pp])}
        p2p = [[g[i], g[i + 1]] for g in groups["pp"] for i in range(len(g) - 1)]
    return {"ranks": ranks, "groups": groups, "stage_groups": stage_groups, "p2p": p2p}


def format_placement(table: dict) -> str:
    """The table as text: one line per rank, then the groups."""
    lines = ["rank  node  stage  coords"]
    for row in table["ranks"]:
        node = "-" if row["node"] is None else row["node"]
        coords = " ".join(f"{a}={c}" for a, c in row["coords"].items())
        lines.append(f"{row['rank']:>4}  {node:>4}  {row['stage']:>5}  {coords}")
    for a, by_stage in table["stage_groups"].items():
        for s, gs in by_stage.items():
            lines.append(f"stage {s} {a} groups: {' '.join(_set(g) for g in gs)}")
    for a, gs in table["groups"].items():
        if a not in table["stage_groups"]:
            lines.append(f"{a} groups: {' '.join(_set(g) for g in gs)}")
    if table["p2p"]:
        lines.append(f"p2p pairs: {' '.join(f'{a}->{b}' for a, b in table['p2p'])}")
    return "\n".join(lines)


def _set(g) -> str:
    return "{" + ",".join(map(str, g)) + "}"
