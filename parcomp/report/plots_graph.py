"""The sharded graph as a picture (``parcomp explain --plots``): layouts on the edges,
collectives as marked nodes.

With graphviz ``dot`` on the PATH the picture is ``dot -Tsvg`` of :func:`dot_source`; without
it (or when dot fails) a layered matplotlib drawing (:func:`draw_graph`): each node one row
below its deepest operand, inputs and params just above their first consumer, each row
ordered by its operands' positions.
"""
from __future__ import annotations

import io
import shutil
import subprocess

from ..ir.ops import LAYOUT_OPS
from ..ir.types import layout_str
from ..units import format_bytes

#: a graph with more nodes is drawn around its layout ops only (each with its operand and users)
MAX_DRAWN_NODES = 240
#: seconds ``dot`` may take before the matplotlib drawing is used instead
DOT_TIMEOUT_S = 30


def _label(node, collectives) -> str:
    if node.op in LAYOUT_OPS:
        rec = collectives.get(node.name)
        dim = "" if node.attr("dim") is None else f"({node.attr('dim')})"
        nbytes = f"\n{format_bytes(rec.bytes)}" if rec is not None else "\n(local)"
        return f"{node.op}{dim} over {node.attr('axis')}{nbytes}"
    return f"{node.op}\n%{node.name}"


def drawn_nodes(graph) -> list:
    """The nodes drawn: all of them, or, past :data:`MAX_DRAWN_NODES`, the layout ops with
    their operands and users (program order)."""
    if len(graph.nodes) <= MAX_DRAWN_NODES:
        return list(graph.nodes)
    users, keep = graph.users(), set()
    for n in graph.nodes:
        if n.op in LAYOUT_OPS:
            keep.update([n.name, *n.inputs, *users[n.name]])
    return [n for n in graph.nodes if n.name in keep]


def dot_source(graph, collectives) -> str:
    """Graphviz source of the drawn nodes: collectives as filled red boxes, local layout ops
    orange, every edge labelled with its operand's layout."""
    nodes = drawn_nodes(graph)
    names = {n.name for n in nodes}
    lines = ["digraph sharded {", "  rankdir=TB; node [shape=box, fontsize=10, fontname=Helvetica];",
             "  edge [fontsize=8, fontname=Helvetica, color=gray40];"]
    for n in nodes:
        style = ""
        if n.op in LAYOUT_OPS:
            color = "#f4a3a3" if n.name in collectives else "#fbd38d"
            style = f', style="filled,bold", fillcolor="{color}"'
        text = _label(n, collectives).replace('"', "'").replace("\n", "\\n")
        lines.append(f'  "{n.name}" [label="{text}"{style}];')
    for n in nodes:
        for i in n.inputs:
            if i in names:
                lines.append(f'  "{i}" -> "{n.name}" [label="{layout_str(graph[i].layout)}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def graph_svg(graph, collectives) -> tuple:
    """``(svg text, "dot" | "matplotlib")``: dot's drawing where dot runs, else matplotlib's."""
    dot = shutil.which("dot")
    if dot:
        try:
            proc = subprocess.run([dot, "-Tsvg"], input=dot_source(graph, collectives), text=True,
                                  capture_output=True, timeout=DOT_TIMEOUT_S, check=False)
            if proc.returncode == 0 and "<svg" in proc.stdout:
                return proc.stdout, "dot"
        except (OSError, subprocess.TimeoutExpired):
            pass
    return svg_text(draw_graph(graph, collectives)), "matplotlib"


def svg_text(fig) -> str:
    """The SVG of matplotlib Figure ``fig`` (text as text, no date: the same plan, the same file)."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "parcomp"}):
        fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    return buf.getvalue()


def layered_positions(graph, nodes) -> dict:
    """``{name: (x, row)}``: row = 1 + the deepest operand's row (inputs and params one row
    above their first drawn consumer), x in each row by the mean x of the operands."""
    names = {n.name for n in nodes}
    row = {}
    for n in nodes:
        ins = [row[i] for i in n.inputs if i in row]
        row[n.name] = 1 + max(ins) if ins else 0
    users = graph.users()
    for n in nodes:
        if not n.inputs or not any(i in names for i in n.inputs):
            below = [row[u] for u in users[n.name] if u in row]
            if below and n.op in ("input", "param"):
                row[n.name] = max(0, min(below) - 1)
    rows = {}
    for n in nodes:
        rows.setdefault(row[n.name], []).append(n)
    pos = {}
    for r in sorted(rows):
        def key(n):
            xs = [pos[i][0] for i in n.inputs if i in pos]
            return sum(xs) / len(xs) if xs else -1.0
        for x, n in enumerate(sorted(rows[r], key=key)):
            pos[n.name] = (float(x) - (len(rows[r]) - 1) / 2, r)
    return pos


def draw_graph(graph, collectives):
    """A matplotlib Figure of the drawn nodes (:func:`layered_positions`)."""
    from matplotlib.figure import Figure

    nodes = drawn_nodes(graph)
    pos = layered_positions(graph, nodes)
    width = max(len([p for p in pos.values() if p[1] == r]) for r in {p[1] for p in pos.values()})
    depth = 1 + max(p[1] for p in pos.values())
    fig = Figure(figsize=(max(6.0, 2.2 * width), max(4.0, 0.9 * depth)))
    ax = fig.add_subplot()
    ax.set_axis_off()
    ax.set_title(f"sharded graph, mesh {graph.mesh}: layouts on edges, collectives in red", fontsize=10)
    for n in nodes:
        for i in n.inputs:
            if i in pos:
                (x0, y0), (x1, y1) = pos[i], pos[n.name]
                ax.plot([x0, x1], [-y0, -y1], color="0.6", lw=0.8, zorder=1)
                ax.text((x0 + x1) / 2, -(y0 + y1) / 2, layout_str(graph[i].layout), fontsize=6,
                        color="0.25", ha="center", va="center", zorder=2,
                        bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none", alpha=0.8))
    for n in nodes:
        x, y = pos[n.name]
        color = ("#f4a3a3" if n.name in collectives else "#fbd38d") if n.op in LAYOUT_OPS else "#e8eef7"
        ax.text(x, -y, _label(n, collectives), fontsize=7, ha="center", va="center", zorder=3,
                fontweight="bold" if n.op in LAYOUT_OPS else "normal",
                bbox=dict(boxstyle="round,pad=0.3", fc=color, ec="0.3", lw=0.6))
    xs = [p[0] for p in pos.values()]
    ax.set_xlim(min(xs) - 1, max(xs) + 1)
    ax.set_ylim(-depth, 1)
    return fig
