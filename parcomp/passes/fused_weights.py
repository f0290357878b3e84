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

Grouped-query q|k|v in one weight (Phi-3's ``qkv_proj``: parts of unequal width, fewer kv
heads than query heads; :func:`_grouped`) is viewed per kv group instead: R + 2 parts of G
heads each, its stored head units reordered (``stored_order``) so that ``colwise`` gives each
rank whole groups (:func:`_grouped_parts`).

Multi-query q|k|v in one weight (Falcon's ``query_key_value`` [(H+2)*hd, in]: H query heads
and one key and one value head, cut by a reshape to heads and slices of the heads dim) cannot
be viewed: Megatron splits the query rows per head and keeps the kv rows replicated, two
layouts, and a view is one param with one layout. So the weight becomes two *part params*
(:func:`_multi_query_parts`): the query rows keep the weight's name, the kv rows take
``NAME_kv``; each carries ``part_of`` (the stored tensor's name), ``part_rows`` (its rows of
it, [start, stop)) and ``part_of_shape`` (the stored shape). Every loader slices its rows
from the stored tensor (:func:`stored_to_parts`) and every writer joins them back
(:func:`parts_to_stored`), so checkpoints, torch and the user keep the fused weight.
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


def _view(node, shape, order=None):
    attrs = {"stored_shape": tuple(node.type.shape)}
    if order:
        attrs["stored_order"] = tuple(order)
    return replace(node, type=TensorType(tuple(shape), node.type.dtype)).with_attrs(**attrs)


def _parts(graph, m, slices, names, order=None):
    """New nodes computing each part: ``[nodes]`` and the views of w and bias. ``slices``:
    the name each part's value takes; ``order``: the view's ``stored_order``
    (:func:`_grouped_parts`)."""
    k, w = len(slices), graph[m["w"]]
    linear = m["wt"] is not None
    a, bdim = w.type.shape
    s = (a if linear else bdim) // k
    wv = _view(w, (k, s, bdim) if linear else (a, k, s), order)
    bv = _view(graph[m["bias"]], (k, s), order) if m["bias"] else None
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


def _grouped(graph, users, value):
    """Grouped-query q|k|v fused in one weight (Phi-3's ``qkv_proj``: 4 query heads | 2 key
    heads | 2 value heads of one head dim): every user of ``value`` a step-1 slice of its
    last dim into three parts q | k | v covering it, k and v of equal width split into
    G >= 2 heads by a reshape, q into H = R * G heads of the same dim. Returns
    ``(q, k, v slice names, G, R, head dim)`` or None.

    Equal parts (G = H) are :func:`_equal_parts`'s. With one kv head (multi-query) no split
    per head exists: the kv part is shared by every query head, so there is nothing to view."""
    ty = graph[value].type
    us = [graph[u] for u in users[value]]
    if len(us) != 3 or not ty.rank or any(u.op != "slice" or u.attr("step", 1) != 1
                                          or u.attr("dim") != ty.rank - 1 for u in us):
        return None
    cuts = sorted((u.attr("start"), u.attr("stop"), u.name) for u in us)
    (q0, q1, q), (k0, k1, k), (v0, v1, v) = cuts
    if q0 != 0 or q1 != k0 or k1 != v0 or v1 != ty.shape[-1] or k1 - k0 != v1 - v0 or q1 <= k1 - k0:
        return None
    heads = [_heads(graph, users, x) for x in (q, k, v)]
    if any(h is None for h in heads) or len({h[1] for h in heads}) != 1:
        return None
    (hq, hd), (g, _), (gv, _) = heads
    if g != gv or g < 2 or hq % g or hq * hd != q1 or g * hd != k1 - k0:
        return None
    return (q, k, v), g, hq // g, hd


def _heads(graph, users, name):
    """``(heads, head dim)`` of the one reshape ``[.., F] -> [.., heads, head dim]`` that
    uses ``name``, else None."""
    us = [graph[u] for u in users[name]]
    src = graph[name].type
    if len(us) != 1 or us[0].op != "reshape" or us[0].type.shape[:src.rank - 1] != src.shape[:-1] \
            or us[0].type.rank != src.rank + 1:
        return None
    return us[0].type.shape[-2], us[0].type.shape[-1]


