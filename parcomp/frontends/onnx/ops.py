"""ONNX op -> parcomp IR: the lowering table of the ONNX frontend (:mod:`.frontend`).

:data:`TABLE` maps an ONNX op type (default domain, opset 17 and later) to
``lower(b, node) -> [result, ...]``: one entry per ONNX output, each the name of
an IR value or a numpy array (a constant the importer knows).  ``b`` is the
importer's builder: ``b.static(name)`` (a constant's array, or None),
``b.value(name)`` (the IR value; an initializer becomes a ``param``),
``b.type(name)``, ``b.emit(op, inputs, suffix, ty=None, **attrs)``, ``b.fail(msg)``.

Constants fold: a node whose inputs are all constants is computed at import
(:mod:`.frontend` does that), ``Shape`` reads the static shape, and a one-element
constant operand of ``Add/Sub/Mul/Div/Pow`` becomes an attribute
(``add_scalar``, ``scale``, ``pow``).  Arithmetic on computed values is
floating point only (parcomp's ops are not integer arithmetic).
"""
from __future__ import annotations

import difflib
import math

import numpy as np

from parcomp.ir.types import TensorType

FLOATS = ("float32", "float64", "float16", "bfloat16")
#: ONNX TensorProto element type -> parcomp dtype
DTYPES = {1: "float32", 11: "float64", 10: "float16", 16: "bfloat16", 7: "int64", 6: "int32",
          9: "bool"}


def dtype_of(elem_type: int) -> str:
    """The parcomp dtype of an ONNX element type; ValueError for one parcomp lacks."""
    if elem_type not in DTYPES:
        import onnx

        raise ValueError(f"element type {onnx.TensorProto.DataType.Name(elem_type)} is not "
                         f"supported; known: {', '.join(DTYPES.values())}")
    return DTYPES[elem_type]


def require_float(b, v: str, what: str) -> str:
    if b.type(v).dtype not in FLOATS:
        raise b.fail(f"{what} of a computed {b.type(v)} value: parcomp computes "
                     f"{b.cur.op} on floating-point tensors only")
    return v


def _scalar(b, name: str, like: str):
    """The constant ``name`` as a python float when every element is equal and broadcasting
    it against the value ``like`` keeps ``like``'s shape, else None."""
    c = b.static(name)
    if c is None or c.size == 0 or not np.all(c == c.flat[0]):
        return None
    try:
        shape = np.broadcast_shapes(c.shape, b.type(like).shape)
    except ValueError:
        return None
    return float(c.flat[0]) if tuple(shape) == b.type(like).shape else None


def _operands(b, n):
    """(x, y, constant x as float or None, constant y as float or None): the IR values of a
    binary op's operands, one of them possibly a constant; a constant operand that is not
    a scalar is an error."""
    x, y = n.inputs[:2]
    for c, other in ((x, y), (y, x)):
        if b.static(c) is None:
            continue
        v = require_float(b, b.value(other), n.op)
        k = _scalar(b, c, v)
        if k is None:  # a tensor constant: rebuilt as ops when it is an arange (b.value), else an error
            break
        return (c, v, k, None) if c == x else (v, c, None, k)
    return require_float(b, b.value(x), n.op), require_float(b, b.value(y), n.op), None, None


def _add(b, n):
    x, y, cx, cy = _operands(b, n)
    if cx is not None or cy is not None:
        v, c = (y, cx) if cx is not None else (x, cy)
        return [v if c == 0 else b.emit("add_scalar", [v], value=c)]
    return [b.emit("add", [x, y])]


def _sub(b, n):
    x, y, cx, cy = _operands(b, n)
    if cy is not None:
        return [x if cy == 0 else b.emit("add_scalar", [x], value=-cy)]
    if cx is not None:
        neg = b.emit("neg", [y], "_neg")
        return [neg if cx == 0 else b.emit("add_scalar", [neg], value=cx)]
    return [b.emit("sub", [x, y])]


def _mul(b, n):
    x, y, cx, cy = _operands(b, n)
    if cx is not None or cy is not None:
        v, c = (y, cx) if cx is not None else (x, cy)
        return [v if c == 1 else b.emit("scale", [v], value=c)]
    return [b.emit("mul", [x, y])]


