"""The spec's MoE capacity policy: ``moe capacity_factor=F [drop=tokens]`` / ``moe
drop=none`` (parcomp/spec/moe.py, parcomp/passes/moe_capacity.py): the graph the spec makes is
the graph of the model built with that capacity, the ep=2 step equals the unsharded step and
torch's with that capacity, a token dropped from every slot leaves the block as zeros (the
residual carries it, as Switch), and every misuse is a located error."""
from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from parcomp.check.differential import verdict
from parcomp.check.train_check import lockstep, train_feeds
from parcomp.cli.commands import feeds_for
from parcomp.cli.main import main
from parcomp.compile.compiler import compile_graph
from parcomp.errors import SpecError
from parcomp.frontends.torch.export import import_torch
from parcomp.ir import parse_graph
from parcomp.passes.moe_capacity import apply_moe_spec
from parcomp.reference import moe_ops
from parcomp.reference.interpreter import run_spmd
from parcomp.reference.numpy_ops import run_unsharded
from parcomp.spec import parse_spec

from moe_cases import MoeCase, feeds, model_text, spec_text
from numerics import assert_equivalent

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..")
MODELS = os.path.join(ROOT, "specs", "models.py")
SPECS = os.path.join(ROOT, "specs")
MAX_EXAMPLES = 10 if os.environ.get("CI") else 30
sys.path.insert(0, SPECS)
import models  # noqa: E402


def _ep2(moe_line: str, train: bool = True):
    with open(os.path.join(SPECS, "moe_ep2_train.pcs")) as f:
        text = "".join(line for line in f if train or not line.startswith("train"))
    return parse_spec(text + moe_line + "\n", "moe_cap.pcs")


def _typed(graph):
    return [(n.name, n.op, n.inputs, n.type, n.attrs) for n in graph.nodes]


@pytest.mark.parametrize("line,factor", [("moe capacity_factor=1.0", 1.0), ("moe capacity_factor=1.25 drop=tokens", 1.25),
                                         ("moe capacity_factor=0.5", 0.5), ("moe capacity_factor=3", 3.0),
                                         ("moe drop=none", 0.0)])
@pytest.mark.parametrize("built", [0.0, 1.0])
def test_spec_capacity_gives_the_graph_of_the_model_built_with_it(line, factor, built):
    """moe_block built with capacity factor ``built`` (0: none), rewritten by the spec's
    statement, is node for node (types, attributes) the export of moe_block built with the
    spec's factor: route and dispatch capacity, the buffer [B, E, C, H], the experts'
    [E, B*C, .] matmuls and the reshapes around them."""
    m, ex, names = models.moe_block("skewed", capacity_factor=built)
    got, changes = apply_moe_spec(import_torch(m, ex, names), _ep2(line))
    want_m, want_ex, _ = models.moe_block("skewed", capacity_factor=factor)
    assert _typed(got) == _typed(import_torch(want_m, want_ex, names))
    (c,) = changes
    assert (c["capacity"], c["model_capacity"], c["slots"]) == (want_m.capacity, m.capacity, want_m.capacity or 8)


def test_spec_capacity_drops_the_overflow_and_ep2_step_equals_unsharded_and_torch():
    """The skewed routing overflows expert 0 (every token wants it): with ``moe
    capacity_factor=1.0`` (C = 4 of 8 tokens) slots are dropped; the ep=2 training step equals
    the unsharded step and torch's step of the model built with the same capacity."""
    m, ex, names = models.moe_block("skewed")  # built without a capacity
    c = compile_graph(import_torch(m, ex, names), _ep2("moe capacity_factor=1.0"))
    assert [n.attr("capacity") for n in c.unsharded.by_op("moe_route", "moe_dispatch")] == [4, 4]
    want_m, want_ex, _ = models.moe_block("skewed", capacity_factor=1.0)
    z = (ex[0].numpy() @ m.gate.weight.detach().numpy().T)
    top, kept = moe_ops.top_mask(z, 2, 4)
    assert (top & ~kept)[..., 0].sum() > 0  # expert 0 overflows
    r = lockstep(c, want_m, want_ex, train_feeds(c, want_m, want_ex, 0, feeds_for), 1)
    assert verdict(r["vs_unsharded"]) == "OK", r["vs_unsharded"]["why"]
    assert verdict(r["vs_torch"]) == "OK", r["vs_torch"]["why"]


