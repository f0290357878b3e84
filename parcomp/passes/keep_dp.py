"""Data parallel stays data parallel (issue 11): the layout search never all-gathers the
batch over the mesh axis ``dp``.

The batch's values are every value computed from a graph input outside the optimizer phase
(activations, their gradients, weight gradients) and the inputs themselves
(:func:`batch_values`).  Gathering one over dp makes every dp rank hold and compute on the
whole batch of it: fewer collective calls on a tiny batch, but per-rank activation memory
grows dp-fold, which the alpha-beta cost model does not see, and a reader of "data
parallel" expects gradient all_reduce instead.  So in :class:`.shard_prop._Problem` such a
conversion is not allowed (infinite cost), except into a layout the spec pins the value to.
This is a restriction of the plan space, not a price: it leaves the cost model's numbers
alone, and :func:`prune` removes the strategies it makes unusable before any search, so the
integer program gets smaller (a price of 10 ms per gather instead made the GPT-2 dp2 x tp2
training step's integer program run past its 300 s safety net).

Where no plan keeps the batch split (a spec pin that needs it gathered downstream, an op
that mixes batch rows such as ``x @ x``), shard-prop searches all plans instead and says so
(``search["data_parallel"]`` False).
"""
from __future__ import annotations

import math

from ..redistribute import DP_AXIS

__all__ = ["batch_values", "prune"]


def batch_values(graph) -> frozenset:
    """Names of the batch's values (see the module) when ``graph``'s mesh has a ``dp`` axis
    of more than one rank; empty otherwise (nothing to keep split)."""
    mesh = graph.mesh
    if DP_AXIS not in mesh.names or mesh.sizes[mesh.names.index(DP_AXIS)] == 1:
        return frozenset()
    out = set()
    for n in graph.nodes:
        if n.op == "input" or (n.phase != "optimizer" and any(i in out for i in n.inputs)):
            out.add(n.name)
    return frozenset(out)


def prune(prob) -> bool:
    """Drop from ``prob.options`` (in place) every strategy no finite-cost plan can use: one
    that reads an operand in a layout no remaining strategy of the operand converts to at a
    finite cost, or whose output some consumer can read in no remaining layout.  Repeats to a
    fixpoint.  Exact: the plans left are exactly the finite-cost ones.

    Returns:
        False when some node has no strategy left (no plan keeps the batch split), else True.
    """
    changed = True
    while changed:
        fwd, bwd = _Pass(prob), _Pass(prob)
        changed = any([_keep(prob, n.name, [o for o in prob.options[n.name]
                                            if all(fwd.reachable(i, lay) for i, lay in zip(n.inputs, o[1]))])
                       for n in prob.g.nodes if n.name in prob.options])
        changed = any([_keep(prob, n.name, [o for o in prob.options[n.name]
                                            if all(bwd.readable(n.name, o[2], u) for u in set(prob.users[n.name]))])
                       for n in reversed(prob.g.nodes) if n.name in prob.options]) or changed
        if any(not opts for opts in prob.options.values()):
            return False
    return True


def _keep(prob, name, kept) -> bool:
    if len(kept) == len(prob.options[name]):
        return False
    prob.options[name] = kept
    return True


class _Pass:
    """Memoised feasibility questions within one pass (options shrink between passes)."""

    def __init__(self, prob):
        self.prob, self.memo = prob, {}

    def reachable(self, name, layout) -> bool:
        """Whether some remaining layout of ``name`` converts to ``layout`` at a finite cost."""
        key = (name, id(layout))
        if key not in self.memo:
            prob, ty = self.prob, self.prob.g[name].type
            made = {o for _, _, o in prob.options[name]} if name in prob.options else {prob.g[name].layout}
            self.memo[key] = any(math.isfinite(prob.plan_cost(o, layout, ty, name)) for o in made)
        return self.memo[key]

    def readable(self, name, out, user) -> bool:
        """Whether some remaining strategy of ``user`` reads ``name`` in a layout ``out``
        converts to at a finite cost."""
        key = (name, id(out), user)
        if key not in self.memo:
            prob, ty = self.prob, self.prob.g[name].type
            reads = self.memo.get((name, user))
            if reads is None:
                pos = [p for p, i in enumerate(prob.g[user].inputs) if i == name]
                reads = self.memo[(name, user)] = {ins[p] for _, ins, _ in prob.options[user] for p in pos}
            self.memo[key] = any(math.isfinite(prob.plan_cost(out, lay, ty, name)) for lay in reads)
        return self.memo[key]
