"""Canonical patterns: exact collectives (kind, axis, dim, local shape) and exact values."""
import numpy as np
import pytest

from parcomp.compile.compiler import compile_graph
from parcomp.errors import ParcompError, VerifyError
from parcomp.ir import P, R, Shard, parse_graph
from parcomp.passes.verify import verify
from parcomp.reference.interpreter import run_spmd, split_for_ranks
from parcomp.reference.numpy_ops import run_unsharded

from parcomp.check.differential import compare

from graphs import megatron_spec, mlp_graph, random_feeds, spec
from numerics import assert_equivalent, rtol_of

TINY = """\
%x: f32[1,2] = input()
%fc1.weight: f32[4,2] = param()
%fc1.wt: f32[2,4] = permute(%fc1.weight) {perm=(1, 0)}
%h: f32[1,4] = matmul(%x, %fc1.wt)
%r: f32[1,4] = relu(%h)
%fc2.weight: f32[2,4] = param()
%fc2.wt: f32[4,2] = permute(%fc2.weight) {perm=(1, 0)}
%output: f32[1,2] = matmul(%r, %fc2.wt)
return %output
"""
W1 = np.array([[1, 2, 0, 1], [0, 1, 3, 2]], "f4")
W2 = np.array([[1, 0], [0, 1], [1, 1], [2, 0]], "f4")
TINY_FEEDS = {"x": np.array([[1, 2]], "f4"), "fc1.weight": W1.T, "fc2.weight": W2.T}


def collectives(run):
    return [(c["kind"], c["axis"], c["dim"], c["local_shape"]) for c in run.log]


def test_worked_example_exact():
    c = compile_graph(parse_graph(TINY), spec(
        "mesh tp=2\nfc1.weight colwise\nfc2.weight rowwise\ninput x replicated\noutput output replicated"))
    run = run_spmd(c.program, TINY_FEEDS)
    assert [e["h"].tolist() for e in run.env] == [[[1, 4]], [[6, 5]]]  # column-split fc1
    assert [e["r"].tolist() for e in run.env] == [[[1, 4]], [[6, 5]]]  # relu on the local shard
    assert [e["output"].tolist() for e in run.env] == [[[1, 4]], [[16, 6]]]  # partial sums
    assert run.outputs(c.program)["output"].tolist() == [[17, 10]]
    assert collectives(run) == [("all_reduce", "tp", None, (1, 2))]


def test_worked_example_hidden_forced_replicated_gathers_by_concat():
    c = compile_graph(parse_graph(TINY), spec(
        "mesh tp=2\nfc1.weight colwise\nfc2.weight rowwise\nactivation h replicated\n"))
    run = run_spmd(c.program, TINY_FEEDS)
    gathered = [n for n in c.program.nodes if n.op == "all_gather"]
    assert len(gathered) == 1 and gathered[0].inputs == ("h",)
    assert [e[gathered[0].name].tolist() for e in run.env] == [[[1, 4, 6, 5]]] * 2  # concat, not sum
    assert run.outputs(c.program)["output"].tolist() == [[17, 10]]
    assert [k for k, *_ in collectives(run)] == ["all_gather", "all_reduce"]


