"""Training step: sharded loss, gradients and updates equal the unsharded step."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from parcomp.compile.compiler import compile_graph
from parcomp.errors import SpecError
from parcomp.ir import parse_graph
from parcomp.reference.interpreter import run_spmd
from parcomp.reference.numpy_ops import run_unsharded


from graphs import mlp_graph, random_feeds, spec
from numerics import assert_all_equivalent, assert_equivalent

from test_megatron import TINY, W1, W2  # the worked example of the forward tests

# the worked MLP with the output gradient dY fed in: loss = sum(output * dy), so dL/doutput = dy
TINY_VJP = (TINY.replace("%x: f32[1,2] = input()\n", "%x: f32[1,2] = input()\n%dy: f32[1,2] = input()\n")
            .replace("return %output\n", "%ydy: f32[1,2] = mul(%output, %dy)\n"
                     "%l: f32[] = sum(%ydy) {dims=(0, 1)}\nreturn %l\n"))


def collectives(run):
    return [(c["kind"], c["axis"], c["dim"]) for c in run.log]


def test_worked_backward_example_exact():
    c = compile_graph(parse_graph(TINY_VJP), spec(
        "mesh tp=2\nfc1.weight colwise\nfc2.weight rowwise\ninput x replicated\n"
        "output l replicated\ntrain loss=output optimizer=sgd(lr=0.0)"))
    feeds = {"x": np.array([[1, 2]], "f4"), "dy": np.array([[2, -1]], "f4"),
             "fc1.weight": W1.T, "fc2.weight": W2.T}
    run = run_spmd(c.program, feeds)
    p = c.program
    dh = [n.name for n in p.nodes if n.op == "relu_grad"][0]
    assert [e[dh].tolist() for e in run.env] == [[[2, -1]], [[1, 4]]]  # dH by channel
    dx_partial = [n.inputs[0] for n in p.nodes if n.op == "all_reduce" and n.name.startswith("bw.")][0]
    assert [e[dx_partial].tolist() for e in run.env] == [[[0, -1]], [[4, 11]]]
    out = run.outputs(p)
    assert out["x.grad"].tolist() == [[4, 10]]
    full = run_unsharded(c.logical, feeds)
    for k in ("fc1.weight.grad", "fc2.weight.grad"):
        np.testing.assert_array_equal(out[k], full[k])
    # each rank's weight-gradient slice is the matching slice of the full gradient
    g1 = [n.name for n in p.nodes if n.name == c.program.outputs[c.program.output_names.index("fc1.weight.grad")]][0]
    np.testing.assert_array_equal(np.concatenate([e[g1] for e in run.env], axis=0), full["fc1.weight.grad"])


def _train(mesh="tp=2", inp="replicated", opt="sgd(lr=0.1)", extra=""):
    return spec(f"mesh {mesh}\nl0.weight colwise over tp\nl1.weight rowwise over tp\n"
                f"input x {inp}\ntrain loss=mse optimizer={opt} {extra}\n")


def _feeds(c, seed=0):
    feeds = random_feeds(c.logical, seed)
    if "step" in feeds:
        feeds["step"] = np.array(3.0, "f4")
    for n in c.logical.params:
        if n.name.endswith(("exp_avg_sq",)):
            feeds[n.name] = np.abs(feeds[n.name])
    return feeds


def test_megatron_mlp_fwd_bwd_one_all_reduce_each_way():
    g = mlp_graph((2, 8), [16, 64, 16], [True, True], ["gelu"])
    c = compile_graph(g, _train())
    run = run_spmd(c.program, _feeds(c))
    assert collectives(run) == [("all_reduce", "tp", None), ("all_reduce", "tp", None)]
    phases = [r["phase"] for r in c.report["collectives"]]
    assert phases == ["forward", "backward"]


@pytest.mark.parametrize("batch", [4, 4096])
def test_dp_tp_one_gradient_reduction_per_param_over_dp(batch):
    """Data parallel stays data parallel at any batch: gathering activations over
    dp is cheaper in calls on a small batch, but grows every rank's activation memory dp-fold,
    which the search never does (shard_prop.batch_values); before, it gathered up to ~16k tokens."""
    g = mlp_graph((batch, 8), [16, 32, 16], [True, True], ["gelu"])
    c = compile_graph(g, _train("dp=2 tp=2", "[S(0), R]", extra="bucket_cap_mb=0"))  # not bucketed
    recs = c.report["collectives"]
    tp = [(r["kind"], r["phase"]) for r in recs if r["axis"] == "tp"]
    dp = [(r["kind"], r["phase"], r["producer"]) for r in recs if r["axis"] == "dp"]
    assert tp == [("all_reduce", "forward"), ("all_reduce", "backward")]
    # each of the 4 parameters' gradients once over dp; the scalar loss once over the
    # joint group (its squares are summed split over tp as well)
    assert dp == [("all_reduce", "backward", p) for p in (
        "bw.l0.mm.matmul_2", "bw.l0.out.sum", "bw.l1.mm.matmul_2", "bw.l1.out.sum")]
    assert [(r["kind"], r["axis"], r["phase"]) for r in recs if r["producer"] == "loss.sum"] == [
        ("all_reduce", "dp,tp", "loss")]
    assert "note" not in c.report["search"]
    feeds = _feeds(c)
    got, want = run_spmd(c.program, feeds).outputs(c.program), run_unsharded(c.logical, feeds)
    assert_all_equivalent(got, want)


def test_zero_sharded_optimizer_state_reduce_scatter_then_all_gather():
    g = mlp_graph((4096, 8), [16, 32, 16], [False, False], ["relu"])  # dp gathers nothing (above)
    c = compile_graph(g, _train("dp=2 tp=2", "[S(0), R]", "adamw(lr=0.01)", "zero=1"))
    dp = sorted(r["kind"] for r in c.report["collectives"] if r["axis"] == "dp"
                and r["phase"] not in ("forward", "loss"))
    assert dp == ["all_gather", "all_gather", "reduce_scatter", "reduce_scatter"]
    feeds = _feeds(c)
    got, want = run_spmd(c.program, feeds).outputs(c.program), run_unsharded(c.logical, feeds)
    assert_all_equivalent(got, want)


def test_row_parallel_bias_gradient_counted_once():
    g = mlp_graph((4,), [4, 8, 4], [True, True], ["relu"])
    c = compile_graph(g, _train())
    feeds = {k: np.round(v * 3) for k, v in _feeds(c).items()}
    got, want = run_spmd(c.program, feeds).outputs(c.program), run_unsharded(c.logical, feeds)
    np.testing.assert_array_equal(got["l1.bias.grad"], want["l1.bias.grad"])
    np.testing.assert_array_equal(got["l1.bias"], want["l1.bias"])


@st.composite
def train_case(draw):
    nlin = draw(st.integers(1, 3))
    dims = [draw(st.sampled_from([4, 8])) for _ in range(nlin + 1)]
    bias = [draw(st.booleans()) for _ in range(nlin)]
    acts = [draw(st.sampled_from(["relu", "gelu", "tanh"])) for _ in range(nlin)]
    mesh = draw(st.sampled_from(["tp=2", "dp=2", "dp=2 tp=2"]))
    axes = [a.split("=")[0] for a in mesh.split()]
    rules = [f"l{i}.weight {draw(st.sampled_from(['colwise', 'rowwise', 'replicated']))} over "
             f"{draw(st.sampled_from(axes))}" for i in range(nlin)]
    inp = "[S(0), R]" if mesh == "dp=2 tp=2" else ("split-seq over dp" if mesh == "dp=2" else "replicated")
    opt = draw(st.sampled_from(["sgd(lr=0.1, momentum=0.9)", "sgd(lr=0.05, weight_decay=0.1)",
                                "adamw(lr=0.01)"]))
    zero = draw(st.sampled_from(["", "zero=1"])) if "dp" in axes else ""
    loss = draw(st.sampled_from(["mse", "cross_entropy"]))
    text = (f"mesh {mesh}\n" + "\n".join(rules) + f"\ninput x {inp}\n"
            f"train loss={loss} optimizer={opt} {zero}\n")
    return mlp_graph((4, 2), dims, bias, acts), text


@given(train_case(), st.integers(0, 2**16))
def test_random_training_step_equals_unsharded(case, seed):
    g, text = case
    c = compile_graph(g, spec(text))
    feeds = _feeds(c, seed)
    if "labels" in feeds:
        feeds["labels"] = np.random.default_rng(seed).integers(0, c.logical["labels"].type.shape and 4,
                                                               c.logical["labels"].type.shape)
    got, want = run_spmd(c.program, feeds).outputs(c.program), run_unsharded(c.logical, feeds)
    assert_all_equivalent(got, want)


@pytest.mark.parametrize("line,msg", [
    ("train loss=mse optimizer=lamb", "optimizer 'lamb' is not supported"),
    ("train loss=output", "needs the model to return a scalar loss"),
    ("train loss=mse batch=3", "batch=3 but input x"),
    ("train loss=mse trainable=\"l9.weight\"", "names no parameter the graph uses"),
])
def test_training_spec_errors_are_located(line, msg):
    g = mlp_graph((4,), [4, 8, 4], [False, False], ["relu"])
    with pytest.raises(SpecError) as e:
        compile_graph(g, spec(f"mesh tp=2\n{line}\n"))
    assert msg in str(e.value) and "test.pcs:2:1" in str(e.value)


def test_batch_not_divisible_by_dp():
    g = mlp_graph((6,), [4, 8, 4], [False, False], ["relu"])
    with pytest.raises(SpecError, match="batch=6 is not divisible by the dp axis of size 4"):
        compile_graph(g, spec("mesh dp=4\ntrain loss=mse batch=6\n"))


def test_sequence_parallel_transposes_all_gather_and_reduce_scatter():
    """Megatron-SP: all_gather(seq) forward <-> reduce_scatter backward, and the reverse.

    Weights larger than the activations (as in real models): otherwise gathering the
    weights (FSDP-style) moves fewer bytes and the compiler rightly does that instead.
    The exact search (ILP) keeps the forward's gathered ``x`` for the weight gradient
    instead of gathering it again in backward (Megatron-SP re-gathers to save memory;
    the cost model here prices no memory), and the output's reduce_scatter is
    transposed by one all_gather of the loss's difference, which the loss and its
    gradient share.
    """
    g = mlp_graph((2, 4), [64, 256, 64], [False, False], ["gelu"])
    c = compile_graph(g, spec("mesh tp=2\nl0.weight colwise\nl1.weight rowwise\ninput x split-seq\n"
                              "output output split-seq\ntrain loss=mse optimizer=sgd(lr=0.1)\n"))
    got = [(r["kind"], r["dim"], r["phase"]) for r in c.report["collectives"] if r["axis"] == "tp"]
    fwd = [(k, d) for k, d, ph in got if ph == "forward" and d is not None]
    bwd = [(k, d) for k, d, ph in got if ph == "backward"]
    assert fwd == [("all_gather", 1), ("reduce_scatter", 1)]
    assert sorted(bwd) == [("reduce_scatter", 1)]
    assert [(k, d) for k, d, ph in got if ph == "loss"] == [("all_gather", 1)]
    assert c.sharded.search["search"] == "ilp" and c.sharded.search["proven_optimal"]
    feeds = _feeds(c)
    out, want = run_spmd(c.program, feeds).outputs(c.program), run_unsharded(c.logical, feeds)
    assert_all_equivalent(out, want)


def test_replicated_input_of_column_parallel_gets_its_gradient_all_reduced():
    """Megatron's f: identity forward on x, all_reduce of dx backward; no tp reduction of dW."""
    g = mlp_graph((4, 8), [16, 32, 16], [True, True], ["relu"])
    c = compile_graph(g, _train())
    bwd = [r for r in c.report["collectives"] if r["phase"] == "backward"]
    assert [(r["kind"], r["axis"]) for r in bwd] == [("all_reduce", "tp")]
    dx = c.sharded[c.sharded.outputs[c.sharded.output_names.index("x.grad")]]
    assert dx.op == "all_reduce"  # the gradient of x is the reduced value, nothing else is


