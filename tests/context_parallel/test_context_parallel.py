"""Context parallel attention: the `context-parallel` statement, its located errors, the
all_gather lowering (K/V gathered forward, dK/dV reduce-scattered to their owners backward), the
causal mask at each rank's global query rows, equal to unsharded forward and backward."""
import json
import pathlib
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from parcomp.cli.main import main
from parcomp.compile.compiler import compile_graph
from parcomp.errors import SpecError
from parcomp.ir import parse_graph
from parcomp.reference.interpreter import run_spmd
from parcomp.reference.numpy_ops import run_unsharded
from parcomp.spec import parse_spec

from graphs import random_feeds, spec
from numerics import assert_all_equivalent, assert_equivalent

ROOT = pathlib.Path(__file__).resolve().parents[1].parent
MODEL = f"{ROOT / 'specs' / 'models.py'}:causal_attention"
CANONICAL = ROOT / "specs" / "attention_cp2_train.pcs"


def _attn(seq, batch=1, dim=4):
    """x [batch, 1, seq, dim] -> q, k, v projections -> causal sdpa -> output."""
    t = f"{batch},1,{seq},{dim}"
    lines = [f"%x: f32[{t}] = input()"]
    for w in "qkv":
        lines += [f"%w{w}: f32[{dim},{dim}] = param()", f"%{w}: f32[{t}] = matmul(%x, %w{w})"]
    lines += [f"%o: f32[{t}] = sdpa(%q, %k, %v) {{causal=true, scale=0.5}}", "return %o as output"]
    return "\n".join(lines) + "\n"


def _cp_spec(mesh="cp=2", extra="", train="train loss=mse optimizer=sgd(lr=0.1)\n"):
    return spec(f"mesh {mesh}\ncontext-parallel\ninput x split-seq\noutput output split-seq\n{extra}{train}")


def _kinds(report):
    return [(c["kind"], c["phase"]) for c in report["collectives"]]


# ---- the statement -------------------------------------------------------------------------

def test_statement_parses_axis_lowering_and_location():
    s = spec("mesh dp=2 cp=2\n\ncontext-parallel\n")
    assert (s.context_parallel.axis, s.context_parallel.lowering, s.context_parallel.loc.line) == ("cp", "all_gather", 3)
    assert spec("mesh sp=4\ncontext-parallel over sp lowering=all_gather\n").context_parallel.axis == "sp"
    assert spec("mesh dp=2 tp=2\ncontext-parallel over dp\n").context_parallel.axis == "dp"
    assert spec("mesh cp=2\n").context_parallel is None


@pytest.mark.parametrize("text,where,match", [
    ("mesh cp=2\ncontext-parallel over xx\n", (2, 23), "unknown mesh axis 'xx'"),
    ("mesh dp=2 tp=2\ncontext-parallel\n", (2, 1), "no 'cp' axis"),
    ("mesh cp=2\ncontext-parallel\ncontext-parallel\n", (3, 1), "given twice"),
    ("mesh cp=2\ncontext-parallel chunks=2\n", (2, 18), "no option 'chunks'"),
    ("mesh cp=2\ncontext-parallel lowering=load_balanced\n", (2, 18), "lowering=load_balanced is not built yet"),
    ("mesh cp=2\ncontext-parallel lowering=gather\n", (2, 18), "'gather' is not a lowering"),
])
def test_statement_errors_are_located(text, where, match):
    with pytest.raises(SpecError, match=match) as e:
        spec(text)
    assert (e.value.loc.line, e.value.loc.col) == where


@pytest.mark.parametrize("text,col", [
    ("mesh cp=2\ncontext-parallel lowering=ring lowering=all_to_all\n", 32),
    ("mesh cp=2\ncontext-parallel over cp chunking=balanced chunking=contiguous\n", 44),
    ("mesh ep=2\nmoe capacity_factor=1 drop=tokens capacity_factor=2\n", 35),
    ("mesh dp=2\ntrain loss=mse schedule=1f1b batch=4 schedule=gpipe\n", 38),
    ("mesh dp=2\ntopology nodes=1 devices_per_node=2 nodes=1\n", 37),
    ("mesh dp=2\ntopology timeout=5 timeout=6\n", 20),
])
def test_an_option_given_twice_is_an_error_at_the_second(text, col):
    """Every key=value statement takes each option once (never "the last one wins"): the
    error is at the second one and names the column of the first."""
    with pytest.raises(SpecError, match=r"option \w+ is given twice \(first at column \d+\)") as e:
        spec(text)
    assert (e.value.loc.line, e.value.loc.col) == (2, col)


