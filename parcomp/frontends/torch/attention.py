"""aten lowerings of the attention part: views, attention, RoPE's ops.

Merged into :data:`parcomp.frontends.torch.export.TABLE`. Each lowering is
``(builder, fx node, args bound by schema name) -> value name`` (a list of names for
the ops that return several tensors: ``split``, ``split_with_sizes``, ``chunk``,
``unbind``; ``operator.getitem`` picks one). The IR keeps few view ops:

- ``slice`` (torch's open ends clamped, negative ones wrapped; a whole-dim slice is no node),
  ``split``/``chunk`` -> several ``slice``; ``select``/``unbind`` -> ``slice`` + ``reshape``;
- ``cat``; ``stack`` -> ``reshape`` (unsqueeze) of each operand + ``cat``;
- ``unsqueeze``/``squeeze`` -> ``reshape``; ``expand`` -> ``reshape`` dropping the size-1
  dims it broadcasts + ``expand`` inserting them;
- ``scaled_dot_product_attention`` -> ``sdpa`` (no dropout; an ``attn_mask`` only when it is
  fixed by the shapes, as transformers' causal mask built from ``arange`` is: it is evaluated
  at import, must be causal, a causal sliding-window band (``sdpa {window}``: Mistral's
  ``sliding_window`` shorter than the sequence) or all true, and the nodes only it used are
  not lowered); k/v with
  fewer heads than q (GQA, ``enable_gqa``) are first repeated explicitly, as transformers'
  ``repeat_kv`` does (kv head j serves q heads j*rep .. j*rep+rep-1): ``expand`` on a new
  dim after heads, then ``reshape``. Under a heads split the repeat is local, and fewer kv
  heads than ranks still works (each rank expands and keeps its heads);
- ``cos``, ``sin``, ``arange``, and ``to``/``_to_copy`` (``cast``, or nothing when the
  dtype stays) for rotary embeddings' tables.
"""
from __future__ import annotations

import math
import operator

import torch

from parcomp.ir.types import TensorType

aten = torch.ops.aten
_BIG = 2 ** 62  # torch writes an open slice end as 2**63 - 1


def _ty(b, n):
    return b.type_of(n)


def _dim(d, rank: int) -> int:
    return int(d) % rank if rank else 0


def slice_of(b, x: str, dim: int, start, stop, step=1, suffix: str = "") -> str:
    """``x[start:stop:step]`` along ``dim`` (Python slice semantics), or ``x`` when whole."""
    size = b.types[x].shape[dim]
    lo, hi, st = slice(start, stop if stop is None or stop < _BIG else None, step).indices(size)
    hi = max(hi, lo)
    if (lo, hi, st) == (0, size, 1):
        return x
    return b.emit("slice", [x], suffix, dim=dim, start=lo, stop=hi, step=st)


def _slice(b, n, a):
    x = b.val(a["self"])
    return slice_of(b, x, _dim(a["dim"], b.types[x].rank), a["start"], a["end"], int(a["step"]))


def _split_sizes(b, x, sizes, dim):
    out, off = [], 0
    for i, s in enumerate(sizes):
        out.append(slice_of(b, x, dim, off, off + int(s), 1, f"_{i}"))
        off += int(s)
    return out


def _split(b, n, a):
    x = b.val(a["self"])
    dim = _dim(a["dim"], b.types[x].rank)
    size, step = b.types[x].shape[dim], int(a.get("split_size") or 0)
    sizes = a.get("split_sizes") or [min(step, size - o) for o in range(0, size, step)]
    return _split_sizes(b, x, sizes, dim)


