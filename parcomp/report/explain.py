"""``parcomp explain``: every layout change of a compiled program, why, and what it costs.

An *edge* is one value converted to one layout a consumer needs: the chain of layout ops
insert-collectives made for it (:mod:`parcomp.passes.insert_collectives`), usually one
collective.  For each edge the explanation names the producer and the consumers (op,
model module path, spec line), the two layouts, the steps chosen with their bytes and
estimated seconds, the reason in words, and the alternatives the planner
(:func:`parcomp.ir.redistribute.plan`) would produce through one intermediate layout, with
their bytes and seconds.  Bytes are bytes sent per rank by ring algorithms
(:func:`parcomp.ir.redistribute.step_bytes`, the count the reference interpreter logs);
seconds come from the alpha-beta model of :mod:`parcomp.cost.links`, per mesh axis's link class.
Edges are grouped per model module; totals are per mesh axis and per phase.

Everything here reads the :class:`parcomp.compile.compiler.Compiled` result; nothing runs.
"""
from __future__ import annotations

import math

from ..cost.links import axis_links, collective_seconds
from ..ir.ops import LAYOUT_OPS
from ..ir.redistribute import plan, step_bytes
from ..ir.types import Partial, Replicate, Shard, layout_str, shard_axes
from ..passes.lowering.bucket import bucketed_members
from ..units import format_bytes

#: at most this many alternatives are listed per edge (cheapest first)
MAX_ALTERNATIVES = 3


def explain(compiled) -> dict:
    """The explanation of ``compiled`` (a :class:`parcomp.compile.compiler.Compiled`) as a JSON-able dict.

    Keys: ``spec``, ``mesh``, ``links`` (per mesh axis), ``edges`` (program order),
    ``modules`` (module path -> edge indices), ``totals`` (``per_axis``, ``per_phase``,
    ``per_axis_phase``: ``{"count", "bytes", "seconds"}``, bytes per rank per step),
    ``memory_bytes_per_rank``, ``estimated_comm_seconds`` (the sum over every collective),
    ``data_parallel`` and, where the batch is gathered, ``data_parallel_note`` and
    ``batch_gathered_by`` (:func:`_batch_record`).

    Raises:
        parcomp.errors.SpecError: an unknown link class in the spec's topology.
    """
    sharded, prog = compiled.sharded, compiled.program_
    links = axis_links(compiled.spec, compiled.report["placement"])
    edges = [_edge(sharded, prog, chain, links) for chain in _chains(sharded)]
    modules = {}
    for i, e in enumerate(edges):
        modules.setdefault(e["module"], []).append(i)
    return {"spec": prog.spec_file, "mesh": dict(prog.mesh.axes), "world_size": prog.mesh.size,
            "links": {a: l.record() for a, l in links.items()},
            "placement": {k: compiled.report["placement"][k] for k in
                          ("nodes", "devices_per_node", "intra_node_axes", "cross_node_axes")},
            "edges": edges, "modules": modules, "totals": totals(edges),
            "memory_bytes_per_rank": compiled.report["memory_bytes_per_rank"],
            "estimated_comm_seconds": sum(e["seconds"] for e in edges),
            "training": compiled.report.get("training") is not None,
            **_batch_record(compiled.report.get("search"))}


def _batch_record(search) -> dict:
    """Whether the plan keeps the batch split over its batch axes (``dp``, and ``ep`` where it
    splits the batch), the report's note where not and the op that forces the gather:
    ``{"data_parallel", "data_parallel_note", "batch_gathered_by"}`` (the last two where the
    search has them), or nothing when the search says nothing."""
    if not search or "data_parallel" not in search:
        return {}
    return {"data_parallel": search["data_parallel"],
            **({"data_parallel_note": search["note"]} if search.get("note") else {}),
            **({"batch_gathered_by": search["batch_gathered_by"]} if search.get("batch_gathered_by") else {})}


def _chains(sharded) -> list:
    """The layout-op chains of ``sharded`` in program order: lists of nodes, each reading the
    previous one, the first reading a value that is not a layout op's."""
    chains, by_last = [], {}
    for n in sharded.nodes:
        if n.op not in LAYOUT_OPS:
            continue
        src = n.inputs[0]
        if src in by_last and sharded[src].op in LAYOUT_OPS:
            chain = by_last.pop(src)
            chain.append(n)
        else:
            chain = [n]
            chains.append(chain)
        by_last[n.name] = chain
    return chains


def _where(prog, sharded, name: str) -> dict:
    """Op, module path and spec line of node ``name``."""
    prov = prog.provenance.get(name)
    node = sharded[name] if name in sharded else None
    return {"name": name, "op": node.op if node is not None else None,
            "source": prov.source if prov else (node.source if node is not None else None),
            "spec_line": prov.spec_ref if prov else None}


