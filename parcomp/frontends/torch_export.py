"""torch.export frontend: an ``nn.Module`` becomes a parcomp :class:`Graph`.

The module is traced with ``torch.export.export(strict=False)``; every aten op
of the exported fx graph is lowered through :data:`TABLE`, a dict from aten
op overload to a small lowering function.  Parameters and buffers become
``param`` nodes named by their ``state_dict`` key, user inputs ``input`` nodes.

``nn.Linear`` (``aten.linear``, weight stored ``[out, in]``) lowers to
``permute{perm=(1,0)}(W) -> matmul(x, .) -> add(., b)``, keeping the chain
param -> permute -> matmul rhs direct so later passes can find the weight's role.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import re
import warnings
from dataclasses import replace

import torch

from ..errors import FrontendError
from ..ir.graph import Graph, Node, make_attrs
from ..ir.names import NameGen
from ..ir.ops import OPS
from ..ir.types import TensorType

aten = torch.ops.aten

DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
          torch.bfloat16: "bfloat16", torch.int64: "int64", torch.int32: "int32",
          torch.bool: "bool"}
_NAME_OK = re.compile(r"[A-Za-z0-9_.]+\Z")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in \S+\n[ \t]*([^\n]*)')
_TORCH_DIR = torch.__file__.rsplit("/", 1)[0] + "/"


class _Builder:
    """Accumulates parcomp nodes while walking one exported fx graph."""

    def __init__(self):
        self.nodes, self.types, self.taken = [], {}, NameGen()
        self.env = {}  # fx node -> parcomp value name (None: no value)
        self.cur = None  # fx node being lowered, for error messages
        self.folded = set()  # fx nodes evaluated at import, not lowered (attention masks)

    def fresh(self, base: str) -> str:
        return self.taken.fresh(re.sub(r"[^A-Za-z0-9_.]", "_", base) or "v")

    def fail(self, msg: str) -> FrontendError:
        return FrontendError(msg + _where(self.cur) if self.cur is not None else msg)

    def add(self, node: Node) -> str:
        if self.cur is not None and node.op not in ("input", "param"):
            node = replace(node, source=_module_path(self.cur))
        self.nodes.append(node)
        self.types[node.name] = node.type
        return node.name

    def source(self, op: str, name: str, fx, **attrs) -> str:
        if not _NAME_OK.match(name) or name in self.taken:
            what = "is used twice" if name in self.taken else "has characters outside [A-Za-z0-9_.]"
            raise FrontendError(f"{op} name {name!r} {what}")
        self.taken.take(name)
        return self.add(Node(name, op, (), _type_of(fx, self), make_attrs(**attrs)))

    def type_of(self, fx) -> TensorType:
        """The parcomp type of fx node ``fx``'s value (torch's static shape and dtype)."""
        return _type_of(fx, self)

    def val(self, arg) -> str:
        """The value name of an fx operand that must be a tensor."""
        if isinstance(arg, torch.fx.Node) and self.env.get(arg) is not None:
            return self.env[arg]
        raise self.fail(f"operand {arg!r} of {self.cur.target} is not a tensor value")

    def emit(self, op: str, inputs, suffix: str = "", ty: TensorType | None = None, **attrs) -> str:
        """Append one node named after the current fx node (+ suffix); infer its type."""
        name = self.fresh(self.cur.name + suffix)
        node = Node(name, op, tuple(inputs), ty, make_attrs(**attrs))
        if ty is None:
            try:
                ty = OPS[op].infer([self.types[i] for i in inputs], node)
                node = Node(name, op, node.inputs, ty, node.attrs)
            except ValueError as e:
                raise self.fail(f"cannot express {self.cur.target} as parcomp {op}: {e}") from None
        return self.add(node)


def _type_of(fx, b: _Builder) -> TensorType:
    val = fx.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise b.fail(f"fx node %{fx.name} does not produce a tensor (got {type(val).__name__})")
    if val.dtype not in DTYPES:
        raise b.fail(f"dtype {val.dtype} of %{fx.name} is not supported; known: "
                     + ", ".join(DTYPES.values()))
    if not all(isinstance(s, int) for s in val.shape):
        raise b.fail(f"%{fx.name} has a dynamic shape {tuple(val.shape)}; only static shapes work")
    return TensorType(tuple(int(s) for s in val.shape), DTYPES[val.dtype])


def _module_path(fx) -> str | None:
    """The path of the innermost user module an fx node was traced in (``mlp.c_fc``), or None."""
    stack = fx.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else ""
    return path or None


def _where(fx) -> str:
    """' in module 'a.b' (Cls), at file.py:12: source' for an fx node, from its meta."""
    out = ""
    stack = fx.meta.get("nn_module_stack") or {}
    if stack:
        path, cls = list(stack.values())[-1]
        cls = getattr(cls, "__qualname__", cls)
        out += f" in module {path!r} ({cls})" if path else f" in the top-level module ({cls})"
    frames = _FRAME.findall(fx.meta.get("stack_trace") or "")
    if frames:
        user = [f for f in frames if not f[0].startswith(_TORCH_DIR)] or frames
        file, line, text = user[-1]
        out += f"\n  at {file}:{line}: {text.strip()}"
    return out


def _bind(fx) -> dict:
    """fx args/kwargs by schema argument name (defaults filled in)."""
    out = {}
    for i, arg in enumerate(fx.target._schema.arguments):
        if not arg.kwarg_only and i < len(fx.args):
            out[arg.name] = fx.args[i]
        elif arg.name in fx.kwargs:
            out[arg.name] = fx.kwargs[arg.name]
        else:
            out[arg.name] = arg.default_value if arg.has_default_value() else None
    return out


def _is_scalar(x) -> bool:
    return isinstance(x, (int, float, bool))


# ---- lowering functions: (builder, fx node, bound args) -> value name -------------

def _unary(op: str):
    return lambda b, n, a: b.emit(op, [b.val(a["self"])])


def _dropout(b, n, a):
    if a["train"] and a["p"]:
        raise b.fail(f"dropout with p={a['p']} in training mode; call module.eval()")
    return b.val(a["input"])


def _scaled(b, x: str, alpha, suffix: str) -> str:
    return x if alpha == 1 else b.emit("scale", [x], suffix, value=float(alpha))


def _additive(op: str, sign: float):
    """add/sub (with ``alpha``); a scalar ``other`` becomes ``add_scalar``."""
    def lower(b, n, a):
        x, y, alpha = a["self"], a["other"], a.get("alpha", 1)
        if _is_scalar(y):
            return b.emit("add_scalar", [b.val(x)], value=float(sign * y * alpha))
        return b.emit(op, [b.val(x), _scaled(b, b.val(y), alpha, "_alpha")])
    return lower


def _rsub(b, n, a):  # other - alpha * self
    x, y, alpha = a["self"], a["other"], a.get("alpha", 1)
    if _is_scalar(y):
        neg = b.emit("scale", [b.val(x)], "_neg", value=float(-alpha))
        return b.emit("add_scalar", [neg], value=float(y))
    return b.emit("sub", [b.val(y), _scaled(b, b.val(x), alpha, "_alpha")])


def _mul(b, n, a):
    x, y = a["self"], a["other"]
    if _is_scalar(x):
        x, y = y, x
    if _is_scalar(y):
        return b.emit("scale", [b.val(x)], value=float(y))
    return b.emit("mul", [b.val(x), b.val(y)])


def _div(b, n, a):
    x, y = a["self"], a["other"]
    if _is_scalar(y):
        return b.emit("scale", [b.val(x)], value=1.0 / float(y))
    return b.emit("div", [b.val(x), b.val(y)])


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


def _reshape(b, n, a):
    x = b.val(a["self"])
    ty = _type_of(n, b)
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
    aten.dropout.default: _dropout,
    **{getattr(aten, op).default: lambda b, n, a: b.val(a["self"])  # identity
       for op in ("clone", "contiguous", "alias", "detach")},
}
# ops with no value that only assert facts torch already checked
SKIP = {aten._assert_tensor_metadata.default}

# ---- attention part (issue 17): views, sdpa, RoPE's ops (parcomp/frontends/torch_attention.py) ----
from .fused import split_fused_weights  # noqa: E402
from .torch_attention import ATTENTION_TABLE, GETITEM, MULTI, mask_only_nodes  # noqa: E402

TABLE.update(ATTENTION_TABLE)
# ---- end of the attention part ----


def supported_ops() -> list:
    """Sorted names (``aten.linear.default`` ...) of the aten ops the frontend lowers."""
    return sorted(str(op) for op in TABLE)


def _lower(b: _Builder, n) -> str | None:
    b.cur = n
    if n.target in SKIP or n in b.folded:
        return None
    if n.target is GETITEM and isinstance(b.env.get(n.args[0]), list):  # one result of a split
        return b.env[n.args[0]][n.args[1]]
    fn = TABLE.get(n.target)
    if fn is None:
        raise FrontendError(f"unsupported op {n.target} (fx node %{n.name}){_where(n)}\n"
                            f"supported ops: {', '.join(supported_ops())}")
    out = fn(b, n, _bind(n))
    if n.target in MULTI:  # several results, picked by getitem
        return out
    want = _type_of(n, b)
    if b.types[out] != want:
        raise b.fail(f"lowering %{n.name} ({n.target}) gives {b.types[out]}, torch computes {want}")
    return out


# ---- driver --------------------------------------------------------------------

# torch loggers that print a traceback of their own before export raises; the error is
# reported once, as a FrontendError, so they are quiet while parcomp traces
_NOISY_LOGGERS = ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes",
                  "torch.export", "torch._export")


@contextlib.contextmanager
def _quiet_torch_logs():
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    saved = [lg.disabled for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    try:
        yield
    finally:
        for lg, was in zip(loggers, saved):
            lg.disabled = was


def _export(module, example_inputs: tuple):
    try:
        # traced in the mode it is given (not switched to eval: the user's module is not
        # changed); dropout with p > 0 in training mode is then a clear error
        with _quiet_torch_logs():
            ep = torch.export.export(module, tuple(example_inputs), strict=False)
    except Exception as e:  # torch raises many types; the user needs the summary
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        shapes = ", ".join(str(tuple(getattr(x, "shape", ()))) for x in example_inputs)
        raise FrontendError(f"torch.export could not trace {type(module).__name__} on "
                            f"{'example inputs of shape ' + shapes if shapes else 'no inputs'}: "
                            f"{type(e).__name__}: {first}") from e
    mutates = any(n.op == "call_function" and getattr(n.target, "_schema", None) is not None
                  and n.target._schema.is_mutable for n in ep.graph.nodes)
    if mutates:  # functionalize in-place ops (relu_, add_) without decomposing anything
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ep = ep.run_decompositions({})
    return ep


def _input_names(module, count: int, names) -> list:
    if names is not None:
        names = [str(x) for x in names]
        if len(names) != count:
            raise FrontendError(f"{len(names)} input names given for {count} model inputs")
        return names
    try:
        params = [p.name for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return params[:count] if len(params) >= count else [f"input_{i}" for i in range(count)]


def _name_outputs(nodes: list, outs: list, wanted: list) -> tuple:
    """Rename each output's defining node to its wanted name (sources keep theirs)."""
    ops, ren = {n.name: n.op for n in nodes}, {}
    for v, w in zip(outs, wanted):
        if ops[v] not in ("input", "param"):
            ren.setdefault(v, w)
    nodes = [replace(n, name=ren.get(n.name, n.name), inputs=tuple(ren.get(i, i) for i in n.inputs))
             for n in nodes]
    return nodes, [ren.get(v, v) for v in outs]


