"""Pipeline parallelism: stage statements, split-stages, schedules, the simulator,
and a pipelined training step on the numpy interpreter equal to the unsharded step."""
import importlib.util
import pathlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from parcomp.check.differential import compare_all
from parcomp.check.pipeline import run_pipeline_step
from parcomp.check.training import data_for, initial_state
from parcomp.cost.placement import format_placement, placement_table
from parcomp.errors import ParcompError, SpecError
from parcomp.passes.autodiff import add_training_step
from parcomp.passes.pass_list import bind_layouts, group, plan_pipeline, program_stage, run_passes
from parcomp.passes.pipeline.pipeline_plan import format_pipeline
from parcomp.passes.pipeline.schedule import (Action, ScheduleError, analytic_bubble, rank_actions,
                                     schedule, simulate)
from parcomp.reference.numpy_ops import run_unsharded

from graphs import mlp_graph, random_feeds, spec
from numerics import assert_all_equivalent, rtol_of

ROOT = pathlib.Path(__file__).resolve().parents[1].parent
TRAIN = "train optimizer=sgd(lr=0.1, momentum=0.9) input_grads=no"


def _models():
    loc = importlib.util.spec_from_file_location("pp_models", ROOT / "specs" / "models.py")
    mod = importlib.util.module_from_spec(loc)
    loc.loader.exec_module(mod)
    return mod


def chain_graph(blocks=4, batch=8, hidden=4):
    """specs/models.py:mlp_chain with ``blocks`` blocks of width ``hidden``, traced at batch
    ``batch``."""
    import torch

    from parcomp.frontends.torch.export import import_torch

    module, _, names = _models().mlp_chain(blocks=blocks, hidden=hidden)
    torch.manual_seed(1)
    return import_torch(module, (torch.randn(batch, 8, hidden),), names)


def assert_detects_a_wrong_scale(got, want):
    """The comparison has power: gradients off by the dp factor (2) fail it."""
    wrong = {k: v * 2 if k.endswith(".grad") else v for k, v in got.items()}
    assert not compare_all(wrong, want, None, rtol_of(*want.values()))["ok"]


def reference(g, train=TRAIN, seed=0, lowered=False):
    """The unsharded training step of ``g`` (no pp), its feeds and its outputs; ``lowered``: the
    step through the list's group ``lower`` as the SPMD program computes it (in bf16/fp16 a fused
    linear rounds its bias add once, as the pipeline's lowered stages do)."""
    pipe = ("microbatches=", "schedule=", "stages=", "virtual=")
    s = spec("mesh tp=1\n" + " ".join(w for w in train.split() if not w.startswith(pipe)) + "\n")
    ref = add_training_step(bind_layouts(g, s), s)
    if lowered:
        ref = program_stage(run_passes(ref, None, group("lower")))
    feeds = {k: v for k, v in random_feeds(ref, seed, scale=0.15).items()  # O(1) activations
             if ref[k].phase != "optimizer"}
    feeds = initial_state(ref, {**feeds, **data_for(ref, seed)})  # zero optimizer state
    if "step" in ref:
        feeds["step"] = np.array(1.0, "float32")
    return ref, feeds, run_unsharded(ref, feeds)


def pipelined(g, head, train=TRAIN, seed=0):
    """(pipelined outputs, unsharded outputs, plan) of one step."""
    _, feeds, want = reference(g, train, seed)
    plan = plan_pipeline(g, spec(f"{head}{train}\n"))
    return run_pipeline_step(plan, feeds), want, plan


# ---- the spec ----

def test_stage_statements_and_pipeline_options_parse():
    s = spec("mesh dp=2 pp=2 tp=2\nstage 0: 0-2 ln_f\nstage 1: h.3-4\n"
             "train microbatches=4 schedule=1f1b\n")
    assert [r.items for r in s.stages] == [("0", "1", "2", "ln_f"), ("h.3", "h.4")]
    assert s.train.get("schedule") == "1f1b" and s.train.get("microbatches") == 4