def test_a_model_without_attention_is_a_located_error():
    text = "%x: f32[2,8,16] = input()\n%y: f32[2,8,16] = gelu(%x)\nreturn %y as output\n"
    with pytest.raises(SpecError, match="no scaled-dot-product attention") as e:
        compile_graph(parse_graph(text), spec("mesh cp=2\n\ncontext-parallel\n"))
    assert e.value.loc.line == 3


def test_a_sequence_not_divisible_by_cp_is_a_located_error():
    with pytest.raises(SpecError, match=r"context-parallel over cp: sdpa %o output .*not divisible") as e:
        compile_graph(parse_graph(_attn(6)), spec("mesh cp=4\ncontext-parallel\n"))
    assert e.value.loc.line == 2


def test_without_the_statement_a_causal_query_split_is_never_chosen():
    """The causal query split needs the mark (the rank's row offset); unmarked sdpa keeps the old
    rule: its rows are gathered, never computed on a block with the mask at row 0."""
    c = compile_graph(parse_graph(_attn(8)), spec("mesh cp=2\ninput x split-seq\noutput output split-seq\n"))
    assert c.sharded["o"].layout[0].__class__.__name__ != "Shard"


# ---- exact small case: a rank's queries need another rank's keys ----------------------------

EXACT = """\
%q: f32[1,1,4,1] = input()
%k: f32[1,1,4,1] = input()
%v: f32[1,1,4,1] = input()
%o: f32[1,1,4,1] = sdpa(%q, %k, %v) {causal=true, scale=1.0}
return %o as output
"""


def test_rank_one_rows_see_rank_zero_keys_exactly():
    """q = 0: each query averages the values of the keys it sees. Rows 2, 3 (rank 1 of cp=2)
    must average v[0..2] and v[0..3], v[0], v[1] being rank 0's: 2.0 and 2.5. A mask at the
    rank's local row 0 would give 3.0 and 3.5 (only its own keys), the bug this pins."""
    g = parse_graph(EXACT)
    c = compile_graph(g, spec("mesh cp=2\ncontext-parallel\ninput * split-seq\noutput output split-seq\n"))
    feeds = {"q": np.zeros((1, 1, 4, 1), np.float32), "k": np.zeros((1, 1, 4, 1), np.float32),
             "v": np.arange(1, 5, dtype=np.float32).reshape(1, 1, 4, 1)}
    run = run_spmd(c.program, feeds)
    want = np.array([1.0, 1.5, 2.0, 2.5], np.float32).reshape(1, 1, 4, 1)
    assert_equivalent(run.outputs(c.program)["output"], want, what="output")
    assert_equivalent(run.env[1][c.program.outputs[0]].reshape(-1), want.reshape(-1)[2:], what="rank 1's rows")
    assert [r["kind"] for r in c.report["collectives"]] == ["all_gather", "all_gather"]  # K and V


# ---- equal to unsharded, forward and backward -----------------------------------------------

def _equal_to_unsharded(c, seed=0):
    feeds = random_feeds(c.logical, seed)
    run = run_spmd(c.program, feeds)
    assert_all_equivalent(run.outputs(c.program), run_unsharded(c.logical, feeds))


@settings(max_examples=12, deadline=None)
@given(cp=st.sampled_from([2, 4]), blocks=st.integers(1, 4), batch=st.integers(1, 2),
       dp=st.booleans(), seed=st.integers(0, 10_000))
def test_training_equals_unsharded_over_sequence_lengths_and_chunkings(cp, blocks, batch, dp, seed):
    """Sequence length cp x blocks (each rank's chunk 1..4 rows), with and without a dp axis
    splitting the batch: loss, every gradient (x.grad too) and every updated weight."""
    seq = cp * blocks
    mesh, batch = (f"dp=2 cp={cp}", 2) if dp else (f"cp={cp}", batch)
    inputs = "input x [S(0), S(2)]\noutput output [S(0), S(2)]\n" if dp else "input x split-seq\noutput output split-seq\n"
    s = spec(f"mesh {mesh}\ncontext-parallel\n{inputs}train loss=mse optimizer=sgd(lr=0.1)\n")
    c = compile_graph(parse_graph(_attn(seq, batch)), s)
    assert ("all_gather", "forward") in _kinds(c.report) and ("reduce_scatter", "backward") in _kinds(c.report)
    _equal_to_unsharded(c, seed)


def _check(tmp_path, capsys, spec_text):
    path = tmp_path / "s.pcs"
    path.write_text(spec_text)
    rc = main(["check", MODEL, "--spec", str(path), "--json"])
    return rc, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("cp", [2, 4])
