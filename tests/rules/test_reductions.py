"""Reductions part of P(max), amax/argmax/softmax/log_softmax/mean over a split dim,
vocab-parallel cross-entropy and padded vocab. Exact small cases, a wrong reduction caught,
torch-vs-numpy of the new ops, and hypothesis over shapes and layouts on the interpreter."""
import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import parcomp.reference.interpreter as interp
from parcomp.compile.compiler import compile_graph
from parcomp.errors import VerifyError
from parcomp.ir import Mesh, Node, TensorType, make_attrs, parse_graph
from parcomp.ir.redistribute import plan
from parcomp.ir.types import PMAX, P, R, Partial, Shard, make_placement, parse_layout
from parcomp.passes.verify import verify
from parcomp.reference.assemble import assemble
from parcomp.reference.interpreter import run_spmd, split_for_ranks
from parcomp.reference.numpy_ops import run_unsharded
from parcomp.reference.numpy_ops import NUMPY_OPS
from parcomp.spec import parse_spec
from parcomp_backends.torch import emit_program
from parcomp_backends.torch.emit import node_code
from parcomp_backends.torch.emit.reduce import REDUCE_FORMATS
from parcomp_backends.torch.runtime import program_reduce

from numerics import assert_equivalent


def _compile(pcir, spec):
    return compile_graph(parse_graph(pcir), parse_spec(spec))


def _run(c, feeds):
    run = run_spmd(c.program, feeds)
    return run, run.outputs(c.program)


def _colls(run):
    return [(e["kind"], e["name"]) for e in run.log]


def _reduce_ops(c):
    return [(n.op, n.attr("reduce_op", "sum")) for n in c.program.nodes if n.op == "all_reduce"]


# ---- P(max): the placement, its text form, the planner ---------------------------------

def test_partial_max_prints_and_parses_everywhere():
    assert str(PMAX) == "P(max)" and str(P) == "P" and make_placement("P", "max") == PMAX
    assert parse_layout("[P(max), P]") == (PMAX, P)
    g = parse_graph("mesh tp=2\n%x: f32[4] [P(max)] = input()\nreturn %x\n")
    assert g["x"].layout == (PMAX,)
    assert parse_spec("mesh tp=2\ninput x [P(max)]\n").rules[0].layout.explicit == (PMAX,)
    with pytest.raises(ValueError, match="P\\(sum\\) and P\\(max\\)"):
        make_placement("P", "min")


def test_a_partial_max_is_reduced_by_max_never_summed_nor_reduce_scattered():
    (step,) = plan((PMAX,), (R,), 1)
    assert (step.kind, step.reduce_op) == ("all_reduce", "max")
    assert [(s.kind, s.reduce_op) for s in plan((PMAX,), (Shard(0),), 1)] == [("all_reduce", "max"),
                                                                           ("shard_slice", "sum")]
    assert [(s.kind, s.reduce_op) for s in plan((PMAX,), (P,), 1)] == [("all_reduce", "max"),
                                                                    ("partial_mask", "sum")]
    assert [(s.kind, s.reduce_op) for s in plan((R,), (PMAX,), 1)] == [("partial_mask", "max")]


def test_split_and_assemble_of_a_partial_max():
    mesh, x = Mesh((("tp", 2),)), np.array([[1.0, -2.0], [3.0, 4.0]])
    pieces = split_for_ranks(x, (PMAX,), mesh, np.random.default_rng(0))
    assert all((p <= x).all() for p in pieces) and not np.array_equal(pieces[0], pieces[1])
    assert np.array_equal(assemble(pieces, (PMAX,), x.shape, mesh, "float64"), x)
    assert not np.array_equal(assemble(pieces, (P,), x.shape, mesh, "float64"), x)  # summing is wrong


