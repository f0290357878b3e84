"""Gradient accumulation (``train accumulate=K``) on the global graph.

The model's graph is traced at the *microbatch* shape; the step's data inputs (``x``,
``target``, ``labels``) hold K microbatches: their dim 0 is ``K * B`` (the global batch
``batch=``). Microbatch k is, on every rank, the k-th of K equal chunks of that rank's
share of dim 0 (as every DP framework splits its local batch): globally
``x.reshape(D, K, B/D, ...)[:, k].reshape(B, ...)`` with D the number of shards of dim 0.

The step is, in this order (so only one microbatch's activations are live at a time):

1. ``count``: the global denominator of the loss, once (mse: K * elements of the output;
   cross_entropy: the counted labels of all K microbatches; loss=output: K, or, for a model
   whose loss is a token mean, the sum of the K microbatches' counts: see below) and the
   backward seed ``1 / count``: **scaled once**, for every microbatch alike;
2. for k = 0..K-1: forward of microbatch k, its loss *sum*, its backward from the seed,
   and ``grad += grad_k``. The gradients stay in the layout backward leaves them
   (partial sums over dp), so the planner reduces the accumulated sum **once per step**,
   never per microbatch (one all_reduce / reduce_scatter costs less than K);
3. ``loss = (sum of the K loss sums) / count``: the mean over the global batch.

The gradient equals the global batch's gradient of the mean loss; the interpreter
checks it against torch running the same K microbatches (``loss_k.backward()`` with
``loss_k = sum_k / count``, gradients summed by autograd) and torch.optim.

``loss=output``: a model's own loss is one scalar per microbatch. When it is a token mean,
``div(S, C)`` with ``S`` a sum over every dim and ``C`` a sum over every dim of a value no
trainable parameter reaches (transformers' ``ForCausalLMLoss``: cross_entropy with
``reduction="mean"`` and ``ignore_index``, lowered as the sum of the per-token losses over
the sum of the label mask; :func:`token_mean`), the step accumulates ``S`` and ``C`` instead
of the K means: each microbatch's ``C`` first (it reads only the data), ``count = sum C_k``,
the seed ``1 / count`` for each microbatch's ``S``, and ``loss = sum S_k / count``: the
token mean of the global batch, as one full-batch step computes it (the mean of K means
weighs a microbatch with few counted tokens as much as one with many). Exact as long as the
model treats batch rows independently, which accumulation assumes anyway. Any other scalar
is averaged over the K microbatches; a per-microbatch mean of another form (a data-dependent
denominator inside a larger expression, such as ``ce_mean + aux``) gets a compile warning
(:func:`accumulate_warnings`).
"""
from __future__ import annotations

from dataclasses import replace

from parcomp.errors import SpecError
from parcomp.ir.graph import Graph
from parcomp.ir.types import TensorType, shard_axes
from ..decompose import Emitter, cross_entropy_parts, padded_size
from . import amp
from .precision import upcast_grads


def micro_split(layout, mesh) -> int:
    """D: how many shards dim 0 of a stacked input with ``layout`` has on ``mesh``."""
    d = 1
    for a in shard_axes(layout, 0):
        d *= mesh.sizes[a]
    return d


