"""The ONNX importer's graph walk: ONNX nodes -> parcomp IR (see :mod:`parcomp.frontends.onnx.frontend`).

:func:`import_onnx` takes a checked ``onnx.ModelProto``; :class:`_Builder` keeps, for every
ONNX value, its IR value or its constant; nodes are lowered through
:data:`parcomp.frontends.onnx.ops.TABLE` after the GELU formulas are recognised and the
nodes no output needs are dropped.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np

from parcomp.errors import FrontendError
from parcomp.ir.graph import Graph, Node, make_attrs
from parcomp.ir.names import NameGen
from parcomp.ir.ops import OPS
from parcomp.ir.types import TensorType
from parcomp.passes.fused_weights import split_fused_weights
from .attention import OP as ATTENTION, lower_attention, rewrite_attention
from .norms import rewrite_rms_norm
from .ops import DTYPES, NO_FOLD, SHAPE_ONLY, TABLE, dtype_of, nearest_op, supported_ops
from .patterns import ONode, rewrite_gelu
from .transformer import materialize

_INT_TYPES = (2, 3, 4, 5, 6, 7, 12, 13, 9)  # (u)int8..64 and bool: always constants


def ir_name(name: str) -> str:
    """An ONNX name as a parcomp value name: characters outside ``[A-Za-z0-9_.-]`` become ``_``."""
    return "".join(c if c.isascii() and (c.isalnum() or c in "_.-") else "_" for c in name) or "_"


@dataclass
class OnnxImport:
    """What :func:`import_onnx` makes: the graph, ``{param name: initializer name}``, and the
    outputs the importer computed itself (``{output name: array}``, constants)."""

    graph: Graph | None
    params: dict
    constants: dict


def _types(model, path: str) -> dict:
    """``{value name: TensorType or None}`` from strict shape inference."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True,
                                                     data_prop=True)
    except Exception as e:  # noqa: BLE001 - InferenceError and protobuf errors
        raise FrontendError(f"{path}: onnx.shape_inference fails: {str(e).strip()}", where=path) from None
    g, out = inferred.graph, {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        t = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        ok = vi.type.HasField("tensor_type") and t.HasField("shape") and None not in dims
        out[vi.name] = TensorType(tuple(dims), DTYPES[t.elem_type]) if ok and t.elem_type in DTYPES else None
    return out


def _attrs(proto) -> dict:
    from onnx import helper, numpy_helper

    out = {}
    for a in proto.attribute:
        v = helper.get_attribute_value(a)
        if a.type == a.TENSOR:
            v = numpy_helper.to_array(v)
        elif isinstance(v, bytes):
            v = v.decode()
        elif isinstance(v, list) and v and isinstance(v[0], bytes):
            v = [x.decode() for x in v]
        out[a.name] = v
    return out


def _scope(proto) -> str | None:
    """The module path torch.onnx recorded for a node (``transformer.h.0.mlp.c_fc``), or None."""
    meta = {p.key: p.value for p in proto.metadata_props}
    scopes = meta.get("pkg.torch.onnx.name_scopes")
    if not scopes:
        return None
    import ast

    try:
        parts = [s for s in ast.literal_eval(scopes)[:-1] if s]
    except (ValueError, SyntaxError):
        return None
    return parts[-1] if parts else None  # each scope is the module's full path


def _nodes(model) -> list:
    return [ONode(p.op_type, p.name or p.output[0], tuple(p.input), tuple(p.output), _attrs(p),
                  p.domain, _scope(p), p) for p in model.graph.node]


def _live(nodes: list, outputs) -> list:
    """The nodes some graph output needs, in order."""
    need, keep = set(outputs), []
    for n in reversed(nodes):
        if any(o in need for o in n.outputs):
            keep.append(n)
            need.update(i for i in n.inputs if i)
    return keep[::-1]


class _Builder:
    """Walks the ONNX nodes, keeping ``env``: ONNX value name -> IR value name or constant."""

    def __init__(self, model, types: dict, path: str):
        self.path, self.types_onnx = path, types
        self.base = os.path.dirname(os.path.abspath(path))
        self.inits = {t.name: t for t in model.graph.initializer}
        self.order = {t.name: i for i, t in enumerate(model.graph.initializer)}
        self.env, self.params, self.names = {}, {}, NameGen()
        self.sources, self.nodes, self.types, self.made = [], [], {}, {}
        self.buffers = set()  # initializers read as {trainable=false} params (see _buffers)
        self.unmade = {}  # ONNX output -> the node that has it but whose lowering does not make it
        self.cur = None

    # -- reading values --
    def fail(self, msg: str) -> FrontendError:
        n = self.cur
        if n is None:
            return FrontendError(f"{self.path}: {msg}", where=self.path)
        mod = f" in module {n.scope!r}" if n.scope else ""
        return FrontendError(f"{self.path}: node {n.name!r} ({n.op} -> {', '.join(n.outputs)}){mod}: "
                             f"{msg}", where=f"{self.path}: node {n.name}")

    def static(self, name: str):
        """The constant array of ONNX value ``name``, or None (computed, or a weight)."""
        v = self.env.get(name)
        if isinstance(v, np.ndarray):
            return v
        t = self.inits.get(name)
        if v is None and t is not None and (t.data_type in _INT_TYPES or int(np.prod(t.dims)) <= 1):
            from onnx import numpy_helper

            self.env[name] = numpy_helper.to_array(t, self.base)
            return self.env[name]
        return None

    def value(self, name: str) -> str:
        """The IR value of ONNX value ``name``; an initializer becomes a ``param``."""
        if name in self.inits:
            return self._param(name)
        v = self.env.get(name)
        if isinstance(v, str):
            return v
        if isinstance(v, np.ndarray):
            made = self.made.get(name) or materialize(self, name, v)  # position ids: arange...
            if made is None:
                raise self.fail(f"operand {name!r} is a constant {v.dtype}{list(v.shape)}; parcomp has "
                                f"no constant tensors (only an arange along one axis is rebuilt): "
                                f"store it as an initializer (a weight)")
            self.made[name] = made  # env keeps the constant (folding reads it)
            return made
        by = self.unmade.get(name)
        by = f" of node {by.name!r} ({by.op})" if by is not None else ""
        raise self.fail(f"operand {name!r} is not computed: an optional output{by} parcomp does not make")

    def onnx_type(self, name: str) -> TensorType:
        """The type of ONNX value ``name`` (inferred, or the IR value's)."""
        v = self.env.get(name)
        if isinstance(v, str):
            return self.types[v]
        if name in self.inits:
            t = self.inits[name]
            return TensorType(tuple(t.dims), DTYPES.get(t.data_type, "float32"))
        if self.types_onnx.get(name) is None:
            raise self.fail(f"the shape of {name!r} is not known; only static shapes work")
        return self.types_onnx[name]

    def type(self, ir: str) -> TensorType:
        return self.types[ir]

    def _param(self, name: str) -> str:
        ir = ir_name(name)
        if ir in self.params:
            if self.params[ir] != name:
                raise self.fail(f"initializers {self.params[ir]!r} and {name!r} both read as "
                                f"parameter {ir!r}; rename one")
            return ir
        t = self.inits[name]
        try:
            ty = TensorType(tuple(int(d) for d in t.dims), dtype_of(t.data_type))
        except ValueError as e:
            raise self.fail(f"initializer {name!r}: {e}") from None
        self._source("param", ir, ty, name, **({"trainable": False} if name in self.buffers else {}))
        self.params[ir] = name
        return ir

    def _source(self, op: str, ir: str, ty: TensorType, name: str, **attrs) -> None:
        if ir in self.names:
            raise self.fail(f"{op} name {ir!r} (from {name!r}) is used twice")
        self.names.take(ir)
        self.sources.append(Node(ir, op, (), ty, make_attrs(**attrs)))
        self.types[ir] = ty

    # -- making nodes --
    def emit(self, op: str, inputs, suffix: str = "", ty: TensorType | None = None, **attrs) -> str:
        """Append one IR node named after the current ONNX node's output (+ suffix)."""
        name = self.names.fresh(ir_name(self.cur.outputs[0]) + suffix)
        node = Node(name, op, tuple(inputs), ty, make_attrs(**attrs), source=self.cur.scope)
        if ty is None:
            try:
                node = replace(node, type=OPS[op].infer([self.types[i] for i in inputs], node))
            except ValueError as e:
                raise self.fail(f"cannot express {self.cur.op} as parcomp {op}: {e}") from None
        self.nodes.append(node)
        self.types[name] = node.type
        return name


def _symbolic(value_info) -> str:
    """``" (dim 0 is 'batch')"``: the symbolic or unknown dims of a graph input's declared
    type (``dynamic_axes`` names them), or ``""`` when it declares no shape."""
    t = value_info.type.tensor_type
    if not t.HasField("shape"):
        return " (it declares no shape)"
    dims = [f"dim {k} is {d.dim_param!r}" if d.dim_param else f"dim {k} is unknown"
            for k, d in enumerate(t.shape.dim) if not d.HasField("dim_value")]
    return f" ({', '.join(dims)})" if dims else ""


def _no_rule(b: _Builder, n: ONode) -> FrontendError:
    dom = f" of domain {n.domain!r}" if n.domain not in ("", "ai.onnx") else ""
    return b.fail(f"no rule for ONNX op {n.op}{dom}{nearest_op(n.op)}; supported ops: "
                  f"{', '.join(supported_ops())} "
                  f"(and any op whose inputs are all constants, computed at import)")


def _constant(n: ONode) -> np.ndarray:
    """The value of a ``Constant`` node."""
    (key, v), = n.attrs.items()
    return np.asarray(v, dtype=np.float32 if key.startswith("value_float") else None)


def _fold(b: _Builder, n: ONode) -> list:
    from onnx.reference import ReferenceEvaluator

    try:
        outs = ReferenceEvaluator(n.proto).run(None, {i: b.static(i) for i in n.inputs if i})
    except Exception as e:  # noqa: BLE001 - the evaluator raises many types
        raise b.fail(f"computing this constant node at import failed: {type(e).__name__}: {e}") from None
    return [np.asarray(o) for o in outs]


def _lower(b: _Builder, n: ONode) -> list:
    b.cur = n
    if n.domain not in ("", "ai.onnx"):
        raise _no_rule(b, n)
    if n.op == "Constant":
        return [_constant(n)]
    if n.op == ATTENTION:
        return lower_attention(b, n)
    if n.op in SHAPE_ONLY:
        return TABLE[n.op](b, n)
    if n.inputs and n.proto is not None and n.op not in NO_FOLD and \
            all(b.static(i) is not None for i in n.inputs if i):
        return _fold(b, n)
    if n.op not in TABLE:
        raise _no_rule(b, n)
    return TABLE[n.op](b, n)


def import_onnx(model, path: str = "model.onnx") -> OnnxImport:
    """Lower a checked ``onnx.ModelProto`` (``path`` names it in messages and locates its
    external data) to a global Graph; see the module docstring.

    Returns an :class:`OnnxImport` (``graph`` None when every output is a constant).

    Raises:
        FrontendError: see :func:`load_onnx`.
    """
    graph_proto = model.graph
    if len(model.functions):
        import onnx.inliner

        model = onnx.inliner.inline_local_functions(model)
        graph_proto = model.graph
    b = _Builder(model, _types(model, path), path)
    for i in graph_proto.input:
        if i.name in b.inits:
            continue
        ty = b.types_onnx.get(i.name)
        if ty is None:
            raise b.fail(f"input {i.name!r} has no static shape and known dtype{_symbolic(i)}; "
                         f"export with fixed shapes (dims given as numbers: no dynamic_axes or "
                         f"dynamic_shapes)")
        b._source("input", ir_name(i.name), ty, i.name)
        b.env[i.name] = ir_name(i.name)
    for o in graph_proto.output:  # output names are reserved for the outputs
        if not isinstance(b.env.get(o.name), str) and o.name not in b.inits:
            b.names.take(ir_name(o.name))
    nodes = _nodes(model)
    pre = _scalars(nodes)
    nodes = rewrite_gelu(nodes, lambda v: _const_scalar(b, pre, v))
    known = {**{t.name: TensorType(tuple(t.dims), DTYPES.get(t.data_type, "float32")) for t in
                b.inits.values()}, **{k: t for k, t in b.types_onnx.items() if t is not None}}
    nodes = rewrite_attention(nodes, lambda v: _const_scalar(b, pre, v), known)
    nodes = rewrite_rms_norm(nodes, lambda v: _const_scalar(b, pre, v), known)
    live = _live(nodes, [o.name for o in graph_proto.output])
    b.buffers = _buffers(live, b.inits, {i.name for i in graph_proto.input} - set(b.inits), known)
    for n in live:
        made = _lower(b, n)
        for o, r in zip(n.outputs, made):
            if o:
                _bind(b, o, r)
        b.unmade.update((o, n) for o in n.outputs[len(made):] if o)
    return _finish(b, [o.name for o in graph_proto.output])


#: ops whose initializer operands are weights even when the other operands are constants
WEIGHT_OPS = ("MatMul", "Gemm", "Gather", "LayerNormalization", "RMSNormalization", "Conv")
#: ops that only view or re-type a value (a weight read through them is still read as one)
VIEW_OPS = ("Transpose", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Cast", "Expand")


def _buffers(nodes: list, inits: dict, inputs: set, types: dict) -> set:
    """Initializers that are buffers, not weights: read (through views, :data:`VIEW_OPS`, and
    elementwise ops with a one-element constant: ``W * 0.5`` is still the weight) only by
    elementwise ops that combine them with a constant tensor (RoPE's ``inv_freq`` times the
    folded positions), never by a :data:`WEIGHT_OPS` op or together with a value computed
    from a graph input. ONNX keeps no parameter/buffer distinction; these get
    ``{trainable=false}`` (no gradient, no optimizer state), as the torch frontend's buffers do.
    ``types``: ONNX value name -> TensorType (initializers included)."""
    dep, users = set(inputs), {}
    for n in nodes:
        if any(i in dep for i in n.inputs):
            dep.update(n.outputs)
        for i in n.inputs:
            users.setdefault(i, []).append(n)
    scalar = lambda v: v in types and types[v].numel == 1  # noqa: E731

    def weight(v, depth=0) -> bool:
        for n in users.get(v, []):
            others = [j for j in n.inputs if j and j != v]
            follow = n.op in VIEW_OPS and n.inputs[0] == v or all(scalar(j) for j in others)
            if n.op in WEIGHT_OPS or any(j in dep for j in others):
                return True
            if follow and n.outputs and depth < 8 and weight(n.outputs[0], depth + 1):
                return True
        return False
    return {i for i in inits if i in users and not weight(i)}


def _scalars(nodes: list) -> dict:
    """``{value: array}`` of the one-element constants the nodes make: ``Constant`` outputs
    and what is computed from them alone (``CastLike(2.0, x)``, ``Sqrt`` of it): the numbers
    the GELU patterns look for."""
    from onnx.reference import ReferenceEvaluator

    pre = {}
    for n in nodes:
        if n.op == "Constant" and n.outputs:
            pre[n.outputs[0]] = _constant(n)
        elif n.op == "CastLike" and n.inputs[0] in pre:
            pre[n.outputs[0]] = pre[n.inputs[0]]
        elif n.inputs and n.proto is not None and n.op not in NO_FOLD + SHAPE_ONLY and \
                all(i in pre and pre[i].size == 1 for i in n.inputs if i):
            try:
                outs = ReferenceEvaluator(n.proto).run(None, {i: pre[i] for i in n.inputs if i})
            except Exception:  # noqa: BLE001 - left to the importer, which reports it
                continue
            pre.update(zip(n.outputs, (np.asarray(o) for o in outs)))
    return pre


def _const_scalar(b: _Builder, pre: dict, name: str):
    """A one-element constant (a ``Constant`` output in ``pre``, or an initializer) as a
    float, for the GELU patterns; else None."""
    v = pre.get(name)
    if v is None and name in b.inits:
        v = b.static(name)
    return float(v.reshape(-1)[0]) if isinstance(v, np.ndarray) and v.size == 1 else None


def _bind(b: _Builder, onnx_name: str, r) -> None:
    """Record the result ``r`` of the current node as ONNX value ``onnx_name``; an IR value
    must have the type shape inference gave it."""
    want = b.types_onnx.get(onnx_name)
    if isinstance(r, str) and want is not None and b.types[r] != want:
        raise b.fail(f"lowering {onnx_name!r} gives {b.types[r]}, onnx infers {want}")
    b.env[onnx_name] = r


def _finish(b: _Builder, outputs: list) -> OnnxImport:
    consts = {ir_name(o): b.env[o] for o in outputs if isinstance(b.env.get(o), np.ndarray)}
    if consts and len(consts) == len(outputs):
        return OnnxImport(None, dict(b.params), consts)
    b.cur = None
    values = [b.value(o) if o not in consts else None for o in outputs]
    public = [ir_name(o) for o in outputs]
    ren = {}
    for v, pub in zip(values, public):  # the value defining an output takes the output's name
        if v is not None and v not in b.params and v not in {s.name for s in b.sources}:
            ren.setdefault(v, pub)
    nodes = [replace(n, name=ren.get(n.name, n.name), inputs=tuple(ren.get(i, i) for i in n.inputs))
             for n in b.nodes]
    params = sorted((s for s in b.sources if s.op == "param"), key=lambda s: b.order[b.params[s.name]])
    inputs = [s for s in b.sources if s.op == "input"]
    outs = tuple(ren.get(v, v) for v in values if v is not None)
    names = tuple(p for v, p in zip(values, public) if v is not None)
    graph = Graph(tuple(inputs + params + nodes), outs, output_names=names)
    return OnnxImport(split_fused_weights(graph), dict(b.params), consts)  # fused q|k|v per part
