"""ONNX frontend: a ``.onnx`` file becomes a parcomp :class:`Graph`.

:func:`load_onnx` reads the file with ``onnx.load`` (external data stays on disk
until a weight is needed), runs ``onnx.checker`` (a failure is an error with the
checker's message) and ``onnx.shape_inference`` (strict), and needs opset 17 or
later of the default domain.  Every node is then lowered through
:data:`parcomp.frontends.onnx_ops.TABLE`, after GELU formulas are recognised
(:mod:`.onnx_patterns`) and nodes no output needs are dropped.

- Initializers read as tensors become ``param`` nodes named as in the file
  (``c_fc.weight``: torch.onnx.export keeps the ``state_dict`` names when exporting with
  ``optimize=False``; its optimizer folds ``Transpose(0.weight)`` into a new initializer
  ``val_0``), so a spec written for the torch model fits its ONNX export.  A character
  outside ``[A-Za-z0-9_.-]`` becomes ``_`` (:func:`ir_name`); ``program.py`` applies the
  same rule when it reads the ``.onnx`` file as its checkpoint.
- Graph inputs that are not initializers become ``input`` nodes; outputs keep their names.
- Integer initializers, one-element initializers and ``Constant`` outputs are constants:
  a node whose inputs are all constants is computed at import (``onnx.reference``), and
  ``Shape``/``Size`` read the static shape.
- A weight keeps its stored orientation: ``Gemm(transB=1)``/``Transpose -> MatMul``
  lower to ``param -> permute -> matmul``, so ``colwise``/``rowwise`` resolve by use.

Every failure is a :class:`FrontendError` naming the file and, for a node, its name,
op type, outputs and the model module it was exported from.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np

from ..errors import FrontendError
from ..ir.graph import Graph, Node, make_attrs
from ..ir.names import NameGen
from ..ir.ops import OPS
from ..ir.types import TensorType
from .model_file import ModelFile
from .onnx_ops import NO_FOLD, SHAPE_ONLY, TABLE, supported_ops
from .onnx_patterns import ONode, rewrite_gelu

MIN_OPSET = 17
#: ONNX TensorProto element type -> parcomp dtype
DTYPES = {1: "float32", 11: "float64", 10: "float16", 16: "bfloat16", 7: "int64", 6: "int32",
          9: "bool"}
_INT_TYPES = (2, 3, 4, 5, 6, 7, 12, 13, 9)  # (u)int8..64 and bool: always constants


def ir_name(name: str) -> str:
    """An ONNX name as a parcomp value name: characters outside ``[A-Za-z0-9_.-]`` become ``_``."""
    return "".join(c if c.isascii() and (c.isalnum() or c in "_.-") else "_" for c in name) or "_"


def dtype_of(elem_type: int) -> str:
    """The parcomp dtype of an ONNX element type; ValueError for one parcomp lacks."""
    if elem_type not in DTYPES:
        import onnx

        raise ValueError(f"element type {onnx.TensorProto.DataType.Name(elem_type)} is not "
                         f"supported; known: {', '.join(DTYPES.values())}")
    return DTYPES[elem_type]


@dataclass
class OnnxImport:
    """What :func:`import_onnx` makes: the graph, ``{param name: initializer name}``, and the
    outputs the importer computed itself (``{output name: array}``, constants)."""

    graph: Graph | None
    params: dict
    constants: dict


class OnnxModel(ModelFile):
    """An imported ``.onnx`` file: its weights, and onnx's reference evaluator as the
    unsharded answer (see :class:`parcomp.frontends.model_file.ModelFile`)."""

    def __init__(self, path: str, model, params: dict):
        self.path, self.model, self.params = path, model, params

    def feeds(self, graph, seed: int = 0) -> dict:
        """Params from the file's initializers (external data read now), inputs seeded
        standard-normal (integers: 0 or 1)."""
        from onnx import numpy_helper

        inits = {t.name: t for t in self.model.graph.initializer}
        base, rng, out = os.path.dirname(os.path.abspath(self.path)), np.random.default_rng(seed), {}
        for n in graph.nodes:
            if n.op == "param":
                out[n.name] = numpy_helper.to_array(inits[self.params[n.name]], base)
            elif n.op == "input":
                x = rng.standard_normal(n.type.shape) if "float" in n.type.dtype else \
                    rng.integers(0, 2, n.type.shape)
                out[n.name] = np.asarray(x).astype(n.type.dtype)
        return out

    def reference_outputs(self, graph, feeds: dict) -> dict:
        """``onnx.reference.ReferenceEvaluator``'s outputs on ``feeds``' inputs."""
        import onnx
        from onnx.reference import ReferenceEvaluator

        model = onnx.load(self.path)  # with its external data
        names = {ir_name(i.name): i.name for i in model.graph.input}
        outs = ReferenceEvaluator(model).run(None, {names[n.name]: feeds[n.name] for n in graph.inputs})
        return dict(zip(graph.output_names, (np.asarray(o) for o in outs)))


def load_onnx(path: str) -> tuple:
    """``(graph, OnnxModel, ())`` for the ONNX file at ``path`` (checked, shapes inferred).

    Raises:
        FrontendError: the file is missing or not ONNX, fails ``onnx.checker`` (its
            message), has an opset below 17, a dynamic shape, an op without a rule
            (op type, node name, module and the supported ops named), or an output
            that is a constant.
    """
    if not os.path.isfile(path):
        raise FrontendError(f"cannot load {path!r}: no such file", where=path)
    try:
        import onnx
    except ImportError as e:
        raise FrontendError(f"reading {path} needs the onnx package ({e}); install parcomp's "
                            f"onnx extra: pip install 'parcomp[onnx]'", where=path) from None
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as e:  # noqa: BLE001 - protobuf raises DecodeError and others
        raise FrontendError(f"{path} is not an ONNX model: {type(e).__name__}: {e}", where=path) from None
    checked(model, path, path)
    got = import_onnx(model, path)
    if got.constants:
        name = next(iter(got.constants))
        raise FrontendError(f"{path}: output {name!r} is a constant ({got.constants[name].shape}); "
                            f"parcomp compiles outputs computed from inputs or weights", where=path)
    return got.graph, OnnxModel(path, model, got.params), ()


def checked(model, path: str, source=None):
    """Run ``onnx.checker`` on ``source`` (a path: external data is checked too; default the
    model) and require opset >= 17; FrontendError with the checker's message."""
    import onnx

    try:
        onnx.checker.check_model(source if source is not None else model)
    except (onnx.checker.ValidationError, ValueError) as e:
        msg = str(e).strip().replace("\n\n", "\n")
        raise FrontendError(f"{path} fails onnx.checker: {msg}", where=path) from None
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None or opset < MIN_OPSET:
        raise FrontendError(f"{path} uses opset {opset} of the default domain; parcomp reads opset "
                            f"{MIN_OPSET} to {onnx.defs.onnx_opset_version()}: convert it with "
                            f"onnx.version_converter.convert_version(model, {MIN_OPSET})", where=path)
    return model


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
    """The module path torch.onnx recorded for a node (``c_fc``), or None."""
    meta = {p.key: p.value for p in proto.metadata_props}
    scopes = meta.get("pkg.torch.onnx.name_scopes")
    if not scopes:
        return None
    import ast

    try:
        parts = [s for s in ast.literal_eval(scopes)[:-1] if s]
    except (ValueError, SyntaxError):
        return None
    return ".".join(parts) or None


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
        self.sources, self.nodes, self.types = [], [], {}
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
            raise self.fail(f"operand {name!r} is a constant {v.dtype}{list(v.shape)}; parcomp has "
                            f"no constant tensors: store it as an initializer (a weight)")
        raise self.fail(f"operand {name!r} is not computed (an optional output parcomp does not make)")

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
        self._source("param", ir, ty, name)
        self.params[ir] = name
        return ir

    def _source(self, op: str, ir: str, ty: TensorType, name: str) -> None:
        if ir in self.names:
            raise self.fail(f"{op} name {ir!r} (from {name!r}) is used twice")
        self.names.take(ir)
        self.sources.append(Node(ir, op, (), ty))
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


def _no_rule(b: _Builder, n: ONode) -> FrontendError:
    dom = f" of domain {n.domain!r}" if n.domain not in ("", "ai.onnx") else ""
    return b.fail(f"no rule for ONNX op {n.op}{dom}; supported ops: {', '.join(supported_ops())} "
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
            raise b.fail(f"input {i.name!r} has no static shape and known dtype; export with "
                         f"fixed shapes (dims given as numbers)")
        b._source("input", ir_name(i.name), ty, i.name)
        b.env[i.name] = ir_name(i.name)
    for o in graph_proto.output:  # output names are reserved for the outputs
        if not isinstance(b.env.get(o.name), str) and o.name not in b.inits:
            b.names.take(ir_name(o.name))
    nodes = _nodes(model)
    pre = _scalars(nodes)
    nodes = rewrite_gelu(nodes, lambda v: _const_scalar(b, pre, v))
    for n in _live(nodes, [o.name for o in graph_proto.output]):
        for o, r in zip(n.outputs, _lower(b, n)):
            if o:
                _bind(b, o, r)
    return _finish(b, [o.name for o in graph_proto.output])


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
    return OnnxImport(graph, dict(b.params), consts)
