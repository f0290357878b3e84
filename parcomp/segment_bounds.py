"""Backward error bounds by exact linear maps between cut points (issue 17, Llama training).

The backward of a model is linear in its incoming gradient: every op of it (matmul and mul
by a forward value, add, the views, ``sdpa_grad``/``rms_norm_grad``/``silu_grad`` in their
first operand, ...) is linear in the values that depend on the loss's seed (``ones``),
the forward values fixed. :func:`tolerance.propagate` bounds each value by a box (an
elementwise error) and each op moves the box by its own ``|J| e``; over ~25 ops the
product ``|J_n| ... |J_1| e`` is many times ``|J_n ... J_1| e``: a box is not attained
after one op, and the next op's worst case assumes it is.

Here the backward is cut where all of the gradient flows through one value ``c`` (the
residual stream's gradient between blocks, found from the graph: after ``c`` no other
seed-dependent value is needed later). A value ``t`` of the segment after ``c`` is
``t = F(g_c, x)`` (``x``: forward values), linear in ``g_c``; its computed value differs
from the exact one by

    |F^(g^_c, x^) - F(g^_c, x)|  +  |F(g^_c, x) - F(g_c, x)|
    <= B0(t)                      +  sum_k |L[t, k]| e_c[k]

where ``B0`` is the box propagation of :data:`ERROR_RULES` through the segment with
``e_c = 0`` (the segment's own roundings and the forward values' errors) and ``L`` the
linear map from ``g_c`` to ``t``, built column by column by running the segment's numpy
ops on unit tangents (exact up to float64 rounding). ``L`` is taken at the computed
forward values ``x^``, not the exact ``x``; the difference is a product of two errors
(forward error times ``e_c``), what ``SAFETY`` covers everywhere (docs/design.md,
"Numerical comparison"), so a segment is refined only where every forward value it reads
is known to :data:`FORWARD_REL` of its scale (float64: ~1e-7 at worst on Llama). Each value keeps the smaller of this and the op-by-op bound
(both are bounds), so nothing gets looser. Ops outside the linear set (AdamW, the loss's
nonlinear parts) take their operands' refined bounds through their usual rules. The
forward of a deep chain is cut and refined the same way, with a second-order term for its
activations (:mod:`parcomp.forward_bounds`).
"""
from __future__ import annotations

from collections import ChainMap

import numpy as np

from .forward_bounds import TANGENT, exact_reads, forward_segments, remainder, tangent_segment
from .ir.ops import OPS
from .segment_ops import run_batched

#: op kinds (parcomp/ir/ops.py) linear in all their seed-dependent operands jointly
JOINT = ("linear", "additive", "reduce", "expand", "slice", "cat", "relayout")
#: op kinds linear in their first operand only (the others forward values)
FIRST = ("linear0", "sdpa_grad")
#: the most unit tangents run per cut (its element count); a larger cut keeps the boxes
MAX_CUT = 4096
#: the most work per graph, in tangent elements computed (cut elements x the elements of the
#: segment's values, summed over segments); beyond it the boxes stay (Llama's: 8e8)
MAX_WORK = 2_000_000_000
#: the most tangent elements held for one value (batch x its elements)
MAX_HELD = 1 << 24
#: how well known (relative to its scale) a forward value the linear maps read must be
FORWARD_REL = 1e-4
#: unit tangents run at once
BATCH = 64


def _linear_in(node, dep) -> bool:
    """Whether ``node`` is linear in its operands that are in ``dep`` (others fixed)."""
    kind = OPS[node.op].kind if node.op in OPS else None
    idx = [i for i, x in enumerate(node.inputs) if x in dep]
    if kind in JOINT:
        return True
    if kind in FIRST:
        return idx == [0]
    return kind == "bilinear" and len(idx) == 1


