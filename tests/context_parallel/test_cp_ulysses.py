"""Context parallel, the all_to_all (DeepSpeed-Ulysses) lowering: q/k/v exchanged from
the sequence split to a heads split, attention with the unsharded causal mask, the output
exchanged back; backward mirrored; GQA with fewer kv heads than cp ranks (kv heads repeated, their
gradients summed over the copies); equal to unsharded forward and backward. Also the SP vs CP
table of report.json and ``parcomp explain`` (parcomp/report/cp_report.py)."""
import json
import pathlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from parcomp.cli.main import main
from parcomp.compile.compiler import compile_graph
from parcomp.cost.links import LINKS
from parcomp.errors import SpecError
from parcomp.ir import parse_graph
from parcomp.reference.interpreter import run_spmd
from parcomp.reference.numpy_ops import run_unsharded
from parcomp.report.cp_report import layer_ways, sp_cp_lines

from graphs import random_feeds, spec
from numerics import assert_all_equivalent, assert_equivalent

ROOT = pathlib.Path(__file__).resolve().parents[1].parent
MODEL = f"{ROOT / 'specs' / 'models.py'}:causal_attention"
CANONICAL = ROOT / "specs" / "attention_cp2_a2a_train.pcs"
TRAIN = "train loss=mse optimizer=sgd(lr=0.1)\n"


def _gqa(seq, heads, kv, batch=1, dim=4):
    """x [b, heads, seq, dim] -> q; xkv [b, kv, seq, dim] -> k, v (repeated to ``heads`` as
    transformers' repeat_kv when kv < heads) -> causal sdpa -> output."""
    b, s, d = batch, seq, dim
    lines = [f"%x: f32[{b},{heads},{s},{d}] = input()", f"%xkv: f32[{b},{kv},{s},{d}] = input()"]
    for w, src, h in (("q", "x", heads), ("k", "xkv", kv), ("v", "xkv", kv)):
        lines += [f"%w{w}: f32[{d},{d}] = param()", f"%{w}: f32[{b},{h},{s},{d}] = matmul(%{src}, %w{w})"]
    for w in "kv":
        if kv != heads:
            lines += [f"%{w}e: f32[{b},{kv},{heads // kv},{s},{d}] = expand(%{w}) {{dims=(2,)}}",
                      f"%{w}r: f32[{b},{heads},{s},{d}] = reshape(%{w}e)"]
    kk, vv = ("kr", "vr") if kv != heads else ("k", "v")
    lines += [f"%o: f32[{b},{heads},{s},{d}] = sdpa(%q, %{kk}, %{vv}) {{causal=true, scale=0.5}}",
              "return %o as output"]
    return "\n".join(lines) + "\n"


def _a2a_spec(cp, train=TRAIN):
    return spec(f"mesh cp={cp}\ncontext-parallel lowering=all_to_all\ninput * split-seq\n"
                f"output output split-seq\n{train}")


def _a2a(report):
    return [c for c in report["collectives"] if c["kind"] == "all_to_all"]


# ---- the statement ---------------------------------------------------------------------------

def test_statement_takes_all_to_all_and_ulysses_is_its_name():
    assert spec("mesh cp=2\ncontext-parallel lowering=all_to_all\n").context_parallel.lowering == "all_to_all"
    assert spec("mesh cp=4\ncontext-parallel lowering=ulysses\n").context_parallel.lowering == "all_to_all"


def test_heads_not_divisible_by_cp_is_a_located_error():
    with pytest.raises(SpecError, match=r"lowering=all_to_all: sdpa %o q .* has 3 heads.*lowering=all_gather") as e:
        compile_graph(parse_graph(_gqa(4, 3, 3)), _a2a_spec(2, ""))
    assert (e.value.loc.line, e.value.loc.col) == (2, 1)


# ---- exact small-integer case ------------------------------------------------------------------

EXACT = """\
%q: f32[1,2,4,1] = input()
%k: f32[1,{kv},4,1] = input()
%v: f32[1,{kv},4,1] = input()
{repeat}%o: f32[1,2,4,1] = sdpa(%q, %{kk}, %{vv}) {{causal=true, scale=1.0}}
return %o as output
"""
REPEAT = ("%ke: f32[1,1,2,4,1] = expand(%k) {dims=(2,)}\n%kr: f32[1,2,4,1] = reshape(%ke)\n"
          "%ve: f32[1,1,2,4,1] = expand(%v) {dims=(2,)}\n%vr: f32[1,2,4,1] = reshape(%ve)\n")


