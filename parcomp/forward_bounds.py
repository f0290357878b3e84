"""Forward error bounds by linear maps between cuts (a deep chain of blocks, docs/design.md
"Deep forward chains: exact linear maps with a second-order term").

The op-by-op box of :func:`parcomp.tolerance.propagate` grows by ``|W2| |f'| |W1|`` per
MLP block, many times ``|W2 f' W1|`` (the 48-block ``mlp_chain``: ~16x a block, against a
measured error ~1e-17). As for the backward (:mod:`parcomp.segment_bounds`), the forward is
cut where every later forward value depends on the earlier ones only through one value
``c`` (a block's output in a chain without skips), and a value ``t`` after it is bounded by

    B(t) + sum_k |L[t, k]| e_c[k]

``L``: the linear map from ``c`` at the computed forward values (matmul/add/views as they
are, an elementwise activation ``f`` by its derivative at the computed input: ``f'(z^) t``,
:data:`TANGENT`), run on unit tangents. ``B``: the box of the segment with ``e_c = 0``,
plus at each activation the second-order remainder of that linearisation, then carried by
the boxes. With ``z(c^)``/``z(c)`` the exact values from the computed and the exact cut and
``z^`` the computed one: ``f(z(c^)) - f(z(c)) - f'(z^) (z(c^) - z(c))`` is
``(f'(xi) - f'(z^)) dz`` for some ``xi`` between ``z(c^)`` and ``z(c)``, so at most
``M (|z(c^) - z^| + |dz|) |dz| <= M (B(z) + lin(z))^2`` with ``M = sup |f''|`` (smooth
``f``), and, for ReLU, 0 where ``|z^| > B(z) + lin(z)`` (both points on one side of the
kink: ``f`` is affine between them) and ``|dz| <= B(z) + lin(z)`` elsewhere. ``|dz -
L dc|`` at ``z`` is the remainders of earlier activations carried by the boxes, which
``B(z)`` holds. So the bound is rigorous, not first order, when the values the segment
reads besides ``c`` (weights, biases) are exact: refined only then (a lockstep step's
state; a later step of a free-running bound keeps the boxes).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .reference.numpy_ops import NUMPY_OPS

#: elementwise activation -> (its gradient op, the operand that op reads: the activation's
#: input or its output, sup |f''| over the reals (None: ReLU, piecewise linear))
TANGENT = {
    "gelu": ("gelu_grad", "input", 0.7979),           # 2 phi(0) = 0.79788, both approximations
    "silu": ("silu_grad", "input", 0.5),              # silu''(0) = 1/2
    "tanh": ("tanh_grad", "output", 0.7699),          # 4 / (3 sqrt 3) = 0.76980
    "sigmoid": ("sigmoid_grad", "output", 0.09623),   # 1 / (6 sqrt 3) = 0.096225
    "relu": ("relu_grad", "input", None),
}


#: the fewest forward ops a segment holds (consecutive cuts merged): longer segments box
#: more of their own rounding, shorter ones compound ``|L|`` over more cuts (docs/design.md)
SPAN = 10


def tangent_segment(nodes, env) -> tuple:
    """``(nodes, extra values)`` a tangent runs through in place of ``nodes``: an activation
    ``f`` becomes ``mul(t, f'(z^))``, its derivative at the computed values (``env``) computed
    once (``extra``: ``{name: f'}``); anything else as it is."""
    out, extra = [], {}
    for n in nodes:
        if n.op not in TANGENT:
            out.append(n)
            continue
        grad, reads, _ = TANGENT[n.op]
        x = np.asarray(env[n.inputs[0] if reads == "input" else n.name], np.float64)
        name = f"{n.name}.tangent"
        extra[name] = NUMPY_OPS[grad]([np.ones_like(x), x], replace(n, op=grad, inputs=(n.inputs[0], n.inputs[0])))
        out.append(replace(n, op="mul", inputs=(n.inputs[0], name), attrs=()))
    return out, extra


def forward_segments(graph, linear_in) -> list:
    """``[(cut, [node, ...])]``: the forward cut between blocks. The region: values that
    depend on an ``input``, before the backward's ``ones`` seed, through ops linear in their region
    operands (``linear_in(node, region)``) or an activation of :data:`TANGENT`. A cut: a
    region value after which no region value read later by the region is another one; its
    segment: the region values up to the next kept cut (:func:`_spaced`) that depend on it."""
    sources = {n.name for n in graph.nodes if n.op == "input"}
    region, order = set(), []
    for n in graph.nodes:
        if n.op == "ones":  # the backward begins: what it reads of the forward is no forward use
            break
        dep = [i for i in n.inputs if i in region or i in sources]
        if n.op in ("input", "param") or not dep:
            continue
        if (n.op in TANGENT and len(n.inputs) == 1) or linear_in(n, region | sources):
            region.add(n.name)
            order.append(n)
    pos = {n.name: k for k, n in enumerate(order)}
    last = {}
    for n in order:
        for i in n.inputs:
            if i in region:
                last[i] = pos[n.name]
    cuts, reach = [], -1  # reach: the last region read of a value before position k
    for k, n in enumerate(order):
        if last.get(n.name, -1) > k and reach <= k:
            cuts.append(k)
        reach = max(reach, last.get(n.name, -1))
    cuts = _spaced(cuts)
    segs = []
    for a, b in zip(cuts, cuts[1:] + [len(order) - 1]):
        inside = {order[a].name}  # what depends on the cut; the rest is read as fixed values
        seg = [n for n in order[a + 1:b + 1] if any(i in inside for i in n.inputs) and not inside.add(n.name)]
        if seg:
            segs.append((order[a].name, seg))
    return segs


def _spaced(cuts) -> list:
    """The cuts (positions) kept: the first, then each at least :data:`SPAN` ops after the last kept."""
    kept = cuts[:1]
    for k in cuts[1:]:
        if k - kept[-1] >= SPAN:
            kept.append(k)
    return kept


def remainder(node, z, box_z, lin_z) -> np.ndarray:
    """The second-order remainder of linearising activation ``node`` at its computed input
    ``z`` (module docstring): ``M (B + lin)^2``, or for ReLU ``B + lin`` where ``|z| <= B +
    lin`` (a kink within reach) and 0 elsewhere."""
    reach = np.asarray(box_z, np.float64) + np.asarray(lin_z, np.float64)
    m = TANGENT[node.op][2]
    if m is None:
        return np.where(np.abs(np.asarray(z, np.float64)) <= reach, reach, 0.0)
    return m * reach * reach


def exact_reads(segment, cut, err) -> bool:
    """Whether every value ``segment`` reads from outside (besides ``cut``) has error 0."""
    inside = {n.name for n in segment} | {cut}
    return all(not np.any(np.asarray(err[i])) for n in segment for i in n.inputs if i not in inside)
