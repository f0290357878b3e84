"""``zero=1`` with a ``pp`` axis: the optimizer state of each stage split over its dp ranks.

Each stage's update and stats programs run on the mesh less ``pp``: the runtime
reduce-scatters each gradient over dp in float32, the update computes this rank's part of
the params and state and all_gathers the params, as the SPMD program's ``zero=1`` step. On
the numpy interpreter each step equals the unsharded step; program.py on 4 gloo ranks (dp=2 x
pp=2) with clip_grad_norm, bf16, zero=1 and accumulate runs 3 steps equal to
torch.optim.AdamW over the unsharded torch module."""
import numpy as np
import pytest

from parcomp.check.pipeline import run_pipeline_step
from parcomp.errors import SpecError
from parcomp.ir.types import Shard
from parcomp.passes.pass_list import plan_pipeline
from parcomp.passes.pipeline.pipeline_plan import stage_memory

from graphs import spec
from numerics import assert_all_equivalent
from test_pipeline import _models, chain_graph, reference
from test_pipeline_tp import HEAD as TP_HEAD

OPT = "train optimizer=adamw(lr=0.01) input_grads=no microbatches=2 schedule=1f1b clip_grad_norm=0.05"
MESHES = ["mesh dp=2 pp=2\n", TP_HEAD]


@pytest.mark.parametrize("head", MESHES, ids=["dp2pp2", "dp2pp2tp2"])
def test_zero1_equals_the_unsharded_step(head):
    """The unsharded step (no zero: the state split changes no number) with the global clip."""
    _, feeds, want = reference(chain_graph(blocks=4), OPT)
    plan = plan_pipeline(chain_graph(blocks=4), spec(f"{head}{OPT} zero=1\n"))
    assert_all_equivalent(run_pipeline_step(plan, feeds), want)


@pytest.mark.parametrize("head", MESHES, ids=["dp2pp2", "dp2pp2tp2"])
def test_zero1_splits_the_state_over_dp_and_gathers_the_params(head):
    """Every Adam moment is split over dp (on a dim tp does not split), the update all_gathers
    each param over dp, the stats' sum of squares is reduced over dp, and one rank's optimizer
    state is half of the unsplit plan's."""
    plan = plan_pipeline(chain_graph(blocks=4), spec(f"{head}{OPT} zero=1\n"))
    plain = plan_pipeline(chain_graph(blocks=4), spec(f"{head}{OPT}\n"))
    for st, local, other in zip(plan.stages, plan.local, plain.local or plain.stages):
        dp = local.axes.index("dp")
        for p in st.params:
            lay = local.layouts[f"{p}.exp_avg"]
            if isinstance(lay[dp], Shard):
                assert lay[dp].dim not in [q.dim for q in lay if isinstance(q, Shard) and q is not lay[dp]]
                assert isinstance(local.layouts[f"grad.{p}"][dp], Shard)
        gathered = {n.inputs[0] for n in local.optimizer.nodes if n.op == "all_gather" and n.attr("axis") == "dp"}
        assert len(gathered) == sum(isinstance(local.layouts[f"{p}.exp_avg"][dp], Shard) for p in st.params)
        assert any(n.op == "all_reduce" and "dp" in n.attr("axis") for n in local.stats.nodes)
        mine = stage_memory(st, local)["optimizer_state_bytes"]
        whole = stage_memory(st, other if plain.local else None)["optimizer_state_bytes"]
        assert mine < whole and mine >= whole // 2


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1", "interleaved"])
def test_zero1_under_every_schedule(schedule):
    """ZB-H1 (the backward split in two) and interleaved 1F1B (a rank's two chunks, each its own
    update on the mesh less pp) with zero=1 and the clip: the unsharded step; program.py prints."""
    from parcomp.compile.compiler import compile_graph
    from parcomp_backends.torch.emit import emit_program

    train = OPT.replace("schedule=1f1b", f"schedule={schedule}")
    _, feeds, want = reference(chain_graph(blocks=4), train)
    s = spec(f"mesh dp=2 pp=2\n{train} zero=1\n")
    plan = plan_pipeline(chain_graph(blocks=4), s)
    assert all(local.axes == ("dp",) for local in plan.local)
    assert_all_equivalent(run_pipeline_step(plan, feeds), want)
    assert "reduce_scatter" in emit_program(compile_graph(chain_graph(blocks=4), s))