def test_llama_attention_with_rope_cp_equals_unsharded_forward_and_backward(tmp_path, capsys, cp):
    """transformers' LlamaAttention (RoPE from global positions, GQA) with the sequence over cp."""
    fwd = f"mesh cp={cp}\ncontext-parallel\ninput x split-seq\noutput output split-seq\n"
    rc, out = _check(tmp_path, capsys, fwd)
    assert rc == 0 and out["ok"] and out["err_over_tol"] <= 1, out
    assert [c["kind"] for c in out["collectives"]] == ["all_gather", "all_gather"]  # K and V only
    rc, out = _check(tmp_path, capsys, fwd + "train loss=mse optimizer=sgd(lr=0.1)\n")
    assert rc == 0 and out["ok"] and out["err_over_tol"] <= 1 and out["max_grad_err"] is not None, out


def test_dp_by_cp_trains_llama_attention_with_adamw_like_unsharded(tmp_path, capsys):
    """dp=2 x cp=2 (4 ranks): the batch over dp, the sequence over cp; K/V gathered over cp only,
    weight gradients all_reduced over dp."""
    rc, out = _check(tmp_path, capsys, "mesh dp=2 cp=2\ncontext-parallel\ninput x [S(0), S(1)]\n"
                     "output output [S(0), S(1)]\ntrain loss=mse optimizer=adamw(lr=0.01)\n")
    assert rc == 0 and out["ok"] and out["err_over_tol"] <= 1, out
    assert {(c["kind"], c["axis"]) for c in out["collectives"] if c["phase"] == "forward"} == {("all_gather", "cp")}
    assert [c["kind"] for c in out["collectives"] if c["axis"] == "cp" and c["kind"] != "all_gather"] == \
        ["reduce_scatter", "reduce_scatter"]


def test_canonical_spec_collective_list_is_pinned(tmp_path, capsys):
    """specs/attention_cp2_train.pcs: forward all_gather of K and of V; backward reduce_scatter
    of dK and of dV to their owners. The other gathers are the cost model's choice at this tiny
    size (2 x 16 tokens): activations are gathered for the weight gradients and the loss rather
    than all-reducing the weight gradients (docs/design/search.md, "Consequence worth knowing")."""
    rc = main(["check", MODEL, "--spec", str(CANONICAL), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["ok"] and out["err_over_tol"] <= 1, out
    got = [(c["kind"], c["phase"], c["bytes"]) for c in out["collectives"]]
    # K and V gathered with their 2 kv heads (2x2x8x8 f32 = 1 KiB), before GQA repeats them to 4
    assert got == [("all_gather", "forward", 1024), ("all_gather", "forward", 1024),
                   ("all_gather", "loss", 2048), ("all_gather", "forward", 2048),
                   ("reduce_scatter", "backward", 1024), ("reduce_scatter", "backward", 1024),
                   ("all_gather", "forward", 2048), ("all_gather", "backward", 1024),
                   ("all_gather", "backward", 1024), ("all_gather", "backward", 2048)]
    assert [c["reason"].split()[0] for c in out["collectives"][:2]] == ["%add_1", "%transpose_2"]  # k (RoPE), v


def test_program_masks_at_the_rank_rows_and_comments_every_collective(tmp_path):
    out = tmp_path / "out"
    assert main(["compile", MODEL, "--spec", str(CANONICAL), "-o", str(out)]) == 0
    text = (out / "program.py").read_text()
    assert text.count(".tril(COORD[0] * 8)") == 2  # sdpa, and its three gradients in one statement
    assert "is_causal=True" not in text
    lines = text.splitlines()
    # blocking, or started early and waited later (overlap-collectives): the comment is at the start
    calls = [i for i, line in enumerate(lines) if re.search(r"= (all_gather|reduce_scatter)(_start)?\(", line)]
    assert len(calls) == 10
    for i in calls:  # a comment above every collective: kind, axis, layouts, bytes and why
        j = i
        while lines[j - 1].lstrip().startswith("#"):
            j -= 1
        above = "\n".join(lines[j:i])
        assert "over cp" in above and "bytes/rank" in above


@pytest.mark.slow
def test_canonical_spec_runs_on_two_gloo_ranks_like_unsharded(capsys):
    rc = main(["run", MODEL, "--spec", str(CANONICAL), "--nproc", "2", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["ok"] and out["err_over_tol"] <= 1, out


# ---- context-parallel needs a cp axis or `over` ----

@pytest.mark.parametrize("mesh", ["tp=2", "dp=2"])
def test_context_parallel_on_a_mesh_without_cp_needs_over(mesh):
    with pytest.raises(SpecError, match=r"no 'cp' axis .*say 'context-parallel over AXIS'") as e:
        parse_spec(f"mesh {mesh}\ncontext-parallel\n", "s.pcs")
    assert (e.value.loc.line, e.value.loc.col) == (2, 1)
    assert parse_spec(f"mesh {mesh}\ncontext-parallel over {mesh[:2]}\n", "s.pcs").context_parallel.axis == mesh[:2]
    assert parse_spec("mesh cp=2\ncontext-parallel\n", "s.pcs").context_parallel.axis == "cp"
