"""Context parallel together with tensor parallel (Megatron's cp x tp): the sequence over cp, the
attention heads over tp (q/k/v projections colwise, o_proj rowwise). The cp exchange of K/V runs
on each tp rank's own heads, one all_reduce over tp after o_proj (and one for dx backward), no
weight is gathered over tp; each lowering equals unsharded forward and backward."""
import json
import pathlib

import pytest
from hypothesis import given, settings, strategies as st

from parcomp.cli.main import main
from parcomp.compile.compiler import compile_graph
from parcomp.errors import SpecError
from parcomp.ir import parse_graph
from parcomp.reference.interpreter import run_spmd
from parcomp.reference.numpy_ops import run_unsharded

from graphs import random_feeds, spec
from numerics import assert_all_equivalent

ROOT = pathlib.Path(__file__).resolve().parents[1].parent
MODEL = f"{ROOT / 'specs' / 'models.py'}:causal_attention"
CANONICAL = ROOT / "specs" / "attention_cp2_tp2_train.pcs"
TRAIN = "train loss=mse optimizer=sgd(lr=0.1)\n"
WEIGHTS = ("attn.q_proj.weight colwise\nattn.k_proj.weight colwise\nattn.v_proj.weight colwise\n"
           "attn.o_proj.weight rowwise\n")


def _mha(seq, heads, kv, batch=1, hd=2):
    """x [b, s, h*hd] -> q/k/v projections [b, s, heads*hd] -> heads [b, heads, s, hd] (k/v with
    ``kv`` heads, repeated as transformers' repeat_kv) -> causal sdpa -> o projection."""
    b, s, hid = batch, seq, heads * hd
    lines = [f"%x: f32[{b},{s},{hid}] = input()"]
    for w, h in (("q", heads), ("k", kv), ("v", kv)):
        lines += [f"%w{w}: f32[{hid},{h * hd}] = param()", f"%{w}0: f32[{b},{s},{h * hd}] = matmul(%x, %w{w})",
                  f"%{w}1: f32[{b},{s},{h},{hd}] = reshape(%{w}0)",
                  f"%{w}: f32[{b},{h},{s},{hd}] = permute(%{w}1) {{perm=(0, 2, 1, 3)}}"]
    for w in "kv":
        if kv != heads:
            lines += [f"%{w}e: f32[{b},{kv},{heads // kv},{s},{hd}] = expand(%{w}) {{dims=(2,)}}",
                      f"%{w}r: f32[{b},{heads},{s},{hd}] = reshape(%{w}e)"]
    kk, vv = ("kr", "vr") if kv != heads else ("k", "v")
    lines += [f"%a: f32[{b},{heads},{s},{hd}] = sdpa(%q, %{kk}, %{vv}) {{causal=true, scale=0.5}}",
              f"%a1: f32[{b},{s},{heads},{hd}] = permute(%a) {{perm=(0, 2, 1, 3)}}",
              f"%a2: f32[{b},{s},{hid}] = reshape(%a1)",
              f"%wo: f32[{hid},{hid}] = param()", f"%o: f32[{b},{s},{hid}] = matmul(%a2, %wo)",
              "return %o as output"]
    return "\n".join(lines) + "\n"


def _spec(lowering, mesh="cp=2 tp=2", train=TRAIN):
    return spec(f"mesh {mesh}\ncontext-parallel over cp lowering={lowering}\nwq colwise\nwk colwise\n"
                f"wv colwise\nwo rowwise\ninput x split-seq over cp\noutput output split-seq over cp\n{train}")


def _tp(report):
    return [(c["kind"], c["phase"]) for c in report["collectives"] if c["axis"] == "tp"]


def _equal_to_unsharded(c, seed=0):
    feeds = random_feeds(c.logical, seed)
    assert_all_equivalent(run_spmd(c.program, feeds).outputs(c.program), run_unsharded(c.logical, feeds))


# ---- the plan: Megatron's, per lowering ---------------------------------------------------------

LOWERINGS = [("all_gather", "cp=2 tp=2"), ("ring", "cp=2 tp=2"), ("all_to_all", "tp=2 cp=2")]