def micro_slice(b, stacked: str, k: int, K: int, split: int, name: str) -> str:
    """Microbatch ``k`` of ``stacked`` ([K*B, ...], dim 0 split ``split`` ways)."""
    ty = b.type(stacked)
    rest, B = ty.shape[1:], ty.shape[0] // K
    r = b.op("reshape", [stacked], type=TensorType((split, K, B // split) + rest, ty.dtype),
             name=f"{name}.chunks")
    s = b.op("slice", [r], dim=1, start=k, stop=k + 1, name=f"{name}.slice")
    return b.op("reshape", [s], type=TensorType((B,) + rest, ty.dtype), name=name)


def accumulated_step(b, graph: Graph, cfg, spec, params: list, ad, cast=None) -> tuple:
    """Forward, loss and backward of K microbatches on Builder ``b`` (which holds the
    graph's params and buffers, not its inputs or compute nodes); ``ad``: the autodiff
    module (its loss helpers and ``backward``); ``cast``: mixed precision's ``{param: its
    low copy}`` (:func:`parcomp.passes.train.precision.lower_forward`). Returns ``(loss, params
    reaching it, {param: accumulated gradient})``.

    Mixed precision: each microbatch differentiates its own low copies (``mb<k>.<p>.low``),
    each gradient is widened (``grad_upcast``) before ``grad += grad_k``, so the sum is
    float32; fp16 seeds every microbatch with ``scale / count`` (GradScaler's
    ``scale(loss_k).backward()``) and unscales the accumulated gradients once, counting
    inf/NaN once for the step (:mod:`parcomp.passes.train.amp`).

    Raises SpecError: an input with no batch dim, a batch not divisible into K chunks per
    rank, ``input_grads=yes`` (or a pattern of inputs)."""
    K, mesh = cfg.options.accumulate, graph.mesh
    asked = dict(spec.train.options).get("input_grads")
    if asked not in (None, "no"):
        raise SpecError(f"accumulate={K} with input_grads={asked}: an input's gradient is per microbatch; "
                        f"drop input_grads (accumulation trains on data inputs)", cfg.loc)
    y, lay = ad.model_output(graph, cfg)
    stacked = {n.name: _stacked_input(b, n, K, mesh, cfg) for n in graph.inputs}
    mean = token_mean(graph, y) if cfg.loss == "output" else None
    counted = [_forward_clone(b, graph, stacked, k, K, mesh, only=_ancestors(graph, mean[1]))
               for k in range(K)] if mean else [None] * K  # each microbatch's count, before any forward
    b.phase, b.prefix = "loss", "loss"
    ty = graph[y].type
    data = _loss_data(b, graph, cfg, y, ty, lay, K, ad)
    if mean:
        count = _total(b, [ren[mean[1]] for ren in counted], "loss.count")
        seed = b.op("div", [b.op("ones", [], type=b.type(count), name="bw.loss"), count], name="bw.loss.seed")
    else:
        count, seed = _count_and_seed(b, graph, cfg, ty, data, K, y)
    cast = cast or {}
    b.prefix, b.phase = "bw", "backward"
    seed = amp.scaled_seed(b, seed, cfg, spec)  # fp16: the same scale for every microbatch
    totals, acc = [], {}
    for k in range(K):
        ren = _forward_clone(b, graph, stacked, k, K, mesh, ren=counted[k])
        b.phase, b.prefix = "loss", f"loss.mb{k}"
        tot = ren[mean[0]] if mean else _loss_sum(b, graph, cfg, ren[y], data, k, K, mesh)
        totals.append(tot)
        if k == 0:
            params = ad.reached_params(b, tot, params, cfg)
        b.phase = "backward"
        low = {p: ren[cast[p]] for p in params if p in cast}
        grads = ad.backward(b, Graph(tuple(b.nodes), (tot,)), {tot: seed}, [low.get(p, p) for p in params])
        grads.update(upcast_grads(b, graph, {low[p]: grads[low[p]] for p in low if low[p] in grads},
                                  {p: low[p] for p in low}, cfg))  # widened per microbatch
        for p in params:
            acc[p] = grads[p] if k == 0 else b.op("add", [acc[p], grads[p]], name=f"bw.{p}.accumulated")
    b.phase, b.prefix = "loss", "loss"
    total = _total(b, totals, "loss.total")
    loss = (b.op("div", [total, count], name="loss") if isinstance(count, str)
            else b.op("scale", [total], value=1.0 / count, name="loss"))
    return loss, params, amp.unscale(b, acc, cfg)  # fp16: unscaled once, after the K backwards


def _stacked_input(b, n, K, mesh, cfg) -> str:
    """The step's input ``n.name``: K microbatches of the model's input ``n`` along dim 0."""
    if not n.type.rank:
        raise SpecError(f"accumulate={K}: input {n.name} {n.type} has no batch dim to stack "
                        f"microbatches along", cfg.loc)
    ty = TensorType((K * n.type.shape[0],) + n.type.shape[1:], n.type.dtype)
    return b.source(n.name, "input", ty, n.layout, "forward")


def _total(b, values: list, name: str) -> str:
    """The sum of ``values`` (left to right)."""
    total = values[0]
    for v in values[1:]:
        total = b.op("add", [total, v], name=name)
    return total


def _forward_clone(b, graph, stacked, k, K, mesh, only=None, ren=None) -> dict:
    """Microbatch k's copy of every compute node (``mb<k>.<name>``), or of those in ``only``;
    ``ren``: the renaming of an earlier partial copy, whose nodes are not copied again.
    Returns the renaming."""
    b.phase = "forward"
    if ren is None:
        ren = {n.name: n.name for n in graph.params}
        for name, s in stacked.items():
            ren[name] = micro_slice(b, s, k, K, micro_split(graph[name].layout, mesh), f"mb{k}.{name}")
    ren = dict(ren)
    for n in graph.nodes:
        if n.op in ("input", "param") or n.name in ren or (only is not None and n.name not in only):
            continue
        new = replace(n, name=b.names.take(f"mb{k}.{n.name}"), inputs=tuple(ren[i] for i in n.inputs))
        b.nodes.append(new)
        b.types[new.name], b.phases[new.name] = new.type, new.phase
        ren[n.name] = new.name
    return ren


def _loss_data(b, graph, cfg, y, ty, lay, K, ad) -> str | None:
    """The stacked ``target`` (mse) or ``labels`` (cross_entropy) input, or None."""
    stack = lambda t: TensorType((K * t.shape[0],) + t.shape[1:], t.dtype)  # noqa: E731
    if cfg.loss == "mse":
        return ad.loss_input(b, "target", stack(ty), lay)
    if cfg.loss == "cross_entropy":
        from parcomp.ir.types import Replicate, Shard
        lab = tuple(Replicate() if p == Shard(ty.rank - 1) else p for p in lay)
        return ad.loss_input(b, "labels", stack(TensorType(ty.shape[:-1], "int64")), lab)
    return None


def _count_and_seed(b, graph, cfg, ty, data, K, y):
    """The loss's global denominator (a number, or the node counting labels) and the backward
    seed ``1 / count`` (one node: the one scaling of every microbatch's gradient)."""
    one = b.op("ones", [], type=TensorType((), ty.dtype), name="bw.loss")
    if cfg.loss == "cross_entropy":
        args = dict(cfg.loss_args)
        valid = b.op("label_mask", [data], ignore_index=args.get("ignore_index", -100), dtype=ty.dtype,
                     name="loss.counted")
        count = b.op("sum", [valid], dims=tuple(range(b.type(valid).rank)), name="loss.count")
        return count, b.op("div", [one, count], name="bw.loss.seed")
    count = K * (ty.numel if cfg.loss == "mse" else 1)
    return count, b.op("scale", [one], value=1.0 / count, name="bw.loss.seed")


def _loss_sum(b, graph, cfg, yk, data, k, K, mesh) -> str:
    """Microbatch k's loss *sum* (not divided by its count)."""
    if cfg.loss == "output":
        if b.type(yk).rank:
            raise SpecError(f"loss=output needs the model to return a scalar loss; it returns "
                            f"{b.type(yk)}", cfg.loc)
        return yk
    dk = micro_slice(b, data, k, K, micro_split(_layout(b, data), mesh), f"loss.mb{k}.{data}")
    if cfg.loss == "mse":
        per = b.op("pow", [b.op("sub", [yk, dk])], exponent=2.0)
    else:
        args = dict(cfg.loss_args)
        e = Emitter(b.names, b.types)
        pad = padded_size({n.name: n for n in b.nodes}, yk)
        per, _ = cross_entropy_parts(e, yk, dk, f"loss.mb{k}.ce", args.get("ignore_index", -100),
                                     args.get("label_smoothing", 0.0), pad)
        for n in e.out:
            b.nodes.append(replace(n, phase="loss"))
            b.phases[n.name] = "loss"
    return b.op("sum", [per], dims=tuple(range(b.type(per).rank)), name=f"loss.mb{k}.sum")


def _layout(b, name):
    return next(n.layout for n in b.nodes if n.name == name)


#: ops a scalar loss may pass through unchanged in value (a dtype cast, an output's layout)
_THROUGH = ("cast", "relayout")


def _through(graph, name: str) -> str:
    while graph[name].op in _THROUGH and len(graph[name].inputs) == 1:
        name = graph[name].inputs[0]
    return name


def _ancestors(graph, name: str) -> set:
    """``name`` and every value it is computed from."""
    seen, todo = set(), [name]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(graph[n].inputs)
    return seen


def _data_only(graph, name: str) -> bool:
    """Whether ``name`` is computed from the data alone: it reads an input and no trainable
    parameter (a count of tokens, not a value training changes)."""
    up = [graph[a] for a in _ancestors(graph, name)]
    return (any(n.op == "input" for n in up)
            and not any(n.op == "param" and n.attr("trainable", True) for n in up))


def _full_sum(graph, name: str) -> bool:
    """Whether ``name`` is a scalar ``sum`` over every dim of its operand (additive over batch rows)."""
    n = graph[name]
    if n.op != "sum" or n.type.rank:
        return False
    rank = graph[n.inputs[0]].type.rank
    return rank > 0 and set(n.attr("dims", ())) == set(range(rank))


def token_mean(graph, y: str) -> tuple | None:
    """``(S, C)`` when the scalar loss ``y`` is a token mean: ``div(S, C)`` with ``S`` a sum over
    every dim and ``C`` a sum over every dim of a value computed from the data alone, of
    ``S``'s dtype (each, and ``y``, possibly through casts and relayouts). None otherwise."""
    if graph[y].type.rank:
        return None
    d = graph[_through(graph, y)]
    if d.op != "div" or len(d.inputs) != 2:
        return None
    s, c = d.inputs
    if not (_full_sum(graph, _through(graph, s)) and _full_sum(graph, _through(graph, c))
            and _data_only(graph, _through(graph, c))):
        return None
    if graph[c].type.dtype != graph[s].type.dtype or graph[c].type.rank:
        return None
    return s, c


def _output_loss(graph, cfg) -> str | None:
    """The value of the model's own loss (``loss=output``: the output ``output=`` names, else
    the only one), or None (another loss, or no such output: the compile reports that)."""
    named = dict(graph.named_outputs())
    if cfg.loss != "output":
        return None
    return named.get(cfg.output) if cfg.output else next(iter(named.values())) if len(named) == 1 else None


def accumulates_token_mean(graph, cfg) -> bool:
    """Whether ``accumulate=K`` (K > 1) accumulates the model's own loss as a token mean of the
    global batch (:func:`token_mean` of the ``loss=output`` value of the model's ``graph``)."""
    y = _output_loss(graph, cfg)
    return cfg.options.accumulate > 1 and y is not None and token_mean(graph, y) is not None


def loss_accumulation(graph, spec) -> str | None:
    """How ``accumulate=K`` (K > 1) with ``loss=output`` combines the K microbatch losses, for
    report.json's ``training``: the token mean of the global batch (:func:`token_mean`) or
    the mean of the K losses; None for another loss or K = 1."""
    from parcomp.spec.train_config import train_config

    if spec.train is None:
        return None
    cfg = train_config(spec)
    K, y = cfg.options.accumulate, _output_loss(graph, cfg)
    if K < 2 or y is None:
        return None
    mean = token_mean(graph, y)
    if mean is None:
        return f"mean of the {K} microbatch losses"
    return (f"token mean of the global batch: %{mean[0]} and %{mean[1]} of the {K} microbatches summed, "
            f"then divided once")


def _per_microbatch_means(graph, y: str) -> list:
    """The ``div`` nodes ``y`` is computed from whose denominator is a scalar computed from the
    data alone (a count of tokens), each as ``(div node, its denominator)``."""
    return [(graph[a], graph[a].inputs[1]) for a in sorted(_ancestors(graph, y))
            if graph[a].op == "div" and len(graph[a].inputs) == 2 and not graph[graph[a].inputs[1]].type.rank
            and _data_only(graph, graph[a].inputs[1])]


def accumulate_warnings(graph, spec) -> list:
    """One message when ``accumulate=K`` (K > 1) and ``loss=output`` train on the mean of the
    K microbatch losses where the model's loss divides by a count of its microbatch's data
    (a token mean) in a form :func:`token_mean` does not accumulate exactly. ``graph``: the
    model's graph (unsharded)."""
    from parcomp.spec.train_config import train_config

    if spec.train is None:
        return []
    cfg = train_config(spec)
    K, y = cfg.options.accumulate, _output_loss(graph, cfg)
    if K < 2 or y is None or token_mean(graph, y) is not None:
        return []
    means = _per_microbatch_means(graph, y)
    if not means:
        return []
    div, count = means[0]
    return [f"accumulate={K} with loss=output: the model's loss %{y} divides by %{count}, a scalar "
            f"computed from its microbatch's data such as a count of tokens (at %{div.name}), so each step trains on the mean of the {K} "
            f"microbatch losses, not on the token mean of the global batch (a microbatch with few "
            f"counted tokens weighs as much as one with many). For token-exact accumulation the "
            f"output the loss is on must be the token mean itself, sum / count as its last op "
            f"(F.cross_entropy(logits, labels, ignore_index=-100), reduction 'mean'): parcomp then "
            f"accumulates the sum and the count over the {K} microbatches and divides once"]