@pytest.mark.parametrize("text,where,msg", [
    ("mesh tp=2\nstage 0: 0-5\n", "2:1", "needs a 'pp' mesh axis"),
    ("mesh pp=2\nstage 2: 0\n", "2:7", "stage 2 does not exist"),
    ("mesh pp=2\nstage 0: 0-5\n", "2:1", "stage 1 has no stage statement"),
    ("mesh pp=2\nstage 0: 0\nstage 0: 1\n", "3:7", "stage 0 is given twice"),
    ("mesh pp=2\nstage 0: 0-5\nstage 1: 5\n", "3:10", "module 5 is already in stage 0"),
    ("mesh pp=2\nstage 0: 5-1\nstage 1: 6\n", "2:10", "ends below its start"),
    ("mesh pp=2\nstage 0: h.0-2\nstage 1: h.2-end\n", "3:10", "module h.2 is already in stage 0"),
    ("mesh pp=2\nstage 1: h.2-end\nstage 0: h.0-3\n", "3:10", "module h.2 is already in stage 1"),
    ("mesh pp=2\nstage 0: h.0 h.1-end\nstage 1: h.3-end\n", "3:10", "module h.3 is already in stage 0"),
    ("mesh pp=2\nstage 0: h.4-end h.0-5\nstage 1: x\n", "2:18", "module h.4 is already in this stage"),
    ("mesh pp=2\nstage 0 0-5\n", "2:9", "expected ':'"),
    ("mesh pp=2\ntrain schedule=gpip\n", "2:7", "did you mean 'gpipe'"),
    ("mesh tp=2\ntrain microbatches=2\n", "2:7", "no 'pp' axis"),
    ("mesh pp=2\ntrain microbatches=0\n", "2:7", "microbatches=0 is out of range"),
    ("mesh pp=2\nstage 0: 0\nstage 1: 1\ntrain stages=balanced\n", "4:1", "keep one"),
])
def test_bad_stage_rules_are_located(text, where, msg):
    with pytest.raises(SpecError) as e:
        spec(text)
    assert f"test.pcs:{where}" in str(e.value) and msg in str(e.value)


@pytest.mark.parametrize("stages,where,msg", [
    ("stage 0: l0 l9\nstage 1: l1 l2\n", "2:13", "l9 matches no module"),
    ("stage 0: l00\nstage 1: l1 l2\n", "2:10", "stage 0: l00 matches no module of the model; did you mean l0?"),
    ("stage 0: l1 l2\nstage 1: l0\n", "2:1", "stages must follow the data flow"),
    ("stage 0: l0 l1 l2\nstage 1: l3\n", "3:10", "stage 1: l3 matches no module"),
])
def test_stage_rules_checked_against_the_model(stages, where, msg):
    g = mlp_graph((4,), [4, 8, 8, 4], [True] * 3, ["relu", "relu", "none"])
    with pytest.raises(SpecError) as e:
        plan_pipeline(g, spec(f"mesh pp=2\n{stages}{TRAIN}\n"))
    assert f"test.pcs:{where}" in str(e.value) and msg in str(e.value)


def test_batch_must_split_into_microbatches_times_dp():
    g = mlp_graph((6,), [4, 8, 4], [False] * 2, ["relu", "none"])
    with pytest.raises(SpecError, match="does not split into microbatches=4 x dp=1"):
        plan_pipeline(g, spec(f"mesh pp=2\n{TRAIN} microbatches=4\n"))


def test_balanced_stages_split_flops_evenly():
    g = chain_graph(blocks=4)
    plan = plan_pipeline(g, spec(f"mesh pp=2\n{TRAIN}\n"))
    assert plan.stage_flops[0] == plan.stage_flops[1]
    assert {plan.stage_of[f"{k}.weight"] for k in (0, 3)} == {0}
    assert {plan.stage_of[f"{k}.weight"] for k in (6, 9)} == {1}


# ---- schedules and the simulator ----

@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,micro", [(2, 1), (2, 4), (3, 2), (4, 8)])
def test_simulated_bubble_equals_analytic_and_stash_peaks(name, pp, micro):
    sim = simulate(schedule(name, pp, micro))
    assert sim.bubble == pytest.approx(analytic_bubble(pp, micro), rel=1e-12)
    want = [micro] * pp if name == "gpipe" else [min(pp - s, micro) for s in range(pp)]
    assert list(sim.peak_inflight) == want


def test_simulator_names_rank_and_step_of_a_swapped_recv():
    acts = [list(a) for a in schedule("1f1b", 2, 2)]
    acts[1][0], acts[1][1] = acts[1][1], acts[1][0]  # forward before its recv
    with pytest.raises(ScheduleError) as e:
        simulate(acts)
    assert (e.value.rank, e.value.step) == (1, 0) and "before its activations" in str(e.value)


