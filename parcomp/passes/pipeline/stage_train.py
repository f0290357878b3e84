"""The training programs of one pipeline stage: forward, backward (one microbatch) and update.

From a :class:`~parcomp.passes.pipeline.split_stages.StageGraph` this builds three global graphs:

* ``forward``: the stage's forward pass of one microbatch (the last stage adds the loss,
  the mean over the microbatch).  Outputs: the values sent on, ``loss`` (last stage),
  and the values the backward pass needs (``saved``, stashed per microbatch).
* ``backward``: inputs are the saved values, the params, and ``grad.<v>`` for each value
  sent on (the gradient the next stage sends back); outputs ``grad.<v>`` for each value
  received (sent back to the previous stage) and ``grad.<p>`` for every trainable param.
* ``optimizer``: inputs ``grad.<p>`` (the gradients summed over the microbatches and
  scaled once by 1/(microbatches x dp)), params and optimizer state; outputs as the
  unsharded training step's: ``<p>`` updated, ``<p>.grad``, the state.

The gradient arithmetic is :func:`parcomp.passes.autodiff.backward`, the same code the
unsharded step uses, and so is ``recompute=``: the backward is built with the SPMD step's
recomputation armed (:func:`parcomp.spec.train_options.start_recompute` on the stage's graph),
so a value the policy drops is recomputed in ``backward`` (``rc.<v>``, from the values it
keeps) and is not stashed: ``saved`` holds only what the policy keeps and the gradients read.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

from parcomp.errors import SpecError
from parcomp.ir.graph import Graph, Node
from parcomp.ir.liveness import (attention_saved_bytes, layer_norm_saved_bytes, stashed_attention,
                                 stashed_layer_norm, storage_roots)
from parcomp.ir.types import Mesh, TensorType
from parcomp.spec.model import pattern_regex
from parcomp.spec.train_options import start_recompute
from ..autodiff import Builder, optimizer_update, backward
from ..train import amp
from ..train.precision import compute_dtype, lower_forward, wrt_names

__all__ = ["StagePrograms", "stage_programs", "grad_name"]


def grad_name(value: str) -> str:
    """The name of the gradient of ``value`` passed between programs: ``grad.<value>``."""
    return f"grad.{value}"


@dataclass(frozen=True)
class StagePrograms:
    """One stage's programs (see the module docstring) and what flows between them.

    Attributes:
        index: the stage.
        forward, backward, optimizer: the three graphs.
        recv, send: activation values received from / sent to the neighbouring stages.
        saved: values ``forward`` outputs for ``backward`` (stashed per microbatch).
        params: the trainable params of the stage (``grad.<p>`` accumulated over microbatches).
        saved_bytes: bytes one microbatch's stash holds: ``saved``, and what an attention's
            forward kernel keeps for the backward (its output and logsumexp) and a layer
            norm's (its mean and rstd per row) (:func:`_kernel_stash_bytes`).
        stats: with ``clip_grad_norm``, the program from the stage's summed, scaled gradients
            to its share of what every stage must agree on before the update: ``clip.norm_sq``,
            the sum of squares of the gradients it owns (a tied weight counted by the first
            stage holding it only).  The runtime sums the stages' shares over ``pp`` (one
            scalar all_reduce) and gives the total to every stage's ``optimizer``, so the
            norm is the global one over all stages and tp shards; None without such an option.
    """

    index: int
    forward: Graph
    backward: Graph
    optimizer: Graph
    recv: tuple
    send: tuple
    saved: tuple
    params: tuple
    saved_bytes: int
    stats: Graph | None = None


def loss_output(graph: Graph, cfg) -> str | None:
    """The model output the loss is taken on: ``output=``'s, else the last one."""
    named = dict(zip(graph.output_names, graph.outputs))
    return named[cfg.output] if cfg.output in named else (graph.outputs[-1] if graph.outputs else None)


