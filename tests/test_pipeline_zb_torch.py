"""ZB-H1 and interleaved 1F1B in program.py under torchrun on gloo (issue 10): one training
step equals the unsharded step (loss, gradients, parameters, momentum), and the new schedules
give the same numbers.  pp=2 on 2 ranks for each, dp=2 x pp=2 x tp=2 on 8 ranks for ZB-H1
(the 8-rank GPipe / 1F1B run is tests/test_pipeline_torch.py), and a tiny GPT-2 whose tied
embedding sits on chunk 0 of rank 0 and chunk 3 of rank 1 under interleaving."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parcomp.compiler import compile_graph  # noqa: E402
from parcomp_backends.torch.emit import emit_program  # noqa: E402
from parcomp_backends.torch.launch import run_torchrun  # noqa: E402

from graphs import spec  # noqa: E402
from numerics import assert_all_equivalent  # noqa: E402
from test_pipeline import TRAIN, assert_detects_a_wrong_scale, chain_graph, reference  # noqa: E402
from test_pipeline_zb import STAGED, assert_same_numbers  # noqa: E402


def _launch(tmp_path, c, ref, feeds, nproc, inputs):
    d = tmp_path / c.program_.pipeline.schedule
    d.mkdir()
    (d / "program.py").write_text(emit_program(c))
    ck = {k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items() if ref[k].op == "param"}
    inp = {k: torch.from_numpy(np.asarray(feeds[k])) for k in inputs}
    res = run_torchrun(d, nproc, ck, inp, str(d / "out.pt"), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = {}
    for s in range(len(c.program_.pipeline.stages)):  # one file per (virtual) stage
        got.update({k: v.numpy() for k, v in torch.load(str(d / f"out.pt.stage{s}")).items()})
    return got, (d / "program.py").read_text()


def _run(tmp_path, head, nproc, name):
    g = chain_graph(blocks=4)
    c = compile_graph(g, spec(f"{head}{TRAIN} microbatches=2 schedule={name}\n"))
    ref, feeds, want, bounds = reference(g)
    got, text = _launch(tmp_path, c, ref, feeds, nproc, ("x", "target"))
    assert f"schedule {name}" in text
    assert_all_equivalent(got, want, bounds)
    assert_detects_a_wrong_scale(got, want, bounds)
    return got, text


def test_pp2_zb_h1_and_interleaved_on_two_gloo_ranks_equal_the_unsharded_step(tmp_path):
    zb, text = _run(tmp_path, f"mesh pp=2\n{STAGED}", 2, "zb-h1")
    assert "def stage1_backward_weight(p, inp):" in text and "('backward_weight', 0, None, 1)," in text
    il, text = _run(tmp_path, "mesh pp=2\n", 2, "interleaved")
    assert "STAGES = {0: [0, 2], 1: [1, 3]}" in text and "('forward', 0, None, 2)," in text
    assert_same_numbers({"zb-h1": zb, "interleaved": il})


def test_dp2_pp2_tp2_zb_h1_on_eight_gloo_ranks_equals_the_unsharded_step(tmp_path):
    from test_pipeline_tp import HEAD

    got, text = _run(tmp_path, HEAD, 8, "zb-h1")
    assert "BACKWARD_WEIGHT = {0: stage0_backward_weight, 1: stage1_backward_weight}" in text


def test_gpt2_interleaved_tied_embedding_under_torchrun_equals_the_unsharded_step(tmp_path):
    """Chunks 0 and 3 hold the tied weight: its gradient is summed over ranks {0, 1}. In
    float64, as tests/test_pipeline_torch.py's GPT-2 run (float32 bounds overflow)."""
    pytest.importorskip("transformers")
    from test_pipeline_tied import TRAIN as LM_TRAIN, gpt2_64, lm_pipelined

    g = gpt2_64()
    train = f"{LM_TRAIN} microbatches=2 schedule=interleaved"
    c = compile_graph(g, spec(f"mesh pp=2\n{train}\n"))
    _, want, bounds, plan, ref, feeds = lm_pipelined(g, "mesh pp=2\n", train)
    assert plan.tied == (("lm_head.weight", (0, 3)),)
    got, text = _launch(tmp_path, c, ref, feeds, 2, ("input_ids", "labels"))
    assert "TIED_SETS = [[[0, 1]]]" in text
    assert_all_equivalent(got, want, bounds)
