"""bucket-dp-grads: data-parallel gradient reductions grouped into flat buffers.

After ``shard-prop`` a data-parallel training step reduces every weight gradient with its
own ``all_reduce`` over ``dp`` (the last ``all_reduce`` of a gradient's backward, read
only by the optimizer or as the step's ``<param>.grad`` output). This lowering (run on the
local program after ``bucket-norm-grads``, before ``overlap-collectives``) groups them as
torch's DistributedDataParallel does: walking the gradients in the order backward produces
them, each bucket takes gradients until ``bucket_cap_mb`` MiB (``train ... bucket_cap_mb=25``,
DDP's name and default; ``0``: one all_reduce per parameter), and becomes

    bucket_cat (flatten, concatenate) -> one all_reduce -> bucket_part (a view per gradient)

The ``bucket_cat`` and the ``all_reduce`` sit right after the bucket's last gradient is
produced; the parts sit just before the first gradient is read (the optimizer), so
``overlap-collectives`` starts the all_reduce asynchronously there and waits for it before
the optimizer. Each part keeps the old all_reduce's name, so its readers are unchanged.

**Which gradients share a bucket.** One all_reduce reduces over one group: the members
reduce over the same axis, in the same dtype, from ``P`` to ``R`` there. On every other
mesh axis the flat buffer must still be one value with one layout (the interpreter, the
report's bytes and ``check`` read its layout): a member split over ``tp`` (any dim) makes
the buffer ``S(0)`` there (the global buffer is the concatenation of the tp ranks' flat
buffers), a member replicated over ``tp`` makes it ``R``, a partial one ``P``. So the
gradients of tp-sharded weights and those of tp-replicated ones (a row-parallel bias) go
to different buckets of the same dp group.

**Chosen by the cost model** (``redistribute``'s constants, the planner's): a bucket of n
gradients costs one call, ``ALPHA_S``, instead of n, plus copying its elements into the
flat buffer (``SECONDS_PER_FLOP`` an element; the parts are views); the ring bytes are the
same. A bucket is made when it is cheaper: many small gradients are latency-bound (100 us
a call against 0.01 ns an element copied), so below the cap they are always bucketed;
gradients so large that copying them costs more than the calls saved stay on their own.
"""
from __future__ import annotations

from dataclasses import replace

from parcomp.ir.graph import Graph
from parcomp.ir.redistribute import ALPHA_S, BETA_S_PER_BYTE, SECONDS_PER_FLOP
from parcomp.ir.types import Partial, Shard, TensorType, layout_str
from parcomp.spec.train_config import BUCKET_KEY, DEFAULT_CAP_MB, bucket_cap_bytes

#: the data-parallel mesh axis (parcomp's convention: the axis named dp)
DP_AXIS = "dp"


def _flat_placement(p):
    """The flat buffer's placement on an axis a member has placement ``p`` on (docstring)."""
    if isinstance(p, Shard):
        return Shard(0)
    return p


#: ops a gradient may pass through between its reduction and the optimizer (a .pcir weight
#: used as ``permute(w)`` gets its gradient as ``permute(all_reduce(...))``)
VIEWS = ("permute", "reshape")


def tail(graph, name, users) -> tuple:
    """``(views, readers)``: the backward views computed from value ``name`` (transitively,
    program order) and the other nodes that read ``name`` or one of those views."""
    views, readers, todo = [], [], [name]
    while todo:
        for u in users[todo.pop()]:
            n = graph[u]
            if n.op in VIEWS and n.phase == "backward":
                views.append(u)
                todo.append(u)
            else:
                readers.append(u)
    pos = {n.name: i for i, n in enumerate(graph.nodes)}
    return sorted(views, key=pos.__getitem__), readers


def _is_dp_grad_reduction(graph, n, users, outs) -> bool:
    """A backward all_reduce (sum) over dp of a gradient read, through views, only by the
    optimizer (or as the step's output)."""
    if n.op != "all_reduce" or n.attr("axis") != DP_AXIS or n.attr("async_op") or n.phase != "backward":
        return False
    if n.attr("reduce_op", "sum") != "sum" or graph[n.inputs[0]].op == "bucket_cat":
        return False
    views, readers = tail(graph, n.name, users)
    out = n.name in outs or any(v in outs for v in views)
    return bool(readers or out) and all(graph[r].phase == "optimizer" for r in readers)