def segments(graph) -> list:
    """``[(cut, [node, ...])]`` in graph order: each cut value and the linear ops after it up
    to and including the next cut whose seed-dependent operands are all the cut or ops of
    the segment (the others, e.g. AdamW's steps on a gradient made blocks earlier, keep
    their rules). The linear region: values depending on a ``ones`` seed through ops
    linear in them (:func:`_linear_in`). A cut: a region value ``c`` such that every other
    region value still needed later feeds none of the graph outputs ``c`` feeds, and no more
    of them (the residual stream's gradient between half-blocks: what is left pending is the
    gradients of weights, for their optimizer steps; a weight's gradient is no cut: the
    stream's pending value feeds more outputs)."""
    region, seeded, order = set(), set(), []
    for n in graph.nodes:
        dep = [i for i in n.inputs if i in seeded]
        if n.op == "ones" or dep:
            seeded.add(n.name)
        # linear in its seeded operands, all of them in the region (an AdamW output is not)
        if n.op == "ones" or (dep and all(i in region for i in dep) and _linear_in(n, region)):
            region.add(n.name)
            order.append(n)
    outs = _outputs_fed(graph)
    pos = {n.name: k for k, n in enumerate(order)}
    later = {}  # region value -> positions of its region users
    for n in order:
        for i in set(n.inputs) & region:
            later.setdefault(i, []).append(pos[n.name])
    cuts, pending = [], set()
    for k, n in enumerate(order):
        pending = {i for i in pending | {n.name} if later.get(i) and later[i][-1] > k}
        mine = outs[n.name]
        if n.name in pending and all(outs[i] & mine == 0 and _count(outs[i]) <= _count(mine)
                                     for i in pending - {n.name}):
            cuts.append(k)
    segs = []
    for a, b in zip(cuts, cuts[1:] + [len(order) - 1]):
        inside = {order[a].name}
        for n in order[a + 1:b + 1]:
            if all(i in inside for i in n.inputs if i in region):
                inside.add(n.name)
        seg = [n for n in order[a + 1:b + 1] if n.name in inside]
        if seg:
            segs.append((order[a].name, seg))
    return segs


def _count(bits: int) -> int:
    return bin(bits).count("1")


def _outputs_fed(graph) -> dict:
    """``{value name: bitset of the graph outputs it feeds}`` (bit k: the k-th output)."""
    bits = {v: 1 << k for k, (_, v) in enumerate(graph.named_outputs())}
    fed = {}
    users = {}
    for n in graph.nodes:
        for i in n.inputs:
            users.setdefault(i, []).append(n.name)
    for n in reversed(graph.nodes):
        b = bits.get(n.name, 0)
        for u in users.get(n.name, ()):
            b |= fed[u]
        fed[n.name] = b
    return fed


