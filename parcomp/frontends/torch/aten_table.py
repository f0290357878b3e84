"""The aten lowering table of the torch.export frontend.

:data:`TABLE` maps an aten op overload to a lowering ``(builder, fx node, args bound
by schema name) -> value name``; the builder is
:class:`parcomp.frontends.torch.export._Builder` (``b.val(arg)``: an operand's value,
``b.emit(op, inputs, suffix, ty=None, **attrs)``: a new node named after the fx node,
``b.types``, ``b.type_of(fx)``, ``b.fail(msg)``).  Parts that add IR ops add their
rows as one block (``TABLE.update``), next to their ops.
"""
from __future__ import annotations

import torch

from parcomp.ir.ops import OPS
from parcomp.ir.types import TensorType

aten = torch.ops.aten


def _is_scalar(x) -> bool:
    return isinstance(x, (int, float, bool))


# ---- lowering functions: (builder, fx node, bound args) -> value name -------------

def _unary(op: str):
    return lambda b, n, a: b.emit(op, [b.val(a["self"])])


def _promoted(b, n, fx, suffix: str) -> str:
    """The value of tensor operand ``fx`` in the dtype torch computes ``n`` in (type promotion:
    float32 + float64 is float64), converted where it differs."""
    x, dtype = b.val(fx), b.type_of(n).dtype
    if b.types[x].dtype == dtype:
        return x
    return b.emit("cast", [x], suffix, ty=TensorType(b.types[x].shape, dtype))


def _scaled(b, x: str, alpha, suffix: str) -> str:
    return x if alpha == 1 else b.emit("scale", [x], suffix, value=float(alpha))


def _additive(op: str, sign: float):
    """add/sub (with ``alpha``); a scalar ``other`` becomes ``add_scalar``."""
    def lower(b, n, a):
        x, y, alpha = a["self"], a["other"], a.get("alpha", 1)
        if _is_scalar(y):
            return b.emit("add_scalar", [b.val(x)], value=float(sign * y * alpha))
        return b.emit(op, [_promoted(b, n, x, "_x"), _scaled(b, _promoted(b, n, y, "_y"), alpha, "_alpha")])
    return lower


def _rsub(b, n, a):  # other - alpha * self
    x, y, alpha = a["self"], a["other"], a.get("alpha", 1)
    if _is_scalar(y):
        neg = b.emit("scale", [b.val(x)], "_neg", value=float(-alpha))
        return b.emit("add_scalar", [neg], value=float(y))
    return b.emit("sub", [_promoted(b, n, y, "_y"), _scaled(b, _promoted(b, n, x, "_x"), alpha, "_alpha")])


def _mul(b, n, a):
    x, y = a["self"], a["other"]
    if _is_scalar(x):
        x, y = y, x
    if _is_scalar(y):
        return b.emit("scale", [b.val(x)], value=float(y))
    return b.emit("mul", [_promoted(b, n, x, "_x"), _promoted(b, n, y, "_y")])


def _div(b, n, a):
    x, y = a["self"], a["other"]
    if _is_scalar(y):
        return b.emit("scale", [b.val(x)], value=1.0 / float(y))
    return b.emit("div", [_promoted(b, n, x, "_x"), _promoted(b, n, y, "_y")])


def _linear(b, n, a):
    wt = b.emit("permute", [b.val(a["weight"])], "_wt", perm=(1, 0))
    if a["bias"] is None:
        return b.emit("matmul", [b.val(a["input"]), wt])
    mm = b.emit("matmul", [b.val(a["input"]), wt], "_mm")
    return b.emit("add", [mm, b.val(a["bias"])])


def _addmm(b, n, a):  # beta * self + alpha * (mat1 @ mat2)
    mm = b.emit("matmul", [b.val(a["mat1"]), b.val(a["mat2"])], "_mm")
    mm = _scaled(b, mm, a["alpha"], "_alpha")
    return b.emit("add", [mm, _scaled(b, b.val(a["self"]), a["beta"], "_beta")])


def _permute_to(b, x: str, perm) -> str:
    rank = b.types[x].rank
    perm = tuple(int(p) % rank for p in perm) if rank else ()
    return x if perm == tuple(range(rank)) else b.emit("permute", [x], perm=perm)


def _transpose(b, n, a):
    x = b.val(a["self"])
    perm = list(range(b.types[x].rank))
    if perm:
        d0, d1 = int(a["dim0"]) % len(perm), int(a["dim1"]) % len(perm)
        perm[d0], perm[d1] = perm[d1], perm[d0]
    return _permute_to(b, x, perm)


def _t(b, n, a):
    x = b.val(a["self"])
    return _permute_to(b, x, (1, 0)) if b.types[x].rank == 2 else x


def _reshape(b, n, a):  # view, reshape, flatten, unflatten, view_as: torch's result shape
    x = b.val(a["self"])
    ty = b.type_of(n)
    return x if ty.shape == b.types[x].shape else b.emit("reshape", [x], ty=ty)


def _matmul(b, n, a):  # mm, bmm (self, mat2) and matmul (self, other)
    return b.emit("matmul", [b.val(a["self"]), b.val(a.get("mat2", a.get("other")))])


