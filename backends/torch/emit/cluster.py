"""The constants of a ``program.py``'s cluster section (:mod:`parcomp_backends.torch.runtime.program_cluster`).

- ``COMM_AXES``: the mesh axes the program's collectives run over; only their process
  groups are made (an axis spanning every rank reuses WORLD: ``make_groups``).
- ``HOST_AXES``: axes whose groups must sit on one host (``tp``: the rule of
  :func:`parcomp.cost.topology.check_topology`), checked at start.
- ``PLACEMENT``, ``TIMEOUT_S``, ``TOPOLOGY``: the spec's ``topology`` line
  (``placement=refuse|warn``, ``timeout=SECONDS``, ``nodes`` x ``devices_per_node``), or the
  defaults :data:`DEFAULT_PLACEMENT` / :data:`DEFAULT_TIMEOUT_S` / None.
- ``COLLECTIVE_DTYPES``: the dtypes the collectives carry (a profile's ``dtype_check``).
"""
from __future__ import annotations

import json

from parcomp.ir.ops import COLLECTIVES

from .cp_ring import ring_axes

DEFAULT_PLACEMENT = "refuse"
DEFAULT_TIMEOUT_S = 600  # NCCL's own default; HCCL_EXEC_TIMEOUT is 1836 s unless set
HOST_AXIS = "tp"  # tensor parallelism communicates in every layer: one host's links
CLUSTER_NAMES = ("COMM_AXES", "HOST_AXES", "PLACEMENT", "TIMEOUT_S", "TOPOLOGY", "COLLECTIVE_DTYPES",
                 "LAUNCH_ENV", "BIND_DEVICE_ID")


def comm_axes(graph) -> list:
    """The mesh axes of ``graph``'s collectives (local layout ops need no group), in mesh order,
    then the joint groups they use (``"dp,tp"``: one collective over several axes), sorted."""
    used = {n.attr("axis") for n in graph.nodes if n.op in COLLECTIVES} | ring_axes(graph)
    return [a for a in graph.mesh.names if a in used] + sorted(a for a in used if "," in a)


def _tuple(xs) -> str:
    xs = [json.dumps(x) for x in xs]
    return "()" if not xs else f"({xs[0]},)" if len(xs) == 1 else "(" + ", ".join(xs) + ")"


def cluster_constants(prog) -> list:
    """The lines defining the cluster section's constants for the :class:`parcomp.compile.program.Program` ``prog``."""
    graph, launch = prog.graph, dict(getattr(prog, "launch", None) or {})
    mesh = graph.mesh
    host = [HOST_AXIS] if HOST_AXIS in mesh.names and mesh.sizes[mesh.names.index(HOST_AXIS)] > 1 else []
    dtypes = sorted({graph[n.inputs[0]].type.dtype for n in graph.nodes if n.op in COLLECTIVES})
    topology = launch.get("topology")
    return [
        f"COMM_AXES = {_tuple(comm_axes(graph))}  # the axes whose process groups the program uses",
        f"HOST_AXES = {_tuple(host)}  # axes whose groups must sit on one host (checked at start)",
        f"PLACEMENT = {json.dumps(launch.get('placement', DEFAULT_PLACEMENT))}"
        "  # a HOST_AXES group on several hosts: refuse | warn (--placement)",
        f"TIMEOUT_S = {launch.get('timeout', DEFAULT_TIMEOUT_S)!r}  # seconds a collective may wait (--timeout)",
        f"TOPOLOGY = {tuple(topology) if topology else None!r}"
        "  # the spec's nodes, devices per node (--print-launch)",
        f"COLLECTIVE_DTYPES = {_tuple(dtypes)}  # what the collectives carry",
    ]