def reaching_params(graph: Graph, cfg) -> frozenset:
    """The params of the model ``graph`` the loss depends on: as in the unsharded step
    (``autodiff._reaching``, torch.optim), one the loss does not reach (BERT's pooler when
    the loss is on ``last_hidden_state``) has no gradient, no optimizer state and no update."""
    live = {loss_output(graph, cfg)}
    for n in reversed(graph.nodes):
        if n.name in live:
            live.update(n.inputs)
    return frozenset(p.name for p in graph.params if p.name in live)


def stage_programs(stage, cfg, last: bool, reaching=None, owned=None, parts: int = 1) -> StagePrograms:
    """The :class:`StagePrograms` of a :class:`StageGraph` under training config ``cfg``;
    ``reaching``: the params the loss reaches (:func:`reaching_params`; None: every one);
    ``owned``: the params whose gradient this stage counts in the global norm (None: all its own);
    ``parts``: microbatches x dp, the loss's share of one microbatch (fp16 seeds
    ``scale / parts``, as GradScaler's ``scale(loss / K).backward()`` under accumulation: the
    per-microbatch gradients stay as large as the full batch's, so they overflow only where
    the unsharded step's would; the update unscales by ``parts / scale`` after the runtime's
    ``1 / parts``).

    Raises:
        SpecError: a loss this builder does not support on a pipeline (``loss=output``
            with a non-scalar output is rejected as in the unsharded step).
    """
    g, cast = _lower(stage, cfg, last)
    b = Builder(g)
    start_recompute(b, g, cfg.options)  # recompute=: backward recomputes what the policy drops
    seeds = {}
    if last:
        loss = _stage_loss(b, g, cfg)
        b.prefix, b.phase = "bw", "backward"
        seed = b.op("ones", [], type=b.type(loss), name="bw.loss")
        seeds[loss] = amp.scaled_seed(b, seed, cfg, SimpleNamespace(mesh=Mesh(())))  # fp16: x scale
        if amp.enabled(cfg) and parts > 1:
            seeds[loss] = b.op("scale", [seeds[loss]], value=1.0 / parts, name="bw.loss_share")
    b.phase = "backward"
    for v in stage.send:
        seeds[v] = b.source(grad_name(v), "input", b.type(v), g[v].layout, "backward")
    rx = pattern_regex(cfg.trainable)
    params = [p for p in stage.params if rx.fullmatch(p) and g[p].attr("trainable", True)
              and (reaching is None or p in reaching)]
    recv = [v for v in stage.recv if g[v].type.dtype.startswith(("float", "bfloat"))]
    whole = Graph(tuple(b.nodes), tuple(seeds))
    grads = backward(b, whole, seeds, wrt_names(params, cast) + recv)
    for p in params:  # mixed precision: each gradient widened to float32 before it is summed
        if p in cast and cast[p] in grads:  # (over microbatches, then dp: in float32)
            b.prefix, b.phase = f"bw.{p}", "backward"
            grads[p] = b.op("grad_upcast", [grads[cast[p]]], name=f"bw.{p}.f32", partial_over="")
    nodes = {n.name: n for n in b.nodes}
    fwd = [n for n in b.nodes if n.phase in ("forward", "loss")]
    derived = _weight_derived(fwd)
    bwd = [n for n in b.nodes if n.phase == "backward" and n.op not in ("input", "param")]
    b_outs = [(grad_name(v), grads[v]) for v in recv] + [(grad_name(p), grads[p]) for p in params]
    used = _closure({i for n in bwd for i in n.inputs} | {v for _, v in b_outs}, derived, nodes)
    saved = tuple(n.name for n in fwd if n.name in used and n.name not in derived
                  and (n.op not in ("input", "param") or n.name in stage.recv))
    sources = [n for n in b.nodes if n.name in used and n.op in ("input", "param")
               and n.name not in saved]
    bwd = [n for n in fwd if n.name in used and n.name in derived and n.op != "param"] + bwd
    stash = [_as_input(nodes[v]) for v in saved]
    f_outs = [*stage.send, *(["loss"] if last else []), *saved]
    f_names = [*stage.send, *(["loss"] if last else []), *(f"saved.{v}" for v in saved)]
    forward = Graph(tuple(fwd), tuple(f_outs), g.mesh, g.stage, tuple(f_names))
    bw_graph = Graph(tuple(_dedupe(sources + stash) + bwd), tuple(v for _, v in b_outs), g.mesh,
                     g.stage, tuple(k for k, _ in b_outs))
    saved_bytes = sum(nodes[v].type.nbytes for v in saved) + _kernel_stash_bytes(forward, bw_graph, saved)
    owned = params if owned is None else [p for p in params if p in owned]
    unsplit = replace(cfg, zero=0)  # the global update: zero=1's state split is stage_shard's
    return StagePrograms(stage.index, forward, bw_graph, _optimizer_graph(g, params, unsplit, parts),
                         stage.recv, stage.send, saved, tuple(params), saved_bytes,
                         _stats_graph(g, params, owned, cfg, parts))


