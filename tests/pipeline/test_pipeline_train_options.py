"""Training options with a ``pp`` axis: recompute (each stage's forward stashes only what the
policy keeps, its backward recomputes the rest), clip_grad_norm (one global norm over every stage and tp
shard: each stage's sum of squares, summed over pp before any update), lr schedules (the
optimizer programs read the step counter), accumulate=K (the microbatches are the
accumulation: K x microbatches of the same size, the model's batch one of K as unpipelined).
Each pipelined step on the numpy interpreter equals the unsharded step with the same options;
program.py under torchrun (4 gloo ranks) runs 3 steps equal to the unsharded steps."""
import json

import numpy as np
import pytest

from parcomp.errors import SpecError
from parcomp.passes.pass_list import plan_pipeline

from graphs import spec
from numerics import assert_all_equivalent
from test_pipeline import chain_graph, pipelined, reference
from test_pipeline_tp import HEAD as TP_HEAD

OPT = "train optimizer=adamw(lr=0.01) input_grads=no microbatches=2 schedule=1f1b"
CLIP = "clip_grad_norm=0.05"  # below the chain's gradient norm: clipping acts
MESHES = ["mesh pp=2\n", "mesh dp=2 pp=2\n", TP_HEAD]


@pytest.mark.parametrize("head", MESHES, ids=["pp2", "dp2pp2", "dp2pp2tp2"])
@pytest.mark.parametrize("opts", [CLIP, "accumulate=2", f"{CLIP} accumulate=2 lr_schedule=linear(total_iters=4)"])
def test_option_equals_the_unsharded_step(head, opts):
    got, want, plan = pipelined(chain_graph(blocks=4), head, f"{OPT} {opts}")
    assert_all_equivalent(got, want)


def test_clipping_acts_and_is_one_norm_over_all_stages():
    """With the clip, the step differs from the unclipped one; clipping each stage by its own
    norm (the stats not summed over the stages) gives another update, which the check catches."""
    from dataclasses import replace

    from parcomp.check.differential import compare_all

    g = chain_graph(blocks=4)
    got, want, plan = pipelined(g, "mesh pp=2\n", f"{OPT} {CLIP}")
    plain = pipelined(g, "mesh pp=2\n", OPT)[0]
    w = "0.weight"
    assert not np.allclose(got[w], plain[w])
    assert all(st.stats is not None for st in plan.stages)
    from parcomp.check.pipeline import run_pipeline_step

    _, feeds, _ = reference(g, f"{OPT} {CLIP}")
    zero = [replace(st, stats=None) if st.index else st for st in plan.stages]  # stage 1's share lost
    alone = replace(plan, stages=tuple(zero))
    with pytest.raises(KeyError):  # its optimizer reads the agreed norm: it cannot run without one
        run_pipeline_step(replace(plan, stages=tuple(replace(st, stats=None) for st in plan.stages)), feeds)
    wrong = run_pipeline_step(alone, feeds)
    assert not compare_all(wrong, want, sorted(got))["ok"]


def test_a_tied_weight_counts_once_in_the_norm():
    from test_pipeline_tied import STAGES, gpt2_64, lm_pipelined

    train = "train loss=cross_entropy optimizer=sgd(lr=0.1, momentum=0.9) input_grads=no clip_grad_norm=0.5"
    got, want, plan, _, _ = lm_pipelined(gpt2_64(), f"mesh pp=2\n{STAGES}", f"{train} microbatches=2")
    assert plan.tied == (("lm_head.weight", (0, 1)),)
    counted = [[n.name for n in st.stats.inputs] for st in plan.stages]
    assert "grad.lm_head.weight" in counted[0] and "grad.lm_head.weight" not in counted[1]
    assert_all_equivalent(got, want)


def test_lr_schedule_three_steps_follow_the_unsharded_trajectory():
    from parcomp.check.pipeline import compare_steps

    train = f"{OPT} lr_schedule=cosine(T_max=3,warmup=1) {CLIP}"
    ref, feeds, _ = reference(chain_graph(blocks=4), train)
    plan = plan_pipeline(chain_graph(blocks=4), spec(f"mesh dp=2 pp=2\n{train}\n"))
    res = compare_steps(plan, ref, feeds, 3)
    assert res["ok"], res["why"]
    const = plan_pipeline(chain_graph(blocks=4), spec(f"mesh dp=2 pp=2\n{OPT} {CLIP}\n"))
    assert not compare_steps(const, ref, feeds, 3)["ok"]  # the schedule changes the trajectory


