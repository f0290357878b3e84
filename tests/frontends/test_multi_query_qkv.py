"""Multi-query q|k|v fused in one weight (Falcon's ``query_key_value`` [96, 64]: 4 query heads,
one key and one value head of dim 16) cut into two part params on import: the query rows keep
the weight's name, the kv rows are ``NAME_kv`` (``part_of`` / ``part_rows`` /
``part_of_shape``, parcomp/passes/fused_weights.py). So Megatron's plan is a plan: the query
rows split per head over tp, the one key and value head replicated (never gathered), the dense
rowwise; every loader cuts the stored tensor and every writer joins the parts back."""
import collections
import json
import os

import numpy as np
import pytest

from parcomp.cli.commands import feeds_for
from parcomp.cli.main import main
from parcomp.compile.compiler import compile_graph
from parcomp.frontends.torch.export import import_torch
from parcomp.passes.fused_weights import parts_to_stored, stored_to_parts, to_stored_shapes, to_view_shapes
from parcomp.plan.planner import plan
from parcomp.reference.interpreter import run_spmd
from parcomp.spec import parse_spec

from graphs import spec

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..")
MODEL = os.path.join(ROOT, "specs", "models.py") + ":falcon_lm"
QKV = "transformer.h.0.self_attention.query_key_value.weight"
KV = QKV + "_kv"
TRAIN = "train loss=cross_entropy optimizer=adamw(lr=0.001) steps=2"
TP = ("mesh tp=2\ntransformer.h.*.self_attention.query_key_value.weight colwise\n"
      "transformer.h.*.self_attention.dense.weight rowwise\n"
      "transformer.h.*.mlp.dense_h_to_4h.weight colwise\ntransformer.h.*.mlp.dense_4h_to_h.weight rowwise\n")


def _falcon():
    import sys
    sys.path.insert(0, os.path.join(ROOT, "specs"))
    import models
    return models.falcon_lm()


@pytest.fixture(scope="module")
def falcon():
    module, example, names = _falcon()
    return module, example, import_torch(module, example, names)


def test_the_fused_weight_is_cut_into_query_rows_and_kv_rows(falcon):
    _, _, g = falcon
    q, kv = g[QKV], g[KV]
    assert q.type.shape == (64, 64) and q.attr("part_rows") == (0, 64)
    assert kv.type.shape == (32, 64) and kv.attr("part_rows") == (64, 96)
    assert {q.attr("part_of"), kv.attr("part_of")} == {QKV}
    assert q.attr("part_of_shape") == kv.attr("part_of_shape") == (96, 64)


def test_each_rank_holds_its_query_heads_and_the_whole_kv_rows(falcon):
    module, example, g = falcon
    c = compile_graph(g, spec(TP))
    stored = np.arange(96 * 64, dtype="f4").reshape(96, 64)
    run = run_spmd(c.program, {**feeds_for(g, module, example), QKV: stored, KV: stored})
    for r in (0, 1):  # query heads 2r, 2r+1 (16 rows each); the key and value head on both
        np.testing.assert_array_equal(run.env[r][QKV], stored[32 * r:32 * (r + 1)])
        np.testing.assert_array_equal(run.env[r][KV], stored[64:96])


def test_the_parts_round_trip_in_every_loader(falcon):
    _, _, g = falcon
    stored = np.random.default_rng(0).standard_normal((96, 64))
    parts = stored_to_parts({QKV: stored, QKV + ".exp_avg": stored}, g)
    np.testing.assert_array_equal(parts[KV + ".exp_avg"], stored[64:])
    np.testing.assert_array_equal(parts[QKV], stored[:64])
    np.testing.assert_array_equal(parts_to_stored(parts, g)[QKV + ".exp_avg"], stored)
    assert KV not in parts_to_stored(parts, g)
    both = to_view_shapes({QKV: stored}, g)
    np.testing.assert_array_equal(to_stored_shapes(both, g)[QKV], stored)
    t = parts_to_stored({QKV: torch.zeros(64, 64), KV: torch.ones(32, 64)}, g, derived=False)[QKV]
    assert tuple(t.shape) == (96, 64) and float(t[64:].sum()) == 32 * 64


def test_the_emitted_loader_reads_each_part_s_rows(falcon):
    from parcomp_backends.torch.emit import emit_program
    _, _, g = falcon
    text = emit_program(compile_graph(g, spec(TP)))
    assert f'"{QKV}", (96, 64), torch.float32).narrow(0, 64, 32)' in text
    assert f'"{QKV}", (96, 64), torch.float32).narrow(0, 0, 64)' in text


