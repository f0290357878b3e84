"""Norms, dropout and embeddings (the norms + embedding part) on the interpreter:
exact small cases, the dropout mask under every sharding, vocab-parallel masking at the
range boundaries, Megatron sequence parallel with one bucketed all_reduce of the
norm-weight gradients, the SiLU-gated MLP, and hypothesis over shapes and layouts.
Against torch: tests/backends/test_norms_torch.py."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from parcomp.compile.compiler import compile_graph
from parcomp.ir import Mesh, parse_graph
from parcomp.reference import norm_ops
from parcomp.reference.interpreter import run_spmd
from parcomp.reference.numpy_ops import run_unsharded

from graphs import random_feeds, spec
from numerics import assert_all_equivalent


def _run(graph_text, spec_text, feeds=None, seed=0):
    """(compiled, interpreter run, sharded outputs, unsharded outputs, feeds)."""
    c = compile_graph(parse_graph(graph_text), spec(spec_text))
    feeds = dict(feeds or {})
    for k, v in random_feeds(c.logical, seed).items():
        feeds.setdefault(k, v)
    run = run_spmd(c.program, feeds)
    return c, run, run.outputs(c.program), run_unsharded(c.logical, feeds), feeds


def kinds(run):
    return [(e["kind"], e["axis"]) for e in run.log]


# --- dropout: the mask is a function of the seed and the global element index -------------

DROP = "%x: f32[4,8,8] = input()\n%y: f32[4,8,8] = dropout(%x) {p=0.5, seed=5}\nreturn %y as output\n"


@pytest.mark.parametrize("layout", ["[R, R]", "[S(0), R]", "[R, S(1)]", "[S(0), S(2)]", "[S(1), S(1)]",
                                    "[S(2), S(0)]"])
def test_dropout_mask_is_the_same_under_every_sharding(layout):
    _, run, got, want, _ = _run(DROP, f"mesh dp=2 tp=2\ninput x {layout}\noutput output {layout}\n")
    assert run.log == []  # no collective: each rank masks its own block
    np.testing.assert_array_equal(got["output"], want["output"])  # bit for bit
    dropped = np.mean(want["output"] == 0)
    assert 0.35 < dropped < 0.65


def test_dropout_masks_differ_between_seeds_and_p_zero_is_the_identity():
    shape, at = (64, 64), (0, 0)
    node = parse_graph(DROP)["y"]
    a = norm_ops.dropout_keep(node, shape)
    b = norm_ops.dropout_keep(node.with_attrs(seed=6), shape)
    assert a.shape == shape and np.mean(a != b) > 0.3
    assert norm_ops.dropout_keep(node.with_attrs(p=0.0, index_start=at, index_shape=shape), shape).all()


def test_dropout_hash_stays_in_32_bits_without_overflow():
    idx = np.array([0, 1, 2**32 - 1, 2**32, 2**62], np.int64)
    with np.errstate(over="raise"):
        h = norm_ops.index_hash(2**32 - 1, idx)
    assert h.dtype == np.int64 and (h >= 0).all() and (h < 2**32).all()
    assert len(set(h.tolist())) == len(idx)


DROP_TRAIN = """\
%x: f32[4,8,8] = input()
%d: f32[4,8,8] = dropout(%x) {p=0.5, seed=5}
%w: f32[8,8] = param()
%y: f32[4,8,8] = matmul(%d, %w)
return %y as output
"""


def test_training_dropout_draws_a_new_mask_each_step_the_same_on_every_sharding():
    """The training step's dropouts (the forward's and the gradient's) read the step counter:
    steps 1 and 2 of the same params and batch drop different elements, and at each step the
    dp=2 x tp=2 program equals the unsharded step."""
    c = compile_graph(parse_graph(DROP_TRAIN), spec("mesh dp=2 tp=2\nw colwise\ninput x [S(0), R]\n"
                                                    "train loss=mse optimizer=sgd(lr=0.1)\n"))
    assert [n.inputs[1] for n in c.logical.by_op("dropout")] == ["step", "step"]
    feeds = random_feeds(c.logical, 0)
    grads = []
    for k in (1, 2):
        feeds["step"] = np.array(k, "f4")
        want = run_unsharded(c.logical, feeds)
        assert_all_equivalent(run_spmd(c.program, feeds).outputs(c.program), want)
        grads.append(want["x.grad"])
    dropped = [g == 0 for g in grads]  # x.grad is zero exactly where the mask dropped x
    assert 0.35 < np.mean(dropped[0]) < 0.65 and np.mean(dropped[0] != dropped[1]) > 0.3


def test_dropout_masks_differ_between_steps():
    node = parse_graph(DROP)["y"]
    a, b = (norm_ops.dropout_keep(node, (64, 64), k) for k in (1, 2))
    assert np.mean(a != b) > 0.3 and np.mean(a != norm_ops.dropout_keep(node, (64, 64))) > 0.3


# --- embedding: vocab-parallel (Megatron's VocabParallelEmbedding) and hidden-split ----------

EMB = """\
%ids: i64[1,4] = input()
%wte: f32[{v},2] = param()
%e: f32[1,4,2] = embedding(%ids, %wte)
return %e as output
"""


@pytest.mark.parametrize("tp, ids", [(2, [7, 8, 0, 15]), (2, [8, 7, 15, 0]), (4, [3, 4, 7, 8]),
                                     (4, [12, 11, 0, 15])])
def test_vocab_parallel_embedding_masks_ids_outside_the_rank_rows(tp, ids):
    v, rows = 16, 16 // tp  # ids on both sides of a boundary between two ranks' rows
    table = np.arange(1, 2 * v + 1, dtype="f4").reshape(v, 2)
    feeds = {"ids": np.array([ids]), "wte": table}
    c, run, got, _, _ = _run(EMB.format(v=v), f"mesh tp={tp}\nwte [S(0)]\ninput ids replicated\n"
                                              "output output replicated\n", feeds)
    assert kinds(run) == [("all_reduce", "tp")]  # the partial rows summed once, the table never gathered
    for r in range(tp):  # rank r holds rows r*rows .. (r+1)*rows - 1; other ids give zero rows
        local = run.env[r]["e"][0]
        for j, i in enumerate(ids):
            want = table[i] if r * rows <= i < (r + 1) * rows else np.zeros(2, "f4")
            np.testing.assert_array_equal(local[j], want)
    np.testing.assert_array_equal(got["output"][0], table[ids])


def test_hidden_split_embedding_needs_no_collective():
    feeds = {"ids": np.array([[3, 0, 2, 1]])}
    _, run, got, want, _ = _run(EMB.format(v=16), "mesh tp=2\nwte [S(1)]\ninput ids replicated\n"
                                                 "output output split-hidden\n", feeds)
    assert run.log == []
    np.testing.assert_array_equal(got["output"], want["output"])


EMB_TRAIN = """\
%ids: i64[2,3] = input()
%dy: f32[2,3,2] = input()
%wte: f32[4,2] = param()
%e: f32[2,3,2] = embedding(%ids, %wte)
%ed: f32[2,3,2] = mul(%e, %dy)
%l: f32[] = sum(%ed) {dims=(0, 1, 2)}
return %l
"""


@pytest.mark.parametrize("layout", ["[S(0)]", "[S(1)]", "[R]"])
def test_embedding_gradient_is_a_scatter_add_into_the_rank_rows(layout):
    ids = np.array([[1, 2, 1], [3, 0, 2]])  # 1 and 2 on the boundary of the two ranks' rows
    dy = np.arange(12, dtype="f4").reshape(2, 3, 2) - 5
    feeds = {"ids": ids, "dy": dy, "wte": np.arange(8, dtype="f4").reshape(4, 2)}
    c, run, got, want, _ = _run(EMB_TRAIN, f"mesh tp=2\nwte {layout}\ninput ids replicated\ninput dy replicated\n"
                                           "train loss=output optimizer=sgd(lr=0.5) input_grads=no\n", feeds)
    grad = np.zeros((4, 2), "f4")
    np.add.at(grad, ids, dy)
    np.testing.assert_array_equal(got["wte.grad"], grad)
    np.testing.assert_array_equal(got["wte"], feeds["wte"] - 0.5 * grad)
    assert all(k != "all_gather" for k, _ in kinds(run))  # never gathers the table


# --- Megatron sequence parallel: norms on split-seq activations ---------------------------

SP_BLOCK = """\
%x: f32[2,8,16] = input()
%ln1.weight: f32[16] = param()
%ln1.bias: f32[16] = param()
%h: f32[2,8,16] = layer_norm(%x, %ln1.weight, %ln1.bias) {eps=1e-05}
%fc.weight: f32[32,16] = param()
%fc.wt: f32[16,32] = permute(%fc.weight) {perm=(1, 0)}
%a: f32[2,8,32] = matmul(%h, %fc.wt)
%g: f32[2,8,32] = gelu(%a) {approximate="tanh"}
%proj.weight: f32[16,32] = param()
%proj.wt: f32[32,16] = permute(%proj.weight) {perm=(1, 0)}
%m: f32[2,8,16] = matmul(%g, %proj.wt)
%d: f32[2,8,16] = dropout(%m) {p=0.1, seed=0}
%r: f32[2,8,16] = add(%x, %d)
%ln2.weight: f32[16] = param()
%y: f32[2,8,16] = rms_norm(%r, %ln2.weight) {eps=1e-06}
return %y as output
"""
# `sequence-parallel` pins the norms' inputs and outputs, and their gradients, split along the
# sequence (the layout search alone prefers replicated norms at these sizes: fewer calls)
SP_SPEC = ("mesh tp=2\nsequence-parallel\nfc.weight colwise\nproj.weight rowwise\ninput x split-seq\n"
           "output output split-seq\ntrain loss=mse optimizer=sgd(lr=0.1)\n")


def test_sequence_parallel_block_one_bucketed_norm_gradient_all_reduce():
    c, run, got, want, feeds = _run(SP_BLOCK, SP_SPEC)
    recs = [(r["kind"], r["phase"]) for r in c.report["collectives"]]
    assert recs == [("all_gather", "forward"), ("reduce_scatter", "forward"), ("all_reduce", "loss"),
                    ("all_gather", "backward"), ("reduce_scatter", "backward"), ("all_reduce", "backward")]
    bucket = c.report["collectives"][-1]
    assert bucket["bytes"] == 2 * (2 - 1) / 2 * 4 * 3 * 16  # ln1.weight, ln1.bias, ln2.weight: 48 floats
    assert [k for k, _ in kinds(run)] == [k for k, _ in recs]  # the program runs what the report says
    gathered = [e for e in run.log if e["kind"] in ("all_gather", "reduce_scatter")]
    assert len({e["bytes"] for e in gathered}) == 1  # all_gather and reduce_scatter of equal bytes
    assert_all_equivalent(got, want)


def test_bucket_is_one_flat_buffer_and_its_parts_keep_the_names():
    c = compile_graph(parse_graph(SP_BLOCK), spec(SP_SPEC))
    p = c.program
    (cat,) = p.by_op("bucket_cat")
    parts = p.by_op("bucket_part")
    assert len(cat.inputs) == 3 and cat.type.shape == (48,)
    assert [n.attr("offset") for n in parts] == [0, 16, 32]
    sharded_ars = [n.name for n in c.sharded.nodes if n.op == "all_reduce" and n.phase == "backward"]
    assert sorted(n.name for n in parts) == sorted(sharded_ars)


def test_norm_weight_gradient_all_reduces_of_dp_and_tp_bucket_once_over_the_joint_group():
    """Norm-weight gradients partial over dp and tp: one bucket, reduced over the joint
    4-rank group at once (it was one bucket per axis, 2 calls)."""
    c, run, got, want, feeds = _run(SP_BLOCK, SP_SPEC.replace("mesh tp=2", "mesh dp=2 tp=2")
                                    .replace("input x split-seq", "input x [S(0), S(1)]")
                                    .replace("output output split-seq", "output output [S(0), S(1)]")
                                    .replace("fc.weight colwise", "fc.weight colwise over tp")
                                    .replace("proj.weight rowwise", "proj.weight rowwise over tp"))
    buckets = [n for n in c.program.nodes if n.op == "all_reduce" and n.inputs[0].startswith("bw.norm_grads")]
    assert [n.attr("axis") for n in buckets] == ["dp,tp"]
    assert_all_equivalent(got, want)


# --- SiLU-gated MLP (Llama: down(silu(gate(x)) * up(x))) ----------------------------------

SWIGLU = """\
%x: f32[4,8,16] = input()
%gate.weight: f32[32,16] = param()
%gate.wt: f32[16,32] = permute(%gate.weight) {perm=(1, 0)}
%up.weight: f32[32,16] = param()
%up.wt: f32[16,32] = permute(%up.weight) {perm=(1, 0)}
%down.weight: f32[16,32] = param()
%down.wt: f32[32,16] = permute(%down.weight) {perm=(1, 0)}
%g: f32[4,8,32] = matmul(%x, %gate.wt)
%s: f32[4,8,32] = silu(%g)
%u: f32[4,8,32] = matmul(%x, %up.wt)
%h: f32[4,8,32] = mul(%s, %u)
%y: f32[4,8,16] = matmul(%h, %down.wt)
return %y as output
"""
SWIGLU_SPEC = ("mesh tp=2\ngate.weight colwise\nup.weight colwise\ndown.weight rowwise\n"
               "input x replicated\noutput output replicated\n")


def test_silu_gated_mlp_one_forward_all_reduce():
    c, run, got, want, feeds = _run(SWIGLU, SWIGLU_SPEC)
    assert [(e["kind"], e["axis"], e["local_shape"]) for e in run.log] == [("all_reduce", "tp", (4, 8, 16))]
    assert_all_equivalent(got, want)


def test_silu_gated_mlp_training_one_all_reduce_each_way():
    c, run, got, want, feeds = _run(SWIGLU, SWIGLU_SPEC + "train loss=mse optimizer=sgd(lr=0.1)\n")
    phases = [(r["kind"], r["phase"]) for r in c.report["collectives"]]
    assert phases == [("all_reduce", "forward"), ("all_reduce", "backward")]  # the backward one: x.grad
    assert_all_equivalent(got, want)


# --- hypothesis: shapes x layouts x ops on the interpreter --------------------------------

def _case_text(op, b, s, h, v):
    lines = [f"%x: f32[{b},{s},{h}] = input()"]
    if op == "embedding":
        lines = [f"%ids: i64[{b},{s}] = input()", f"%wte: f32[{v},{h}] = param()",
                 f"%x: f32[{b},{s},{h}] = embedding(%ids, %wte)"]
    lines += [f"%w: f32[{h}] = param()", f"%c: f32[{h}] = param()"]
    body = {"layer_norm": "layer_norm(%x, %w, %c) {eps=1e-05}", "rms_norm": "rms_norm(%x, %w) {eps=1e-06}",
            "dropout": "dropout(%x) {p=0.3, seed=9}", "embedding": "layer_norm(%x, %w, %c) {eps=1e-05}"}[op]
    lines.append(f"%n: f32[{b},{s},{h}] = {body}")
    lines.append(f"%y: f32[{b},{s},{h}] = mul(%n, %w)")
    return "\n".join(lines) + "\nreturn %y as output\n"


@settings(max_examples=25, deadline=None)
@given(op=st.sampled_from(["layer_norm", "rms_norm", "dropout", "embedding"]),
       b=st.sampled_from([2, 4]), s=st.sampled_from([2, 4]), h=st.sampled_from([4, 8]),
       v=st.sampled_from([4, 8]), mesh=st.sampled_from(["tp=2", "dp=2 tp=2"]),
       x_pl=st.sampled_from(["R", "S(0)", "S(1)"]), table_pl=st.sampled_from(["R", "S(0)", "S(1)"]),
       train=st.booleans(), seed=st.integers(0, 3))
def test_sharded_equals_unsharded(op, b, s, h, v, mesh, x_pl, table_pl, train, seed):
    axes = len(mesh.split())
    lay = "[" + ", ".join(["R"] * (axes - 1) + [x_pl]) + "]"
    rules = [f"mesh {mesh}"]
    if op == "embedding":
        rules += [f"wte [{', '.join(['R'] * (axes - 1) + [table_pl])}]", f"input ids {lay}"]
    else:
        rules.append(f"input x {lay}")
    rules.append(f"output output {lay}")
    if train:
        rules.append("train loss=mse optimizer=sgd(lr=0.1)")
    feeds = {"ids": np.random.default_rng(seed).integers(0, v, (b, s))}
    c, run, got, want, feeds = _run(_case_text(op, b, s, h, v), "\n".join(rules) + "\n", feeds, seed)
    assert_all_equivalent(got, want)


def test_rank_attrs_only_touch_the_ops_that_read_their_block():
    g = parse_graph(DROP)
    mesh = Mesh((("tp", 2),))
    assert norm_ops.rank_attrs(g["x"], [], [], None, mesh, (1,)) is g["x"]
    from parcomp.ir import Shard
    n = norm_ops.rank_attrs(g["y"].with_attrs(), [], [], (Shard(1),), mesh, (1,))
    # the local block [4, 8, 8] of a global [4, 16, 8] at rank 1 starts at row 8 of dim 1
    assert n.attr("index_start") == (0, 8, 0) and n.attr("index_shape") == (4, 16, 8)


def test_bucketed_members_follow_an_async_all_reduce_to_its_wait():
    from parcomp.passes.lowering.bucket import bucketed_members

    g = parse_graph("""\
mesh tp=2
stage local
%a: f32[4] [P] = input() {global_shape=(4,)}
%b: f32[2,2] [P] = input() {global_shape=(2, 2)}
%c: f32[8] [P] = bucket_cat(%a, %b)
%r: f32[8] [R] = all_reduce(%c) {async_op=true, axis="tp"}
%r.wait: f32[8] [R] = wait(%r)
%ga: f32[4] [R] = bucket_part(%r.wait) {numel=4, offset=0}
%gb: f32[2,2] [R] = bucket_part(%r.wait) {numel=4, offset=4}
return %ga, %gb
""")
    ar, parts = bucketed_members(g, "gb")
    assert ar.name == "r" and parts == ("ga", "gb")
    assert bucketed_members(g, "a") is None
    run = run_spmd(g, {"a": np.arange(4, dtype="f4"), "b": np.ones((2, 2), "f4")})
    np.testing.assert_array_equal(run.outputs(g)["gb"], np.ones((2, 2), "f4"))
