"""The compile report: every collective, why it is there, and what it costs.

``report.json`` is this dict.  Bytes are bytes sent per rank by a ring
algorithm (:func:`parcomp.redistribute.step_bytes`); shapes are per-rank.
"""
from __future__ import annotations

from .ir.ops import COLLECTIVES
from .ir.types import layout_str
from .redistribute import Step, step_bytes


PHASES = (("bw.", "backward"), ("opt.", "optimizer"))


def phase_of(value: str) -> str:
    """forward | backward | optimizer, from the autodiff naming convention."""
    return next((ph for prefix, ph in PHASES if value.startswith(prefix)), "forward")


def collective_records(sharded, program) -> list:
    """One dict per collective node of ``sharded`` (global) / ``program`` (local), in order."""
    users = sharded.users()
    outs = {v: p for p, v in sharded.named_outputs()}
    recs = []
    for n in sharded.nodes:
        if n.op not in COLLECTIVES:
            continue
        src = sharded[n.inputs[0]]
        a = sharded.mesh.names.index(n.attr("axis"))
        step = Step(n.op, a, n.attr("dim"), n.attr("src_dim"), src.layout, n.layout)
        consumers = [f"{sharded[u].op} %{u}" for u in users[n.name]]
        if n.name in outs:
            consumers.append(f"output {outs[n.name]}")
        recs.append({
            "name": n.name, "kind": n.op, "axis": n.attr("axis"), "dim": n.attr("dim"),
            "dtype": n.type.dtype, "local_shape": list(program[src.name].type.shape),
            "from": layout_str(src.layout), "to": layout_str(n.layout),
            "bytes": step_bytes(step, n.type, sharded.mesh), "phase": phase_of(src.name),
            "producer": src.name, "consumers": consumers, "reason": n.attr("reason"),
        })
    return recs


def build_report(sharded, program, spec) -> dict:
    """The whole report: mesh, collectives, per-axis totals."""
    recs = collective_records(sharded, program)
    totals = {}
    for r in recs:
        t = totals.setdefault(r["axis"], {"count": 0, "bytes": 0})
        t["count"] += 1
        t["bytes"] += r["bytes"]
    return {
        "mesh": dict(sharded.mesh.axes),
        "world_size": sharded.mesh.size,
        "spec": getattr(spec, "file", None),
        "collectives": recs,
        "totals_per_axis": totals,
    }


def format_collectives(recs) -> str:
    """A plain-text table of collectives, one row each, then the reasons."""
    if not recs:
        return "collectives: none"
    head = ("#", "kind", "axis", "dim", "local shape", "bytes/rank", "phase", "value")
    rows = [(str(i), r["kind"], r["axis"], "-" if r["dim"] is None else str(r["dim"]),
             "x".join(map(str, r["local_shape"])), str(r["bytes"]), r["phase"], r["producer"])
            for i, r in enumerate(recs)]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines = [f"collectives: {len(recs)}", "  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines += [f"  [{i}] why: {r['reason']}" for i, r in enumerate(recs)]
    return "\n".join(lines)