def test_verifier_rejects_a_partial_max_summed_or_computed_on():
    base = "mesh tp=2\n%x: f32[4] [P(max)] = input()\n"
    bad = [base + "%y: f32[4] [R] = all_reduce(%x) {axis=\"tp\"}\nreturn %y\n",  # summed
           base + "%y: f32[4] [P(max)] = exp(%x)\nreturn %y\n",
           base + "%y: f32[4] [R] = reduce_scatter(%x) {axis=\"tp\", dim=0, reduce_op=\"max\"}\nreturn %y\n"]
    for text in bad:
        with pytest.raises(VerifyError):
            verify(parse_graph(text))
    verify(parse_graph(base + '%y: f32[4] [R] = all_reduce(%x) {axis="tp", reduce_op="max"}\nreturn %y\n'))


# ---- exact small cases -----------------------------------------------------------------

SOFTMAX = "%x: f32[1,4] = input()\n%y: f32[1,4] = softmax(%x) {dim=1}\nreturn %y\n"
SOFTMAX_SPLIT = ("mesh tp=2\ninput x split-hidden\nactivation y.max [P(max)]\nactivation y.sumexp [P]\n"
                 "output y split-hidden\n")
X100 = {"x": np.array([[100, 110, 120, 130]], "f4")}


def test_softmax_split_along_its_dim_equals_the_unsharded_float32_result():
    c = _compile(SOFTMAX, SOFTMAX_SPLIT)
    run, out = _run(c, X100)
    assert _reduce_ops(c) == [("all_reduce", "max"), ("all_reduce", "sum")]
    assert [e["kind"] for e in run.log] == ["all_reduce", "all_reduce"]  # nothing gathered
    want = run_unsharded(parse_graph(SOFTMAX), X100)["y"]
    assert np.isfinite(out["y"]).all()
    assert_equivalent(out["y"], want)
    np.testing.assert_allclose(out["y"], torch.softmax(torch.tensor(X100["x"]), 1).numpy(), rtol=0, atol=2e-7)


def test_a_max_combined_by_sum_would_give_nan(monkeypatch):
    """The same program with the P(max) all_reduce summing (the bug the kind prevents)."""
    c = _compile(SOFTMAX, SOFTMAX_SPLIT)
    monkeypatch.setitem(interp._LAYOUT_OPS, "all_reduce", lambda xs, n: [interp._sum(xs)] * len(xs))
    _, out = _run(c, X100)
    assert np.isnan(out["y"]).all()  # exp(x - 240) underflows: 0 / 0


def test_softmax_with_the_dim_whole_is_one_fused_op():
    c = _compile(SOFTMAX, "mesh tp=2\ninput x [R]\n")
    assert [n.op for n in c.program.nodes if n.op not in ("input", "relayout")] == ["softmax"]
    assert "torch.softmax(x, dim=1)" in emit_program(c)


ARGMAX = "%x: f32[2,4] = input()\n%y: i64[2] = argmax(%x) {dim=1}\nreturn %y\n"


@pytest.mark.parametrize("rows, want", [([[3, 1, 9, 7], [2, 8, 4, 6]], [2, 1]),
                                        ([[1, 9, 9, 2], [-5, -7, -1, -1]], [1, 2])])  # ties: first index
def test_argmax_over_a_split_dim_reduces_value_and_global_index_together(rows, want):
    c = _compile(ARGMAX, "mesh tp=2\ninput x split-hidden\nactivation y.key [P(max)]\n")
    run, out = _run(c, {"x": np.array(rows, "f4")})
    np.testing.assert_array_equal(out["y"], want)
    assert _reduce_ops(c) == [("all_reduce", "max")] and [e["kind"] for e in run.log] == ["all_reduce"]
    assert [n.op for n in c.program.nodes if n.op not in ("input", "relayout", "all_reduce")] == [
        "argmax_key", "argmax_index"]


def test_argmax_with_the_dim_whole_is_torch_argmax():
    c = _compile(ARGMAX, "mesh tp=2\ninput x [S(0)]\n")
    assert "torch.argmax(x, dim=1)" in emit_program(c)
    _, out = _run(c, {"x": np.array([[3, 1, 9, 7], [2, 8, 4, 6]], "f4")})
    np.testing.assert_array_equal(out["y"], [2, 1])


