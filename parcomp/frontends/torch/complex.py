"""Complex values lowered to real arithmetic (complex rotary embeddings: DeepSeek-V2's and
Meta's Llama ``apply_rotary_emb``, ``torch.view_as_complex(x.reshape(..., -1, 2)) * freqs_cis``
then ``torch.view_as_real``): parcomp computes in real dtypes, so the frontend carries each
complex fx value as a pair of real values (:class:`Complex`: the real and imaginary parts, each
of the complex value's shape) and writes every complex op on the pair:

- ``view_as_complex(x)`` (x ``[..., 2]``): the two ``slice``\\ s of the last dim, reshaped to drop it;
- ``view_as_real(z)``: ``cat`` of the two parts along a new last dim;
- ``mul``: ``(ar br - ai bi, ar bi + ai br)`` (a real operand scales both parts), ``add`` / ``sub``
  part by part;
- view-like ops of one operand (``unsqueeze``, ``view``, ``reshape``, ``expand``, ``to`` without a
  dtype change, ``clone``, ``slice``, ``permute``, ``transpose``...): the real op on each part;
- a folded complex constant (``freqs_cis = torch.polar(ones, freqs)`` from buffers): two frozen
  params, ``<name>.real`` and ``<name>.imag``.

A complex value that reaches a real op any other way (``abs``, ``angle``, a complex model
output) is a located error naming the op.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from parcomp.ir.types import TensorType

from .attention import slice_of
from .hints import COMPLEX

aten = torch.ops.aten

#: complex dtype -> the real dtype of its parts
REAL = {torch.complex64: torch.float32, torch.complex128: torch.float64, torch.complex32: torch.float16}


class Complex(NamedTuple):
    """A complex fx value as its real and imaginary parts (value names)."""

    re: str
    im: str


def is_complex_node(fx) -> bool:
    val = fx.meta.get("val") if isinstance(fx, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dtype.is_complex


def touches_complex(fx) -> bool:
    """Whether fx node ``fx`` makes or reads a complex value."""
    return is_complex_node(fx) or any(is_complex_node(i) for i in fx.all_input_nodes)


def _real_meta(val):
    return torch.empty(tuple(val.shape), dtype=REAL[val.dtype], device="meta")


def _part(b, x: str, dim: int, i: int, ty: TensorType) -> str:
    s = slice_of(b, x, dim, i, i + 1, 1, "_re" if i == 0 else "_im")
    return b.emit("reshape", [s], "_re_part" if i == 0 else "_im_part", ty=ty)


def _pair(b, arg):
    """(re, im) of operand ``arg``: a Complex value, or a real value (imaginary part None)."""
    v = b.env.get(arg) if isinstance(arg, torch.fx.Node) else None
    if isinstance(v, Complex):
        return v.re, v.im
    return b.val(arg), None


def _view_as_complex(b, n, a):
    x = b.val(a["self"])
    shape, dtype = b.types[x].shape, b.types[x].dtype
    ty = TensorType(shape[:-1], dtype)
    return Complex(_part(b, x, len(shape) - 1, 0, ty), _part(b, x, len(shape) - 1, 1, ty))


def _view_as_real(b, n, a):
    z = b.env.get(a["self"])
    ty = b.types[z.re]
    one = TensorType(ty.shape + (1,), ty.dtype)
    parts = [b.emit("reshape", [p], s, ty=one) for p, s in ((z.re, "_re"), (z.im, "_im"))]
    return b.emit("cat", parts, dim=len(ty.shape))


def _mul(b, n, a):
    (ar, ai), (br, bi) = _pair(b, a["self"]), _pair(b, a["other"])
    if ai is None or bi is None:  # a real factor scales both parts
        (xr, xi), y = ((br, bi), ar) if ai is None else ((ar, ai), br)
        return Complex(b.emit("mul", [xr, y], "_re"), b.emit("mul", [xi, y], "_im"))
    re = b.emit("sub", [b.emit("mul", [ar, br], "_rr"), b.emit("mul", [ai, bi], "_ii")], "_re")
    im = b.emit("add", [b.emit("mul", [ar, bi], "_ri"), b.emit("mul", [ai, br], "_ir")], "_im")
    return Complex(re, im)


def _additive(op):
    def lower(b, n, a):
        if a.get("alpha", 1) != 1:
            raise b.fail(f"complex {op} with alpha is not supported")
        (ar, ai), (br, bi) = _pair(b, a["self"]), _pair(b, a["other"])
        if ai is None or bi is None:
            raise b.fail(f"complex {op} of a real and a complex tensor is not supported")
        return Complex(b.emit(op, [ar, br], "_re"), b.emit(op, [ai, bi], "_im"))
    return lower


COMPLEX_TABLE = {
    aten.view_as_complex.default: _view_as_complex,
    aten.view_as_real.default: _view_as_real,
    aten.mul.Tensor: _mul,
    aten.add.Tensor: _additive("add"),
    aten.sub.Tensor: _additive("sub"),
}
#: ops of one tensor operand that act on each part alike (their real lowerings run per part)
PER_PART = {aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.view.default,
            aten.reshape.default, aten._unsafe_view.default, aten.expand.default, aten.clone.default,
            aten.alias.default, aten.contiguous.default, aten.slice.Tensor, aten.select.int,
            aten.permute.default, aten.transpose.int, aten.to.dtype_layout, aten.to.device,
            aten._to_copy.default, aten.detach.default}


def lower_complex(b, n, table: dict, bind) -> object:
    """The lowering of fx node ``n`` that makes or reads a complex value: a :class:`Complex`
    or, for ``view_as_real``, a real value name."""
    a = bind(n)
    if n.target in COMPLEX_TABLE:
        return COMPLEX_TABLE[n.target](b, n, a)
    src = [i for i in n.all_input_nodes if isinstance(b.env.get(i), Complex)]
    out_complex = is_complex_node(n)
    if n.target not in PER_PART or len(n.all_input_nodes) != 1 or not src or not out_complex:
        raise b.fail(f"{n.target} on a complex value is not supported", f"; {COMPLEX}")
    val = n.meta["val"]
    if REAL[val.dtype] != REAL[src[0].meta["val"].dtype]:
        raise b.fail(f"{n.target} changes a complex dtype ({src[0].meta['val'].dtype} to {val.dtype}); "
                     "not supported")
    z = b.env[src[0]]
    parts = []
    n.meta["val"] = _real_meta(val)
    try:
        for part in z:
            b.env[src[0]] = part
            parts.append(table[n.target](b, n, a))
    finally:
        b.env[src[0]], n.meta["val"] = z, val
    return Complex(*parts)
