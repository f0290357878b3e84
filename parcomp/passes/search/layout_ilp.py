"""The layout choice as an integer program, solved by HiGHS (``highspy``).

This is the exact search behind ``shard-prop`` on graphs that are not trees
(Alpa's and AutoParallel's formulation, with this compiler's cost model: each
distinct conversion of a value is paid once, however many consumers share it).

Variables (one ``ShardProblem`` of :mod:`parcomp.passes.shard_prop` in, one plan out):

- ``x[n, k]`` binary: node ``n`` runs strategy ``k`` (``sum_k x[n, k] = 1``);
- ``w[v, L]`` in [0, 1]: some consumer reads value ``v`` in layout ``L``
  (``w[v, L] >= sum of x[u, k]`` over the strategies ``k`` of each consumer ``u``
  that read ``v`` as ``L``);
- ``q[v, o, L]`` in [0, 1]: ``v`` is produced in ``o`` and converted to ``L``
  (``sum_o q[v, o, L] = w[v, L]``, ``q[v, o, L] <= y[v, o]``, ``y[v, o]`` the sum
  of ``v``'s strategies producing ``o``), priced at the seconds of that
  redistribution.  Layouts ``o`` with the same cost to ``L`` share one ``q``.  (This is tighter than ``q >= y + w - 1``: its LP relaxation
  charges a fractional ``w`` at least its cheapest conversion.)
- for such a value made in more than one layout, per read (consumer and operand position)
  ``e[o, L]`` in [0, 1] with both marginals (``sum_L e = y[o]``, ``sum_o e`` = the read's
  strategies taking ``L``), and ``q >= sum of e[o, L]`` over the ``o`` of each ``q``: the
  pairwise tie between the producer's layout and what each reader takes.  It adds no plan and
  removes none (at binary ``x`` each ``e`` is the product of a layout and a read); it removes
  fractional points where a value is made half in one layout and half in another and each
  reader takes, from the mix, whatever needs no conversion.  Without it the LP relaxation of a
  2-block Qwen3 forward on dp x tp with a replicated input was 35% below the optimum (each
  value mixed over its dp layouts R, S(0), S(1)) and HiGHS spent ~130 s in cuts at the root;
  with it the relaxation is the optimum and HiGHS proves the plan at the root in seconds.

Minimise compute + conversions.  At binary ``x`` the continuous ``w`` and ``q``
take exactly the values of :meth:`ShardProblem.total`, so the ILP optimum is the
exact optimum of the cost model.  The objective is in nanoseconds (seconds are
1e-12..1e1, too far apart for a solver's tolerances).
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager

import numpy as np

from parcomp.cost.memory import (MemoryLimitError, kernel_saved, kernel_saved_bytes, local_bytes, over_limit,
                                 resident_values)
from parcomp.errors import ParcompError
from parcomp.units import format_bytes

#: objective unit: nanoseconds
SCALE = 1e9
#: branch-and-bound nodes one solve may explore (deterministic, unlike a time limit)
MAX_NODES = 20_000
#: default time budget of one solve, seconds: only a safety net far above what the node
#: budget takes, so that a loaded machine (CI, tests in parallel) gets the same plan as an
#: idle one; at 10 s the GPT-2 dp2 x tp2 training step fell back to the heuristic plan under
#: a load of 10 on 2 cores
DEFAULT_SECONDS = 300.0
#: above this many strategies in all shard-prop keeps the heuristic's plan without calling
#: the solver: a 48-block training chain on dp x tp has 33,000 strategies (~370,000 columns),
#: whose root LP alone ran 10-45 s on a loaded 2-core machine and ended with the warm start;
#: every shipped spec but that one is below it (the largest, gpt2_lm_dp2_tp2_train: 9,436)
MAX_STRATEGIES = 12_000
#: above this many columns (strategies plus the conversion variables of every value) the
#: solver is not called either. A mesh with three axes multiplies every value's layouts: the
#: 2-block MLP training step of bench/mesh_compile_time.py on dp x sq x tp has 84,000-107,000
#: columns (30,000-33,000 rows) and took HiGHS 130-310 s on a loaded 2-core machine, a 6-linear
#: one 195,000 columns and over 300 s. The largest shipped spec (gpt2_lm_dp2_tp2_train: 61,464
#: columns, 23,622 rows) solves in ~10 s idle (29 s loaded). The column count grows with the
#: mesh's number of axes (layouts per value), not with its ranks (larger axes only rule out
#: layouts that do not divide).
MAX_COLUMNS = 75_000


def too_large(prob) -> bool:
    """Whether ``prob`` (a :class:`parcomp.passes.shard_prop.ShardProblem`) has more than MAX_STRATEGIES."""
    return sum(len(o) for o in prob.options.values()) > MAX_STRATEGIES


def solve_ilp(prob, warm: dict, seconds: float = DEFAULT_SECONDS, limit=None) -> tuple:
    """The least-cost plan of ``prob`` (a :class:`parcomp.passes.shard_prop.ShardProblem`), within ``seconds``.

    Args:
        prob: the problem (options per node, users, fixed source layouts).
        warm: a feasible plan ``{node: (in layouts, out layout)}`` (the heuristic's):
            the solver's start, and what it improves on when time runs out.
        seconds: wall-clock budget of the solver.
        limit: a :class:`MemoryLimit` (one more row), or None.

    Returns:
        ``(plan, proven)``: the best plan found and whether HiGHS proved it optimal; proven is
        None where the problem has over MAX_COLUMNS columns and the solver was not called
        (``prob.ilp_skipped_columns`` says how many).
    """
    import highspy

    model = _Model(prob)
    if model.base_columns > MAX_COLUMNS and limit is None:  # its root LP alone would outrun the budget
        prob.ilp_skipped_columns = model.base_columns
        return dict(warm), None
    model.tighten()
    if limit is not None:
        model.rows.append(limit.row(model.x))
    with _quiet_stdout():
        h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(seconds))  # a safety net: the node budget decides first
    # a deterministic budget (branch-and-bound nodes, not seconds): a cut-off plan is then the
    # same on every machine; the shipped specs solve at the root node
    h.setOptionValue("mip_max_nodes", MAX_NODES)
    h.setOptionValue("mip_rel_gap", 0.0)
    h.setOptionValue("mip_abs_gap", 1e-6)
    h.setOptionValue("presolve", "off")  # the rows are already minimal; presolve cost more than it saved
    h.setOptionValue("threads", 1)  # a compile is one process among many (tests, CI)
    # no feasibility-jump heuristic and no symmetry detection before the root: the warm start
    # is the incumbent and the root LP decides (every shipped spec solves at its root node);
    # on a plain dp=2 x tp=2 spec on a 2-block Qwen2 (59,300 columns) they were 40% of the
    # solve (1.2 -> 0.7 s CPU), and the plans are the same
    h.setOptionValue("mip_heuristic_run_feasibility_jump", False)
    h.setOptionValue("mip_detect_symmetry", False)
    model.load(h, highspy)
    start = highspy.HighsSolution()
    start.col_value = list(model.values(warm))
    start.value_valid = True
    h.setSolution(start)
    h.run()
    status = h.getModelStatus()
    if h.getInfo().primal_solution_status != 2:  # no feasible point: keep the warm start
        return dict(warm), False
    plan = model.plan(h.getSolution().col_value)
    return plan, status == highspy.HighsModelStatus.kOptimal


def lp_bound(prob) -> float:
    """The optimum of the integer program's LP relaxation (every ``x`` in [0, 1]), in seconds:
    a lower bound on the cost of every plan of ``prob``, and the bound HiGHS starts its
    branch-and-bound from. Where it equals the least plan's cost, the solver proves that plan
    optimal at its root node without cuts or branching."""
    import highspy

    model = _Model(prob)
    model.tighten()
    model.binary = [False] * len(model.binary)
    with _quiet_stdout():
        h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("presolve", "off")
    h.setOptionValue("threads", 1)
    model.load(h, highspy)
    h.run()
    return h.getInfo().objective_function_value / SCALE


class MemoryLimit:
    """The spec's ``memory`` as a constraint on a plan's resident bytes per rank
    (:mod:`parcomp.cost.memory`): the sources' fixed bytes plus each counted value's bytes
    under the layout its strategy produces (one linear row of the ILP).

    Raises (on construction):
        MemoryLimitError: even the smallest choice of every value exceeds the limit (``need``:
            that smallest resident total).
    """

    def __init__(self, prob, limit: int, loc=None):
        g, self.limit, self.loc = prob.g, limit, loc
        counted, saved = resident_values(g), kernel_saved(g)  # saved: an attention kernel's logsumexp
        self.fixed = sum(local_bytes(g[v].type, g[v].layout, g.mesh) for v in counted if v not in prob.options) + \
            sum(kernel_saved_bytes(g, v, g[v].layout) for v in saved if v not in prob.options)
        self.per = {v: [local_bytes(g[v].type, o, g.mesh) for _, _, o in prob.options[v]]
                    for v in counted if v in prob.options}
        for v in saved:
            if v in prob.options:
                got = [kernel_saved_bytes(g, v, o) for _, _, o in prob.options[v]]
                self.per[v] = [a + b for a, b in zip(self.per.get(v, [0] * len(got)), got)]
        self.index = {v: {opt[1:]: k for k, opt in enumerate(prob.options[v])} for v in self.per}
        least = self.fixed + sum(min(b) for b in self.per.values())
        if least > limit:
            raise MemoryLimitError(over_limit(limit, least, "the smallest layout plan (weights, inputs "
                                              "and saved activations, each split as far as it can be)")
                                   + "; use more ranks or a smaller batch", loc, need=least)

    def bytes(self, plan) -> int:
        """Resident bytes per rank of ``plan``."""
        return self.fixed + sum(self.per[v][self.index[v][plan[v]]] for v in self.per)

    def fits(self, plan) -> bool:
        return self.bytes(plan) <= self.limit

    def row(self, x) -> tuple:
        """The ILP row (in MiB: byte counts are too large for a solver's tolerances)."""
        return (-np.inf, (self.limit - self.fixed) / 2**20,
                {x[(v, k)]: b / 2**20 for v, bs in self.per.items() for k, b in enumerate(bs)})

    def not_found(self, seconds) -> ParcompError:
        return ParcompError(f"no layout plan within the memory limit {format_bytes(self.limit)} per "
                            f"rank was found in {seconds:g} s (the smallest possible is "
                            f"{format_bytes(self.fixed + sum(min(b) for b in self.per.values()))})", self.loc)


class _Model:
    """Columns and rows of the ILP, and the map between plans and column values."""

    def __init__(self, prob):
        self.prob = prob
        self.cost, self.ub, self.binary = [], [], []
        self.rows = []  # (lower, upper, {col: coef})
        self.x = {}     # (node, k) -> col
        self.aux = []   # (col, kind, data) for warm-start values
        for name, opts in prob.options.items():
            cols = [self._col(c * SCALE, binary=True) for c, _, _ in opts]
            self.x.update({(name, k): col for k, col in enumerate(cols)})
            self.rows.append((1.0, 1.0, {col: 1.0 for col in cols}))
        # per value read several times and made in several layouts: (value, produced,
        # {(consumer, operand position): {layout: [x cols]}}, {layout: [(its q col, {y cols})]})
        self.reads = []
        for n in prob.g.nodes:
            self._value(n.name)
        #: the columns before :meth:`tighten` (MAX_COLUMNS is a bound on these)
        self.base_columns = len(self.cost)

    def _col(self, cost, binary=False, ub=np.inf):
        self.cost.append(cost)
        self.ub.append(1.0 if binary else ub)
        self.binary.append(binary)
        return len(self.cost) - 1

    def _produced(self, name):
        """``{layout: [x cols producing it]}``, or ``{layout: None}`` for a fixed source."""
        if name not in self.prob.options:
            return {self.prob.g[name].layout: None}
        out = {}
        for k, (_, _, o) in enumerate(self.prob.options[name]):
            out.setdefault(o, []).append(self.x[(name, k)])
        return out

    def _wanted(self, name):
        """``{layout: {consumer: [x cols of its strategies reading name in layout]}}``."""
        want = {}
        for u in dict.fromkeys(self.prob.users[name]):
            pos = [p for p, i in enumerate(self.prob.g[u].inputs) if i == name]
            for k, (_, ins, _) in enumerate(self.prob.options[u]):
                for lay in {ins[p] for p in pos}:
                    want.setdefault(lay, {}).setdefault(u, []).append(self.x[(u, k)])
        return want

    def _value(self, name):
        ty = self.prob.g[name].type
        produced = self._produced(name)
        if len(self.prob.users[name]) == 1:
            return self._single_use(name, produced)
        wanted, shared = self._wanted(name), {}
        if len(produced) > 1:
            self.reads.append((name, produced, self._read_layouts(name), shared))
        for lay, by_user in wanted.items():
            costs = {o: self.prob.plan_cost(o, lay, ty, name) * SCALE for o in produced}
            if not any(costs.values()):
                continue
            if all(c == np.inf for c in costs.values()):  # no allowed way to read name in lay
                self._forbid(c for cols in by_user.values() for c in cols)
                continue
            single = len(produced) == 1
            w = self._col(next(iter(costs.values())) if single else 0.0, ub=1.0)
            self.aux.append((w, "w", [c for cols in by_user.values() for c in cols]))
            for cols in by_user.values():
                self.rows.append((0.0, np.inf, {w: 1.0, **{c: -1.0 for c in cols}}))
            if single:
                continue
            share, levels = {w: -1.0}, {}
            for o, cost in costs.items():  # one q per distinct cost: the same optimum, fewer columns
                levels.setdefault(cost, []).extend(produced[o])
            levels.pop(np.inf, None)  # a forbidden conversion has no column: w needs another o
            for cost, ys in levels.items():
                q = self._col(cost, ub=1.0)
                share[q] = 1.0
                self.aux.append((q, "q", (w, ys)))
                self.rows.append((-np.inf, 0.0, {q: 1.0, **{c: -1.0 for c in ys}}))
                shared.setdefault(lay, []).append((q, set(ys)))
            self.rows.append((0.0, 0.0, share))

    def _read_layouts(self, name):
        """``{(consumer, operand position): {layout: [x cols of its strategies reading name there
        in layout]}}``: one entry per read (a consumer reading ``name`` twice has two)."""
        out = {}
        for u in dict.fromkeys(self.prob.users[name]):
            for p, i in enumerate(self.prob.g[u].inputs):
                if i != name:
                    continue
                by_lay = out.setdefault((u, p), {})
                for k, (_, ins, _) in enumerate(self.prob.options[u]):
                    by_lay.setdefault(ins[p], []).append(self.x[(u, k)])
        return out

    def tighten(self):
        """Add the pairwise ``e[o, L]`` of every read of a value read several times and made in
        more than one layout (see the module docstring): valid for every plan, and the LP
        relaxation then no longer lets each reader take the fraction it likes of a mixed value."""
        for name, produced, reads, shared in self.reads:
            ty = self.prob.g[name].type
            for wanted in reads.values():
                by_out, by_lay, link = {o: {} for o in produced}, {lay: {} for lay in wanted}, {}
                for o, ys in produced.items():
                    for lay, zs in wanted.items():
                        if self.prob.plan_cost(o, lay, ty, name) == np.inf:  # forbidden: no column
                            continue
                        e = self._col(0.0, ub=1.0)
                        self.aux.append((e, "e", (ys, zs)))
                        by_out[o][e] = by_lay[lay][e] = 1.0
                        for q, qys in shared.get(lay, ()):  # the q that pays o -> lay
                            if ys[0] in qys:
                                link.setdefault(q, {})[e] = -1.0
                for q, row in link.items():
                    self.rows.append((0.0, np.inf, {q: 1.0, **row}))
                for coefs, sides in ((by_out, produced), (by_lay, wanted)):
                    for key, row in coefs.items():
                        self.rows.append((0.0, 0.0, {**row, **{c: -1.0 for c in sides[key]}}))

    def _single_use(self, name, produced):
        """A value read once: the conversion is a pairwise term between its layout and the
        one its consumer wants.  One layout produced: added to the consumer's strategy costs;
        else ``e[o, L]`` with both marginals (``sum_L e = y[o]``, ``sum_o e = z[L]``), whose
        LP relaxation is exact where the graph is a tree."""
        ty = self.prob.g[name].type
        wanted = {lay: cols for lay, by_user in self._wanted(name).items() for cols in by_user.values()}
        if len(produced) == 1:
            (o,) = produced
            for lay, cols in wanted.items():
                cost = self.prob.plan_cost(o, lay, ty, name) * SCALE
                if cost == np.inf:
                    self._forbid(cols)
                for c in cols:
                    self.cost[c] += 0.0 if cost == np.inf else cost
            return
        by_out = {o: {} for o in produced}
        by_lay = {lay: {} for lay in wanted}
        for o, ys in produced.items():
            for lay, zs in wanted.items():
                cost = self.prob.plan_cost(o, lay, ty, name) * SCALE
                if cost == np.inf:  # forbidden: no column, so o and lay never meet
                    continue
                e = self._col(cost, ub=1.0)
                self.aux.append((e, "e", (ys, zs)))
                by_out[o][e] = by_lay[lay][e] = 1.0
        for coefs, sides in ((by_out, produced), (by_lay, wanted)):
            for key, row in coefs.items():
                self.rows.append((0.0, 0.0, {**row, **{c: -1.0 for c in sides[key]}}))

    def _forbid(self, cols):
        """Strategies whose conversion is forbidden (infinite cost) are never chosen."""
        for c in cols:
            self.ub[c] = 0.0

    def load(self, h, highspy):
        """Pass the columns, integrality and rows to the solver ``h``."""
        n = len(self.cost)
        h.addCols(n, np.array(self.cost), np.zeros(n), np.array(self.ub), 0,
                  np.array([], dtype=np.int32), np.array([], dtype=np.int32), np.array([]))
        ints = np.array([i for i, b in enumerate(self.binary) if b], dtype=np.int32)
        h.changeColsIntegrality(len(ints), ints, np.array([highspy.HighsVarType.kInteger] * len(ints)))
        starts, index, value = [], [], []
        for _, _, coefs in self.rows:
            starts.append(len(index))
            index += coefs.keys()
            value += coefs.values()
        h.addRows(len(self.rows), np.array([r[0] for r in self.rows]), np.array([r[1] for r in self.rows]),
                  len(index), np.array(starts, dtype=np.int32), np.array(index, dtype=np.int32),
                  np.array(value, dtype=float))

    def values(self, plan):
        """Column values of ``plan`` (a feasible point: the warm start)."""
        vals = np.zeros(len(self.cost))
        for (name, k), col in self.x.items():
            c, ins, out = self.prob.options[name][k]
            vals[col] = 1.0 if plan[name] == (ins, out) else 0.0
        for col, kind, data in self.aux:  # w before the q that read it (creation order)
            if kind == "w":
                vals[col] = max((vals[c] for c in data), default=0.0)
            elif kind == "e":
                ys, zs = data
                vals[col] = min(sum(vals[c] for c in ys), sum(vals[c] for c in zs))
            else:
                w, ys = data
                vals[col] = min(vals[w], sum(vals[c] for c in ys))
        return vals

    def plan(self, col_value):
        """The plan of a solver point: each node's strategy with the largest ``x``."""
        plan = {}
        for name, opts in self.prob.options.items():
            k = max(range(len(opts)), key=lambda k: col_value[self.x[(name, k)]])
            plan[name] = opts[k][1:]
        return plan


@contextmanager
def _quiet_stdout():
    """HiGHS prints its banner on file descriptor 1 when the first solver is made."""
    sys.stdout.flush()
    fd = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(fd, 1)
        os.close(fd)

