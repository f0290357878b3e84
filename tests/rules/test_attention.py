"""Attention (attention part): sdpa with heads split over tp, GQA with fewer kv
heads than ranks, RoPE under a heads split, heads not divisible by tp, against the
unsharded model through ``parcomp check`` (interpreter, float64: parcomp/check/differential.py)."""
import json
import pathlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from parcomp.cli.commands import feeds_for
from parcomp.cli.main import main
from parcomp.compile.compiler import compile_graph
from parcomp.frontends.torch.export import import_torch
from parcomp.reference.interpreter import run_spmd

from graphs import spec
from numerics import assert_equivalent

MODELS = str(pathlib.Path(__file__).parents[1].joinpath("attention_models.py"))
LLAMA_TP = ("attn.q_proj.weight colwise\nattn.k_proj.weight colwise\nattn.v_proj.weight colwise\n"
            "attn.o_proj.weight rowwise\n")


def _check(tmp_path, capsys, factory, spec_text):
    path = tmp_path / "s.pcs"
    path.write_text(spec_text)
    rc = main(["check", f"{MODELS}:{factory}", "--spec", str(path), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return rc, out


def _kinds(out, phase=None):
    return [c["kind"] for c in out["collectives"] if phase is None or c["phase"] == phase]


@pytest.mark.parametrize("tp", [2, 4])
def test_llama_attention_heads_split_is_one_all_reduce(tmp_path, capsys, tp):
    rc, out = _check(tmp_path, capsys, "llama_attention", f"mesh tp={tp}\n" + LLAMA_TP)
    assert rc == 0 and out["ok"], out
    assert _kinds(out) == ["all_reduce"]  # Megatron: only the row-parallel o_proj's sum


def test_llama_attention_training_is_megatrons_two_all_reduces(tmp_path, capsys):
    rc, out = _check(tmp_path, capsys, "llama_attention", "mesh tp=2\n" + LLAMA_TP + "train loss=mse steps=2\n")
    assert rc == 0 and out["ok"], out
    assert _kinds(out) == ["all_reduce", "all_reduce"]  # g forward, f backward
    assert out["err_over_tol"] <= 1


def test_two_kv_heads_on_four_ranks_equal_unsharded_forward_and_gradients(tmp_path, capsys):
    # 8 query heads, 2 kv heads, tp=4: each kv head serves the query heads of 2 ranks
    rc, out = _check(tmp_path, capsys, "llama_attention_kv2_h8",
                     "mesh tp=4\n" + LLAMA_TP + "train loss=mse steps=2\n")
    assert rc == 0 and out["ok"], out
    assert out["err_over_tol"] <= 1 and out["max_grad_err"] is not None


def test_two_kv_heads_on_four_ranks_replicate_the_kv_projections():
    from attention_models import llama_attention_kv2_h8
    module, example, names = llama_attention_kv2_h8()
    g = import_torch(module, example, names)
    c = compile_graph(g, spec("mesh tp=4\n" + LLAMA_TP))
    lay = {n.name: str(n.layout[0]) for n in c.program.params}
    assert lay == {"attn.q_proj.weight": "S(0)", "attn.k_proj.weight": "R", "attn.v_proj.weight": "R",
                   "attn.o_proj.weight": "S(1)", "rope.cos": "R", "rope.sin": "R"}
    feeds = feeds_for(g, module, example)
    got = run_spmd(c.program, feeds).outputs(c.program)["output"]
    want = module(*example).detach().numpy()
    assert_equivalent(got, want, what="output")


def test_heads_not_divisible_by_tp_is_a_located_spec_error(tmp_path, capsys):
    (tmp_path / "s.pcs").write_text("mesh tp=4\n" + LLAMA_TP)
    rc = main(["check", f"{MODELS}:llama_attention_h6", "--spec", str(tmp_path / "s.pcs")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "s.pcs:2" in err and "attn.q_proj.weight" in err and "tp" in err and "6 heads" in err, err


def test_rope_under_a_heads_split_equals_unsharded(tmp_path, capsys):
    rc, out = _check(tmp_path, capsys, "rope", "mesh tp=2\ninput q [S(1)]\ninput k [S(1)]\n"
                     "output output_0 [S(1)]\noutput output_1 [S(1)]\n")
    assert rc == 0 and out["ok"], out
    assert _kinds(out) == []  # head_dim stays whole: the rotation is local to each head


def test_rope_lowers_to_slice_neg_cat_with_cos_sin_tables():
    """The cos/sin tables depend on a buffer only: the frontend folds them into constant params
    (``rope.cos``/``rope.sin``); what is left is the rotation itself."""
    from attention_models import rope
    module, example, names = rope()
    g = import_torch(module, example, names)
    ops = [n.op for n in g.nodes]
    assert {"slice", "neg", "cat", "mul", "add"} <= set(ops) and not {"arange", "cos", "sin"} & set(ops), ops
    assert {"rope.cos", "rope.sin"} <= {n.name for n in g.params}


def test_gqa_sdpa_repeats_kv_heads_like_repeat_interleave():
    q, k, v = torch.randn(1, 4, 3, 2), torch.randn(1, 2, 3, 2), torch.randn(1, 2, 3, 2)

    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    g = import_torch(M(), (q, k, v))
    assert [n.op for n in g.nodes if n.op not in ("input",)] == ["expand", "reshape", "expand", "reshape", "sdpa"]
    feeds = {"q": q.numpy(), "k": k.numpy(), "v": v.numpy()}
    c = compile_graph(g, spec("mesh tp=2\ninput q [S(1)]\ninput k [S(1)]\ninput v [S(1)]\noutput output [S(1)]"))
    run = run_spmd(c.program, feeds)
    assert run.log == []
    want = M()(q, k, v).numpy()
    assert_equivalent(run.outputs(c.program)["output"], want)


def test_a_mask_from_an_input_is_refused_with_the_op_named():
    from parcomp.errors import FrontendError

    class M(torch.nn.Module):
        def forward(self, q, m):
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=m)

    with pytest.raises(FrontendError, match="attn_mask"):
        import_torch(M(), (torch.randn(1, 2, 3, 2), torch.ones(3, 3, dtype=torch.bool)))


def test_sdpa_numpy_matches_torch_causal_and_scaled():
    from parcomp.ir import parse_graph
    from parcomp.reference.numpy_ops import run_unsharded
    g = parse_graph("".join(f"%{x}: f32[2,3,5,4] = input()\n" for x in "qkv")
                    + "%y: f32[2,3,5,4] = sdpa(%q, %k, %v) {causal=true, scale=0.3}\nreturn %y\n")
    rng = np.random.default_rng(0)
    feeds = {x: rng.standard_normal((2, 3, 5, 4)).astype("f4") for x in "qkv"}
    want = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(feeds[x]) for x in "qkv"), is_causal=True, scale=0.3).numpy()
    assert_equivalent(run_unsharded(g, feeds)["y"], want)


@pytest.mark.slow
def test_llama_attention_trains_under_torchrun_like_torch(tmp_path, capsys):
    """The emitted program (sdpa, its three gradients from one sdpa backward, RoPE's arange/cos/sin)
    on 2 gloo ranks against torch.optim on the unsharded module."""
    (tmp_path / "s.pcs").write_text("mesh tp=2\n" + LLAMA_TP + "train loss=mse steps=2\n")
    rc = main(["run", f"{MODELS}:llama_attention", "--spec", str(tmp_path / "s.pcs"), "--nproc", "2", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["ok"] and out["err_over_tol"] <= 1, out


def test_transformers_causal_mask_is_folded_into_a_causal_sdpa(tmp_path, capsys):
    """LlamaModel passes sdpa an explicit boolean mask built from arange (masking_utils); it is
    evaluated at import, found causal, and none of its ops reaches the graph."""
    from attention_models import llama_attention_masked
    module, example, names = llama_attention_masked()
    g = import_torch(module, example, names)
    assert [n.attrs for n in g.nodes if n.op == "sdpa"] == [(("causal", True), ("scale", 0.5))]
    rc, out = _check(tmp_path, capsys, "llama_attention_masked", "mesh tp=2\n" + LLAMA_TP)
    assert rc == 0 and out["ok"] and _kinds(out) == ["all_reduce"], out


@pytest.mark.parametrize("kind, what", [("band", "neither causal"), ("bias", "float bias")])
def test_a_mask_that_is_not_causal_is_refused(kind, what):
    from parcomp.errors import FrontendError

    class M(torch.nn.Module):
        def forward(self, q):
            i = torch.arange(3)
            d = i[:, None] - i[None, :]
            m = d.abs() <= 1 if kind == "band" else d.to(torch.float32) * 0.5
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=m)

    with pytest.raises(FrontendError, match=what):
        import_torch(M(), (torch.randn(1, 2, 3, 2),))


# ---- fused weights, split per part (parcomp/passes/fused_weights.py) ---------------------

GPT2_TP = "attn.c_attn.weight colwise\nattn.c_proj.weight rowwise\n"


def test_gpt2_c_attn_colwise_splits_each_of_q_k_v_by_heads(tmp_path, capsys):
    rc, out = _check(tmp_path, capsys, "gpt2_attention", "mesh tp=2\n" + GPT2_TP + "train loss=mse steps=2\n")
    assert rc == 0 and out["ok"] and out["err_over_tol"] <= 1, out
    assert _kinds(out, "forward") == ["all_reduce"] and _kinds(out, "backward") == ["all_reduce"]


def test_c_attn_rank_holds_its_heads_of_each_part_exactly():
    from attention_models import gpt2_attention
    module, example, names = gpt2_attention()
    g = import_torch(module, example, names)
    w = g["attn.c_attn.weight"]
    assert w.type.shape == (16, 3, 16) and w.attr("stored_shape") == (16, 48)
    c = compile_graph(g, spec("mesh tp=2\n" + GPT2_TP))
    stored = np.arange(16 * 48, dtype="f4").reshape(16, 48)
    feeds = {**feeds_for(g, module, example), "attn.c_attn.weight": stored}
    run = run_spmd(c.program, feeds)
    for r in (0, 1):  # rank r: columns p*16 + 8r .. p*16 + 8r + 7 of q (p=0), k (p=1) and v (p=2)
        want = np.stack([stored[:, p * 16 + 8 * r: p * 16 + 8 * r + 8] for p in range(3)], axis=1)
        np.testing.assert_array_equal(run.env[r]["attn.c_attn.weight"], want)
    assert str(c.program["attn.c_attn.bias"].layout[0]) == "S(1)"  # the bias follows, per part


def test_fused_gate_up_colwise_is_one_all_reduce(tmp_path, capsys):
    rc, out = _check(tmp_path, capsys, "fused_gate_up",
                     "mesh tp=2\ngate_up.weight colwise\ndown.weight rowwise\ntrain loss=mse steps=2\n")
    assert rc == 0 and out["ok"] and out["err_over_tol"] <= 1, out
    assert _kinds(out) == ["all_reduce", "all_reduce"]


def test_fused_heads_not_divisible_is_a_located_spec_error(tmp_path, capsys):
    (tmp_path / "s.pcs").write_text("mesh tp=2\n" + GPT2_TP)
    rc = main(["check", f"{MODELS}:gpt2_attention_h3", "--spec", str(tmp_path / "s.pcs")])
    err = capsys.readouterr().err
    assert rc == 2 and "s.pcs:2" in err and "attn.c_attn.weight" in err and "3 heads" in err, err


MHA_TP = "attn.in_proj_weight colwise\nattn.out_proj.weight rowwise\n"


@pytest.mark.parametrize("factory, tp, sizes, heads, then", [
    ("mha", 2, "of 16 features each", "4 heads of 4 in each part", "then 'attn.in_proj_weight colwise' "
     "splits each part's heads over tp"),
    ("mha_h6", 4, "of 24 features each", "6 heads of 4 in each part", "its 6 heads then need a mesh "
     "axis that divides 6, not 4 ranks")], ids=["tp2", "h6-tp4"])
def test_multihead_attention_packed_in_proj_says_parts_not_heads(tmp_path, capsys, factory, tp, sizes,
                                                                  heads, then):
    """nn.MultiheadAttention cuts q, k, v apart after unflatten(-1, (3, E)): the 3 are its
    parts, and the error says so, with the heads attention sees and the rewrite that splits."""
    (tmp_path / "s.pcs").write_text(f"mesh tp={tp}\n" + MHA_TP)
    rc = main(["check", f"{MODELS}:{factory}", "--spec", str(tmp_path / "s.pcs")])
    err = capsys.readouterr().err
    assert rc == 2 and "s.pcs:2:1\n" in err and "Traceback" not in err, err
    assert f"attn.in_proj_weight packs 3 parts (q, k and v) {sizes}" in err, err
    assert f"the 3 there are those parts, not attention heads (attention sees {heads})" in err, err
    assert ".chunk(3, -1)" in err and then in err and "3 heads cannot be split" not in err, err


def test_multihead_attention_without_a_rule_equals_torch(tmp_path, capsys):
    """The error's other way out: no colwise/rowwise rule, the attention whole on each rank."""
    rc, out = _check(tmp_path, capsys, "mha", "mesh tp=2\n")
    assert rc == 0 and out["ok"] and out["err_over_tol"] <= 1 and _kinds(out) == [], out


def test_packed_attention_the_error_suggests_equals_multihead_attention_and_splits_its_heads(tmp_path, capsys):
    """The rewrite the error names: nn.MultiheadAttention's weights in PackedAttention give
    torch's output, and 'in_proj_weight colwise' then splits each part's heads (Megatron: one
    all_reduce forward), equal to the unsharded module; training equals it and torch.optim."""
    ref, (x,), _ = __import__("attention_models").mha()
    module, _, _ = __import__("attention_models").mha_packed()
    torch.testing.assert_close(module(x), ref(x), rtol=1e-5, atol=1e-6)
    rc, out = _check(tmp_path, capsys, "mha_packed", "mesh tp=2\n" + MHA_TP)
    assert rc == 0 and out["ok"] and out["err_over_tol"] <= 1 and _kinds(out) == ["all_reduce"], out
    rc, out = _check(tmp_path, capsys, "mha_packed", "mesh tp=2\n" + MHA_TP + "train loss=mse steps=2\n")
    assert rc == 0 and out["ok"] and out["err_over_tol"] <= 1 and out["max_grad_err"] is not None, out


@pytest.mark.slow
def test_gpt2_attention_fused_c_attn_trains_under_torchrun_like_torch(tmp_path, capsys):
    (tmp_path / "s.pcs").write_text("mesh tp=2\n" + GPT2_TP + "train loss=mse steps=2 optimizer=adamw(lr=0.01)\n")
    rc = main(["run", f"{MODELS}:gpt2_attention", "--spec", str(tmp_path / "s.pcs"), "--nproc", "2", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["ok"] and out["err_over_tol"] <= 1, out


# ---- random attention configs x layouts (interpreter, forward and training) ---------

@st.composite
def attention_case(draw):
    tp = draw(st.sampled_from([2, 4]))
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.sampled_from([1, 2, 4]))
    b, s, d = draw(st.sampled_from([1, 2])), draw(st.sampled_from([3, 4])), draw(st.sampled_from([2, 4]))
    causal = draw(st.booleans())
    lines = [f"%x: f32[{b},{heads},{s},{d}] = input()", f"%w: f32[{d}] = param()",
             f"%q: f32[{b},{heads},{s},{d}] = mul(%x, %w)"]  # a parameter, for training
    lines += [f"%{x}: f32[{b},{kv},{s},{d}] = input()" for x in "kv"]
    for x in "kv":  # transformers' repeat_kv: head h reads kv head h // (heads // kv)
        if kv != heads:
            lines.append(f"%{x}e: f32[{b},{kv},{heads // kv},{s},{d}] = expand(%{x}) {{dims=(2,)}}")
            lines.append(f"%{x}r: f32[{b},{heads},{s},{d}] = reshape(%{x}e)")
    kk, vv = ("kr", "vr") if kv != heads else ("k", "v")
    lines.append(f"%y: f32[{b},{heads},{s},{d}] = sdpa(%q, %{kk}, %{vv}) "
                 f"{{causal={str(causal).lower()}, scale={1 / d ** 0.5}}}")
    lines.append("return %y as output")
    ok = [p for p, n in (("[S(0)]", b), ("[S(1)]", heads)) if n % tp == 0]
    lay = {x: draw(st.sampled_from(["replicated"] + ok)) for x in ("q", "output")}
    lay["kv"] = draw(st.sampled_from(["replicated"] + (["[S(1)]"] if kv % tp == 0 else [])))
    rules = [f"input x {lay['q']}", f"input k {lay['kv']}", f"input v {lay['kv']}", f"output output {lay['output']}"]
    train = draw(st.booleans())
    return ("\n".join(lines) + "\n", f"mesh tp={tp}\n" + "\n".join(rules) + "\n"
            + ("train loss=mse steps=1\n" if train else ""))


@settings(max_examples=25, deadline=None)
@given(attention_case())
def test_random_attention_sharded_equals_unsharded(tmp_path_factory, case):
    text, spec_text = case
    d = tmp_path_factory.mktemp("attn")
    (d / "m.pcir").write_text(text)
    (d / "s.pcs").write_text(spec_text)
    rc = main(["check", str(d / "m.pcir"), "--spec", str(d / "s.pcs"), "--json"])
    assert rc == 0, (text, spec_text)


def test_gqa_replication_touches_only_the_kv_projections_a_wildcard_rule_names():
    from attention_models import llama_attention_kv2_h8
    module, example, names = llama_attention_kv2_h8()
    g = import_torch(module, example, names)
    c = compile_graph(g, spec("mesh tp=4\nattn.*_proj.weight colwise\n"))
    lay = {n.name: str(n.layout[0]) for n in c.program.params}
    assert lay["attn.q_proj.weight"] == "S(0)" and lay["attn.o_proj.weight"] == "S(0)"
    assert lay["attn.k_proj.weight"] == lay["attn.v_proj.weight"] == "R"


def test_a_stored_shape_layout_on_a_fused_weight_says_how_layouts_are_written(tmp_path, capsys):
    (tmp_path / "s.pcs").write_text("mesh tp=2\nattn.c_attn.weight [S(1)]\n")
    rc = main(["check", f"{MODELS}:gpt2_attention", "--spec", str(tmp_path / "s.pcs")])
    err = capsys.readouterr().err
    assert rc == 2 and "s.pcs:2:1" in err and "Traceback" not in err
    assert "stored as [16,48]" in err and "f32[16,3,16] (dim 1 picks the part)" in err and "'colwise'" in err
