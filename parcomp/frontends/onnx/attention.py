"""Attention as ONNX exporters write it, found and lowered to parcomp's ``sdpa``.

Before opset 23 ONNX has no attention op; torch.onnx (dynamo) writes
``scaled_dot_product_attention`` out as

    P = Softmax(MatMul(q * s1, kT * s2) [+ mask], axis=-1)
    P = Where(IsNaN(P), 0, P)                    # optional: fully masked rows give 0
    P = Identity(Cast(P, float32))               # optional: eager attention's cast, dropout (eval)
    out = MatMul(P, v)

with ``kT`` the key transposed on its last two dims (``Transpose``, or ``Reshape ->
Transpose(0, 2, 1) -> Reshape`` through ``[batch*heads, seq, dim]``), the scale split
as ``sqrt(scale)`` on both sides (or one ``Mul``/``Div`` after the first ``MatMul``, as
eager attention writes it), and ``mask`` an additive constant (0 where kept, -inf
elsewhere) built from the shapes.  :func:`rewrite_attention` replaces the root
``MatMul`` of such a formula by one internal node (:data:`OP`, inputs ``q, k or kT, v,
mask``); its lowering (:func:`lower_attention`) requires the mask to fold to a constant
that is causal (``sdpa{causal=true}``) or keeps everything (no mask), as the torch.export
frontend does for transformers' masks.  Any other mask (padding) is a located error.
The nodes only the formula used are dropped by the importer's dead-code pass.
"""
from __future__ import annotations

import numpy as np

from .patterns import ONode, factors

#: the internal op type of a recognised attention (not an ONNX op; never in a file)
OP = "parcomp.Attention"


def _key(kt: str, prod: dict, types: dict):
    """``(k, transposed)``: the key before its last-two-dims transpose when ``kt`` is one
    (``(k, False)``), else ``(kt, True)`` (the lowering transposes it)."""
    n = prod.get(kt)
    if n is None:
        return kt, True
    if n.op == "Transpose":
        perm = tuple(n.attrs.get("perm", ()))
        r = len(perm)
        if r >= 2 and perm == tuple(range(r - 2)) + (r - 1, r - 2):
            return n.inputs[0], False
    if n.op == "Reshape":
        t = prod.get(n.inputs[0])
        r1 = prod.get(t.inputs[0]) if t is not None and t.op == "Transpose" else None
        if r1 is not None and r1.op == "Reshape" and tuple(t.attrs.get("perm", ())) == (0, 2, 1):
            k, out = types.get(r1.inputs[0]), types.get(kt)
            mid = types.get(r1.outputs[0])
            if k is not None and out is not None and mid is not None and mid.rank == 3 and \
                    mid.shape[1:] == k.shape[-2:] and out.shape == k.shape[:-2] + k.shape[-2:][::-1]:
                return r1.inputs[0], False
    return kt, True


def _probs(p: str, prod: dict, scalar):
    """The Softmax node behind ``p`` (through the NaN guard, ``Identity``: eval-mode
    dropout, and a ``Cast`` to float32: transformers' ``softmax(..., dtype=float32).to(q)``),
    or None."""
    n = prod.get(p)
    while n is not None and (n.op == "Identity" or (n.op == "Cast" and n.attrs.get("to") == 1)):
        n = prod.get(n.inputs[0])
    if n is not None and n.op == "Where" and len(n.inputs) == 3:
        c = prod.get(n.inputs[0])
        if c is not None and c.op == "IsNaN" and c.inputs[0] == n.inputs[2] and scalar(n.inputs[1]) == 0.0:
            n = prod.get(n.inputs[2])
    return n if n is not None and n.op == "Softmax" else None


def _scores(x: str, prod: dict, scalar):
    """``(scale, q, kT, mask)`` when ``x`` is ``c * MatMul(c1 q, c2 kT) [+ mask]``, else None."""
    n, mask = prod.get(x), ""
    if n is not None and n.op == "Add" and len(n.inputs) == 2:
        for a, m in (n.inputs, n.inputs[::-1]):
            c, fs = factors(a, prod, scalar)
            if len(fs) == 1 and prod.get(fs[0]) is not None and prod[fs[0]].op == "MatMul":
                x, mask = a, m
                break
    c, fs = factors(x, prod, scalar)
    mm = prod.get(fs[0]) if len(fs) == 1 else None
    if mm is None or mm.op != "MatMul":
        return None
    (cq, fq), (ck, fk) = ((c, f) if len(f) == 1 else (1.0, [i])  # a product of values: itself
                          for i, (c, f) in zip(mm.inputs, (factors(i, prod, scalar) for i in mm.inputs)))
    return c * cq * ck, fq[0], fk[0], mask


