"""Fused weights split per part (attention part).

GPT-2's ``c_attn`` is one Conv1D weight ``[in, 3*out]`` whose output is split into q, k
and v; Llama-style MLPs may fuse gate|up into one Linear ``[2*out, in]``. Megatron's
``colwise`` on such a weight splits *each part* by its output features (each rank holds
its heads of q, of k and of v), which is no contiguous block of the stored tensor. So the
frontend gives the weight the shape of its parts: when a matmul weight's output (after an
optional bias and reshapes that keep the feature dim) is used only by slices that cut the
features into k >= 2 equal parts, the param becomes a *view* of the stored tensor,

- Conv1D ``[in, k*out]`` -> ``[in, k, out]``; Linear ``[k*out, in]`` -> ``[k, out, in]``;
  a bias ``[k*out]`` -> ``[k, out]``,

carrying ``stored_shape`` (the checkpoint's shape; program.py and the interpreter reshape
the stored tensor on load, a free view), and the one matmul becomes k matmuls, one per
part (``slice`` of the view on the parts dim, ``reshape``, ``matmul``, bias ``add``, the
reshapes replayed at the part's width). Each part then names the value the model's
slice named, so the rest of the graph is unchanged. ``colwise`` on the view splits the
per-part feature dim and ``rowwise`` the input dim (:func:`fused_split_dim`), and an
unnamed fused bias of the same module follows a colwise weight (:func:`fused_bias_follows`).
Updated values and gradients of such a param keep the view's shape
(:func:`to_view_shapes` reshapes torch's for comparison).
"""
from __future__ import annotations

import re
from dataclasses import replace

import numpy as np

from ..ir.graph import Graph, Node, make_attrs
from ..ir.names import NameGen
from ..ir.types import R, Shard, TensorType