def test_simulator_reports_a_deadlock_with_every_blocked_rank():
    acts = [list(a) for a in schedule("gpipe", 2, 2)]
    i = [k for k, a in enumerate(acts[0]) if a.kind == "send_fwd"][1]
    j = [k for k, a in enumerate(acts[0]) if a.kind == "recv_bwd"][0]
    acts[0][i], acts[0][j] = acts[0][j], acts[0][i]  # a swapped send/recv
    with pytest.raises(ScheduleError) as e:
        simulate(acts)
    assert (e.value.rank, e.value.step) == (0, 3)
    assert "deadlock" in str(e.value) and "rank 1 step 2 waits on recv_fwd m=1 <- 0" in str(e.value)


def test_simulator_rejects_a_send_nobody_receives():
    acts = [list(a) for a in schedule("gpipe", 2, 1)]
    acts[0].insert(2, Action("send_fwd", 0, 1))
    with pytest.raises(ScheduleError, match="sent twice"):
        simulate(acts)
    acts = [list(a) for a in schedule("gpipe", 2, 1)]
    acts[1] = [a for a in acts[1] if a.kind != "recv_fwd"]
    with pytest.raises(ScheduleError):
        simulate(acts)


def test_rank_action_lists_name_global_peers():
    s = spec("mesh dp=2 pp=2 tp=2\n")
    acts = schedule("1f1b", 2, 2)
    assert [str(a) for a in rank_actions(s.mesh, acts, 5)][:3] == [
        "forward m=0", "send_fwd m=0 -> 7", "forward m=1"]
    assert str(rank_actions(s.mesh, acts, 6)[0]) == "recv_fwd m=0 <- 4"


# ---- the 8-device example ----

def test_placement_table_of_the_8_device_example():
    s = spec("mesh dp=2 pp=2 tp=2\ntopology nodes=2 devices_per_node=4\n")
    t = placement_table(s.mesh, s.topology)
    assert t["stage_groups"]["tp"] == {0: [[0, 1], [4, 5]], 1: [[2, 3], [6, 7]]}
    assert t["groups"]["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t["p2p"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [(r["node"], r["stage"]) for r in t["ranks"]] == [
        (0, 0), (0, 0), (0, 1), (0, 1), (1, 0), (1, 0), (1, 1), (1, 1)]
    text = format_placement(t)
    assert "stage 0 tp groups: {0,1} {4,5}" in text and "stage 1 tp groups: {2,3} {6,7}" in text
    print(text)


def test_megatron_order_puts_pp_outermost():
    s = spec("mesh pp=2 dp=2 tp=2\n")
    t = placement_table(s.mesh)
    assert t["stage_groups"]["tp"][0] == [[0, 1], [2, 3]] and t["p2p"][0] == [0, 4]


# ---- execution on the interpreter ----

@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("head", ["mesh pp=2\nstage 0: 0-5\nstage 1: 6-11\n", "mesh dp=2 pp=2\n"])
def test_pp2_step_on_a_4_block_chain_equals_the_unsharded_step(name, head):
    g = chain_graph(blocks=4)
    got, want, _ = pipelined(g, head, f"{TRAIN} microbatches=2 schedule={name}")
    assert_all_equivalent(got, want)  # loss, every grad, param and momentum
    assert_detects_a_wrong_scale(got, want)


def test_schedules_give_the_same_numbers():
    g = chain_graph(blocks=4)
    outs = [pipelined(g, "mesh pp=4\n", f"{TRAIN} microbatches=4 schedule={n}")[0]
            for n in ("gpipe", "1f1b")]
    for k in outs[0]:
        np.testing.assert_array_equal(outs[0][k], outs[1][k])


def _skip_model():
    """l0 -> a; a feeds l1 (stage 1) and the residual add on stage 2: a skip 0 -> 2 and
    a value used by two later stages."""
    import torch
    from torch import nn

    from parcomp.frontends.torch.export import import_torch

    class Skip(nn.Module):
        def __init__(self):
            super().__init__()
            self.l0, self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            a = self.l0(x)
            return self.l2(torch.tanh(self.l1(a))) + a

    torch.manual_seed(0)
    return import_torch(Skip(), (torch.randn(4, 8),), ["x"])


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_skip_connection_over_two_stages_forward_and_backward(name):
    g = _skip_model()
    head = "mesh pp=3\nstage 0: l0\nstage 1: l1\nstage 2: l2\n"
    got, want, plan = pipelined(g, head, f"{TRAIN} microbatches=2 schedule={name}")
    (a,) = plan.stages[0].send
    assert plan.stages[1].recv == (a,) and a in plan.stages[1].send  # relayed through stage 1
    assert a in plan.stages[2].recv and len(plan.stages[2].recv) == 2
    # stage 1 adds stage 2's gradient of a to its own before sending it back
    assert "grad." + a in [n.name for n in plan.stages[1].backward.inputs]
    assert_all_equivalent(got, want)


