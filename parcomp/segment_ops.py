"""Ops run on a batch of tangents at once (a leading batch axis), for the linear maps of
:mod:`parcomp.segment_bounds`: a tangent operand ``[B, *shape]``, the forward operands as the
graph holds them. Ops whose numpy rule broadcasts (elementwise, matmul, the norm and attention
gradients, reductions over the last dim) run as they are; views get the batch axis in their
attributes; any other op runs once per tangent. Every result is checked to have the shape
``[B, *node shape]`` (else the op runs once per tangent)."""
from __future__ import annotations

import numpy as np

from .reference.numpy_ops import NUMPY_OPS

#: ops whose NUMPY_OPS rule takes a leading batch axis on a tangent operand of the output's rank
BROADCASTING = ("add", "sub", "mul", "div", "neg", "scale", "relayout", "matmul", "silu_grad",
                "relu_grad", "tanh_grad", "sigmoid_grad", "gelu_grad", "rms_norm_grad",
                "layer_norm_grad", "sdpa_grad")


def _axes(dims, ndim):
    return tuple(int(d) % ndim + 1 for d in dims)


VIEWS = {
    "reshape": lambda t, n: t.reshape((t.shape[0], *n.type.shape)),
    "permute": lambda t, n: np.transpose(t, (0, *_axes(n.attr("perm"), t.ndim - 1))),
    "sum": lambda t, n: np.sum(t, axis=_axes(n.attr("dims"), t.ndim - 1)),
    "expand": lambda t, n: np.broadcast_to(np.expand_dims(t, _axes(n.attr("dims"), len(n.type.shape))),
                                           (t.shape[0], *n.type.shape)),
}


def run_batched(node, operands, tangent, batch: int):
    """``node`` on ``operands``, where ``tangent[i]`` says operand i is a batch of ``batch``
    tangents ``[batch, *shape]``; returns ``[batch, *node.type.shape]``."""
    want = (batch, *node.type.shape)
    out = None
    rank = len(node.type.shape)
    if node.op in VIEWS and tangent == [True]:
        out = VIEWS[node.op](operands[0], node)
    elif node.op in BROADCASTING and _aligned(node, operands, tangent, rank):
        try:
            with np.errstate(all="ignore"):
                out = NUMPY_OPS[node.op](operands, node)
        except ValueError:  # shapes numpy cannot broadcast: once per tangent
            out = None
    if out is None or tuple(np.shape(out)) != want:
        out = np.stack([NUMPY_OPS[node.op]([x[b] if t else x for x, t in zip(operands, tangent)], node)
                        for b in range(batch)])
    return out


def _aligned(node, operands, tangent, rank) -> bool:
    """Whether numpy's right-aligned broadcasting keeps the batch axis apart: each tangent of
    the output's rank (+1 for the batch), each forward operand of at most that rank, and a
    matmul's tangent a matrix (a vector operand would meet the batch axis)."""
    tans = [np.ndim(x) for x, t in zip(operands, tangent) if t]
    fixed = [np.ndim(x) for x, t in zip(operands, tangent) if not t]
    return (all(d == rank + 1 for d in tans) and all(d <= rank for d in fixed)
            and (node.op != "matmul" or (all(d >= 3 for d in tans) and all(d >= 2 for d in fixed))))
