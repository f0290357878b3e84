"""The torch emitter's per-node text: the op tables and :func:`node_code`, the right-hand side of
one statement of ``program.py`` per graph node (split from :mod:`parcomp_backends.torch.emit`, which re-exports
every name here; :mod:`.sections` writes the program's other sections).

Each op maps to a format string over its operand variables and attributes (Python
literals from :func:`py_literal`); ``inplace=true`` and ``async_op=true`` nodes read their own
tables.  The parts' rows come from ``emit_norms``, ``emit_reduce``, ``emit_moe`` and
``emit_cp_ring``.
"""
from __future__ import annotations

import json
import math
from json.encoder import encode_basestring_ascii as _json_str  # json.dumps of a str

from parcomp.compile.program import ParcompError

from .cp import Q_OPERAND, cp_kw  # context parallel; Q_OPERAND: sdpa, sdpa_grad
from .attention import JOINT_FORMATS, SAVED_FORMATS  # one attention's gradients together
from .cp_ring import RING_FORMATS, ring_key, ring_kw
from .moe import MOE_DEFAULTS, MOE_FORMATS, moe_key
from .norms import NORM_FORMATS, norm_kw
from .reduce import ASYNC_REDUCE, IN_PLACE_REDUCE, REDUCE_FORMATS, reduce_key, reduce_kw