def _grouped_parts(graph, m, grouped, names):
    """The nodes of a grouped q|k|v (:func:`_grouped`) split per part and per group, as
    Megatron lays out its fused ``linear_qkv``: the view has R + 2 parts (the R query heads of
    each kv group, the key, the value), each of G heads (one per group), so ``colwise`` (the
    per-part dim) gives each rank whole groups: its query heads with the key and value heads
    they read. No reshape of the stored rows q | k | v gives those parts, so the view
    reorders the stored head units (``stored_order``: unit ``g*R + j`` of q is part j's head
    g; the key's and value's heads follow in order); every loader applies it. The queries
    are put back in the model's head order (``h = g*R + j``) by a cat of the R query parts
    over a new dim and a reshape, so the graph after them is unchanged."""
    (q, k, v), g, r, hd = grouped
    order = [gi * r + j for j in range(r) for gi in range(g)]
    order += [r * g + gi for gi in range(g)] + [r * g + g + gi for gi in range(g)]
    qparts = [names.fresh(f"{m['mm'].name}_q{j}") for j in range(r)]
    out, wv, bv = _parts(graph, m, qparts + [k, v], names, order)
    qty = graph[q].type
    lead, dt, src = qty.shape[:-1], qty.dtype, m["mm"].source
    grown = []
    for qp in qparts:
        name = names.fresh(f"{qp}_heads")
        grown.append(Node(name, "reshape", (qp,), TensorType(lead + (g, 1, hd), dt), make_attrs(), source=src))
    cat = Node(names.fresh(f"{m['mm'].name}_q_heads"), "cat", tuple(n.name for n in grown),
               TensorType(lead + (g, r, hd), dt), make_attrs(dim=len(lead) + 1), source=src)
    qn = Node(q, "reshape", (cat.name,), qty, make_attrs(), source=src)
    return out + grown + [cat, qn], wv, bv


def _multi_query(graph, users, value):
    """Multi-query q|k|v fused in one Linear weight, cut by step-1 slices into the query
    features ``[0:Q]`` and fewer kv features after them (``[Q:F]``, in pieces: key, value)
    either of the matmul product itself (bias optional; Phi-3's ``qkv_proj`` with one kv head:
    each piece then reshaped to heads of one head dim, so MLA's latent | rotary key cut of
    ``kv_a_proj_with_mqa`` is none) or, as Falcon's ``query_key_value``, of its reshape ``[.., F] -> [.., N, hd]`` to heads
    (the slices then cut the heads dim). Returns ``(match, Q, F, unit, q slice, kv slices)``
    with ``unit`` the rows one sliced index holds (``hd`` for heads, else 1), or None."""
    node = graph[value]
    unit = 1
    if node.op == "reshape" and node.inputs:  # cut per head
        src, ty = graph[node.inputs[0]].type, node.type
        if ty.rank != src.rank + 1 or ty.shape[:src.rank - 1] != src.shape[:-1] \
                or ty.shape[-2] * ty.shape[-1] != src.shape[-1]:
            return None
        unit, dim, base = ty.shape[-1], ty.rank - 2, node.inputs[0]
    elif node.op in ("matmul", "add") and node.type.rank:
        dim, base = node.type.rank - 1, value
    else:
        return None
    us = [graph[u] for u in users[value]]
    if len(us) < 2 or any(u.op != "slice" or u.attr("dim") != dim or u.attr("step", 1) != 1 for u in us):
        return None
    cuts = sorted((u.attr("start"), u.attr("stop"), u.name) for u in us)
    n = node.type.shape[dim]
    if cuts[0][0] != 0 or cuts[-1][1] != n or any(a[1] != b[0] for a, b in zip(cuts, cuts[1:])):
        return None
    q = cuts[0][1]
    if q < 2 or n - q >= q:
        return None
    if unit == 1:  # features: each piece reshaped to heads of one head dim, fewer kv than query heads
        heads = [_heads(graph, users, c[2]) for c in cuts]
        if any(h is None for h in heads) or len({h[1] for h in heads}) != 1 or heads[0][0] < 2 \
                or sum(h[0] for h in heads[1:]) >= heads[0][0]:
            return None
    m = _match(graph, users, base)
    if m is None or m["wt"] is None or m["chain"] or (base == value and m["add"] is None and node.op == "add"):
        return None
    return m, q, n, unit, cuts[0][2], [graph[c[2]] for c in cuts[1:]]