def _div(b, n):
    x, y, cx, cy = _operands(b, n)
    if cy is not None:
        return [x if cy == 1 else b.emit("scale", [x], value=1.0 / cy)]
    if cx is not None:
        inv = b.emit("pow", [y], "_inv", exponent=-1.0)
        return [inv if cx == 1 else b.emit("scale", [inv], value=cx)]
    return [b.emit("div", [x, y])]


def _pow(b, n):
    x, e = n.inputs[:2]
    v = require_float(b, b.value(x), "Pow")
    c = _scalar(b, e, v)
    if c is None:
        raise b.fail(f"the exponent {e!r} must be a scalar constant (parcomp's pow takes its "
                     f"exponent as an attribute)")
    return [v if c == 1 else b.emit("pow", [v], exponent=c)]


def unary(op: str, **attrs):
    return lambda b, n: [b.emit(op, [require_float(b, b.value(n.inputs[0]), n.op)], **attrs)]


def _gelu(b, n):
    approx = n.attrs.get("approximate", "none")
    return [b.emit("gelu", [require_float(b, b.value(n.inputs[0]), "Gelu")], approximate=approx)]


def _identity(b, n):
    return [b.value(n.inputs[0])]


def _dropout(b, n):
    """Inference Dropout is the identity; training mode (a constant true ``training_mode``)
    with a ratio that is not a constant 0 is an error."""
    arg = lambda i: b.static(n.inputs[i]) if len(n.inputs) > i and n.inputs[i] else None  # noqa: E731
    training, ratio = arg(2), arg(1)
    if training is not None and bool(training) and (ratio is None or float(ratio) > 0):
        raise b.fail("Dropout in training mode; export the model in eval mode")
    return [b.value(n.inputs[0])]


def _cast_like(b, n):
    """CastLike(x, like): of a constant, the constant in ``like``'s dtype; of a computed
    value, itself (same dtype) or a ``cast`` node."""
    to = b.onnx_type(n.inputs[1]).dtype
    c = b.static(n.inputs[0])
    if c is not None:
        return [c.astype(np.dtype(to)) if to != "bfloat16" else c]
    v = b.value(n.inputs[0])
    if b.type(v).dtype != to:
        return [b.emit("cast", [v], ty=TensorType(b.type(v).shape, to))]
    return [v]


def _matmul(b, n):
    x, w = (b.value(i) for i in n.inputs[:2])
    if b.type(w).rank < 2:
        raise b.fail(f"MatMul with a {b.type(w).rank}-D right operand is not supported")
    return [b.emit("matmul", [x, w])]


def _transposed(b, v: str, suffix: str) -> str:
    return b.emit("permute", [v], suffix, perm=(1, 0))


def _gemm(b, n):
    """``alpha * A' @ B' + beta * C``; ``B'`` stays ``param -> permute -> matmul`` (transB)."""
    a, w = (b.value(i) for i in n.inputs[:2])
    a = _transposed(b, a, "_at") if n.attrs.get("transA", 0) else a
    w = _transposed(b, w, "_wt") if n.attrs.get("transB", 0) else w
    alpha, beta = float(n.attrs.get("alpha", 1.0)), float(n.attrs.get("beta", 1.0))
    has_c = len(n.inputs) > 2 and n.inputs[2]
    mm = b.emit("matmul", [a, w], "_mm" if has_c or alpha != 1 else "")
    if alpha != 1:
        mm = b.emit("scale", [mm], "_alpha" if has_c else "", value=alpha)
    if not has_c or beta == 0:
        return [mm]
    c = _scalar(b, n.inputs[2], mm) if b.static(n.inputs[2]) is not None else None
    if c is not None:
        return [b.emit("add_scalar", [mm], value=beta * c)]
    bias = b.value(n.inputs[2])
    bias = bias if beta == 1 else b.emit("scale", [bias], "_beta", value=beta)
    return [b.emit("add", [mm, bias])]


def reshape_to(b, v: str, shape) -> str:
    shape = tuple(int(s) for s in shape)
    if shape == b.type(v).shape:
        return v
    return b.emit("reshape", [v], ty=TensorType(shape, b.type(v).dtype))


