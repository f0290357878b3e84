"""Sequence parallel vs context parallel, for the given sequence length and mesh.

A spec with a ``context-parallel`` or ``sequence-parallel`` statement and a model with
attention (``sdpa``) gets, in report.json (``sp_vs_cp``) and ``parcomp explain``, a small
table: the bytes each rank sends, the collective calls, and the estimated time of the
attention's exchanges per step, for each way of splitting the sequence over the statement's
axis of ``n`` ranks. Per attention layer, with ``q``/``out`` ``[B, H, S, D]``, ``k``/``v``
``[B, Hkv, S, D]`` (kv heads before a GQA repeat), element size ``e``, ``f = (n-1)/n``:

==============  ===========================================  =====================================
way             exchanges (forward; backward mirrored)       bytes per rank, forward
==============  ===========================================  =====================================
SP (on tp)      all_gather of ``[B, S, H D]`` before the      ``2 f B S H D e``
                column-parallel QKV, reduce_scatter after
                the row-parallel output projection
CP all_gather   all_gather of K and of V                      ``2 f B Hkv S D e``
CP all_to_all   all_to_all of Q, K, V (seq -> heads) and of   ``f/n B S D e (2 H + 2 Hkv')``
                the output (heads -> seq)                     (``Hkv'``: Hkv if it divides by n,
                                                              else H: K/V repeated first)
CP ring         n-1 steps, each passing one K and one V block ``2 f B Hkv S D e``
                to the next rank                              (backward: K, V, dK, dV: twice)
CP ring,        the same exchanges on ``chunking=balanced``   the same
balanced        chunks (rank c: chunks c and 2n-1-c of 2n)
==============  ===========================================  =====================================

Work: each way also gets the attention's query-key score pairs the slowest rank computes in
the forward (``work_pairs``: batch x heads x visible pairs, summed over layers; a causal
sdpa's fully masked pairs are not computed). Chunking changes the work, not the bytes: on
contiguous chunks the last rank of a causal ring (or all_gather) attends to every earlier
key, ``n - 1/2`` blocks of pairs, while balanced chunks give every rank the same ``n/2``
(about half; :func:`parcomp.reference.cp_ring.positions`). The all_gather row uses the
spec's chunking (it works with either); SP and all_to_all attend whole sequences on H/n
heads. A balanced row needs a sequence that divides by ``2 n``.

A training step doubles each (backward: reduce_scatter/all_gather, dK/dV reduce_scatter,
the four all_to_all again), except ring, whose backward passes K, V, dK and dV (4 blocks a
step). Times: :func:`parcomp.cost.links.collective_seconds` on the axis's link (the spec's
``topology``, ``parcomp explain``'s model), a ring step one hop (``call_us + hop_us +
bytes / bandwidth``) with no overlap with compute counted. Ring is an estimate from bytes
whether or not a ring lowering is built. Only attention's exchanges are counted: SP also
splits the weights over tp (memory) and its MLP block adds the same exchanges again; CP keeps
weights whole and all-reduces their gradients over the axis, as data parallel does.
"""
from __future__ import annotations

import math

from ..cost.links import axis_links, collective_seconds
from ..ir.types import Shard
from ..reference.cp_ring import positions

_WALK = ("reshape", "expand", "relayout")  # through a GQA repeat (and a pin) to the kv heads
WAYS = ("sp", "all_gather", "all_to_all", "ring", "ring_balanced")
LABELS = {"sp": "SP (Megatron, on tp)", "all_gather": "CP all_gather", "all_to_all": "CP all_to_all",
          "ring": "CP ring (estimate)", "ring_balanced": "CP ring, balanced"}


def attention_layers(graph) -> list:
    """``(B, H, Hkv, S, D, element bytes, causal)`` of every forward sdpa of ``graph``."""
    out = []
    for n in graph.nodes:
        if n.op == "sdpa" and n.phase in (None, "forward"):
            b, h, s, d = n.type.shape
            out.append((b, h, _kv_heads(graph, n.inputs[1], h), s, d, n.type.nbytes // n.type.numel,
                        bool(n.attr("causal", False))))
    return out


