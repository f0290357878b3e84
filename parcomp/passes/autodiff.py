"""autodiff: loss, backward and optimizer update appended to the *global* graph.

The training step is differentiated before sharding, so the backward
collectives come out of the same shard-prop / insert-collectives passes as
the forward ones (see docs/design/training.md): the transposes (all_gather <->
reduce_scatter, all_reduce <-> identity, Megatron's f/g pair) are consequences
of the rule tables, and the tests check them.

Naming: gradient values are ``bw.<value>...``, optimizer values
``opt.<param>...``, loss values ``loss...``, for people reading the IR.  The
phase of every node is the :attr:`parcomp.ir.graph.Node.phase` field, set here
(``loss``, ``backward``, ``optimizer``; the model's nodes stay ``forward``),
never derived from a name: a model module called ``opt`` is forward code.
"""
from __future__ import annotations

import re
import sys

from dataclasses import replace

from ..errors import SpecError, closest
from ..ir.graph import Graph, Node, evolve, make_attrs
from ..ir.names import NameGen
from ..ir.ops import OPS
from ..ir.types import Partial, Replicate, Shard, TensorType, replicated, shard_axes
from ..rules.vjp import VJP_RULES
from ..spec.model import pattern_regex
from ..spec.option_loc import option_loc
from ..spec.train_config import train_config
from ..spec.train_options import (clip_gradients, lr_factor, recompute_view, scheduled_sgd_step, scheduled_update,
                            start_recompute)
from .decompose import Emitter, cross_entropy_parts, padded_size
from .train import amp
from .train.accumulate import accumulated_step
from .train.precision import lower_forward, upcast_grads, wrt_names
from .vocab_pad import padded_logits


class Builder:
    """Appends nodes to a graph under construction, with unique names and inferred types."""

    def __init__(self, graph: Graph):
        self.nodes = list(graph.nodes)
        self.types = {n.name: n.type for n in graph.nodes}
        self.names = NameGen(self.types)
        self.prefix = "bw"
        self.phase = "backward"  # the phase of the nodes op() appends
        self.phases = {n.name: n.phase for n in graph.nodes}

    def type(self, name) -> TensorType:
        return self.types[name]

    def fresh(self, base: str) -> str:
        return self.names.fresh(base)

    def op(self, op, inputs, type=None, name=None, layout=None, **attrs) -> str:
        name = self.fresh(name or f"{self.prefix}.{op}")
        probe = Node(name, op, tuple(inputs), type, make_attrs(**attrs), phase=self.phase)
        ty = type or OPS[op].infer([self.types[i] for i in inputs], probe)
        self.nodes.append(evolve(probe, type=ty, layout=layout))
        self.types[name] = ty
        self.phases[name] = self.phase
        return name

    def source(self, name, op, ty, layout, phase) -> str:
        """Insert an ``input``/``param`` node ``name`` first in the graph."""
        self.nodes.insert(0, Node(name, op, (), ty, (), layout, phase=phase))
        self.types[self.names.take(name)], self.phases[name] = ty, phase
        return name


def backward(b: Builder, graph: Graph, seeds: dict, wrt) -> dict:
    """Gradients of ``wrt`` values given output gradients ``seeds`` {value: grad name}."""
    needs = _needs_grad(graph, set(wrt))
    grads = {k: [v] for k, v in seeds.items()}
    for n in reversed(graph.nodes):
        if n.name not in grads or n.op in ("input", "param") or not any(i in needs for i in n.inputs):
            continue
        if n.op not in VJP_RULES:
            raise SpecError(f"cannot differentiate {n.op} %{n.name}: no gradient rule")
        b.prefix = f"bw.{n.name}"
        contribs = VJP_RULES[n.op](b, recompute_view(b, n), _total(b, grads[n.name]))
        for i, gi in zip(n.inputs, contribs):
            if gi is not None and i in needs:
                grads.setdefault(i, []).append(gi)
    out = {}
    for w in wrt:
        b.prefix = f"bw.{w}"
        out[w] = _total(b, grads[w]) if w in grads else b.op("scale", [b.op("ones", [], type=b.type(w))], value=0.0)
    return out