# op -> format string; {0}, {1}: operand variables, {name}: attribute as a Python literal
OP_FORMATS = {
    "relu": "torch.relu({0})",
    "gelu": "torch.nn.functional.gelu({0}, approximate={approximate})",
    "tanh": "torch.tanh({0})",
    "exp": "torch.exp({0})",
    "sigmoid": "torch.sigmoid({0})",
    "silu": "torch.nn.functional.silu({0})",
    "pow": "torch.pow({0}, {exponent})",
    "add_scalar": "{0} + {value}",
    "neg": "torch.neg({0})",
    "scale": "{0} * {value}",
    "add": "{0} + {1}",
    "sub": "{0} - {1}",
    "mul": "{0} * {1}",
    "div": "{0} / {1}",
    "matmul": "torch.matmul({0}, {1})",
    "permute": "{0}.permute{perm}",
    "reshape": "{0}.reshape({local_shape})",
    "sum": "torch.sum({0}, dim={dims})",  # dims=() is the identity (see node_code)
    "expand": "{0}.reshape({kept_shape}).expand({local_shape})",
    "ones": "torch.ones({local_shape}, dtype={dtype}, device=DEVICE)",
    "relu_grad": "{0} * ({1} > 0).to({0}.dtype)",
    "tanh_grad": "{0} * (1 - {1} * {1})",
    "sigmoid_grad": "{0} * {1} * (1 - {1})",
    "silu_grad": "{0} * torch.sigmoid({1}) * (1 + {1} * (1 - torch.sigmoid({1})))",
    "pow_grad": "{0} * {exponent} * torch.pow({1}, {exponent} - 1)",
    "gelu_grad": "torch.ops.aten.gelu_backward({0}, {1}, approximate={approximate})",
    "cross_entropy": ("torch.nn.functional.cross_entropy({0}.reshape(-1, {0}.shape[-1]), {1}.reshape(-1), "
                      'reduction="none").reshape({local_shape})'),
    "cross_entropy_grad": ("{0}.unsqueeze(-1) * (torch.softmax({1}, dim=-1) - "
                           "torch.nn.functional.one_hot({2}, {1}.shape[-1]).to({1}.dtype))"),
    # torch.optim.AdamW's update (numpy_ops._adamw): decay, then m / (sqrt(v) / sqrt(bc2) + eps)
    "adamw_param": ("{0} * (1 - {lr} * {weight_decay}) - {lr} / (1 - {beta1} ** {3}) * {1} "
                    "/ (torch.sqrt({2}) / torch.sqrt(1 - {beta2} ** {3}) + {eps})"),
    "all_reduce": "all_reduce({0}, {axis})",
    "all_gather": "all_gather({0}, {dim}, {axis})",
    "reduce_scatter": "reduce_scatter({0}, {dim}, {axis})",
    "all_to_all": "all_to_all({0}, {src_dim}, {dim}, {axis})",
    "shard_slice": "shard_slice({0}, {dim}, {axis})",
    "partial_mask": "partial_mask({0}, {axis})",
    "relayout": "{0}",
    # lowered ops (parcomp/passes/lowering/lower.py)
    "dense": "torch.nn.functional.linear({args})",
    "addmm": "torch.addmm({0}, {1}, {2})",
    "matmul_t": "torch.matmul({1}.t(), {0}.t())",
    "add_scaled": "torch.add({0}, {1}, alpha={b})",
    "axpby": "torch.add({0} * {a}, {1}, alpha={b})",
    "mse_sum": 'torch.nn.functional.mse_loss({0}, {1}, reduction="sum")',
    "mse_grad": "({1} - {2}).mul_({0} * 2.0)",
    "wait": "wait({0})",
    # ---- attention part: views, sdpa, RoPE pointwise ops ----
    "slice": "torch.ops.aten.slice({0}, {dim}, {start}, {stop}, {step})",
    "slice_grad": ("torch.ops.aten.slice_scatter(torch.zeros({local_shape}, dtype={dtype}, device=DEVICE), "
                   "{0}, {dim}, {start}, {stop}, {step})"),
    "cat": "torch.cat(({args},), dim={dim})",
    # loss part: a constant pad of one dim (moved last for F.pad, then back)
    "pad": "torch.nn.functional.pad({0}.movedim({dim}, -1), ({before}, {after}), value={value}).movedim(-1, {dim})",
    "sdpa": "torch.nn.functional.scaled_dot_product_attention({0}, {1}, {2}, {mask_args}, scale={scale})",
    "sdpa_grad": ("torch.func.vjp(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention("
                  "q, k, v, {mask_args}, scale={scale}), {1}, {2}, {3})[1]({0})[{wrt_index}]"),
    "cos": "torch.cos({0})",
    "sin": "torch.sin({0})",
    "cast": "{0}.to({dtype})",
    "arange": "torch.arange({local_shape}[0], dtype=torch.float64, device=DEVICE).mul({step}).add({start}).to({dtype})",
    # ---- end of the attention part ----
    "clip_coef": "torch.clamp({max_norm} / (torch.sqrt({0}) + 1e-6), max=1.0)",
    "grad_upcast": "{0}.float()",  # mixed precision: the gradient widened before its reduction
    "nonfinite": "(~torch.isfinite({0})).float()",  # fp16 loss scaling (parcomp/passes/train/amp.py)
    "amp_select": "torch.where({0} > 0, {2}, {1})",
    "amp_ratio": "torch.where({0} > 0, {1} * 0.5 - 0.5, torch.where({2} + 1 >= {interval}, {1} * 2 + 1, {1}))",
    "amp_tracker": "torch.where(({0} > 0) | ({1} + 1 >= {interval}), torch.zeros_like({1}), {1} + 1)",
    **NORM_FORMATS,  # norms + embedding part: backends/torch/emit/norms.py
    **REDUCE_FORMATS,  # reductions part: backends/torch/emit/reduce.py
    **MOE_FORMATS,  # expert parallel MoE: backends/torch/emit/moe.py
    **RING_FORMATS,  # ring attention: backends/torch/emit/cp_ring.py
}
# ``inplace=true``: the result is written into the first operand (torch.optim's own updates)
IN_PLACE_FORMATS = {
    "all_reduce": "all_reduce_({0}, {axis})",
    "add": "{0}.add_({1})",
    "add_scaled": "{0}.add_({1}, alpha={b})",
    "axpby": "{0}.mul_({a}).add_({1}, alpha={b})",
    # torch.optim.AdamW's capturable single-tensor form: one temporary (the denominator,
    # divided by -step_size in place), then one addcdiv_ into the param
    "adamw_param": ("{0}.mul_(1 - {lr} * {weight_decay}).addcdiv_({1}, torch.sqrt({2}).div_("
                    "torch.sqrt(1 - {beta2} ** {3}) * (-{lr} / (1 - {beta1} ** {3})))"
                    ".add_({eps} / (-{lr} / (1 - {beta1} ** {3}))))"),
    **IN_PLACE_REDUCE,
}
# ``async_op=true``: start the collective, ``wait`` returns its value (key + "_": in place)
ASYNC_FORMATS = {"all_reduce": "all_reduce_start({0}, {axis})", "all_reduce_": "all_reduce_start_({0}, {axis})",
                 "all_gather": "all_gather_start({0}, {dim}, {axis})",
                 "reduce_scatter": "reduce_scatter_start({0}, {dim}, {axis})", **ASYNC_REDUCE}
