"""TP inside every expert vs expert parallel, for the routing of given inputs.

``parcomp explain`` of a model with MoE layers (``moe_dispatch``) adds, per layer, the seed's
two alternatives on the spec's ``ep`` axis (or its first axis) of ``n`` ranks, for the routing
the model's example inputs and weights give (:func:`moe_compare`):

- **TP inside every expert**: every rank holds every expert, each expert's intermediate dim
  split n ways (gate/up colwise, down rowwise), tokens replicated: one ``all_reduce`` of the
  layer's output ``[B, S, H]`` forward and one of ``dx`` backward; bytes ``2 (n-1)/n B S H``
  per rank, the same on every rank; each rank computes 1/n of every routed (token, expert)
  pair.
- **EP**: experts split n ways, rows split n ways; each routed pair's row goes to its
  expert's rank and the expert's output back (forward; the same again for the gradients
  backward). Bytes per rank from the routing: the rows it sends to other ranks and the rows it
  returns; without a capacity (program.py's dropless form, what it runs) plus the per-expert
  counts (one int64 all_to_all per step), with one (the ragged ``all_to_all`` of the slot
  buffer) plus one mask byte per slot; load per rank = the pairs its experts process. The slowest rank sets the time; ``padded_bytes`` is what the dense all_to_all of
  the whole ``[B, E, C, H]`` buffer would send (report.json's static count).

Times: :func:`parcomp.cost.links.collective_seconds` on the axis's link (alpha-beta, per call);
``compute_seconds``: the experts' matmuls of the slowest rank (3 matmuls of ``H x F`` a routed
pair, ``2 H F`` FLOPs each, forward and twice that backward) at the cost model's
:data:`parcomp.ir.redistribute.SECONDS_PER_FLOP`: TP splits every pair's work n ways, EP's slowest
rank does its experts' pairs whole, so their ratio is EP's imbalance; ``step_seconds`` adds the
two.
"""
from __future__ import annotations

import numpy as np

from ..cost.links import collective_seconds
from ..ir.redistribute import SECONDS_PER_FLOP
from ..reference import moe_ops
from ..reference.numpy_ops import NUMPY_OPS


def _values(graph, feeds: dict, wanted: set) -> dict:
    env = {}
    for n in graph.nodes:
        if n.op in ("input", "param"):
            if n.name in feeds:  # a training step's target is not needed for the routing
                env[n.name] = np.asarray(feeds[n.name])
        elif n.op in NUMPY_OPS and all(i in env for i in n.inputs):
            env[n.name] = NUMPY_OPS[n.op]([env[i] for i in n.inputs], n)
        if wanted <= set(env):
            break
    return env