def placeable(graph, members) -> list:
    """The members whose readers (past their views) all come after the last member's operand."""
    pos, users = {n.name: i for i, n in enumerate(graph.nodes)}, graph.users()
    members = list(members)
    while len(members) > 1:
        last = max(pos[m.inputs[0]] for m in members)
        late = [m for m in members if all(pos[r] > last for r in tail(graph, m.name, users)[1])]
        if len(late) == len(members):
            return members
        members = late
    return members


def candidates(graph: Graph) -> dict:
    """(axis, dtype, flat layout before, after) -> dp gradient all_reduces, in backward order."""
    users, outs = graph.users(), set(graph.outputs)
    pos = {n.name: i for i, n in enumerate(graph.nodes)}
    groups = {}
    for n in graph.nodes:
        if not _is_dp_grad_reduction(graph, n, users, outs):
            continue
        before = tuple(_flat_placement(p) for p in graph[n.inputs[0]].layout)
        after = tuple(_flat_placement(p) for p in n.layout)
        if any(isinstance(p, Partial) and p.op != "sum" for p in before):
            continue
        groups.setdefault((n.attr("axis"), n.type.dtype, before, after), []).append(n)
    for ms in groups.values():
        ms.sort(key=lambda m: pos[m.inputs[0]])
    return groups


def cut(members, cap: int) -> list:
    """Members (in backward order) cut into runs of at most ``cap`` bytes (a larger one alone)."""
    runs, cur, held = [], [], 0
    for m in members:
        if cur and held + m.type.nbytes > cap:
            runs.append(cur)
            cur, held = [], 0
        cur.append(m)
        held += m.type.nbytes
    return runs + ([cur] if cur else [])


