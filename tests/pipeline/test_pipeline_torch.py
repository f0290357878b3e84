"""The pipelined program.py under torchrun on gloo: one training step equals the unsharded
step (loss, gradients, parameters, momentum) with dp=2 x pp=2, and ``parcomp run`` launches it.
Every schedule on pp=2 and dp=2 x pp=2 x tp=2, for the MLP chain and GPT-2, is
tests/pipeline/test_pipeline_schedules_torch.py."""
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parcomp.compile.compiler import compile_graph  # noqa: E402
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
    ref, feeds, want = reference(g)
    ck = {k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items() if ref[k].op == "param"}
    inp = {k: torch.from_numpy(np.asarray(feeds[k])) for k in ("x", "target")}
    res = run_torchrun(d, nproc, ck, inp, str(d / "out.pt"), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = {}
    for s in range(2):
        got.update({k: v.numpy() for k, v in torch.load(str(d / f"out.pt.stage{s}")).items()})
    assert_all_equivalent(got, want)
    assert_detects_a_wrong_scale(got, want)
    return got


def test_dp2_pp2_on_four_gloo_ranks_equals_the_unsharded_step(tmp_path):
    _run(tmp_path, chain_graph(blocks=4), "mesh dp=2 pp=2\n", 4, "1f1b")


def test_cli_run_launches_the_pipelined_step(tmp_path, capsys):
    from parcomp.cli.main import main

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
    # the kept inputs.pt holds the batch only (program.py feeds AdamW's step number itself)
    assert sorted(torch.load(tmp_path / "work" / "inputs.pt")) == ["target", "x"]
