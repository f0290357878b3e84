"""``--save-every N`` and ``--log-every N`` of a pipelined program.py (dp=2 x pp=2 with zero=1 on
4 gloo ranks: the Adam moments saved as DTensors split over dp): a run killed after step 3's
checkpoint of 6 steps, resumed for the 3 steps left, ends bit for bit where the run that was not
killed ends."""
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parcomp.compile.compiler import compile_graph  # noqa: E402
from parcomp_backends.torch.emit import emit_program  # noqa: E402
from parcomp_backends.torch.launch import run_torchrun  # noqa: E402

from graphs import spec  # noqa: E402
from test_pipeline import chain_graph, reference  # noqa: E402

TRAIN = "train optimizer=adamw(lr=0.01) input_grads=no microbatches=2 schedule=1f1b zero=1"

# a launcher whose rank 0 dies (exit 9, as a killed process) once DIR/latest names step KILL_AT
KILLED = """\
import os, runpy, sys
real = os.replace
def replace(src, dst, *args, **kw):
    real(src, dst, *args, **kw)
    if os.path.basename(dst) == "latest" and open(dst).read().strip() == "step-" + os.environ["KILL_AT"]:
        os._exit(9)
os.replace = replace
sys.argv[0] = "program.py"
runpy.run_path("program.py", run_name="__main__")
"""


@pytest.mark.slow
def test_a_run_killed_after_step_3_of_6_resumes_to_the_same_end(tmp_path):
    g = chain_graph(blocks=4)
    (tmp_path / "program.py").write_text(emit_program(compile_graph(g, spec(f"mesh dp=2 pp=2\n{TRAIN}\n"))))
    (tmp_path / "killed.py").write_text(KILLED)
    ref, feeds, _ = reference(g, TRAIN.replace(" zero=1", ""))
    torch.save({k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items() if ref[k].op == "param"},
               tmp_path / "model.pt")
    torch.save({k: torch.from_numpy(np.asarray(feeds[k])) for k in ("x", "target")}, tmp_path / "inputs.pt")

    def run(out, *extra, program="program.py", env=None):
        return run_torchrun(tmp_path, 4, str(tmp_path / "model.pt"), str(tmp_path / "inputs.pt"), str(out),
                            extra, timeout=300, program=program, env=env)

    whole = run(tmp_path / "whole.pt", "--steps", "6", "--log-every", "4")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert re.findall(r"step (\d+) loss", whole.stdout) == ["4", "6"]  # every 4th and the last, once
    save = tmp_path / "ckpt"
    killed = run(tmp_path / "killed.pt", "--steps", "6", "--save", str(save), "--save-every", "3",
                 program="killed.py", env={"KILL_AT": "3"})
    assert killed.returncode != 0
    assert (save / "latest").read_text().strip() == "step-3" and not (save / "step-6").exists()
    assert not (tmp_path / "killed.pt.stage0").exists()  # it died before its last step
    resumed = run(tmp_path / "resumed.pt", "--steps", "3", "--resume", str(save), "--save", str(save))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.findall(r"step (\d+) loss", resumed.stdout) == ["4", "5", "6"]
    assert (save / "latest").read_text().strip() == "step-6"
    for s in range(2):
        want = torch.load(str(tmp_path / f"whole.pt.stage{s}"))
        got = torch.load(str(tmp_path / f"resumed.pt.stage{s}"))
        assert sorted(got) == sorted(want)
        for k in want:
            w = want[k][3:] if k == "losses" else want[k]
            assert torch.equal(got[k], w), k
        assert "0.weight.exp_avg" in got or "11.weight.exp_avg" in got