def test_mean_over_a_split_dim_divides_by_the_global_count():
    g = "%x: f32[2,4] = input()\n%y: f32[2] = mean(%x) {dims=(1,)}\nreturn %y\n"
    c = _compile(g, "mesh tp=2\ninput x split-hidden\nactivation y.sum [P]\n")
    run, out = _run(c, {"x": np.array([[1, 3, 8, 8], [0, 0, 4, 4]], "f4")})
    np.testing.assert_array_equal(out["y"], [5, 2])  # local means summed would give [10, 4]
    assert [e["kind"] for e in run.log] == ["all_reduce"]


# ---- vocab-parallel cross-entropy ------------------------------------------------------

def _ce_graph(tokens, hidden, vocab, extra=""):
    return (f"%x: f32[{tokens},{hidden}] = input()\n%w: f32[{hidden},{vocab}] = param()\n"
            f"%l: i64[{tokens}] = input()\n%z: f32[{tokens},{vocab}] = matmul(%x, %w)\n{extra}"
            f"%ce: f32[{tokens}] = cross_entropy(%{'zp' if extra else 'z'}, %l)\nreturn %ce\n")


VOCAB_PARALLEL = ("mesh tp=2\nw colwise\ninput x replicated\ninput l replicated\nactivation ce.max [P(max)]\n"
                  "activation ce.sumexp [P]\nactivation ce.target [P]\noutput ce replicated\n")


def _ce_feeds(tokens=4, hidden=3, vocab=8, zero=False, seed=0):
    rng = np.random.default_rng(seed)
    w = np.zeros((hidden, vocab), "f4") if zero else rng.standard_normal((hidden, vocab)).astype("f4")
    return {"x": rng.standard_normal((tokens, hidden)).astype("f4"), "w": w,
            "l": np.array([0, 7, 3, 4][:tokens], "int64")}


def test_vocab_parallel_cross_entropy_equals_the_gathered_one_with_three_all_reduces():
    g, feeds = _ce_graph(4, 3, 8), _ce_feeds()
    c = _compile(g, VOCAB_PARALLEL)
    run, out = _run(c, feeds)
    assert _colls(run) == [("all_reduce", "ce.max.all_reduce_tp"), ("all_reduce", "ce.sumexp.all_reduce_tp"),
                           ("all_reduce", "ce.target.all_reduce_tp")]
    assert _reduce_ops(c) == [("all_reduce", "max"), ("all_reduce", "sum"), ("all_reduce", "sum")]
    logits = torch.tensor(feeds["x"]) @ torch.tensor(feeds["w"])  # gathered logits, torch's CE
    want = torch.nn.functional.cross_entropy(logits, torch.tensor(feeds["l"]), reduction="none").numpy()
    gathered = _compile(g, "mesh tp=2\nw colwise\nactivation z replicated\noutput ce replicated\n")
    assert [e["kind"] for e in _run(gathered, feeds)[0].log][0] == "all_gather"
    assert_equivalent(out["ce"], want)
    assert_equivalent(_run(gathered, feeds)[1]["ce"], out["ce"])


def test_a_sum_exp_left_unreduced_is_off_by_ln_tp_and_caught(monkeypatch):
    """Equal logits: the loss is ln(V); each rank's own sum of exps gives ln(V / tp)."""
    g, feeds = _ce_graph(4, 3, 8), _ce_feeds(zero=True)
    c = _compile(g, VOCAB_PARALLEL)
    _, good = _run(c, feeds)
    np.testing.assert_allclose(good["ce"], math.log(8), rtol=0, atol=1e-6)
    real = interp._LAYOUT_OPS["all_reduce"]
    monkeypatch.setitem(interp._LAYOUT_OPS, "all_reduce",  # the sum of exps not reduced
                        lambda xs, n: list(xs) if "sumexp" in n.name else real(xs, n))
    run, bad = _run(c, feeds)
    np.testing.assert_allclose(good["ce"] - bad["ce"], math.log(2), rtol=0, atol=1e-6)
    with pytest.raises(AssertionError, match="tolerance"):
        assert_equivalent(bad["ce"], good["ce"])


