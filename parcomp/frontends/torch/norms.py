"""aten lowerings of the norms + embedding part, joined to
:data:`parcomp.frontends.torch.export.TABLE`, and the fx patterns lowered as one op.

- ``aten.layer_norm`` / ``aten.native_layer_norm`` (its ``[0]``) -> ``layer_norm``;
  ``aten.rms_norm`` -> ``rms_norm``; both over the last dim only.
- transformers' ``LlamaRMSNorm`` as torch.export writes it,
  ``w * to(x * rsqrt(mean(pow(x, 2), [-1], keepdim) + eps))`` (the ``to`` casts to the
  same dtype; the ``w *`` is optional) -> ``rms_norm(x[, w])`` (:func:`fused_patterns`).
- ``aten.dropout`` / ``aten.native_dropout`` (its ``[0]``): in training mode with p > 0 a
  ``dropout`` whose seed is the site's number in the model (0, 1, ...): its mask is
  parcomp's (a hash of the seed and the global element index, the same on every sharding),
  not torch's generator's; otherwise the identity.
- ``aten.embedding(weight, indices, padding_idx)`` -> ``embedding(ids, table)``, with
  ``{padding_idx}`` when torch's is set (that row gets no gradient from the lookup).
"""
from __future__ import annotations

import operator

import torch

from parcomp.ir.graph import Node, make_attrs

aten = torch.ops.aten


def _norm_dims(b, x: str, normalized_shape):
    last = b.types[x].shape[-1:] if b.types[x].rank else ()
    if tuple(int(s) for s in normalized_shape) != tuple(last):
        raise b.fail(f"normalized_shape {list(normalized_shape)} of {b.types[x]}: parcomp normalises "
                     f"over the last dim only ([{last[0] if last else ''}])")


def _layer_norm(b, n, a):
    x = b.val(a["input"])
    _norm_dims(b, x, a["normalized_shape"])
    if a["weight"] is None and a["bias"] is not None:
        raise b.fail("layer_norm with a bias but no weight is not supported")
    ins = [x] + [b.val(a[k]) for k in ("weight", "bias") if a[k] is not None]
    return b.emit("layer_norm", ins, eps=float(a["eps"]))


def _rms_norm(b, n, a):
    x = b.val(a["input"])
    _norm_dims(b, x, a["normalized_shape"])
    eps = a["eps"]
    if eps is None:  # torch's default: the dtype's machine epsilon
        eps = float(torch.finfo(n.meta["val"].dtype).eps)
    ins = [x] + ([b.val(a["weight"])] if a["weight"] is not None else [])
    return b.emit("rms_norm", ins, eps=float(eps))


def _dropout(b, n, a):
    x = b.val(a["input"])
    p, train = float(a["p"]), a["train"]
    if not train or p == 0:
        return x
    if not 0 <= p <= 1:
        raise b.fail(f"dropout probability p={p} is outside [0, 1]")
    seed = b.dropout_sites  # this site's number: dropout nodes emitted before it
    b.dropout_sites += 1
    return b.emit("dropout", [x], p=p, seed=seed)


def _embedding(b, n, a):
    if a["scale_grad_by_freq"] or a["sparse"]:
        raise b.fail("embedding with scale_grad_by_freq or sparse gradients is not supported")
    pad = int(a["padding_idx"]) if a["padding_idx"] is not None else -1
    # aten's padding_idx is already non-negative (nn.Embedding and F.embedding wrap a negative
    # one); -1 means none
    return b.emit("embedding", [b.val(a["indices"]), b.val(a["weight"])],
                  **({"padding_idx": pad} if pad >= 0 else {}))


NORM_TABLE = {
    aten.layer_norm.default: _layer_norm,
    aten.rms_norm.default: _rms_norm,
    aten.dropout.default: _dropout,
    aten.embedding.default: _embedding,
}


# ---- fx patterns: fx node -> lowering(builder, fx node) ------------------------------

def _is(fx, *targets) -> bool:
    return isinstance(fx, torch.fx.Node) and fx.op == "call_function" and fx.target in targets


def _same_dtype_to(fx) -> bool:
    """A ``to`` that keeps the dtype (an identity)."""
    if not _is(fx, aten.to.dtype, aten._to_copy.default):
        return False
    src, val = fx.args[0], fx.meta.get("val")
    return (isinstance(src, torch.fx.Node) and isinstance(val, torch.Tensor)
            and src.meta.get("val") is not None and src.meta["val"].dtype == val.dtype)


def _through_to(fx):
    return fx.args[0] if _same_dtype_to(fx) else fx