def test_input_grads_no_drops_dx_and_its_all_reduce():
    g = mlp_graph((4, 8), [16, 32, 16], [True, True], ["relu"])
    c = compile_graph(g, _train(extra="input_grads=no"))
    assert "x.grad" not in c.program.output_names
    assert [(r["kind"], r["phase"]) for r in c.report["collectives"]] == [("all_reduce", "forward")]
    feeds = _feeds(c)
    got, want = run_spmd(c.program, feeds).outputs(c.program), run_unsharded(c.logical, feeds)
    assert_all_equivalent(got, want)


# --- what is not a trainable parameter is never updated; several outputs ------------------------

BUFFERED = """\
%x: f32[4,8] = input()
%w1: f32[8,16] = param()
%s: f32[16] = param() {trainable=false}
%w2: f32[16,8] = param()
%h: f32[4,16] = matmul(%x, %w1)
%r: f32[4,16] = relu(%h)
%hs: f32[4,16] = mul(%r, %s)
%y: f32[4,8] = matmul(%hs, %w2)
return %y
"""
BUFFERED_SPEC = ("mesh tp=2\nw1 colwise\nw2 rowwise\ninput x replicated\n"
                 "train loss=mse optimizer=sgd(lr=0.02, momentum=0.9) steps=3{extra}\n")