def test_cross_entropy_ignore_index_and_label_smoothing_match_torch():
    for attrs in ("{ignore_index=3, label_smoothing=0.1}", "{label_smoothing=0.25}"):
        g = _ce_graph(4, 3, 8).replace("cross_entropy(%z, %l)", f"cross_entropy(%z, %l) {attrs}")
        feeds = _ce_feeds()
        c = _compile(g, VOCAB_PARALLEL)
        run, out = _run(c, feeds)
        logits = torch.tensor(feeds["x"]) @ torch.tensor(feeds["w"])
        node = parse_graph(g)["ce"]
        want = torch.nn.functional.cross_entropy(
            logits, torch.tensor(feeds["l"]), reduction="none", ignore_index=node.attr("ignore_index", -100),
            label_smoothing=node.attr("label_smoothing")).numpy()
        assert_equivalent(out["ce"], want)


def test_training_loss_on_vocab_split_logits_is_vocab_parallel_with_a_global_count():
    """A vocab large enough that gathering costs more: max, sum of exps and the target logit
    reduced (the target's reduction rides on the loss's scalar sum); the gradient is local."""
    g = "%x: f32[32,16] = input()\n%w: f32[16,65536] = param()\n%y: f32[32,65536] = matmul(%x, %w)\nreturn %y\n"
    c = _compile(g, "mesh tp=2\nw colwise\ntrain loss=cross_entropy optimizer=sgd(lr=0.1) input_grads=no\n")
    ars = [(n.name, n.attr("reduce_op", "sum")) for n in c.program.nodes if n.op == "all_reduce"]
    assert ars == [("loss.ce.max.all_reduce_tp", "max"), ("loss.ce.sumexp.all_reduce_tp", "sum"),
                   ("loss.sum.all_reduce_tp", "sum")]
    assert [r["kind"] for r in c.report["collectives"]] == ["all_reduce"] * 3  # the gradient is local
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((32, 16)).astype("f4"), "w": rng.standard_normal((16, 65536)).astype("f4"),
             "labels": rng.integers(0, 65536, 32).astype("int64")}
    feeds["labels"][:4] = -100  # ignored: the mean is over the 28 counted tokens
    run = run_spmd(c.program, feeds)
    out, want = run.outputs(c.program), run_unsharded(c.logical, feeds)
    logits = torch.tensor(feeds["x"]) @ torch.tensor(feeds["w"])
    ref = torch.nn.functional.cross_entropy(logits, torch.tensor(feeds["labels"])).item()
    assert_equivalent(out["loss"], want["loss"])
    assert_equivalent(out["loss"], np.float32(ref))
    assert_equivalent(out["w.grad"], want["w.grad"])


# ---- padded vocab ----------------------------------------------------------------------

PAD = "%zp: f32[4,8] = mask_pad(%z) {size=7}\n"


