"""Every executed schedule under torchrun on gloo: a 4-block MLP chain
and a tiny GPT-2, pp=2 on 2 ranks and dp=2 x pp=2 x tp=2 on 8 ranks.  For each (model, mesh)
one test runs GPipe, 1F1B, ZB-H1 and interleaved 1F1B: each step equals the unsharded step
(loss, gradients, parameters, momentum) within float32's tolerance, and the four schedules'
outputs are equal bit for bit (the same sums in the same order, as the interpreter shows:
tests/pipeline/test_pipeline_zb.py).

The specs are the shipped ones, specs/mlp_chain_dp2_pp2_tp2_train.pcs and
specs/gpt2_lm_dp2_pp2_tp2_train.pcs, with ``schedule=`` swapped and ``microbatches=2``
(interleaved needs a multiple of pp; every schedule takes the same count so their sums agree):
the chain is traced with 4 blocks of width 4 at batch 8 (its stage lines and tp layouts
cut to those 4 blocks), GPT-2 at batch 4 (2 samples per dp replica) in float64 (as
tests/pipeline/test_pipeline_tied.py).  Interleaved drops the stage
lines: it balances its pp x 2 chunks itself.  The pp=2 runs keep the stage and train lines.
"""
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parcomp.compile.compiler import compile_graph  # noqa: E402
from parcomp_backends.torch.emit import emit_program  # noqa: E402
from parcomp_backends.torch.launch import run_torchrun  # noqa: E402

from graphs import spec  # noqa: E402
from numerics import assert_all_equivalent  # noqa: E402
from test_pipeline import ROOT, _models, assert_detects_a_wrong_scale, chain_graph, reference  # noqa: E402
from test_pipeline_zb import ALL, assert_same_numbers  # noqa: E402

CHAIN_STAGES = "stage 0: 0-5\nstage 1: 6-11\n"  # the shipped 0-71 / 72-143, for 4 blocks


def derived(name: str, schedule: str, mesh: str, stages=None, params=()):
    """(head, train line) of specs/``name`` with ``schedule=`` swapped and ``microbatches=2``.

    ``mesh="pp2"`` keeps only the stage and train lines under ``mesh pp=2``; ``"8"`` keeps
    every line but layout lines naming a param outside ``params`` (``()``: keep all).
    ``stages`` replaces the stage lines; interleaved drops them.
    """
    lines = [x.split("#")[0].rstrip() for x in (ROOT / "specs" / name).read_text().splitlines()]
    lines = [x for x in lines if x]
    train = next(x for x in lines if x.startswith("train "))
    train = re.sub(r"microbatches=\d+", "microbatches=2", re.sub(r"schedule=\S+", f"schedule={schedule}", train))
    stage_lines = [x for x in lines if x.startswith("stage ")] if stages is None else stages.splitlines()
    if schedule == "interleaved":
        stage_lines = []
    if mesh == "pp2":
        return "mesh pp=2\n" + "".join(f"{x}\n" for x in stage_lines), train
    keep = []
    for x in lines:
        if x.startswith(("train ", "stage ")):
            continue
        first = x.split()[0]
        if params and x.split()[1] in ("colwise", "rowwise") and first not in params:
            continue  # the shipped chain has 48 blocks
        keep.append(x)
    head = [keep[0]] + stage_lines + keep[1:]  # the mesh line first
    return "".join(f"{x}\n" for x in head), train


def _launch(tmp_path, g, head, train, nproc, feeds, ref, inputs):
    c = compile_graph(g, spec(f"{head}{train}\n"))
    name = c.program_.pipeline.schedule
    d = tmp_path / name
    d.mkdir()
    text = emit_program(c)
    assert f"schedule {name}" in text and "ACTIONS = {" in text
    (d / "program.py").write_text(text)
    ck = {k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items() if ref[k].op == "param"}
    inp = {k: torch.from_numpy(np.asarray(feeds[k])) for k in inputs}
    res = run_torchrun(d, nproc, ck, inp, str(d / "out.pt"), timeout=300)
    assert res.returncode == 0, f"{name}: {res.stderr[-3000:]}"
    got, files = {}, {}
    for s in range(len(c.program_.pipeline.stages)):  # one file per (virtual) stage
        files[s] = torch.load(str(d / f"out.pt.stage{s}"))
        got.update({k: v.numpy() for k, v in files[s].items()})
    return got, text, files