def test_zero2_is_refused_at_its_column():
    with pytest.raises(SpecError) as e:
        plan_pipeline(chain_graph(blocks=4), spec(f"mesh dp=2 pp=2\n{OPT} zero=2\n"))
    assert "zero=" in str(e.value) and "test.pcs:2:" in str(e.value)


def test_clip_bf16_zero1_and_accumulate_equal_the_unsharded_accumulating_step():
    """All four at once on the interpreter: the unsharded bf16 step accumulating the same
    8 microbatches (microbatches 2 x accumulate 2 x dp 2), lowered as the stages are (in bf16 a
    fused linear rounds its bias add once)."""
    train = f"{OPT} precision=bf16"
    _, feeds, want = reference(chain_graph(blocks=4, batch=2), f"{train} accumulate=8", lowered=True)
    plan = plan_pipeline(chain_graph(blocks=4, batch=8), spec(f"mesh dp=2 pp=2\n{train} zero=1 accumulate=2\n"))
    assert (plan.microbatches, plan.micro_batch) == (4, 2)
    assert_all_equivalent(run_pipeline_step(plan, feeds), want)


def _torch_steps(feeds, steps, parts, clip):
    """``steps`` steps of torch.optim.AdamW(lr=0.01) on specs/models.py:mlp_chain(4 blocks,
    width 4) from ``feeds``' params: per step ``parts`` microbatches under
    torch.autocast(bfloat16), each loss / parts backward into float32 .grad, then
    clip_grad_norm_; the params and each step's loss (mean over the global batch)."""
    import torch

    module = _models().mlp_chain(blocks=4, hidden=4)[0].train()
    with torch.no_grad():
        for k, v in module.named_parameters():
            v.copy_(torch.from_numpy(np.asarray(feeds[k])))
    opt = torch.optim.AdamW(module.parameters(), lr=0.01)
    xs = torch.from_numpy(np.asarray(feeds["x"])).chunk(parts)
    ts = torch.from_numpy(np.asarray(feeds["target"])).chunk(parts)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for x, t in zip(xs, ts):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = module(x)
            loss = torch.nn.functional.mse_loss(y.float(), t) / parts
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        opt.step()
        losses.append(total)
    return {k: v.detach().numpy() for k, v in module.named_parameters()}, np.array(losses)


@pytest.mark.slow
def test_program_with_clip_bf16_zero1_and_accumulate_equals_torch(tmp_path):
    """program.py on 4 gloo ranks (dp=2 x pp=2), clip_grad_norm + bf16 + zero=1 + accumulate=2,
    3 steps: each loss and the params after them equal torch.optim.AdamW over the unsharded
    module within bfloat16's tolerance; the program reduce-scatters the gradients and holds
    half of each Adam moment per dp rank."""
    torch = pytest.importorskip("torch")
    from parcomp.check.differential import tolerance_for
    from parcomp.compile.compiler import compile_graph
    from parcomp_backends.torch.emit import emit_program
    from parcomp_backends.torch.launch import run_torchrun

    train = f"{OPT} precision=bf16 zero=1 accumulate=2"
    c = compile_graph(chain_graph(blocks=4, batch=8), spec(f"mesh dp=2 pp=2\n{train}\n"))
    text = emit_program(c)
    assert "reduce_scatter(t, dim, \"dp\")" in text and 'all_gather(' in text
    (tmp_path / "program.py").write_text(text)
    _, feeds, _ = reference(chain_graph(blocks=4, batch=16), f"{OPT} precision=bf16")
    ck = {k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items()
          if k in dict(_models().mlp_chain(blocks=4, hidden=4)[0].named_parameters())}
    inp = {k: torch.from_numpy(np.asarray(feeds[k])) for k in ("x", "target")}
    res = run_torchrun(tmp_path, 4, ck, inp, str(tmp_path / "out.pt"), ("--steps", "3"), timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    got = {}
    for s in range(2):
        got.update({k: v.float().numpy() for k, v in torch.load(str(tmp_path / f"out.pt.stage{s}")).items()})
    want, losses = _torch_steps(feeds, 3, 8, 0.05)
    rtol = tolerance_for("bfloat16")
    assert_all_equivalent({"losses": got["losses"], **{k: got[k] for k in want}},
                          {"losses": losses, **want}, rtol=rtol)
    assert got["0.weight.exp_avg"].shape == want["0.weight"].shape  # gathered whole for the file
    moved = {k: v for k, v in want.items() if not np.allclose(v, ck[k].numpy(), rtol=rtol, atol=0)}
    assert moved  # the steps changed the params beyond the tolerance (the check has power)
