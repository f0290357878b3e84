"""Pictures of a compiled plan (``parcomp explain --plots DIR``) and its collective timeline.

Writes, through :func:`parcomp.outdir.write_dir_atomic` (never touching a file parcomp did
not write):

- ``graph.svg``: the sharded graph, layouts on the edges, collectives marked
  (:mod:`parcomp.report.plots_graph`; graphviz ``dot`` if installed, else matplotlib);
- ``devices.svg``: the device map: nodes, the devices in them with rank and mesh
  coordinates, the groups of the last mesh axis (``tp``) boxed, other axes' groups joined;
- ``memory.svg``: per-rank memory bars (weights, gradients, optimizer state, saved
  activations stacked; peak live marked);
- ``trace.json``: the per-rank collective sequence as Chrome trace events (open it in
  Perfetto or chrome://tracing): one track per rank, one slice per collective, its
  length the alpha-beta estimate of :mod:`parcomp.cost.links`, back to back (compute is not
  modelled).

matplotlib draws with its object API (no pyplot, no global backend switch); SVG text
stays text (``svg.fonttype: none``) so the files are small and searchable.
"""
from __future__ import annotations

import json

from ..errors import ParcompError
from ..outdir import write_dir_atomic
from ..units import format_bytes
from .plots_graph import graph_svg, svg_text

