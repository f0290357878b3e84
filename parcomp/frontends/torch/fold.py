"""Constant folding for the torch.export frontend.

A model computes some tensors from nothing its caller passes in: position ids
(``arange``), causal masks (``full``/``triu``/``where``, or transformers' mask functions
with ``index``/``cumsum``/``le``/``__and__``), RoPE's cos/sin tables from the
``inv_freq`` buffer.  :func:`fold` runs every fx node that depends only on buffers,
lifted tensor constants and literals once, at import, with torch itself; the frontend
then turns each folded value that a computed node uses into a non-trainable ``param``
(``{trainable=false}``, like a buffer) whose value :func:`folded_constants` gives.  No
op is needed for them, and none of them gets a gradient or a collective of its own.

:func:`causal_attention` rewrites ``scaled_dot_product_attention`` whose ``attn_mask``
folds to exactly the causal mask (bool lower triangle, or 0 / -inf additive) into
``is_causal=True`` without a mask, and drops a mask that keeps everything, so neither
mask is kept at all.

Not folded: anything that reads a model input or a parameter (trainable or frozen:
a frozen parameter can still be loaded from a checkpoint), and random ops (dropout,
rand: ``torch.Tag.nondeterministic_seeded``). Except: an allocation shaped like a tensor
(``zeros_like``, ``new_zeros``, ``new_empty``, ``full_like``, ...: :data:`ALLOCATIONS`)
reads only its operand's static shape and dtype, so it folds whatever the operand is; an
uninitialised one (``new_empty``, ``empty_like``) folds to zeros (a model that reads it
before writing it reads whatever torch left there, no value in particular).
"""
from __future__ import annotations

import weakref

import torch
from torch.fx.node import map_arg

aten = torch.ops.aten

# module -> {param name: tensor} of its latest import (see folded_constants)
_FOLDED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def folded_constants(module) -> dict:
    """``{param name: tensor}`` of the constants the latest :func:`import_torch` of
    ``module`` folded (empty if none).  These ``param`` nodes are not in the module's
    ``state_dict``: feed them with it (``parcomp check``/``run`` do)."""
    return dict(_FOLDED.get(module, {}))


def module_sources(module) -> dict:
    """Every value a ``param`` node of ``module``'s imported graph can name: the
    ``state_dict``, non-persistent buffers and the folded constants (tensors)."""
    return {**dict(module.named_buffers()), **module.state_dict(), **folded_constants(module)}


def remember(module, values: dict) -> None:
    """Record ``values`` as ``module``'s folded constants (replacing an earlier import's)."""
    _FOLDED[module] = dict(values)


def _inputs(n) -> list:
    found = []
    map_arg((n.args, n.kwargs), lambda x: found.append(x))
    return found


def _foldable(n, vals: dict) -> bool:
    if n.op != "call_function" or not all(x in vals for x in _inputs(n)):
        return False
    return torch.Tag.nondeterministic_seeded not in getattr(n.target, "tags", ())


# allocation op -> its fill (None: the op's fill_value argument); the shape and dtype are
# the node's own (torch's static meta value)
ALLOCATIONS = {aten.zeros_like.default: 0.0, aten.new_zeros.default: 0.0, aten.empty_like.default: 0.0,
               aten.new_empty.default: 0.0, aten.new_empty_strided.default: 0.0,
               aten.ones_like.default: 1.0, aten.new_ones.default: 1.0,
               aten.full_like.default: None, aten.new_full.default: None}


def _allocated(n):
    """The value of allocation node ``n`` (:data:`ALLOCATIONS`), or None if its shape is not static."""
    meta = n.meta.get("val")
    if not isinstance(meta, torch.Tensor) or not all(isinstance(s, int) for s in meta.shape):
        return None
    fill = ALLOCATIONS[n.target]
    if fill is None:
        fill = n.kwargs.get("fill_value", n.args[2] if n.target is aten.new_full.default else n.args[1])
    if isinstance(fill, torch.fx.Node):
        return None
    return torch.full(tuple(meta.shape), fill, dtype=meta.dtype)