def _train_spmd(c, feeds, steps):
    from parcomp.check.training import train_steps

    return train_steps(lambda s: run_spmd(c.program, s).outputs(c.program), c.logical, feeds, steps)


def test_a_param_marked_not_trainable_gets_no_gradient_state_or_update():
    c = compile_graph(parse_graph(BUFFERED), spec(BUFFERED_SPEC.format(extra="")))
    assert {"s", "s.grad", "s.momentum_buffer"}.isdisjoint(c.program.output_names)
    assert "s.momentum_buffer" not in c.program
    assert {"w1", "w2", "w1.grad", "w2.momentum_buffer"} <= set(c.program.output_names)
    # no collective serves a gradient of s (it was an all_gather of the column-split s.grad)
    assert [(r["kind"], r["phase"]) for r in c.report["collectives"]] == [("all_reduce", "forward"),
                                                                          ("all_reduce", "backward")]
    feeds = random_feeds(c.unsharded, 1, scale=0.5)
    feeds["target"] = np.random.default_rng(2).standard_normal((4, 8)).astype("f4")
    from parcomp.check.training import numpy_train

    got, want = _train_spmd(c, feeds, 3), numpy_train(c.logical, feeds, 3)
    np.testing.assert_array_equal(got["state"]["s"], feeds["s"])  # carried 3 steps, unchanged
    assert_equivalent(np.array(got["losses"]), np.array(want["losses"]))
    assert got["losses"][2] < got["losses"][0]  # w1, w2 were trained
    assert_all_equivalent(got["state"], want["state"], ("w1", "w2", "w2.momentum_buffer"))


