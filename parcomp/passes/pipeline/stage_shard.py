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
from parcomp.ir.types import Mesh, Replicate, Shard, layout_str, replicated, shard_axes
from .stage_train import grad_name

__all__ = ["StageLocal", "inner_mesh", "shard_stages", "update_mesh", "zero_layout"]

OUTER = ("pp", "dp")


@dataclass(frozen=True)
class StageLocal:
    """One stage's per-rank programs on the inner mesh.

    Attributes:
        forward, backward, optimizer: localized graphs (``stage == "local"``), collectives
            over inner axes explicit; same inputs and outputs as the global stage graphs.
        layouts: ``{source or output name: layout}`` of every value that crosses between
            programs, the runtime and the checkpoint (params, state, ``grad.<p>``,
            ``saved.<v>``), on the mesh of the axes ``axes`` names.
        stats: the stats program (``clip_grad_norm``, fp16's overflow count), or None.
        axes: the mesh axes of ``layouts``: () for the inner mesh; with ``zero=1`` the mesh
            less ``pp`` (``dp`` included: the update and the stats run on it, see
            :func:`shard_stages`). Without tp the forward and backward are then the stage's
            global programs (no axis inside the stage to shard them over).
        sharded: ``{kind: global sharded graph}`` of the per-rank programs above (``forward``,
            ``backward``, ``optimizer``, ``stats``; a global program has none): every
            collective with its global types, what its bytes are computed from
            (:mod:`parcomp.compile.build`).
    """

    forward: Graph
    backward: Graph
    optimizer: Graph
    layouts: dict
    stats: Graph | None = None
    axes: tuple = ()
    sharded: dict | None = None


def inner_mesh(mesh: Mesh) -> Mesh:
    """The spec's mesh less ``pp`` and ``dp``: the axes that shard inside a stage."""
    return Mesh(tuple((a, n) for a, n in mesh.axes if a not in OUTER))


def update_mesh(mesh: Mesh) -> Mesh:
    """The mesh a ``zero=1`` update runs on: the spec's mesh less ``pp`` (``dp`` and the inner axes)."""
    return Mesh(tuple((a, n) for a, n in mesh.axes if a != "pp"))


def _project(layout, mesh: Mesh, drop=OUTER) -> tuple:
    """A layout on the full mesh restricted to the axes not in ``drop`` (the inner axes)."""
    return tuple(p for a, p in zip(mesh.names, layout) if a not in drop)


def _lift(layout, inner: Mesh, mesh: Mesh) -> tuple:
    """A layout on ``inner`` written on ``mesh`` (which holds every inner axis): R on the others."""
    by = dict(zip(inner.names, layout))
    return tuple(by.get(a, Replicate()) for a in mesh.names)


def zero_layout(layout, ty, mesh: Mesh) -> tuple:
    """A param's optimizer-state layout under ``zero=1`` on ``mesh`` (the update's mesh): the
    param's ``layout`` also split over ``dp`` along its first dim no other axis splits and
    ``dp`` divides, as the SPMD program's (:func:`parcomp.passes.autodiff.state_layout`); the
    param's own layout where none does (that state stays replicated over dp)."""
    a = mesh.axis_index("dp")
    for d, size in enumerate(ty.shape):
        if not shard_axes(layout, d) and size % mesh.sizes[a] == 0:
            return layout[:a] + (Shard(d),) + layout[a + 1:]
    return layout


