"""Joint error bounds for the decomposed softmax family (``parcomp/passes/decompose.py``).

Softmax, log_softmax and cross-entropy are written as ``s = x - amax(x)`` (the max
detached), ``E = exp(s)``, ``S = sum(E)``, ``log(S)``, ``E / S``. Bounded op by op, an input
error ``d`` that is large against 1 makes ``exp(s + d)`` overflow and ``log(S - e_S)``
undefined, although every one of these functions is tame: ``E`` lies in [0, 1], ``S`` in
[1, n], log-sum-exp is 1-Lipschitz in the max norm, and a softmax probability ``p_i`` moves
by at most ``p_i (exp(2 d) - 1)`` (and at most 1) when the logits move by ``d`` (each
``exp(s_i)`` by a factor within ``exp(+-d)``, their sum too). These rules (``GRAPH_RULES``,
applied after the element rules by :func:`parcomp.tolerance.propagate`) replace the element
bound by that one where the pattern matches, and return None elsewhere. Rounding of the
computation itself is charged ``gamma_{n+8}`` (n: the reduced length) as in Higham ch. 3.
"""
from __future__ import annotations

import numpy as np

from .error import gamma


def _node(graph, name):
    return graph[name] if name in graph else None


def _shift(graph, name):
    """``(x, d)`` when ``name`` is ``x - expand(amax(x){detach}, dims=(d,))``, else None."""
    n = _node(graph, name)
    if n is None or n.op != "sub":
        return None
    b = _node(graph, n.inputs[1])
    m = _node(graph, b.inputs[0]) if b is not None and b.op == "expand" else None
    if m is None or m.op != "amax" or not m.attr("detach") or m.inputs[0] != n.inputs[0]:
        return None
    dims = tuple(m.attr("dims"))
    return (n.inputs[0], dims[0] % n.type.rank) if len(dims) == 1 else None


def _exp_of_shift(graph, name):
    """``(s, d)`` when ``name`` is ``exp(s)`` of a shift over dim d."""
    n = _node(graph, name)
    if n is None or n.op != "exp":
        return None
    found = _shift(graph, n.inputs[0])
    return (n.inputs[0], found[1]) if found else None


def _sumexp(graph, name):
    """``(E, s, d)`` when ``name`` is ``sum(E){dims=(d,)}`` with ``E = exp(s)`` of a shift over d."""
    n = _node(graph, name)
    if n is None or n.op != "sum":
        return None
    found = _exp_of_shift(graph, n.inputs[0])
    if not found or tuple(d % graph[n.inputs[0]].type.rank for d in n.attr("dims")) != (found[1],):
        return None
    return n.inputs[0], found[0], found[1]


#: a shifted logit whose upper bound ``s + e`` lies below this is *dead*: ``exp`` of it is
#: below ``exp(DEAD) ~ 1.6e-28`` on both sides, whatever its error. A padded vocab entry
#: (``mask_pad`` fills the dtype's lowest value) has an error bound near the dtype's max
#: (``u |s|``) that would otherwise make every row's log-sum-exp bound ``log n``.
DEAD = -64.0


def _dead(env, err, s):
    """Where the shifted logits ``s`` are dead (see :data:`DEAD`)."""
    v = np.asarray(env[s], np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.isfinite(v) & (v + np.asarray(err[s], np.float64) < DEAD) | (v == -np.inf)


def _delta(env, err, s, d):
    """The largest error of the shifted logits in each row (kept as a size-1 dim d), over
    the live entries, plus ``n exp(DEAD)`` for the dead ones: with live entries moving by at
    most delta_L and dead ones adding at most ``n exp(DEAD)`` to a sum that is at least 1
    (its max entry is exp(0) = 1 and live), log-sum-exp moves by at most
    ``delta_L + n exp(DEAD)`` and every live ``exp`` and the sum within that factor."""
    dead = _dead(env, err, s)
    live = np.where(dead, 0.0, np.asarray(err[s], np.float64))
    n = dead.shape[d]
    return np.max(live, axis=d, keepdims=True) + n * np.exp(DEAD)


def _exp(node, graph, env, err, u):
    """exp of a shift lies in [0, 1] on both sides: at most 1 apart."""
    if _exp_of_shift(graph, node.name) is None:
        return None
    return np.minimum(err[node.name], 1.0)


def _sum(node, graph, env, err, u):
    """A sum of n exps of a shift lies in [1, n(1 + gamma_n)]: at most n apart."""
    found = _sumexp(graph, node.name)
    if found is None:
        return None
    n = graph[found[0]].type.shape[found[2]]
    return np.minimum(err[node.name], float(n))


def _log(node, graph, env, err, u):
    """log-sum-exp of the shifted logits: 1-Lipschitz in the max norm, within [0, log n]."""
    found = _sumexp(graph, node.inputs[0])
    if found is None:
        return None
    _, s, d = found
    n = graph[s].type.shape[d]
    own = gamma(n + 8, u) + 2 * u * np.abs(np.asarray(env[node.name], np.float64))
    lip = np.squeeze(_delta(env, err, s, d), axis=d)
    return np.minimum(lip, np.log(n)) + own


def _probs(graph, env, e_name, s_name):
    """``(p, delta, n)``: the softmax of the family and its row's logit error."""
    found = _sumexp(graph, s_name)
    if found is None or found[0] != e_name:
        return None
    _, s, d = found
    e = np.asarray(env[e_name], np.float64)
    p = e / np.sum(e, axis=d, keepdims=True)
    return p, d, s, graph[s].type.shape[d]


def _moved(p, delta):
    """How far a probability p moves when every logit of its row moves by at most delta."""
    with np.errstate(over="ignore"):
        return np.minimum(1.0, p * np.expm1(np.minimum(2 * delta, 700.0)))


def _div(node, graph, env, err, u):
    """``E / expand(S)``: softmax itself."""
    b = _node(graph, node.inputs[1])
    if b is None or b.op != "expand":
        return None
    found = _probs(graph, env, node.inputs[0], b.inputs[0])
    if found is None:
        return None
    return _softmax_err(env, err, u, *found)


def _softmax_err(env, err, u, p, d, s, n):
    """Bound on |softmax computed - exact| from the probabilities ``p`` (reduced over dim ``d``
    of ``n`` terms, shifted logits ``s``): the moved share (a dead entry's probability is
    below ``exp(DEAD)`` on both sides) plus the division's rounding."""
    dead = np.where(_dead(env, err, s), np.exp(DEAD), 0.0)
    return _moved(p, _delta(env, err, s, d)) + dead + 2 * gamma(n + 8, u) * p


def _mul(node, graph, env, err, u):
    """``expand(G / S) * E``: the gradient of log-sum-exp, G times softmax."""
    b = _node(graph, node.inputs[0])
    q = _node(graph, b.inputs[0]) if b is not None and b.op == "expand" else None
    if q is None or q.op != "div":
        return None
    found = _probs(graph, env, node.inputs[1], q.inputs[1])
    if found is None:
        return None
    p, d = found[0], found[1]
    g = np.expand_dims(np.asarray(env[q.inputs[0]], np.float64), d)
    eg = np.expand_dims(np.asarray(err[q.inputs[0]], np.float64), d)
    moved = _softmax_err(env, err, u, *found)
    return np.abs(g) * moved + eg * (p + moved) + u * np.abs(np.asarray(env[node.name], np.float64))


SOFTMAX_GRAPH_RULES = {"exp": _exp, "sum": _sum, "log": _log, "div": _div, "mul": _mul}