@pytest.mark.parametrize("kv", [2, 1])
def test_rank_one_holds_head_one_over_the_whole_sequence_exactly(kv):
    """q = k = 0: query row i averages v[0..i]. Head 0's v is 1..4, head 1's 10..40 (with one kv
    head both heads read 1..4). Rank 1 of cp=2 computes head 1 over all 4 rows (its rows 0, 1
    come from rank 0) and, after the exchange back, holds rows 2, 3 of both heads."""
    text = EXACT.format(kv=kv, repeat=REPEAT if kv == 1 else "", kk="kr" if kv == 1 else "k",
                        vv="vr" if kv == 1 else "v")
    g = parse_graph(text)
    c = compile_graph(g, _a2a_spec(2, ""))
    v = np.array([1, 2, 3, 4, 10, 20, 30, 40][:4 * kv], np.float32).reshape(1, kv, 4, 1)
    feeds = {"q": np.zeros((1, 2, 4, 1), np.float32), "k": np.zeros((1, kv, 4, 1), np.float32), "v": v}
    head1 = [10.0, 15.0, 20.0, 25.0] if kv == 2 else [1.0, 1.5, 2.0, 2.5]
    want = np.array([[1.0, 1.5, 2.0, 2.5], head1], np.float32).reshape(1, 2, 4, 1)
    run = run_spmd(c.program, feeds)
    assert_equivalent(run.outputs(c.program)["output"], want, what="output")
    sdpa = next(n.name for n in c.program.nodes if n.op == "sdpa")
    assert_equivalent(run.env[1][sdpa], want[:, 1:], what="rank 1's head, all rows")
    assert_equivalent(run.env[1][c.program.outputs[0]], want[:, :, 2:], what="rank 1's rows")
    assert [r["kind"] for r in c.report["collectives"]] == ["all_to_all"] * 4  # q, k, v in; out back


# ---- equal to unsharded, forward and backward ---------------------------------------------------

@settings(max_examples=10, deadline=None)
@given(cp=st.sampled_from([2, 4]), per_rank=st.integers(1, 2), kv_pick=st.integers(0, 3),
       blocks=st.integers(1, 3), batch=st.integers(1, 2), train=st.booleans(), seed=st.integers(0, 10_000))
def test_equals_unsharded_over_sequence_lengths_and_head_counts(cp, per_rank, kv_pick, blocks, batch, train, seed):
    """Sequence cp x blocks, cp x per_rank q heads, kv heads any divisor of them (fewer than cp
    included): the output, or the loss, every gradient and updated weight, equal unsharded; the
    program's all_to_all bytes are the SP vs CP table's."""
    heads = cp * per_rank
    kvs = [k for k in (1, 2, 4, 8) if heads % k == 0]
    kv = kvs[kv_pick % len(kvs)]
    c = compile_graph(parse_graph(_gqa(cp * blocks, heads, kv, batch)), _a2a_spec(cp, TRAIN if train else ""))
    assert len(_a2a(c.report)) == (8 if train else 4)
    assert sum(r["bytes"] for r in _a2a(c.report)) == c.report["sp_vs_cp"]["ways"]["all_to_all"]["bytes_per_rank"]
    feeds = random_feeds(c.logical, seed)
    assert_all_equivalent(run_spmd(c.program, feeds).outputs(c.program), run_unsharded(c.logical, feeds))


def _check(tmp_path, capsys, spec_text):
    path = tmp_path / "s.pcs"
    path.write_text(spec_text)
    rc = main(["check", MODEL, "--spec", str(path), "--json"])
    return rc, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("cp", [2, 4])
def test_llama_attention_all_to_all_equals_unsharded_forward_and_backward(tmp_path, capsys, cp):
    """transformers' LlamaAttention (4 q heads, 2 kv heads, RoPE): cp=2 exchanges K/V with their
    2 kv heads (before the repeat), cp=4 (2 kv heads on 4 ranks) repeats them first and
    exchanges 4 heads, every rank receiving the kv head its q head needs; dK/dV of the copies
    summed (max_grad_err within the bound)."""
    fwd = f"mesh cp={cp}\ncontext-parallel lowering=all_to_all\ninput x split-seq\noutput output split-seq\n"
    rc, out = _check(tmp_path, capsys, fwd)
    assert rc == 0 and out["ok"] and out["err_over_tol"] <= 1, out
    q_bytes = 2 * 4 * 16 * 8 * 4 // cp * (cp - 1) // cp  # [2, 4, 16, 8] f32, split cp ways, (n-1)/n sent
    kv_bytes = q_bytes // 2 if cp == 2 else q_bytes
    assert [(c["kind"], c["bytes"]) for c in out["collectives"]] == \
        [("all_to_all", kv_bytes)] * 2 + [("all_to_all", q_bytes)] * 2 if cp == 2 else \
        [("all_to_all", q_bytes)] * 4
    rc, out = _check(tmp_path, capsys, fwd + TRAIN)
    assert rc == 0 and out["ok"] and out["err_over_tol"] <= 1 and out["max_grad_err"] is not None, out
    assert sum(c["kind"] == "all_to_all" for c in out["collectives"]) == 8