def shard_stages(stages, bound: Graph, mesh: Mesh, loc, shard, zero: bool = False) -> tuple:
    """One :class:`StageLocal` per stage of ``stages`` (:class:`~.stage_train.StagePrograms`),
    the param layouts read from ``bound`` (the model graph after bind-layouts on ``mesh``);
    ``shard(graph) -> (sharded, local)``: the sharding passes of the one pass list
    (:mod:`parcomp.passes.pass_list`, group ``shard``: shard-prop, insert-collectives, localize).

    ``zero``: ``zero=1`` over ``dp`` inside each stage. The update and the stats programs run on
    the mesh less ``pp``: ``grad.<p>`` (the sum over the microbatches of this dp rank, which
    the runtime reduce-scatters over dp in float32) and the optimizer state are split over
    ``dp`` (:func:`zero_layout`), the params are whole over dp, and the updated params are
    pinned whole, so the update computes this rank's part and all_gathers the params, as
    the SPMD program's ``zero=1`` step; the stats' sums of squares are all_reduced over dp.

    Raises:
        SpecError: a param split over ``dp`` or ``pp`` (ZeRO-style sharding is not run inside
            a pipeline), at its layout rule (else ``loc``). ShardingError: a layout that does not split evenly.
    """
    inner = inner_mesh(mesh)
    update = update_mesh(mesh) if zero else None
    out = []
    for st in stages:
        lay, full = {}, {}
        for p in st.params + tuple(n.name for n in st.forward.params):
            full = bound[p].layout
            for a, pl in zip(mesh.names, full):
                if a in OUTER and str(pl) != "R":
                    raise SpecError(f"param {p} is laid out {layout_str(full)}: inside a pipeline "
                                    f"a param may split only over {', '.join(inner.names)}",
                                    bound[p].spec_loc or loc)
            lay[p] = _project(full, mesh)
        rules = {p: bound[p].spec_loc for p in lay if p in bound and bound[p].spec_loc is not None}
        bound_shard = _bound_rules(shard, rules)
        if zero:
            st_local = _shard_stage(st, lay, inner, bound_shard, forward=inner.size > 1)
            out.append(_zero_update(st, st_local, inner, update, bound_shard))
        else:
            out.append(_shard_stage(st, lay, inner, bound_shard))
    return tuple(out)


def _zero_update(st, local: StageLocal, inner: Mesh, mesh: Mesh, shard) -> StageLocal:
    """``local`` with its update and stats programs sharded on ``mesh`` (the mesh less pp) for
    ``zero=1`` (:func:`shard_stages`), every layout written on ``mesh``."""
    params = {p: _lift(local.layouts[p], inner, mesh) for p in st.params}
    params.update({n.name: _lift(local.layouts.get(n.name, replicated(len(inner.axes))), inner, mesh)
                   for n in st.optimizer.params if n.phase != "optimizer" and n.name not in params})
    split = {p: zero_layout(params[p], st.optimizer[p].type, mesh) for p in st.params}
    rep = replicated(len(mesh.axes))
    sources = {**params, **{grad_name(p): split[p] for p in st.params}}
    for n in st.optimizer.params:  # optimizer state: as its param's split (named <p>.<state>)
        if n.name not in sources:
            owner = max((p for p in st.params if n.name.startswith(p + ".")), key=len, default=None)
            sources[n.name] = split[owner] if owner else rep
    outs = {}
    for pub, v in st.optimizer.named_outputs():
        if pub.endswith(".grad") and pub[:-len(".grad")] in split:
            outs[pub] = split[pub[:-len(".grad")]]  # the reduced gradient: this rank's part
        else:
            outs[pub] = sources.get(pub, sources.get(v, rep))
    opt = _shard(shard, st.optimizer, mesh, sources, rep, outs)
    stats = None
    if st.stats is not None:  # a scalar every rank of the stage holds whole (dp's, tp's partials reduced)
        stats = _shard(shard, st.stats, mesh, sources, rep, {k: rep for k in st.stats.output_names})
    layouts = {k: _lift(v, inner, mesh) for k, v in local.layouts.items()}
    layouts.update({**sources, **outs})
    sharded = {**(local.sharded or {}), "optimizer": opt[0], **({"stats": stats[0]} if stats else {})}
    return replace(local, optimizer=opt[1], stats=stats[1] if stats else None, layouts=layouts,
                   axes=mesh.names, sharded=sharded)


def _shard_stage(st, params: dict, inner: Mesh, shard, forward: bool = True) -> StageLocal:
    """The stage's programs on ``inner``; ``forward=False`` (an inner mesh of one rank, under
    ``zero=1``): the forward and backward stay the stage's global programs."""
    rep = replicated(len(inner.axes))
    fixed = {**params, **{grad_name(p): params[p] for p in st.params}}
    if not forward:
        layouts = {**fixed, **{n.name: rep for n in st.optimizer.params if n.name not in fixed}}
        return StageLocal(st.forward, st.backward, st.optimizer, layouts, st.stats)
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
    return StageLocal(fwd[1], bwd[1], opt[1], layouts, stats[1] if stats else None, sharded=sharded)


def _bound_rules(shard, rules: dict):
    """``shard`` run on a graph whose params carry their spec rule (:func:`_with_rules`)."""
    return lambda graph: shard(_with_rules(graph, rules))


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