def test_accumulate_multiplies_the_microbatches():
    from parcomp.compile.compiler import compile_graph

    c = compile_graph(chain_graph(blocks=4, batch=8), spec(f"mesh dp=2 pp=2\n{OPT} accumulate=3\n"))
    plan = c.program_.pipeline
    assert (plan.microbatches, plan.micro_batch, plan.batch) == (6, 2, 24)
    assert c.report["pipeline"]["global_batch"] == 24
    with pytest.raises(SpecError) as e:
        plan_pipeline(chain_graph(blocks=4, batch=6), spec(f"mesh dp=2 pp=2\n{OPT} accumulate=2\n"))
    assert "accumulate=2" in str(e.value) and "equal parts" in str(e.value)


@pytest.mark.parametrize("key,value", [("zero", "2")])
def test_options_not_pipelined_yet_are_refused_at_their_column(key, value):
    with pytest.raises(SpecError) as e:
        plan_pipeline(chain_graph(blocks=4), spec(f"mesh dp=2 pp=2\n{OPT} {key}={value}\n"))
    assert f"{key}=" in str(e.value) and "test.pcs:2:" in str(e.value)


#: a 4-linear GELU MLP (pcir, no module paths: a node's layer is its param's ``l<k>``):
#: 2 layers a stage, each a matmul, a bias add and a GELU
RC_WIDTHS = [8, 16, 16, 16, 8]
RC_OPT = "train loss=mse optimizer=adamw(lr=0.01) input_grads=no microbatches=2 schedule=1f1b"


def _rc_graph():
    from graphs import mlp_graph

    return mlp_graph((8, 8), RC_WIDTHS, [True] * 4, ["gelu"] * 3)


@pytest.mark.parametrize("head", MESHES[:2] + ["mesh pp=2 tp=2\nl0.weight colwise\nl1.weight rowwise\n"],
                         ids=["pp2", "dp2pp2", "pp2tp2"])
@pytest.mark.parametrize("mode", ["selective", "all"])
def test_recompute_equals_the_unsharded_step_and_stashes_less(head, mode):
    """Each stage's backward recomputes what the policy drops (``rc.*`` values, as the SPMD
    step's), so the stage's forward stashes less per microbatch and the memory model's
    per-stage peak drops; the step equals the unsharded step without recomputation."""
    g = _rc_graph()
    got, want, plan = pipelined(g, head, f"{RC_OPT} recompute={mode}")
    assert_all_equivalent(got, want)
    plain = pipelined(g, head, RC_OPT)[2]
    for st, base in zip(plan.stages, plain.stages):
        assert any(n.name.startswith("rc.") for n in st.backward.nodes)
        assert not any(n.name.startswith("rc.") for n in st.forward.nodes)
        assert st.saved_bytes < base.saved_bytes or (mode, st.index) == ("all", 1)
    peak = [[s["peak_inflight_bytes"] for s in p.report()["stages"]] for p in (plain, plan)]
    assert sum(peak[1]) < sum(peak[0]) and all(a <= b for a, b in zip(peak[1], peak[0]))


def test_recompute_all_keeps_the_layer_boundaries_only():
    """recompute=all: stage 0 (l0, l1) stashes l0's output activation alone (x is the
    microbatch's data, l1's activation is sent), matmul outputs and bias sums recomputed;
    the last stage stashes what it received, l2's activation and the loss's difference."""
    plan = pipelined(_rc_graph(), "mesh pp=2\n", f"{RC_OPT} recompute=all")[2]
    assert [st.saved for st in plan.stages] == [("l0.act",), ("l1.act", "l2.act", "loss.sub")]
    rc = sorted(n.name for n in plan.stages[0].backward.nodes if n.name.startswith("rc."))
    assert rc == ["rc.l0.mm", "rc.l0.out", "rc.l1.mm", "rc.l1.out"]


@pytest.mark.parametrize("opts", ["microbatches=2 schedule=zb-h1", "microbatches=4 schedule=interleaved virtual=2",
                                  "microbatches=2 schedule=1f1b precision=bf16 zero=1 clip_grad_norm=0.05"])
def test_recompute_changes_no_value_of_other_pipeline_options(opts):
    """With ZB-H1's split backward, an interleaved schedule, bf16 with zero=1 and clipping: the
    step with recompute=all is the step without it, bit for bit (the same ops on the same
    operands)."""
    from parcomp.check.pipeline import run_pipeline_step
    from graphs import mlp_graph

    g = mlp_graph((8, 8), RC_WIDTHS + [8], [True] * 5, ["gelu"] * 4)
    _, feeds, _ = reference(g, "train loss=mse optimizer=adamw(lr=0.01) input_grads=no")
    base = f"mesh dp=2 pp=2\ntrain loss=mse optimizer=adamw(lr=0.01) input_grads=no {opts}"
    plain, full = (plan_pipeline(g, spec(f"{base} recompute={m}\n")) for m in ("none", "all"))
    assert sum(st.saved_bytes for st in full.stages) < sum(st.saved_bytes for st in plain.stages)
    a, b = run_pipeline_step(plain, feeds), run_pipeline_step(full, feeds)
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_cli_check_of_a_pipeline_with_recompute(tmp_path, capsys):
    """parcomp check: the pipelined step with recompute=all on the float64 interpreter equals
    the unsharded step."""
    from parcomp.cli.main import main

    from graphs import mlp_text

    (tmp_path / "m.pcir").write_text(mlp_text((8, 8), RC_WIDTHS, [True] * 4, ["gelu"] * 3))
    (tmp_path / "s.pcs").write_text(f"mesh pp=2\n{RC_OPT} recompute=all\n")
    rc = main(["check", str(tmp_path / "m.pcir"), "--spec", str(tmp_path / "s.pcs")])
    out = capsys.readouterr().out
    line = out.split("pipelined step on the numpy interpreter vs unsharded step")[1].split("\n")[0]
    assert rc == 0 and "in float64" in line and line.endswith("OK"), out


