"""The MoE ops as torch custom ops: what a torch model calls so that
``torch.export`` keeps routing, dispatch and combine as single nodes, and their frontend rows.

Mixtral's own ``MixtralSparseMoeBlock`` loops over the experts hit (``nonzero``,
``torch.where``): data-dependent shapes, which ``torch.export`` turns into unbacked sizes
and a graph per routing. ``torch.ops.parcomp.moe_route / moe_dispatch / moe_combine`` keep the
routing inside three ops of static shape (the dispatch buffer holds ``capacity`` slots per
expert per row); ``specs/models.py:moe_block`` is Mixtral's block written with them (checked
against the real class in tests/moe/test_moe.py). Eager forward and backward run the helpers of
``backends/torch/runtime/program_moe.py``, the same functions program.py runs.
"""
from __future__ import annotations

import torch

from parcomp_backends.torch.runtime import program_moe as _moe

Tensor = torch.Tensor


@torch.library.custom_op("parcomp::moe_route", mutates_args=())
def moe_route(z: Tensor, top_k: int, capacity: int) -> Tensor:
    """Combine weights [..., S, E] of router logits z (parcomp/reference/moe_ops.py:route)."""
    return _moe.moe_route(z, top_k, capacity)


@moe_route.register_fake
def _(z, top_k, capacity):
    return torch.empty_like(z)


def _route_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.k, ctx.cap = inputs[1], inputs[2]


def _route_bw(ctx, g):
    return _moe.moe_route_grad(g, ctx.saved_tensors[0], ctx.k, ctx.cap), None, None


moe_route.register_autograd(_route_bw, setup_context=_route_setup)


@torch.library.custom_op("parcomp::moe_dispatch", mutates_args=())
def moe_dispatch(x: Tensor, c: Tensor, capacity: int, weighted: bool) -> Tensor:
    """[B, E, capacity, H] dispatch buffer of tokens x[B, S, H] under weights c[B, S, E]."""
    return _moe.moe_dispatch(x, c, capacity, weighted)


@moe_dispatch.register_fake
def _(x, c, capacity, weighted):
    return x.new_empty((x.shape[0], c.shape[2], capacity, x.shape[2]))


@torch.library.custom_op("parcomp::moe_combine", mutates_args=())
def moe_combine(y: Tensor, c: Tensor, weighted: bool) -> Tensor:
    """[B, S, H]: each token's slots of y[B, E, C, H] summed, times c[B, S, E] if weighted."""
    return _moe.moe_combine(y, c, weighted)


@moe_combine.register_fake
def _(y, c, weighted):
    return y.new_empty((c.shape[0], c.shape[1], y.shape[3]))


def _pair_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.rest = inputs[2:]


def _dispatch_bw(ctx, g):
    x, c = ctx.saved_tensors
    cap, weighted = ctx.rest
    dc = _moe.moe_combine_grad_c(x, g, c) if weighted else None
    return _moe.moe_combine(g, c, weighted), dc, None, None


def _combine_bw(ctx, g):
    y, c = ctx.saved_tensors
    (weighted,) = ctx.rest
    dc = _moe.moe_combine_grad_c(g, y, c) if weighted else None
    return _moe.moe_dispatch(g, c, y.shape[2], weighted), dc, None


moe_dispatch.register_autograd(_dispatch_bw, setup_context=_pair_setup)
moe_combine.register_autograd(_combine_bw, setup_context=_pair_setup)

_ops = torch.ops.parcomp
MOE_TABLE = {  # frontend rows: (builder, fx node, args by schema name) -> value name
    _ops.moe_route.default: lambda b, n, a: b.emit("moe_route", [b.val(a["z"])], top_k=int(a["top_k"]),
                                                   capacity=int(a["capacity"])),
    _ops.moe_dispatch.default: lambda b, n, a: b.emit("moe_dispatch", [b.val(a["x"]), b.val(a["c"])],
                                                      capacity=int(a["capacity"]),
                                                      weighted=bool(a["weighted"])),
    _ops.moe_combine.default: lambda b, n, a: b.emit("moe_combine", [b.val(a["y"]), b.val(a["c"])],
                                                     weighted=bool(a["weighted"])),
}