def _dict_keys(ep, count: int) -> list | None:
    """The keys of a ``forward`` that returns a flat dict of ``count`` tensors with string
    keys that are names (``{"a": y, "b": z}``: outputs ``a`` and ``b``), else None."""
    spec = getattr(getattr(ep, "call_spec", None), "out_spec", None)
    if spec is None or spec.type is not dict or spec.num_leaves != count:
        return None
    keys = list(spec.context)
    ok = all(isinstance(k, str) and k.replace(".", "_").isidentifier() for k in keys)
    return keys if ok and len(keys) == count else None  # count leaves in count keys: flat


def _frozen(module, sig, fx_name: str) -> dict:
    """``{"trainable": False}`` for a buffer or a ``requires_grad=False`` parameter, else ``{}``."""
    if fx_name in sig.inputs_to_buffers:
        return {"trainable": False}
    param = module.get_parameter(sig.inputs_to_parameters[fx_name])
    return {} if param.requires_grad else {"trainable": False}


def import_torch(module: torch.nn.Module, example_inputs: tuple,
                 input_names: list | None = None) -> Graph:
    """Trace ``module`` with torch.export and lower it to a global parcomp Graph.

    Args:
        module: the model, traced in the mode it is in (call ``.eval()`` first for
            inference; dropout with p > 0 in training mode is rejected).
        example_inputs: tuple of tensors with the static shapes to compile for.
        input_names: names of the ``input`` nodes; default: ``forward``'s argument
            names, else ``input_0``, ``input_1``...

    Returns:
        A Graph whose ``param`` nodes are named by ``state_dict`` keys (unused ones
        dropped; buffers and ``requires_grad=False`` parameters carry
        ``{trainable=false}``: training never updates them), ``input`` nodes in argument order, and outputs named ``output``
        (one) or ``output_0``, ``output_1``... (several; an output that is itself an
        input or param keeps its name). Shapes are those of ``example_inputs``.

    Raises:
        FrontendError: torch.export fails, an aten op has no lowering (the message
            names the op, fx node, module path and source line, and lists the
            supported ops), a shape is dynamic, or a dtype is unknown.
    """
    ep = _export(module, example_inputs)
    sig, b = ep.graph_signature, _Builder()
    sources = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    users = dict(zip(sig.user_inputs, _input_names(module, len(sig.user_inputs), input_names)))
    fx_nodes = list(ep.graph.nodes)
    b.folded = mask_only_nodes(fx_nodes, SKIP)  # attention part (issue 17)
    for n in fx_nodes:
        if n.op != "placeholder":
            continue
        if n.name in sources:
            b.env[n] = b.source("param", sources[n.name], n, **_frozen(module, sig, n.name))
        elif n.name in users:
            b.env[n] = b.source("input", users[n.name], n)
        else:
            raise FrontendError(f"model input %{n.name} is a lifted constant or token; only "
                                "parameters, buffers and tensor inputs are supported")
    bad = [s for s in sig.output_specs if s.kind.name != "USER_OUTPUT"]
    if bad:
        raise FrontendError(f"the model mutates {bad[0].target!r} ({bad[0].kind.name}); "
                            "only side-effect-free forward() is supported")
    out_fx = [n for n in fx_nodes if n.op == "output"][0].args[0]
    keys = _dict_keys(ep, len(out_fx))
    wanted = ([b.fresh(k) for k in keys] if keys else [b.fresh("output")] if len(out_fx) == 1
              else [b.fresh(f"output_{i}") for i in range(len(out_fx))])
    for n in fx_nodes:
        if n.op == "call_function":
            b.env[n] = _lower(b, n)
        elif n.op not in ("placeholder", "output"):
            raise FrontendError(f"fx node %{n.name} of kind {n.op} is not supported")
    outs = [b.env.get(o) if isinstance(o, torch.fx.Node) else None for o in out_fx]
    if None in outs:
        raise FrontendError("forward() must return only tensors")
    nodes, outs = _name_outputs(b.nodes, outs, wanted)
    used = set(outs) | {i for n in nodes for i in n.inputs}  # drop unused params/buffers
    names = tuple(wanted) if len(set(outs)) < len(outs) else None  # `return y, y`: two names, one value
    graph = Graph(tuple(n for n in nodes if n.op != "param" or n.name in used), tuple(outs),
                  output_names=names)
    return split_fused_weights(graph)  # attention part (issue 17): fused q|k|v, gate|up per part
