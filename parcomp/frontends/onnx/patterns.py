"""GELU as exporters write it without the ``Gelu`` op, found and replaced by one ``Gelu`` node.

Before opset 20 ONNX has no ``Gelu``; exporters (torch.onnx's TorchScript path, tf2onnx,
and every model that spells GELU out, as GPT-2's ``gelu_new`` does) write

- exact: ``x * 0.5 * (1 + Erf(x / sqrt(2)))`` (or ``Erf(x * 0.7071...)``),
- tanh: ``x * 0.5 * (1 + Tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))``, ``x^3`` as
  ``Pow(x, 3)`` or ``x * x * x``,

with the products in any order and grouping.  :func:`rewrite_gelu` reads every ``Mul``
as a product ``c * f1 * f2 ...`` (through nested ``Mul`` and ``Div`` by a constant) and
replaces the root ``Mul`` of such a formula by ``Gelu(x, approximate=none|tanh)`` with the
same output; the nodes it no longer needs are dropped by the importer's dead-code pass
(any other reader keeps them).  The constants must equal the formula's to
:data:`CONST_RTOL` (an exporter writes them rounded to float32).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

#: relative difference allowed between a constant of the graph and the formula's
#: (float32 rounding is 6e-8; exporters that print 7 significant digits stay within this)
CONST_RTOL = 1e-6
_DEPTH = 6  # how many nested Mul/Div a product is read through
_ADDS = ("Add", "Sum")  # a two-input Sum is an Add (onnx's own function bodies write it)


@dataclass(frozen=True)
class ONode:
    """One ONNX node as the importer reads it: op type, name, value names, attributes
    (python values), domain, the model module it was exported from, and the NodeProto."""

    op: str
    name: str
    inputs: tuple
    outputs: tuple
    attrs: dict = field(default_factory=dict)
    domain: str = ""
    scope: str | None = None
    proto: object = None


def near_const(a, b) -> bool:
    return a is not None and abs(a - b) <= CONST_RTOL * abs(b)


def factors(name, prod, scalar, depth=0) -> tuple:
    """``name`` as ``(c, [f1, f2, ...])``: the value is ``c * f1 * f2 ...``."""
    s = scalar(name)
    if s is not None:
        return s, []
    n = prod.get(name)
    if n is not None and depth < _DEPTH and len(n.inputs) == 2:
        if n.op == "Mul":
            (c1, f1), (c2, f2) = (factors(i, prod, scalar, depth + 1) for i in n.inputs)
            return c1 * c2, f1 + f2
        d = scalar(n.inputs[1]) if n.op == "Div" else None
        if d:
            c, f = factors(n.inputs[0], prod, scalar, depth + 1)
            return c / d, f
    return 1.0, [name]


def _one_plus(name, prod, scalar, op):
    """The input of ``op`` when ``name`` is ``Add(op(t), 1)`` (either order; or Sum), else None."""
    n = prod.get(name)
    if n is None or n.op not in _ADDS or len(n.inputs) != 2:
        return None
    for a, b in (n.inputs, n.inputs[::-1]):
        t = prod.get(a)
        if t is not None and t.op == op and near_const(scalar(b), 1.0):
            return t.inputs[0]
    return None


def _is_cube_term(name, x, prod, scalar) -> bool:
    """``name`` is ``0.044715 * x^3``."""
    c, fs = factors(name, prod, scalar)
    if not near_const(c, 0.044715):
        return False
    if fs == [x, x, x]:
        return True
    p = prod.get(fs[0]) if len(fs) == 1 else None
    return p is not None and p.op == "Pow" and p.inputs[0] == x and near_const(scalar(p.inputs[1]), 3.0)


def _tanh_arg_ok(name, x, prod, scalar) -> bool:
    """``name`` is ``sqrt(2/pi) * (x + 0.044715 * x^3)``."""
    c, fs = factors(name, prod, scalar)
    s = prod.get(fs[0]) if len(fs) == 1 and near_const(c, math.sqrt(2 / math.pi)) else None
    if s is None or s.op not in _ADDS or len(s.inputs) != 2:
        return False
    return any(a == x and _is_cube_term(b, x, prod, scalar) for a, b in (s.inputs, s.inputs[::-1]))


def gelu_of(n: ONode, prod: dict, scalar) -> tuple:
    """``(x, "none" | "tanh")`` when ``n`` is the root ``Mul`` of a GELU formula, else ``(None, None)``.

    ``prod``: value name -> producing ONode; ``scalar(name)``: the value as a python
    float when it is a constant with one element (else None).
    """
    if n.op != "Mul" or len(n.inputs) != 2:
        return None, None
    c, fs = factors(n.outputs[0], prod, scalar)
    if len(fs) != 2 or not near_const(c, 0.5):
        return None, None
    for x, a in (fs, fs[::-1]):
        inner = _one_plus(a, prod, scalar, "Erf")
        if inner is not None:
            ce, fe = factors(inner, prod, scalar)
            if fe == [x] and near_const(ce, 1 / math.sqrt(2)):
                return x, "none"
        inner = _one_plus(a, prod, scalar, "Tanh")
        if inner is not None and _tanh_arg_ok(inner, x, prod, scalar):
            return x, "tanh"
    return None, None


def rewrite_gelu(nodes: list, scalar) -> list:
    """``nodes`` with the root of every GELU formula replaced by a ``Gelu`` node (same
    output name, name and module); see the module docstring."""
    prod = {o: n for n in nodes for o in n.outputs}
    out = []
    for n in nodes:
        x, approx = gelu_of(n, prod, scalar)
        if x is not None:
            n = ONode("Gelu", n.name, (x,), n.outputs, {"approximate": approx}, "", n.scope)
            prod[n.outputs[0]] = n
        out.append(n)
    return out