def test_dp_by_cp_all_to_all_trains_llama_attention_with_adamw_like_unsharded(tmp_path, capsys):
    """dp=2 x cp=2 (4 ranks): the batch over dp, the sequence over cp; the exchanges over cp only."""
    rc, out = _check(tmp_path, capsys, "mesh dp=2 cp=2\ncontext-parallel lowering=all_to_all\n"
                     "input x [S(0), S(1)]\noutput output [S(0), S(1)]\ntrain loss=mse optimizer=adamw(lr=0.01)\n")
    assert rc == 0 and out["ok"] and out["err_over_tol"] <= 1, out
    assert {c["axis"] for c in out["collectives"] if c["kind"] == "all_to_all"} == {"cp"}
    assert sum(c["kind"] == "all_to_all" for c in out["collectives"]) == 8
    assert {c["axis"] for c in out["collectives"] if c["phase"] == "forward"} == {"cp"}


def test_canonical_program_keeps_the_causal_mask_and_comments_every_all_to_all(tmp_path):
    out = tmp_path / "out"
    assert main(["compile", MODEL, "--spec", str(CANONICAL), "-o", str(out)]) == 0
    text = (out / "program.py").read_text()
    assert "is_causal=True" in text and ".tril(" not in text  # whole rows of its heads: the plain mask
    lines = text.splitlines()
    calls = [i for i, line in enumerate(lines) if "= all_to_all(" in line]
    assert len(calls) == 8
    for i in calls:  # a comment above every exchange: kind, axis, bytes and why
        j = i
        while lines[j - 1].lstrip().startswith("#"):
            j -= 1
        above = " ".join(lines[j:i])
        assert "all_to_all over cp" in above and "bytes/rank" in above and "context-parallel" in above