def _consumers(sharded, prog, last) -> list:
    users = sharded.users()[last.name]
    out = [_where(prog, sharded, u) for u in users]
    out += [{"name": pub, "op": "output", "source": None, "spec_line": None}
            for pub, v in sharded.named_outputs() if v == last.name]
    return out


def _edge(sharded, prog, chain, links) -> dict:
    mesh = sharded.mesh
    root = sharded[chain[0].inputs[0]]
    ty, src, tgt = root.type, root.layout, chain[-1].layout
    steps = [_step(prog, n, mesh, links) for n in chain]
    producer = _where(prog, sharded, root.name)
    consumers = _consumers(sharded, prog, chain[-1])
    chosen = {"bytes": sum(s["bytes"] for s in steps), "seconds": sum(s["seconds"] for s in steps)}
    return {"value": root.name, "dtype": ty.dtype, "shape": list(ty.shape),
            "from": layout_str(src), "to": layout_str(tgt), "producer": producer,
            "consumers": consumers, "steps": steps, "phase": chain[0].phase,
            "module": _module(sharded, producer, consumers),
            "kinds": " + ".join(_step_text(s) for s in steps), **chosen,
            "alternatives": alternatives(src, tgt, ty, mesh, links, [_key(s) for s in steps])}


def _step(prog, n, mesh, links) -> dict:
    """One layout op ``n`` of a chain, priced as the program runs it: a collective the lowering
    fused into a bucket (passes/lowering/bucket.py, passes/lowering/dp_buckets.py) is the bucket's one all_reduce,
    with the flat buffer's bytes, at its first member; the other members cost nothing here
    (``in_bucket`` names the bucket) -- so the steps count and price ``prog.collectives``."""
    rec, in_bucket = prog.collective(n.name), None
    if rec is None:
        bucket = bucketed_members(prog.graph, n.name)
        if bucket is not None and bucket[1][0] == n.name:
            rec = prog.collective(bucket[0].name)
        elif bucket is not None:
            in_bucket = bucket[0].name
    axis = n.attr("axis")
    nbytes = rec.bytes if rec is not None else 0
    ranks, link = _over(mesh, links, axis)
    return {"name": rec.name if rec is not None else n.name, "kind": n.op, "axis": axis, "dim": n.attr("dim"),
            "bytes": nbytes, "seconds": 0.0 if in_bucket else collective_seconds(n.op, ranks, nbytes, link),
            "phase": n.phase, "reason": rec.reason if rec is not None and rec.name != n.name else n.attr("reason"),
            "in_bucket": in_bucket, "spec_line": rec.provenance.spec_ref if rec is not None else _spec_ref(n)}


def _module(sharded, producer, consumers) -> str:
    """The module an edge is listed under: its producer's, else a consumer's, else (a backward
    or optimizer value, which the tracer did not see) the module of the forward op it
    differentiates: autodiff names every node it makes for forward node ``v`` ``bw.v.*``
    (``opt.p.*`` for parameter ``p``'s update), so the longest such ``v`` with a module is it."""
    for w in [producer] + consumers:
        if w["source"]:
            return w["source"]
    for w in [producer] + consumers:
        found = _forward_module(sharded, w["name"])
        if found:
            return f"{found} (backward)" if w["name"].startswith("bw.") else f"{found} (optimizer)"
    return "(top level: loss and gradients of no module's op)"


def _forward_module(sharded, name: str):
    """The module of the forward node (or parameter) a ``bw.``/``opt.`` node was made for."""
    for head in ("bw.", "opt."):
        if name.startswith(head):
            parts = name[len(head):].split(".")
            for k in range(len(parts) - 1, 0, -1):
                v = ".".join(parts[:k])
                if v in sharded and sharded[v].source:
                    return sharded[v].source
                if v in sharded and sharded[v].op == "param" and "." in v:
                    return v.rsplit(".", 1)[0]
    return None


def program_comm(prog, links) -> dict:
    """``{"count", "bytes", "seconds"}`` of ``prog.collectives`` (the list report.json holds),
    each priced by :func:`parcomp.cost.links.collective_seconds` as the explanation prices it: the
    figure :func:`explain`'s totals must reproduce."""
    out = {"count": 0, "bytes": 0, "seconds": 0.0}
    for c in prog.collectives:
        ranks, link = _over(prog.mesh, links, c.axis)
        out["count"] += 1
        out["bytes"] += c.bytes
        out["seconds"] += collective_seconds(c.kind, ranks, c.bytes, link)
    return out


def _spec_ref(node):
    loc = node.spec_loc
    return f"{loc.file.rsplit('/', 1)[-1]}:{loc.line}" if loc is not None else None


def _key(step) -> tuple:
    return (step["kind"], step["axis"], step["dim"])


def _step_text(s) -> str:
    dim = "" if s["dim"] is None else f"(dim {s['dim']})"
    fused = " (bucketed)" if s.get("in_bucket") else ""
    return f"{s['kind']}{dim} over {s['axis']}{fused}"


