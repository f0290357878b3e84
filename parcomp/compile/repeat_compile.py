"""Block-plan reuse: compile a few blocks, stamp the plan onto all of them.

For a model of ``N`` repeated blocks (:mod:`parcomp.compile.repeat`) whose whole graph shard-prop
would search with its heuristic (over MAX_STRATEGIES), the one pass list
(:mod:`parcomp.passes.pass_list`) runs on the model cut to :data:`REDUCED` blocks, its shard-prop forced to the same heuristic, and the stages
the compiler keeps (``logical``, ``sharded``, ``program``) are stamped to ``N`` blocks
(:mod:`parcomp.compile.repeat_stamp`). Checks, any failing -> None (the caller compiles the whole
graph), the cheap ones before the reduced compile's shard-prop: the stamped input graph equals
the model's graph node for node (names, module paths, phases, attributes); the whole graph is
over MAX_STRATEGIES (its own search would be the heuristic; counted from the reduced problem's
per-node option lists) and the plan keeps data parallel; every stage stamped has the shape
``repeat_stamp.fits`` needs and is SSA with operands made before use; the stamped program
passes the verifier. The search record's cost is ``ShardProblem.total``'s sum in the whole
graph's order (the report's ``cost_s``). ``tests/compile/test_block_reuse.py`` checks program.py,
the report and the .pcir stages are byte-identical to the whole-graph compile's.
"""
from __future__ import annotations

import math

from ..ir.graph import Graph
from ..passes.pass_list import run_passes
from ..passes.search.keep_dp import prune
from ..passes.search.layout_ilp import MAX_STRATEGIES
from ..passes.shard_prop import ShardProblem
from ..passes.verify import verify
from .repeat import find_blocks, reduced, spec_names_a_block
from .repeat_stamp import Stamper, fits, stamp, stamp_order

#: blocks of the reduced model: 0 and 1, the template (repeat_stamp.TEMPLATE), two after it
REDUCED = 5


def reuse_fits(spec) -> bool:
    """Whether the spec allows reuse: no pipeline (``pp``, stages), memory limit, context
    parallel or MoE (each makes blocks differ or the plan global)."""
    return not ("pp" in spec.mesh.names or getattr(spec, "stages", ()) or spec.memory is not None
                or getattr(spec, "context_parallel", None) is not None
                or getattr(spec, "moe", None) is not None)


def reused_stages(graph: Graph, spec, passes) -> dict | None:
    """``{pass name: graph}`` for the stages ``parcomp.compile.compiler`` reads (``input``, the
    logical stage, ``shard-prop``, ``insert-collectives``, the last), built by stamping a
    reduced compile of ``passes`` (the pass list of ``spec``), or None where reuse does not apply or a check fails (module docstring).
    A lowering pass whose reduced output does not stamp (``bucket-dp-grads``: its buckets of
    every block's gradients are cut by byte size) runs, with the passes after it, on the whole
    stamped graph before it (verified, as the pipeline does); sequence parallel's norm-gradient
    bucket stamps (:mod:`parcomp.compile.repeat_bucket`). The final stage is verified (the copies of a
    template node are alike to it: the verifier checks one of them, ``verify``'s keys).

    Raises:
        ParcompError: what the reduced compile raises (a spec/model mismatch shows there as
            it would in the whole compile).
    """
    blocks = find_blocks(graph)
    if blocks is None or blocks.n <= REDUCED or spec_names_a_block(spec, blocks, graph):
        return None
    try:
        small = reduced(graph, blocks, REDUCED)
    except ValueError:
        return None
    st = Stamper(blocks, REDUCED)
    inp = stamp(st, small, blocks.n)
    if inp is None or not _same(inp, graph):  # the blocks are not alike
        return None
    names = [p.name for p in passes]
    first = names.index("shard-prop")
    stages = run_passes(small, spec, passes[:first], heuristic=True)
    before = stages[names[first - 1]]
    order = stamp_order(st, before, blocks.n) if fits(st, before) else None
    whole = None if order is None else _whole_problem(before, order)
    if whole is None:  # the whole graph's search would be the ILP (or gather the batch)
        return None
    later = run_passes(before, spec, passes[first:], heuristic=True, problem=whole[0])  # the reduced plan
    later.pop("input")
    stages.update(later)
    search = stages["shard-prop"].search
    if search.get("search") != "heuristic" or not search.get("data_parallel"):
        return None
    good = next((k for k, name in enumerate(names) if (k == 0 or stages[name] is not stages[names[k - 1]])
                 and not fits(st, stages[name])), len(names))  # a pass that changed nothing: as before
    if good <= first + 1:  # the plan or its collectives do not stamp
        return None
    info = _search_info(*whole, stages["shard-prop"], order, search)
    if info is None:
        return None
    logical = names[first - 1]  # the logical stage: the one before shard-prop (pass_list.logical_stage)
    keep = dict.fromkeys([logical, "insert-collectives", names[good - 1]])
    out = {"input": graph}
    planned = names[first:good]
    for key in keep:
        got = stamp(st, stages[key], blocks.n, **({"search": info} if key in planned else {}))
        if got is None:
            return None
        out[key] = got
    if good < len(names):  # the rest of the lowering on the whole graph
        rest = run_passes(out[names[good - 1]], spec, passes[good:])
        rest.pop("input")
        out.update(rest)
    else:
        verify(out[names[-1]])  # copies are alike to their template node: checked once (verify's keys)
    return out


