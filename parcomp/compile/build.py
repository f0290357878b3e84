"""The Program of one rank built from the sharded and local graphs: process groups, every
collective with its provenance and cost, the training loop (:mod:`parcomp.compile.program`).
"""
from __future__ import annotations

import os
from dataclasses import replace

from ..cost.topology import axis_groups, joint_groups
from ..ir.graph import Graph
from ..ir.ops import COLLECTIVES
from ..ir.redistribute import Step, step_bytes
from ..ir.types import Shard, TensorType, layout_str
from ..passes.attention.cp_ring import ring_records
from ..passes.lowering.bucket import bucketed_members
from ..spec.train_config import train_config
from .program import Collective, Program, Provenance, TrainLoop


def build_program(sharded: Graph, local: Graph, spec) -> Program:
    """The :class:`Program` of a compiled graph.

    Args:
        sharded: the global graph with every collective (after ``insert-collectives``).
        local: the per-rank graph (after ``localize``); same node names.
        spec: the parsed spec (its ``file`` and ``train`` line).

    Raises:
        parcomp.errors.SpecError: a bad ``train`` line (already checked by then).
    """
    mesh = local.mesh
    groups = {a: axis_groups(mesh, i) for i, a in enumerate(mesh.names)}
    for n in local.nodes:  # joint groups: one entry per axis set a collective uses
        if n.op in COLLECTIVES and n.attr("axis") not in groups:
            groups[n.attr("axis")] = joint_groups(mesh, mesh.axes_of(n.attr("axis")))
    prov = _provenances(local.nodes)
    return Program(local, groups, getattr(spec, "file", None), {n.name: n.phase for n in local.nodes},
                   prov, _collectives(sharded, local, prov), _train_loop(local, spec), sharded.search,
                   {"topology": getattr(spec, "topology", None), **dict(getattr(spec, "launch", ()))})


def stage_programs(plan, spec) -> tuple:
    """Per virtual stage of a pipeline ``plan`` (after ``lower-stages``), ``{kind: Program}`` of
    each of its lowered programs (forward, backward, optimizer, ...): the facts the SPMD
    program's step is printed from (provenance, each collective's bytes and reason), so a stage
    function is printed by the same code; ``train`` is None (the pipeline runtime runs the loop)."""
    return tuple({k: _stage_program(st.sharded.get(k), g, spec) for k, g in st.programs.items()}
                 for st in plan.lowered)


def _stage_program(sharded: Graph | None, local: Graph, spec) -> Program:
    """One stage program's :class:`Program`; ``sharded``: the global graph it was localized from
    (None: a stage's own unsharded graph, which has no collectives)."""
    phases, prov = {n.name: n.phase for n in local.nodes}, _provenances(local.nodes)
    if sharded is None or local.mesh is None:
        return Program(local, {}, getattr(spec, "file", None), phases, prov, (), None)
    prog = build_program(_restricted(sharded, local), local, spec)
    return replace(prog, train=None)


def _restricted(sharded: Graph, local: Graph) -> Graph:
    """``sharded`` cut to what ``local`` computes (a ZB-H1 half of a backward): a value ``local``
    takes as an input is an input here, and only the nodes ``local``'s values depend on stay
    (with those its lowering fused away, which their readers still name here)."""
    cut = {n.name: replace(n, op="input", inputs=()) for n in sharded.nodes
           if n.name in local and local[n.name].op == "input" and n.op != "input"}
    todo, keep = [n.name for n in local.nodes if n.name in sharded], set()
    while todo:
        v = todo.pop()
        if v not in keep:
            keep.add(v)
            todo.extend(cut[v].inputs if v in cut else sharded[v].inputs)
    if len(keep) == len(sharded.nodes) and not cut:
        return sharded
    nodes = [cut.get(n.name, n) for n in sharded.nodes if n.name in keep]
    outs = [(k, v) for k, v in sharded.named_outputs() if v in keep]
    return replace(sharded, nodes=tuple(nodes), outputs=tuple(v for _, v in outs),
                   output_names=tuple(k for k, _ in outs), search=None)


def _provenances(nodes) -> dict:
    """``{name: _provenance(node)}``; nodes with the same spec rule and source share one
    (immutable, compared by value) record: a deep model's nodes have few distinct ones."""
    made, out = {}, {}
    for n in nodes:
        loc = n.spec_loc
        key = (n.source,) if loc is None else (n.source, loc.file, loc.line)
        got = made.get(key)
        if got is None:
            got = made[key] = _provenance(n)
        out[n.name] = got
    return out