def test_a_token_dropped_from_every_slot_leaves_the_block_as_zeros():
    """top-1, every token routed to expert 0, capacity 1 slot (``capacity_factor=1``: ceil(1 *
    4 * 1 / 4)): per row the first token is kept and the other three dropped, so their block
    output is exactly 0 (Switch: the residual passes them on); ep=2 forward equals the
    unsharded graph of the model built with capacity 1."""
    case = MoeCase(experts=4, top_k=1, batch=2, seq=4, hidden=4, inter=4, capacity=0, ep=2, skew=3.0)
    spec = parse_spec(spec_text(case, train=False) + "moe capacity_factor=1\n", "case.pcs")
    c = compile_graph(parse_graph(model_text(case)), spec)
    f = feeds(c.logical, case, 0)
    got = run_spmd(c.program, f).outputs(c.program)["output"]
    assert np.all(got[:, 1:] == 0) and np.all(np.any(got[:, 0] != 0, axis=-1))
    built = parse_graph(model_text(MoeCase(**{**case.__dict__, "capacity": 1})))
    assert _typed(c.unsharded) == _typed(built)
    want = run_unsharded(built, f)["output"]
    assert_equivalent(got, want, what="output")


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(st.sampled_from([2, 4]), st.sampled_from([1, 2]), st.integers(1, 4), st.sampled_from([3, 4, 6]),
       st.sampled_from([0.25, 0.5, 1.0, 1.25, 2.0]), st.sampled_from([0.0, 1.0, 3.0]), st.integers(0, 3))
def test_random_spec_capacity_equals_the_model_built_with_it(ep, per, top_k, seq, factor, skew, seed):
    """Expert counts, top-k, sequence lengths, factors and routings: the spec's capacity gives
    the graph of the case built with ``C = min(ceil(F S k / E), S)``, and the ep training step equals
    the unsharded one in float64, as ``parcomp check`` compares them."""
    experts = ep * per
    top_k = min(top_k, max(1, experts - 1) if skew else experts)  # k = E under a skew: nothing to resolve
    case = MoeCase(experts=experts, top_k=top_k, batch=ep, seq=seq, hidden=4, inter=4, capacity=0, ep=ep, skew=skew)
    built = MoeCase(**{**case.__dict__, "capacity": min(max(1, math.ceil(factor * seq * top_k / experts)), seq)})
    spec = parse_spec(spec_text(case) + f"moe capacity_factor={factor}\n", "case.pcs")
    got, _ = apply_moe_spec(parse_graph(model_text(case)), spec)
    assert _typed(got) == _typed(parse_graph(model_text(built)))
    c = compile_graph(parse_graph(model_text(case)), spec)
    f = feeds(c.logical, case, seed)
    r = lockstep(c, None, None, f, 1)["vs_unsharded"]  # in float64, as `parcomp check`
    assert verdict(r) == "OK", (case, factor, r["why"])


BAD = [
    ("moe\n", 1, "moe says nothing"),
    ("moe capacity_factor=0\n", 5, "give a number > 0"),
    ("moe capacity_factor=-1.5\n", 5, "give a number > 0"),
    ("moe capacity_factor=abc\n", 5, "give a number > 0"),
    ("moe drop=none capacity_factor=1\n", 15, "drop=none has no capacity"),
    ("moe drop=tokens\n", 5, "needs capacity_factor="),
    ("moe drop=priority capacity_factor=1\n", 5, "not built yet"),
    ("moe drop=all capacity_factor=1\n", 5, "is not a drop policy"),
    ("moe capacity=4\n", 5, "no option 'capacity'"),
    ("moe capacity_factor=1 capacity_factor=2\n", 23, "given twice"),
    ("moe drop=none\nmoe drop=none\n", 1, "moe is given twice"),
]