@pytest.mark.parametrize("lowering,mesh", LOWERINGS)
def test_heads_stay_split_over_tp_one_all_reduce_each_way(lowering, mesh):
    """4 q heads, 4 kv heads: no collective over tp but o_proj's all_reduce (forward) and dx's
    (backward); every cp exchange carries one tp rank's heads (2 of 4)."""
    c = compile_graph(parse_graph(_mha(8, 4, 4, batch=2)), _spec(lowering, mesh))
    assert _tp(c.report) == [("all_reduce", "forward"), ("all_reduce", "backward")]
    exchanged = [r for r in c.report["collectives"]
                 if r["axis"] == "cp" and r["kind"] in ("all_gather", "send_recv", "all_to_all", "reduce_scatter")
                 and len(r["local_shape"]) == 4]
    assert exchanged and all(r["local_shape"][1] <= 2 for r in exchanged), exchanged  # never all 4 heads
    _equal_to_unsharded(c)


def test_canonical_spec_collective_list_is_pinned(capsys):
    """specs/attention_cp2_tp2_train.pcs: forward all_gather over cp of K and V (one kv head per
    tp rank: 2x1x8x8 f32 = 512 B), one all_reduce over tp of o_proj's output; backward
    reduce_scatter over cp of dK, dV, one all_reduce over tp of dx. The other cp gathers are the
    cost model's choice at this size, as in specs/attention_cp2_train.pcs (activations gathered
    for the weight gradients instead of all-reducing them over cp). No weight gathered over tp."""
    rc = main(["check", MODEL, "--spec", str(CANONICAL), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["ok"] and out["err_over_tol"] <= 1 and out["max_grad_err"] is not None, out
    got = [(c["kind"], c["axis"], c["phase"], c["bytes"]) for c in out["collectives"]]
    assert got == [("all_gather", "cp", "forward", 512), ("all_gather", "cp", "forward", 512),
                   ("all_reduce", "tp", "forward", 2048), ("all_gather", "cp", "loss", 2048),
                   ("all_gather", "cp", "forward", 1024), ("reduce_scatter", "cp", "backward", 512),
                   ("reduce_scatter", "cp", "backward", 512), ("all_gather", "cp", "forward", 2048),
                   ("all_gather", "cp", "backward", 512), ("all_gather", "cp", "backward", 512),
                   ("all_gather", "cp", "backward", 1024), ("all_reduce", "tp", "backward", 2048)]
    assert [c["reason"].split()[0] for c in out["collectives"][:2]] == ["%add_1", "%transpose_2"]  # k (RoPE), v


def test_sp_vs_cp_counts_one_tp_ranks_heads(tmp_path):
    """Under CP x TP each rank exchanges only its tp rank's heads: the report's row for the
    spec's own lowering (all_gather) equals the program's K/V all_gathers plus dK/dV
    reduce_scatters over cp (2 x 512 + 2 x 512 B), not the whole heads' 4096 B."""
    out = tmp_path / "out"
    assert main(["compile", MODEL, "--spec", str(CANONICAL), "-o", str(out)]) == 0
    rep = json.loads((out / "report.json").read_text())
    rec = rep["sp_vs_cp"]
    assert (rec["this_spec"], rec["heads_split"], rec["heads"], rec["kv_heads"]) == ("all_gather", 2, 2, 1)
    mine = rep["collectives"][:2] + [c for c in rep["collectives"] if c["kind"] == "reduce_scatter"]
    assert sum(c["bytes"] for c in mine) == rec["ways"]["all_gather"]["bytes_per_rank"] == 2048
    assert len(mine) == rec["ways"]["all_gather"]["calls"]


def _check(tmp_path, capsys, text):
    path = tmp_path / "s.pcs"
    path.write_text(text)
    rc = main(["check", MODEL, "--spec", str(path), "--json"])
    return rc, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("lowering,mesh", LOWERINGS)
def test_llama_attention_gqa_equals_unsharded_forward_and_backward(tmp_path, capsys, lowering, mesh):
    """transformers' LlamaAttention (RoPE, 4 q heads, 2 kv heads = tp): forward, then a training
    step; no weight gathered over tp, one all_reduce over tp each way."""
    text = (f"mesh {mesh}\ncontext-parallel over cp lowering={lowering}\n{WEIGHTS}"
            "input x split-seq over cp\noutput output split-seq over cp\n")
    rc, out = _check(tmp_path, capsys, text)
    assert rc == 0 and out["ok"] and out["err_over_tol"] <= 1, out
    assert [(c["kind"], c["phase"]) for c in out["collectives"] if c["axis"] == "tp"] == [("all_reduce", "forward")]
    rc, out = _check(tmp_path, capsys, text + TRAIN)
    assert rc == 0 and out["ok"] and out["err_over_tol"] <= 1 and out["max_grad_err"] is not None, out
    assert _tp(out) == [("all_reduce", "forward"), ("all_reduce", "backward")]


# ---- what a lowering cannot do: located errors ---------------------------------------------------

def test_ulysses_with_tp_after_cp_in_the_mesh_is_a_located_error():
    """Ulysses splits each tp rank's heads further over cp: tp must be the outer axis."""
    with pytest.raises(SpecError, match=r"needs tp before cp in the mesh .*tp=2 cp=2") as e:
        compile_graph(parse_graph(_mha(8, 4, 4)), _spec("all_to_all"))
    assert (e.value.loc.line, e.value.loc.col) == (2, 1)


def test_ulysses_heads_not_divisible_by_tp_times_cp_is_a_located_error():
    """2 q heads: 1 per tp rank, which cp=2 cannot split."""
    with pytest.raises(SpecError, match=r"heads, which do not split over the axis") as e:
        compile_graph(parse_graph(_mha(8, 2, 2)), _spec("all_to_all", "tp=2 cp=2"))
    assert e.value.loc.line == 2


# ---- hypothesis over small configurations --------------------------------------------------------

@settings(max_examples=15, deadline=None)
@given(low=st.sampled_from(LOWERINGS), per_rank=st.integers(1, 2), kv_pick=st.integers(0, 3),
       blocks=st.integers(1, 2), batch=st.integers(1, 2), train=st.booleans(), seed=st.integers(0, 10_000))
def test_equals_unsharded_over_small_configs(low, per_rank, kv_pick, blocks, batch, train, seed):
    """q heads 4 x per_rank (Ulysses: tp x cp ranks each need one), kv heads any divisor (fewer
    than tp included: the kv projection is then replicated over tp), sequence 2 x blocks per
    rank: output, or loss, every gradient and updated weight, equal unsharded; no weight
    gathered over tp."""
    lowering, mesh = low
    heads = 4 * per_rank
    kvs = [k for k in (1, 2, 4, 8) if heads % k == 0]
    kv = kvs[kv_pick % len(kvs)]
    c = compile_graph(parse_graph(_mha(2 * blocks * 2, heads, kv, batch)), _spec(lowering, mesh, TRAIN if train else ""))
    assert not [r for r in c.report["collectives"] if r["axis"] == "tp" and r["kind"] == "all_gather"]
    _equal_to_unsharded(c, seed)


# ---- 4 gloo ranks ---------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("lowering,mesh", [(None, None), *LOWERINGS[1:]])
def test_trains_on_four_gloo_ranks_like_unsharded(tmp_path, capsys, lowering, mesh):
    """torchrun, 4 gloo ranks: the canonical spec (all_gather), then ring and Ulysses (tp outer)."""
    path = CANONICAL
    if lowering:
        path = tmp_path / "s.pcs"
        path.write_text(f"mesh {mesh}\ncontext-parallel over cp lowering={lowering}\n{WEIGHTS}"
                        f"input x split-seq over cp\noutput output split-seq over cp\n{TRAIN}")
    rc = main(["run", MODEL, "--spec", str(path), "--nproc", "4", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["ok"] and out["err_over_tol"] <= 1 and out["max_grad_err"] is not None, out
    assert _tp(out) == [("all_reduce", "forward"), ("all_reduce", "backward")]


def test_a_weight_split_over_the_cp_axis_is_warned_as_cp_s_doing():
    """``context-parallel over tp`` with q/k/v/o split on tp: CP keeps weights whole over its
    axis, so the plan gathers them; the warning says the CP statement undoes the split (not
    the cost model) and the result stays equal."""
    g = parse_graph(_mha(8, 4, 4))
    s = spec("mesh tp=2\ncontext-parallel over tp lowering=all_gather\nwq colwise\nwk colwise\nwv colwise\n"
             "wo rowwise\ninput x split-seq\noutput output split-seq\n")
    c = compile_graph(g, s)
    warned = [w for w in c.report["warnings"] if "the plan all-gathers it whole over tp" in w]
    assert warned and all("context-parallel over tp keeps every weight whole" in w for w in warned)
    assert not any("cheaper in the cost model" in w for w in warned)
    _equal_to_unsharded(c)