def _whole_problem(before: Graph, order: list) -> tuple | None:
    """``(problem, strategies)``: shard-prop's problem of the reduced graph ``before`` (after
    the data-parallel pruning, as shard_prop does) and the strategy count of the whole graph
    (``order``: for each of its nodes the index of the reduced node it is stamped from, see
    :func:`stamp_order`); None where the whole graph is not over MAX_STRATEGIES (its search
    is the ILP: reuse does not apply) or data parallel cannot be kept."""
    prob = ShardProblem(before)
    if prob.batch and not prune(prob):
        return None
    names = [before.nodes[k].name for k in order]
    count = sum(len(prob.options[name]) for name in names if name in prob.options)
    return (prob, count) if count > MAX_STRATEGIES else None


def _search_info(prob, count: int, planned: Graph, order: list, small: dict) -> dict | None:
    """shard-prop's ``search`` record of the stamped plan of the whole graph (None where it
    breaks data parallel). ``prob``, ``count``: :func:`_whole_problem`'s; ``planned``: the
    reduced model's shard-prop stage.

    The cost is ``ShardProblem.total``'s sum over the whole graph, in program order (as shard_prop
    prices it), of each node's compute and conversion terms, a stamped node's being its reduced
    original's (same op, types, layouts and readers' layouts)."""
    canon, nodes = prob.intern, prob.g.nodes
    sol = {x.name: (tuple(canon(lay) for lay in x.in_layouts), canon(x.layout))
           for x in planned.nodes if x.name in prob.options}
    compute = {name: prob.compute_cost(sol, name) for name in sol}
    value = [prob.value_cost(sol, x.name) for x in nodes]
    names = [nodes[k].name for k in order]
    cost = sum(compute[name] for name in names if name in compute) + sum(value[k] for k in order)
    if math.isinf(cost):
        return None
    return {"search": "heuristic", "proven_optimal": False, "cost_s": cost,
            "seconds": small["seconds"], "data_parallel": True, "solver_skipped": count}


def _same(a: Graph, b: Graph) -> bool:
    """Node for node equal, with the fields equality leaves out (phase, module path, spec
    location), and the same outputs."""
    if a.nodes != b.nodes or a.outputs != b.outputs or a.output_names != b.output_names:
        return False
    return all(x.phase == y.phase and x.source == y.source and x.spec_loc == y.spec_loc
               for x, y in zip(a.nodes, b.nodes))
