"""Grouped-query q|k|v fused in one weight (Phi-3's ``qkv_proj``: 4 query | 2 key | 2 value
heads of dim 16 in [128, 64]): viewed per part and per kv group, its head units reordered on
load (``stored_order``, parcomp/passes/fused_weights.py), so ``colwise`` gives each rank whole
groups; every loader (interpreter, program.py, the checks' comparisons, export, the Python
API's gather) applies the order and its inverse."""
import json

import numpy as np
import pytest

from parcomp.cli.commands import feeds_for
from parcomp.cli.main import main
from parcomp.compile.compiler import compile_graph
from parcomp.frontends.torch.export import import_torch
from parcomp.passes.fused_weights import in_stored_indices, to_stored_shapes, to_view_shapes
from parcomp.reference.interpreter import run_spmd
from parcomp.reference.numpy_attn import stored_to_view, view_to_stored

from graphs import spec

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
QKV = "model.layers.0.self_attn.qkv_proj.weight"
TP = ("mesh tp=2\nmodel.layers.*.self_attn.qkv_proj.weight colwise\n"
      "model.layers.*.self_attn.o_proj.weight rowwise\n")


PHI3 = """
import torch
def phi3(kv=2):
    from transformers import Phi3Config, Phi3ForCausalLM
    torch.manual_seed(0)
    config = Phi3Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=kv, max_position_embeddings=32,
                        bos_token_id=0, eos_token_id=1, pad_token_id=0, use_cache=False,
                        attn_implementation="sdpa")
    return Phi3ForCausalLM(config).eval(), (torch.randint(0, 64, (2, 8)),), ["input_ids"]
"""
_NS = {}
exec(PHI3, _NS)  # noqa: S102 - the factory the CLI tests load from a file, also called here
_phi3 = _NS["phi3"]


def _model_file(tmp_path):
    (tmp_path / "phi3_model.py").write_text(PHI3)
    (tmp_path / "s.pcs").write_text(TP + "train loss=cross_entropy optimizer=adamw(lr=0.01) steps=2\n")
    return f"{tmp_path}/phi3_model.py:phi3", str(tmp_path / "s.pcs")


@pytest.fixture(scope="module")
def phi3():
    module, example, names = _phi3()
    return module, example, import_torch(module, example, names)


def test_each_rank_holds_its_groups_query_key_and_value_heads(phi3):
    module, example, g = phi3
    w = g[QKV]
    # parts: query heads 0 and 2 | 1 and 3 | keys | values, each one head per kv group
    assert w.type.shape == (4, 32, 64) and w.attr("stored_shape") == (128, 64)
    assert w.attr("stored_order") == (0, 2, 1, 3, 4, 5, 6, 7)
    c = compile_graph(g, spec(TP))
    stored = np.arange(128 * 64, dtype="f4").reshape(128, 64)
    run = run_spmd(c.program, {**feeds_for(g, module, example), QKV: stored})
    rows = lambda head: stored[head * 16:(head + 1) * 16]  # noqa: E731 - head units of 16 rows
    for r in (0, 1):  # kv group r: query heads 2r, 2r+1, key head r (unit 4+r), value head r (6+r)
        want = np.stack([rows(2 * r), rows(2 * r + 1), rows(4 + r), rows(6 + r)])
        np.testing.assert_array_equal(run.env[r][QKV], want)


def test_the_split_equals_torch_with_one_all_reduce_each_way(phi3, tmp_path, capsys):
    model, spec_path = _model_file(tmp_path)
    rc = main(["check", model, "--spec", spec_path, "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["ok"], out
    kinds = sorted((c["kind"], c["phase"]) for c in out["collectives"])
    assert kinds == [("all_reduce", "backward"), ("all_reduce", "forward")], kinds


def test_stored_order_round_trips_in_every_loader(phi3):
    _, _, g = phi3
    w = g[QKV]
    stored = np.random.default_rng(0).standard_normal((128, 64))
    view = stored_to_view(stored, w.type.shape, w.attr("stored_order"))
    np.testing.assert_array_equal(view[1, 16:], stored[48:64])  # part 1, group 1: query head 3
    np.testing.assert_array_equal(view_to_stored(view, (128, 64), w.attr("stored_order")), stored)
    got = to_view_shapes({QKV: stored, QKV + ".exp_avg": stored}, g)
    np.testing.assert_array_equal(got[QKV], view)
    np.testing.assert_array_equal(to_stored_shapes(got, g)[QKV + ".exp_avg"], stored)
    # a mismatch reported at a view index is given at the stored index the user knows
    said = in_stored_indices({"worst": f"{QKV}[1,16,0]"}, g)["worst"]
    assert said == f"{QKV}[48,0]", said


def test_the_emitted_loader_reorders_the_heads(phi3, tmp_path):
    from parcomp_backends.torch.emit import emit_program
    _, _, g = phi3
    text = emit_program(compile_graph(g, spec(TP)))
    assert "index_select(0, torch.tensor([0, 2, 1, 3, 4, 5, 6, 7]))" in text


def test_multi_query_is_cut_into_part_params_not_viewed():
    """One kv head: no view splits it per head (the kv part is shared by every query head), so
    the weight becomes its query rows and its kv rows (tests/frontends/test_multi_query_qkv.py)."""
    module, example, names = _phi3(kv=1)
    g = import_torch(module, example, names)
    assert g[QKV].type.shape == (64, 64) and not g[QKV].attr("stored_shape")
    assert g[QKV + "_kv"].attr("part_of") == QKV


@pytest.mark.slow
def test_the_grouped_split_trains_under_torchrun_like_torch(tmp_path, capsys):
    model, spec_path = _model_file(tmp_path)
    rc = main(["run", model, "--spec", spec_path, "--nproc", "2", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["ok"], out



@pytest.mark.slow
def test_parallelize_trains_it_and_gives_the_weight_back_in_its_stored_rows(tmp_path):
    """parcomp.parallelize in a user's loop (2 gloo ranks): the steps equal the unsharded
    model's, and ``full_state_dict`` gives qkv_proj back as the checkpoint stores it."""
    from gloo_ranks import run_ranks
    for r in run_ranks("api_grouped_workers:train_phi3_equal", 2, cache_dir=str(tmp_path)):
        assert r["qkv_shape"] == [128, 64] and r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-3, r


def test_a_pipeline_stage_loads_it_in_its_order(tmp_path, capsys):
    """A pipeline stage's loader takes the head units in the stored order, as the SPMD loader
    (tests/pipeline/test_pipeline_zoo.py runs it on gloo ranks)."""
    model, _ = _model_file(tmp_path)
    (tmp_path / "pp.pcs").write_text("mesh pp=2\nstage 0: model.embed_tokens\nstage 1: model.layers.0 model.norm "
                                     "lm_head\ntrain loss=cross_entropy optimizer=sgd(lr=0.1) microbatches=1 "
                                     "schedule=1f1b input_grads=no\n")
    rc = main(["compile", model, "--spec", str(tmp_path / "pp.pcs"), "-o", str(tmp_path / "out")])
    assert rc == 0, capsys.readouterr().err
    text = (tmp_path / "out" / "program.py").read_text()
    assert f"STORED_ORDER = {{{QKV!r}: [0, 2, 1, 3, 4, 5, 6, 7]}}" in text
