"""The text form of a graph (``.pcir``): one line per node (parsed by :mod:`parcomp.ir.text`).

Kept apart from the parser so that :meth:`parcomp.ir.graph.Graph.__str__` can
print without an import cycle (graph -> printer; text -> graph, printer).
"""
from __future__ import annotations

import json

from .types import layout_str


def _fmt_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, tuple):
        return "(" + ", ".join(str(int(x)) for x in v) + ("," if len(v) == 1 else "") + ")"
    raise TypeError(f"attribute value {v!r} has no text form")


def print_node(n: Node) -> str:
    """One node as one line of ``.pcir`` text."""
    lay = "" if n.layout is None else " " + layout_str(n.layout)
    if n.in_layouts is None:
        args = ", ".join("%" + i for i in n.inputs)
    else:
        args = ", ".join(f"%{i} {layout_str(lay)}" for i, lay in zip(n.inputs, n.in_layouts))
    attrs = ""
    if n.attrs:
        attrs = " {" + ", ".join(f"{k}={_fmt_value(v)}" for k, v in n.attrs) + "}"
    return f"%{n.name}: {n.type}{lay} = {n.op}({args}){attrs}"


def print_graph(g: Graph) -> str:
    """Canonical text of ``g`` (ends with a newline)."""
    lines = []
    if g.mesh is not None and g.mesh.axes:
        lines.append("mesh " + str(g.mesh))
    if g.stage != "global":
        lines.append(f"stage {g.stage}")
    lines += [print_node(n) for n in g.nodes]
    lines.append("return " + ", ".join(
        "%" + v + ("" if v == name else f" as {name}") for name, v in g.named_outputs()))
    return "\n".join(lines) + "\n"