def test_padded_logits_never_win_and_never_count():
    g, feeds = _ce_graph(4, 3, 8, PAD), _ce_feeds()
    feeds["w"][:, 7] = 50.0  # the padded column would win everything
    feeds["x"] = np.abs(feeds["x"])
    feeds["l"] = np.array([0, 6, 3, 4], "int64")
    c = _compile(g, VOCAB_PARALLEL.replace("w colwise", "w colwise\nactivation zp split-hidden"))
    run, out = _run(c, feeds)
    logits = (torch.tensor(feeds["x"]) @ torch.tensor(feeds["w"]))[:, :7]  # the real vocab only
    want = torch.nn.functional.cross_entropy(logits, torch.tensor(feeds["l"]), reduction="none").numpy()
    assert_equivalent(out["ce"], want)
    am = g.replace("%ce: f32[4] = cross_entropy(%zp, %l)\nreturn %ce", "%a: i64[4] = argmax(%zp) {dim=1}\n"
                   "%s: f32[4,8] = softmax(%zp) {dim=1}\nreturn %a, %s")
    c2 = _compile(am, "mesh tp=2\nw colwise\nactivation zp split-hidden\nactivation a.key [P(max)]\n")
    _, out2 = _run(c2, feeds)
    np.testing.assert_array_equal(out2["a"], torch.argmax(logits, 1).numpy())
    assert (out2["s"][:, 7] == 0).all()
    np.testing.assert_allclose(out2["s"][:, :7], torch.softmax(logits, 1).numpy(), rtol=0, atol=2e-7)


# ---- torch emitter vs numpy ------------------------------------------------------------

TORCH_CASES = {  # op: (operands, result type, attrs)
    "log": ([np.abs(np.arange(1, 7, dtype="f4")).reshape(2, 3)], TensorType((2, 3)), {}),
    "amax": ([np.array([[1, 5, 5], [-2, -1, -3]], "f4")], TensorType((2,)), {"dims": (1,)}),
    "amax_grad": ([np.array([1, 2], "f4"), np.array([[1, 5, 5], [-2, -1, -3]], "f4"), np.array([5, -1], "f4")],
                  TensorType((2, 3)), {"dims": (1,)}),
    "argmax": ([np.array([[1, 5, 5], [-2, -1, -3]], "f4")], TensorType((2,), "int64"), {"dim": 1}),
    "argmax_key": ([np.array([[1, 5, 5], [-2, -1, -3]], "f4")], TensorType((2,), "int64"), {"dim": 1}),
    "argmax_index": ([np.array([4294967295, 4294967290], "int64")], TensorType((2,), "int64"), {}),
    "mean": ([np.arange(6, dtype="f4").reshape(2, 3)], TensorType((3,)), {"dims": (0,)}),
    "softmax": ([np.arange(6, dtype="f4").reshape(2, 3)], TensorType((2, 3)), {"dim": 0}),
    "log_softmax": ([np.arange(6, dtype="f4").reshape(2, 3)], TensorType((2, 3)), {"dim": 1}),
    "pick": ([np.arange(6, dtype="f4").reshape(2, 3), np.array([2, -100])], TensorType((2,)), {}),
    "pick_grad": ([np.array([1.5, 2], "f4"), np.array([1, 0])], TensorType((2, 3)), {"ignore_index": 0}),
    "label_mask": ([np.array([1, -100, 3])], TensorType((3,)), {}),
    "mask_pad": ([np.arange(6, dtype="f4").reshape(2, 3)], TensorType((2, 3)), {"size": 2}),
    "topk": ([np.array([[1, 5, 4], [-2, -1, -3]], "f4")], TensorType((2, 2)), {"k": 2, "dim": 1}),
    "topk_index": ([np.array([[1, 5, 4], [-2, -1, -3]], "f4")], TensorType((2, 2), "int64"), {"k": 2, "dim": 1}),
    "take_along": ([np.arange(6, dtype="f4").reshape(2, 3), np.array([[2, 0], [1, 1]])], TensorType((2, 2)),
                   {"dim": 1}),
    "put_along": ([np.array([[1.5, 2], [3, 4]], "f4"), np.array([[2, 0], [1, 1]])], TensorType((2, 3)),
                  {"dim": 1, "size": 3}),
}


@pytest.mark.parametrize("op", sorted(TORCH_CASES))
def test_torch_rows_match_numpy(op):
    xs, ty, attrs = TORCH_CASES[op]
    node = Node("y", op, tuple(f"a{i}" for i in range(len(xs))), ty, make_attrs(**attrs))
    env = {"torch": torch, **{k: getattr(program_reduce, k) for k in dir(program_reduce)}}
    env.update({f"a{i}": torch.tensor(x) for i, x in enumerate(xs)})
    got = eval(node_code(node, [f"a{i}" for i in range(len(xs))]), env)  # noqa: S307 - our own table
    want = NUMPY_OPS[node.op](xs, node)
    assert tuple(got.shape) == tuple(np.shape(want))
    assert_equivalent(got.numpy(), want, what=op)