def kv_part_name(name: str) -> str:
    """The name of the kv rows' part param of multi-query weight ``name`` (the query rows
    keep ``name``)."""
    return f"{name}_kv"


def _part(node, name, rows):
    size = (rows[1] - rows[0],) + tuple(node.type.shape[1:])
    return replace(node, name=name, type=TensorType(size, node.type.dtype)).with_attrs(
        part_of=node.name, part_rows=tuple(rows), part_of_shape=tuple(node.type.shape))


def _multi_query_parts(graph, found, names):
    """The nodes of a multi-query q|k|v (:func:`_multi_query`) as two part params and two
    matmuls: the query rows ``[0, Q*unit)`` (named as the weight) giving the query slice's
    value (reshaped to its heads when the model cut heads), the kv rows ``[Q*unit, F*unit)``
    (``NAME_kv``) giving the kv features (reshaped to the kv heads), which the model's kv
    slices (shifted by Q) cut as before. Returns the nodes replacing the matmul, the kv slices
    and the new params (with their biases)."""
    m, q, n, unit, qslice, kvslices = found
    w, src = graph[m["w"]], m["mm"].source
    lead = graph[m["x"]].type.shape[:-1]
    dt = w.type.dtype
    params, out = [], []
    for part, (a, b) in (("q", (0, q * unit)), ("kv", (q * unit, n * unit))):
        wname = w.name if part == "q" else names.fresh(kv_part_name(w.name))
        params.append(_part(w, wname, (a, b)))
        width = b - a
        last = part == "q" and unit == 1  # the query slice's value itself
        wt = Node(names.fresh(f"{m['mm'].name}_{part}_wt"), "permute", (wname,),
                  TensorType((w.type.shape[1], width), dt), make_attrs(perm=(1, 0)), source=src)
        mm = Node(qslice if last and not m["bias"] else names.fresh(f"{m['mm'].name}_{part}"), "matmul",
                  (m["x"], wt.name), TensorType(lead + (width,), dt), make_attrs(), source=src)
        out += [wt, mm]
        cur = mm.name
        if m["bias"]:
            bias = graph[m["bias"]]
            bname = bias.name if part == "q" else names.fresh(kv_part_name(bias.name))
            params.append(_part(bias, bname, (a, b)))
            add = Node(qslice if last else names.fresh(f"{m['mm'].name}_{part}_bias"), "add", (cur, bname),
                       TensorType(lead + (width,), dt), make_attrs(), source=src)
            out.append(add)
            cur = add.name
        if unit > 1:
            heads = Node(qslice if part == "q" else names.fresh(f"{m['mm'].name}_kv_heads"), "reshape", (cur,),
                         TensorType(lead + (width // unit, unit), dt), make_attrs(), source=src)
            out.append(heads)
            cur = heads.name
    kv = out[-1].name
    moved = {s.name: replace(s, inputs=(kv,)).with_attrs(start=s.attr("start") - q, stop=s.attr("stop") - q)
             for s in kvslices}
    return out, moved, params


def split_fused_weights(graph: Graph) -> Graph:
    """Rewrite every fused weight of ``graph`` (see the module docstring); others unchanged.
    One pass: the patterns of different weights share no node."""
    users = graph.users()
    names = NameGen(n.name for n in graph.nodes)
    at, views, gone = {}, {}, set()  # mm name -> part nodes; param name -> view; nodes dropped
    moved, parts = {}, {}  # kv slices re-pointed; param name -> its part params (multi-query)
    for n in graph.nodes:
        slices = _equal_parts(graph, users, n.name)
        grouped = None if slices else _grouped(graph, users, n.name)
        mq = None if slices or grouped else _multi_query(graph, users, n.name)
        if mq is not None:
            m = mq[0]
            at[m["mm"].name], kv, params = _multi_query_parts(graph, mq, names)
            moved.update(kv)
            for p in params:
                parts.setdefault(p.attr("part_of"), []).append(p)
            gone |= {n.name, mq[4], *(x.name for x in (m["add"], m["wt"]) if x is not None)}
            continue
        m = _match(graph, users, n.name) if slices or grouped else None
        if m is None:
            continue
        if grouped:
            at[m["mm"].name], wv, bv = _grouped_parts(graph, m, grouped, names)
            slices = list(grouped[0])
        else:
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
        elif x.name in parts:
            nodes += parts[x.name]
        elif x.name not in gone:
            nodes.append(moved.get(x.name) or views.get(x.name, x))
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


def part_params(graph) -> dict:
    """``{stored name: [its part params in row order]}`` of ``graph``'s multi-query weights."""
    out = {}
    for n in graph.params:
        if n.attr("part_of"):
            out.setdefault(n.attr("part_of"), []).append(n)
    return {k: sorted(v, key=lambda n: n.attr("part_rows")[0]) for k, v in out.items()}


def _suffixes(values, name, shape, derived=True):
    """The suffixes ``s`` (``""``, ``.grad``, ``.exp_avg``, ...) of the keys ``name + s`` of
    ``values`` whose value has ``shape``."""
    return [k[len(name):] for k, v in values.items()
            if (k == name or (derived and k.startswith(name + "."))) and tuple(np.shape(v)) == tuple(shape)]


def stored_to_parts(values: dict, graph, derived: bool = True) -> dict:
    """``values`` with each multi-query weight's entries in the stored shape (``NAME``,
    ``NAME.grad``, ...) cut into its part params' rows (``NAME`` the query rows, ``NAME_kv``
    the kv rows, same suffix). Values of other names pass unchanged."""
    out = dict(values)
    for stored, parts in part_params(graph).items():
        for suffix in _suffixes(values, stored, parts[0].attr("part_of_shape"), derived):
            whole = values[stored + suffix]
            for p in parts:
                a, b = p.attr("part_rows")
                out[p.name + suffix] = whole[a:b]
    return out


def parts_to_stored(values: dict, graph, derived: bool = True) -> dict:
    """The inverse of :func:`stored_to_parts`: each multi-query weight's part entries joined
    back into the stored tensor's rows (the kv part's keys dropped)."""
    out = dict(values)
    for stored, parts in part_params(graph).items():
        for suffix in _suffixes(values, parts[0].name, parts[0].type.shape, derived):
            keys = [p.name + suffix for p in parts]
            if all(k in values for k in keys):
                rows = [values[k] for k in keys]
                for k in keys:
                    out.pop(k, None)
                out[stored + suffix] = (np.concatenate([np.asarray(r) for r in rows]) if isinstance(rows[0], np.ndarray)
                                        else _cat(rows))
    return out


def _cat(rows):
    import torch  # a torch tensor's parts (export, the Python API's gather)
    return torch.cat([r if isinstance(r, torch.Tensor) else torch.as_tensor(np.asarray(r)) for r in rows])


def to_view_shapes(values: dict, graph) -> dict:
    """``values`` keyed by param names (and ``name.grad``, ``name.exp_avg``, ...) with each
    fused view param's entries in the stored shape reshaped to the view, and each multi-query
    weight's cut into its part params (:func:`stored_to_parts`)."""
    values = stored_to_parts(values, graph)
    views = {n.name: n for n in graph.params if n.attr("stored_shape")}
    out = dict(values)
    for key, v in values.items():
        base = next((p for p in views if key == p or key.startswith(p + ".")), None)
        if base is not None and tuple(np.shape(v)) == tuple(views[base].attr("stored_shape")):
            out[key] = stored_to_view(np.asarray(v), views[base].type.shape,  # a padded vocab: pad
                                      views[base].attr("stored_order"))
    return out


def to_stored_shapes(values: dict, graph, derived: bool = True) -> dict:
    """The inverse of :func:`to_view_shapes`: each fused view param's entry in the view shape
    reshaped to the stored (checkpoint) shape, and with ``derived`` its ``name.exp_avg``, ...
    too: torch.optim holds those in the param's shape (torch starts), program.py's loader
    reads them per part (``--replay`` states: ``derived=False``). Multi-query part params are
    joined into their stored tensor (:func:`parts_to_stored`)."""
    views = {n.name: n for n in graph.params if n.attr("stored_shape")}
    out = dict(values)
    for key, v in values.items():
        base = next((p for p in views if key == p or (derived and key.startswith(p + "."))), None)
        if base is not None and tuple(np.shape(v)) == tuple(views[base].type.shape):
            out[key] = _stored(np.asarray(v), views[base].attr("stored_shape"), views[base].attr("stored_order"))
    return parts_to_stored(out, graph, derived)


def _stored(x, shape, order=None):
    """A view's value in the stored shape: reshaped (its head units put back in the stored
    order), or (a padded vocab table) trimmed."""
    if x.size == int(np.prod(shape)):
        return view_to_stored(x, shape, order)
    return x[tuple(slice(0, n) for n in shape)]


def to_shape(x, shape):  # noqa: D103 - see parcomp.reference.numpy_attn.to_shape
    from ..reference.numpy_attn import to_shape as pad_or_reshape
    return pad_or_reshape(x, shape)


def stored_to_view(x, shape, order=None):  # noqa: D103 - see parcomp.reference.numpy_attn
    from ..reference.numpy_attn import stored_to_view as to_view
    return to_view(x, shape, order)


def view_to_stored(x, shape, order=None):  # noqa: D103 - see parcomp.reference.numpy_attn
    from ..reference.numpy_attn import view_to_stored as to_stored
    return to_stored(x, shape, order)


_INDEX = re.compile(r"\[(\d+(?:, ?\d+)*)\]")


def in_stored_indices(result, graph):
    """``result`` (a check/run result: nested dicts and lists) with the ``worst``, ``why``
    and ``note`` texts' indices into a fused view param (``qkv.weight[0,0,0]`` of the view
    [3, 32, 32]) given in the stored shape the user knows (``qkv.weight[0,0]`` of [96, 32]):
    ``NAME[i,j,k]`` and, in a ``NAME: reason`` clause (up to ``;``), each index of the
    view's rank. Names with suffixes (``.grad``, ``.exp_avg``) count: they have the view's
    shape. A graph without fused views returns ``result`` unchanged."""
    views = {n.name: (n.type.shape, n.attr("stored_shape"), n.attr("stored_order")) for n in graph.params
             if n.attr("stored_shape") and int(np.prod(n.type.shape)) == int(np.prod(n.attr("stored_shape")))}
    if not views:
        return result
    names = "|".join(re.escape(v) for v in sorted(views, key=len, reverse=True))
    clause = re.compile(rf"(?<![\w.])({names})((?:\.[A-Za-z_]\w*)*)(\[[\d, ]+\]|: [^;]*)")

    def index(view, stored, order, m):
        idx = tuple(int(i) for i in m.group(1).split(","))
        if len(idx) != len(view) or any(i >= n for i, n in zip(idx, view)):
            return m.group(0)
        if order:  # the stored element at that view index: a grouped q|k|v's heads reordered
            flat = int(stored_to_view(np.arange(int(np.prod(stored))).reshape(stored), view, order)[idx])
        else:
            flat = np.ravel_multi_index(idx, view)
        new = np.unravel_index(flat, stored)
        return "[" + (", " if " " in m.group(1) else ",").join(str(int(i)) for i in new) + "]"

    def clauses(m):
        view, stored, order = views[m.group(1)]
        return m.group(1) + m.group(2) + _INDEX.sub(lambda i: index(view, stored, order, i), m.group(3))

    def walk(x, key=None):
        if isinstance(x, dict):
            return {k: walk(v, k) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v, key) for v in x]
        return clause.sub(clauses, x) if isinstance(x, str) and key in ("worst", "why", "note") else x

    return walk(result)
