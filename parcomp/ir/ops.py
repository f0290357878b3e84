"""The op vocabulary: arity, shape inference and algebraic class of every op.

The algebraic ``kind`` is what the sharding rules and the verifier rely on:

- ``nonlinear``: never accepts a ``Partial`` input (DESIGN.md "rules that always hold").
- ``linear``: f(sum x_k) = sum f(x_k); passes ``Partial`` through.
- ``additive``: add/sub, linear in all operands jointly (a ``Replicate``
  addend must be counted once, so every operand must be ``Partial`` together).
- ``bilinear``: mul/matmul, linear in each operand separately (exactly one
  operand may be ``Partial``).
- ``linear0``: div, linear in the first operand only.
- ``source``: input/param; ``collective`` and ``local`` are layout changes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .types import TensorType


@dataclass(frozen=True)
class OpDef:
    """Static semantics of one op (Thunder's *meta* function)."""

    name: str
    arity: int  # -1: any
    kind: str
    infer: Callable  # (in_types, node) -> TensorType


def _same(ts, n):
    return ts[0]


def _broadcast(ts, n):
    try:
        shape = np.broadcast_shapes(*[t.shape for t in ts])
    except ValueError as e:
        raise ValueError(f"shapes {[t.shape for t in ts]} do not broadcast") from e
    return TensorType(tuple(int(s) for s in shape), ts[0].dtype)


def _matmul(ts, n):
    a, b = ts
    if a.rank < 1 or b.rank < 2:
        raise ValueError(f"matmul needs a rank>=1 lhs and rank>=2 rhs, got {a} and {b}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul contracts {a.shape[-1]} with {b.shape[-2]}")
    if b.rank > 2 and a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"batched matmul needs equal batch dims, got {a} and {b}")
    return TensorType(a.shape[:-1] + (b.shape[-1],), a.dtype)


def _permute(ts, n):
    perm = n.attr("perm")
    if sorted(perm) != list(range(ts[0].rank)):
        raise ValueError(f"perm {perm} is not a permutation of {ts[0].rank} dims")
    return TensorType(tuple(ts[0].shape[p] for p in perm), ts[0].dtype)


def _reshape(ts, n):
    # the target shape is the node's own type; check the element count
    if ts[0].numel != n.type.numel:
        raise ValueError(f"reshape of {ts[0]} to {n.type} changes the element count")
    return n.type


def _own(ts, n):
    return n.type


def _sum(ts, n):
    dims = n.attr("dims")
    return TensorType(tuple(s for d, s in enumerate(ts[0].shape) if d not in dims), ts[0].dtype)


def _expand(ts, n):
    dims = n.attr("dims")
    kept = tuple(s for d, s in enumerate(n.type.shape) if d not in dims)
    if kept != ts[0].shape:
        raise ValueError(f"expand along {dims} of {ts[0]} cannot give {n.type}")
    return n.type


def _cross_entropy(ts, n):
    logits, labels = ts
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"labels {labels} must have the shape of logits {logits} less its last dim")
    return TensorType(labels.shape, logits.dtype)


def _cross_entropy_grad(ts, n):
    dl, logits, labels = ts
    if dl.shape != labels.shape or logits.shape[:-1] != labels.shape:
        raise ValueError(f"shapes {dl}, {logits}, {labels} do not fit")
    return logits


OPS: dict = {}


def _def(name, arity, kind, infer):
    OPS[name] = OpDef(name, arity, kind, infer)


for _n in ("relu", "gelu", "tanh", "exp", "sigmoid", "silu", "pow", "add_scalar"):
    _def(_n, 1, "nonlinear", _same)
for _n in ("neg", "scale"):
    _def(_n, 1, "linear", _same)
_def("add", 2, "additive", _broadcast)
_def("sub", 2, "additive", _broadcast)
_def("mul", 2, "bilinear", _broadcast)
_def("div", 2, "linear0", _broadcast)
_def("matmul", 2, "bilinear", _matmul)
_def("permute", 1, "linear", _permute)
_def("reshape", 1, "linear", _reshape)
_def("sum", 1, "reduce", _sum)  # sum over attr dims (no keepdims)
_def("expand", 1, "expand", _expand)  # inverse of sum: broadcast along attr dims
_def("ones", 0, "const", _own)
# gradients of pointwise ops: op(dy, x) is linear in dy only
for _n in ("relu_grad", "gelu_grad", "tanh_grad", "sigmoid_grad", "silu_grad", "pow_grad"):
    _def(_n, 2, "linear0", _broadcast)
_def("cross_entropy", 2, "cross_entropy", _cross_entropy)  # per-token loss: logsumexp - picked logit
_def("cross_entropy_grad", 3, "cross_entropy_grad", _cross_entropy_grad)  # dl * (softmax - onehot)
_def("adamw_param", 4, "nonlinear", _broadcast)  # (p, m, v, t) -> updated p (torch.optim.AdamW)
_def("input", 0, "source", _own)
_def("param", 0, "source", _own)
# layout changes inserted by insert-collectives (see parcomp/redistribute.py)
for _n in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
    _def(_n, 1, "collective", _same)
for _n in ("shard_slice", "partial_mask"):
    _def(_n, 1, "local", _same)

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
LAYOUT_OPS = COLLECTIVES + ("shard_slice", "partial_mask")
# identity whose output layout is fixed by the spec (outputs, pinned activations);
# insert-collectives replaces it by the redistribution it asks for
_def("relayout", 1, "relayout", _same)

# attributes an op cannot do without (checked by the verifier)
REQUIRED_ATTRS = {
    "pow": ("exponent",), "pow_grad": ("exponent",), "scale": ("value",), "add_scalar": ("value",),
    "permute": ("perm",), "sum": ("dims",), "expand": ("dims",),
    "adamw_param": ("lr", "beta1", "beta2", "eps", "weight_decay"),
    **{op: ("axis",) for op in LAYOUT_OPS},
}
ATTR_CHOICES = {("gelu", "approximate"): ("none", "tanh"), ("gelu_grad", "approximate"): ("none", "tanh")}
