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


def test_phi3_pp2_on_two_gloo_ranks_equals_the_unsharded_step(tmp_path, capsys):
    """``parcomp run`` of the grouped q|k|v model, 2 stages of 2 microbatches: each rank loads
    transformers' ``state_dict()`` (qkv_proj stored [128, 64]) in the view's head order."""
    from parcomp.cli.main import main

    (tmp_path / "s.pcs").write_text(f"mesh pp=2\n{TRAIN}\n")
    rc = main(["run", str(ROOT / "specs" / "models.py") + ":phi3_lm", "--spec", str(tmp_path / "s.pcs"),
               "--nproc", "2", "--keep", str(tmp_path / "work")])
    out = capsys.readouterr().out
    assert rc == 0, out
    line = next(x for x in out.splitlines() if "1 pipelined step " in x)
    assert "2 gloo ranks" in line and "2 microbatches" in line and line.endswith("OK")
    assert "STORED_ORDER = {'model.layers.0.self_attn.qkv_proj.weight': [" in (tmp_path / "work" / "program.py").read_text()


def test_mixtral_stage_runs_its_experts_on_the_routed_tokens_as_the_dense_stage():
    """Each stage's MoE layer in program.py is dropless, as in the SPMD program: the forward
    stashes the packed rows (one per routed pair) and the weights they follow, the backward
    computes the route plan again from them; stage 0's forward and backward of one microbatch
    equal the dense slot buffer's statements (printed from the same stage programs) on the
    model's weights. Before, both kept the [B, E, C, H] buffer."""
    from parcomp.compile.compiler import compile_graph
    from parcomp.frontends.loader import load_model
    from parcomp.frontends.torch.fold import module_sources
    from parcomp_backends.torch.emit import emit_program, step_function

    g, module, _ = load_model(str(ROOT / "specs" / "models.py") + ":mixtral_lm")
    c = compile_graph(g, spec(f"mesh pp=2\n{TRAIN}\n"))
    text = emit_program(c)
    stage0 = text[text.index("def stage0_forward"):text.index("def stage0_optimizer")]
    assert stage0.count("moe_grouped_mm(") == 4 and stage0.count("moe_grouped_wgrad(") == 2
    assert "moe_dispatch(" not in stage0 and "moe_pack(" in stage0
    ns = {"__name__": "program"}
    exec(text, ns)  # noqa: S102 - the emitted program's functions and runtime, run on this process
    stages = c.program_.stages[0]
    for kind in ("forward", "backward"):
        exec(step_function(stages[kind], f"dense_{kind}", "the dense slot buffer", pop_inputs=True), ns)
    state = module_sources(module)
    p = {k: state[k].detach().float() for k in ns["STAGE_PARAMS"][0] if k in state}
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    out, want = ns["stage0_forward"](p, {"input_ids": ids}), ns["dense_forward"](p, {"input_ids": ids})
    torch.testing.assert_close(out["add_8"], want["add_8"], rtol=0, atol=1e-5 * float(want["add_8"].abs().max()))
    grad = torch.randn(want["add_8"].shape, generator=torch.Generator().manual_seed(1))

    def backward(fn, fwd):
        saved = {k[len("saved."):]: v for k, v in fwd.items() if k.startswith("saved.")}
        handed = {}  # the parameter gradients the stage's backward hands to ready (not returned)
        marks = (handed.__setitem__,) if fn.startswith("stage") else ()  # the dp buckets' hook
        return {**ns[fn](p, {"grad.add_8": grad, "input_ids": ids, **saved}, *marks), **handed}

    got, dense = backward("stage0_backward", out), backward("dense_backward", want)
    assert sorted(got) == sorted(dense) and any("experts" in k for k in got)
    for k in dense:  # float32, summed in another order: within 1e-5 of each value's scale
        torch.testing.assert_close(got[k], dense[k], rtol=0, atol=1e-5 * float(dense[k].abs().max()))
    # the stash holds the routed rows, not the slot buffer: 16 tokens x top-2 rows, not 16 x 4 experts
    assert out["saved.view_7"].shape == (32, 16) and want["saved.view_7"].shape == (4, 16, 16)


def _microbatch_chain(ns, fn, p, ids, labels, zb):
    """One microbatch through both stages' functions named ``fn(stage, kind)`` as the runtime's
    step() calls them (ZB-H1: the input half on a copy of inp, the weight half on inp and the
    ``wstash.*`` it handed over): {"loss", "saved.*" of each stage, "wstash.*", every gradient}."""
    def backward(s, fwd, grads_in):
        saved = {k[len("saved."):]: v for k, v in fwd.items() if k.startswith("saved.")}
        inp = {**({"input_ids": ids} if s == 0 else {"labels": labels}), **saved, **grads_in}
        handed, marks = {}, ()
        if not zb:
            marks = (handed.__setitem__,) if fn(s, "backward").startswith("stage") else ()
            return {**ns[fn(s, "backward")](p, inp, *marks), **handed}, {}
        out = ns[fn(s, "backward_input")](p, dict(inp))
        wst = {k[len("wstash."):]: v for k, v in out.items() if k.startswith("wstash.")}
        marks = (handed.__setitem__,) if fn(s, "backward_weight").startswith("stage") else ()
        w = ns[fn(s, "backward_weight")](p, {**inp, **wst}, *marks)
        return {**{k: v for k, v in out.items() if not k.startswith("wstash.")}, **w, **handed}, wst

    f0 = ns[fn(0, "forward")](p, {"input_ids": ids})
    f1 = ns[fn(1, "forward")](p, {"add_8": f0["add_8"], "labels": labels})
    b1, w1 = backward(1, f1, {})
    b0, w0 = backward(0, f0, {"grad.add_8": b1["grad.add_8"]})
    return {"loss": f1["loss"], **{f"s0.{k}": v for k, v in f0.items()}, **{f"s1.{k}": v for k, v in f1.items()},
            **{f"w1.{k}": v for k, v in w1.items()}, **{f"w0.{k}": v for k, v in w0.items()}, **b1, **b0}