def alternatives(src, tgt, ty, mesh, links, chosen_keys=()) -> list:
    """Other step sequences from layout ``src`` to ``tgt`` of global type ``ty``: the planner's
    plan through one intermediate layout (``src`` or ``tgt`` with one mesh axis's placement
    changed), cheapest first, at most :data:`MAX_ALTERNATIVES`, each
    ``{"via", "steps": [{"kind", "axis", "dim", "bytes", "seconds"}], "bytes", "seconds"}``.

    Only shards that divide the tensor evenly are considered, and an intermediate partial
    placement only where the source is partial on that axis (``R -> P -> R`` sums zeros).
    """
    seen, out = {tuple(chosen_keys)}, []
    for mid in _intermediates(src, tgt, ty, mesh):
        steps = _steps(src, mid, ty, mesh, links) + _steps(mid, tgt, ty, mesh, links)
        key = tuple(_key(s) for s in steps)
        if not steps or key in seen:
            continue
        seen.add(key)
        out.append({"via": layout_str(mid), "steps": steps, "kinds": " + ".join(map(_step_text, steps)),
                    "bytes": sum(s["bytes"] for s in steps),
                    "seconds": sum(s["seconds"] for s in steps)})
    out.sort(key=lambda a: (a["seconds"], a["bytes"], a["kinds"]))
    return out[:MAX_ALTERNATIVES]


def _steps(a, b, ty, mesh, links) -> list:
    out = []
    for st in plan(a, b, ty.rank):
        if st.ranks(mesh) == 1:
            continue
        axis = ",".join(mesh.names[a] for a in st.axes)
        nbytes = step_bytes(st, ty, mesh) if st.is_collective else 0
        n, link = _over(mesh, links, axis)
        out.append({"kind": st.kind, "axis": axis, "dim": st.dim, "bytes": nbytes,
                    "seconds": collective_seconds(st.kind, n, nbytes, link)})
    return out


def _over(mesh, links, axis) -> tuple:
    """``(ranks in a group, link)`` of a mesh axis or joint group ``"dp,tp"``: a joint ring
    runs at its slowest axis's link."""
    axes = mesh.axes_of(axis)
    link = min((links[mesh.names[a]] for a in axes), key=lambda lk: lk.gb_per_s)
    return math.prod(mesh.sizes[a] for a in axes), link


def _intermediates(src, tgt, ty, mesh):
    """Layouts one placement away from ``src`` or ``tgt`` (not either), even, no new partial."""
    for base in (src, tgt):
        for a in range(len(base)):
            options = [Replicate()] + [Shard(d) for d in range(ty.rank)]
            if isinstance(src[a], Partial):
                options.append(src[a])
            for p in options:
                mid = tuple(p if i == a else q for i, q in enumerate(base))
                if mid not in (tuple(src), tuple(tgt)) and _even(mid, ty, mesh):
                    yield mid


def _even(layout, ty, mesh) -> bool:
    for d in range(ty.rank):
        parts = 1
        for a in shard_axes(layout, d):
            parts *= mesh.sizes[a]
        if ty.shape[d] % parts:
            return False
    return True


def totals(edges) -> dict:
    """``per_axis``, ``per_phase`` and ``per_axis_phase`` (``"tp/forward"``) sums of the edges'
    collective steps: ``{"count", "bytes", "seconds"}`` (bytes per rank per step)."""
    out = {"per_axis": {}, "per_phase": {}, "per_axis_phase": {}}
    for e in edges:
        for s in e["steps"]:
            if s.get("in_bucket") or (s["bytes"] == 0 and s["seconds"] == 0):
                continue  # fused into a bucket (counted at its first member), or a local layout op
            for table, key in (("per_axis", s["axis"]), ("per_phase", s["phase"]),
                               ("per_axis_phase", f"{s['axis']}/{s['phase']}")):
                t = out[table].setdefault(key, {"count": 0, "bytes": 0, "seconds": 0.0})
                t["count"] += 1
                t["bytes"] += s["bytes"]
                t["seconds"] += s["seconds"]
    return out


def format_seconds(s: float) -> str:
    """``"12.3 us"``, ``"4.56 ms"``, ``"1.20 s"``: an estimate for people."""
    if s == 0:
        return "0"
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def cost_words(alt, chosen) -> str:
    """How an alternative compares with the chosen steps, in words."""
    db, dt = alt["bytes"] - chosen["bytes"], alt["seconds"] - chosen["seconds"]
    b = "the same bytes" if db == 0 else f"{format_bytes(abs(db))} {'more' if db > 0 else 'fewer'} bytes"
    t = f"{format_seconds(abs(dt))} {'slower' if dt > 0 else 'faster'}" if dt else "the same time"
    return f"{b}, {t}"
