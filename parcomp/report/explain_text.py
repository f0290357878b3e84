"""How ``parcomp explain`` shows an explanation: ``rich`` tables on a terminal, plain text
otherwise, both from one list of blocks (:func:`blocks`, :func:`compare_blocks`) so the
two never say different things.  A block is ``("table", title, headers, rows)`` or
``("text", lines)``; every cell is a string.
"""
from __future__ import annotations

import sys

from ..units import format_bytes
from .explain import cost_words, format_seconds


def _who(w) -> str:
    if w["op"] == "output":
        return f"output {w['name']}"
    at = f" ({w['source']})" if w["source"] else ""
    return f"{w['op']} %{w['name']}{at}"


def _spec_lines(e) -> str:
    refs = sorted({s["spec_line"] for s in e["steps"] if s["spec_line"]})
    return ", ".join(refs) or "-"


def blocks(x: dict) -> list:
    """The blocks of one explanation (:func:`parcomp.report.explain.explain`)."""
    out = [("text", _header(x))]
    for module, idx in x["modules"].items():
        rows = []
        for i in idx:
            e = x["edges"][i]
            rows.append([str(i), _who(e["producer"]), ", ".join(map(_who, e["consumers"])),
                         f"{e['from']} -> {e['to']}", e["kinds"], format_bytes(e["bytes"]),
                         format_seconds(e["seconds"]), e["phase"], _spec_lines(e)])
        out.append(("table", f"module {module}", ["#", "producer", "consumer", "layouts", "chosen",
                                                   "bytes/rank", "est. time", "phase", "spec"], rows))
        out.append(("text", [line for i in idx for line in _why(i, x["edges"][i])]))
    if not x["edges"]:
        out.append(("text", ["no layout changes: every value is already where its consumers need it"]))
    out.append(("table", "totals per mesh axis and phase (bytes per rank per step)",
                ["axis/phase", "collectives", "bytes/rank", "est. time"], _totals_rows(x["totals"])))
    out.append(("text", [_memory_line(x["memory_bytes_per_rank"]),
                         f"estimated communication per step: {format_seconds(x['estimated_comm_seconds'])} "
                         f"(alpha-beta per link class; compute not included)"]
                + ([f"data parallel: {x['data_parallel_note']}"] if x.get("data_parallel_note") else [])))
    return out


def _header(x) -> list:
    mesh = " ".join(f"{a}={n}" for a, n in x["mesh"].items())
    lines = [f"spec {x['spec']}: mesh {mesh} ({x['world_size']} ranks)"]
    p = x["placement"]
    if p["nodes"] is None:
        lines.append("placement: no topology nodes= line, every axis taken as inside one node")
    else:
        lines.append(f"placement: {p['nodes']} nodes x {p['devices_per_node']} devices; across nodes: "
                     f"{', '.join(p['cross_node_axes']) or '-'}")
    for a, l in x["links"].items():
        lines.append(f"link {a}: {l['name']} {l['gb_per_s']:g} GB/s, {l['hop_us']:g} us per ring hop, "
                     f"{l['call_us']:g} us per call ({l['source']})")
    return lines


def _why(i, e) -> list:
    lines = [f"[{i}] {s['kind']} over {s['axis']}: {s['reason']}" + _bucket_words(s) for s in e["steps"]]
    for a in e["alternatives"]:
        lines.append(f"    instead {a['kinds']} (via {a['via']}): {format_bytes(a['bytes'])}, "
                     f"{format_seconds(a['seconds'])}: {cost_words(a, e)}")
    if not e["alternatives"]:
        lines.append("    no other plan through one intermediate layout")
    return lines


def _bucket_words(s) -> str:
    """Where a step fused into a bucket is run and counted (passes/lowering/bucket.py, dp_buckets.py)."""
    if not s.get("in_bucket"):
        return ""
    return f"; run as part of the one all_reduce %{s['in_bucket']} (its bytes and time counted there)"


def _totals_rows(t) -> list:
    rows = []
    for table in ("per_axis_phase", "per_axis", "per_phase"):
        for k, v in t[table].items():
            label = k if table == "per_axis_phase" else f"{k} (all)" if table == "per_axis" else f"(all)/{k}"
            rows.append([label, str(v["count"]), format_bytes(v["bytes"]), format_seconds(v["seconds"])])
    return rows or [["-", "0", "0 B", "0"]]


def _memory_line(m) -> str:
    return "memory per rank: " + ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in m.items())


def compare_blocks(xs: list, names: list) -> list:
    """Blocks setting explanations side by side: one column per spec."""
    axes = sorted({a for x in xs for a in x["totals"]["per_axis"]})
    rows = [["mesh"] + [" ".join(f"{a}={n}" for a, n in x["mesh"].items()) for x in xs],
            ["collectives"] + [str(sum(v["count"] for v in x["totals"]["per_axis"].values())) for x in xs],
            ["bytes/rank/step"] + [format_bytes(sum(v["bytes"] for v in x["totals"]["per_axis"].values()))
                                   for x in xs]]
    for a in axes:
        rows.append([f"  over {a}"] + [format_bytes(x["totals"]["per_axis"].get(a, {}).get("bytes", 0))
                                       for x in xs])
    rows.append(["est. comm time/step"] + [format_seconds(x["estimated_comm_seconds"]) for x in xs])
    for k in xs[0]["memory_bytes_per_rank"]:
        rows.append([f"memory: {k.replace('_', ' ')}"] + [format_bytes(x["memory_bytes_per_rank"][k]) for x in xs])
    rows += _chosen_rows(xs)
    return [("table", "side by side (per rank)", [""] + names, rows)]


def _chosen_rows(xs: list) -> list:
    """The layout changes each spec chose, one short row per kind (``all_gather(dim 1) over
    tp``) with its count per spec: never one row listing every edge."""
    kinds = {}
    for x in xs:
        for e in x["edges"]:
            kinds.setdefault(e["kinds"], None)
    counts = [{k: sum(e["kinds"] == k for e in x["edges"]) for k in kinds} for x in xs]
    rows = [["layout changes chosen"] + [str(len(x["edges"])) for x in xs]]
    return rows + [[f"  {k}"] + [str(c[k] or "-") for c in counts] for k in kinds]


def render_plain(bl: list) -> str:
    """Plain text: aligned columns, titles underlined with ``-``."""
    out = []
    for b in bl:
        if b[0] == "text":
            out.extend(b[1])
            continue
        _, title, head, rows = b
        widths = [max(len(c) for c in col) for col in zip(head, *rows)]
        out += ["", title, "-" * len(title), "  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip()]
        out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(out)


def render_rich(bl: list, file=None) -> None:
    """The blocks as ``rich`` tables on ``file`` (stdout)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file or sys.stdout)
    for b in bl:
        if b[0] == "text":
            for line in b[1]:
                console.print(line, markup=False, highlight=False)
            continue
        _, title, head, rows = b
        t = Table(title=title, title_justify="left")
        for h in head:
            t.add_column(h, overflow="fold")
        for r in rows:
            t.add_row(*r)
        console.print(t)


def show(bl: list, file=None) -> None:
    """Print the blocks: rich tables when ``file`` (stdout) is a terminal and rich is
    installed, else plain text."""
    file = file or sys.stdout
    if getattr(file, "isatty", lambda: False)():
        try:
            render_rich(bl, file)
            return
        except ImportError:
            pass
    print(render_plain(bl), file=file)