def _provenance(node) -> Provenance:
    loc = node.spec_loc
    if loc is None:
        return Provenance(source=node.source)
    return Provenance(os.path.basename(loc.file), loc.line, node.source)


def _collectives(sharded, local, prov) -> tuple:
    users, outs = sharded.users(), {v: p for p, v in sharded.named_outputs()}
    recs, bucketed = [], set()
    for n in sharded.nodes:
        recs += [Collective(**r, provenance=prov[n.name]) for r in ring_records(sharded, local, n)]
        if n.op not in COLLECTIVES:
            continue
        bucket = bucketed_members(local, n.name)  # norms part: passes/lowering/bucket.py
        if bucket is not None:
            if bucket[0].name not in bucketed:
                bucketed.add(bucket[0].name)
                recs.append(_bucket_record(sharded, local, bucket, prov))
            continue
        src = sharded[n.inputs[0]]
        step = _step(sharded.mesh, n, src)
        consumers = [f"{sharded[u].op} %{u}" for u in users[n.name]]
        if n.name in outs:
            consumers.append(f"output {outs[n.name]}")
        recs.append(Collective(
            n.name, n.op, n.attr("axis"), n.attr("dim"), n.type.dtype, tuple(local[src.name].type.shape),
            layout_str(src.layout), layout_str(n.layout), step_bytes(step, n.type, sharded.mesh),
            n.phase, src.name, tuple(consumers), _collective_reason(local, n), prov[n.name]))
    return tuple(recs)


def _collective_reason(local, n):
    """``n``'s reason; a ragged all_to_all's (parcomp/passes/lowering/moe_ragged.py) says how it sends."""
    if n.name not in local or not local[n.name].attr("ragged"):
        return n.attr("reason")
    return (n.attr("reason") or "") + ("; ragged: only the routed tokens' rows travel, after the per-rank "
                                       "split sizes (one byte per row); bytes here: the padded buffer's, "
                                       "an upper bound")


def _step(mesh, n, src, after=None) -> Step:
    """The :class:`Step` layout op ``n`` (one axis or a joint group) takes ``src`` by."""
    axes = mesh.axes_of(n.attr("axis"))
    return Step(n.op, axes[0], n.attr("dim"), n.attr("src_dim"), src.layout,
                n.layout if after is None else after, group=axes if len(axes) > 1 else ())


def _bucket_record(sharded, local, bucket, prov) -> Collective:
    """The one all_reduce of a bucket of gradients (its members' records merged): norm-weight
    gradients (passes/lowering/bucket.py) or dp gradients (passes/lowering/dp_buckets.py). Bytes are
    the flat buffer's, whose layout is the bucket_cat's (a split member makes it S(0))."""
    ar, parts = bucket
    cat = local[ar.inputs[0]]
    step = _step(sharded.mesh, ar, cat, ar.layout)
    flat = TensorType((ar.type.numel * _split_ranks(cat.layout, sharded.mesh),), ar.type.dtype)
    consumers = tuple(f"bucket_part %{p}" for p in parts)
    return Collective(ar.name, "all_reduce", ar.attr("axis"), None, ar.type.dtype, tuple(ar.type.shape),
                      layout_str(cat.layout), layout_str(ar.layout), step_bytes(step, flat, sharded.mesh),
                      ar.phase, ar.inputs[0], consumers, ar.attr("reason"), prov[ar.name])


def _split_ranks(layout, mesh) -> int:
    """How many ranks' blocks make the global value of a ``layout`` (the split axes' sizes)."""
    n = 1
    for size, p in zip(mesh.sizes, layout):
        n *= size if isinstance(p, Shard) else 1
    return n


def _train_loop(local, spec) -> TrainLoop | None:
    """The loop facts, from the phases ``autodiff`` set (nothing is read from a name's shape)."""
    if getattr(spec, "train", None) is None:
        return None
    cfg = train_config(spec)
    params = {n.name for n in local.params}
    carried = tuple(pub for pub, _ in local.named_outputs() if pub in params)
    optimizer = {n.name for n in local.params if n.phase == "optimizer"}
    state = tuple(c for c in carried if c in optimizer)
    step = next((n.name for n in local.inputs if n.phase == "optimizer"), None)
    dp = spec.mesh.sizes[spec.mesh.axis_index("dp")] if "dp" in spec.mesh.names else 1
    batch = cfg.batch or next((n.attr("global_shape")[0] for n in local.inputs
                               if n.attr("global_shape")), None)
    return TrainLoop(cfg.steps, carried, state, step, "loss", cfg.loss, cfg.optimizer, cfg.hyper,
                     cfg.zero, dp, batch, cfg.options)