def test_adamw_and_cross_entropy_on_a_pipeline():
    g = mlp_graph((8,), [4, 8, 8, 6], [True] * 3, ["gelu", "tanh", "none"])
    train = "train loss=cross_entropy optimizer=adamw(lr=0.01) input_grads=no microbatches=4"
    got, want, _ = pipelined(g, "mesh pp=3\n", train)
    assert_all_equivalent(got, want)


def test_pipeline_report_and_program_field():
    from parcomp.compile.compiler import compile_graph

    g = mlp_graph((8,), [4, 8, 8, 4], [True] * 3, ["relu", "relu", "none"])
    c = compile_graph(g, spec(f"mesh dp=2 pp=2\n{TRAIN} microbatches=2 schedule=gpipe\n"))
    plan = c.program_.pipeline
    assert plan is not None and plan.batch == 8 and plan.micro_batch == 2
    rep = c.report["pipeline"]
    assert rep["bubble_analytic"] == pytest.approx(1 / 3)
    assert [s["peak_inflight_microbatches"] for s in rep["stages"]] == [2, 2]
    assert rep["actions"][1][0] == "recv_fwd m=0 <- 0"
    text = format_pipeline(c.report)
    assert "global batch 8 = microbatch 2 x 2 microbatches x dp 2" in text
    assert "stage 1 dp groups: {1,3}" in text


