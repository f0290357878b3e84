"""Vector-Jacobian products: one rule per op (tinygrad's ``pm_gradient`` as a dict).

A rule is ``(b, node, g) -> tuple`` giving, for each input of ``node``, the name
of its gradient contribution (or None), where ``g`` names the gradient of the
node's output and ``b`` is a :class:`parcomp.passes.autodiff.Builder` that adds
nodes to the global graph.  Broadcast operands get their gradient summed back
to their own shape (:func:`unbroadcast`).  Each rule is checked against central
finite differences in float64 in ``tests/rules/test_vjp.py``.
"""
from __future__ import annotations

from ..ir.types import TensorType
from .norms import NORM_VJP_RULES
from .reductions import REDUCE_VJP_RULES


def unbroadcast(b, g, ty: TensorType):
    """Sum gradient ``g`` over the dims that broadcasting added to a ``ty`` operand."""
    gty = b.type(g)
    if gty.shape == ty.shape:
        return g
    lead = gty.rank - ty.rank
    dims = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(ty.shape)
                                      if s == 1 and gty.shape[lead + i] != 1)
    out = b.op("sum", [g], dims=dims)
    if b.type(out).shape != ty.shape:
        out = b.op("reshape", [out], type=ty)
    return out


def _ub(b, node, i, g):
    return unbroadcast(b, g, b.type(node.inputs[i]))


def _pointwise_grad(grad_op, use_output=False):
    def rule(b, n, g):
        x = n.name if use_output else n.inputs[0]
        attrs = dict(n.attrs) if grad_op in ("gelu_grad", "pow_grad") else {}
        return (b.op(grad_op, [g, x], **attrs),)
    return rule


def _matmul(b, n, g):
    a, w = n.inputs
    ta, tw = b.type(a), b.type(w)
    perm_w = tuple(range(tw.rank - 2)) + (tw.rank - 1, tw.rank - 2)
    da = b.op("matmul", [g, b.op("permute", [w], perm=perm_w)])
    if tw.rank > 2:  # batched: same batch dims
        perm_a = tuple(range(ta.rank - 2)) + (ta.rank - 1, ta.rank - 2)
        dw = b.op("matmul", [b.op("permute", [a], perm=perm_a), g])
    else:  # weight: fold every leading dim of a into the contraction
        k, n_out = tw.shape
        a2 = a if ta.rank == 2 else b.op("reshape", [a], type=TensorType((ta.numel // k, k), ta.dtype))
        g2 = g if ta.rank == 2 else b.op("reshape", [g], type=TensorType((ta.numel // k, n_out), ta.dtype))
        dw = b.op("matmul", [b.op("permute", [a2], perm=(1, 0)), g2])
    return da, dw


def _relayout_grad(b, n, g):
    """A pin with ``grad=true`` (``sequence-parallel``) pins the gradient to the same layout."""
    return b.op("relayout", [g], layout=n.layout, origin=f"gradient: {n.attr('origin')}")


def _add(b, n, g):
    return _ub(b, n, 0, g), _ub(b, n, 1, g)


def _sub(b, n, g):
    return _ub(b, n, 0, g), _ub(b, n, 1, b.op("neg", [g]))


def _mul(b, n, g):
    x, y = n.inputs
    return _ub(b, n, 0, b.op("mul", [g, y])), _ub(b, n, 1, b.op("mul", [g, x]))


def _div(b, n, g):
    x, y = n.inputs
    gx = b.op("div", [g, y])
    gy = b.op("neg", [b.op("div", [b.op("mul", [gx, x]), y])])
    return _ub(b, n, 0, gx), _ub(b, n, 1, gy)


def _permute(b, n, g):
    perm = n.attr("perm")
    inv = tuple(sorted(range(len(perm)), key=lambda i: perm[i]))
    return (b.op("permute", [g], perm=inv),)


def _cross_entropy(b, n, g):
    logits, labels = n.inputs
    return b.op("cross_entropy_grad", [g, logits, labels], **dict(n.attrs)), None


VJP_RULES = {
    "relu": _pointwise_grad("relu_grad"),
    "gelu": _pointwise_grad("gelu_grad"),
    "silu": _pointwise_grad("silu_grad"),
    "pow": _pointwise_grad("pow_grad"),
    "tanh": _pointwise_grad("tanh_grad", use_output=True),
    "sigmoid": _pointwise_grad("sigmoid_grad", use_output=True),
    "exp": lambda b, n, g: (b.op("mul", [g, n.name]),),
    "add_scalar": lambda b, n, g: (g,),
    "neg": lambda b, n, g: (b.op("neg", [g]),),
    "scale": lambda b, n, g: (b.op("scale", [g], value=n.attr("value")),),
    "add": _add,
    "sub": _sub,
    "mul": _mul,
    "div": _div,
    "matmul": _matmul,
    "permute": _permute,
    "reshape": lambda b, n, g: (b.op("reshape", [g], type=b.type(n.inputs[0])),),
    "relayout": lambda b, n, g: (_relayout_grad(b, n, g) if n.attr("grad", False) else g,),
    "sum": lambda b, n, g: (b.op("expand", [g], dims=n.attr("dims"), type=b.type(n.inputs[0])),),
    "expand": lambda b, n, g: (b.op("sum", [g], dims=n.attr("dims")),),
    "cross_entropy": _cross_entropy,
    **NORM_VJP_RULES,  # norms + embedding part: parcomp/rules/norms.py
    **REDUCE_VJP_RULES,  # reductions part: parcomp/rules/reductions.py
}


# ---- attention part: views, sdpa, RoPE pointwise ops ----
from .attention import ATTENTION_VJPS  # noqa: E402
from .views import VIEW_VJPS  # noqa: E402

VJP_RULES.update(VIEW_VJPS)
VJP_RULES.update(ATTENTION_VJPS)
# ---- end of the attention part ----
from .moe import MOE_VJP_RULES  # noqa: E402  expert parallel MoE

VJP_RULES.update(MOE_VJP_RULES)
