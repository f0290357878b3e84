"""Hypothesis properties: sharded == unsharded, redistribution, text round trip."""
import numpy as np
from hypothesis import given, strategies as st

from parcomp.check.check64 import promote_compiled, promote_feeds
from parcomp.compile.compiler import compile_graph
from parcomp.ir import Mesh, P, R, Shard, TensorType, parse_graph, print_graph
from parcomp.ir.graph import Graph, Node, make_attrs
from parcomp.ir.types import divisibility_problem
from parcomp.passes.insert_collectives import insert_collectives
from parcomp.passes.localize import localize
from parcomp.reference.assemble import assemble
from parcomp.reference.interpreter import run_spmd, split_for_ranks
from parcomp.reference.numpy_ops import run_unsharded

from graphs import mlp_graph, random_feeds, spec
from numerics import assert_equivalent

MESHES = ["tp=1", "tp=2", "tp=4", "dp=2 tp=2"]
WORDS = ["colwise", "rowwise", "replicated"]


@st.composite
def mlp_case(draw):
    nlin = draw(st.integers(1, 4))
    dims = [draw(st.sampled_from([4, 8, 12])) for _ in range(nlin + 1)]
    bias = [draw(st.booleans()) for _ in range(nlin)]
    acts = [draw(st.sampled_from(["relu", "gelu", "tanh", "none"])) for _ in range(nlin)]
    batch = draw(st.sampled_from([(4,), (4, 4), (2, 8)]))
    mesh = draw(st.sampled_from(MESHES))
    axes = [a.split("=")[0] for a in mesh.split()]
    rules = []
    for i in range(nlin):
        w = draw(st.sampled_from(WORDS))
        rules.append(f"l{i}.weight {w} over {draw(st.sampled_from(axes))}")
    inp = draw(st.sampled_from(["replicated", "split-hidden", "partial-sum"]
                               + (["[S(0), R]", "[P, S(0)]"] if len(axes) == 2 else [])))
    out = draw(st.sampled_from(["replicated", "split-hidden", "split-seq"]))
    text = f"mesh {mesh}\n" + "\n".join(rules) + f"\ninput x {inp}\noutput output {out}\n"
    torch_layout = draw(st.booleans())
    return mlp_graph(batch, dims, bias, acts, torch_layout=torch_layout), text


@given(mlp_case(), st.integers(0, 2**16))
def test_random_mlp_sharded_equals_unsharded(case, seed):
    """``parcomp check``'s comparison: the program and the unsharded graph in float64, within
    the threshold of the output's scale (parcomp/check/differential.py)."""
    g, text = case
    wide = promote_compiled(compile_graph(g, spec(text)))
    feeds = promote_feeds(random_feeds(g, seed))
    # partial-sum inputs are split with random sign-varying offsets per rank, so a
    # nonlinear op applied before the reduction would give a visibly wrong answer
    run = run_spmd(wide.program, feeds, partial_rng=np.random.default_rng(seed))
    want = run_unsharded(wide.unsharded, feeds)["output"]
    assert_equivalent(run.outputs(wide.program)["output"], want)


def _placements(rank):
    return st.sampled_from([R, P] + [Shard(d) for d in range(rank)])


@st.composite
def redistribution_case(draw):
    mesh = Mesh(tuple(draw(st.sampled_from([(("a", 2),), (("a", 4),), (("a", 2), ("b", 2)),
                                            (("a", 2), ("b", 3))]))))
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.sampled_from([12, 24])) for _ in range(rank))
    ty = TensorType(shape, "float64")
    src = tuple(draw(_placements(rank)) for _ in mesh.axes)
    tgt = tuple(draw(_placements(rank)) for _ in mesh.axes)
    return mesh, ty, src, tgt


@given(redistribution_case(), st.integers(0, 2**16))
def test_planned_redistribution_gives_target_shard_on_every_rank(case, seed):
    mesh, ty, src, tgt = case
    g = Graph((Node("x", "input", (), ty, (), src),
               Node("y", "relayout", ("x",), ty, (), tgt, (tgt,))), ("y",), mesh)
    prog = localize(insert_collectives(g))
    rng = np.random.default_rng(seed)
    full = rng.standard_normal(ty.shape)
    run = run_spmd(prog, {"x": full}, partial_rng=rng)
    # every rank holds exactly its block of the target layout (up to the partial split)
    want = split_for_ranks(full, tgt, mesh)
    out = prog.outputs[0]
    if any(p == P for p in tgt):
        got = assemble([e[out] for e in run.env], tgt, ty.shape, mesh, "float64")
        assert_equivalent(got, full)
    else:
        for r in range(mesh.size):
            assert_equivalent(run.env[r][out], want[r], what=f"rank {r}")


@given(mlp_case())
def test_text_round_trip_at_every_stage(case):
    g, text = case
    stages = []
    compile_graph(g, spec(text), after=lambda name, graph: stages.append(graph))
    for graph in [g] + stages:
        txt = print_graph(graph)
        again = parse_graph(txt)
        assert again == graph
        assert print_graph(again) == txt
