"""The pipelined program.py under torchrun on gloo: one training step equals the unsharded
step (loss, gradients, parameters, momentum) for GPipe and 1F1B, and with dp=2 x pp=2."""
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parcomp.compiler import compile_graph  # noqa: E402
from parcomp_backends.torch.emit import emit_program  # noqa: E402
from parcomp_backends.torch.launch import run_torchrun  # noqa: E402

from graphs import spec  # noqa: E402
from numerics import assert_all_equivalent  # noqa: E402
from test_pipeline import TRAIN, assert_detects_a_wrong_scale, chain_graph, reference  # noqa: E402


def _run(tmp_path, g, head, nproc, name):
    c = compile_graph(g, spec(f"{head}{TRAIN} microbatches=2 schedule={name}\n"))
    d = tmp_path / name
    d.mkdir()
    text = emit_program(c)
    assert "ACTIONS = {" in text and f"schedule {name}" in text
    (d / "program.py").write_text(text)
    ref, feeds, want, bounds = reference(g)
    ck = {k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items() if ref[k].op == "param"}
    inp = {k: torch.from_numpy(np.asarray(feeds[k])) for k in ("x", "target")}
    res = run_torchrun(d, nproc, ck, inp, str(d / "out.pt"), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = {}
    for s in range(2):
        got.update({k: v.numpy() for k, v in torch.load(str(d / f"out.pt.stage{s}")).items()})
    assert_all_equivalent(got, want, bounds)
    assert_detects_a_wrong_scale(got, want, bounds)
    return got


def test_pp2_gpipe_and_1f1b_on_two_gloo_ranks_equal_the_unsharded_step(tmp_path):
    g = chain_graph(blocks=4)
    a = _run(tmp_path, g, "mesh pp=2\nstage 0: 0-5\nstage 1: 6-11\n", 2, "gpipe")
    b = _run(tmp_path, g, "mesh pp=2\nstage 0: 0-5\nstage 1: 6-11\n", 2, "1f1b")
    assert sorted(a) == sorted(b)


def test_dp2_pp2_on_four_gloo_ranks_equals_the_unsharded_step(tmp_path):
    _run(tmp_path, chain_graph(blocks=4), "mesh dp=2 pp=2\n", 4, "1f1b")


TP_LAYOUTS = "".join(f"{3 * k}.weight colwise\n{3 * k + 2}.weight rowwise\n" for k in range(4))


def test_dp2_pp2_tp2_on_eight_gloo_ranks_equals_the_unsharded_step_for_every_schedule(tmp_path):
    """The only 8-rank test: Megatron tp inside each stage, both schedules, same numbers."""
    head = f"mesh dp=2 pp=2 tp=2\ntopology nodes=2 devices_per_node=4\n{TP_LAYOUTS}"
    g = chain_graph(blocks=4)
    a = _run(tmp_path, g, head, 8, "gpipe")
    b = _run(tmp_path, g, head, 8, "1f1b")
    assert sorted(a) == sorted(b)
    for k in a:  # the same sums in the same order on every rank: the schedules agree exactly
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_cli_run_launches_the_pipelined_step(tmp_path, capsys):
    from parcomp.cli import main

    from graphs import mlp_text

    (tmp_path / "m.pcir").write_text(mlp_text((8,), [4, 8, 8, 4], [True] * 3, ["relu", "tanh", "none"]))
    (tmp_path / "s.pcs").write_text(f"mesh pp=2\n{TRAIN} microbatches=2 schedule=1f1b\n")
    rc = main(["run", str(tmp_path / "m.pcir"), "--spec", str(tmp_path / "s.pcs"), "--nproc", "2",
               "--keep", str(tmp_path / "work")])
    out = capsys.readouterr().out
    assert rc == 0, out
    line = next(x for x in out.splitlines() if "1 pipelined step " in x)
    assert "2 gloo ranks" in line and "1f1b" in line and line.endswith("OK")
    assert "ACTIONS = {" in (tmp_path / "work" / "program.py").read_text()
    assert (tmp_path / "work" / "outputs.pt.stage1").exists()
    # the stages' outputs are run files parcomp wrote: a second run into --keep replaces them;
    # --steps 3: free-running steps (AdamW's counter 1, 2, 3) against the unsharded trajectory
    (tmp_path / "s.pcs").write_text("mesh pp=2\ntrain optimizer=adamw(lr=0.01) input_grads=no "
                                    "microbatches=2 schedule=gpipe\n")
    assert main(["run", str(tmp_path / "m.pcir"), "--spec", str(tmp_path / "s.pcs"), "--nproc", "2",
                 "--keep", str(tmp_path / "work"), "--steps", "3", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["ok"] and len(res["losses"]) == 3 and res["losses"][2] < res["losses"][0]


def test_gpt2_pp2_tied_embedding_under_torchrun_equals_the_unsharded_step(tmp_path):
    """program.py sums the tied weight's gradient over stages 0 and 1 (a group of exactly
    those ranks). In float64 (the model promoted, parcomp/check64.py): float32 transformer
    bounds overflow and could not tell a missing contribution from rounding."""
    pytest.importorskip("transformers")
    from test_pipeline_tied import STAGES, TRAIN as LM_TRAIN, gpt2_64, lm_pipelined

    g = gpt2_64()
    train = f"{LM_TRAIN} microbatches=2 schedule=1f1b"
    c = compile_graph(g, spec(f"mesh pp=2\n{STAGES}{train}\n"))
    text = emit_program(c)
    assert "TIED_SETS = [[[0, 1]]]" in text
    (tmp_path / "program.py").write_text(text)
    _, want, bounds, _, ref, feeds = lm_pipelined(g, f"mesh pp=2\n{STAGES}", train)
    ck = {k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items() if ref[k].op == "param"}
    inp = {k: torch.from_numpy(np.asarray(feeds[k])) for k in ("input_ids", "labels")}
    res = run_torchrun(tmp_path, 2, ck, inp, str(tmp_path / "out.pt"), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = {}
    for s in range(2):
        got.update({k: v.numpy() for k, v in torch.load(str(tmp_path / f"out.pt.stage{s}")).items()})
    assert_all_equivalent(got, want, bounds)
    stage0 = torch.load(str(tmp_path / "out.pt.stage0"))  # both copies took the same update
    assert torch.equal(stage0["lm_head.weight"], torch.from_numpy(got["lm_head.weight"]))
