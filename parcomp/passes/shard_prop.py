"""shard-prop: choose a layout for every value and a strategy for every op.

Input: a graph whose sources (params, inputs) and ``relayout`` nodes carry the
layouts the spec fixes.  Output: every node has ``layout`` (what it produces)
and ``in_layouts`` (what its op consumes); ``insert-collectives`` turns the
differences into collectives.

Cost of a solution (seconds, :mod:`parcomp.ir.redistribute`): every node's local
compute, plus for every value the redistributions to each *distinct* layout
its consumers need (a conversion is made once and shared).

Search:

1. a dynamic program in topological order (``best[v][O]``: least cost to
   produce ``v`` in ``O``) and a reverse pass fixing each strategy given what
   its consumers ask — exact where every value is read once (chains, trees),
   and then the answer;
2. otherwise the integer program of :mod:`.search.layout_ilp` (HiGHS), exact, started
   from the best of the DP, a forward greedy pass (DTensor-style propagation)
   and local moves (:mod:`.search.shard_moves`: a node re-picks its strategy, operands
   computed only for it follow), which is also kept if the solver's time budget runs out first.

Both are checked against brute-force enumeration in the tests (test_optimality,
test_ilp).
"""
from __future__ import annotations

import math
import time

from ..errors import ShardingError
from ..ir.graph import Graph, describe, evolve
from ..ir.redistribute import compute_cost, gathers_over, plan_cost
from ..ir.types import layout_str
from ..rules.sharding import mesh_strategies
from .search.keep_dp import batch_axes, batch_values, blocked_record, prune, unbatched_values
from .search.layout_ilp import DEFAULT_SECONDS, MemoryLimit, solve_ilp, too_large
from .search.shard_moves import LocalMoves

_TOL = 1e-15
# collectives over a batch axis (dp; ep where it splits the batch) that make one of the
# batch's values whole on every rank of it: an all_gather; in the forward also an all_reduce of
# a value that still holds the batch (a partial sum over dp there comes from contracting a dim
# moved onto dp, a gather in disguise; the loss and the gradients are reduced over dp in the
# loss and backward phases). A forward value whose batch dim was reduced away (a model's own
# loss: the sum over its tokens and their count) is all-reduced as the loss's are:
# keep_dp.unbatched_values.
_GROWS, _GROWS_FORWARD = ("all_gather",), ("all_gather", "all_reduce")


def shard_prop(graph: Graph, seconds: float = DEFAULT_SECONDS, memory: int | None = None,
               memory_loc=None, free: dict | None = None, heuristic: bool = False,
               problem=None) -> Graph:
    """Complete the layouts of ``graph`` with the least estimated cost.

    On a tree (every value read once) the DP is exact; otherwise the ILP of
    :mod:`.search.layout_ilp` runs for at most ``seconds``, started from the heuristic's
    plan.  The returned graph's ``search`` says which search produced the plan,
    its cost (seconds) and whether it is proven optimal under the cost model.
    Data parallel stays data parallel: no plan all-gathers the batch over ``dp``
    (:class:`ShardProblem`) unless none can avoid it (``search["data_parallel"]`` False).
    With ``memory`` (bytes per rank), plans whose resident bytes
    (:mod:`parcomp.cost.memory`) exceed it are infeasible.  ``free`` maps a source (param or
    input) to the layouts it may take (``parcomp plan``); other sources keep theirs.
    ``heuristic`` skips the ILP as a graph over MAX_STRATEGIES does (block-plan reuse compiles
    a few blocks of a model whose whole graph is over it: parcomp/compile/repeat_compile.py).
    ``problem``: this graph's :class:`ShardProblem` (``free`` empty), already pruned with data
    parallel kept (:func:`.search.keep_dp.prune` True), which block-plan reuse builds first to count
    the strategies; it is used as built.

    Raises:
        ShardingError: a pinned layout no strategy can produce evenly (names the
            node and its operand shapes).
        ParcompError: no plan fits ``memory`` (says by how much the smallest misses).
    """
    t0 = time.perf_counter()
    blocked = None
    if problem is None:
        prob = ShardProblem(graph, free or {})
        gathered = bool(prob.batch) and not prune(prob)
        blocked = blocked_record(prob)
    else:
        prob, gathered = problem, False
    if not gathered:
        limit = None if memory is None else MemoryLimit(prob, memory, memory_loc)
        sol, search, proven = _search(prob, limit, seconds, heuristic)
        sol = _in_order(graph, sol)
        cost = prob.total(sol)
        gathered = math.isinf(cost)
    if gathered:  # no plan keeps the batch split over dp (pins, a batch-mixing op): the best of all
        prob = ShardProblem(graph, free or {}, data_parallel=False)
        limit = None if memory is None else MemoryLimit(prob, memory, memory_loc)
        sol, search, proven = _search(prob, limit, seconds, heuristic)
        sol = _in_order(graph, sol)
        cost = prob.total(sol)
    info = {"search": search, "proven_optimal": proven, "cost_s": cost,
            "seconds": round(time.perf_counter() - t0, 6), "data_parallel": not gathered}
    if gathered and batch_axes(graph):
        info["batch_axes"] = list(batch_axes(graph))
        if blocked is not None:
            info["batch_gathered_by"] = blocked
    if search == "heuristic" and limit is None and too_large(prob):
        info["solver_skipped"] = sum(len(o) for o in prob.options.values())  # strategies
    elif prob.ilp_skipped_columns:
        info["solver_skipped_columns"] = prob.ilp_skipped_columns
    if limit is not None:
        info.update(memory_limit=memory, resident_bytes=limit.bytes(sol))
    nodes = [n if n.name not in sol else evolve(n, layout=sol[n.name][1], in_layouts=sol[n.name][0]
                                                 if n.op not in ("input", "param") else None)
             for n in graph.nodes]
    return graph.with_nodes(nodes, search=info)


