"""Transformers' own models (tiny configs, random weights, ``specs/models.py``) as 2-stage
pipelines of 2 microbatches: DeepSeek-V2/V3 (MLA, a dense then an MoE block) with balanced
stages, whose attention builds a ``new_empty`` buffer the tracer places before the embedding,
and whose group-limited router writes a ``ones`` mask at topk indices; Phi-3's grouped
q|k|v fused weight split by kv group inside a stage (``pp=2 tp=2``), its head units reordered
on load (``stored_order``) by the pipelined program's loader as by the SPMD one. Each step, in
float64 on the interpreter, equals the unsharded step."""
import numpy as np
import pytest

from parcomp.passes.pipeline.split_stages import balanced_rules, rebatch

from graphs import spec
from numerics import assert_all_equivalent
from test_pipeline import ROOT
from test_pipeline_batch_shapes import TRAIN, _steps
from test_pipeline_models import model64

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

PHI3_TP = ("mesh pp=2 tp=2\nmodel.layers.*.self_attn.qkv_proj.weight colwise\n"
           "model.layers.*.self_attn.o_proj.weight rowwise\n")


@pytest.mark.parametrize("factory", ["deepseek_v3_lm", "deepseek_v2_lm"])
def test_deepseek_balanced_stages_follow_the_data_flow(factory):
    """Before, the balancing units were in graph order, where both layers' ``new_empty``
    expands stand first: stage 0 got ``model.layers.0`` alone and stage 1 the embedding it reads."""
    g = model64(factory)
    rules = balanced_rules(g, 2)
    assert rules[0].items[:2] == ("model.embed_tokens", "model.layers.0")
    assert rules[1].items[-2:] == ("model.norm", "lm_head")
    got, want, _, _ = _steps(factory, with_torch=False)
    assert_all_equivalent(got, want)


def test_deepseek_v3_group_mask_takes_the_microbatch():
    """The router's ``scatter(zeros, 1, group_idx, 1)``: a ``ones`` [tokens, 1] put at the
    topk indices; with half the tokens a microbatch both halve (before: the ones kept 16 rows)."""
    g = model64("deepseek_v3_lm")
    put = [n for n in g.nodes if n.op == "put_along" and g[n.inputs[0]].op == "ones"]
    assert put and g[put[0].inputs[0]].type.shape == (16, 1)
    small = rebatch(g, 1)
    assert small[put[0].inputs[0]].type.shape == small[put[0].inputs[1]].type.shape == (8, 1)


def _phi3_tp():
    from parcomp.frontends.loader import load_model

    g, _, _ = load_model(str(ROOT / "specs" / "models.py") + ":phi3_lm")
    return g


def test_phi3_grouped_qkv_in_a_tp_stage_equals_the_unsharded_step_and_loads_in_its_order():
    from parcomp.check.check64 import promote_graph
    from parcomp.check.pipeline import run_pipeline_step
    from parcomp.compile.compiler import compile_graph
    from parcomp.passes.pass_list import plan_pipeline
    from parcomp.reference.numpy_attn import stored_to_view
    from parcomp.reference.numpy_ops import run_unsharded
    from parcomp_backends.torch.emit import emit_program
    from parcomp_backends.torch.runtime.pipeline_main import stored_view

    from test_pipeline import reference

    g = promote_graph(_phi3_tp())
    ref, feeds, _ = reference(g, TRAIN, 0)
    rng = np.random.default_rng(0)
    for k in ("input_ids", "labels"):  # within the vocab of 128 (the feeds hold zeros: the padding row)
        feeds[k] = rng.integers(0, 128, np.shape(feeds[k])).astype("int64")
    want = run_unsharded(ref, feeds)
    got = run_pipeline_step(plan_pipeline(g, spec(f"{PHI3_TP}{TRAIN}\n")), feeds)
    assert_all_equivalent(got, want)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    order = g[qkv].attr("stored_order")
    assert order and g[qkv].attr("stored_shape") == (128, 64)
    # the pipelined program names the order (before: refused, "its loader only reshapes") ...
    text = emit_program(compile_graph(_phi3_tp(), spec(f"{PHI3_TP}{TRAIN}\n")))
    assert f"STORED_ORDER = {{{qkv!r}: {list(order)!r}" in text
    # ... and its loader takes the head units in that order, as the interpreter's loader does
    w = np.arange(128 * 64, dtype=np.float64).reshape(128, 64)
    view = stored_view(torch.from_numpy(w), [128, 64], list(g[qkv].type.shape), list(order))
    np.testing.assert_array_equal(view.numpy(), stored_to_view(w, g[qkv].type.shape, order))


def test_phi3_pp2_tp2_on_four_gloo_ranks_equals_the_unsharded_step(tmp_path, capsys):
    """``parcomp run`` of the grouped q|k|v model, pp=2 x tp=2: each rank loads transformers'
    ``state_dict()`` (qkv_proj stored [128, 64]) and takes its kv group's heads."""
    from parcomp.cli.main import main

    (tmp_path / "s.pcs").write_text(f"{PHI3_TP}{TRAIN}\n")
    rc = main(["run", str(ROOT / "specs" / "models.py") + ":phi3_lm", "--spec", str(tmp_path / "s.pcs"),
               "--nproc", "4", "--keep", str(tmp_path / "work")])
    out = capsys.readouterr().out
    assert rc == 0, out
    line = next(x for x in out.splitlines() if "1 pipelined step " in x)
    assert "4 gloo ranks" in line and line.endswith("OK")
