"""The hand-written Megatron block (TP: f/g all_reduce; SP: all_gather / reduce_scatter of the
sequence) and the DTensor plans of bench/tp_block_train.py, taken unchanged from the shared
anchor ``shared/anchors/bench/tp_sp_block.py`` (so parcomp is measured against the same peers)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

class _CopyToTP(torch.autograd.Function):  # Megatron f
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        dist.all_reduce(g)
        return g


class _ReduceFromTP(torch.autograd.Function):  # Megatron g
    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


def _all_gather_seq(x):
    """(B, s, H) local -> (B, world*s, H): all_gather into a dim-0 concat buffer + one copy.

    (gloo rejects the stacked (world, ...) output form of all_gather_single here.)
    """
    w = dist.get_world_size()
    b, s = x.shape[0], x.shape[1]
    out = torch.empty((w * b,) + tuple(x.shape[1:]), dtype=x.dtype)
    dist.all_gather_single(out, x.contiguous())
    return out.view(w, b, s, *x.shape[2:]).transpose(0, 1).reshape(b, w * s, *x.shape[2:])


def _reduce_scatter_seq(x):
    """(B, S, H) partial -> (B, S/world, H) reduced: seq chunks concatenated on dim 0 + reduce_scatter."""
    w = dist.get_world_size()
    b, s = x.shape[0], x.shape[1]
    inp = x.reshape(b, w, s // w, *x.shape[2:]).transpose(0, 1).reshape(w * b, s // w, *x.shape[2:])
    out = torch.empty((b, s // w) + tuple(x.shape[2:]), dtype=x.dtype)
    dist.reduce_scatter_single(out, inp)
    return out


class _GatherSeq(torch.autograd.Function):  # SP: all_gather fwd, reduce_scatter bwd
    @staticmethod
    def forward(ctx, x):
        return _all_gather_seq(x)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_seq(g)


class _ScatterSeq(torch.autograd.Function):  # SP: reduce_scatter fwd, all_gather bwd
    @staticmethod
    def forward(ctx, x):
        return _reduce_scatter_seq(x)

    @staticmethod
    def backward(ctx, g):
        return _all_gather_seq(g)


class HandBlock(nn.Module):
    def __init__(self, ref: Block, rank, world, sp: bool, comm: bool = True):
        super().__init__()
        self.comm = comm  # comm=False (TP only): same local compute, collectives skipped
        h = ref.norm1.normalized_shape[0]
        self.h, self.sp, self.hd = h, sp, ref.attn.hd
        P = lambda t: nn.Parameter(t.detach().clone())  # noqa: E731
        a, m = ref.attn, ref.mlp
        sh, sf = slice(rank * h // world, (rank + 1) * h // world), slice(rank * 4 * h // world, (rank + 1) * 4 * h // world)
        self.sh, self.sf = sh, sf
        self.ln1_w, self.ln1_b = P(ref.norm1.weight), P(ref.norm1.bias)
        self.ln2_w, self.ln2_b = P(ref.norm2.weight), P(ref.norm2.bias)
        self.wq, self.bq = P(a.q.weight[sh]), P(a.q.bias[sh])
        self.wk, self.bk = P(a.k.weight[sh]), P(a.k.bias[sh])
        self.wv, self.bv = P(a.v.weight[sh]), P(a.v.bias[sh])
        self.wo, self.bo = P(a.o.weight[:, sh]), P(a.o.bias)
        self.w1, self.b1 = P(m.fc1.weight[sf]), P(m.fc1.bias[sf])
        self.w2, self.b2 = P(m.fc2.weight[:, sf]), P(m.fc2.bias)
        # replicated params whose grads are partial sums under SP
        self.sp_replicated = [self.ln1_w, self.ln1_b, self.ln2_w, self.ln2_b, self.bo, self.b2]

    def _enter(self, t):
        if not self.comm:
            return t
        return _GatherSeq.apply(t) if self.sp else _CopyToTP.apply(t)

    def _exit(self, t):
        if not self.comm:
            return t
        return _ScatterSeq.apply(t) if self.sp else _ReduceFromTP.apply(t)

    def forward(self, x):
        h = self.h
        a = self._enter(F.layer_norm(x, (h,), self.ln1_w, self.ln1_b))
        b, s = a.shape[0], a.shape[1]
        q = F.linear(a, self.wq, self.bq).view(b, s, -1, self.hd).transpose(1, 2)
        k = F.linear(a, self.wk, self.bk).view(b, s, -1, self.hd).transpose(1, 2)
        v = F.linear(a, self.wv, self.bv).view(b, s, -1, self.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + (self._exit(F.linear(y, self.wo)) + self.bo)
        a = self._enter(F.layer_norm(x, (h,), self.ln2_w, self.ln2_b))
        mm = F.linear(F.gelu(F.linear(a, self.w1, self.b1)), self.w2)
        return x + (self._exit(mm) + self.b2)

    def finalize_grads(self):
        if not self.sp:
            return
        grads = [p.grad for p in self.sp_replicated]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        o = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[o:o + n].view_as(g))
            o += n

    def grads(self):
        return {
            "norm1.weight": self.ln1_w.grad, "norm1.bias": self.ln1_b.grad,
            "norm2.weight": self.ln2_w.grad, "norm2.bias": self.ln2_b.grad,
            "attn.q.weight": self.wq.grad, "attn.q.bias": self.bq.grad,
            "attn.k.weight": self.wk.grad, "attn.k.bias": self.bk.grad,
            "attn.v.weight": self.wv.grad, "attn.v.bias": self.bv.grad,
            "attn.o.weight": self.wo.grad, "attn.o.bias": self.bo.grad,
            "mlp.fc1.weight": self.w1.grad, "mlp.fc1.bias": self.b1.grad,
            "mlp.fc2.weight": self.w2.grad, "mlp.fc2.bias": self.b2.grad,
        }


def dtensor_plan(kind):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel)

    if kind == "tp":
        return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.o": RowwiseParallel(), "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
    if kind == "tp-prep":
        return {"attn": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
                "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.o": RowwiseParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
                "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
    if kind == "sp":
        return {"norm1": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.o": RowwiseParallel(output_layouts=Shard(1)),
                "norm2": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel(output_layouts=Shard(1))}
    raise ValueError(kind)


def dtensor_finalize(params):
    """Partial grads of replicated params -> Replicate (one all_reduce each)."""
    from torch.distributed.tensor import DTensor, Replicate

    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(g.device_mesh, [Replicate()] * g.device_mesh.ndim)


def local(t):
    if hasattr(t, "to_local"):
        t = t.to_local()
    if hasattr(t, "wait") and hasattr(t, "elem"):  # AsyncCollectiveTensor
        t = t.wait()
    return t