def _pairs_matrix(c, capacity: int, n: int) -> np.ndarray:
    """``m[r, j]``: routed pairs of rank r's rows whose expert rank j holds."""
    b, s, e, pos = moe_ops.slots(c, capacity)
    rows_per, experts_per = c.shape[0] // n, c.shape[2] // n
    m = np.zeros((n, n), np.int64)
    np.add.at(m, (b // rows_per, e // experts_per), 1)
    return m


def layer_compare(x, c, capacity: int, n: int, link, inter: int = 0, dropless: bool = False) -> dict:
    """The two alternatives for one layer: tokens ``x[B, S, H]``, weights ``c[B, S, E]``,
    each expert's intermediate size ``inter`` (0: no compute time). ``dropless``: the program
    runs the layer without a capacity on the routed rows only (program.py's dropless form):
    EP's exchange is one all_to_all of the per-expert counts (int64) per step, then the routed
    rows alone, there and back, forward and backward; else the ragged all_to_all of the slot
    buffer, a mask byte per slot with the rows."""
    bsz, seq, h = x.shape
    experts, isz = c.shape[2], x.dtype.itemsize
    m = _pairs_matrix(c, capacity, n)
    off = m * (1 - np.eye(n, dtype=np.int64))
    if dropless:
        counts = (n - 1) * (experts // n) * 8  # this rank's counts of each other rank's experts
        there, back = off.sum(1) * h * isz, off.sum(0) * h * isz
        ep_bytes = 2 * (there + back) + counts  # forward, and the gradients backward
        ep_s = collective_seconds("all_to_all", n, counts, link)
    else:
        masks = (n - 1) * (bsz // n) * (experts // n) * capacity  # one byte per slot sent elsewhere
        there, back = off.sum(1) * h * isz + masks, off.sum(0) * h * isz + masks
        ep_bytes = 2 * (there + back)  # forward, and the gradients backward
        ep_s = 0.0
    ep_s += 2 * (collective_seconds("all_to_all", n, int(there.max()), link)
                 + collective_seconds("all_to_all", n, int(back.max()), link))
    tp_bytes = 2 * (n - 1) * bsz * seq * h * isz // n
    load = m.sum(0)
    pair_s = 3 * 3 * 2 * h * inter * SECONDS_PER_FLOP  # 3 matmuls, 2HF FLOPs each, forward + 2x backward
    compute = {"ep": float(load.max()) * pair_s, "tp": float(m.sum()) / n * pair_s}
    out = {
        "tokens": bsz * seq, "experts": experts, "ranks": n,
        "tokens_per_expert": [int(t) for t in (moe_ops.slots(c, capacity)[2][:, None]
                                               == np.arange(experts)).sum(0)],
        "ep": {"collective": "all_to_all (dropless)" if dropless else "all_to_all (ragged)",
               "bytes_per_rank": [int(v) for v in ep_bytes],
               "padded_bytes": int(4 * (n - 1) * (bsz // n) * experts * capacity * h * isz // n),
               "load_per_rank": [int(v) for v in load],
               "imbalance": float(load.max() / max(load.mean(), 1e-12)), "seconds": ep_s},
        "tp": {"collective": "all_reduce", "bytes_per_rank": [2 * tp_bytes] * n,
               "load_per_rank": [float(m.sum()) / n] * n, "imbalance": 1.0,
               "seconds": 2 * collective_seconds("all_reduce", n, tp_bytes, link)},
    }
    for key in ("ep", "tp"):
        out[key]["compute_seconds"] = compute[key]
        out[key]["step_seconds"] = out[key]["seconds"] + compute[key]
    return out


def moe_compare(compiled, feeds: dict, links: dict) -> list:
    """One :func:`layer_compare` record (plus ``layer``, ``axis``) per ``moe_dispatch`` of the
    forward pass of ``compiled.logical``, on the ``ep`` axis (else the mesh's first);
    ``bytes``/``seconds`` per training step (forward and backward)."""
    graph, mesh = compiled.logical, compiled.program.mesh
    axis = "ep" if "ep" in mesh.names else mesh.names[0]
    n = mesh.sizes[mesh.names.index(axis)]
    layers = [d for d in graph.nodes if d.op == "moe_dispatch" and d.phase in (None, "forward")]
    env = _values(graph, feeds, {i for d in layers for i in d.inputs})
    out = []
    for d in layers:
        route = graph[d.inputs[1]]
        dropless = route.op == "moe_route" and not route.attr("capacity", 0)  # program.py's dropless form
        rec = layer_compare(env[d.inputs[0]], env[d.inputs[1]], d.attr("capacity"), n, links[axis],
                            _inter(graph, d), dropless)
        wanted = rec["tokens"] * route.attr("top_k")  # (token, expert) pairs routed
        out.append({"layer": d.name, "axis": axis, "capacity": d.attr("capacity"), "dropless": dropless,
                    "dropped": wanted - sum(rec["tokens_per_expert"]), **rec})
    return out


def _inter(graph, dispatch) -> int:
    """The experts' intermediate size: the last dim of the first matmul reading the buffer
    (through its permutes, reshapes and pinned layouts), 0 if none does."""
    users, todo = graph.users(), [dispatch.name]
    while todo:
        for u in users[todo.pop(0)]:
            n = graph[u]
            if n.op == "matmul":
                return n.type.shape[-1]
            if n.op in ("permute", "reshape", "relayout"):
                todo.append(u)
    return 0


def moe_blocks(records: list) -> list:
    """``parcomp explain``'s blocks (:mod:`parcomp.report.explain_text`) for :func:`moe_compare`'s
    records: per layer two lines, then TP vs EP as a table (one short cell per figure)."""
    out = []
    for r in records:
        out.append(("text", [f"MoE layer {r['layer']}: {r['tokens']} tokens, {r['ranks']} ranks over {r['axis']}",
                             f"  tokens per expert {r['tokens_per_expert']}",
                             "  dropless (no capacity): the experts compute the routed rows only; EP sends them "
                             "after the per-expert counts" if r.get("dropless") else
                             f"  capacity {r['capacity']} slots per expert per row; {r['dropped']} (token, expert) "
                             f"pairs dropped past it"]))
        rows = []
        for key, what in (("tp", "TP inside every expert"), ("ep", "EP")):
            a = r[key]
            padded = f" (padded {a['padded_bytes']})" if key == "ep" else ""
            rows.append([what, a["collective"], f"{a['bytes_per_rank']}{padded}", str(a["load_per_rank"]),
                         f"{a['imbalance']:.2f}", f"{a['seconds'] * 1e6:.1f}", f"{a['compute_seconds'] * 1e6:.1f}",
                         f"{a['step_seconds'] * 1e6:.1f}"])
        out.append(("table", f"MoE layer {r['layer']}: TP vs EP per training step (forward + backward)",
                    ["way", "collective", "bytes/rank", "load/rank", "max/mean", "comm us", "experts us",
                     "step us"], rows))
    return out


_SLOT_ENDS = ("moe_combine", "moe_combine_grad_c")


def moe_exchange(graph, recs: list) -> list:
    """report.json's ``moe_exchange``: per MoE layer whose routing has no capacity (program.py
    runs it dropless, on the routed rows only), the ``all_to_all`` records that move its slot
    buffer (from each ``moe_dispatch``, forward and backward, up to the combine) with the
    program's form beside them: the records' ``bytes`` are the dense ``[B, E, C, H]`` buffer's
    (a bound fixed at compile time); program.py sends the routed rows only (``top_k / E`` of
    the buffer's slots when C is the row's tokens and the routing is even; the routing of
    given inputs: ``parcomp explain``), after one all_to_all of the int64 per-expert counts per
    layer and step."""
    by_name, users, out = {n.name: n for n in graph.nodes}, graph.users(), []
    kinds = {r["name"]: r for r in recs if r["kind"] == "all_to_all"}
    routes = [n for n in graph.nodes if n.op == "moe_route"]
    for route in routes:
        if route.attr("capacity", 0):
            continue
        found, todo, seen = [], [u for u in users.get(route.name, ()) if by_name[u].op == "moe_dispatch"], set()
        while todo:
            v = todo.pop()
            if v in seen:
                continue
            seen.add(v)
            if v in kinds:
                found.append(v)
            todo += [u for u in users.get(v, ()) if by_name[u].op not in _SLOT_ENDS]
        if not found:
            continue
        experts, top_k = route.type.shape[-1], route.attr("top_k")
        dense = sum(kinds[v]["bytes"] for v in found)
        out.append({"route": route.name, "form": "dropless", "collectives": sorted(found),
                    "dense_bytes": dense, "even_routing_bytes": dense * top_k // experts,
                    "note": "the records' bytes are the dense slot buffer's; program.py sends the routed rows "
                            "only, after one all_to_all of the per-expert counts per layer and step"})
    return out

