"""Block-plan reuse (issue 17): compile a few blocks, stamp the plan onto all of them.

For a model of ``N`` repeated blocks (:mod:`parcomp.repeat`) whose whole graph shard-prop
would search with its heuristic (over MAX_STRATEGIES), the pass pipeline runs on the model
cut to :data:`REDUCED` blocks, its shard-prop forced to the same heuristic, and the stages
the compiler keeps (``logical``, ``shard-prop``, ``sharded``, ``program``) are stamped to ``N``
blocks (:mod:`parcomp.repeat_stamp`). Checks, any failing -> None (the caller compiles the
whole graph): the stamped input graph equals the model's graph node for node (names,
module paths, phases, attributes); every stamped stage is SSA with operands made before use;
the whole graph is over MAX_STRATEGIES (its own search would be the heuristic) and the
stamped plan keeps data parallel; the plan's cost is that of the whole graph, priced by
shard-prop's own ``_Problem.total`` (the report's ``cost_s``); the stamped program passes the
verifier. ``tests/test_block_reuse.py`` checks program.py, the report and the .pcir stages are
byte-identical to the whole-graph compile's.
"""
from __future__ import annotations

import math

from .ir.graph import Graph
from .passes.keep_dp import prune
from .passes.layout_ilp import MAX_STRATEGIES
from .passes.manager import forward_pipeline, run_pipeline
from .passes.shard_prop import _Problem
from .passes.verify import verify
from .repeat import find_blocks, reduced, spec_names_a_block
from .repeat_stamp import Stamper, fits, stamp, stamp_order

#: blocks of the reduced model: 0 and 1, the template (repeat_stamp.TEMPLATE), two after it
REDUCED = 5


def reuse_fits(spec, moe_changes) -> bool:
    """Whether the spec allows reuse: no pipeline (``pp``, stages), memory limit, context
    parallel or MoE (each makes blocks differ or the plan global)."""
    return not ("pp" in spec.mesh.names or getattr(spec, "stages", ()) or spec.memory is not None
                or getattr(spec, "context_parallel", None) is not None
                or getattr(spec, "moe", None) is not None or moe_changes)


def reused_stages(graph: Graph, spec) -> dict | None:
    """``{pass name: graph}`` for the stages ``parcomp.compiler`` reads (``input``, the
    logical stage, ``shard-prop``, ``insert-collectives``, the last), built by stamping a
    reduced compile, or None where reuse does not apply or a check fails (module docstring).
    A lowering pass whose reduced output does not stamp (a bucket of every block's gradients:
    ``bucket-norm-grads`` under sequence parallel, ``bucket-dp-grads``) runs, with the passes
    after it, on the whole stamped graph before it (verified, as the pipeline does).

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
    passes = forward_pipeline(spec, heuristic=True)
    stages = run_pipeline(small, passes)
    search = stages["shard-prop"].search
    if search.get("search") != "heuristic" or not search.get("data_parallel"):
        return None
    st = Stamper(blocks, REDUCED)
    inp = stamp(st, small, blocks.n)
    if inp is None or not _same(inp, graph):
        return None
    names = [p.name for p in passes]
    first = names.index("shard-prop")
    good = next((k for k, name in enumerate(names) if not fits(st, stages[name])), len(names))
    if good <= first + 1:  # the plan or its collectives do not stamp
        return None
    logical = "autodiff" if "autodiff" in stages else "bind-layouts"
    order = stamp_order(st, stages[names[first - 1]], blocks.n)
    info = _search_info(stages[names[first - 1]], stages["shard-prop"], order, search)
    if info is None:
        return None
    keep = dict.fromkeys([logical, "insert-collectives", names[good - 1]])
    out = {"input": graph}
    planned = names[first:good]
    for key in keep:
        got = stamp(st, stages[key], blocks.n, **({"search": info} if key in planned else {}))
        if got is None:
            return None
        out[key] = got
    if good < len(names):  # the rest of the lowering on the whole graph
        rest = run_pipeline(out[names[good - 1]], passes[good:])
        rest.pop("input")
        out.update(rest)
    else:
        verify(out[names[-1]])
    return out


def _search_info(before: Graph, planned: Graph, order: list, small: dict) -> dict | None:
    """shard-prop's ``search`` record of the stamped plan of the whole graph, or None where
    the whole graph is small enough for the ILP (its search would not be the heuristic) or
    the plan breaks data parallel.

    ``before``/``planned``: the reduced model's stages before and after shard-prop; ``order``:
    for each node of the whole graph the index of the reduced node it was stamped from
    (:func:`stamp_order`). The cost is ``_Problem.total``'s sum over the whole graph, in
    program order (as shard_prop prices it), of each node's compute and conversion terms, a
    stamped node's being its reduced original's (same op, types, layouts and readers' layouts);
    the strategy count likewise (after the data-parallel pruning, as shard_prop counts)."""
    prob = _Problem(before)
    if prob.batch and not prune(prob):
        return None
    canon, nodes = prob._intern, before.nodes
    sol = {x.name: (tuple(canon(lay) for lay in x.in_layouts), canon(x.layout))
           for x in planned.nodes if x.name in prob.options}
    compute = {name: prob._compute(sol, name) for name in sol}
    value = [prob.value_cost(sol, x.name) for x in nodes]
    names = [nodes[k].name for k in order]
    count = sum(len(prob.options[name]) for name in names if name in prob.options)
    if count <= MAX_STRATEGIES:
        return None
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