def linear_bounds(segment, cut, env, ecut, batch: int = BATCH):
    """``{node name: sum_k |L[node, k]| ecut[k]}`` over ``segment`` (nodes after ``cut``, in
    float64), ``L`` the segment's linear map from the cut's value, run on ``batch`` unit
    tangents at a time (:func:`parcomp.segment_ops.run_batched`). None when the cut has more
    than :data:`MAX_CUT` elements or an unbounded one."""
    ecut = np.asarray(ecut, np.float64)
    if ecut.size > MAX_CUT or not np.isfinite(ecut).all():  # an unbounded cut: nothing to refine
        return None
    acc = {n.name: 0.0 for n in segment}
    flat = ecut.reshape(-1)
    last = {i: k for k, n in enumerate(segment) for i in n.inputs}
    nz = np.flatnonzero(flat)
    batch = max(1, min(batch, MAX_HELD // max(1, *(int(np.prod(n.type.shape)) for n in segment))))
    for start in range(0, nz.size, batch):
        ks = nz[start:start + batch]
        units = np.zeros((ks.size, flat.size))  # unit tangents scaled by e_k >= 0: |L e_k| = |L| e_k
        units[np.arange(ks.size), ks] = flat[ks]
        tan = {cut: units.reshape((ks.size, *ecut.shape))}
        for k, n in enumerate(segment):
            flags = [i in tan for i in n.inputs]
            tan[n.name] = t = run_batched(n, [tan[i] if f else _fixed(n, env[i]) for i, f in zip(n.inputs, flags)],
                                          flags, ks.size)
            acc[n.name] = acc[n.name] + np.abs(t).sum(axis=0)
            for i in n.inputs:
                if last.get(i) == k and i in tan:
                    del tan[i]
            if n.name not in last:
                del tan[n.name]
    return acc


def _fixed(node, value):
    """A forward operand as the tangent sees it: 0 in an op linear in all operands jointly
    (``add(g, x)`` moves with ``g`` alone: ``x`` is an offset), the value elsewhere (a factor)."""
    return np.zeros_like(value) if OPS[node.op].kind in JOINT else value


def work(segs, env) -> int:
    """The tangent elements :func:`linear_bounds` computes over ``segs`` (``(cut, nodes,
    ...)``, see :data:`MAX_WORK`)."""
    return sum(int(np.size(env[x[0]])) * sum(int(np.size(env[n.name])) for n in x[1]) for x in segs)


def refine(graph, env, err, bound_op, graph_rule, needed=None) -> dict:
    """``err`` with every backward value bounded by :func:`linear_bounds` plus the box of the
    segment's own errors where that is smaller (module docstring), and every forward value
    of a segment of :func:`parcomp.forward_bounds.forward_segments` likewise, its activations'
    second-order remainders in the box (that module's docstring).

    ``bound_op(node, operands, errors) -> bound`` (an :data:`ERROR_RULES` bound);
    ``graph_rule(node, errors) -> bound or None`` (a ``GRAPH_RULES`` bound). ``needed``: the
    values whose bounds are wanted tighter (None: all); only the segments they depend on
    run their linear maps (the others keep their boxes, a sound ``e_c`` for the segments
    after them). Returns a new dict; ``err`` is not changed."""
    from .check64 import promote_graph

    back = [(c, s, False) for c, s in segments(graph)]
    fwd = [(c, s, True) for c, s in forward_segments(graph, _linear_in) if exact_reads(s, c, err)]
    if needed is not None:
        up = upstream(graph, needed)
        back, fwd = ([x for x in segs if any(n.name in up for n in x[1])] for segs in (back, fwd))
    segs = (fwd if work(fwd, env) <= MAX_WORK else []) + (back if work(back, env) <= MAX_WORK else [])
    if not segs:
        return err
    wide = promote_graph(graph)
    env64 = {k: np.asarray(v, np.float64) if np.asarray(v).dtype.kind == "f" else v for k, v in env.items()}
    seg_of = {n.name: i for i, (_, s, _) in enumerate(segs) for n in s}
    new = dict(err)
    changed = set()
    done, box0 = {}, {}
    for n in graph.nodes:
        if n.name in seg_of:
            i = seg_of[n.name]
            c, seg, fwd = segs[i]
            if i not in done:
                done[i] = _linear_terms(seg, c, fwd, wide, env, env64, new)
            own = box0.setdefault(i, {})  # this segment's boxes with e_c = 0 (never another's)
            view = ChainMap({c: np.zeros(np.shape(env[c]))}, own, new)
            b = bound_op(n, [env[x] for x in n.inputs], [view[x] for x in n.inputs])
            g = graph_rule(n, view)
            own[n.name] = b if g is None else g
            if done[i] is not None:
                if fwd and n.op in TANGENT:  # the activation's second-order remainder (forward_bounds.py)
                    z = n.inputs[0]
                    own[n.name] = own[n.name] + remainder(n, env64[z], view[z], new[c] if z == c else done[i][z])
                new[n.name] = _smaller(err[n.name], own[n.name] + done[i][n.name])
                changed.add(n.name)
                continue
        if n.op not in ("input", "param") and any(x in changed for x in n.inputs):  # AdamW: refined operands
            b = bound_op(n, [env[x] for x in n.inputs], [new[x] for x in n.inputs])
            g = graph_rule(n, new)
            new[n.name] = _smaller(err[n.name], b if g is None else g)
            changed.add(n.name)
    return new


def _linear_terms(seg, cut, fwd, wide, env, env64, err):
    """:func:`linear_bounds` of a backward segment (``fwd`` False) where its forward values
    are known well enough, or of a forward segment (activations by their tangent ops) where
    what it reads besides the cut is exact; else None (the boxes stay)."""
    if fwd:
        if not exact_reads(seg, cut, err):
            return None
        nodes, extra = tangent_segment([wide[m.name] for m in seg], env64)
        return linear_bounds(nodes, cut, ChainMap(extra, env64), err[cut])
    return (linear_bounds([wide[m.name] for m in seg], cut, env64, err[cut])
            if _forward_known(seg, cut, env, err) else None)


def upstream(graph, names) -> set:
    """``names`` and every value of ``graph`` they depend on (through node inputs)."""
    seen, stack = set(), [x for x in names if x in graph]
    while stack:
        x = stack.pop()
        if x not in seen:
            seen.add(x)
            stack.extend(graph[x].inputs)
    return seen


def _forward_known(segment, cut, env, err) -> bool:
    """Whether every forward value ``segment`` reads is known to :data:`FORWARD_REL` of its
    scale (max error <= FORWARD_REL * max |value|): then the linear map at the computed
    forward values is the exact one's up to that relative amount (module docstring)."""
    inside = {n.name for n in segment} | {cut}
    for x in {i for n in segment for i in n.inputs} - inside:
        v, e = np.asarray(env[x]), np.asarray(err[x], np.float64)
        if v.dtype.kind == "f" and v.size and not e.max(initial=0.0) <= FORWARD_REL * np.abs(v).max():
            return False
    return True


def _smaller(a, b) -> np.ndarray:
    """The elementwise smaller of two bounds, a NaN (an unknown error) counting as inf."""
    with np.errstate(invalid="ignore"):
        a, b = (np.where(np.isnan(x), np.inf, x) for x in (np.asarray(a, np.float64), np.asarray(b, np.float64)))
    return np.minimum(a, b)