@pytest.mark.slow
def test_canonical_spec_trains_on_two_gloo_ranks_like_unsharded(capsys):
    rc = main(["run", MODEL, "--spec", str(CANONICAL), "--nproc", "2", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["ok"] and out["err_over_tol"] <= 1 and out["max_grad_err"] is not None, out
    assert sum(c["kind"] == "all_to_all" for c in out["collectives"]) == 8


# ---- SP vs CP ------------------------------------------------------------------------------------

def test_layer_ways_bytes_by_hand():
    """B=2, H=4, Hkv=2, S=16, D=8, f32 ([B, H, S, D] = 4096 B) on 2 ranks, a training step."""
    w = layer_ways(2, 4, 2, 16, 8, 4, 2, LINKS["nvlink"], train=True)
    assert {k: (r["calls"], r["bytes_per_rank"]) for k, r in w.items()} == {
        "sp": (4, 4 * 2048), "all_gather": (4, 4 * 1024), "all_to_all": (8, 2 * (1024 + 512 + 512 + 1024)),
        "ring": (2, 2048 + 4096), "ring_balanced": (2, 2048 + 4096)}  # chunking: same bytes
    w4 = layer_ways(2, 4, 2, 16, 8, 4, 4, LINKS["nvlink"], train=False)  # 2 kv heads < 4 ranks: repeated
    assert w4["all_to_all"]["bytes_per_rank"] == 4 * 768 and w4["all_gather"]["bytes_per_rank"] == 2 * 1536
    assert not layer_ways(1, 6, 6, 8, 2, 4, 4, LINKS["nvlink"], train=False)["all_to_all"]["possible"]


@pytest.mark.parametrize("path,way", [(CANONICAL, "all_to_all"),
                                      (ROOT / "specs" / "attention_cp2_train.pcs", "all_gather")])
def test_report_table_matches_the_programs_attention_exchanges(tmp_path, path, way):
    out = tmp_path / "out"
    assert main(["compile", MODEL, "--spec", str(path), "-o", str(out)]) == 0
    rep = json.loads((out / "report.json").read_text())
    rec = rep["sp_vs_cp"]
    assert (rec["this_spec"], rec["axis"], rec["ranks"], rec["seq"], rec["heads"], rec["kv_heads"]) == \
        (way, "cp", 2, 16, 4, 2)
    if way == "all_to_all":  # the pins' four exchanges each way
        mine = [c for c in rep["collectives"] if "context-parallel" in c["reason"]]
    else:  # K and V gathered (the first two, test_context_parallel), dK and dV reduce-scattered
        mine = rep["collectives"][:2] + [c for c in rep["collectives"] if c["kind"] == "reduce_scatter"]
        assert [c["reason"].split()[0] for c in mine[:2]] == ["%add_1", "%transpose_2"]
    assert sum(c["bytes"] for c in mine) == rec["ways"][way]["bytes_per_rank"]
    assert len(mine) == rec["ways"][way]["calls"]


def test_explain_prints_the_table_and_marks_this_spec(capsys):
    assert main(["explain", MODEL, "--spec", str(CANONICAL)]) == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("  CP ") or line.startswith("  SP ")]
    assert [r.split()[0] + r.split()[1] for r in rows] == ["SP(Megatron,", "CPall_gather", "CPall_to_all", "CPring",
                                                           "CPring,"]
    assert [r for r in rows if r.endswith("<- this spec")] == [rows[2]]
    assert main(["explain", MODEL, "--spec", str(CANONICAL), "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sp_cp_lines(got["sp_vs_cp"])[2:-1] == rows  # the last line: what "work" counts


def test_ring_row_follows_chunking_balanced_halves_the_slowest_ranks_causal_work(capsys):
    """Causal attention, B=2, H=4, S=16 on 2 ranks: contiguous chunks leave the last rank
    positions 8-15 (9 + ... + 16 = 100 visible pairs per head), balanced chunks give both ranks
    68 (0-3 and 12-15; 4-11), SP / all_to_all the whole 136 on H/2 heads; same bytes. On 8 ranks
    balanced is about half of contiguous. The balanced spec's own row is the balanced ring."""
    w = layer_ways(2, 4, 2, 16, 8, 4, 2, LINKS["nvlink"], train=True, causal=True, chunking="balanced")
    assert {k: r["work_pairs"] for k, r in w.items()} == {
        "sp": 2 * 2 * 136, "all_to_all": 2 * 2 * 136, "all_gather": 8 * 68, "ring": 8 * 100, "ring_balanced": 8 * 68}
    assert w["ring"]["bytes_per_rank"] == w["ring_balanced"]["bytes_per_rank"]
    w8 = layer_ways(1, 8, 8, 1024, 8, 4, 8, LINKS["nvlink"], train=False)
    assert 0.5 <= w8["ring_balanced"]["work_pairs"] / w8["ring"]["work_pairs"] < 0.55
    full = layer_ways(2, 4, 2, 16, 8, 4, 2, LINKS["nvlink"], train=False, causal=False)
    assert full["ring"]["work_pairs"] == full["ring_balanced"]["work_pairs"] == 8 * 8 * 16  # nothing to skip
    odd = layer_ways(2, 4, 2, 6, 8, 4, 2, LINKS["nvlink"], train=False)  # 6 rows: no 4 equal chunks
    assert not odd["ring_balanced"]["possible"] and odd["ring"]["possible"]
    balanced = str(ROOT / "specs" / "attention_cp2_ring_balanced_train.pcs")
    assert main(["explain", MODEL, "--spec", balanced, "--json"]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["sp_vs_cp"]
    assert rec["this_spec"] == "ring_balanced" and rec["chunking"] == "balanced"
    assert rec["ways"]["ring_balanced"]["work_pairs"] < rec["ways"]["ring"]["work_pairs"]
    assert main(["explain", MODEL, "--spec", balanced]) == 0
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  CP ring, balanced"))
    assert row.endswith("<- this spec") and "  544  " in row


def test_no_table_without_a_cp_or_sp_statement():
    c = compile_graph(parse_graph(_gqa(4, 2, 2)), spec("mesh cp=2\ninput * split-seq\noutput output split-seq\n"))
    assert "sp_vs_cp" not in c.report


def test_all_to_all_with_balanced_chunking_is_a_located_error():
    """Ulysses attends whole sequences per rank: a balanced chunking would be silently moot."""
    with pytest.raises(SpecError, match="nothing to balance") as e:
        spec("mesh cp=2\ncontext-parallel lowering=all_to_all chunking=balanced\n")
    assert ":2:" in str(e.value)
