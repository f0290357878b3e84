"""RMSNorm as exporters write it before opset 23, found and replaced by ``RMSNormalization``.

torch.onnx writes transformers' ``LlamaRMSNorm`` (``w * (x * rsqrt(mean(x^2, -1) + eps))``) as

    Mul(w, Mul(x, Reciprocal(Sqrt(Add(ReduceMean(Pow(x, 2), axes=[-1], keepdims=1), eps)))))

(``Div(x, Sqrt(...))``, ``Pow(s, -0.5)`` and ``Mul(x, x)`` are read too; either operand
order).  :func:`rewrite_rms_norm` replaces the root by one ``RMSNormalization(x[, w])``
node with the same output (lowered to parcomp's ``rms_norm``, whose gradient is the
op's rather than five ops'); ``w`` joins when it is a 1-D value of
``x``'s last dim.  Unmatched formulas lower op by op.
"""
from __future__ import annotations

from .patterns import ONode, near_const


def _squared(name, prod, scalar):
    """``x`` when ``name`` is ``Pow(x, 2)`` or ``Mul(x, x)``, else None."""
    n = prod.get(name)
    if n is not None and n.op == "Pow" and near_const(scalar(n.inputs[1]), 2.0):
        return n.inputs[0]
    if n is not None and n.op == "Mul" and n.inputs[0] == n.inputs[1]:
        return n.inputs[0]
    return None


def _mean_sq_eps(name, prod, scalar, types):
    """``(x, eps)`` when ``name`` is ``ReduceMean(x^2, last axis, keepdims) + eps``."""
    add = prod.get(name)
    if add is None or add.op != "Add" or len(add.inputs) != 2:
        return None
    for m, e in (add.inputs, add.inputs[::-1]):
        eps, mean = scalar(e), prod.get(m)
        if eps is None or mean is None or mean.op != "ReduceMean" or not mean.attrs.get("keepdims", 1):
            continue
        x = _squared(mean.inputs[0], prod, scalar)
        ty = types.get(x) if x is not None else None
        axes = scalar(mean.inputs[1]) if len(mean.inputs) > 1 and mean.inputs[1] else None
        axes = axes if axes is not None else (mean.attrs.get("axes") or [None])[0]
        if ty is not None and ty.rank and axes is not None and int(axes) % ty.rank == ty.rank - 1:
            return x, eps
    return None


def _inv_sqrt(name, prod, scalar):
    """``s`` when ``name`` is ``1 / sqrt(s)`` (Reciprocal(Sqrt), Pow(., -0.5))."""
    n = prod.get(name)
    if n is not None and n.op == "Reciprocal":
        s = prod.get(n.inputs[0])
        return s.inputs[0] if s is not None and s.op == "Sqrt" else None
    if n is not None and n.op == "Pow" and near_const(scalar(n.inputs[1]), -0.5):
        return n.inputs[0]
    return None


def rms_of(n: ONode, prod: dict, scalar, types: dict):
    """``(x, eps)`` when ``n`` computes ``x / sqrt(mean(x^2, -1) + eps)``, else None."""
    if n.op == "Div" and len(n.inputs) == 2:
        s = prod.get(n.inputs[1])
        pairs = [(n.inputs[0], s.inputs[0])] if s is not None and s.op == "Sqrt" else []
    elif n.op == "Mul" and len(n.inputs) == 2:
        pairs = [(x, _inv_sqrt(r, prod, scalar)) for x, r in (n.inputs, n.inputs[::-1])]
    else:
        return None
    for x, s in pairs:
        got = _mean_sq_eps(s, prod, scalar, types) if s is not None else None
        if got is not None and got[0] == x:
            return got
    return None


def rewrite_rms_norm(nodes: list, scalar, types: dict) -> list:
    """``nodes`` with every RMSNorm formula's root replaced by ``RMSNormalization``
    (weight included when the root is ``Mul(w, norm)``); see the module docstring."""
    prod = {o: n for n in nodes for o in n.outputs}
    out = []
    for n in nodes:
        got = rms_of(n, prod, scalar, types)
        new = None
        if got is not None:
            new = ONode("RMSNormalization", n.name, (got[0],), n.outputs, {"epsilon": got[1]}, "", n.scope)
        elif n.op == "Mul" and len(n.inputs) == 2:
            for w, y in (n.inputs, n.inputs[::-1]):
                inner = prod.get(y)
                wt, xt = types.get(w), types.get(y)
                if inner is not None and inner.op == "RMSNormalization" and len(inner.inputs) == 1 and \
                        wt is not None and xt is not None and wt.shape == xt.shape[-1:]:
                    new = ONode("RMSNormalization", n.name, (inner.inputs[0], w), n.outputs,
                                dict(inner.attrs), "", n.scope)
                    break
        if new is not None:
            prod[n.outputs[0]] = n = new
        out.append(n)
    return out
