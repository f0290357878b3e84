"""The cluster runtime of a pipelined program.py (pp=2 on 2 gloo ranks): ``--timeout`` bounds
every wait, so a rank that hung or left makes the other fail naming it instead of hanging;
``--save`` / ``--resume`` write and read a torch.distributed.checkpoint per stage, and 2 steps +
save, then 1 resumed step, equal 3 uninterrupted steps exactly."""
import json
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parcomp.compile.compiler import compile_graph  # noqa: E402
from parcomp_backends.torch.emit import emit_program  # noqa: E402
from parcomp_backends.torch.launch import run_torchrun  # noqa: E402

from graphs import spec  # noqa: E402
from test_pipeline import chain_graph, reference  # noqa: E402

ADAMW = "train optimizer=adamw(lr=0.01) input_grads=no microbatches=2 schedule=1f1b"

# a launcher that runs program.py with rank 1 hanging (or leaving with exit 0, which torchrun
# does not count as a failure) at its first point-to-point slot
FAULTY = """\
import os, runpy, sys, time
import torch.distributed as dist
def faulty(*args, **kw):
    if os.environ["MODE"] == "exit":
        os._exit(0)
    time.sleep(600)
if os.environ["RANK"] == "1":
    dist.batch_isend_irecv = faulty
sys.argv[0] = "program.py"
runpy.run_path("program.py", run_name="__main__")
"""


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    """(directory holding program.py, checkpoint, inputs) of a 4-block chain on pp=2, AdamW."""
    g = chain_graph(blocks=4)
    d = tmp_path_factory.mktemp("pp2")
    (d / "program.py").write_text(emit_program(compile_graph(g, spec(f"mesh pp=2\n{ADAMW}\n"))))
    ref, feeds, _ = reference(g, ADAMW)
    ck = {k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items() if ref[k].op == "param"}
    inp = {k: torch.from_numpy(np.asarray(feeds[k])) for k in ("x", "target")}
    torch.save(ck, d / "model.pt")
    torch.save(inp, d / "inputs.pt")
    return d


def _run(d, out, *extra, program="program.py", env=None, ok=True):
    res = run_torchrun(d, 2, str(d / "model.pt"), str(d / "inputs.pt"), str(out), extra, timeout=240,
                       program=program, env=env)
    assert (res.returncode == 0) == ok, res.stdout[-2000:] + res.stderr[-4000:]
    return res


def _outputs(out):
    got = {}
    for s in range(2):
        got.update(torch.load(f"{out}.stage{s}"))
    return got


@pytest.mark.parametrize("mode", ["hang", "exit"])
def test_a_rank_that_hangs_or_leaves_stops_the_other_naming_it(program, tmp_path, mode):
    """Rank 1 hangs (sleeps 600 s) or exits 0 at its first point-to-point slot: rank 0's wait
    for it ends by --timeout 3 s (its message says so; without the timeout the launcher's own
    240 s limit kills the run and the test fails), it exits 2 naming the slot and rank 1, and
    torchrun stops rank 1."""
    (program / "faulty.py").write_text(FAULTY)
    res = _run(program, tmp_path / "out.pt", "--timeout", "3", program="faulty.py", env={"MODE": mode}, ok=False)
    line = next(x for x in res.stderr.splitlines() if "program.py (rank 0): error:" in x)
    # rank 0 waits in the slot that sends to rank 1 and receives its gradient
    assert re.search(r"step 1: send_fwd of microbatch \d for stage 0 to rank 1(, recv_bwd of microbatch \d "
                     r"for stage 0 from rank 1)?: rank 1 \(on [^)]*\) stopped answering", line), line
    assert "each collective waits at most --timeout 3 s" in line
    assert "Traceback" not in res.stderr.split("program.py (rank 0): error:")[0][-2000:]


def test_timeout_is_checked_by_argparse(program, tmp_path):
    res = _run(program, tmp_path / "out.pt", "--timeout", "-1", ok=False)
    assert res.returncode != 0 and "argument --timeout: -1: give a number of seconds" in res.stderr