def _kernel_stash_bytes(forward: Graph, backward: Graph, saved) -> int:
    """Bytes one microbatch's stash holds beside ``saved`` for the attentions whose forward
    kernel keeps, for the stage's backward, its output and a logsumexp per query row
    (:func:`parcomp.ir.liveness.stashed_attention`): the logsumexp, and the output where no
    stashed value holds its buffer already (the output projection's input, a view of it in the
    usual block: :func:`parcomp.ir.liveness.storage_roots`); and for the layer norms whose
    forward kernel keeps its mean and rstd per row for the backward
    (:func:`parcomp.ir.liveness.stashed_layer_norm`), those."""
    out, roots = 0, storage_roots(forward)
    held = {roots[v] for v in saved}
    for src in stashed_attention(forward, backward):
        ty = forward[src].type
        out += attention_saved_bytes(ty, ty.nbytes) + (0 if src in held else ty.nbytes)
    for src in stashed_layer_norm(forward, backward):
        ty = forward[src].type
        out += layer_norm_saved_bytes(ty, ty.nbytes)
    return out


def _lower(stage, cfg, last: bool) -> tuple:
    """``(stage graph, {param: its low copy})`` in ``precision=``'s compute dtype, as the
    unsharded step's forward (:func:`parcomp.passes.train.precision.lower_forward`: fp32
    master params read through a ``cast``, every float32 value in the compute dtype, the
    model output cast back to float32 for the loss); the values received are in the compute
    dtype already (their sender computed them so: the p2p sends 2-byte elements)."""
    low = compute_dtype(cfg.options)
    g = stage.graph
    if low is None:
        return g, {}
    recv = set(stage.recv)
    nodes = tuple(replace(n, type=TensorType(n.type.shape, low))
                  if n.name in recv and n.type.dtype == "float32" else n for n in g.nodes)
    lowered, cast = lower_forward(Graph(nodes, (), g.mesh, g.stage, ()), cfg, list(stage.params),
                                  lambda n: n.layout)
    out, outs, sent = list(lowered.nodes), [], set(stage.send)
    for v in g.outputs:  # a model output (last stage) back in float32 for the loss, as unpipelined
        if last and v not in sent and g[v].type.dtype == "float32":
            out.append(Node(f"{v}.f32", "cast", (v,), g[v].type, phase="forward", source=g[v].source))
            v = f"{v}.f32"
        outs.append(v)
    return Graph(tuple(out), tuple(outs), g.mesh, g.stage, g.output_names), cast


def _weight_derived(fwd) -> set:
    """Forward values computed from params alone (a weight's transpose): the backward
    recomputes them instead of stashing them per microbatch."""
    out = set()
    for n in fwd:
        if n.op == "param" or (n.op not in ("input",) and n.inputs and all(i in out for i in n.inputs)):
            out.add(n.name)
    return out


def _closure(used, derived, nodes) -> set:
    """``used`` plus the inputs of every weight-derived value in it, transitively."""
    todo, out = list(used), set(used)
    while todo:
        v = todo.pop()
        if v in derived:
            for i in nodes[v].inputs:
                if i not in out:
                    out.add(i)
                    todo.append(i)
    return out


