"""torch.export frontend: an ``nn.Module`` becomes a parcomp :class:`Graph`.

The module is traced with ``torch.export.export(strict=False)``; what depends only on
constants and buffers is folded (:mod:`.fold`), every other aten op of the
exported fx graph is lowered through :data:`TABLE` (:mod:`.aten_table`), a dict from
aten op overload to a small lowering function, and the outputs are named after what
``forward`` returns (:mod:`.outputs`).  Parameters and buffers become ``param``
nodes named by their ``state_dict`` key, user inputs ``input`` nodes.

``nn.Linear`` (``aten.linear``, weight stored ``[out, in]``) lowers to
``permute{perm=(1,0)}(W) -> matmul(x, .) -> add(., b)``, keeping the chain
param -> permute -> matmul rhs direct so later passes can find the weight's role.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import logging
import re
import sys
import warnings
from dataclasses import replace

import torch

from parcomp.errors import FrontendError
from parcomp.ir.graph import Graph, Node, make_attrs
from parcomp.ir.names import NameGen
from parcomp.ir.ops import OPS
from parcomp.ir.types import TensorType
from .aten_table import TABLE
from .fold import (causal_attention, defining, fold, folded_constants,  # noqa: F401
                         materialized, remember, same_value)
from .hints import (COMPLEX, DATA_DEPENDENT, is_data_dependent, module_path as _module_path,
                          raising_frame, unsupported, user_frame, where_of)
from .complex import REAL, Complex, lower_complex, touches_complex
from .activations import gelu_patterns
from .norms import NORM_TABLE, fused_patterns
from .outputs import name_outputs, output_names, register_output_dataclasses

aten = torch.ops.aten

DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
          torch.bfloat16: "bfloat16", torch.int64: "int64", torch.int32: "int32",
          torch.bool: "bool"}
_NAME_OK = re.compile(r"[A-Za-z0-9_.]+\Z")


class _Builder:
    """Accumulates parcomp nodes while walking one exported fx graph."""

    def __init__(self):
        self.nodes, self.types, self.taken = [], {}, NameGen()
        self.env = {}  # fx node -> parcomp value name (None: no value)
        self.cur = None  # fx node being lowered, for error messages
        self.folded = set()  # fx nodes evaluated at import, not lowered (attention masks)
        self.fused = {}  # fx node -> lowering(builder, fx node) of a fused pattern (norms part)
        self.dropout_sites = 0  # dropout nodes emitted so far (the next one's seed)

    def fresh(self, base: str) -> str:
        return self.taken.fresh(re.sub(r"[^A-Za-z0-9_.]", "_", base) or "v")

    def fail(self, msg: str, hint: str = "") -> FrontendError:
        """A FrontendError about the fx node being lowered: ``msg``, its module path and
        class, ``hint`` (what to do), and as its location the user's source line it was traced from (the
        ``file:line:col`` header of every located error), when there is one."""
        if self.cur is None:
            return FrontendError(msg + hint)
        return FrontendError(msg + where_of(self.cur) + hint, user_frame(self.cur),
                             where=_module_path(self.cur) or str(self.cur.target))

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
        if isinstance(arg, torch.fx.Node) and isinstance(self.env.get(arg), Complex):
            raise self.fail(f"complex operand %{arg.name} of {self.cur.target}: parcomp computes in real "
                            "dtypes (complex values are lowered for rotary embeddings only)",
                            f"; {COMPLEX}")
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
        raise b.fail(f"dtype {val.dtype} of %{fx.name} is not supported (known: "
                     + ", ".join(DTYPES.values()) + ")", f"; {COMPLEX}" if val.dtype.is_complex else "")
    if not all(isinstance(s, int) for s in val.shape):
        raise b.fail(f"%{fx.name} has a dynamic shape {tuple(val.shape)}; only static shapes work")
    return TensorType(tuple(int(s) for s in val.shape), DTYPES[val.dtype])


def _batch_size(inputs) -> int | None:
    """The batch: dim 0 shared by every user input fx node that is a tensor of rank 1 or
    more; None when there is none or they differ."""
    sizes = {int(v.shape[0]) for v in (n.meta.get("val") for n in inputs)
             if isinstance(v, torch.Tensor) and v.dim() and isinstance(v.shape[0], int)}
    return sizes.pop() if len(sizes) == 1 else None


def _repeats_over_batch(value: torch.Tensor, batch: int | None) -> bool:
    """Whether folded ``value`` is one row repeated over the batch: dim 0 is the batch
    (more than 1) and every row equals the first (a mask built for each sequence of the batch,
    ``expand``-ed from the example input's shape)."""
    if batch is None or batch < 2 or value.dim() == 0 or value.shape[0] != batch:
        return False
    return all(same_value(value[0], value[i]) for i in range(1, batch))


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


# ops with no value that only assert facts torch already checked
SKIP = {aten._assert_tensor_metadata.default}

# ---- attention part: views, sdpa, RoPE's ops (parcomp/frontends/torch/attention.py) ----
from parcomp.passes.fused_weights import split_fused_weights  # noqa: E402
from .attention import ATTENTION_TABLE, GETITEM, MULTI, mask_only_nodes  # noqa: E402

TABLE.update(ATTENTION_TABLE)
# ---- end of the attention part ----
TABLE.update(NORM_TABLE)  # norms + embedding part: parcomp/frontends/torch/norms.py
# ---- reductions part: amax, argmax, mean, log, softmax, log_softmax
# (parcomp/frontends/torch/reductions.py) ----
from .reductions import REDUCTION_TABLE  # noqa: E402

TABLE.update(REDUCTION_TABLE)
MULTI = MULTI + (aten.topk.default,)  # values and indices, picked by getitem
from .loss import LOSS_TABLE  # noqa: E402  loss part: pad, cross_entropy_loss, nll_loss

TABLE.update(LOSS_TABLE)
from .conv import CONV_TABLE  # noqa: E402  patch convolutions as a matmul over patches

TABLE.update(CONV_TABLE)
from .buffers import BUFFER_TABLE, mask_patterns  # noqa: E402  buffers written in parts, routing masks

TABLE.update(BUFFER_TABLE)


def supported_ops() -> list:
    """Sorted names (``aten.linear.default`` ...) of the aten ops the frontend lowers."""
    return sorted(str(op) for op in TABLE)


def _lower(b: _Builder, n) -> str | None:
    b.cur = n
    if n.target in SKIP or n in b.folded:
        return None
    if n.target is GETITEM and isinstance(b.env.get(n.args[0]), list):  # one result of a split
        return b.env[n.args[0]][n.args[1]]
    if n in b.fused:  # a pattern lowered as one op (norms part: torch_norms.py)
        return b.fused[n](b, n, _bind(n) if getattr(n.target, "_schema", None) is not None else {})
    if touches_complex(n):  # complex part: a pair of real values (parcomp/frontends/torch/complex.py)
        return lower_complex(b, n, TABLE, _bind)
    fn = TABLE.get(n.target)
    if fn is None:
        raise unsupported(n, supported_ops())
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


@contextlib.contextmanager
def _no_partial_graph_dump():
    """What Python code writes to ``sys.stderr`` while torch.export traces, passed on after
    it, except the partial fx graph torch.export prints before raising (``partial_fx_graph``:
    an internal dump; the error names the user's line instead). A model's own prints stay."""
    buf, real = io.StringIO(), sys.stderr
    try:
        with contextlib.redirect_stderr(buf):
            yield
    except BaseException as e:
        text, dump = buf.getvalue(), getattr(e, "partial_fx_graph", None)
        if isinstance(dump, str) and dump:
            text = text.replace(dump + "\n", "")  # printed once per export wrapper
        real.write(text)
        raise
    real.write(buf.getvalue())


def _returned_cache(module, exc) -> str | None:
    """What to say when torch.export failed on a transformers KV cache in the output: the
    model's config has ``use_cache=True``, so ``forward`` returns a ``DynamicCache`` (the keys
    and values kept for generating the next token), which torch's pytree cannot flatten.
    parcomp compiles a forward or training step and never feeds a cache back, so the user
    turns it off (docs/design/frontends.md says why parcomp does not do it for them)."""
    config = getattr(module, "config", None)
    found = re.search(r"<class '(transformers\.cache_utils\.\w+|[\w.]*Cache)'>", str(exc))
    if found is None or not getattr(config, "use_cache", False):
        return None
    return (f"{type(module).__name__}.config.use_cache is True: forward returns a "
            f"{found.group(1).rsplit('.', 1)[-1]} (the KV cache for generating the next token), "
            f"which torch.export cannot return; parcomp compiles a forward or training step, which "
            f"never reads a cache: set config.use_cache = False before building the model (or "
            f"{type(config).__name__}(..., use_cache=False))")


def export_module(module, example_inputs: tuple):
    """``torch.export.export(module, example_inputs, strict=False)`` as the frontend runs it:
    torch's own tracebacks quiet, a dataclass output registered, in-place ops functionalized.

    Raises:
        FrontendError: torch.export fails (the user's line that raised, when known).
    """
    try:
        # traced in the mode it is given (not switched to eval: the user's module is not
        # changed); dropout with p > 0 in training mode becomes parcomp's dropout
        with _quiet_torch_logs(), _no_partial_graph_dump(), static_experts(module):
            try:
                ep = torch.export.export(module, tuple(example_inputs), strict=False)
            except RuntimeError as e:  # a dataclass output: register it, as the user would
                if "not a known type" not in str(e) or not register_output_dataclasses(
                        module, example_inputs):
                    raise
                ep = torch.export.export(module, tuple(example_inputs), strict=False)
    except Exception as e:  # torch raises many types; the user needs the summary
        cache = _returned_cache(module, e)
        if cache:
            raise FrontendError(cache, where=f"{type(module).__name__}.config.use_cache") from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        shapes = ", ".join(str(tuple(getattr(x, "shape", ()))) for x in example_inputs)
        what = f"{type(e).__name__}: {first}"
        if is_data_dependent(e):  # torch's "(unhinted: ...) (Size-like symbols: ...)" dropped
            what = f"{DATA_DEPENDENT} ({what.split(' (unhinted')[0]})"
        loc = raising_frame(e)
        raise FrontendError(f"torch.export could not trace {type(module).__name__} on "
                            f"{'example inputs of shape ' + shapes if shapes else 'no inputs'}: "
                            f"{what}", loc) from e
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


def tied_aliases(module) -> dict:
    """``{parameter name: its other names}`` for each tied parameter of ``module`` (one
    tensor under several names: ``named_parameters(remove_duplicate=False)``; GPT-2's
    ``lm_head.weight`` and ``transformer.wte.weight``). Untied parameters are absent."""
    by_id = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {n: tuple(m for m in names if m != n) for names in by_id.values() if len(names) > 1 for n in names}


def _tied(tied: dict, name: str) -> dict:
    """``{"aliases": "a,b"}`` (a param attr: spec rules match these names too) for a tied
    parameter, else ``{}``."""
    return {"aliases": ",".join(sorted(tied[name]))} if tied.get(name) else {}


def _frozen(frozen_params: set, buffers, params, fx_name: str) -> dict:
    """``{"trainable": False}`` for a buffer or a ``requires_grad=False`` parameter, else
    ``{}``; ``buffers``/``params``: the signature's placeholder -> state_dict key maps, read
    once per import (torch builds them anew on each access, a walk over every input)."""
    if fx_name in buffers or params[fx_name] in frozen_params:
        return {"trainable": False}
    return {}


def op_inventory(module: torch.nn.Module, example_inputs: tuple) -> dict:
    """The aten ops ``module``'s forward exports to, counted: ``{"exported": {op name:
    count}, "lowered": {...}}``, ``lowered`` being what is left for :data:`TABLE` after
    constant folding and the causal-mask rewrite (``supported_ops()`` says which have a
    lowering). Op names as ``str(op)``: ``aten.linear.default``; ``operator.getitem``
    and :data:`SKIP` ops are left out.

    Raises:
        FrontendError: torch.export fails.
    """
    ep = export_module(module, example_inputs)

    def count(nodes) -> dict:
        names = [str(n.target) for n in nodes if n.op == "call_function" and n.target not in SKIP
                 and isinstance(n.target, torch._ops.OpOverload)]
        return {k: names.count(k) for k in sorted(set(names))}

    exported = count(ep.graph.nodes)
    consts = fold(ep)
    causal_attention(ep, consts, _bind)
    return {"exported": exported, "lowered": count(n for n in ep.graph.nodes if n not in consts)}


def import_torch(module: torch.nn.Module, example_inputs: tuple,
                 input_names: list | None = None) -> Graph:
    """Trace ``module`` with torch.export and lower it to a global parcomp Graph.

    Args:
        module: the model, traced in the mode it is in (call ``.eval()`` first for
            inference; dropout with p > 0 in training mode becomes parcomp's ``dropout``,
            whose mask is a hash of the element's global index, not torch's generator).
        example_inputs: tuple of tensors with the static shapes to compile for.
        input_names: names of the ``input`` nodes; default: ``forward``'s argument
            names, else ``input_0``, ``input_1``...

    Returns:
        A Graph whose ``param`` nodes are named by ``state_dict`` keys (unused ones
        dropped; buffers and ``requires_grad=False`` parameters carry
        ``{trainable=false}``: training never updates them), ``input`` nodes in
        argument order, and outputs named as :mod:`parcomp.frontends.torch.outputs`
        says (``output``; ``output_0``, ``output_1``...; dict/``ModelOutput`` keys such
        as ``logits``; nested paths joined with ``.``; an output that is itself an input
        or param keeps its name). Values computed from constants and buffers alone are
        folded (:mod:`parcomp.frontends.torch.fold`) into ``{trainable=false}`` params
        named ``<module path>.<fx node>``, their values in :func:`folded_constants`.
        Shapes are those of ``example_inputs``.

    Raises:
        FrontendError: torch.export fails, an aten op has no lowering (located at the
            user's source line; the message names the op, fx node, module path and a
            related supported op or rewrite: :mod:`.hints`), a shape is dynamic, or a
            dtype is unknown (complex: the real-arithmetic RoPE rewrite).
    """
    return import_exported(module, export_module(module, example_inputs), input_names)


def import_exported(module: torch.nn.Module, ep, input_names: list | None = None) -> Graph:
    """:func:`import_torch` past its torch.export step: ``ep`` (what :func:`export_module`
    gave for ``module``; its fx graph is changed in place: causal masks are dropped) lowered
    to a parcomp Graph. The work is linear in the exported graph's size: every fx node and
    every input spec is visited a bounded number of times."""
    consts = fold(ep)  # fx node -> value, for what depends on constants and buffers only
    causal_attention(ep, consts, _bind)
    sig, b = ep.graph_signature, _Builder()
    params, buffers = dict(sig.inputs_to_parameters), dict(sig.inputs_to_buffers)
    sources = {**params, **buffers}
    frozen_params = {name for name, p in module.named_parameters(remove_duplicate=False)
                     if not p.requires_grad}
    users = dict(zip(sig.user_inputs, _input_names(module, len(sig.user_inputs), input_names)))
    fx_nodes = list(ep.graph.nodes)
    tied = tied_aliases(module)
    b.folded = mask_only_nodes(fx_nodes, SKIP)  # attention part
    b.fused = {**fused_patterns(fx_nodes), **mask_patterns(fx_nodes), **gelu_patterns(fx_nodes)}
    for n in fx_nodes:
        if n.op != "placeholder":
            continue
        if n.name in sources:
            b.env[n] = b.source("param", sources[n.name], n, **_frozen(frozen_params, buffers, params, n.name),
                                **_tied(tied, sources[n.name]))
        elif n.name in users:
            b.env[n] = b.source("input", users[n.name], n)
        elif n not in consts:
            raise FrontendError(f"model input %{n.name} is a token or an opaque object; only "
                                "parameters, buffers, constants and tensor inputs are supported")
    values = {}
    batch = _batch_size([n for n in fx_nodes if n.name in users])

    def frozen(n, value, suffix="", own_shape=False):  # one param per distinct value (each layer's RoPE cos is one)
        found = next((k for k, v in values.items() if same_value(v, value)), None)
        if found is None:
            at = defining(n)
            ty = TensorType(tuple(value.shape), DTYPES[value.dtype]) if suffix or own_shape else _type_of(n, b)
            found = b.add(Node(b.fresh(".".join(filter(None, (_module_path(at), at.name))) + suffix),
                               "param", (), ty, make_attrs(trainable=False), source=_module_path(at)))
            values[found] = value.clone()
        return found

    for n in materialized(ep, consts):  # folded values that computed nodes use: frozen params
        b.cur, value = n, consts[n].detach()
        if value.dtype.is_complex and value.dtype in REAL:  # complex part: its two real parts
            b.env[n] = Complex(frozen(n, value.real.contiguous(), ".real"), frozen(n, value.imag.contiguous(), ".imag"))
        elif _repeats_over_batch(value, batch):  # one row, expanded over the batch (ir.md)
            b.env[n] = b.emit("expand", [frozen(n, value[0].contiguous(), own_shape=True)], "_batch",
                              ty=_type_of(n, b), dims=(0,))
        else:
            b.env[n] = frozen(n, value)
    remember(module, values)
    bad = [s for s in sig.output_specs if s.kind.name != "USER_OUTPUT"]
    if bad:
        raise FrontendError(f"the model mutates {bad[0].target!r} ({bad[0].kind.name}); "
                            "only side-effect-free forward() is supported")
    out_fx = [n for n in fx_nodes if n.op == "output"][0].args[0]
    named = [(o, k) for o, k in zip(out_fx, output_names(ep, len(out_fx))) if o is not None]
    out_fx, wanted = [o for o, _ in named], [b.fresh(k) for _, k in named]  # None: no output
    for n in fx_nodes:
        if n.op == "call_function" and n not in consts:
            b.env[n] = _lower(b, n)
        elif n.op not in ("placeholder", "output", "call_function"):
            raise FrontendError(f"fx node %{n.name} of kind {n.op} is not supported")
    outs = [b.env.get(o) if isinstance(o, torch.fx.Node) else None for o in out_fx]
    if None in outs:
        raise FrontendError("forward() must return only tensors")
    nodes, outs = name_outputs(b.nodes, outs, wanted)
    used = set(outs) | {i for n in nodes for i in n.inputs}
    params = {n.name for n in nodes if n.op == "param"}
    # a folded constant repeated over the batch is a param row + expand: drop both when unread
    # (a zeros_like that scatter_add only names as its base)
    nodes = [n for n in nodes if n.name in used or not (n.op == "expand" and n.inputs[0] in params)]
    used = set(outs) | {i for n in nodes for i in n.inputs}  # drop unused params/buffers
    names = tuple(wanted) if len(set(outs)) < len(outs) else None  # `return y, y`: two names, one value
    graph = Graph(tuple(n for n in nodes if n.op != "param" or n.name in used), tuple(outs),
                  output_names=names)
    return split_fused_weights(graph)  # attention part: fused q|k|v, gate|up per part
from .moe import MOE_TABLE, static_experts  # noqa: E402  expert parallel MoE

TABLE.update(MOE_TABLE)
