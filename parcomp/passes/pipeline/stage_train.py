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
unsharded step uses.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

from parcomp.errors import SpecError
from parcomp.ir.graph import Graph
from parcomp.ir.types import Mesh, TensorType
from parcomp.spec.model import pattern_regex
from ..autodiff import Builder, optimizer_update, backward

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
        saved_bytes: bytes one microbatch's stash holds.
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


def stage_programs(stage, cfg, last: bool, reaching=None) -> StagePrograms:
    """The :class:`StagePrograms` of a :class:`StageGraph` under training config ``cfg``;
    ``reaching``: the params the loss reaches (:func:`reaching_params`; None: every one).

    Raises:
        SpecError: a loss this builder does not support on a pipeline (``loss=output``
            with a non-scalar output is rejected as in the unsharded step).
    """
    g = stage.graph
    b = Builder(g)
    seeds = {}
    if last:
        loss = _stage_loss(b, g, cfg)
        b.prefix, b.phase = "bw", "backward"
        seeds[loss] = b.op("ones", [], type=b.type(loss), name="bw.loss")
    b.phase = "backward"
    for v in stage.send:
        seeds[v] = b.source(grad_name(v), "input", b.type(v), g[v].layout, "backward")
    rx = pattern_regex(cfg.trainable)
    params = [p for p in stage.params if rx.fullmatch(p) and g[p].attr("trainable", True)
              and (reaching is None or p in reaching)]
    recv = [v for v in stage.recv if g[v].type.dtype.startswith("float")]
    whole = Graph(tuple(b.nodes), tuple(seeds))
    grads = backward(b, whole, seeds, params + recv)
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
    saved_bytes = sum(nodes[v].type.nbytes for v in saved)
    return StagePrograms(stage.index, forward, bw_graph, _optimizer_graph(g, params, cfg),
                         stage.recv, stage.send, saved, tuple(params), saved_bytes)


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


def _optimizer_graph(g, params, cfg) -> Graph:
    """The update of the stage's params from their summed, scaled gradients ``grad.<p>``."""
    b = Builder(Graph(tuple(g[p] for p in params), ()))
    spec = SimpleNamespace(mesh=Mesh(()))
    outs = []
    for p in params:
        gr = b.source(grad_name(p), "input", g[p].type, g[p].layout, "optimizer")
        outs += optimizer_update(b, b.nodes[[n.name for n in b.nodes].index(p)], gr, cfg, spec)
    return Graph(tuple(b.nodes), tuple(v for _, v in outs), g.mesh, g.stage,
                 tuple(k for k, _ in outs))
