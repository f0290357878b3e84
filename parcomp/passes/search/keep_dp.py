"""Data parallel stays data parallel: the layout search never all-gathers the
batch over the mesh axes that split it (:func:`batch_axes`: ``dp``, and ``ep`` where the
spec splits an input over it).

The batch's values are every value computed from a graph input outside the optimizer phase
(activations, their gradients, weight gradients) and the inputs themselves
(:func:`batch_values`).  Gathering one over dp makes every dp rank hold and compute on the
whole batch of it: fewer collective calls on a tiny batch, but per-rank activation memory
grows dp-fold, which the alpha-beta cost model does not see, and a reader of "data
parallel" expects gradient all_reduce instead.  So in :class:`parcomp.passes.shard_prop.ShardProblem` such a
conversion is not allowed (infinite cost), except into a layout the spec pins the value to.
This is a restriction of the plan space, not a price: it leaves the cost model's numbers
alone, and :func:`prune` removes the strategies it makes unusable before any search, so the
integer program gets smaller (a price of 10 ms per gather instead made the GPT-2 dp2 x tp2
training step's integer program run past its 300 s safety net).

Expert parallel splits the batch too: an ``ep`` rank holds its own tokens, which reach the
other ranks' experts by all_to_all and come back the same way; outside the experts (the
embedding, attention, norms, the loss) it computes on them as a dp rank does. So where the
spec splits an input over ``ep`` (its rows, or its sequence), ``ep`` is kept split like ``dp``.

Where no plan keeps the batch split (a spec pin that needs it gathered downstream, an op
that mixes batch rows such as ``x @ x``), shard-prop searches all plans instead and says so
(``search["data_parallel"]`` False), naming the op :func:`prune` found without a strategy
(:func:`blocked_record`).
"""
from __future__ import annotations

import math

from parcomp.ir.redistribute import DP_AXIS
from parcomp.ir.types import Partial, Replicate, Shard, layout_str, shard_axes

__all__ = ["EP_AXIS", "batch_axes", "batch_values", "blocked_record", "prune", "unbatched_values"]

#: the expert-parallel mesh axis; kept split like ``dp`` where an input is split over it
EP_AXIS = "ep"


def batch_axes(graph) -> tuple:
    """The mesh axes (names) the batch is kept split over: ``dp`` when ``graph``'s mesh has it
    with more than one rank; ``ep`` (more than one rank) when some graph input is split over it
    (its tokens: the batch rows, or the sequence). Empty: nothing to keep split."""
    mesh = graph.mesh
    sized = {a for k, a in enumerate(mesh.names) if mesh.sizes[k] > 1}
    out = [DP_AXIS] if DP_AXIS in sized else []
    if EP_AXIS in sized:
        ep = mesh.names.index(EP_AXIS)
        if any(n.layout is not None and any(ep in shard_axes(n.layout, d) for d in range(n.type.rank))
               for n in graph.inputs):
            out.append(EP_AXIS)
    return tuple(out)


def batch_values(graph) -> frozenset:
    """Names of the batch's values (see the module) when ``graph`` has a batch axis
    (:func:`batch_axes`); empty otherwise (nothing to keep split)."""
    if not batch_axes(graph):
        return frozenset()
    out = set()
    for n in graph.nodes:
        if n.op == "input" or (n.phase != "optimizer" and any(i in out for i in n.inputs)):
            out.add(n.name)
    return frozenset(out)


def unbatched_values(graph, options, axes, batch) -> dict:
    """``{axis name: names}``: for each batch axis (:func:`batch_axes`), the forward values of
    the batch (``batch``, :func:`batch_values`) that hold no batch dim split over it: a
    reduction over the batch (the loss's sum over its tokens and their count, a statistic over
    the batch). Their partial sum over the axis is that reduction, all-reduced once, not a
    gather in disguise, so the forward may all_reduce them.

    Found by following the batch dim through the rule tables (``options``: each node's
    ``(cost, in layouts, out layout)`` strategies): where a strategy reads every operand of the
    batch split on its batch dim over the axis (``S(d)``; a value with no batch dim and every
    other operand ``R``), its output there is ``S(e)`` (the batch dim moves to ``e``) or ``P``
    (reduced: none). A value no such strategy reads (an op mixing the batch's rows, ``x @ x``)
    is taken to hold the batch, as is every value after it."""
    mesh, out = graph.mesh, {}
    for a in axes:
        ax, dims = mesh.names.index(a), {}  # value -> its batch dim on axis a, None: none
        for n in graph.nodes:
            if n.op == "input":
                p = n.layout[ax] if n.layout is not None else None
                dims[n.name] = p.dim if isinstance(p, Shard) else None
                continue
            if n.name not in batch or n.phase != "forward" or n.name not in options:
                continue
            if not n.type.rank:  # a scalar has no dim to hold the batch in
                dims[n.name] = None
                continue
            if any(i in batch and i not in dims for i in n.inputs):
                continue  # an operand of unknown batch dim: so is this
            want = [Shard(dims[i]) if i in batch and dims[i] is not None else Replicate() for i in n.inputs]
            made = [o[2][ax] for o in options[n.name] if all(lay[ax] == w for lay, w in zip(o[1], want))]
            split = [p.dim for p in made if isinstance(p, Shard)]
            if split:
                dims[n.name] = split[0]
            elif made:  # only partial (or replicated) results: the batch dim was reduced
                dims[n.name] = None
        out[a] = frozenset(v for v, d in dims.items() if d is None and graph[v].op != "input")
    return out