@st.composite
def chain_case(draw):
    nlin = draw(st.integers(1, 4))
    dims = [draw(st.sampled_from([4, 8])) for _ in range(nlin + 1)]
    bias = [draw(st.booleans()) for _ in range(nlin)]
    acts = [draw(st.sampled_from(["relu", "gelu", "tanh", "none"])) for _ in range(nlin)]
    name = draw(st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved"]))
    virtual = draw(st.integers(1, min(2, nlin))) if name == "interleaved" else 1  # a chunk needs a module
    # a module per chunk; interleaved microbatches (pp or 2pp) must split the batch of 8
    pp = draw(st.sampled_from([p for p in range(1, max(1, nlin // virtual) + 1)
                               if name != "interleaved" or 8 % p == 0]))
    micro = pp * draw(st.sampled_from([1, 2])) if name == "interleaved" else draw(st.sampled_from([1, 2, 4]))
    dp = draw(st.sampled_from([d for d in (1, 2) if 8 % (micro * d) == 0]))  # micro x dp splits 8
    opt = draw(st.sampled_from(["sgd(lr=0.1, momentum=0.9)", "adamw(lr=0.01)"]))
    mesh = f"mesh {'dp=2 ' if dp == 2 else ''}pp={pp}\n"
    train = f"train optimizer={opt} input_grads=no microbatches={micro} schedule={name}" + \
        (f" virtual={virtual}" if name == "interleaved" else "")
    return mlp_graph((8,), dims, bias, acts), mesh, train


@settings(max_examples=20)
@given(chain_case(), st.integers(0, 2**16))
def test_random_chains_stages_microbatches_schedules_equal_unsharded(case, seed):
    g, mesh, train = case
    got, want, plan = pipelined(g, mesh, train, seed)
    assert_all_equivalent(got, want)
    assert plan.simulation.bubble == pytest.approx(plan.analytic_bubble, abs=1) and \
        0 <= plan.simulation.bubble < 1


def test_a_model_with_fewer_modules_than_stages_is_an_error():
    g = mlp_graph((8,), [4, 4], [False], ["none"])
    with pytest.raises(ParcompError, match="1 module"):
        plan_pipeline(g, spec(f"mesh pp=2\n{TRAIN}\n"))


def test_cli_compile_prints_the_pipeline_and_placement(tmp_path, capsys):
    from parcomp.cli.main import main

    from graphs import mlp_text

    (tmp_path / "m.pcir").write_text(mlp_text((8,), [4, 8, 8, 4], [True] * 3, ["relu", "relu", "none"]))
    (tmp_path / "s.pcs").write_text(f"mesh dp=2 pp=2\ntopology nodes=2 devices_per_node=2\n"
                                    f"stage 0: l0\nstage 1: l1 l2\n{TRAIN} microbatches=2\n")
    rc = main(["compile", str(tmp_path / "m.pcir"), "--spec", str(tmp_path / "s.pcs"),
               "-o", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0 and "pipeline: pp=2 schedule 1f1b" in out and "p2p pairs: 0->1 2->3" in out
    assert "ACTIONS = {" in (tmp_path / "out" / "program.py").read_text()


def test_cli_bad_stage_rule_exits_2_at_its_line(tmp_path, capsys):
    from parcomp.cli.main import main

    from graphs import mlp_text

    (tmp_path / "m.pcir").write_text(mlp_text((8,), [4, 8, 4], [False] * 2, ["relu", "none"]))
    (tmp_path / "s.pcs").write_text(f"mesh pp=2\nstage 0: l0\nstage 1: l1 l7\n{TRAIN}\n")
    rc = main(["check", str(tmp_path / "m.pcir"), "--spec", str(tmp_path / "s.pcs")])
    err = capsys.readouterr().err
    assert rc == 2 and "s.pcs:3:13" in err and "l7 matches no module" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    assert "Traceback" not in err


def test_cli_check_runs_the_pipelined_step(tmp_path, capsys):
    from parcomp.cli.main import main

    from graphs import mlp_text

    (tmp_path / "m.pcir").write_text(mlp_text((8,), [4, 8, 8, 4], [True] * 3, ["relu", "tanh", "none"]))
    (tmp_path / "s.pcs").write_text(f"mesh dp=2 pp=2\n{TRAIN} microbatches=2 schedule=gpipe\n")
    rc = main(["check", str(tmp_path / "m.pcir"), "--spec", str(tmp_path / "s.pcs")])
    out = capsys.readouterr().out
    assert rc == 0 and "pipelined step on the numpy interpreter vs unsharded step" in out
    assert "OK" in out.split("pipelined step")[1].split("\n")[0]


def test_cli_run_of_a_pipeline_with_a_wrong_nproc_is_a_located_error(tmp_path, capsys):
    from parcomp.cli.main import main

    from graphs import mlp_text

    (tmp_path / "m.pcir").write_text(mlp_text((8,), [4, 8, 4], [False] * 2, ["relu", "none"]))
    (tmp_path / "s.pcs").write_text(f"mesh pp=2 tp=2\n{TRAIN}\n")
    rc = main(["run", str(tmp_path / "m.pcir"), "--spec", str(tmp_path / "s.pcs"), "--nproc", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "--nproc 2" in err and "4 ranks" in err


def test_shipped_dp2_pp2_tp2_spec_plans_the_8_device_example():
    from parcomp.frontends.loader import load_model
    from parcomp.spec import load_spec

    s = load_spec(str(ROOT / "specs" / "mlp_chain_dp2_pp2_tp2_train.pcs"))
    g, _, _ = load_model(str(ROOT / "specs" / "models.py") + ":mlp_chain")
    plan = plan_pipeline(g, s)
    assert plan.batch == 2 and plan.dp == 2 and plan.micro_batch == 1
    assert plan.stage_of["71.weight"] == 0 and plan.stage_of["72.weight"] == 1
    t = placement_table(s.mesh, s.topology)
    assert t["stage_groups"]["tp"] == {0: [[0, 1], [4, 5]], 1: [[2, 3], [6, 7]]}
    assert t["groups"]["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [str(a) for a in plan.rank_actions(s.mesh, 5)] == [
        "forward m=0", "send_fwd m=0 -> 7", "recv_bwd m=0 <- 7", "backward m=0", "optimizer"]


@pytest.mark.parametrize("mesh,rule,msg", [
    ("pp=2 tp=2", "l0.weight pp=S(0)", "param l0.weight is split over pp (pp=S(0)): inside a pipeline "
                                       "(mesh pp=2 tp=2) a param may split only over tp"),
    ("dp=2 pp=2", "l*.weight dp=S(1)", "param l0.weight is split over dp (dp=S(1))"),
])
def test_cli_param_split_over_pp_or_dp_is_an_error_at_its_rule(tmp_path, capsys, mesh, rule, msg):
    from parcomp.cli.main import main

    from graphs import mlp_text

    (tmp_path / "m.pcir").write_text(mlp_text((8,), [4, 8, 4], [False] * 2, ["relu", "none"]))
    (tmp_path / "s.pcs").write_text(f"mesh {mesh}\n{rule}\n{TRAIN} microbatches=2\n")
    rc = main(["compile", str(tmp_path / "m.pcir"), "--spec", str(tmp_path / "s.pcs"),
               "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "s.pcs:2:1" in err and msg in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