def need_static(b, name: str, what: str) -> np.ndarray:
    c = b.static(name)
    if c is None:
        raise b.fail(f"{what} {name!r} is computed at run time; parcomp needs it constant "
                     f"(static shapes only)")
    return c


def reshape_shape(shape, target, allowzero: bool) -> tuple:
    """ONNX Reshape's result shape of ``shape`` for ``target`` (0 copies a dim unless
    ``allowzero``; one -1 is inferred). Raises ValueError when it does not fit."""
    out = [int(s) for s in target]
    if not allowzero:
        out = [shape[i] if s == 0 and i < len(shape) else s for i, s in enumerate(out)]
    if out.count(-1) > 1:
        raise ValueError(f"shape {list(target)} has more than one -1")
    known = math.prod(s for s in out if s != -1)
    total = math.prod(shape)
    if -1 in out:
        if known == 0 or total % known:
            raise ValueError(f"cannot reshape {list(shape)} to {list(target)}")
        out[out.index(-1)] = total // known
    if math.prod(out) != total:
        raise ValueError(f"cannot reshape {list(shape)} ({total} elements) to {list(target)}")
    return tuple(out)


def _reshape(b, n):
    v = b.value(n.inputs[0])
    target = need_static(b, n.inputs[1], "the shape")
    try:
        shape = reshape_shape(b.type(v).shape, target, bool(n.attrs.get("allowzero", 0)))
    except ValueError as e:
        raise b.fail(str(e)) from None
    return [reshape_to(b, v, shape)]


def _axes(b, n, rank: int):
    """Unsqueeze/Squeeze axes (the second input), normalised to [0, rank); None if absent."""
    if len(n.inputs) < 2 or not n.inputs[1]:
        return None
    return sorted(int(a) % rank for a in need_static(b, n.inputs[1], "the axes").reshape(-1))


def _unsqueeze(b, n):
    v = b.value(n.inputs[0])
    shape = list(b.type(v).shape)
    axes = _axes(b, n, len(shape) + len(need_static(b, n.inputs[1], "the axes").reshape(-1)))
    for a in axes:
        shape.insert(a, 1)
    return [reshape_to(b, v, shape)]


def _squeeze(b, n):
    v = b.value(n.inputs[0])
    shape = b.type(v).shape
    axes = _axes(b, n, len(shape))
    axes = [d for d, s in enumerate(shape) if s == 1] if axes is None else axes
    if any(shape[a] != 1 for a in axes):
        raise b.fail(f"Squeeze of axes {axes} of shape {list(shape)}: not all are 1")
    return [reshape_to(b, v, [s for d, s in enumerate(shape) if d not in axes])]


def _flatten(b, n):
    v = b.value(n.inputs[0])
    shape = b.type(v).shape
    axis = int(n.attrs.get("axis", 1))
    axis = axis + len(shape) if axis < 0 else axis
    return [reshape_to(b, v, (math.prod(shape[:axis]), math.prod(shape[axis:])))]


def _transpose(b, n):
    v = b.value(n.inputs[0])
    rank = b.type(v).rank
    perm = tuple(int(p) % rank for p in n.attrs.get("perm", range(rank - 1, -1, -1)))
    return [v if perm == tuple(range(rank)) else b.emit("permute", [v], perm=perm)]


def _shape(b, n):
    shape = b.onnx_type(n.inputs[0]).shape
    rank = len(shape)
    start, end = n.attrs.get("start", 0), n.attrs.get("end", rank)
    start, end = (max(0, min(rank, s + rank if s < 0 else s)) for s in (start, end))
    return [np.array(shape[start:end], dtype=np.int64)]


def _size(b, n):
    return [np.array(b.onnx_type(n.inputs[0]).numel, dtype=np.int64)]


