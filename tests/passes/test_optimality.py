"""shard-prop's choice equals brute-force enumeration of every strategy on small chains."""
import itertools

from hypothesis import given, settings, strategies as st

from parcomp.ir.redistribute import plan_cost
from parcomp.passes.pass_list import bind_layouts
from parcomp.passes.shard_prop import shard_prop
from parcomp.rules.sharding import mesh_strategies

from graphs import mlp_graph, spec


def total_cost(graph) -> float:
    """Sum of redistribution costs over every edge of a layout-annotated graph."""
    cost = 0.0
    for n in graph.nodes:
        if n.in_layouts is None:
            continue
        for i, lay in zip(n.inputs, n.in_layouts):
            cost += plan_cost(graph[i].layout, lay, graph[i].type, graph.mesh)
    return cost


def brute_force(graph) -> float:
    compute = [n for n in graph.nodes if n.op not in ("input", "param")]
    options = []
    for n in compute:
        opts = mesh_strategies(n, [graph[i].type for i in n.inputs], graph.mesh)
        if n.layout is not None:
            opts = [o for o in opts if o[1] == n.layout]
        options.append(opts)
    layout = {n.name: n.layout for n in graph.nodes if n.op in ("input", "param")}
    best = None
    for combo in itertools.product(*options):
        out = dict(layout)
        cost = 0.0
        for n, (ins, o) in zip(compute, combo):
            out[n.name] = o
            for i, lay in zip(n.inputs, ins):
                cost += plan_cost(out[i], lay, graph[i].type, graph.mesh)
        best = cost if best is None else min(best, cost)
    return best


@settings(max_examples=15)
@given(st.integers(1, 2), st.lists(st.sampled_from(["colwise", "rowwise", "replicated"]), min_size=2,
                                   max_size=2),
       st.sampled_from(["replicated", "split-hidden"]), st.sampled_from(["replicated", "split-seq",
                                                                          "split-hidden"]),
       st.sampled_from(["relu", "none"]))
def test_shard_prop_matches_brute_force(nlin, words, inp, out, act):
    g = mlp_graph((4,), [4] * (nlin + 1), [False] * nlin, [act] * nlin)
    text = "mesh tp=2\n" + "".join(f"l{i}.weight {words[i]}\n" for i in range(nlin))
    bound = bind_layouts(g, spec(text + f"input x {inp}\noutput output {out}\n"))
    chosen = shard_prop(bound)
    assert abs(total_cost(chosen) - brute_force(bound)) < 1e-12