ATTR_DEFAULTS = {"gelu": {"approximate": "none"}, "gelu_grad": {"approximate": "none"},
                 # attention part
                 **{op: {"causal": False} for op in ("sdpa", "sdpa_grad")},
                 **{op: {"step": 1} for op in ("slice", "slice_grad")}, "arange": {"start": 0, "step": 1},
                 **MOE_DEFAULTS}
TORCH_DTYPES = {"float32": "torch.float32", "float64": "torch.float64", "float16": "torch.float16",
                "bfloat16": "torch.bfloat16", "int64": "torch.int64", "int32": "torch.int32",
                "bool": "torch.bool"}


class EmitError(ParcompError):
    """The program cannot be emitted (an op or dtype the torch backend has no entry for)."""


def py_literal(v) -> str:
    """A Python literal for an attribute value."""
    if type(v) is str:  # the most common: json.dumps(v)'s own encoder, without its set-up
        return _json_str(v)
    if isinstance(v, bool) or isinstance(v, int):
        return repr(v)
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else f'float("{v}")'
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, tuple):
        return repr(tuple(int(x) for x in v))
    raise EmitError(f"attribute value {v!r} has no Python form")



def node_code(n, args, program=None, parts=None, saved=None) -> str:
    """The right-hand side computing node ``n`` from operand variables ``args``
    (``inplace``: :data:`IN_PLACE_FORMATS`; ``async_op``: :data:`ASYNC_FORMATS`; ``parts``: an
    ``sdpa_grad``'s attention's gradients wanted together; ``saved``: the variable of the
    attention's saved kernel tensors, an ``sdpa`` that keeps them or the joint ``sdpa_grad``
    that reads them, emit/attention.py)."""
    op, attr = n.op, n.attr
    async_op, inplace = attr("async_op"), attr("inplace")
    table = (ASYNC_FORMATS if async_op else IN_PLACE_FORMATS if inplace else OP_FORMATS)
    rkey = reduce_key(n)
    key = ring_key(n, moe_key(n, rkey + ("_" if async_op and inplace else "")))
    if op == "sdpa_grad" and parts:  # the gradients ``parts`` of one attention together
        table, key = JOINT_FORMATS, key + ("_saved_joint" if saved else "_joint")
    elif op == "sdpa" and saved:  # the forward keeping its kernel's saved tensors
        table = SAVED_FORMATS
    if key not in table:
        raise EmitError(f"op {n.op!r} (%{n.name}) has no torch mapping; the torch backend "
                        f"knows: {', '.join(sorted(OP_FORMATS))}")
    if op == "sum" and not attr("dims"):
        return args[0]
    if op == "pow_grad" and attr("exponent") == 2.0:  # d(x**2) = 2 x dy, without pow(x, 1)
        return f"{args[0]} * ({args[1]} * 2.0)"
    ty = n.type
    if ty.dtype not in TORCH_DTYPES:
        raise EmitError(f"%{n.name} has dtype {ty.dtype}, which has no torch name")
    if op in ATTR_DEFAULTS:
        attrs = dict(ATTR_DEFAULTS[op])
        attrs.update(n.attrs)
        kw = {k: py_literal(v) for k, v in attrs.items()}
    else:
        kw = {k: py_literal(v) for k, v in dict(n.attrs).items()}
    kw["local_shape"] = repr(tuple(ty.shape))
    kw["dtype"] = TORCH_DTYPES[ty.dtype]
    kw["args"] = ", ".join(args)
    if op in NORM_FORMATS:
        kw.update(norm_kw(program, n, args))  # norms + embedding part
    if op in REDUCE_FORMATS or rkey in REDUCE_FORMATS:  # reduce_kw's own test
        kw.update(reduce_kw(program, n, py_literal))  # reductions part
    if op in Q_OPERAND:
        kw.update(cp_kw(program, n, args))  # context parallel: causal mask at the rank's rows
        kw.update(ring_kw(n))  # ring attention: sdpa / sdpa_grad only
    if op == "expand":
        kw["kept_shape"] = repr(tuple(1 if d in attr("dims") else s for d, s in enumerate(ty.shape)))
    if op == "sdpa_grad":  # attention part: which of torch.func.vjp's (dq, dk, dv)
        kw["wrt_index"] = "qkv".index(attr("wrt"))
        if parts:
            kw["parts"] = py_literal(parts)
    if saved:
        kw["saved"] = saved
    return table[key].format(*args, **kw)