def prune(prob) -> bool:
    """Drop from ``prob.options`` (in place) every strategy no finite-cost plan can use: one
    that reads an operand in a layout no remaining strategy of the operand converts to at a
    finite cost, or whose output some consumer can read in no remaining layout.  Repeats to a
    fixpoint.  Exact: the plans left are exactly the finite-cost ones.

    ``prob.blocked`` is set to the first node left without a strategy (what
    :func:`blocked_record` describes), or None.

    Returns:
        False when some node has no strategy left (no plan keeps the batch split), else True.
    """
    prob.blocked = None
    changed = True
    while changed:
        fwd, bwd = _Pass(prob), _Pass(prob)
        changed = False
        for n in prob.g.nodes:
            if n.name in prob.options:
                changed = _keep(prob, n.name, [o for o in prob.options[n.name] if all(
                    fwd.reachable(i, lay) for i, lay in zip(n.inputs, o[1]))], fwd) or changed
        for n in reversed(prob.g.nodes):
            if n.name in prob.options:
                changed = _keep(prob, n.name, [o for o in prob.options[n.name] if all(
                    bwd.readable(n.name, o[2], u) for u in set(prob.users[n.name]))], bwd) or changed
        if prob.blocked is not None:
            return False
    return True


def _keep(prob, name, kept, how) -> bool:
    if len(kept) == len(prob.options[name]):
        return False
    if not kept and prob.blocked is None:
        prob.blocked = (name, how.why(name))
    prob.options[name] = kept
    return True


def blocked_record(prob) -> dict | None:
    """What keeps the batch from staying split, after :func:`prune` returned False:
    ``{"node", "op", "module", "why"}`` (the first op left without a strategy, the model module
    it was traced from, and in words which operand's layouts it cannot read), or None."""
    if getattr(prob, "blocked", None) is None:
        return None
    name, why = prob.blocked
    n = prob.g[name]
    return {"node": name, "op": n.op, "module": n.source, "why": why}


class _Pass:
    """Memoised feasibility questions within one pass (options shrink between passes)."""

    def __init__(self, prob):
        self.prob, self.memo, self.made_in = prob, {}, {}
        self.axes = " and ".join(batch_axes(prob.g))

    def made(self, name) -> list:
        """The layouts ``name`` can still be made in (options' layouts are interned: one
        object per distinct layout)."""
        got = self.made_in.get(name)
        if got is None:
            prob = self.prob
            if name in prob.options:
                got = list({id(o): o for _, _, o in prob.options[name]}.values())
            else:
                got = [prob.g[name].layout]
            self.made_in[name] = got
        return got

    def reachable(self, name, layout) -> bool:
        """Whether some remaining layout of ``name`` converts to ``layout`` at a finite cost."""
        key = (name, id(layout))
        if key not in self.memo:
            prob, ty = self.prob, self.prob.g[name].type
            self.memo[key] = any(math.isfinite(prob.plan_cost(o, layout, ty, name)) for o in self.made(name))
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

    def why(self, name) -> str:
        """Why node ``name`` (its options about to be emptied) has no strategy left: the operands
        it cannot read as the split batch holds them, or the consumers that cannot read it."""
        prob = self.prob
        n = prob.g[name]
        split = f"the batch split over {self.axes}"
        opts = prob.options[name]
        stuck = {}
        for k, i in enumerate(n.inputs):  # an operand every strategy reads in a layout it cannot reach
            wanted = tuple(dict.fromkeys(o[1][k] for o in opts))
            if not any(self.reachable(i, lay) for lay in wanted):
                stuck.setdefault((i, wanted), None)
        if stuck:
            return f"{n.op} %{name} " + "; ".join(
                f"reads %{i} only as {' or '.join(map(layout_str, wanted))}, but with {split} it is "
                f"{' or '.join(map(layout_str, self.made(i)))}{_partial_words(self.made(i))}"
                for i, wanted in stuck)
        if any(all(self.reachable(i, lay) for i, lay in zip(n.inputs, o[1])) for o in opts):
            users = sorted(set(prob.users[name]))
            return (f"no strategy of {n.op} %{name} makes a layout its consumers "
                    f"({', '.join('%' + u for u in users)}) can read with {split}")
        return (f"{n.op} %{name} has no strategy that reads all of its operands "
                f"({', '.join('%' + i for i in n.inputs)}) as they are held with {split}")


def _partial_words(layouts) -> str:
    """``": a partial sum"`` where every layout is partial over some axis (a reduction over the
    split batch that the forward may only sum where its result is a scalar), else ``""``."""
    if layouts and all(any(isinstance(p, Partial) for p in lay) for lay in layouts):
        return ": a partial sum over the batch"
    return ""