def attention_of(n: ONode, prod: dict, scalar, types: dict):
    """The replacement :data:`OP` node when ``n`` is the root ``MatMul`` of attention, else None."""
    if n.op != "MatMul" or len(n.inputs) != 2:
        return None
    sm = _probs(n.inputs[0], prod, scalar)
    if sm is None or int(sm.attrs.get("axis", -1)) not in (-1, 3):
        return None
    found = _scores(sm.inputs[0], prod, scalar)
    q_ty = types.get(found[1]) if found else None
    if found is None or q_ty is None or q_ty.rank != 4:
        return None
    scale, q, kt, mask = found
    k, transpose = _key(kt, prod, types)
    return ONode(OP, n.name, (q, k, n.inputs[1], mask), n.outputs,
                 {"scale": float(scale), "transpose_k": int(transpose)}, "", n.scope)


def rewrite_attention(nodes: list, scalar, types: dict) -> list:
    """``nodes`` with the root of every attention formula replaced by an :data:`OP` node
    (same output, name and module); see the module docstring."""
    prod = {o: n for n in nodes for o in n.outputs}
    out = []
    for n in nodes:
        a = attention_of(n, prod, scalar, types)
        if a is not None:
            prod[n.outputs[0]] = n = a
        out.append(n)
    return out


def _causal(b, mask: np.ndarray, shape: tuple) -> bool:
    """Whether the constant additive ``mask`` is causal (True) or keeps everything (False)."""
    m = np.asarray(mask)
    if m.dtype == np.bool_:
        keep, bias = m, None
    else:
        keep = m > np.finfo(m.dtype).min / 2 if m.dtype.kind == "f" else None
        bias = m
    if keep is None or (bias is not None and np.any(bias[keep] != 0)):
        raise b.fail("attention's mask is a float bias, not 0 / -inf: only a causal mask (or none) "
                     "is supported; nearest supported op: sdpa{causal=true}")
    try:
        keep = np.broadcast_to(keep, shape)
    except ValueError:
        raise b.fail(f"attention's mask {list(m.shape)} does not broadcast to the scores {list(shape)}") from None
    if keep.all():
        return False
    if np.array_equal(keep, np.broadcast_to(np.tril(np.ones(shape[-2:], bool)), shape)):
        return True
    raise b.fail("attention's mask is neither causal nor all kept (padding or packed sequences?): not "
                 "supported; nearest supported op: sdpa{causal=true}")


def lower_attention(b, n):
    """``sdpa(q, k, v) {causal, scale}`` for an :data:`OP` node (see the module docstring)."""
    q, k, v = (b.value(i) for i in n.inputs[:3])
    if n.attrs["transpose_k"]:
        r = b.type(k).rank
        k = b.emit("permute", [k], "_k", perm=tuple(range(r - 2)) + (r - 1, r - 2))
    tq, tk = b.type(q), b.type(k)
    if tk.rank != 4 or tq.shape[:2] != tk.shape[:2]:
        raise b.fail(f"attention on q {tq} and k {tk}: parcomp's sdpa takes [batch, heads, seq, "
                     f"head_dim] operands with equal heads")
    causal = False
    if n.inputs[3]:
        mask = b.static(n.inputs[3])
        if mask is None and n.inputs[3] in b.inits:  # a mask stored as an initializer
            from onnx import numpy_helper

            mask = numpy_helper.to_array(b.inits[n.inputs[3]], b.base)
        if mask is None:
            raise b.fail(f"attention's mask {n.inputs[3]!r} is computed at run time (a padding mask "
                         f"input?): only a causal mask, fixed by the shapes, is supported")
        causal = _causal(b, mask, tq.shape[:3] + (tk.shape[2],))
    return [b.emit("sdpa", [q, k, v], causal=causal, scale=n.attrs["scale"])]
