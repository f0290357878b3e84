"""Vocab-parallel cross entropy: the loss of logits split over the vocabulary (``Shard(-1)``)
computed without gathering them, as DTensor's ``loss_parallel`` does.

Each rank holds the logits of a slice ``[v0, v0 + V/n)`` of the vocabulary. Three all_reduces
over the splitting axis, each of one value per token: the max (for a stable softmax), the sum of
``exp(logit - max)``, and the target's logit (only the rank whose slice holds the target adds
it). The loss is ``log(sum) + max - target logit`` per token, averaged over the tokens whose
label is not ``ignore_index``. Backward needs no collective: the gradient of this rank's slice
is ``softmax - onehot`` on that slice.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import ParcompError


class VocabParallelCrossEntropy(torch.autograd.Function):
    """``cross_entropy(logits, labels)`` of a vocab-split ``logits`` (this rank's slice, starting
    at vocabulary index ``start``) over ``group``; mean over the counted tokens, or their sum."""

    @staticmethod
    def forward(ctx, logits, labels, group, start, ignore_index, reduction):
        vocab = logits.shape[-1]
        x = logits.reshape(-1, vocab).float()
        y = labels.reshape(-1)
        top = x.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        e = torch.exp(x - top[:, None])
        total = e.sum(dim=-1)
        dist.all_reduce(total, group=group)
        mine = (y >= start) & (y < start + vocab)
        index = (y - start).clamp(0, vocab - 1)
        target = x.gather(1, index[:, None]).squeeze(1) * mine
        dist.all_reduce(target, group=group)
        counted = y != ignore_index
        per_token = (torch.log(total) + top - target) * counted
        count = counted.sum().clamp(min=1).to(x.dtype)
        loss = per_token.sum() / count if reduction == "mean" else per_token.sum()
        ctx.save_for_backward(e / total[:, None], index, mine, counted, count)
        ctx.shape, ctx.dtype, ctx.mean = logits.shape, logits.dtype, reduction == "mean"
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        softmax, index, mine, counted, count = ctx.saved_tensors
        g = softmax.clone()
        g[torch.arange(g.shape[0]), index] -= mine.to(g.dtype)
        g = g * counted[:, None].to(g.dtype) * grad.float()
        if ctx.mean:
            g = g / count
        return g.reshape(ctx.shape).to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits, labels, group, start: int, *, ignore_index: int = -100,
                                 reduction: str = "mean"):
    """The cross entropy of vocab-split ``logits`` (see the module docstring); differentiable in
    ``logits``. ``labels`` are global vocabulary indices, shaped as ``logits`` less its last dim."""
    if reduction not in ("mean", "sum"):
        raise ParcompError(f"cross_entropy: reduction={reduction!r}; give 'mean' or 'sum'")
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ParcompError(f"cross_entropy: labels of shape {list(labels.shape)} for logits of shape "
                           f"{list(logits.shape)}: the labels are the logits' shape less the vocabulary dim")
    return VocabParallelCrossEntropy.apply(logits, labels, group, start, ignore_index, reduction)
