"""shard-prop's local moves (:mod:`parcomp.passes.shard_prop`, search step 2): from a starting plan, a node
re-picks its strategy, operands computed only for it following, while that strictly lowers
the plan's cost.

:class:`LocalMoves` is a base of :class:`parcomp.passes.shard_prop.ShardProblem` and reads its state:
``g``, ``users``, ``options``, the caches ``_moves``, ``_fit``, ``_reads``, and its costs
(:meth:`~parcomp.passes.shard_prop.ShardProblem.value_cost`, ``plan_cost``, ``compute_cost``, ``_read_info``).
"""
from __future__ import annotations


class LocalMoves:
    """The local-move improvement of a plan (``{node: (in layouts, out layout)}``)."""

    def improve(self, sol, rounds: int = 8) -> dict:
        """Apply strictly improving moves (see :meth:`_best_move`) until none is left.

        A node whose last move attempt kept nothing, and none of whose neighbourhood
        (:meth:`_hood`: what that attempt read) changed since, is skipped: the attempt
        would read the same state and keep nothing again, so the plan is the one trying
        every node every round gives, in time linear in the moves made."""
        sol, hoods = dict(sol), {}
        for n in self.g.nodes:
            if n.name in sol:
                hoods[n.name] = self._hood(self._parts_of(sol, n))
        readers = {}  # name -> the nodes whose move reads its strategy
        for name, (_, reads) in hoods.items():
            for m in reads:
                readers.setdefault(m, []).append(name)
        dirty = set(hoods)
        for _ in range(rounds):
            changed = False
            for n in reversed(self.g.nodes):
                if n.name not in dirty:
                    continue
                if self._best_move(sol, n):
                    changed = True
                    for m in hoods[n.name][0]:
                        dirty.update(readers.get(m, ()))
                else:
                    dirty.discard(n.name)
            if not changed:
                break
        return sol

    def _hood(self, parts):
        """``(moved, reads)`` of a move with :meth:`_parts` ``parts``: the nodes it may
        re-pick and every node whose strategy it reads (those, the values it prices and
        their readers; not the readers of a value whose cost they cannot change, see
        :meth:`_read_info`)."""
        _, touched, moved = parts
        return moved, set(moved) | set(touched) | {u for v in touched if not self._info(v)[4]
                                                   for u in self.users[v]}

    def _info(self, name) -> tuple:
        info = self._reads.get(name)
        if info is None:
            info = self._reads[name] = self._read_info(name)
        return info

    def _parts_of(self, sol, n):
        """:meth:`_parts` of ``n``, kept (a plan always has the same nodes: the options')."""
        parts = self._moves.get(n.name)
        if parts is None:
            parts = self._moves[n.name] = self._parts(sol, n)
        return parts

    def _parts(self, sol, n):
        """``(feeders, touched, moved)``: ``n``'s operands made only for it (with their
        operand positions), the values whose conversions a move at ``n`` prices (a tuple,
        in the order of the set they form) and the nodes it may re-pick."""
        feeders = [i for i in dict.fromkeys(n.inputs) if i in sol and len(self.users[i]) == 1]
        touched = set(n.inputs) | {n.name} | {j for i in feeders for j in self.g[i].inputs}
        return [(i, n.inputs.index(i)) for i in feeders], tuple(touched), [n.name] + feeders

    def _best_move(self, sol, n) -> bool:
        """Re-pick ``n``'s strategy; an operand made only for ``n`` may change with it
        (to produce exactly the layout ``n`` then wants).  Keeps strict gains only.

        The option ``n`` already has, with every feeder already producing what it wants,
        is the current state itself: its cost is the starting cost, no strict gain, so it
        is not priced again."""
        feeders, touched, moved = self._parts_of(sol, n)
        cur = sol[n.name]
        if not feeders and all(ins is cur[0] and out is cur[1] for _, ins, out in self.options[n.name]):
            return False  # every option is the current state (no feeder to change): nothing to price
        compute, value_cost = self.compute_cost, self.value_cost

        def local():
            return sum(compute(sol, m) for m in moved) + sum(value_cost(sol, v) for v in touched)

        keep = {m: sol[m] for m in moved}
        best, best_cost = dict(keep), local()
        for _, ins, out in self.options[n.name]:
            sol.update(keep)
            sol[n.name] = (ins, out)
            same = ins is cur[0] and out is cur[1]
            for i, k in feeders:
                want = ins[k]
                fits = self._fits(i, want)
                if fits and sol[i][1] is not want:
                    sol[i] = min(fits, key=lambda f: self._feeder_cost(sol, i, f))[1:]
                    same = False
            if same:
                continue
            cost = local()
            if cost < best_cost - 1e-13:
                best, best_cost = {m: sol[m] for m in moved}, cost
        sol.update(best)
        return best != keep

    def _fits(self, name, want) -> list:
        """``name``'s options that produce ``want`` (interned), in option order."""
        opts = self.options[name]
        key = (id(opts), id(want))
        fits = self._fit.get(key)
        if fits is None:
            fits = self._fit[key] = [(c, i_ins, o) for c, i_ins, o in opts if o is want]
        return fits

    def _feeder_cost(self, sol, i, option):
        c, ins, out = option
        return c + sum(self.plan_cost(self.layout(sol, j), lay, self.g[j].type, j)
                       for j, lay in zip(self.g[i].inputs, ins))