MESHES = [("pp2", 2), ("8", 8)]


def schedules(mesh):
    """Every schedule on the 2-rank mesh; on the 8-rank dp x pp x tp mesh the two that large runs
    use (1F1B and interleaved): the other two differ from 1F1B only in the order of the same
    stage programs, which the 2-rank runs already compare, and eight ranks cost ~25 s a schedule."""
    return ALL if mesh == "pp2" else ("1f1b", "interleaved")


@pytest.mark.slow
@pytest.mark.parametrize("mesh,nproc", MESHES)
def test_mlp_chain_every_schedule_equals_the_unsharded_step_and_each_other(tmp_path, mesh, nproc):
    g = chain_graph(blocks=4)
    params = {f"{3 * k + j}.weight" for k in range(4) for j in (0, 2)}
    outs = {}
    for name in schedules(mesh):
        head, train = derived("mlp_chain_dp2_pp2_tp2_train.pcs", name, mesh, CHAIN_STAGES, params)
        ref, feeds, want = reference(g, train)
        got, text, _ = _launch(tmp_path, g, head, train, nproc, feeds, ref, ("x", "target"))
        assert_all_equivalent(got, want)
        assert_detects_a_wrong_scale(got, want)
        outs[name] = got
        if name == "zb-h1":  # the weight-gradient half of backward is its own action
            assert "BACKWARD_WEIGHT = {0: stage0_backward_weight, 1: stage1_backward_weight}" in text
            assert "('backward_weight', 0, None, 1)," in text
        if name == "interleaved":
            assert "STAGES = {0: [0, 2], 1: [1, 3]}" in text and "('forward', 0, None, 2)," in text
    assert_same_numbers(outs)


def gpt2_64_batch4():
    """specs/models.py:gpt2_lm traced at batch 4 (dp=2 x 2 microbatches), in float64."""
    from parcomp.check.check64 import promote_graph
    from parcomp.frontends.torch.export import import_torch

    module, args, names = _models().gpt2_lm(batch=4)
    return promote_graph(import_torch(module, args, names))


@pytest.mark.slow
@pytest.mark.parametrize("mesh,nproc", MESHES)
def test_gpt2_every_schedule_equals_the_unsharded_step_and_each_other(tmp_path, mesh, nproc):
    """The tied LM head: its two copies' gradients are summed over exactly the ranks holding
    them (stages 0 and 1; chunks 0 and 3 under interleaving), and both take the same update."""
    pytest.importorskip("transformers")
    from test_pipeline_tied import lm_pipelined

    g = gpt2_64_batch4()
    outs = {}
    for name in schedules(mesh):
        head, train = derived("gpt2_lm_dp2_pp2_tp2_train.pcs", name, mesh)
        _, want, plan, ref, feeds = lm_pipelined(g, head, train)
        assert plan.tied == (("lm_head.weight", (0, 3 if name == "interleaved" else 1)),)
        got, text, files = _launch(tmp_path, g, head, train, nproc, feeds, ref, ("input_ids", "labels"))
        assert ("TIED_SETS = [[[0, 1]]]" if mesh == "pp2" else
                "TIED_SETS = [[[0, 2], [1, 3], [4, 6], [5, 7]]]") in text
        assert_all_equivalent(got, want)
        assert_detects_a_wrong_scale(got, want)
        assert torch.equal(files[0]["lm_head.weight"], torch.from_numpy(got["lm_head.weight"]))
        outs[name] = got
    # ZB-H1's halves take a LayerNorm's dx and its weight and bias gradients from torch's fused
    # kernel on the forward's mean and rstd, as the other schedules' backward does: same bits
    assert_same_numbers(outs)