def _needs_grad(graph, wrt) -> set:
    needs = set(wrt)
    for n in graph.nodes:
        if any(i in needs for i in n.inputs):
            needs.add(n.name)
    return needs


def _total(b, contribs):
    total = contribs[0]
    for c in contribs[1:]:
        total = b.op("add", [total, c])
    return total


def add_training_step(graph: Graph, spec) -> Graph:
    """Append loss, backward and the optimizer update to a layout-bound forward graph.

    Outputs of the result: ``loss`` (replicated), every trainable parameter's
    updated value (public name = the parameter's), its ``.grad``, optimizer
    state (``.momentum_buffer`` / ``.exp_avg`` / ``.exp_avg_sq``), and ``x.grad``
    for every float input ``x`` (unless the spec says ``input_grads=no``).

    Raises:
        SpecError: non-scalar ``loss=output``, an unknown optimizer, a batch that
            does not match the model or divide over ``dp``, a ``trainable``
            pattern naming no trainable parameter the graph uses, several model
            outputs and no ``output=`` naming one of them.
    """
    cfg = train_config(spec)
    params = _trainable(graph, cfg)
    _check_batch(graph, spec, cfg)
    graph, cast = lower_forward(graph, cfg, params, lambda n: state_layout(n, cfg, spec))
    b = Builder(graph)
    outs = []
    start_recompute(b, graph, cfg.options)  # recompute=selective
    if cfg.options.accumulate > 1:  # K microbatches (parcomp/passes/train/accumulate.py)
        b = Builder(Graph(tuple(n for n in graph.nodes if n.op == "param"), (), graph.mesh))
        start_recompute(b, graph, cfg.options)
        loss, params, grads = accumulated_step(b, graph, cfg, spec, params, sys.modules[__name__], cast)
        finputs = []
    else:
        loss = _loss(b, graph, cfg)
        params = reached_params(b, loss, params, cfg)
        b.prefix, b.phase = "bw", "backward"
        seed = amp.scaled_seed(b, b.op("ones", [], type=b.type(loss), name="bw.loss"), cfg, spec)  # fp16
        finputs = input_grad_names(graph, cfg)
        grads = backward(b, Graph(tuple(b.nodes), (loss,)), {loss: seed}, wrt_names(params, cast) + finputs)
        grads.update(upcast_grads(b, graph, grads, cast, cfg))  # mixed precision
        grads = amp.unscale(b, {k: grads[k] for k in params + finputs}, cfg)
    outs.append(("loss", _pin(b, loss, replicated(len(spec.mesh.axes)), "the loss")))
    clipped, factor = training_options(b, {p: grads[p] for p in params}, cfg, spec)
    grads.update(clipped)
    for p in params:
        outs += optimizer_update(b, graph[p], grads[p], cfg, spec, factor)
    b.phase = "backward"
    for x in finputs:
        outs.append((f"{x}.grad", _pin(b, grads[x], graph[x].layout, f"gradient of input {x}")))
    outs = amp.skip_on_overflow(b, outs, cfg, spec, _pin)  # fp16: a step with inf/NaN is skipped
    dropout_steps(b, spec)
    return dead_code_elimination(Graph(tuple(b.nodes), tuple(v for _, v in outs), graph.mesh,
                                       graph.stage, tuple(k for k, _ in outs)))


def input_grad_names(graph, cfg) -> list:
    """The float inputs whose gradient the step returns: every one for ``input_grads=yes``,
    those the pattern names for ``input_grads=PATTERN`` (as torch computes only the gradients
    of inputs that require grad: ``input_grads=x`` leaves a loss input ``dy`` without one, and
    its backward without the work), none for ``no``.

    Raises:
        SpecError: a pattern that names no float input of the model (at the option).
    """
    if not cfg.input_grads:
        return []
    floats = [n.name for n in graph.inputs if n.type.dtype.startswith("float")]
    names = [x for x in floats if cfg.wants_input_grad(x)]
    if not names and cfg.input_grad_names != "**":
        hint = closest(cfg.input_grad_names, floats)
        raise SpecError(f"input_grads={cfg.input_grad_names!r} names no float input of the model"
                        + (f"; did you mean {hint!r}?" if hint else f"; its float inputs: {', '.join(floats) or 'none'}"),
                        option_loc(cfg.loc, "input_grads"))
    return names