@pytest.mark.slow
def test_program_with_recompute_on_two_gloo_ranks_equals_the_unsharded_steps(tmp_path, capsys):
    """program.py on 2 gloo ranks (pp=2), recompute=all: each stage's backward recomputes its
    layers from the stash (``rc_`` statements), 2 steps equal to the unsharded steps."""
    pytest.importorskip("torch")
    from parcomp.cli.main import main

    from graphs import mlp_text

    (tmp_path / "m.pcir").write_text(mlp_text((8, 8), RC_WIDTHS, [True] * 4, ["gelu"] * 3))
    (tmp_path / "s.pcs").write_text(f"mesh pp=2\n{RC_OPT} recompute=all\n")
    rc = main(["run", str(tmp_path / "m.pcir"), "--spec", str(tmp_path / "s.pcs"), "--nproc", "2",
               "--keep", str(tmp_path / "work"), "--steps", "2", "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    res = json.loads(out.strip().splitlines()[-1])
    assert res["ok"] and len(res["losses"]) == 2
    text = (tmp_path / "work" / "program.py").read_text()
    backward = text.split("def stage0_backward")[1].split("\ndef ")[0]
    assert "rc_l0_mm = torch.matmul(x, l0_weight)" in backward


@pytest.mark.slow
def test_program_with_clip_schedule_and_accumulate_runs_three_steps_equal_to_torch(tmp_path, capsys):
    """program.py on 4 gloo ranks (dp=2 x pp=2), 3 steps, against the unsharded steps with the
    same options (``parcomp run --steps 3``: the losses judged, the rest reported)."""
    pytest.importorskip("torch")
    from parcomp.cli.main import main

    from graphs import mlp_text

    (tmp_path / "m.pcir").write_text(mlp_text((8,), [4, 8, 8, 4], [True] * 3, ["relu", "tanh", "none"]))
    (tmp_path / "s.pcs").write_text(f"mesh dp=2 pp=2\n{OPT} {CLIP} accumulate=2 "
                                    f"lr_schedule=cosine(T_max=3,warmup=1)\n")
    rc = main(["run", str(tmp_path / "m.pcir"), "--spec", str(tmp_path / "s.pcs"), "--nproc", "4",
               "--keep", str(tmp_path / "work"), "--steps", "3", "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    res = json.loads(out.strip().splitlines()[-1])
    assert res["ok"] and len(res["losses"]) == 3
    text = (tmp_path / "work" / "program.py").read_text()
    assert "STATS = {0: stage0_stats, 1: stage1_stats}" in text and "MICROBATCHES = 4" in text


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("head", MESHES, ids=["pp2", "dp2pp2", "dp2pp2tp2"])
def test_low_precision_equals_the_unsharded_step_accumulating_the_same_microbatches(head, precision):
    """precision=bf16|fp16: fp32 master params read through a cast, low-precision activations
    and p2p, each microbatch's parameter gradients widened to fp32 before they are summed (over
    microbatches, then dp); fp16 seeds the last stage's backward with the loss scale and unscales
    the summed gradients in every stage's update. The unsharded reference that sums the same microbatches is
    ``accumulate=K`` (torch: K autocast forward/backward into fp32 .grad, as
    tests/training/test_precision_accumulate.py shows), lowered as the SPMD program is (the
    stages are: a fused linear rounds its bias add once): equal within float32's tolerance (the
    unsharded full-batch bf16 step differs by bf16 rounding: its gradient sums over the batch
    in bf16)."""
    from parcomp.check.differential import compare_all, tolerance_for
    from parcomp.check.pipeline import run_pipeline_step

    dp = 2 if "dp=2" in head else 1
    train = f"{OPT} precision={precision} {CLIP}"
    ref, feeds, want = reference(chain_graph(blocks=4, batch=8 // (2 * dp)),
                                 f"{train} accumulate={2 * dp}", lowered=True)
    plan = plan_pipeline(chain_graph(blocks=4, batch=8), spec(f"{head}{train}\n"))
    low = {"bf16": "bfloat16", "fp16": "float16"}[precision]
    assert plan.stages[1].forward[plan.stages[1].recv[0]].type.dtype == low  # p2p in 2 bytes
    got = run_pipeline_step(plan, feeds)
    # tp inside a stage: a row-parallel matmul's partial sums are low precision, reduced over tp
    # (as Megatron's): within the dtype's tolerance of the one unsplit matmul, not float32's
    assert_all_equivalent(got, want, rtol=tolerance_for(low) if "tp=2" in head else None)
    fp32 = run_pipeline_step(plan_pipeline(chain_graph(blocks=4, batch=8), spec(f"{head}{OPT} {CLIP}\n")),
                             {k: v for k, v in feeds.items() if not k.startswith("amp.")})
    assert not compare_all(fp32, want, sorted(fp32), 1e-3)["ok"]  # the precision shows


@pytest.mark.parametrize("head", MESHES[1:], ids=["dp2pp2", "dp2pp2tp2"])
def test_fp16_overflow_skips_the_step_on_every_stage(head):
    """A loss scale that overflows float16: every stage counts its non-finite gradients, the
    counts are summed over the stages (the stats), and every stage keeps its params and state,
    halves the scale and counts the skip, as the unsharded GradScaler step."""
    from parcomp.check.pipeline import run_pipeline_step

    train = f"{OPT} precision=fp16 loss_scale=1e19"
    plan = plan_pipeline(chain_graph(blocks=4, batch=8), spec(f"{head}{train}\n"))
    with np.errstate(all="ignore"):  # the overflow is the point
        ref, feeds, want = reference(chain_graph(blocks=4, batch=2), f"{train} accumulate=4", lowered=True)
        got = run_pipeline_step(plan, feeds)
    assert (float(got["amp.skipped"]), float(got["amp.scale_ratio"])) == (1.0, -0.5)
    for p in ("0.weight", "11.weight"):  # the first and the last stage both skipped
        np.testing.assert_array_equal(got[p], feeds[p])
    assert_all_equivalent(got, want, [k for k in want if not k.endswith(".grad") and k != "loss"])


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_program_runs_three_steps_on_two_ranks(tmp_path, capsys, precision):
    """program.py with precision=bf16|fp16 (p2p of 2-byte elements; fp16: the loss scale and
    the stages' overflow count summed over pp) and the clip, 3 steps on 2 gloo ranks against the
    unsharded steps in that precision, within its tolerance."""
    pytest.importorskip("torch")
    from parcomp.cli.main import main

    from graphs import mlp_text

    (tmp_path / "m.pcir").write_text(mlp_text((8,), [4, 8, 8, 4], [True] * 3, ["relu", "tanh", "none"]))
    # fp16 at loss_scale=256: the reference is the full-batch step, whose fp16 batch sums overflow
    # at the default 65536 on this model where the pipeline's (fp32 sums of microbatches) do not
    scale = " loss_scale=256" if precision == "fp16" else ""
    (tmp_path / "s.pcs").write_text(f"mesh pp=2\n{OPT} {CLIP} precision={precision}{scale}\n")
    rc = main(["run", str(tmp_path / "m.pcir"), "--spec", str(tmp_path / "s.pcs"), "--nproc", "2",
               "--keep", str(tmp_path / "work"), "--steps", "3", "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    res = json.loads(out.strip().splitlines()[-1])
    assert res["ok"] and len(res["losses"]) == 3
    text = (tmp_path / "work" / "program.py").read_text()
    assert {"bf16": "bfloat16", "fp16": "float16"}[precision] in text
    assert ("amp.found" in text) == (precision == "fp16")


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1", "interleaved"])
def test_every_schedule_takes_every_option(schedule):
    """fp16 (loss scale, overflow count), the global clip and an lr schedule under GPipe, ZB-H1
    (the backward split in two) and interleaved 1F1B (a rank's two chunks share one sum of
    squares, the tied-free chain's 4 virtual stages): the unsharded accumulating step exactly."""
    from parcomp.check.pipeline import run_pipeline_step

    train = (f"train optimizer=adamw(lr=0.01) input_grads=no microbatches=2 schedule={schedule} "
             f"precision=fp16 {CLIP} lr_schedule=linear(total_iters=4)")
    ref, feeds, want = reference(chain_graph(blocks=4, batch=4), f"{train} accumulate=2", lowered=True)
    plan = plan_pipeline(chain_graph(blocks=4, batch=8), spec(f"mesh pp=2\n{train}\n"))
    assert all(st.stats is not None for st in plan.stages)
    assert_all_equivalent(run_pipeline_step(plan, feeds), want)
