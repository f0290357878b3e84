"""Tensor parallel inside a pipeline stage: each stage's programs sharded over the inner mesh.

The inner mesh is the spec's mesh less ``pp`` and ``dp`` (``mesh dp=2 pp=2 tp=2`` gives
``tp=2``): ``pp`` is the pipeline (p2p between stages) and ``dp`` the replicas (gradients
all-reduced once per step), both run by the pipeline runtime.  Each of a stage's three
global graphs (:mod:`.stage_train`) goes through shard-prop, insert-collectives and
localize on the inner mesh, with its sources and outputs pinned so the three agree:

* params, their ``grad.<p>`` (backward output and optimizer input) and optimizer state
  take the spec's layout of the param, projected on the inner axes (Megatron: each tp rank
  holds, differentiates and updates its own shard);
* values crossing a stage cut and their gradients, the loss and batch inputs are
  replicated over the inner mesh (each tp rank of a stage sends and receives the whole
  activation, as Megatron without scatter-gather);
* a stashed value keeps the layout the forward produced it in; the backward takes it so.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from parcomp.errors import SpecError
from parcomp.ir.graph import Graph, Node, make_attrs
from parcomp.ir.types import Mesh, layout_str, replicated
from .stage_train import grad_name

__all__ = ["StageLocal", "inner_mesh", "shard_stages"]

OUTER = ("pp", "dp")


@dataclass(frozen=True)
class StageLocal:
    """One stage's per-rank programs on the inner mesh.

    Attributes:
        forward, backward, optimizer: localized graphs (``stage == "local"``), collectives
            over inner axes explicit; same inputs and outputs as the global stage graphs.
        layouts: ``{source or output name: layout on the inner mesh}`` of every value that
            crosses between programs, the runtime and the checkpoint (params, state,
            ``grad.<p>``, ``saved.<v>``).
        stats: the per-rank program of the sums every stage agrees on (clip_grad_norm), or None.
        sharded: ``{kind: global sharded graph}`` of the programs above (``forward``,
            ``backward``, ``optimizer``, ``stats``): every collective with its global types,
            what a collective's bytes are computed from (:mod:`parcomp.compile.build`).
    """

    forward: Graph
    backward: Graph
    optimizer: Graph
    layouts: dict
    stats: Graph | None = None
    sharded: dict | None = None


def inner_mesh(mesh: Mesh) -> Mesh:
    """The spec's mesh less ``pp`` and ``dp``: the axes that shard inside a stage."""
    return Mesh(tuple((a, n) for a, n in mesh.axes if a not in OUTER))


def _project(layout, mesh: Mesh) -> tuple:
    """A layout on the full mesh restricted to the inner axes."""
    return tuple(p for a, p in zip(mesh.names, layout) if a not in OUTER)


def shard_stages(stages, bound: Graph, mesh: Mesh, loc, shard) -> tuple:
    """One :class:`StageLocal` per stage of ``stages`` (:class:`~.stage_train.StagePrograms`),
    the param layouts read from ``bound`` (the model graph after bind-layouts on ``mesh``);
    ``shard(graph) -> (sharded, local)``: the sharding passes of the one pass list
    (:mod:`parcomp.passes.pass_list`, group ``shard``: shard-prop, insert-collectives, localize).

    Raises:
        SpecError: a param split over ``dp`` or ``pp`` (ZeRO-style sharding is not run inside
            a pipeline), at its layout rule (else ``loc``). ShardingError: a layout that does not split evenly.
    """
    inner = inner_mesh(mesh)
    out = []
    for st in stages:
        lay = {}
        for p in st.params + tuple(n.name for n in st.forward.params):
            full = bound[p].layout
            for a, pl in zip(mesh.names, full):
                if a in OUTER and str(pl) != "R":
                    raise SpecError(f"param {p} is laid out {layout_str(full)}: inside a pipeline "
                                    f"a param may split only over {', '.join(inner.names)}",
                                    bound[p].spec_loc or loc)
            lay[p] = _project(full, mesh)
        rules = {p: bound[p].spec_loc for p in lay if p in bound and bound[p].spec_loc is not None}
        out.append(_shard_stage(st, lay, inner, lambda g: shard(_with_rules(g, rules))))
    return tuple(out)