@pytest.mark.parametrize("torch_layout", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_megatron_mlp_one_all_reduce(torch_layout, bias):
    g = mlp_graph((2, 8), [16, 64, 16], [bias, bias], ["gelu"], torch_layout=torch_layout)
    c = compile_graph(g, megatron_spec())
    feeds = random_feeds(g)
    run = run_spmd(c.program, feeds)
    assert collectives(run) == [("all_reduce", "tp", None, (2, 8, 16))]
    assert_equivalent(run.outputs(c.program)["output"], run_unsharded(g, feeds)["output"])


def test_megatron_mlp_sequence_parallel_output_is_one_reduce_scatter():
    g = mlp_graph((8, 4), [16, 64, 16], [True, True], ["relu"])
    c = compile_graph(g, megatron_spec(output="split-seq"))
    feeds = random_feeds(g)
    run = run_spmd(c.program, feeds)
    # tokens [8, 4, 16]: split-seq is dim 1 (the dim before hidden)
    assert collectives(run) == [("reduce_scatter", "tp", 1, (8, 4, 16))]
    assert_equivalent(run.outputs(c.program)["output"], run_unsharded(g, feeds)["output"])


def test_row_parallel_bias_added_once_after_the_sum():
    g = mlp_graph((4,), [4, 8, 4], [False, True], ["relu"])
    c = compile_graph(g, megatron_spec())
    ops = [n.op for n in c.sharded.nodes]
    assert ops.index("all_reduce") < ops.index("add")  # bias after the reduction
    feeds = {k: np.round(v * 4) for k, v in random_feeds(g, seed=3).items()}
    feeds["l1.bias"] = np.array([1, 2, 3, 4], "f4")
    run = run_spmd(c.program, feeds)
    np.testing.assert_array_equal(run.outputs(c.program)["output"], run_unsharded(g, feeds)["output"])


def test_bias_added_on_every_rank_is_caught():
    """Hand-written IR that adds the row-parallel bias to the partial sums on every rank."""
    bad = parse_graph("""\
mesh tp=2
%x: f32[1,4] [S(1)] = input()
%w: f32[4,2] [S(0)] = param()
%b: f32[2] [R] = param()
%y: f32[1,2] [P] = matmul(%x, %w)
%z: f32[1,2] [P] = add(%y, %b)
return %z
""")
    with pytest.raises(VerifyError, match="counted 2 times"):
        verify(bad)


def test_nonlinear_on_partial_is_rejected():
    bad = parse_graph("""\
mesh tp=2
%x: f32[1,4] [S(1)] = input()
%w: f32[4,2] [S(0)] = param()
%y: f32[1,2] [P] = matmul(%x, %w)
%z: f32[1,2] [P] = gelu(%y)
return %z
""")
    with pytest.raises(VerifyError, match="nonlinear op gelu gets a partial-sum operand over mesh axis tp"):
        verify(bad)


def test_partial_input_sign_varying_split_shows_nonlinear_fault():
    """Applying relu to each rank's partial sum would differ from relu of the sum."""
    rng = np.random.default_rng(0)
    x = np.array([[1.0, -2.0, 3.0]], "f4")
    from parcomp.ir import Mesh
    parts = split_for_ranks(x, (P,), Mesh((("tp", 2),)), rng)
    assert_equivalent(parts[0] + parts[1], x)
    relu_of_parts = np.maximum(parts[0], 0) + np.maximum(parts[1], 0)
    assert not compare(relu_of_parts, np.maximum(x, 0), rtol_of(x))["ok"]


def test_uneven_weight_is_a_located_error():
    g = mlp_graph((2,), [4, 6, 4], [False, False], ["relu"])
    with pytest.raises(ParcompError) as e:
        compile_graph(g, megatron_spec(mesh="tp=4"))
    msg = str(e.value)
    assert "test.pcs:2:1" in msg and "l0.weight" in msg and "size 6" in msg and "tp" in msg


def test_dp_tp_mesh_collectives():
    g = mlp_graph((4, 8), [16, 32, 16], [True, True], ["gelu"])
    s = spec("mesh dp=2 tp=2\nl0.weight colwise over tp\nl1.weight rowwise over tp\n"
             "input x [S(0), R]\noutput output [S(0), R]\n")
    c = compile_graph(g, s)
    feeds = random_feeds(g)
    run = run_spmd(c.program, feeds)
    # one all_reduce per tp group (the log has one entry per collective node)
    assert collectives(run) == [("all_reduce", "tp", None, (2, 8, 16))]
    assert_equivalent(run.outputs(c.program)["output"], run_unsharded(g, feeds)["output"])


def test_layout_of_every_value_in_megatron_mlp():
    g = mlp_graph((2,), [4, 8, 4], [True, True], ["relu"])
    c = compile_graph(g, megatron_spec())
    lay = {n.name: n.layout for n in c.sharded.nodes}
    assert lay["l0.weight"] == (Shard(1),) and lay["l0.bias"] == (Shard(0),)
    assert lay["l0.act"] == (Shard(1),) and lay["l1.mm"] == (P,) and lay["l1.bias"] == (R,)