def _equal_parts(graph, users, value):
    """k when every user of ``value`` is a step-1 slice of its last dim into k >= 2 equal
    parts covering it (the slices in part order), else None."""
    ty = graph[value].type
    us = [graph[u] for u in users[value]]
    if len(us) < 2 or not ty.rank or any(u.op != "slice" for u in us):
        return None
    last, width = ty.rank - 1, ty.shape[-1]
    cuts = sorted((u.attr("start"), u.attr("stop"), u.name) for u in us
                  if u.attr("dim") == last and u.attr("step", 1) == 1)
    k = len(cuts)
    if k != len(us) or width % k or cuts != [(i * width // k, (i + 1) * width // k, c[2])
                                            for i, c in enumerate(cuts)]:
        return None
    return [c[2] for c in cuts]


def _single(users, name):
    return len(users[name]) == 1


def _match(graph, users, value):
    """The fused pattern ending at ``value``: dict(x, w, wt (permute or None), bias, chain
    (reshapes, outermost last), mm, add), or None."""
    chain, cur = [], value
    while graph[cur].op == "reshape" and graph[cur].type.shape[-1:] == graph[graph[cur].inputs[0]].type.shape[-1:]:
        chain.append(graph[cur])
        cur = graph[cur].inputs[0]
        if not _single(users, cur):
            return None
    add = bias = None
    if graph[cur].op == "add":
        add = graph[cur]
        mm_name, bias = (add.inputs if graph[add.inputs[0]].op == "matmul" else add.inputs[::-1])
        if graph[bias].op != "param" or graph[bias].type.rank != 1 or not _single(users, bias):
            return None
        cur = mm_name
        if not _single(users, cur):
            return None
    mm = graph[cur]
    if mm.op != "matmul" or graph[mm.inputs[1]].type.rank != 2:
        return None
    w, wt = mm.inputs[1], None
    if graph[w].op == "permute" and graph[w].attr("perm") == (1, 0) and _single(users, w):
        wt, w = graph[w], graph[w].inputs[0]
    if graph[w].op != "param" or not _single(users, w) or graph[w].attr("stored_shape"):
        return None
    return {"x": mm.inputs[0], "w": w, "wt": wt, "bias": bias, "chain": chain[::-1], "mm": mm, "add": add}


def _view(node, shape):
    return replace(node, type=TensorType(tuple(shape), node.type.dtype)).with_attrs(
        stored_shape=tuple(node.type.shape))


def _parts(graph, m, slices, names):
    """New nodes computing each part: ``{mm name: [nodes]}`` and the views of w and bias."""
    k, w = len(slices), graph[m["w"]]
    linear = m["wt"] is not None
    a, bdim = w.type.shape
    s = (a if linear else bdim) // k
    wv = _view(w, (k, s, bdim) if linear else (a, k, s))
    bv = _view(graph[m["bias"]], (k, s)) if m["bias"] else None
    dt, out = w.type.dtype, []
    for i, final in enumerate(slices):
        src = m["mm"].source

        def node(op, ins, shape, base, **attrs):
            name = final if base is None else names.fresh(f"{m['mm'].name}_{base}{i}")
            out.append(Node(name, op, tuple(ins), TensorType(tuple(shape), dt), make_attrs(**attrs), source=src))
            return name
        part = node("slice", [w.name], (1, s, bdim) if linear else (a, 1, s), "w_part",
                    dim=0 if linear else 1, start=i, stop=i + 1, step=1)
        wi = node("reshape", [part], (s, bdim) if linear else (a, s), "w")
        if linear:
            wi = node("permute", [wi], (bdim, s), "wt", perm=(1, 0))
        steps = [("matmul", graph[m["x"]].type.shape[:-1] + (s,))]
        steps += [("add", None)] if bv else []
        steps += [("reshape", r.type.shape[:-1] + (s,)) for r in m["chain"]]
        cur = wi
        for j, (op, shape) in enumerate(steps):
            base = None if j == len(steps) - 1 else f"{op}_part"
            if op == "matmul":
                cur = node("matmul", [m["x"], wi], shape, base)
                shape_mm = shape
            elif op == "add":
                bp = node("slice", [bv.name], (1, s), "bias_part", dim=0, start=i, stop=i + 1, step=1)
                bi = node("reshape", [bp], (s,), "bias")
                cur = node("add", [cur, bi], shape_mm, base)
            else:
                cur = node("reshape", [cur], shape, base)
    return out, wv, bv


def split_fused_weights(graph: Graph) -> Graph:
    """Rewrite every fused weight of ``graph`` (see the module docstring); others unchanged.
    One pass: the patterns of different weights share no node."""
    users = graph.users()
    names = NameGen(n.name for n in graph.nodes)
    at, views, gone = {}, {}, set()  # mm name -> part nodes; param name -> view; nodes dropped
    for n in graph.nodes:
        slices = _equal_parts(graph, users, n.name)
        m = _match(graph, users, n.name) if slices else None
        if m is None:
            continue
        at[m["mm"].name], wv, bv = _parts(graph, m, slices, names)
        views.update({v.name: v for v in (wv, bv) if v is not None})
        gone |= {m["mm"].name, *slices, *(r.name for r in m["chain"])}
        gone |= {x.name for x in (m["add"], m["wt"]) if x is not None}
    if not at:
        return graph
    nodes = []
    for x in graph.nodes:
        if x.name in at:
            nodes += at[x.name]
        elif x.name not in gone:
            nodes.append(views.get(x.name, x))
    return graph.with_nodes(nodes)


def fused_split_dim(node, word: str) -> int:
    """The dim of a fused view param ``node`` that ``colwise``/``rowwise`` splits: the
    per-part features (after the parts dim) or the input features (the other dim)."""
    stored, view = node.attr("stored_shape"), node.type.shape
    p = next(d for d in range(len(view)) if d >= len(stored) or view[d] != stored[d])
    return p + 1 if word == "colwise" else ({0, 1, 2} - {p, p + 1}).pop()


def fused_bias_follows(graph, layouts, bound_by):
    """An unnamed fused bias ``m.bias`` [k, out] follows a colwise fused ``m.weight``."""
    for b in graph.params:
        if not b.attr("stored_shape") or b.type.rank != 2 or bound_by.get(b.name) is not None:
            continue
        w = b.name.rsplit(".", 1)[0] + ".weight"
        rule = bound_by.get(w)
        if rule is None or rule.layout.word != "colwise" or not graph[w].attr("stored_shape"):
            continue
        dim = fused_split_dim(graph[w], "colwise")
        layouts[b.name] = tuple(Shard(1) if p == Shard(dim) else R for p in layouts[w])
        bound_by[b.name] = rule


def to_view_shapes(values: dict, graph) -> dict:
    """``values`` keyed by param names (and ``name.grad``, ``name.exp_avg``, ...) with each
    fused view param's entries in the stored shape reshaped to the view."""
    views = {n.name: n for n in graph.params if n.attr("stored_shape")}
    out = dict(values)
    for key, v in values.items():
        base = next((p for p in views if key == p or key.startswith(p + ".")), None)
        if base is not None and tuple(np.shape(v)) == tuple(views[base].attr("stored_shape")):
            out[key] = to_shape(np.asarray(v), views[base].type.shape)  # a padded vocab: pad
    return out


def to_stored_shapes(values: dict, graph, derived: bool = True) -> dict:
    """The inverse of :func:`to_view_shapes`: each fused view param's entry in the view shape
    reshaped to the stored (checkpoint) shape, and with ``derived`` its ``name.exp_avg``, ...
    too: torch.optim holds those in the param's shape (torch starts), program.py's loader
    reads them per part (``--replay`` states: ``derived=False``)."""
    views = {n.name: n for n in graph.params if n.attr("stored_shape")}
    out = dict(values)
    for key, v in values.items():
        base = next((p for p in views if key == p or (derived and key.startswith(p + "."))), None)
        if base is not None and tuple(np.shape(v)) == tuple(views[base].type.shape):
            out[key] = _stored(np.asarray(v), views[base].attr("stored_shape"))
    return out


def _stored(x, shape):
    """A view's value in the stored shape: reshaped, or (a padded vocab table) trimmed."""
    if x.size == int(np.prod(shape)):
        return x.reshape(shape)
    return x[tuple(slice(0, n) for n in shape)]


def to_shape(x, shape):  # noqa: D103 - see parcomp.reference.numpy_attn.to_shape
    from ..reference.numpy_attn import to_shape as pad_or_reshape
    return pad_or_reshape(x, shape)


_INDEX = re.compile(r"\[(\d+(?:, ?\d+)*)\]")


def in_stored_indices(result, graph):
    """``result`` (a check/run result: nested dicts and lists) with the ``worst``, ``why``
    and ``note`` texts' indices into a fused view param (``qkv.weight[0,0,0]`` of the view
    [3, 32, 32]) given in the stored shape the user knows (``qkv.weight[0,0]`` of [96, 32]):
    ``NAME[i,j,k]`` and, in a ``NAME: reason`` clause (up to ``;``), each index of the
    view's rank. Names with suffixes (``.grad``, ``.exp_avg``) count: they have the view's
    shape. A graph without fused views returns ``result`` unchanged."""
    views = {n.name: (n.type.shape, n.attr("stored_shape")) for n in graph.params
             if n.attr("stored_shape") and int(np.prod(n.type.shape)) == int(np.prod(n.attr("stored_shape")))}
    if not views:
        return result
    names = "|".join(re.escape(v) for v in sorted(views, key=len, reverse=True))
    clause = re.compile(rf"(?<![\w.])({names})((?:\.[A-Za-z_]\w*)*)(\[[\d, ]+\]|: [^;]*)")

    def index(view, stored, m):
        idx = tuple(int(i) for i in m.group(1).split(","))
        if len(idx) != len(view) or any(i >= n for i, n in zip(idx, view)):
            return m.group(0)
        new = np.unravel_index(np.ravel_multi_index(idx, view), stored)
        return "[" + (", " if " " in m.group(1) else ",").join(str(int(i)) for i in new) + "]"

    def clauses(m):
        view, stored = views[m.group(1)]
        return m.group(1) + m.group(2) + _INDEX.sub(lambda i: index(view, stored, i), m.group(3))

    def walk(x, key=None):
        if isinstance(x, dict):
            return {k: walk(v, k) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v, key) for v in x]
        return clause.sub(clauses, x) if isinstance(x, str) and key in ("worst", "why", "note") else x

    return walk(result)