def test_every_reduction_row_has_a_torch_case():
    assert set(REDUCE_FORMATS) - {"all_reduce_max", "partial_mask_max"} == set(TORCH_CASES)


# ---- hypothesis: shapes x layouts on the interpreter ------------------------------------

@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["softmax", "log_softmax", "argmax", "amax", "mean"]), st.integers(0, 1),
       st.integers(0, 2), st.sampled_from([(2, 4), (4, 2), (4, 6), (2, 8)]), st.integers(0, 9))
def test_split_reductions_equal_the_unsharded_op(op, dim, split, shape, seed):
    out_ty = ("i64" if op == "argmax" else "f32")
    out_shape = shape if op in ("softmax", "log_softmax") else (shape[1 - dim],)
    attr = f"dims=({dim},)" if op in ("amax", "mean") else f"dim={dim}"
    g = (f"%x: f32[{shape[0]},{shape[1]}] = input()\n"
         f"%y: {out_ty}[{','.join(map(str, out_shape))}] = {op}(%x) {{{attr}}}\nreturn %y\n")
    layout = ["[S(0)]", "[S(1)]", "[R]"][split]
    c = _compile(g, f"mesh tp=2\ninput x {layout}\n")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype("f4") * 10
    feeds = {"x": x}
    run, out = _run(c, feeds)
    want = run_unsharded(parse_graph(g), feeds)["y"]
    if op == "argmax":
        np.testing.assert_array_equal(out["y"], want)
    else:
        assert_equivalent(out["y"], want)


def test_partial_max_layout_types_are_partials():
    assert isinstance(PMAX, Partial) and PMAX != P


# ---- torchrun: program.py with all_reduce(max), argmax keys, pick on 2 gloo ranks ----------

@pytest.mark.slow
def test_vocab_parallel_program_on_two_gloo_ranks(tmp_path):
    from parcomp_backends.torch.launch import assemble_outputs, run_torchrun, write_checkpoint, write_program
    g = _ce_graph(4, 3, 8, PAD).replace("return %ce", "%a: i64[4] = argmax(%zp) {dim=1}\nreturn %ce, %a")
    c = _compile(g, VOCAB_PARALLEL.replace("w colwise", "w colwise\nactivation zp split-hidden")
                 + "activation a.key [P(max)]\n")
    feeds = _ce_feeds()
    feeds["l"] = np.array([0, 6, 3, 4], "int64")
    write_program(c, tmp_path, "cpu")
    ckpt = write_checkpoint({"w": feeds["w"]}, tmp_path / "model.pt")
    torch.save({k: torch.tensor(feeds[k]) for k in ("x", "l")}, tmp_path / "inputs.pt")
    res = run_torchrun(tmp_path, 2, ckpt, str(tmp_path / "inputs.pt"), tmp_path / "out.pt", (), timeout=240)
    assert res.returncode == 0, res.stderr[-4000:]
    out = assemble_outputs(tmp_path / "out.pt", c.program)
    run, want = _run(c, {k: feeds[k] for k in feeds})
    np.testing.assert_array_equal(out["a"], want["a"])
    assert_equivalent(out["ce"], want["ce"])
    assert "all_reduce_max_(" in (tmp_path / "program.py").read_text()


# ---- torch.export frontend ------------------------------------------------------------

class _Heads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 6)

    def forward(self, x):
        z = self.proj(x)
        return (torch.softmax(z, -1), torch.log_softmax(z, dim=0), z.amax(dim=-1, keepdim=True),
                z.argmax(dim=1), z.mean(dim=(0,)), torch.log(torch.exp(z) + 1), z.sum(-1, keepdim=True), z.sum())