def test_trainable_pattern_naming_only_frozen_params_is_an_error():
    with pytest.raises(SpecError) as e:
        compile_graph(parse_graph(BUFFERED), spec(BUFFERED_SPEC.format(extra=' trainable="s"')))
    assert "test.pcs:5:1" in str(e.value)
    assert "trainable='s' names only buffers or frozen (requires_grad=False) parameters" in str(e.value)


TWO_OUT = """\
%x: f32[4,8] = input()
%w1: f32[8,8] = param()
%w2: f32[8,8] = param()
%y0: f32[4,8] = matmul(%x, %w1)
%y1: f32[4,8] = matmul(%x, %w2)
return %y0, %y1
"""


@pytest.mark.parametrize("out,trained,untouched", [("y0", "w1", "w2"), ("y1", "w2", "w1")])
def test_loss_on_the_named_output_and_only_what_reaches_it_is_trained(out, trained, untouched):
    c = compile_graph(parse_graph(TWO_OUT), spec(
        f"mesh tp=2\nw1 colwise\nw2 colwise\ninput x replicated\ntrain loss=mse optimizer=adamw(lr=0.01)"
        f" output={out}\n"))
    names = set(c.program.output_names)
    assert {trained, f"{trained}.grad", f"{trained}.exp_avg"} <= names
    # as in torch.optim: no gradient reaches it, so no update (not even AdamW's weight decay)
    assert not any(n.startswith(untouched) for n in names)
    from parcomp.check.training import initial_state

    rand = random_feeds(c.logical, 3)
    feeds = initial_state(c.logical, {k: rand[k] for k in ("x", "w1", "w2", "target")})  # zero state
    feeds["step"] = np.array(1.0, "f4")
    got = run_spmd(c.program, feeds).outputs(c.program)
    y = feeds["x"].astype("f8") @ feeds[trained]
    want = np.mean((y - feeds["target"]) ** 2)  # float64: exact next to float32's bound
    assert_equivalent(got["loss"], want)


@pytest.mark.parametrize("line,msg", [
    ("train loss=mse", "the model has 2 outputs (y0, y1); say which one the loss is computed on, "
                       "e.g. 'train ... output=y0'"),
    ("train loss=mse output=yy", "output='yy' is not an output of the model (its outputs: y0, y1)"),
    ("train loss=mse output=y00", "output='y00' is not an output of the model; did you mean 'y0'?"),
])
def test_several_outputs_need_the_loss_output_named(line, msg):
    with pytest.raises(SpecError) as e:
        compile_graph(parse_graph(TWO_OUT), spec(f"mesh tp=2\nw1 colwise\n{line}\n"))
    col = line.index("output=") + 1 if "output=" in line else 1  # the option's own column
    assert msg in str(e.value) and str(e.value).startswith(f"test.pcs:3:{col}\n")