def test_two_steps_saved_then_one_resumed_equal_three_steps(program, tmp_path):
    """AdamW (its step counter, moments) on pp=2: 2 steps + --save, then --resume and 1 step,
    give bit for bit the params, optimizer state, gradients and loss of 3 uninterrupted steps."""
    ck = tmp_path / "ck"
    _run(program, tmp_path / "three.pt", "--steps", "3")
    three = _outputs(tmp_path / "three.pt")
    res = _run(program, tmp_path / "two.pt", "--steps", "2", "--save", str(ck))
    assert "saved step 2 to" in res.stdout and (ck / "latest").read_text() == "step-2\n"
    table = json.loads((ck / "step-2" / "stages.json").read_text())
    assert [(s["stage"], s["ranks"]) for s in table["stages"]] == [(0, [0]), (1, [1])]
    assert table["step"] == 2 and "0.weight.exp_avg" in table["stages"][0]["values"]
    _run(program, tmp_path / "resumed.pt", "--steps", "1", "--resume", str(ck))
    resumed, two = _outputs(tmp_path / "resumed.pt"), _outputs(tmp_path / "two.pt")
    keys = sorted(k for k in three if k != "losses")
    assert sorted(k for k in resumed if k != "losses") == keys and len(keys) > 10
    for k in keys:
        assert torch.equal(resumed[k], three[k]), k
    assert torch.equal(resumed["losses"], three["losses"][2:])
    assert not torch.equal(two["0.weight"], three["0.weight"])


def test_save_refuses_a_step_that_exists(program, tmp_path):
    """A second save of step 2 into the same directory exits 2 before training."""
    ck = tmp_path / "ck"
    _run(program, tmp_path / "a.pt", "--steps", "2", "--save", str(ck))
    res = _run(program, tmp_path / "b.pt", "--steps", "2", "--save", str(ck), ok=False)
    assert "step-2 exists; parcomp's program never replaces a checkpoint" in res.stderr
    res = _run(program, tmp_path / "c.pt", "--resume", str(tmp_path / "none"), ok=False)
    assert "no checkpoint there" in res.stderr


TP_LAYOUTS = "".join(f"{3 * k}.weight colwise\n{3 * k + 2}.weight rowwise\n" for k in range(4))


def test_tp_inside_stages_saves_full_tensors_and_resumes_exactly(tmp_path):
    """pp=2 x tp=2 on 4 ranks: each tp rank saves its block (a DTensor of the full shape); the
    checkpoint read whole by torch equals the whole outputs of the 2 steps, and 1 resumed step
    equals 3 uninterrupted steps bit for bit."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    g = chain_graph(blocks=4)
    d = tmp_path / "pp2tp2"
    d.mkdir()
    compiled = compile_graph(g, spec(f"mesh pp=2 tp=2\n{TP_LAYOUTS}{ADAMW}\n"))
    (d / "program.py").write_text(emit_program(compiled))
    ref, feeds, _ = reference(g, ADAMW)
    torch.save({k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items() if ref[k].op == "param"}, d / "model.pt")
    torch.save({k: torch.from_numpy(np.asarray(feeds[k])) for k in ("x", "target")}, d / "inputs.pt")

    def run(out, *extra):
        res = run_torchrun(d, 4, str(d / "model.pt"), str(d / "inputs.pt"), str(tmp_path / out), extra,
                           timeout=300)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
        return _outputs(tmp_path / out)

    ck = tmp_path / "ck"
    three, two = run("three.pt", "--steps", "3"), run("two.pt", "--steps", "2", "--save", str(ck))
    table = json.loads((ck / "step-2" / "stages.json").read_text())
    assert [(s["stage"], s["ranks"]) for s in table["stages"]] == [(0, [0, 1]), (1, [2, 3])]
    dcp_to_torch_save(str(ck / "step-2"), str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt")
    saved = sorted(k for k in full if k != "step")
    assert int(full["step"]) == 2 and len(saved) == 48 and "0.weight.exp_avg" in saved  # 16 params, 2 moments each
    for k in saved:
        assert torch.equal(full[k], two[k]), k
    # parcomp export reads the pipelined checkpoint as the SPMD program's: every param, whole
    from safetensors.torch import load_file

    from parcomp.cli.export import export_pretrained
    from test_pipeline import _models

    export_pretrained(compiled, str(ck), str(tmp_path / "export"), _models().mlp_chain(blocks=4, hidden=4)[0])
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert sorted(exported) == sorted(k for k in saved if not k.endswith(("exp_avg", "exp_avg_sq"))) and len(exported) == 16
    for k in exported:
        assert torch.equal(exported[k], full[k]), k
    resumed = run("resumed.pt", "--steps", "1", "--resume", str(ck))
    for k in sorted(k for k in three if k != "losses"):
        assert torch.equal(resumed[k], three[k]), k
