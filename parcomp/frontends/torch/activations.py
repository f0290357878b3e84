"""GELU spelt out as elementwise aten ops, found in the exported fx graph and lowered as one
``gelu`` node (:func:`gelu_patterns`, joined to the builder's fused patterns).

transformers' ``gelu_new`` (GPT-2), ``gelu_python_tanh`` and ``gelu_accurate`` export as
eight ops, ``mul(mul(x, 0.5), add(tanh(mul(add(x, mul(pow(x, 3), 0.044715)),
sqrt(2/pi))), 1))``; the erf form ``x * 0.5 * (1 + erf(x / sqrt(2)))`` as five. Both become
``gelu(x){approximate=tanh|none}``: the program runs ``torch.nn.functional.gelu`` (one kernel)
and its backward ``gelu_backward`` (instead of the VJP of eight ops), and the reference
interpreter its numpy formula. The products may come in any order and grouping (read through
nested ``mul`` and ``div`` by a number, as the ONNX importer's ``patterns.py`` does); the cube
is ``pow(x, 3)`` or ``x * x * x``; the constants must equal the formula's to
:data:`CONST_RTOL` (``gelu_fast``'s ``0.7978845608 * x * (1 + 0.044715 x^2)`` is another
grouping, not matched, and stays as it is written). The formula's inner nodes lower to
nothing when nothing outside the formula reads them.
"""
from __future__ import annotations

import math

import torch

from parcomp.ir.graph import Node, make_attrs

aten = torch.ops.aten

#: relative difference allowed between a number of the graph and the formula's
CONST_RTOL = 1e-6
_DEPTH = 6  # how many nested mul/div a product is read through
_MUL = (aten.mul.Tensor, aten.mul.Scalar)
_DIV = (aten.div.Tensor, aten.div.Scalar)
_ADD = (aten.add.Tensor, aten.add.Scalar)


def _call(fx, targets) -> bool:
    return isinstance(fx, torch.fx.Node) and fx.op == "call_function" and fx.target in targets


def _num(v):
    """``v`` as a python float when it is a number (not a tensor), else None."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _near(a, b) -> bool:
    return a is not None and abs(a - b) <= CONST_RTOL * abs(b)


def _factors(v, seen, depth=0):
    """``v`` as ``(c, [f1, f2, ...])`` (the value is ``c * f1 * f2 ...``); the mul/div nodes
    read are added to ``seen``."""
    c = _num(v)
    if c is not None:
        return c, []
    if depth < _DEPTH and _call(v, _MUL) and len(v.args) == 2 and not v.kwargs:
        seen.add(v)
        (c1, f1), (c2, f2) = (_factors(a, seen, depth + 1) for a in v.args)
        return c1 * c2, f1 + f2
    if depth < _DEPTH and _call(v, _DIV) and len(v.args) == 2 and not v.kwargs and _num(v.args[1]):
        seen.add(v)
        c, f = _factors(v.args[0], seen, depth + 1)
        return c / _num(v.args[1]), f
    return 1.0, [v]


def _plus_one(v, fn, seen):
    """The input of ``fn`` when ``v`` is ``fn(t) + 1`` (either order, alpha 1), else None."""
    if not _call(v, _ADD) or len(v.args) != 2 or v.kwargs.get("alpha", 1) != 1:
        return None
    for a, b in (v.args, v.args[::-1]):
        if _call(a, (fn,)) and _near(_num(b), 1.0):
            seen.update((v, a))
            return a.args[0]
    return None


def _cube_term(v, x, seen) -> bool:
    """``v`` is ``0.044715 * x^3`` (``pow(x, 3)`` or ``x * x * x``)."""
    c, fs = _factors(v, seen)
    if not _near(c, 0.044715):
        return False
    if len(fs) == 3 and all(f is x for f in fs):
        return True
    p = fs[0] if len(fs) == 1 else None
    if _call(p, (aten.pow.Tensor_Scalar,)) and p.args[0] is x and _near(_num(p.args[1]), 3.0):
        seen.add(p)
        return True
    return False


def _tanh_arg(v, x, seen) -> bool:
    """``v`` is ``sqrt(2/pi) * (x + 0.044715 * x^3)``."""
    c, fs = _factors(v, seen)
    s = fs[0] if len(fs) == 1 and _near(c, math.sqrt(2 / math.pi)) else None
    if not _call(s, _ADD) or len(s.args) != 2 or s.kwargs.get("alpha", 1) != 1:
        return False
    seen.add(s)
    return any(a is x and _cube_term(b, x, seen) for a, b in (s.args, s.args[::-1]))


def gelu_match(root):
    """``(x, "tanh" | "none", inner fx nodes)`` when ``root`` is the last ``mul`` of a GELU
    formula (module docstring), else None."""
    if not _call(root, _MUL):
        return None
    seen = set()
    c, fs = _factors(root, seen)
    if len(fs) != 2 or not _near(c, 0.5):
        return None
    for x, a in (fs, fs[::-1]):
        if not isinstance(x, torch.fx.Node):
            continue
        inner = set(seen)
        arg = _plus_one(a, aten.erf.default, inner)
        if arg is not None:
            ce, fe = _factors(arg, inner)
            if len(fe) == 1 and fe[0] is x and _near(ce, 1 / math.sqrt(2)):
                return x, "none", inner - {root}
        inner = set(seen)
        arg = _plus_one(a, aten.tanh.default, inner)
        if arg is not None and _tanh_arg(arg, x, inner):
            return x, "tanh", inner - {root}
    return None


def _skip(b, n, a):
    return None


def _gelu_lowering(x, approximate):
    def lower(b, n, a):
        xv = b.val(x)
        return b.add(Node(b.fresh("gelu"), "gelu", (xv,), b.types[xv], make_attrs(approximate=approximate)))
    return lower


def gelu_patterns(fx_nodes) -> dict:
    """fx node -> lowering ``(builder, fx node, args)``: the root of each GELU formula to one
    ``gelu``, and its inner nodes that nothing else reads to nothing."""
    out = {}
    for n in fx_nodes:
        if not _call(n, _MUL) or n in out:
            continue
        found = gelu_match(n)
        if found is None:
            continue
        x, approximate, inner = found
        out[n] = _gelu_lowering(x, approximate)
        # an inner node read from outside the formula (or by a kept one) is lowered as written
        keep = set()
        changed = True
        while changed:
            changed = False
            for m in inner - keep:
                if any(u is not n and u.target is not aten._assert_tensor_metadata.default
                       and (u not in inner or u in keep) for u in m.users):
                    keep.add(m)
                    changed = True
        out.update({m: _skip for m in inner - keep})
    return out