def _dedupe(nodes) -> list:
    seen, out = set(), []
    for n in nodes:
        if n.name not in seen:
            seen.add(n.name)
            out.append(n)
    return out


def _as_input(node):
    """A stashed value as an ``input`` of the backward program (same name and type)."""
    return replace(node, op="input", inputs=(), attrs=(), phase="backward")


def _stage_loss(b, g, cfg) -> str:
    """The loss of the last stage: the mean over this microbatch (scaled once later)."""
    b.prefix, b.phase = "loss", "loss"
    if not g.outputs:
        raise SpecError("the last stage has no model output to compute the loss on", cfg.loc)
    y = loss_output(g, cfg)
    ty = b.type(y)
    if cfg.loss == "output":
        if ty.rank:
            raise SpecError(f"loss=output needs the model to return a scalar loss; it returns {ty}",
                            cfg.loc)
        return y
    if cfg.loss == "mse":
        target = b.source("target", "input", ty, g[y].layout, "loss")
        per = b.op("pow", [b.op("sub", [y, target])], exponent=2.0)
        count = ty.numel
    else:
        labels = b.source("labels", "input", TensorType(ty.shape[:-1], "int64"), None, "loss")
        per, count = b.op("cross_entropy", [y, labels]), ty.numel // ty.shape[-1]
    total = b.op("sum", [per], dims=tuple(range(b.type(per).rank)))
    return b.op("scale", [total], value=1.0 / count, name="loss")


#: the global sum of squares of every stage's gradients (``clip_grad_norm``)
NORM_SQ = "clip.norm_sq"
#: the count of non-finite gradient elements of every stage (``precision=fp16``)
FOUND = "amp.found"


def _stats_graph(g, params, owned, cfg, parts: int = 1) -> Graph | None:
    """:attr:`StagePrograms.stats`: ``clip.norm_sq``, the sum of squares of the (unscaled)
    gradients of ``owned`` (torch's ``clip_grad_norm_`` sums every parameter's squares once),
    and with ``precision=fp16`` ``amp.found``, the count of non-finite gradient elements of the
    stage (GradScaler's ``found_inf``: any stage's makes every stage skip); None with neither."""
    fp16 = amp.enabled(cfg)
    if cfg.options.clip_grad_norm is None and not fp16:
        return None
    b = Builder(Graph((), ()))
    b.prefix, b.phase = "opt.clip", "optimizer"
    grads = {p: b.source(grad_name(p), "input", g[p].type, g[p].layout, "optimizer")
             for p in (params if fp16 else owned)}  # fp16 counts inf/NaN in every gradient
    outs = []
    if fp16:
        grads = _unscaled(b, grads, cfg, parts)
        found = None
        for p, gr in grads.items():
            bad = b.op("nonfinite", [gr], name=f"amp.{p}.nonfinite")
            n = b.op("sum", [bad], dims=tuple(range(b.type(bad).rank))) if b.type(bad).rank else bad
            found = n if found is None else b.op("add", [found, n], name="amp.found_sum")
        outs.append((FOUND, found if found is not None else _zero(b, "float32")))
    if cfg.options.clip_grad_norm is not None:
        total = None
        for p in owned:
            gr = grads[p]
            sq = b.op("mul", [gr, gr], name=f"opt.{p}.grad_sq")
            rank = b.type(sq).rank
            part = b.op("sum", [sq], dims=tuple(range(rank)), name=f"opt.{p}.grad_sq_sum") if rank else sq
            total = part if total is None else b.op("add", [total, part], name="opt.clip.norm_sq_part")
        outs.append((NORM_SQ, total if total is not None else _zero(b, _float(g, owned))))
    return Graph(tuple(b.nodes), tuple(v for _, v in outs), g.mesh, g.stage, tuple(k for k, _ in outs))


def _zero(b, dtype) -> str:
    """A 0-d zero: the share of a stage with nothing of its own to count."""
    return b.op("scale", [b.op("ones", [], type=TensorType((), dtype))], value=0.0)