def costs(members, dp: int) -> tuple:
    """``(seconds as one all_reduce per gradient, seconds as one bucket)`` (module docstring)."""
    ring = sum(2 * (dp - 1) * m.type.nbytes // dp for m in members) * BETA_S_PER_BYTE
    copy = sum(m.type.numel for m in members) * SECONDS_PER_FLOP
    return len(members) * ALPHA_S + ring, ALPHA_S + ring + copy


def _why(members, per, one) -> str:
    return (f"one all_reduce instead of {len(members)}: {one * 1e6:.1f} us vs {per * 1e6:.1f} us in the "
            f"cost model ({ALPHA_S * 1e6:g} us a call, copying {sum(m.type.numel for m in members)} "
            f"elements into the flat buffer)")


def plan(graph: Graph, cap: int) -> list:
    """``[(members, reason, bucketed)]``: every run of dp gradient reductions and the decision
    (a run of one gradient, or one not bucketed, says why in ``reason``)."""
    out = []
    if graph.mesh is None or DP_AXIS not in graph.mesh.names:  # no mesh: no dp axis
        return out
    dp = graph.mesh.sizes[graph.mesh.names.index(DP_AXIS)]
    for key, members in candidates(graph).items():
        for run in (cut(members, cap) if cap > 0 else [[m] for m in members]):
            placed = placeable(graph, run)
            late = [m for m in run if m not in placed]
            for m in late:
                out.append(([m], "not bucketed: read before the last gradient of its bucket is produced", False))
            if len(placed) < 2:
                out += [([m], _alone(m, cap, key[2]), False) for m in placed]
                continue
            per, one = costs(placed, dp)
            if one < per:
                out.append((placed, _why(placed, per, one), True))
            else:
                out.append((placed, f"not bucketed: copying into a bucket costs more ({one * 1e6:.1f} us) "
                            f"than the calls it saves ({per * 1e6:.1f} us as one all_reduce per gradient)",
                            False))
    return out


def _alone(m, cap, flat) -> str:
    if cap == 0:
        return f"not bucketed: {BUCKET_KEY}=0 (one all_reduce per gradient)"
    if m.type.nbytes > cap:
        return f"not bucketed: {m.type.nbytes} bytes, larger than the bucket cap ({cap} bytes)"
    return (f"not bucketed: the only {m.type.dtype} gradient reduced over dp whose flat buffer would be "
            f"{layout_str(flat)} (one all_reduce holds one layout: a gradient split over another axis "
            f"and one replicated there cannot share a buffer)")


def _bucket(graph, members, index, reason, total_buckets) -> Graph:
    """``graph`` with ``members`` (placeable, backward order) reduced as one flat buffer."""
    pos = {n.name: i for i, n in enumerate(graph.nodes)}
    users, first = graph.users(), members[0]
    axis, src = first.attr("axis"), graph[first.inputs[0]]
    names = {n.name for n in graph.nodes}
    cat_name = f"bw.grad_bucket{index}.{axis}"
    while cat_name in names or f"{cat_name}.all_reduce" in names:
        cat_name += "_"
    ar_name = f"{cat_name}.all_reduce"
    flat = TensorType((sum(m.type.numel for m in members),), first.type.dtype)
    before = tuple(_flat_placement(p) for p in src.layout)
    after = tuple(_flat_placement(p) for p in first.layout)
    cat = replace(first, name=cat_name, op="bucket_cat", inputs=tuple(m.inputs[0] for m in members),
                  type=flat, attrs=(), layout=before, in_layouts=None)
    grads = ", ".join(_grad_name(graph, m, users) for m in members)
    why = (f"gradient bucket {index + 1} of {total_buckets} over {axis} ({flat.nbytes} bytes a rank): "
           f"{grads}; reduced as soon as the last of them is produced; {reason}")
    ar = replace(first, name=ar_name, inputs=(cat_name,), type=flat, layout=after,
                 attrs=(("axis", axis), ("grad_bucket", index), ("reason", why)))
    parts, offset = {}, 0
    for m in members:
        parts[m.name] = replace(m, op="bucket_part", inputs=(ar_name,),
                                attrs=(("numel", m.type.numel), ("offset", offset)))
        offset += m.type.numel
    last = max(pos[m.inputs[0]] for m in members)
    moved, reads = [], []
    for m in members:
        views, readers = tail(graph, m.name, users)
        moved += views
        reads += [pos[r] for r in readers]
    first_read = min(reads) if reads else len(graph.nodes)
    after = list(parts.values()) + [graph[v] for v in sorted(moved, key=pos.__getitem__)]
    skip = set(parts) | set(moved)
    nodes = []
    for i, n in enumerate(graph.nodes):
        if i == first_read:
            nodes += after
        if n.name not in skip:
            nodes.append(n)
        if i == last:
            nodes += [cat, ar]
    if first_read == len(graph.nodes):
        nodes += after
    return graph.with_nodes(nodes)


def _grad_name(graph, m, users) -> str:
    """The parameter whose gradient ``m`` reduces: its (or its views') ``<param>.grad``
    output, else the parameter its optimizer update reads, else the operand's name."""
    views, readers = tail(graph, m.name, users)
    named = {v: pub for pub, v in graph.named_outputs()}
    for v in [m.name] + views:
        if named.get(v, "").endswith(".grad"):
            return named[v][:-len(".grad")]
    for r in readers:
        for i in graph[r].inputs:
            if graph[i].op == "param" and graph[i].phase != "optimizer":
                return i
    return m.inputs[0]


def bucket_dp_grads(graph: Graph, spec=None) -> Graph:
    """The dp gradient all_reduces of ``graph`` bucketed as :func:`plan` decides (docstring).
    ``spec``: where ``bucket_cap_mb`` is read (None: the default, 25 MiB)."""
    cap = bucket_cap_bytes(spec) if spec is not None else int(DEFAULT_CAP_MB * (1 << 20))
    decided = plan(graph, cap)
    for run, why, ok in decided:
        if not ok:
            graph = graph.with_nodes([n.with_attrs(grad_bucket_note=why) if n.name == run[0].name else n
                                      for n in graph.nodes])
    chosen = [(run, why) for run, why, ok in decided if ok]
    for i, (run, why) in enumerate(chosen):
        graph = _bucket(graph, [graph[m.name] for m in run], i, why, len(chosen))
    return graph


def grad_buckets(program) -> dict | None:
    """``report.json["grad_buckets"]``: which dp gradient all_reduces of the lowered program
    were bucketed, each bucket's members and why, and why the others were not; None for a
    program that is not a training step on a mesh with a dp axis."""
    local = program.graph
    if program.train is None or DP_AXIS not in local.mesh.names:
        return None
    users, buckets, single = local.users(), [], []
    for n in local.by_op("all_reduce"):
        if n.attr("grad_bucket") is not None:
            readers = users[n.name] if not n.attr("async_op") else users[users[n.name][0]]
            parts = [local[p] for p in readers if local[p].op == "bucket_part"]
            buckets.append({"all_reduce": n.name, "axis": n.attr("axis"), "bytes_per_rank": n.type.nbytes,
                            "members": [_grad_name(local, p, users) for p in parts],
                            "reason": n.attr("reason")})
        elif n.attr("grad_bucket_note") is not None:
            single.append({"all_reduce": n.name, "bytes_per_rank": n.type.nbytes,
                           "reason": n.attr("grad_bucket_note")})
    return {"decision": "bucketed" if buckets else "one all_reduce per gradient",
            "buckets": buckets, "unbucketed": single}