def test_aten_reductions_lower_and_match_torch():
    from parcomp.frontends.torch.export import import_torch
    torch.manual_seed(0)
    m, x = _Heads(), torch.randn(3, 4)
    g = import_torch(m, (x,))
    assert {"softmax", "log_softmax", "amax", "argmax", "mean", "log", "sum"} <= {n.op for n in g.nodes}
    feeds = {"x": x.numpy(), **{k: v.detach().numpy() for k, v in m.state_dict().items()}}
    got = run_unsharded(g, feeds)
    for i, want in enumerate(m(x)):
        name = f"output_{i}"
        if want.dtype == torch.int64:
            np.testing.assert_array_equal(got[name], want.numpy())
        else:
            assert_equivalent(got[name], want.detach().numpy(), what=name)


# ---- train loss=cross_entropy(...) against torch.optim ---------------------------------

def test_train_cross_entropy_options_match_torch_on_vocab_split_logits(tmp_path, capsys):
    from parcomp.cli.main import main
    spec = tmp_path / "ce.pcs"
    spec.write_text("mesh tp=2\n0.weight colwise\n2.weight colwise\ntrain loss=cross_entropy("
                    "label_smoothing=0.1, ignore_index=1) optimizer=sgd(lr=0.1) steps=2\n")
    rc = main(["check", "specs/models.py:torch_mlp", "--spec", str(spec)])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert "vs torch.optim" in out and out.rstrip().endswith("OK")
    spec.write_text("mesh tp=2\ntrain loss=cross_entropy(label_smoothing=1.5)\n")
    assert main(["check", "specs/models.py:torch_mlp", "--spec", str(spec)]) == 2
    assert "label_smoothing=1.5" in capsys.readouterr().err


# ---- hypothesis: redistribution from and to P(max) on every rank --------------------------

@st.composite
def _max_case(draw):
    mesh = Mesh(tuple(draw(st.sampled_from([(("a", 2),), (("a", 4),), (("a", 2), ("b", 2))]))))
    rank = draw(st.integers(1, 2))
    ty = TensorType(tuple(draw(st.sampled_from([4, 8])) for _ in range(rank)), "float64")

    def layout():  # one partial kind per layout: no rule mixes a sum and a max on one value
        kind = draw(st.sampled_from([P, PMAX]))
        return tuple(draw(st.sampled_from([R, kind] + [Shard(d) for d in range(rank)])) for _ in mesh.axes)

    return mesh, ty, layout(), layout()


@settings(max_examples=40, deadline=None)
@given(_max_case(), st.integers(0, 2**16))
# P(max) on two axes: the interpreter's pieces once held the value on no rank (each axis chose
# its owner per coordinate of the other), so even a right max all_reduce looked wrong
@example(case=(Mesh((("a", 2), ("b", 2))), TensorType((4,), "float64"), (PMAX, PMAX), (R, R)), seed=726)
def test_planned_redistribution_with_partial_max_gives_the_value(case, seed):
    from parcomp.ir.graph import Graph
    from parcomp.passes.insert_collectives import insert_collectives
    from parcomp.passes.localize import localize
    mesh, ty, src, tgt = case
    g = Graph((Node("x", "input", (), ty, (), src), Node("y", "relayout", ("x",), ty, (), tgt, (tgt,))),
              ("y",), mesh)
    prog = localize(insert_collectives(g))
    verify(prog)
    assert not any(n.op == "reduce_scatter" and PMAX in prog[n.inputs[0]].layout for n in prog.nodes)
    rng = np.random.default_rng(seed)
    full = rng.standard_normal(ty.shape)
    run = run_spmd(prog, {"x": full}, partial_rng=rng)
    got = assemble([e[prog.outputs[0]] for e in run.env], tgt, ty.shape, mesh, "float64")
    assert_equivalent(got, full)
