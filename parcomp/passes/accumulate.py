"""Gradient accumulation (issue 13, ``train accumulate=K``) on the global graph.

The model's graph is traced at the *microbatch* shape; the step's data inputs (``x``,
``target``, ``labels``) hold K microbatches: their dim 0 is ``K * B`` (the global batch
``batch=``). Microbatch k is, on every rank, the k-th of K equal chunks of that rank's
share of dim 0 (as every DP framework splits its local batch): globally
``x.reshape(D, K, B/D, ...)[:, k].reshape(B, ...)`` with D the number of shards of dim 0.

The step is, in this order (so only one microbatch's activations are live at a time):

1. ``count``: the global denominator of the loss, once (mse: K * elements of the output;
   cross_entropy: the counted labels of all K microbatches; loss=output: K) and the
   backward seed ``1 / count``: **scaled once**, for every microbatch alike;
2. for k = 0..K-1: forward of microbatch k, its loss *sum*, its backward from the seed,
   and ``grad += grad_k``. The gradients stay in the layout backward leaves them
   (partial sums over dp), so the planner reduces the accumulated sum **once per step**,
   never per microbatch (one all_reduce / reduce_scatter costs less than K);
3. ``loss = (sum of the K loss sums) / count``: the mean over the global batch.

The gradient equals the global batch's gradient of the mean loss; the interpreter
checks it against torch running the same K microbatches (``loss_k.backward()`` with
``loss_k = sum_k / count``, gradients summed by autograd) and torch.optim.
"""
from __future__ import annotations

from dataclasses import replace

from ..errors import SpecError
from ..ir.graph import Graph
from ..ir.types import TensorType, shard_axes
from . import amp
from .decompose import Emitter, cross_entropy_parts, padded_size
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
    low copy}`` (:func:`parcomp.passes.precision.lower_forward`). Returns ``(loss, params
    reaching it, {param: accumulated gradient})``.

    Mixed precision: each microbatch differentiates its own low copies (``mb<k>.<p>.low``),
    each gradient is widened (``grad_upcast``) before ``grad += grad_k``, so the sum is
    float32; fp16 seeds every microbatch with ``scale / count`` (GradScaler's
    ``scale(loss_k).backward()``) and unscales the accumulated gradients once, counting
    inf/NaN once for the step (:mod:`parcomp.passes.amp`).

    Raises SpecError: an input with no batch dim, a batch not divisible into K chunks per
    rank, ``input_grads=yes``."""
    K, mesh = cfg.options.accumulate, graph.mesh
    if dict(spec.train.options).get("input_grads") == "yes":
        raise SpecError(f"accumulate={K} with input_grads=yes: an input's gradient is per microbatch; "
                        f"drop input_grads (accumulation trains on data inputs)", cfg.loc)
    y, lay = ad._model_output(graph, cfg)
    stacked = {n.name: _stacked_input(b, n, K, mesh, cfg) for n in graph.inputs}
    b.phase, b.prefix = "loss", "loss"
    ty = graph[y].type
    data = _loss_data(b, graph, cfg, y, ty, lay, K, ad)
    count, seed = _count_and_seed(b, graph, cfg, ty, data, K, y)
    cast = cast or {}
    b.prefix, b.phase = "bw", "backward"
    seed = amp.scaled_seed(b, seed, cfg, spec)  # fp16: the same scale for every microbatch
    totals, acc = [], {}
    for k in range(K):
        ren = _forward_clone(b, graph, stacked, k, K, mesh)
        b.phase, b.prefix = "loss", f"loss.mb{k}"
        tot = _loss_sum(b, graph, cfg, ren[y], data, k, K, mesh)
        totals.append(tot)
        if k == 0:
            params = ad._reaching(b, tot, params, cfg)
        b.phase = "backward"
        low = {p: ren[cast[p]] for p in params if p in cast}
        grads = ad.backward(b, Graph(tuple(b.nodes), (tot,)), {tot: seed}, [low.get(p, p) for p in params])
        grads.update(upcast_grads(b, graph, {low[p]: grads[low[p]] for p in low if low[p] in grads},
                                  {p: low[p] for p in low}, cfg))  # widened per microbatch
        for p in params:
            acc[p] = grads[p] if k == 0 else b.op("add", [acc[p], grads[p]], name=f"bw.{p}.accumulated")
    b.phase, b.prefix = "loss", "loss"
    total = totals[0]
    for t in totals[1:]:
        total = b.op("add", [total, t], name="loss.total")
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


def _forward_clone(b, graph, stacked, k, K, mesh) -> dict:
    """Microbatch k's copy of every compute node (``mb<k>.<name>``); returns the renaming."""
    b.phase = "forward"
    ren = {n.name: n.name for n in graph.params}
    for name, s in stacked.items():
        ren[name] = micro_slice(b, s, k, K, micro_split(graph[name].layout, mesh), f"mb{k}.{name}")
    for n in graph.nodes:
        if n.op in ("input", "param"):
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
        return ad._input(b, "target", stack(ty), lay)
    if cfg.loss == "cross_entropy":
        from ..ir.types import Replicate, Shard
        lab = tuple(Replicate() if p == Shard(ty.rank - 1) else p for p in lay)
        return ad._input(b, "labels", stack(TensorType(ty.shape[:-1], "int64")), lab)
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