# ONNX op type -> lowering; the ops an MLP is exported with (the transformer ops are added
# by parcomp/frontends/onnx/transformer.py)
TABLE = {
    "MatMul": _matmul, "Gemm": _gemm,
    "Add": _add, "Sub": _sub, "Mul": _mul, "Div": _div, "Pow": _pow,
    "Relu": unary("relu"), "Tanh": unary("tanh"), "Sigmoid": unary("sigmoid"),
    "Exp": unary("exp"), "Neg": unary("neg"), "Gelu": _gelu,
    "Sqrt": unary("pow", exponent=0.5), "Reciprocal": unary("pow", exponent=-1.0),
    "Reshape": _reshape, "Transpose": _transpose, "Flatten": _flatten,
    "Unsqueeze": _unsqueeze, "Squeeze": _squeeze,
    "Identity": _identity, "Dropout": _dropout, "CastLike": _cast_like,  # Cast: onnx_transformer
    "Shape": _shape, "Size": _size,
}
#: ops whose result is known at import even when an input is computed (it reads only the type)
SHAPE_ONLY = ("Shape", "Size", "CastLike")
#: ops that are never folded although their inputs are constant (they draw random numbers)
NO_FOLD = ("RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
           "Bernoulli")


def supported_ops() -> list:
    """Sorted ONNX op types the frontend lowers (besides ``Constant`` and folded constants);
    the transformer rows are in :data:`TABLE` once :mod:`parcomp.frontends.onnx.frontend` (or
    :mod:`.transformer`) is imported."""
    return sorted(set(TABLE) | {"Constant"})


#: for an op without a rule, the supported op it is closest to in meaning and how to get it
#: (the "nearest supported op" of the error); ops not listed fall back to the closest name
NEAREST = {
    "LeakyRelu": ("Relu", "nn.ReLU instead of nn.LeakyReLU"),
    "PRelu": ("Relu", "nn.ReLU instead of nn.PReLU"),
    "Elu": ("Relu", "nn.ReLU, or nn.GELU, instead of nn.ELU"),
    "Selu": ("Relu", "nn.ReLU instead of nn.SELU"),
    "Celu": ("Relu", "nn.ReLU instead of nn.CELU"),
    "ThresholdedRelu": ("Relu", "nn.ReLU"),
    "Softplus": ("Relu", "nn.ReLU instead of nn.Softplus"),
    "Mish": ("Gelu", "nn.GELU instead of nn.Mish"),
    "HardSigmoid": ("Sigmoid", "nn.Sigmoid instead of nn.Hardsigmoid"),
    "HardSwish": ("Sigmoid", "x * sigmoid(x) (nn.SiLU) instead of nn.Hardswish"),
    "Hardmax": ("Softmax", "softmax"),
    "Softsign": ("Tanh", "tanh"),
    "Erf": ("Gelu", "GELU's whole formula x * 0.5 * (1 + erf(x / sqrt(2))), or the Gelu op"),
    "BatchNormalization": ("LayerNormalization", "nn.LayerNorm"),
    "InstanceNormalization": ("LayerNormalization", "nn.LayerNorm"),
    "GroupNormalization": ("LayerNormalization", "nn.LayerNorm"),
    "SimplifiedLayerNormalization": ("RMSNormalization", "opset 23's RMSNormalization, or export "
                                     "with optimize=False (RMSNorm written out)"),
    "SkipLayerNormalization": ("LayerNormalization", "an export with optimize=False (no fusion)"),
    "Einsum": ("MatMul", "torch.matmul / @ instead of torch.einsum"),
    "ReduceMin": ("ReduceMax", "ReduceMax of the negated value"),
    "ReduceL2": ("ReduceSum", "Sqrt(ReduceSum(Mul(x, x)))"),
    "ReduceSumSquare": ("ReduceSum", "ReduceSum(Mul(x, x))"),
    "Tile": ("Expand", "expand"),
    "Attention": ("Softmax", "an export with optimize=False (attention written out)"),
    "MultiHeadAttention": ("Softmax", "an export with optimize=False (attention written out)"),
}


def nearest_op(op: str) -> str:
    """``"; nearest supported op: X (hint)"`` for an ONNX op type without a rule: the row of
    :data:`NEAREST`, else the closest supported name (difflib, said to be by name only),
    else ``""``."""
    if op in NEAREST:
        near, hint = NEAREST[op]
        return f"; nearest supported op: {near} (export {hint})"
    close = difflib.get_close_matches(op, supported_ops(), n=1, cutoff=0.6)
    return f"; nearest supported op by name only: {close[0]}" if close else ""