def _unscaled(b, grads: dict, cfg, parts: int = 1) -> dict:
    """fp16: every gradient times ``parts / scale`` (``scaler.unscale_`` of gradients seeded
    with ``scale / parts`` and scaled by ``1 / parts`` again by the runtime), the scale made from
    the carried ``amp.scale_ratio`` as :func:`parcomp.passes.train.amp.scaled_seed` makes it."""
    s0 = cfg.options.loss_scale
    ratio = amp.RATIO if amp.RATIO in b.types else b.source(amp.RATIO, "param", TensorType((), "float32"), (),
                                                            "optimizer")
    b.amp = {"scale": b.op("add_scalar", [b.op("scale", [ratio], value=s0)], value=s0, name="amp.scale")}
    one = b.op("ones", [], type=TensorType((), "float32"))
    inv = b.op("div", [one, b.amp["scale"]], name="amp.inv_scale")
    if parts > 1:
        inv = b.op("scale", [inv], value=float(parts), name="amp.inv_scale_share")
    return {p: b.op("mul", [gr, inv], name=f"amp.{p}.unscaled") for p, gr in grads.items()}


def _float(g, params) -> str:
    """The dtype of the stage's gradients (float64 in ``check``), float32 without any."""
    return next((g[p].type.dtype for p in params), "float32")


def _optimizer_graph(g, params, cfg, parts: int = 1) -> Graph:
    """The update of the stage's params from their summed, scaled gradients ``grad.<p>``:
    unscaled (fp16), clipped by the global norm (input ``clip.norm_sq``, the stages'
    :func:`_stats_graph` summed over pp), at the lr schedule's step ``lr_k``, and with fp16
    every carried value kept and the scale halved when any stage found inf/NaN (input
    ``amp.found``), as in the unsharded step (:func:`parcomp.passes.autodiff.training_options`,
    :mod:`parcomp.passes.train.amp`)."""
    from parcomp.spec.train_options import lr_factor

    b = Builder(Graph(tuple(g[p] for p in params), ()))
    spec = SimpleNamespace(mesh=Mesh(()))
    grads = {p: b.source(grad_name(p), "input", g[p].type, g[p].layout, "optimizer") for p in params}
    if amp.enabled(cfg):
        b.prefix, b.phase = "amp", "optimizer"
        grads = _unscaled(b, grads, cfg, parts)
        b.amp["found"] = b.source(FOUND, "input", TensorType((), "float32"), None, "optimizer")
    if cfg.options.clip_grad_norm is not None:
        b.prefix, b.phase = "opt.clip", "optimizer"
        norm_sq = b.source(NORM_SQ, "input", TensorType((), _float(g, params)), None, "optimizer")
        coef = b.op("clip_coef", [norm_sq], max_norm=cfg.options.clip_grad_norm, name="opt.clip.coef")
        grads = {p: b.op("mul", [gr, coef], name=f"opt.{p}.clipped_grad") for p, gr in grads.items()}
    factor = lr_factor(b, cfg.options.schedule, cfg.h("lr"), lambda: _step(b))
    outs = []
    for p in params:
        outs += optimizer_update(b, b.nodes[[n.name for n in b.nodes].index(p)], grads[p], cfg, spec, factor)
    outs = amp.skip_on_overflow(b, outs, cfg, spec, _pin)  # fp16: a step with inf/NaN is skipped
    return Graph(tuple(b.nodes), tuple(v for _, v in outs), g.mesh, g.stage,
                 tuple(k for k, _ in outs))


def _pin(b, value, layout, what):
    """``relayout(value) -> layout``, an output of the update, in the phase of ``value`` (as the
    unsharded step pins its outputs)."""
    phase, b.phase = b.phase, b.phases[value]
    out = b.op("relayout", [value], name=f"{value}.as_output", layout=layout,
               origin=f"output {what} (layout of the training step's outputs)")
    b.phase = phase
    return out


def _step(b) -> str:
    """The step counter k = 1, 2, ... (the input ``step`` the runtime sets)."""
    return "step" if "step" in b.types else b.source("step", "input", TensorType((), "float32"), None,
                                                     "optimizer")