@pytest.mark.parametrize("text,col,words", BAD)
def test_bad_moe_statements_are_located_errors(text, col, words):
    with pytest.raises(SpecError) as e:
        parse_spec("mesh ep=2\n" + text, "bad.pcs")
    assert e.value.loc.line == 1 + text.count("moe")  # the second statement when given twice
    assert e.value.loc.col == col and words in str(e.value), str(e.value)


def test_moe_statement_on_a_model_without_moe_is_a_located_cli_error(capsys, tmp_path):
    spec = tmp_path / "s.pcs"
    with open(os.path.join(SPECS, "tiny_relu_mlp_tp2.pcs")) as f:
        spec.write_text(f.read() + "moe capacity_factor=1.25\n")
    rc = main(["compile", os.path.join(SPECS, "tiny_relu_mlp.pcir"), "--spec", str(spec), "--out",
               str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "no MoE layer" in err and "s.pcs:" in err and "Traceback" not in err, err


UNFOLLOWABLE = [
    ("%ds: f32[2,2,4] = sum(%d) {dims=(2,)}", 0, "%ds (sum) contracts or reduces the expert slots of %d"),
    ("%ds: f32[2,2,2,8] = reshape(%d)", 0, "the reshape %ds cuts the expert slots"),
    ("", 1, "%d was built with 1 slot per expert"),
]


@pytest.mark.parametrize("extra,built,words", UNFOLLOWABLE)
def test_slots_that_cannot_be_followed_are_located_errors(extra, built, words):
    """A model that sums its dispatch buffer over the slots or reshapes the slot dim apart (a
    value whose shape does not follow the capacity), or that was built with 1 slot (nothing
    to follow), gets a located error at the statement, never a wrong shape."""
    case = MoeCase(experts=2, top_k=1, batch=2, seq=4, hidden=4, inter=4, capacity=built, ep=2)
    text = model_text(case)
    if extra:
        text = text.replace("return %output", f"{extra}\nreturn %output, %ds")
    spec = parse_spec(spec_text(case, train=False) + "moe capacity_factor=1.5\n", "case.pcs")
    with pytest.raises(SpecError) as e:
        apply_moe_spec(parse_graph(text), spec)
    assert words in str(e.value) and e.value.loc.line == 9, str(e.value)


def test_explain_shows_the_spec_capacity_and_the_dropped_pairs(capsys, tmp_path):
    spec = tmp_path / "s.pcs"
    spec.write_text(_text_with("moe capacity_factor=1.0"))
    rc = main(["explain", f"{MODELS}:moe_block_skewed", "--spec", str(spec), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (rec,) = out["moe"]
    assert rc == 0 and rec["capacity"] == 4
    assert rec["dropped"] == 2 * rec["tokens"] - sum(rec["tokens_per_expert"]) > 0
    assert max(rec["tokens_per_expert"]) <= 4 * 4  # 4 rows, 4 slots each


def _text_with(line: str) -> str:
    with open(os.path.join(SPECS, "moe_ep2_train.pcs")) as f:
        return f.read() + line + "\n"


def test_check_with_a_spec_capacity_compares_with_the_graph_of_that_capacity(capsys, tmp_path):
    """``parcomp check`` of a spec that changes the model's capacity: the torch module built
    without one is no reference, so the step is checked against the unsharded step with the
    spec's capacity (no vs torch.optim), and it is OK."""
    spec = tmp_path / "s.pcs"
    spec.write_text(_text_with("moe capacity_factor=1.0"))
    rc = main(["check", f"{MODELS}:moe_block_skewed", "--spec", str(spec), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["verdict"] == "OK" and "vs_torch" not in out, out.get("why")


def test_check_with_a_spec_capacity_says_what_the_reference_is(capsys, tmp_path):
    """The "vs torch.optim" line is not silently dropped: it says the reference is the model
    with the spec's capacity (4 = ceil(1.0 * 8 * 2 / 4)), and the torch model's own (8)."""
    spec = tmp_path / "s.pcs"
    spec.write_text(_text_with("moe capacity_factor=1.0"))
    rc = main(["check", f"{MODELS}:moe_block_skewed", "--spec", str(spec)])
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if "vs torch.optim" in ln]
    assert rc == 0 and "not compared" in line and "the model with capacity 4" in line, line
    assert "capacity_factor=1" in line and "built with capacity 8" in line, line


@pytest.mark.parametrize("factor", [2.0, 4.0, 1e9, 1e300])
def test_a_capacity_is_capped_at_the_tokens_of_a_row(factor, capsys, tmp_path):
    """An expert takes at most one slot per token (a token's top-k experts differ), so the
    capacity is min(ceil(F S k / E), S): a huge factor gives S = 8 slots, the graph of the
    model built with that factor (capped alike), a buffer [B, E, 8, H], and a note saying so."""
    spec = _ep2(f"moe capacity_factor={factor!r}", train=False)
    m, ex, names = models.moe_block()
    graph, changes = apply_moe_spec(import_torch(m, ex, names), spec)
    (c,) = changes
    asked = math.ceil(factor * 8 * 2 / 4)
    assert (c["capacity"], c["slots"], c["asked"]) == (8, 8, asked)
    assert graph[c["dispatch"]].type.shape == (4, 4, 8, 16)
    want_m, want_ex, _ = models.moe_block(capacity_factor=factor)
    assert want_m.capacity == 8 and _typed(graph) == _typed(import_torch(want_m, want_ex, names))
    spec_file = tmp_path / "s.pcs"
    spec_file.write_text(_text_with(f"moe capacity_factor={factor!r}"))
    rc = main(["compile", f"{MODELS}:moe_block", "--spec", str(spec_file), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 0 and ("capped at 8, the 8 tokens of a row" in err) == (asked > 8), err


@pytest.mark.slow
def test_spec_capacity_trains_under_torchrun_like_unsharded(capsys, tmp_path):
    """The emitted program.py honours the spec's capacity: ep=2 on gloo ranks, skewed routing
    with expert 0 overflowing, one step equal to the unsharded step with that capacity."""
    spec = tmp_path / "s.pcs"
    spec.write_text(_text_with("moe capacity_factor=1.0"))
    rc = main(["run", f"{MODELS}:moe_block_skewed", "--spec", str(spec), "--nproc", "2", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["verdict"] == "OK" and out["world_size"] == 2, out.get("why")


def test_explain_prices_the_experts_compute_of_the_slowest_rank(capsys):
    """TP vs EP per step: EP's slowest rank computes its experts' (token, expert) pairs whole,
    TP every rank 1/n of all pairs: 18 H F FLOPs a pair (3 matmuls, forward + backward) at the
    cost model's rate; on the skewed routing EP's compute is the larger, by its imbalance."""
    from parcomp.ir.redistribute import SECONDS_PER_FLOP

    rc = main(["explain", f"{MODELS}:moe_block_skewed", "--spec", os.path.join(SPECS, "moe_ep2_train.pcs"), "--json"])
    out = capsys.readouterr().out
    (rec,) = json.loads(out.strip().splitlines()[-1])["moe"]
    pair_s = 18 * 16 * 32 * SECONDS_PER_FLOP  # hidden 16, expert intermediate 32
    ep, tp = rec["ep"], rec["tp"]
    assert rc == 0 and round(ep["compute_seconds"] / pair_s) == max(ep["load_per_rank"])
    assert round(2 * tp["compute_seconds"] / pair_s) == sum(ep["load_per_rank"])
    assert ep["compute_seconds"] > tp["compute_seconds"] and ep["imbalance"] > 1.2
    for a in (ep, tp):
        assert a["step_seconds"] == a["seconds"] + a["compute_seconds"]