def fold(ep) -> dict:
    """``{fx node: value}`` for every node of ``ep`` computable from constants alone.

    Buffers and lifted tensor constants are the leaves (their placeholders are in the
    result); a node whose evaluation raises is simply not folded (the lowering then
    reports it).
    """
    sig = ep.graph_signature
    leaves = {**{k: ep.state_dict.get(v, ep.constants.get(v)) for k, v in sig.inputs_to_buffers.items()},
              **{k: ep.constants.get(v) for k, v in sig.inputs_to_lifted_tensor_constants.items()}}
    vals = {}
    for n in ep.graph.nodes:
        if n.op == "placeholder" and leaves.get(n.name) is not None:
            vals[n] = leaves[n.name]
        elif n.op == "call_function" and n.target in ALLOCATIONS:
            if (v := _allocated(n)) is not None:
                vals[n] = v
        elif _foldable(n, vals):
            args, kwargs = map_arg((n.args, n.kwargs), lambda x: vals[x])
            try:
                with torch.no_grad():
                    vals[n] = n.target(*args, **kwargs)
            except Exception:  # noqa: BLE001 - best effort: the op is lowered instead
                continue
    return vals


def materialized(ep, vals: dict) -> list:
    """The folded call_function nodes (and lifted-constant placeholders) that a computed
    node or the output uses: those become ``param`` nodes.  Buffers used directly keep
    their own ``param`` (they are not copied)."""
    buffers = ep.graph_signature.inputs_to_buffers  # built anew on each access: read once
    out = []
    for n in ep.graph.nodes:
        if n not in vals or (n.op == "placeholder" and n.name in buffers):
            continue
        if isinstance(vals[n], torch.Tensor) and any(u not in vals for u in n.users):
            out.append(n)
    return out


# ops that only reshape, convert or copy their one tensor operand (or, with one tensor
# operand, add a number to it or scale it): a folded value is named after the op below
# them (RoPE's ``(cos * scaling).to(dtype).unsqueeze(1)`` after ``cos``)
_VIEWS = {"unsqueeze", "squeeze", "view", "reshape", "_unsafe_view", "expand", "to", "_to_copy",
          "alias", "clone", "contiguous", "detach", "type_as", "permute", "transpose", "t",
          "mul", "div", "add", "sub"}


def defining(n):
    """The fx node a folded value is named after: ``n`` past the view-like ops (and
    arithmetic with a Python number: RoPE's ``cos * attention_scaling``, GPT-2's
    ``arange(seq) + past_length``) above it."""
    while n.op == "call_function" and str(n.target).split(".")[1:2] in [[v] for v in _VIEWS]:
        srcs = list(dict.fromkeys(_inputs(n)))
        if len(srcs) != 1 or srcs[0].op != "call_function":
            break
        n = srcs[0]
    return n


def same_value(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal dtype, shape and elements (NaN equal to NaN): one param serves both."""
    return x.dtype == y.dtype and x.shape == y.shape and bool(torch.equal(x, y) or (
        x.dtype.is_floating_point and ((x == y) | (x.isnan() & y.isnan())).all()))


def _mask_kind(mask: torch.Tensor, q_len: int, k_len: int) -> str | None:
    """``"causal"`` when ``mask`` (broadcast over batch and heads) is torch's ``is_causal``
    mask, ``tril(ones(q_len, k_len))`` as bool or 0 there and -inf (or the dtype's lowest
    value) elsewhere; ``"none"`` when it keeps everything (all true, or all 0); else None."""
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != (q_len, k_len):
        return None
    if mask.dtype == torch.bool:
        keep = mask
    elif mask.dtype.is_floating_point and bool(((mask == 0) | (mask <= torch.finfo(mask.dtype).min)).all()):
        keep = mask == 0
    else:
        return None
    if bool(keep.all()):
        return "none"
    causal = torch.ones(q_len, k_len, dtype=torch.bool).tril()
    return "causal" if bool((keep == causal).all()) else None


def causal_attention(ep, vals: dict, bind) -> int:
    """Drop the mask of each ``scaled_dot_product_attention`` of ``ep`` whose mask folds to
    the causal mask (then ``is_causal=True``) or to a mask that keeps everything;
    ``bind(fx)`` gives the node's arguments by schema name.  Returns how many changed."""
    count = 0
    for n in ep.graph.nodes:
        if n.op != "call_function" or n.target is not aten.scaled_dot_product_attention.default:
            continue
        a = bind(n)
        mask = a["attn_mask"]
        if a["is_causal"] or not isinstance(mask, torch.fx.Node) or mask not in vals:
            continue
        q_len, k_len = a["query"].meta["val"].shape[-2], a["key"].meta["val"].shape[-2]
        kind = (_mask_kind(vals[mask], int(q_len), int(k_len))
                if isinstance(vals[mask], torch.Tensor) else None)
        if kind is not None:
            a.update(attn_mask=None, is_causal=kind == "causal")
            n.args = (a.pop("query"), a.pop("key"), a.pop("value"))
            n.kwargs = a
            count += 1
    return count