def _only_user(fx):
    """The one user of ``fx`` that computes (metadata asserts do not count), or None."""
    users = [u for u in fx.users if u.target is not aten._assert_tensor_metadata.default]
    return users[0] if len(users) == 1 else None


def _rms_match(mul):
    """``(x, eps, inner nodes)`` if ``mul`` is ``x * rsqrt(mean(x**2, -1, keepdim) + eps)``."""
    if not _is(mul, aten.mul.Tensor) or len(mul.args) != 2:
        return None
    for xs, r in (mul.args, mul.args[::-1]):
        if not _is(r, aten.rsqrt.default) or not _is(r.args[0], aten.add.Tensor, aten.add.Scalar):
            continue
        add = r.args[0]
        mean, eps = add.args[0], add.args[1] if len(add.args) > 1 else None
        if not _is(mean, aten.mean.dim) or not isinstance(eps, (int, float)):
            continue
        rank = xs.meta["val"].dim() if isinstance(xs, torch.fx.Node) and "val" in xs.meta else 0
        dims = [int(d) % rank for d in mean.args[1]] if rank else None
        keep = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
        pw = mean.args[0]
        if dims != [rank - 1] or not keep or not _is(pw, aten.pow.Tensor_Scalar) or pw.args[1] != 2:
            continue
        if pw.args[0] is not xs or any(_only_user(m) is None for m in (pw, mean, add, r)):
            continue
        return xs, float(eps), (pw, mean, add, r)
    return None


def _skip(b, n, a):
    return None


def _alias(b, n, a):
    return b.val(n.args[0])


def _rms_lowering(xs, eps, weight=None):
    x = _through_to(xs)

    def lower(b, n, a):  # named rms_norm, rms_norm_1, ... as aten.rms_norm's would be
        ins = [b.val(x)] + ([b.val(weight)] if weight is not None else [])
        return b.add(Node(b.fresh("rms_norm"), "rms_norm", tuple(ins), b.types[ins[0]], make_attrs(eps=eps)))
    return lower


def _weight_of(out):
    """The 1-D operand of the ``w * y`` that is ``out``'s only use (through a same-dtype
    ``to``), as ``(to node or None, mul node, w)``, or None."""
    nxt = _only_user(out)
    to = nxt if nxt is not None and _same_dtype_to(nxt) else None
    mul = _only_user(to) if to is not None else nxt
    if mul is None or not _is(mul, aten.mul.Tensor) or len(mul.args) != 2:
        return None
    last = out.meta["val"].shape[-1:]
    y = to if to is not None else out
    w = mul.args[1] if mul.args[0] is y else mul.args[0]
    ok = isinstance(w, torch.fx.Node) and w is not y and tuple(w.meta["val"].shape) == tuple(last)
    return (to, mul, w) if ok and w.meta["val"].dtype == out.meta["val"].dtype else None


def _tuple_lowering(op_fn):
    """A tuple-valued op (native_layer_norm, native_dropout): element 0 is the op's value."""
    return lambda b, n, a: (op_fn(b, n, a),)


def _getitem(b, n, a):
    src, idx = n.args
    vals = b.env.get(src)
    if idx != 0 and not n.users:
        return None  # an unused statistic: nothing to lower
    if idx != 0 or not isinstance(vals, tuple):
        raise b.fail(f"output {idx} of {src.target} (mean/rstd/mask) is not supported; only its value")
    return vals[0]


def _native_layer_norm(b, n, a):
    return _layer_norm(b, n, a)


def _native_dropout(b, n, a):
    return _dropout(b, n, {"input": a["input"], "p": a["p"], "train": a["train"]})


def fused_patterns(fx_nodes) -> dict:
    """fx node -> lowering ``(builder, fx node, args bound by schema name or {})`` for the
    patterns lowered as one op (module docstring): the inner nodes lower to nothing, the
    last to the op; tuple-valued ops and their ``[0]``."""
    out = {}
    for n in fx_nodes:
        if _is(n, aten.native_layer_norm.default, aten.native_dropout.default):
            fn = _native_layer_norm if n.target is aten.native_layer_norm.default else _native_dropout
            out[n] = _tuple_lowering(fn)
            for u in n.users:
                if u.op == "call_function" and u.target is operator.getitem:
                    out[u] = _getitem
        found = _rms_match(n)
        if found is None:
            continue
        xs, eps, inner = found
        out.update({m: _skip for m in inner})
        if _same_dtype_to(xs):
            out[xs] = _alias
        folded = _weight_of(n)
        if folded is None:
            out[n] = _rms_lowering(xs, eps)
            continue
        to, mul, w = folded
        out[n] = _skip
        if to is not None:
            out[to] = _skip
        out[mul] = _rms_lowering(xs, eps, w)
    return out