def dropout_steps(b, spec) -> None:
    """Give every dropout of the training step (the model's, their recomputations and the
    gradients' masks) the step counter k as its second operand: the mask hashes the seed, k
    and each element's global index, so every step draws a new mask, the same on every
    sharding (parcomp/reference/norm_ops.py)."""
    if not any(n.op == "dropout" and len(n.inputs) == 1 for n in b.nodes):
        return
    step = _step_input(b, spec)
    b.nodes = [evolve(n, inputs=n.inputs + (step,)) if n.op == "dropout" and len(n.inputs) == 1 else n
               for n in b.nodes]


def dead_code_elimination(graph: Graph) -> Graph:
    """Drop compute nodes no output depends on (sources are kept: they are the interface)."""
    live = set(graph.outputs)
    for n in reversed(graph.nodes):
        if n.name in live:
            live.update(n.inputs)
    return graph.with_nodes([n for n in graph.nodes if n.name in live or n.op in ("input", "param")])


def _pin(b, value, layout, what):
    """``relayout(value) -> layout`` for an output; in the phase of ``value``."""
    phase, b.phase = b.phase, b.phases[value]
    out = b.op("relayout", [value], name=f"{value}.as_output", layout=layout,
               origin=f"output {what} (layout of the training step's outputs)")
    b.phase = phase
    return out


def _trainable(graph, cfg):
    """Names of the params ``trainable=`` matches, less buffers and frozen params
    (``{trainable=false}``): those get no gradient, no state and no update."""
    rx = pattern_regex(cfg.trainable)
    matched = [n.name for n in graph.params if rx.fullmatch(n.name)]
    names = [m for m in matched if graph[m].attr("trainable", True)]
    if matched and not names:
        raise SpecError(f"trainable={cfg.trainable!r} names only buffers or frozen (requires_grad="
                        f"False) parameters, which training never updates: {', '.join(matched[:8])}",
                        cfg.loc)
    if not names:
        hint = closest(cfg.trainable, [n.name for n in graph.params])
        meta = sorted(set(re.findall(r"[\[\]?+(){}|^$\\]", cfg.trainable)))
        note = (f"; a pattern's only wildcards are '*' (within one name part) and '**' (across "
                f"'.'): {' '.join(meta)} {'is' if len(meta) == 1 else 'are'} matched literally"
                if meta else "")
        raise SpecError(f"trainable={cfg.trainable!r} names no parameter the graph uses"
                        + (f"; did you mean {hint!r}?" if hint else "") + note, cfg.loc)
    return names


def reached_params(b, loss, params, cfg):
    """The ``params`` the loss depends on: as in torch.optim, one the loss does not
    reach has no gradient and is not updated (not even by weight decay)."""
    live = {loss}
    for n in reversed(b.nodes):
        if n.name in live:
            live.update(n.inputs)
    kept = [p for p in params if p in live]
    if not kept:
        raise SpecError(f"no trainable parameter reaches the loss (trainable={cfg.trainable!r}: "
                        f"{', '.join(params[:8])}); nothing would be trained", cfg.loc)
    return kept


def _check_batch(graph, spec, cfg):
    k = cfg.options.accumulate  # the model's batch is one of k microbatches
    for n in graph.inputs:
        if cfg.batch is not None and n.type.shape and n.type.shape[0] * k != cfg.batch:
            raise SpecError(f"batch={cfg.batch} but input {n.name} {n.type} has batch {n.type.shape[0]}"
                            + (f" x accumulate={k} = {n.type.shape[0] * k}" if k > 1 else ""), cfg.loc)
    if "dp" in spec.mesh.names and cfg.batch is not None:
        dp = spec.mesh.sizes[spec.mesh.axis_index("dp")]
        if cfg.batch % dp:
            raise SpecError(f"batch={cfg.batch} is not divisible by the dp axis of size {dp}", cfg.loc)