def test_the_planner_splits_the_query_rows_and_replicates_the_kv_rows(falcon):
    """Without pinning: the query rows colwise (per head), the kv rows no rule (replicated:
    one kv head, which 2 ranks cannot split), the dense rowwise. With Falcon's parallel
    attention and MLP, a block is one all_reduce forward (attention and MLP partial sums
    added first) and two backward (the kv heads' gradient, a partial sum over the ranks'
    query heads, and the block input's); nothing gathered (before: the fused weight whole and
    an all_gather of the attention output's gradient every block)."""
    _, _, g = falcon
    text, _ = plan(g, "tp=2", train=TRAIN, seconds=5.0)
    rules = dict(ln.split()[:2] for ln in text.splitlines() if ".weight" in ln and not ln.startswith(("#", " ")))
    assert rules["transformer.h.*.self_attention.query_key_value.weight"] == "colwise", rules
    assert rules["transformer.h.*.self_attention.dense.weight"] == "rowwise", rules
    assert not [r for r in rules if r.endswith("_kv")], rules
    c = compile_graph(g, parse_spec(text, "falcon_plan.pcs"))
    counts = collections.Counter((r["kind"], r["phase"]) for r in c.report["collectives"])
    assert dict(counts) == {("all_reduce", "forward"): 2, ("all_reduce", "backward"): 4}


def test_check_of_the_split_equals_torch(tmp_path, capsys):
    (tmp_path / "s.pcs").write_text(TP + TRAIN + "\n")
    rc = main(["check", MODEL, "--spec", str(tmp_path / "s.pcs"), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["ok"], out
    kinds = collections.Counter((c["kind"], c["phase"]) for c in out["collectives"])
    assert dict(kinds) == {("all_reduce", "forward"): 2, ("all_reduce", "backward"): 4}, kinds


def test_one_kv_head_cut_on_the_features_is_cut_too():
    """Phi-3's qkv_proj with one kv head (the slices cut the product's features, not heads):
    the same two parts."""
    from test_grouped_qkv import _phi3
    module, example, names = _phi3(kv=1)
    g = import_torch(module, example, names)
    w = "model.layers.0.self_attn.qkv_proj.weight"
    assert g[w].type.shape == (64, 64) and g[w + "_kv"].type.shape == (32, 64)
    assert g[w + "_kv"].attr("part_rows") == (64, 96)


def test_a_pipeline_stage_refuses_it_naming_the_weight(tmp_path, capsys):
    (tmp_path / "pp.pcs").write_text("mesh pp=2\nstage 0: transformer.word_embeddings transformer.h.0\n"
                                     "stage 1: transformer.h.1 transformer.ln_f lm_head\n"
                                     "train loss=cross_entropy optimizer=sgd(lr=0.1) microbatches=1 "
                                     "schedule=1f1b input_grads=no\n")
    rc = main(["compile", MODEL, "--spec", str(tmp_path / "pp.pcs"), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and "multi-query fused weight" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_parallelize_trains_it_and_gives_the_weight_back_in_its_stored_rows(tmp_path):
    """parcomp.parallelize in a user's loop (2 gloo ranks): the steps equal the unsharded
    model's, and ``full_state_dict`` gives query_key_value back whole, as the checkpoint stores it."""
    from gloo_ranks import run_ranks
    for r in run_ranks("api_grouped_workers:train_falcon_equal", 2, cache_dir=str(tmp_path)):
        assert r["qkv_shape"] == [96, 64] and not r["kv_part_named"], r
        assert r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-3, r


def test_export_joins_the_parts_into_the_stored_rows(tmp_path):
    """A saved TP=2 training checkpoint (one step in the interpreter, keyed by the program's
    params: the query rows and ``NAME_kv``) exported as the model stores it: one
    ``query_key_value.weight`` [96, 64], the query rows over the kv rows."""
    import torch.distributed.checkpoint as dcp
    from types import SimpleNamespace

    from parcomp.check.training import train_steps
    from parcomp.cli import commands
    from parcomp.cli.export import full_tensors

    (tmp_path / "s.pcs").write_text(TP + "train loss=cross_entropy optimizer=sgd(lr=0.1) steps=1\n")
    c, module, example = commands.compile_model(SimpleNamespace(model=MODEL, spec=str(tmp_path / "s.pcs")))
    feeds = commands.training_feeds(c, module, example, 0)
    state = train_steps(lambda s: run_spmd(c.program, s).outputs(c.program), c.logical, feeds, 1)["state"]
    sd = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}
    sd["step"] = torch.tensor(1)
    dcp.save(sd, checkpoint_id=str(tmp_path / "ckpt" / "step-1"), no_dist=True)
    (tmp_path / "ckpt" / "latest").write_text("step-1\n")
    full = full_tensors(c, str(tmp_path / "ckpt"), module)
    assert KV not in full and tuple(full[QKV].shape) == (96, 64)
    np.testing.assert_array_equal(full[QKV].numpy(), np.concatenate([state[QKV], state[KV]]))
    assert not np.array_equal(full[QKV].numpy(), module.state_dict()[QKV].numpy())  # trained


@pytest.mark.slow
def test_the_split_trains_under_torchrun_like_torch(tmp_path, capsys):
    (tmp_path / "s.pcs").write_text(TP + TRAIN + "\n")
    rc = main(["run", MODEL, "--spec", str(tmp_path / "s.pcs"), "--nproc", "2", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["ok"], out