def _chunk(b, n, a):
    x = b.val(a["self"])
    dim = _dim(a["dim"], b.types[x].rank)
    size = b.types[x].shape[dim]
    step = -(-size // int(a["chunks"]))
    return _split_sizes(b, x, [min(step, size - o) for o in range(0, size, step)], dim)


def _drop(b, x: str, dim: int, suffix: str) -> str:
    shape = b.types[x].shape
    ty = TensorType(shape[:dim] + shape[dim + 1:], b.types[x].dtype)
    return b.emit("reshape", [x], suffix, ty=ty)


def _select(b, n, a):
    x = b.val(a["self"])
    dim = _dim(a["dim"], b.types[x].rank)
    i = int(a["index"]) % b.types[x].shape[dim]
    return _drop(b, slice_of(b, x, dim, i, i + 1, 1, "_slice"), dim, "")


def _unbind(b, n, a):
    x = b.val(a["self"])
    dim = _dim(a["dim"], b.types[x].rank)
    return [_drop(b, slice_of(b, x, dim, i, i + 1, 1, f"_slice_{i}"), dim, f"_{i}")
            for i in range(b.types[x].shape[dim])]


def _cat(b, n, a):
    xs = [b.val(t) for t in a["tensors"]]
    xs = [x for x in xs if b.types[x].numel or len(xs) == 1]  # torch drops empty operands
    if len(xs) == 1:
        return xs[0]
    return b.emit("cat", xs, dim=_dim(a["dim"], b.types[xs[0]].rank))


def _stack(b, n, a):
    xs = [b.val(t) for t in a["tensors"]]
    rank = b.types[xs[0]].rank + 1
    dim = _dim(a["dim"], rank)
    ups = []
    for i, x in enumerate(xs):
        s = b.types[x].shape
        ups.append(b.emit("reshape", [x], f"_unsqueeze_{i}",
                          ty=TensorType(s[:dim] + (1,) + s[dim:], b.types[x].dtype)))
    return ups[0] if len(ups) == 1 else b.emit("cat", ups, dim=dim)


def _as_shape(b, n, a):  # unsqueeze, squeeze: a reshape to torch's result shape
    x, ty = b.val(a["self"]), _ty(b, n)
    return x if ty.shape == b.types[x].shape else b.emit("reshape", [x], ty=ty)


def expand_to(b, x: str, shape: tuple, suffix: str = "") -> str:
    """``x`` broadcast to ``shape`` (torch's expand): drop the size-1 dims it widens
    (``reshape``), then insert them at their full size (``expand``)."""
    src, dtype = b.types[x].shape, b.types[x].dtype
    lead = len(shape) - len(src)
    new = tuple(d for d in range(len(shape)) if d < lead or (src[d - lead] == 1 and shape[d] != 1))
    if not new:
        return x
    kept = tuple(shape[d] for d in range(len(shape)) if d not in new)
    if kept != src:
        x = b.emit("reshape", [x], suffix + "_squeeze", ty=TensorType(kept, dtype))
    return b.emit("expand", [x], suffix, ty=TensorType(tuple(shape), dtype), dims=new)


def _expand(b, n, a):
    return expand_to(b, b.val(a["self"]), _ty(b, n).shape)


def repeat_heads(b, x: str, heads: int, suffix: str) -> str:
    """kv ``x`` [B, Hkv, S, D] repeated to ``heads`` heads: head h reads kv head h // rep."""
    bb, hkv, s, d = b.types[x].shape
    rep = heads // hkv
    e = b.emit("expand", [x], suffix + "_expand", ty=TensorType((bb, hkv, rep, s, d), b.types[x].dtype),
               dims=(2,))
    return b.emit("reshape", [e], suffix, ty=TensorType((bb, heads, s, d), b.types[x].dtype))


def _evaluate(b, fx, memo):
    """The value of fx node ``fx`` computed now with torch: it must not depend on a model
    input, parameter or buffer (transformers builds its causal mask from ``arange``)."""
    if fx in memo:
        return memo[fx]
    if fx.op != "call_function":
        raise b.fail(f"scaled_dot_product_attention's attn_mask depends on %{fx.name} ({fx.op}): "
                     "only a mask fixed by the shapes (causal, or all true) is supported; "
                     "nearest supported op: sdpa with is_causal=True")
    args, kwargs = torch.fx.node.map_arg((fx.args, fx.kwargs), lambda x: _evaluate(b, x, memo))
    memo[fx] = fx.target(*args, **kwargs)
    return memo[fx]


def _mask_kind(b, mask_fx, q, k) -> tuple:
    """``(causal, window)`` of the constant ``attn_mask``: ``(True, 0)`` the causal mask,
    ``(True, w)`` the causal band of width ``w`` < the sequence (a sliding window), ``(False, 0)``
    a mask that keeps everything.

    Raises:
        FrontendError: the mask depends on inputs, or keeps some other pattern (padding,
            packed sequences), or is an additive float bias rather than a 0 / -inf mask.
    """
    mask = _evaluate(b, mask_fx, {})
    if mask.dtype != torch.bool:
        keep = mask > torch.finfo(mask.dtype).min / 2
        if torch.any(mask[keep] != 0):
            raise b.fail("scaled_dot_product_attention's attn_mask is a float bias, not a mask; "
                         "nearest supported op: sdpa with is_causal=True")
        mask = keep
    sq, sk = b.types[q].shape[2], b.types[k].shape[2]
    shape = b.types[q].shape[:2] + (sq, sk)
    mask = torch.broadcast_to(mask, shape)
    if bool(torch.all(mask)):
        return False, 0
    if bool(torch.equal(mask, torch.broadcast_to(torch.ones(sq, sk, dtype=torch.bool).tril(), shape))):
        return True, 0
    window = _sliding_window(mask[0, 0])
    if window and bool(torch.equal(mask, torch.broadcast_to(mask[0, 0], shape))):
        return True, window
    raise b.fail("scaled_dot_product_attention's attn_mask is neither causal nor all true (padding "
                 "or packed sequences?): not supported; nearest supported op: sdpa with is_causal=True")


def _sliding_window(mask) -> int:
    """``w`` when the bool [sq, sk] ``mask`` is the causal band of width ``w`` (Mistral's
    ``sliding_window``: key j is kept for query i when i - w < j <= i), else 0."""
    sq, sk = mask.shape
    w = int(mask[-1].sum())
    if sq != sk or not 0 < w < sk:
        return 0
    band = torch.ones(sq, sk, dtype=torch.bool).tril() & ~torch.ones(sq, sk, dtype=torch.bool).tril(-w)
    return w if bool(torch.equal(mask, band)) else 0


def mask_only_nodes(fx_nodes, skip) -> set:
    """fx nodes used only to build sdpa attention masks (folded by :func:`_mask_kind`,
    so not lowered); ``skip``: ops that only assert facts (their use does not count)."""
    sdpa = aten.scaled_dot_product_attention.default
    masks = {n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
             for n in fx_nodes if n.op == "call_function" and n.target is sdpa}
    out = set()
    for n in reversed(fx_nodes):
        if n.op != "call_function" or n.target in skip:
            continue
        users = [u for u in n.users if u.target not in skip]
        as_mask = n in masks and all(u.target is sdpa and n not in u.args[:3] for u in users)
        if users and (as_mask or all(u in out for u in users)):
            out.add(n)
    return out


def _sdpa(b, n, a):
    if a["dropout_p"]:
        raise b.fail(f"scaled_dot_product_attention with dropout_p={a['dropout_p']} (dropout of the attention "
                     "probabilities) is not supported: call module.eval(), or to train with dropout set "
                     "the attention dropout to 0 (GPT-2's attn_pdrop, Llama's attention_dropout); dropout "
                     "layers elsewhere (resid_pdrop, embd_pdrop) are supported")
    q, k, v = (b.val(a[key]) for key in ("query", "key", "value"))
    tq, tk = b.types[q], b.types[k]
    if tq.rank != 4 or tk.rank != 4:
        raise b.fail(f"scaled_dot_product_attention on {tq} and {tk}: parcomp's sdpa takes "
                     "[batch, heads, seq, head_dim] operands")
    heads, kv = tq.shape[1], tk.shape[1]
    if kv != heads:
        if heads % kv:
            raise b.fail(f"{heads} query heads cannot share {kv} kv heads (not a multiple)")
        k, v = repeat_heads(b, k, heads, "_k_repeat"), repeat_heads(b, v, heads, "_v_repeat")
    causal, window = bool(a["is_causal"]), 0
    if a["attn_mask"] is not None and not causal:
        causal, window = _mask_kind(b, a["attn_mask"], q, k)
    scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(tq.shape[-1])
    return b.emit("sdpa", [q, k, v], causal=causal, scale=float(scale), **({"window": window} if window else {}))


def _to(b, n, a):
    x, ty = b.val(a["self"]), _ty(b, n)
    return x if ty.dtype == b.types[x].dtype else b.emit("cast", [x], ty=ty)


def _arange(b, n, a):
    start, step = a.get("start", 0), a.get("step", 1)
    ty = _ty(b, n)
    return b.emit("arange", [], ty=ty, start=start if isinstance(start, int) else float(start),
                  step=step if isinstance(step, int) else float(step))


ATTENTION_TABLE = {
    aten.slice.Tensor: _slice,
    aten.split.Tensor: _split, aten.split_with_sizes.default: _split, aten.chunk.default: _chunk,
    aten.select.int: _select, aten.unbind.int: _unbind,
    aten.cat.default: _cat, aten.stack.default: _stack,
    aten.unsqueeze.default: _as_shape, aten.squeeze.dim: _as_shape, aten.squeeze.dims: _as_shape,
    aten.squeeze.default: _as_shape,
    aten.expand.default: _expand,
    aten.scaled_dot_product_attention.default: _sdpa,
    aten.cos.default: lambda b, n, a: b.emit("cos", [b.val(a["self"])]),
    aten.sin.default: lambda b, n, a: b.emit("sin", [b.val(a["self"])]),
    aten.to.dtype: _to, aten.to.device: _to, aten.to.dtype_layout: _to, aten._to_copy.default: _to,
    aten.arange.default: _arange, aten.arange.start: _arange, aten.arange.start_step: _arange,
}
MULTI = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int)
GETITEM = operator.getitem