def _shard_stage(st, params: dict, inner: Mesh, shard) -> StageLocal:
    rep = replicated(len(inner.axes))
    fixed = {**params, **{grad_name(p): params[p] for p in st.params}}
    fwd = _shard(shard, st.forward, inner, fixed, rep, {v: rep for v in (*st.send, "loss")})
    saved = {f"saved.{v}": fwd[0][v].layout for v in st.saved}
    lay = {**fixed, **saved, **{v: l for v, l in zip(st.saved, saved.values())}}
    bw_out = {grad_name(v): rep for v in st.recv}
    bw_out.update({grad_name(p): params[p] for p in st.params})
    bwd = _shard(shard, st.backward, inner, lay, rep, bw_out)
    opt_lay = dict(fixed)
    for n in st.optimizer.params:  # optimizer state: as its param (named <p>.<state>)
        if n.name not in opt_lay:
            owner = max((p for p in params if n.name.startswith(p + ".")), key=len, default=None)
            opt_lay[n.name] = params[owner] if owner else rep
    opt_out = {}
    for pub, v in st.optimizer.named_outputs():
        base = pub[:-len(".grad")] if pub.endswith(".grad") else pub
        opt_out[pub] = opt_lay.get(base, opt_lay.get(v, rep))
    opt = _shard(shard, st.optimizer, inner, opt_lay, rep, opt_out)
    layouts = {**opt_lay, **saved, **{k: v for k, v in opt_out.items()}}
    stats = None
    if st.stats is not None:  # a scalar every rank of the stage holds whole (tp's partials reduced)
        stats = _shard(shard, st.stats, inner, fixed, rep, {k: rep for k in st.stats.output_names})
    sharded = {"forward": fwd[0], "backward": bwd[0], "optimizer": opt[0],
               **({"stats": stats[0]} if stats else {})}
    return StageLocal(fwd[1], bwd[1], opt[1], layouts, stats[1] if stats else None, sharded)


def _with_rules(graph: Graph, rules: dict) -> Graph:
    """``graph`` with each param's spec rule (``spec_loc``, from the bound model graph) set, so
    the collectives its layout causes name that rule, as in the SPMD program."""
    if not any(n.name in rules and n.op == "param" for n in graph.nodes):
        return graph
    return graph.with_nodes([replace(n, spec_loc=rules[n.name]) if n.op == "param" and n.name in rules
                             else n for n in graph.nodes])


def _shard(shard, graph: Graph, inner: Mesh, sources: dict, default, outputs: dict) -> tuple:
    """``(global sharded graph, local graph)`` of ``graph`` on ``inner``: sources take
    ``sources[name]`` (else ``default``), each named output in ``outputs`` is pinned to its
    layout by a ``relayout``; other outputs keep what shard-prop chose."""
    nodes = []
    for n in graph.nodes:
        lay = sources.get(n.name, default) if n.op in ("input", "param") else None
        nodes.append(replace(n, layout=lay, in_layouts=None))
    names = {n.name for n in nodes}
    outs = []
    for pub, v in graph.named_outputs():
        if pub not in outputs:
            outs.append(v)
            continue
        new = f"{pub}.as_stage_output"
        while new in names:
            new += "_"
        names.add(new)
        src = next(n for n in nodes if n.name == v)
        nodes.append(Node(new, "relayout", (v,), src.type, make_attrs(origin=f"stage output {pub}"),
                          outputs[pub], phase=src.phase, source=src.source))
        outs.append(new)
    g = replace(graph, nodes=tuple(nodes), outputs=tuple(outs), mesh=inner)
    return shard(g)  # verified before and after each pass