def model_output(graph, cfg):
    """The model output the loss is computed on, and the layout the loss's target gets.

    That is the output ``cfg.output`` names, else the model's only output; a
    model with several outputs and no ``output=`` is a SpecError listing them.

    An output the spec names keeps its pinned layout; an unnamed one is not
    gathered for the loss (its ``relayout`` is skipped) and the target is split
    like the batch: ``S(0)`` on every axis that splits dim 0 of a model input.
    """
    public, value = _loss_output(graph, cfg)
    node = graph[value]
    if node.op == "relayout" and node.attr("default", False):
        value = padded_logits(graph, node.inputs[0])  # a padded vocab's masked logits
        naxes = len(graph.mesh.axes)
        batch = {a for n in graph.inputs for a in shard_axes(n.layout, 0)}
        return value, tuple(Shard(0) if a in batch else Replicate() for a in range(naxes))
    return value, node.layout


def _loss_output(graph, cfg):
    """``(public name, value)`` of the output the loss is on (see :func:`model_output`)."""
    named = graph.named_outputs()
    names = [p for p, _ in named]
    if cfg.output is None and len(named) == 1:
        return named[0]
    if cfg.output is None:
        raise SpecError(f"the model has {len(named)} outputs ({', '.join(names)}); say which one "
                        f"the loss is computed on, e.g. 'train ... output={names[0]}'", cfg.loc)
    if cfg.output not in names:
        hint = closest(cfg.output, names)
        raise SpecError(f"output={cfg.output!r} is not an output of the model"
                        + (f"; did you mean {hint!r}?" if hint else f" (its outputs: {', '.join(names)})"),
                        option_loc(cfg.loc, "output"))
    return named[names.index(cfg.output)]


def _loss(b, graph, cfg):
    b.prefix, b.phase = "loss", "loss"
    y, lay = model_output(graph, cfg)
    ty = b.type(y)
    if cfg.loss == "output":
        if ty.rank:
            raise SpecError(f"loss=output needs the model to return a scalar loss; it returns {ty}", cfg.loc)
        return y
    if cfg.loss == "mse":
        target = loss_input(b, "target", ty, lay)
        d = b.op("sub", [y, target])
        per, count = b.op("pow", [d], exponent=2.0), ty.numel
    else:
        if not ty.rank:
            raise SpecError(f"loss={cfg.loss} needs the model's logits [..., classes]; the output it is on "
                            f"is {ty}, a loss the model computes itself: write 'loss=output' (its options, "
                            "as label_smoothing or ignore_index, are the model's own)",
                            option_loc(cfg.loc, "loss"))
        labels = loss_input(b, "labels", TensorType(ty.shape[:-1], "int64"),
                            tuple(Replicate() if p == Shard(ty.rank - 1) else p for p in lay))
        return _cross_entropy_loss(b, graph, y, labels, dict(cfg.loss_args))
    total = b.op("sum", [per], dims=tuple(range(b.type(per).rank)))
    return b.op("scale", [total], value=1.0 / count, name="loss")  # global count, never mean of means


def _cross_entropy_loss(b, graph, y, labels, args):
    """Mean cross-entropy over the counted tokens (label != ignore_index, default -100),
    with the GLOBAL count; written as the reductions a vocab split turns into Megatron's
    three all_reduces (reductions part: parcomp/passes/decompose.py)."""
    e = Emitter(b.names, b.types)
    pad = padded_size({n.name: n for n in graph.nodes}, y)
    per, valid = cross_entropy_parts(e, y, labels, "loss.ce", args.get("ignore_index", -100),
                                     args.get("label_smoothing", 0.0), pad)
    for n in e.out:
        b.nodes.append(replace(n, phase="loss"))
        b.phases[n.name] = "loss"
    dims = tuple(range(b.type(per).rank))
    total, count = b.op("sum", [per], dims=dims), b.op("sum", [valid], dims=dims, name="loss.count")
    return b.op("div", [total, count], name="loss")  # global count, never a mean of means