def _search(prob, limit, seconds, heuristic=False) -> tuple:
    """``(plan, search, proven)`` of ``prob``: the DP where exact, else the heuristic and
    (below MAX_STRATEGIES or under a memory limit) the ILP started from it."""
    dp = prob.dp_solution()
    if all(len(u) <= 1 for u in prob.users.values()) and (limit is None or limit.fits(dp)):
        return dp, "dp", True
    sol = prob.improve(min((dp, prob.greedy_solution()), key=prob.total))
    if limit is None and (heuristic or too_large(prob)):  # the solver would stop at its root with this plan
        return sol, "heuristic", False
    ilp, proven = solve_ilp(prob, sol, seconds, limit)
    if proven is None:  # over MAX_COLUMNS: the solver was not called
        return sol, "heuristic", False
    fits = [s for s in (ilp, sol) if limit is None or limit.fits(s)]
    if not fits:
        raise limit.not_found(seconds)
    best = min(fits, key=prob.total)
    better = best is ilp and prob.total(ilp) < prob.total(sol) - _TOL
    return best, "ilp" if proven or better else "heuristic", proven


class ShardProblem(LocalMoves):
    """Options per node and the exact cost of a plan.  With ``data_parallel`` (the default)
    a conversion that all-gathers one of the batch's values over a batch axis (``dp``; ``ep``
    where the spec splits an input over it: :func:`.search.keep_dp.batch_axes`) costs
    infinity (:func:`batch_values`), except into a layout the spec pins that value to."""

    def __init__(self, graph, free=None, data_parallel: bool = True):
        self.g, self.mesh = graph, graph.mesh
        self.users = graph.users()
        self.batch = batch_values(graph) if data_parallel else frozenset()
        self.batch_axes = batch_axes(graph)
        self.blocked = None  # keep_dp.prune: the first node it left without a strategy
        self.ilp_skipped_columns = 0  # layout_ilp.solve_ilp: the columns of a program it did not solve
        self.pinned = {}  # value -> layouts a relayout (a spec pin) reads it in
        for n in graph.nodes:
            if n.op == "relayout":
                self.pinned.setdefault(n.inputs[0], set()).add(n.layout)
        self._gathers = {}
        self._value_ctx = {}  # value -> plan_cost's context of it (_context)
        self.options = {}  # name -> [(compute cost, ins, out)]
        self._canon, self._costs, self._computes, self._types, self._reads = {}, {}, {}, {}, {}
        self._fit = {}  # (option list id, layout id) -> the options producing that layout
        self._fixed_costs = {}  # (value, id(its layout)) -> value_cost, for fixed reads
        self._moves = {}  # node -> _parts of a move there
        same = {}  # nodes alike in op, attrs, types and pin have the same options
        for n in graph.nodes:
            if n.op in ("input", "param"):
                if n.name in (free or {}):
                    self.options[n.name] = [(0.0, (), self.intern(lay)) for lay in free[n.name]]
                continue
            in_types = tuple(graph[i].type for i in n.inputs)
            key = (n.op, _strategy_attrs(n), n.type, in_types, n.layout)
            if key not in same:
                same[key] = self._strategies(n, in_types)
            if not same[key]:
                raise ShardingError(_no_strategy(graph, n))
            self.options[n.name] = same[key]
        # the forward values whose batch dim is reduced away, per batch axis (keep_dp)
        self.unbatched = unbatched_values(graph, self.options, self.batch_axes, self.batch)

    def _strategies(self, n, in_types) -> list:
        opts = mesh_strategies(n, list(in_types), self.mesh)
        if n.layout is not None:
            opts = [o for o in opts if o[1] == n.layout]
        return [(compute_cost(n, list(in_types), i, o, self.mesh),
                 tuple(self.intern(lay) for lay in i), self.intern(o)) for i, o in opts]

    def intern(self, layout):
        """One object per distinct layout, so costs can be cached by identity."""
        return self._canon.setdefault(layout, layout)

    def plan_cost(self, src, tgt, ty, value=None) -> float:
        """:func:`parcomp.ir.redistribute.plan_cost` on this mesh, cached by object identity
        (layouts are interned; types and fixed layouts live as long as the graph); infinity
        for a conversion of ``value`` that data parallel forbids (see the class)."""
        ctx = self._value_ctx.get(value)
        if ctx is None or ctx[0] is not ty:
            ctx = self._context(value, ty)
        _, tid, held, pinned = ctx
        if held is not None and not (pinned and tgt in pinned):
            key = (id(src), id(tgt), ty.rank, held)
            gathers = self._gathers.get(key)
            if gathers is None:
                gathers = self._gathers[key] = any(
                    gathers_over(src, tgt, ty.rank, self.mesh, a, _GROWS_FORWARD if h else _GROWS)
                    for a, h in zip(self.batch_axes, held))
            if gathers:
                return math.inf
        key = (id(src), id(tgt), tid)
        cost = self._costs.get(key)
        if cost is None:
            cost = self._costs[key] = plan_cost(src, tgt, ty, self.mesh)
        return cost

    def _context(self, value, ty) -> tuple:
        """``(ty, type id, held, pinned)`` of ``value`` for :meth:`plan_cost`, found once per
        value: the id its costs are cached under (equal types share their costs); ``held``, for
        one of the batch's values, whether each batch axis forbids its all_reduce too (a forward
        value that still holds the batch), else None (nothing forbidden); the layouts a spec pin
        reads it in (a gather into those is allowed)."""
        tid = self._types.get(id(ty))
        if tid is None:  # equal types share their costs
            tid = self._types[id(ty)] = id(self._canon.setdefault(ty, ty))
        held = None
        if value in self.batch:
            fwd = self.g[value].phase == "forward"
            held = tuple(fwd and value not in self.unbatched[a] for a in self.batch_axes)
        ctx = (ty, tid, held, self.pinned.get(value, ()))
        if value is not None:
            self._value_ctx[value] = ctx
        return ctx

    def layout(self, sol, name):
        return sol[name][1] if name in sol else self.g[name].layout

    def value_cost(self, sol, name) -> float:
        """Redistributions of ``name`` to the distinct layouts its consumers want."""
        info = self._reads.get(name)
        if info is None:
            info = self._reads[name] = self._read_info(name)
        reads, ty, tid, guarded, fixed = info
        ent = sol.get(name)
        src = ent[1] if ent is not None else self.g[name].layout
        if fixed:  # what its readers want does not depend on the plan: a function of src
            key = (name, id(src))
            total = self._fixed_costs.get(key)
            if total is None:
                total = self._fixed_costs[key] = self._value_cost(sol, name, src, info)
            return total
        if len(reads) == 1:  # one read, nothing to share (0.0 + cost: the same float as the loop's)
            u, k = reads[0]
            lay = sol[u][0][k]
            cost = None if guarded else self._costs.get((id(src), id(lay), tid))
            return 0.0 + (self.plan_cost(src, lay, ty, name) if cost is None else cost)
        return self._value_cost(sol, name, src, info)

    def _value_cost(self, sol, name, src, info) -> float:
        reads, ty, tid, guarded, _ = info
        costs, sid = self._costs, id(src)
        seen, total = set(), 0.0
        for u, k in reads:
            lay = sol[u][0][k]
            lid = id(lay)
            if lid not in seen:  # layouts are interned: one object per distinct layout
                seen.add(lid)
                cost = None if guarded else costs.get((sid, lid, tid))
                total += self.plan_cost(src, lay, ty, name) if cost is None else cost
        return total

    def _read_info(self, name) -> tuple:
        """``(reads, type, type id, guarded, fixed)`` of value ``name``: the (consumer,
        operand position) of every read, its type, the id :meth:`plan_cost` caches its costs
        under, whether data parallel may forbid its conversions (it is one of the batch's),
        and whether every option of every reader wants the same layout object of it (a
        plan's strategies are always option entries, so its cost then depends only on the
        layout ``name`` is made in: the ``step`` scalar every optimizer update reads)."""
        reads = [(u, k) for u in dict.fromkeys(self.users[name])
                 for k, i in enumerate(self.g[u].inputs) if i == name]
        ty = self.g[name].type
        tid = self._types.get(id(ty))
        if tid is None:
            tid = self._types[id(ty)] = id(self._canon.setdefault(ty, ty))
        fixed = all(len({id(ins[k]) for _, ins, _ in self.options[u]}) == 1 for u, k in reads)
        return reads, ty, tid, name in self.batch, fixed

    def total(self, sol) -> float:
        """Exact cost (seconds) of a solution: compute plus each distinct conversion once."""
        compute = sum(self.compute_cost(sol, name) for name in sol)
        return compute + sum(self.value_cost(sol, n.name) for n in self.g.nodes)

    def compute_cost(self, sol, name):
        """The compute seconds of node ``name`` under plan ``sol`` (its strategy's cost)."""
        ins, out = sol[name]
        opts = self.options[name]
        table = self._computes.get(id(opts))  # nodes sharing an option list share its table
        if table is None:
            table = self._computes[id(opts)] = {}
            for c, i, o in reversed(opts):  # the first of equal keys wins
                table[(id(i), id(o))] = c
        c = table.get((id(ins), id(out)))
        return c if c is not None else next(c for c, i, o in self.options[name] if i == ins and o == out)

    def dp_solution(self) -> dict:
        """Forward DP over ``best[v][layout]``, then a reverse pass fixing each strategy
        (it reuses each option's forward cost: the same sum of the same memoized terms)."""
        best, memo, forward, cost_to = {}, {}, {}, self._cost_to
        for n in self.g.nodes:
            opts = self.options.get(n.name)
            if opts is None:
                best[n.name] = {n.layout: 0.0}
                continue
            table, costs = {}, []
            for c, ins, out in opts:
                terms = []
                for i, lay in zip(n.inputs, ins):
                    term = memo.get((i, id(lay)))
                    terms.append(cost_to(best, i, lay, memo) if term is None else term)
                cost = c + sum(terms)
                costs.append(cost)
                if out not in table or cost < table[out] - _TOL:
                    table[out] = cost
            best[n.name], forward[n.name] = table, costs
        required, sol = {n.name: [] for n in self.g.nodes}, {}
        for n in reversed(self.g.nodes):
            opts = self.options.get(n.name)
            if opts is None:
                continue
            pick, pick_cost, wanted = None, None, required[n.name]
            for (c, ins, out), total in zip(opts, forward[n.name]):
                total += sum(self.plan_cost(out, lay, n.type, n.name) for lay in wanted)
                if pick is None or total < pick_cost - _TOL:
                    pick, pick_cost = (ins, out), total
            sol[n.name] = pick
            for i, lay in zip(n.inputs, pick[0]):
                required[i].append(lay)
        return sol

    def _cost_to(self, best, name, layout, memo) -> float:
        """Cost of having ``name`` in ``layout``.  A value with several consumers
        charges each only what its layout choice adds over its cheapest layout:
        the shared upstream work is paid once, not once per consumer.  ``memo``
        keeps each answer (``best[name]`` is final once ``name``'s consumers ask)."""
        key = (name, id(layout))
        if key not in memo:
            ty, table = self.g[name].type, best[name]
            base = min(table.values()) if len(self.users[name]) > 1 else 0.0
            base = base if math.isfinite(base) else 0.0
            memo[key] = min([c - base + self.plan_cost(o, layout, ty, name) for o, c in table.items()])
        return memo[key]

    def greedy_solution(self) -> dict:
        """DTensor-style propagation: each op takes the cheapest strategy given its inputs."""
        sol = {}
        for n in self.g.nodes:
            if n.name not in self.options:
                continue
            src = [self.layout(sol, i) for i in n.inputs]
            types = [self.g[i].type for i in n.inputs]
            sol[n.name] = min(
                ((c + sum(self.plan_cost(s, lay, t, i) for s, lay, t, i in zip(src, ins, types, n.inputs)), k,
                  (ins, out))
                 for k, (c, ins, out) in enumerate(self.options[n.name])))[2]
        return sol


def _in_order(graph, sol) -> dict:
    """``sol`` in program order: its cost (a float sum over it) then does not depend on
    which search built it (a reused block plan prices the same sum: parcomp/compile/repeat_compile.py)."""
    return {n.name: sol[n.name] for n in graph.nodes if n.name in sol}


def _strategy_attrs(n) -> tuple:
    """``n``'s attributes less those no strategy or cost reads (a relayout's ``origin``
    names its spec rule): nodes of repeated blocks then share one option list."""
    return tuple(kv for kv in n.attrs if kv[0] != "origin")


def _no_strategy(graph, n) -> str:
    shapes = ", ".join(f"%{i}: {graph[i].type}" for i in n.inputs)
    pinned = f" producing the pinned layout {layout_str(n.layout)}" if n.layout else ""
    return (f"no sharding strategy for {describe(n)}{pinned} on mesh {graph.mesh}: every way to "
            f"split it leaves an uneven shard (operands {shapes}). Make the dims divisible by the "
            f"mesh axis sizes or replicate the operands.")