#: ranks drawn in the device map and memory bars, and tracks in the trace
MAX_DRAWN_RANKS = 64
MEMORY_PARTS = ("weights", "gradients", "optimizer_state", "saved_activations")
AXIS_COLORS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def write_plots(compiled, x: dict, out: str) -> dict:
    """Write the pictures and trace of ``compiled`` (explanation ``x``) into directory ``out``.

    Returns:
        ``{"files": [names written], "kept": [entries of out parcomp left alone],
        "graph_drawn_by": "dot" | "matplotlib"}``.

    Raises:
        ParcompError: matplotlib is missing, or ``out`` cannot be written (see
            :func:`parcomp.outdir.write_dir_atomic`, flag ``--plots``).
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ParcompError("--plots needs matplotlib: pip install 'parcomp[plots]' (or matplotlib)",
                           where="--plots") from None
    prog = compiled.program_
    collectives = {c.name: c for c in prog.collectives}
    graph, drawn_by = graph_svg(compiled.sharded, collectives)
    files = {"graph.svg": graph, "devices.svg": svg_text(device_map(prog, x["placement"])),
             "memory.svg": svg_text(memory_bars(prog.mesh.size, x["memory_bytes_per_rank"])),
             "trace.json": json.dumps(chrome_trace(prog, x), indent=1) + "\n"}
    kept = write_dir_atomic(out, files, flag="--plots", command="plots")
    return {"files": sorted(files), "kept": kept, "graph_drawn_by": drawn_by}


def _nodes(mesh, placement) -> tuple:
    if placement.get("nodes"):
        return placement["nodes"], placement["devices_per_node"]
    return 1, mesh.size


def device_map(prog, placement):
    """The device map Figure: one row of devices per node (at most :data:`MAX_DRAWN_RANKS`
    ranks), each labelled ``r<rank>`` and its mesh coordinates; the groups of the last mesh
    axis boxed, the other axes' groups joined by a line under the devices."""
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyBboxPatch, Rectangle

    mesh = prog.mesh
    nodes, per = _nodes(mesh, placement)
    shown = min(mesh.size, MAX_DRAWN_RANKS)
    rows = -(-shown // per)
    fig = Figure(figsize=(max(5.0, 1.3 * min(per, 16) + 1.5), 1.2 + 1.6 * rows))
    ax = fig.add_subplot()
    ax.set_axis_off()
    cols = min(per, 16)
    spot = {r: ((r % per) % cols * 1.3, -((r // per) * -(-per // cols) + (r % per) // cols) * 1.6)
            for r in range(shown)}
    for node in range(-(-shown // per)):
        ys = [spot[r][1] for r in range(node * per, min(shown, (node + 1) * per))]
        ax.add_patch(Rectangle((-0.55, min(ys) - 0.75), cols * 1.3 - 0.2, max(ys) - min(ys) + 1.3,
                               fill=False, ec="0.4", lw=1.0, ls="--"))
        ax.text(-0.5, max(ys) + 0.45, f"node {node}", fontsize=8, color="0.3")
    for r, (x, y) in spot.items():
        ax.add_patch(Rectangle((x - 0.4, y - 0.35), 0.8, 0.7, fc="#e8eef7", ec="0.2", lw=0.8))
        coords = ",".join(f"{a}{c}" for a, c in zip(mesh.names, mesh.coords(r)))
        ax.text(x, y + 0.08, f"r{r}", ha="center", va="center", fontsize=9, fontweight="bold")
        ax.text(x, y - 0.18, coords, ha="center", va="center", fontsize=6)
    for i, axis in enumerate(mesh.names):
        color = AXIS_COLORS[i % len(AXIS_COLORS)]
        for g in prog.group_ranks(axis):
            g = [r for r in g if r in spot]
            if len(g) < 2:
                continue
            if i == len(mesh.names) - 1 and all(spot[r][1] == spot[g[0]][1] for r in g):
                x0, x1, y = spot[g[0]][0], spot[g[-1]][0], spot[g[0]][1]
                ax.add_patch(FancyBboxPatch((x0 - 0.5, y - 0.45), x1 - x0 + 1.0, 0.9,
                                            boxstyle="round,pad=0.02", fill=False, ec=color, lw=1.8))
            else:
                off = 0.45 + 0.08 * i
                ax.plot([spot[r][0] for r in g], [spot[r][1] - off for r in g], color=color, lw=1.5,
                        marker="o", ms=3)
        ax.plot([], [], color=color, lw=2, label=f"{axis} groups ({mesh.sizes[i]} ranks)")
    more = f" (first {shown} of {mesh.size} ranks)" if shown < mesh.size else ""
    ax.set_title(f"device map: mesh {mesh}, {nodes} node(s) x {per} devices{more}", fontsize=10)
    ax.legend(loc="upper right", fontsize=7, frameon=False, bbox_to_anchor=(1.0, 0.0))
    xs, ys = [p[0] for p in spot.values()], [p[1] for p in spot.values()]
    ax.set_xlim(min(xs) - 0.8, max(cols * 1.3, max(xs) + 0.8))
    ax.set_ylim(min(ys) - 1.0, max(ys) + 0.8)
    ax.set_aspect("equal")
    return fig


def _unit(n) -> tuple:
    for power, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if n >= 1024 ** power:
            return 1024 ** power, unit
    return 1, "B"


def memory_bars(world: int, memory: dict):
    """Per-rank memory bars: the parts of :data:`MEMORY_PARTS` stacked, peak live as a
    black tick (every rank of an SPMD program holds the same; at most
    :data:`MAX_DRAWN_RANKS` bars)."""
    from matplotlib.figure import Figure

    shown = min(world, MAX_DRAWN_RANKS)
    scale, unit = _unit(max(memory["peak_live"], sum(memory[p] for p in MEMORY_PARTS), 1))
    fig = Figure(figsize=(max(4.0, 0.5 * shown + 2.5), 3.5))
    ax = fig.add_subplot()
    ranks = list(range(shown))
    bottom = [0.0] * shown
    for i, part in enumerate(MEMORY_PARTS):
        h = memory[part] / scale
        ax.bar(ranks, [h] * shown, bottom=bottom, label=f"{part.replace('_', ' ')} {format_bytes(memory[part])}",
               color=AXIS_COLORS[(i + 1) % len(AXIS_COLORS)], width=0.6)
        bottom = [b + h for b in bottom]
    ax.scatter(ranks, [memory["peak_live"] / scale] * shown, marker="_", s=400, color="black",
               label=f"peak live {format_bytes(memory['peak_live'])}", zorder=3)
    ax.set_xticks(ranks)
    ax.set_xticklabels([f"r{r}" for r in ranks], fontsize=7)
    ax.set_ylabel(f"per rank ({unit})")
    more = f" (first {shown} of {world})" if shown < world else ""
    ax.set_title(f"memory per rank{more}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return fig


def chrome_trace(prog, x: dict) -> dict:
    """Chrome trace events of each rank's collectives in program order (one process, one
    thread per rank, at most :data:`MAX_DRAWN_RANKS`): ``ph: "X"`` slices whose ``dur`` is
    the estimate in microseconds, ``args`` the axis, the rank's group, bytes, phase, reason."""
    est = {s["name"]: s for e in x["edges"] for s in e["steps"] if "name" in s}
    seq = [prog.collective(n.name) for n in prog.graph.nodes if prog.collective(n.name) is not None]
    shown = min(prog.mesh.size, MAX_DRAWN_RANKS)
    events = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
               "args": {"name": f"parcomp {prog.spec_name or ''} (estimated collectives)".strip()}}]
    groups = {a: prog.group_ranks(a) for a in prog.groups} if shown else {}
    for r in range(shown):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}})
        ts = 0.0
        for c in seq:
            dur = est[c.name]["seconds"] * 1e6 if c.name in est else 0.0
            group = next(g for g in groups[c.axis] if r in g)
            events.append({"name": f"{c.kind} {c.axis}", "cat": c.phase, "ph": "X", "pid": 0, "tid": r,
                           "ts": round(ts, 3), "dur": round(dur, 3),
                           "args": {"value": c.name, "axis": c.axis, "group": group, "bytes": c.bytes,
                                    "from": c.src_layout, "to": c.dst_layout, "phase": c.phase,
                                    "reason": c.reason}})
            ts += dur
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"spec": prog.spec_name, "world_size": prog.mesh.size, "ranks_shown": shown}}