def loss_input(b, name, ty, layout, phase="loss"):
    return b.source(name, "input", ty, tuple(Replicate() if isinstance(p, Partial) else p for p in layout),
                    phase)


def state_layout(param, cfg, spec):
    """The optimizer state's layout: the param's, or with ZeRO also split over dp.

    ZeRO splits the first dim no other mesh axis splits (so a tp shard is not
    re-cut in the nested order), if it divides evenly; else the state stays
    laid out like the param.
    """
    lay = param.layout
    if not cfg.zero:
        return lay
    a = spec.mesh.axis_index("dp")
    if not isinstance(lay[a], Replicate):
        return lay
    for d, size in enumerate(param.type.shape):
        if not shard_axes(lay, d) and size % spec.mesh.sizes[a] == 0:
            return lay[:a] + (Shard(d),) + lay[a + 1:]
    return lay


def _state(b, param, suffix, layout):
    name = f"{param.name}.{suffix}"
    return b.source(name, "param", param.type, layout, "optimizer")


def training_options(b, grads, cfg, spec):
    """Gradient clipping and the LR schedule's factor (parcomp/spec/train_options.py).
    Returns ``(grads, clipped if asked; the factor node lr_k / lr, or None)``."""
    opts = cfg.options
    if opts.clip_grad_norm is not None:
        grads = clip_gradients(b, grads, opts.clip_grad_norm)
    return grads, lr_factor(b, opts.schedule, cfg.h("lr"), lambda: _step_input(b, spec))


def _step_input(b, spec):
    """The step counter k = 1, 2, ... (an input the program's loop sets)."""
    return "step" if "step" in b.types else loss_input(b, "step", TensorType((), "float32"),
                                                       replicated(len(spec.mesh.axes)), "optimizer")


def optimizer_update(b, param, g, cfg, spec, factor=None):
    """The update of one parameter; returns its (public name, value) outputs."""
    b.prefix, b.phase = f"opt.{param.name}", "optimizer"
    p, st_lay = param.name, state_layout(param, cfg, spec)
    out = [(f"{p}.grad", _pin(b, g, st_lay, f"gradient of {p}"))]
    if cfg.optimizer == "sgd":
        if cfg.h("weight_decay"):
            g = b.op("add", [g, b.op("scale", [p], value=cfg.h("weight_decay"))])
        step = g
        if cfg.h("momentum"):
            buf = _state(b, param, "momentum_buffer", st_lay)
            step = b.op("add", [b.op("scale", [buf], value=cfg.h("momentum")), g])
            out.append((buf, _pin(b, step, st_lay, f"momentum of {p}")))
        new = b.op("sub", [p, b.op("scale", [scheduled_sgd_step(b, step, factor)], value=cfg.h("lr"))])
    else:
        b1, b2 = cfg.h("beta1"), cfg.h("beta2")
        m, v = _state(b, param, "exp_avg", st_lay), _state(b, param, "exp_avg_sq", st_lay)
        m_new = b.op("add", [b.op("scale", [m], value=b1), b.op("scale", [g], value=1 - b1)])
        v_new = b.op("add", [b.op("scale", [v], value=b2),
                             b.op("scale", [b.op("mul", [g, g])], value=1 - b2)])
        t = amp.adam_step(b, _step_input(b, spec), cfg, spec)  # fp16: skipped steps are not counted
        new = b.op("adamw_param", [p, m_new, v_new, t], lr=cfg.h("lr"), beta1=b1,
                   beta2=b2, eps=cfg.h("eps"), weight_decay=cfg.h("weight_decay"))
        new = scheduled_update(b, p, new, factor)
        out += [(m, _pin(b, m_new, st_lay, f"exp_avg of {p}")), (v, _pin(b, v_new, st_lay, f"exp_avg_sq of {p}"))]
    out.append((p, _pin(b, new, param.layout, f"updated {p}")))
    return out