def slowest_pairs(chunking: str, n: int, s: int, causal: bool) -> int | None:
    """Query-key pairs the busiest of ``n`` ranks computes for one head of a sequence of ``s``
    split over them in ``chunking`` (``contiguous`` / ``balanced``; causal: only a key at or
    before the query's global position). None: ``s`` does not split that way."""
    if s % (2 * n if chunking == "balanced" else n):
        return None
    if not causal:
        return (s // n) * s
    return max(int((positions(chunking, n, c, s // n) + 1).sum()) for c in range(n))


def _kv_heads(graph, name, heads) -> int:
    """The fewest heads on the way up from sdpa operand ``name`` through a GQA repeat."""
    node, want = graph[name], graph[name].type.shape
    while node.op in _WALK:
        node = graph[node.inputs[0]]
        s = node.type.shape
        if node.type.rank == 4 and (s[0], s[2], s[3]) == (want[0], want[2], want[3]):
            heads = min(heads, s[1])
    return heads


def _p2p_seconds(nbytes, link) -> float:
    return (link.call_us + link.hop_us) * 1e-6 + nbytes / (link.gb_per_s * 1e9)


def layer_ways(b, h, hkv, s, d, e, n, link, train: bool, causal: bool = True,
               chunking: str = "contiguous") -> dict:
    """The ways (:data:`WAYS`) for one attention layer on ``n`` ranks: ``{way: {collectives,
    calls, bytes_per_rank, seconds, possible, work_pairs}}`` per step (``train``: forward and
    backward; ``work_pairs``: the slowest rank's forward score pairs, :func:`slowest_pairs`;
    ``chunking``: the spec's, for the all_gather row)."""
    f = (n - 1) / n
    act, kv = b * s * h * d * e, b * hkv * s * d * e
    hkv_a2a = hkv if hkv % n == 0 else h
    a2a_q, a2a_kv = int(f * act / n), int(f * b * hkv_a2a * s * d * e / n)
    sides = 2 if train else 1
    blk = kv // n
    ways = {
        "sp": ([("all_gather", int(f * act)), ("reduce_scatter", int(f * act))] * sides,
               "all_gather + reduce_scatter of [B, S, hidden]", h % n == 0),
        "all_gather": ([("all_gather", int(f * kv))] * 2 + [("reduce_scatter", int(f * kv))] * 2 * (sides - 1),
                       "all_gather K, V" + ("; reduce_scatter dK, dV" if train else ""), True),
        "all_to_all": ([("all_to_all", a2a_q), ("all_to_all", a2a_kv), ("all_to_all", a2a_kv),
                        ("all_to_all", a2a_q)] * sides, "all_to_all Q, K, V, out" + (" (and grads)" if train else ""),
                       h % n == 0),
    }
    out = {k: {"collectives": what, "calls": len(calls), "bytes_per_rank": sum(c for _, c in calls),
               "seconds": sum(collective_seconds(kind, n, c, link) for kind, c in calls), "possible": ok}
           for k, (calls, what, ok) in ways.items()}
    steps = [2 * blk] * (n - 1) + ([4 * blk] * (n - 1) if train else [])
    ring = {"collectives": f"{n - 1} send/recv step(s) of K, V" + (" (backward: K, V, dK, dV)" if train else ""),
            "calls": len(steps), "bytes_per_rank": sum(steps),
            "seconds": sum(_p2p_seconds(c, link) for c in steps), "possible": True}
    out["ring"], out["ring_balanced"] = ring, dict(ring)
    whole = b * (h // n) * slowest_pairs("contiguous", 1, s, causal) if h % n == 0 else None
    for way, chunks in (("sp", None), ("all_to_all", None), ("all_gather", chunking),
                        ("ring", "contiguous"), ("ring_balanced", "balanced")):
        pairs = whole if chunks is None else slowest_pairs(chunks, n, s, causal)
        out[way]["work_pairs"] = None if pairs is None else (pairs if chunks is None else b * h * pairs)
        out[way]["possible"] = out[way]["possible"] and pairs is not None
    return out


def heads_split(sharded, axis: str) -> int:
    """Over how many ranks of the mesh axes other than ``axis`` the first forward sdpa of the
    ``sharded`` graph splits its heads (dim 1: tp's heads under CP x TP, docs/design/context_parallel.md); 1
    when none does or ``sharded`` is None."""
    for n in (sharded.nodes if sharded is not None else ()):
        if n.op == "sdpa" and n.phase in (None, "forward") and n.layout:
            mesh = sharded.mesh
            return math.prod(size for name, size, p in zip(mesh.names, mesh.sizes, n.layout)
                             if name != axis and isinstance(p, Shard) and p.dim == 1)
    return 1


def sp_vs_cp(graph, spec, links: dict, sharded=None) -> dict | None:
    """The comparison for ``graph`` (the unsharded model) under ``spec`` (None without a
    ``context-parallel`` / ``sequence-parallel`` statement or without attention): the axis
    and its size, the sequence length, this spec's way, and per way the sums over the model's
    attention layers. ``links``: ``{mesh axis: Link}`` (:func:`parcomp.cost.links.axis_links`).
    ``sharded``: the sharded graph; under CP x TP each rank exchanges only its own heads
    (``heads / t``, kv heads ``kv / t``, all ``kv`` when they do not divide by ``t``: the
    program then keeps K and V whole over tp before the GQA repeat; ``t``: :func:`heads_split`)."""
    cp, sp = getattr(spec, "context_parallel", None), getattr(spec, "sequence_parallel", None)
    layers = attention_layers(graph)
    if (cp is None and sp is None) or not layers:
        return None
    axis = cp.axis if cp is not None else sp[0]
    split = heads_split(sharded, axis) if cp is not None else 1
    layers = [(b, h // split, hkv // split if hkv % split == 0 else hkv, *rest) for b, h, hkv, *rest in layers]
    n = spec.mesh.sizes[spec.mesh.names.index(axis)]
    train = spec.train is not None
    chunking = cp.chunking if cp is not None else "contiguous"
    total = {w: {"collectives": "", "calls": 0, "bytes_per_rank": 0, "seconds": 0.0, "possible": True,
                 "work_pairs": 0} for w in WAYS}
    for layer in layers:
        for w, r in layer_ways(*layer[:6], n, links[axis], train, layer[6], chunking).items():
            t = total[w]
            ok = t["possible"] and r["possible"]
            t.update(collectives=r["collectives"], calls=t["calls"] + r["calls"],
                     bytes_per_rank=t["bytes_per_rank"] + r["bytes_per_rank"],
                     seconds=t["seconds"] + r["seconds"], possible=ok,
                     work_pairs=t["work_pairs"] + r["work_pairs"] if ok else None)
    b, h, hkv, s, d, _, _ = layers[0]
    mine = "sp" if cp is None else ("ring_balanced" if cp.lowering == "ring" and chunking == "balanced"
                                    else cp.lowering)
    return {"axis": axis, "ranks": n, "seq": s, "heads": h, "kv_heads": hkv, "layers": len(layers),
            "heads_split": split,
            "link": links[axis].name, "per": "training step" if train else "forward",
            "chunking": chunking, "this_spec": mine, "ways": total}


def sp_cp_record(graph, spec, placement: dict, sharded=None) -> dict:
    """``{"sp_vs_cp": ...}`` for report.json, or ``{}`` (see :func:`sp_vs_cp`)."""
    if getattr(spec, "context_parallel", None) is None and getattr(spec, "sequence_parallel", None) is None:
        return {}
    rec = sp_vs_cp(graph, spec, axis_links(spec, placement), sharded)
    return {"sp_vs_cp": rec} if rec else {}


def sp_cp_lines(rec: dict) -> list:
    """The small table ``parcomp explain`` prints for :func:`sp_vs_cp`'s record."""
    per_rank = f" per {rec['heads_split']}-way heads split" if rec.get("heads_split", 1) > 1 else ""
    out = [f"SP vs CP: sequence {rec['seq']}, {rec['heads']} heads ({rec['kv_heads']} kv){per_rank}, "
           f"{rec['layers']} attention layer(s), {rec['ranks']} ranks over {rec['axis']} "
           f"({rec['link']}), per {rec['per']}, attention exchanges only:",
           f"  {'way':24s} {'calls':>5s} {'bytes/rank':>11s} {'est. us':>9s} {'work':>10s}  exchanges"]
    for w in WAYS:
        r = rec["ways"][w]
        mark = "  <- this spec" if w == rec["this_spec"] else ""
        label = LABELS[w] + (", balanced" if w == "all_gather" and rec.get("chunking") == "balanced" else "")
        if not r["possible"]:
            why = (f"sequence {rec['seq']} does not split into {2 * rec['ranks']} chunks" if w == "ring_balanced"
                   else f"heads do not divide by {rec['ranks']}")
            out.append(f"  {label:24s} {'-':>5s} {'-':>11s} {'-':>9s} {'-':>10s}  {why}{mark}")
            continue
        out.append(f"  {label:24s} {r['calls']:5d} {r['bytes_per_rank']:11d} {r['seconds'] * 1e6:9.1f} "
                   f"{r['work_pairs']:10d}  {r['collectives']}{mark}")
    out.append("  work: query-key score pairs the slowest rank computes in the forward attention "
               "(a causal mask's skipped pairs not counted)")
    return out