def test_mixtral_zb_h1_stage_halves_run_the_experts_on_the_routed_tokens_as_the_dense_stage():
    """ZB-H1 (the backward in an input half and a weight half): every stage function of the MoE
    layers is dropless, as under 1F1B: the forward stashes the packed rows, the input half reads
    them and hands its packed slot gradients to the weight half (``wstash.*``), whose expert
    weight gradients are grouped matmuls over exact counts. No [B, E, C, H] buffer is left: the
    experts' FLOPs (FlopCounterMode: the dense program's expert matmuls are its only bmm) are
    top_k / experts (2 / 4) of the dense buffer's; one microbatch through both stages' functions
    equals the dense statements printed from the same stage programs. Before, every function of
    a ZB-H1 stage kept the dense buffer."""
    from torch.utils.flop_counter import FlopCounterMode

    from parcomp.compile.compiler import compile_graph
    from parcomp.frontends.loader import load_model
    from parcomp.frontends.torch.fold import module_sources
    from parcomp_backends.torch.emit import emit_program, step_function

    g, module, _ = load_model(str(ROOT / "specs" / "models.py") + ":mixtral_lm")
    c = compile_graph(g, spec(f"mesh pp=2\n{TRAIN.replace('schedule=1f1b', 'schedule=zb-h1')}\n"))
    text = emit_program(c)
    for s in (0, 1):
        for kind in ("forward", "backward", "backward_input", "backward_weight"):
            body = text[text.index(f"def stage{s}_{kind}("):].split("\n\n\n")[0]
            assert "moe_dispatch(" not in body and "moe_combine(" not in body, (s, kind)
        weight = text[text.index(f"def stage{s}_backward_weight("):].split("\n\n\n")[0]
        assert weight.count("moe_grouped_wgrad(") == 2 and "MoE: dropless" in weight
    assert "moe_route_plan(" in text[text.index("def stage1_backward_input("):].split("\n\n\n")[0]
    ns = {"__name__": "program"}
    exec(text, ns)  # noqa: S102 - the emitted program's functions and runtime, run on this process
    for s in (0, 1):
        for kind in ("forward", "backward", "backward_input", "backward_weight"):
            exec(step_function(c.program_.stages[s][kind], f"dense{s}_{kind}", "the dense slot buffer",
                               pop_inputs=True), ns)
    state = module_sources(module)
    p = {k: state[k].detach().float() for s in (0, 1) for k in ns["STAGE_PARAMS"][s] if k in state}
    gen = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 64, (2, 8), generator=gen), torch.randint(0, 64, (2, 8), generator=gen)
    flops = {}
    for name, fn in (("packed", lambda s, k: f"stage{s}_{k}"), ("dense", lambda s, k: f"dense{s}_{k}")):
        with FlopCounterMode(display=False) as count:
            flops[name] = (_microbatch_chain(ns, fn, p, ids, labels, True), count.get_flop_counts()["Global"])
    (got, packed), (want, dense) = flops["packed"], flops["dense"]
    mm, bmm = torch.ops.aten.mm, torch.ops.aten.bmm
    assert dense[bmm] > 0 and packed.get(bmm, 0) == 0  # the dense buffer's expert matmuls are gone
    assert packed[mm] - dense[mm] == dense[bmm] * 2 // 4  # replaced by the routed rows' alone: top-2 of 4
    grads = [k for k in want if k.startswith("grad.")]
    assert sorted(k for k in got if k.startswith("grad.")) == sorted(grads)
    assert any("experts" in k for k in grads) and any("gate" in k for k in grads)
    for k in grads + ["loss"]:  # float32, summed in another order: within 1e-5 of each value's scale
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5 * float(want[k].abs().max()))
    # the stash and the halves' hand-over hold the routed rows, not the slot buffer: 16 tokens x top-2
    assert got["s0.saved.view_7"].shape == (32, 16) and want["s0.saved.view_7"].shape == (4, 16, 16)
    slots = [k for k, v in want.items() if k.startswith("w1.") and v.dim() == 3 and v.shape[:2] == (4, 16)]
    assert len(slots) == 2 and all(got[k].shape == (32, want[k].shape[2]) for k in slots)


def test_mixtral_zb_h1_on_two_gloo_ranks_equals_the_unsharded_step(tmp_path, capsys):
    """``parcomp run`` of the MoE model under ZB-H1, 2 stages of 2 microbatches: the dropless
    stage halves (each rank's expert matmuls over its routed rows only) give the unsharded step."""
    from parcomp.cli.main import main

    (tmp_path / "s.pcs").write_text(f"mesh pp=2\n{TRAIN.replace('schedule=1f1b', 'schedule=zb-h1')}\n")
    rc = main(["run", str(ROOT / "specs" / "models.py") + ":mixtral_lm", "--spec", str(tmp_path / "s.pcs"),
               "--nproc", "2", "--keep", str(tmp_path / "work")])
    out = capsys.readouterr().out
    assert rc == 0, out
    line = next(x for x in out.splitlines() if "1 pipelined step " in x)
    assert "2 gloo ranks" in line and "2 microbatches" in line and line.endswith("OK")
    text = (tmp_path / "work" / "program.py").read_text()
    weight = text[text.index("def stage1_backward_weight("):].split("\n\n\n")[0]
    assert "moe_grouped_wgrad(" in weight and "moe_dispatch(" not in text[:text.index("def profile_device(")]