# aten op -> lowering(builder, fx node, args bound by schema name) -> value name
_ADDSUB = (("add", 1.0), ("sub", -1.0))
TABLE = {
    aten.linear.default: _linear,
    aten.addmm.default: _addmm,
    aten.mm.default: _matmul, aten.bmm.default: _matmul, aten.matmul.default: _matmul,
    aten.permute.default: lambda b, n, a: _permute_to(b, b.val(a["self"]), a["dims"]),
    aten.transpose.int: _transpose, aten.t.default: _t,
    aten.view.default: _reshape, aten.reshape.default: _reshape,
    aten._unsafe_view.default: _reshape,
    **{getattr(aten, op).default: _unary(op)
       for op in ("relu", "tanh", "exp", "sigmoid", "silu", "neg")},
    aten.gelu.default: lambda b, n, a: b.emit("gelu", [b.val(a["self"])],
                                              approximate=str(a["approximate"])),
    aten.pow.Tensor_Scalar: lambda b, n, a: b.emit("pow", [b.val(a["self"])],
                                                   exponent=float(a["exponent"])),
    aten.reciprocal.default: lambda b, n, a: b.emit("pow", [b.val(a["self"])], exponent=-1.0),
    **{getattr(aten, op).Tensor: _additive(op, sign) for op, sign in _ADDSUB},
    **{getattr(aten, op).Scalar: _additive(op, sign) for op, sign in _ADDSUB},
    aten.rsub.Scalar: _rsub, aten.rsub.Tensor: _rsub,
    aten.mul.Tensor: _mul, aten.mul.Scalar: _mul,
    aten.div.Tensor: _div, aten.div.Scalar: _div,
    # aten.dropout.default: the norms part's (parcomp/frontends/torch/norms.py)
    **{getattr(aten, op).default: lambda b, n, a: b.val(a["self"])  # identity
       for op in ("clone", "contiguous", "alias", "detach")},
}


# ---- frontend part: views, powers, batched matmuls and sums onto existing ops ----

def _pow(exponent: float):
    return lambda b, n, a: b.emit("pow", [b.val(a["self"])], exponent=exponent)


def _baddbmm(b, n, a):  # beta * self + alpha * (batch1 @ batch2)
    mm = b.emit("matmul", [b.val(a["batch1"]), b.val(a["batch2"])], "_mm")
    mm = _scaled(b, mm, a["alpha"], "_alpha")
    if not a["beta"]:  # torch ignores self (even NaN in it) when beta == 0
        return mm
    return b.emit("add", [mm, _scaled(b, b.val(a["self"]), a["beta"], "_beta")])


def _swap(b, n, a):  # swapaxes / swapdims (axis0, axis1 or dim0, dim1)
    return _transpose(b, n, {"self": a["self"], "dim0": a.get("axis0", a.get("dim0")),
                             "dim1": a.get("axis1", a.get("dim1"))})


def _movedim(b, n, a):
    x = b.val(a["self"])
    rank = b.types[x].rank
    src, dst = int(a["source"]) % rank, int(a["destination"]) % rank
    rest = [d for d in range(rank) if d != src]
    return _permute_to(b, x, rest[:dst] + [src] + rest[dst:])


def _sum(b, n, a):  # sum.default (every dim) and sum.dim_IntList (keepdim: + reshape)
    x = b.val(a["self"])
    rank, want = b.types[x].rank, b.type_of(n)
    if a.get("dtype") is not None and want.dtype != b.types[x].dtype:
        raise b.fail(f"sum with dtype={a['dtype']} converts {b.types[x].dtype} to {want.dtype}; "
                     "sum in the input's dtype")
    dims = a.get("dim")
    dims = tuple(range(rank)) if not dims else tuple(sorted({int(d) % rank for d in dims}))
    if not dims:
        return x
    out = b.emit("sum", [x], "_sum" if a.get("keepdim") else "", dims=dims)
    return out if b.types[out].shape == want.shape else b.emit("reshape", [out], ty=want)


def _same_dtype(b, n, a):  # type_as, to.dtype_layout: no node when the dtype stays
    x, ty = b.val(a["self"]), b.type_of(n)
    if ty.dtype == b.types[x].dtype:
        return x
    if "cast" in OPS:  # the attention part's conversion op, once merged
        return b.emit("cast", [x], ty=ty)
    raise b.fail(f"{n.target} converts {b.types[x].dtype} to {ty.dtype}; only conversions "
                 "that keep the dtype are supported")


TABLE.update({
    aten.rsqrt.default: _pow(-0.5), aten.sqrt.default: _pow(0.5), aten.square.default: _pow(2.0),
    aten.baddbmm.default: _baddbmm,
    aten.swapaxes.default: _swap, aten.swapdims.default: _swap, aten.movedim.int: _movedim,
    aten.flatten.using_ints: _reshape, aten.unflatten.int: _reshape, aten.view_as.default: _reshape,
    aten.sum.default: _sum, aten.sum.dim_IntList: _sum,
    aten.type_as.default: _same_dtype, aten.to.dtype_layout: _same_dtype,
})
# ---- end of the frontend part ----
