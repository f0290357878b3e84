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

import contextlib
import types

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


# ---- transformers' own experts modules --------------------------------------------------
# transformers (5.x) stores a MoE block's experts as 3-D tensors in one module whose forward
# it picks at run time (``@use_experts_implementation``: an expert loop over ``nonzero``, or
# ``grouped_mm`` after a sort by expert): data-dependent shapes either way. The experts'
# contract is fixed, though: ``forward(hidden_states [T, H], top_k_index [T, k],
# top_k_weights [T, k])`` with ``gate_up_proj`` [E, 2F, H] (or ``up_proj``), ``down_proj``
# [E, H, F] (``is_transposed``: [E, H, 2F] and [E, F, H]) and ``_apply_gate``. While torch.export
# traces, :func:`static_experts` gives each such module :func:`experts_forward`, the same sum
# written with the MoE ops above: the router's choice as combine weights [T, E], each token its
# own routing group with one slot per expert (nothing is dropped), the experts as one batched
# matmul per projection. The router (transformers' own, ``topk`` included) is traced as written.

def is_transformers_experts(m) -> bool:
    """Whether ``m`` is an experts module of transformers' ``@use_experts_implementation``."""
    weights = getattr(m, "gate_up_proj", None) if getattr(m, "has_gate", False) else getattr(m, "up_proj", None)
    down = getattr(m, "down_proj", None)
    return (hasattr(m, "_apply_gate") and hasattr(m, "is_transposed")
            and isinstance(getattr(m, "num_experts", None), int)
            and isinstance(weights, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter)
            and weights.dim() == 3 and down.dim() == 3)


def experts_forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """transformers' experts (``sum_k w_k * expert_{i_k}(x)`` per token) with static shapes."""
    if getattr(self, "has_bias", False) or getattr(self, "has_post_expert_norm", False):
        raise NotImplementedError("parcomp's static experts: expert biases and post-expert norms "
                                  "are not supported")
    t, h = hidden_states.shape
    e = self.num_experts
    c = torch.zeros(t, e, dtype=hidden_states.dtype).scatter_add(
        1, top_k_index, top_k_weights.to(hidden_states.dtype))  # combine weights [T, E]
    x, c = hidden_states.unsqueeze(1), c.unsqueeze(1)  # a token per routing group: [T, 1, H]
    d = moe_dispatch(x, c, 1, False).permute(1, 0, 2, 3).reshape(e, t, h)  # [E, T, H]
    up = self.gate_up_proj if self.has_gate else self.up_proj
    y = torch.matmul(d, up if self.is_transposed else up.transpose(1, 2))
    y = self._apply_gate(y) if self.has_gate else self.act_fn(y)
    y = torch.matmul(y, self.down_proj if self.is_transposed else self.down_proj.transpose(1, 2))
    return moe_combine(y.reshape(e, t, 1, h).permute(1, 0, 2, 3), c, True).reshape(t, h)


@contextlib.contextmanager
def static_experts(module):
    """:func:`experts_forward` as the forward of every transformers experts module of
    ``module`` while the block runs (the modules are unchanged after)."""
    found = [m for m in module.modules() if is_transformers_experts(m) and "forward" not in vars(m)]
    for m in found:
        m.forward = types.MethodType(experts_forward, m)
    try:
        yield found
    finally:
        for m in found:
            del m.forward
