"""The SPMD training program's ``--data``, ``--replay`` and stop on SIGTERM in a pipelined
program.py under torchrun on gloo: a dataset read per stage and dp share trains as the same
batches on the unsharded step; each replayed step starts from its state; a SIGTERM saves the
step all ranks agree on, and a resumed run ends bit-equal to the run never stopped."""
import re
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parcomp.compile.compiler import compile_graph  # noqa: E402
from parcomp.reference.numpy_ops import run_unsharded  # noqa: E402
from parcomp_backends.torch.emit import emit_program  # noqa: E402
from parcomp_backends.torch.launch import run_torchrun  # noqa: E402

from graphs import spec  # noqa: E402
from numerics import assert_all_equivalent  # noqa: E402
from test_pipeline import TRAIN, chain_graph, reference  # noqa: E402

SCHEDULE = " microbatches=2 schedule=1f1b"

# step k's global batch is samples (k-1)*8 .. k*8-1 of X and T (data.npz); every read is logged
DATA = '''
import os

import numpy as np
import torch

FILE = np.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), "data.npz"))
X, T = torch.from_numpy(FILE["x"]), torch.from_numpy(FILE["target"])


def log(i):
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "read." + os.environ["RANK"]), "a") as f:
        f.write(f"{i}\\n")


class Samples:
    def __len__(self):
        return len(X)

    def __getitem__(self, i):
        log(i)
        return {"x": X[i], "target": T[i]}


def dataset():
    return Samples()


def shards(shard, num_shards):
    """Shard ``shard``'s rows of every step's batch of 8, in order (a tuple in INPUTS order)."""
    per = 8 // num_shards
    for k in range(len(X) // 8):
        for j in range(per):
            i = k * 8 + shard * per + j
            log(i)
            yield (T[i], X[i])
'''


def _program(d, g, head, train=TRAIN):
    d.mkdir()
    (d / "program.py").write_text(emit_program(compile_graph(g, spec(f"{head}{train}{SCHEDULE}\n"))))
    return d


def _stages(path):
    """Every stage file's outputs of ``path`` (OUT.stage0, OUT.stage1) in one dict of arrays."""
    got = {}
    for s in range(2):
        got.update({k: v.numpy() for k, v in torch.load(f"{path}.stage{s}").items()})
    return got


def _two_steps(ref, feeds, batches):
    """The unsharded step run twice, step k on ``batches[k-1]``: the outputs of each."""
    outs, state = [], dict(feeds)
    for x, t in batches:
        outs.append(run_unsharded(ref, {**state, "x": x, "target": t}))
        state.update({k: outs[-1][k] for k in state if k in outs[-1]})
    return outs


@pytest.mark.slow
def test_data_on_pp2_and_dp2_pp2_trains_as_the_unsharded_step_on_the_same_batches(tmp_path):
    g = chain_graph(blocks=2)
    ref, feeds, _ = reference(g)
    rng = np.random.default_rng(3)
    x, t = (rng.standard_normal((16, 8, 4)).astype("float32") * 0.5 for _ in range(2))
    want = _two_steps(ref, feeds, [(x[:8], t[:8]), (x[8:], t[8:])])
    ck = {k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items() if ref[k].op == "param"}
    for head, nproc, source in (("mesh pp=2\n", 2, "dataset"), ("mesh dp=2 pp=2\n", 4, "shards")):
        d = _program(tmp_path / source, g, head)
        np.savez(d / "data.npz", x=x, target=t)
        (d / "data.py").write_text(DATA)
        res = run_torchrun(d, nproc, ck, None, str(d / "out.pt"), ("--data", f"data.py:{source}", "--steps", "2"),
                           timeout=300)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
        got = _stages(d / "out.pt")
        assert_all_equivalent(got, want[1])
        assert_all_equivalent({"losses": got["losses"]}, {"losses": np.array([want[0]["loss"], want[1]["loss"]])})
        reads = [sorted(int(i) for i in (d / f"read.{r}").read_text().split()) for r in range(nproc)]
        if nproc == 2:  # every rank (one per stage) reads each step's 8 samples once
            assert reads == [list(range(16))] * 2
        else:  # each rank reads only its dp share (rows 0-3 or 4-7 of each step's 8), once
            shares = [[k * 8 + s * 4 + j for k in range(2) for j in range(4)] for s in range(2)]
            assert sorted(reads) == sorted(shares * 2), reads


@pytest.mark.slow
def test_replay_starts_each_step_from_its_state(tmp_path):
    # a 2-step --replay from states A and B: step 1's loss is A's, and the run ends where one
    # unsharded step from B (momentum included) ends, not where a second step from A's result would
    g = chain_graph(blocks=2)
    ref, feeds, want_a = reference(g)
    _, feeds_b, after_b = reference(g, seed=1)
    state_b = {k: after_b[k] for k in feeds_b if k not in ("x", "target")}  # nonzero momentum
    want = run_unsharded(ref, {**feeds, **state_b})
    d = _program(tmp_path / "replay", g, "mesh pp=2\n")
    full = {k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items() if ref[k].op == "param"}
    torch.save([full, {**full, **{k: torch.from_numpy(np.asarray(v)) for k, v in state_b.items()}}],
               d / "replay.pt")
    inp = {k: torch.from_numpy(np.asarray(feeds[k])) for k in ("x", "target")}
    res = run_torchrun(d, 2, {k: v for k, v in full.items() if "momentum" not in k}, inp, str(d / "out.pt"),
                       ("--steps", "2", "--replay", str(d / "replay.pt")), timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    got = _stages(d / "out.pt")
    assert_all_equivalent(got, want)
    assert_all_equivalent({"loss": got["losses"][0]}, {"loss": want_a["loss"]})


# a launcher of program.py whose rank 0, in its step 2, sends SIGTERM to torchrun (which passes
# it on to every rank) and waits, at most 60 s, until its own handler has seen it
SIGNALLED = """\
import importlib.util, os, signal, sys, time
spec = importlib.util.spec_from_file_location("program", "program.py")
program = importlib.util.module_from_spec(spec)
sys.argv[0] = "program.py"
spec.loader.exec_module(program)
real, calls = program.step, []
def step(k, state, p, data, *rest):
    calls.append(1)
    if len(calls) == 2 and os.environ["RANK"] == "0":
        os.kill(os.getppid(), signal.SIGTERM)
        end = time.monotonic() + 60
        while not program.STOP["asked"] and time.monotonic() < end:
            time.sleep(0.01)
    return real(k, state, p, data, *rest)
program.step = step
try:
    program.main()
except SystemExit as e:
    program.exit_now(e.code if isinstance(e.code, int) else 1)
program.exit_now(0)
"""


@pytest.mark.slow
def test_sigterm_saves_the_agreed_step_and_a_resumed_run_ends_bit_equal(tmp_path):
    # pp=2, 6 AdamW steps with --save: every rank ends step K (2 or 3), saves it, rank 0 says how
    # to go on, each exits 143; resumed for steps K+1..6 it ends bit-equal to 6 steps never stopped
    g = chain_graph(blocks=2)
    train = "train optimizer=adamw(lr=0.01) input_grads=no"
    ref, feeds, _ = reference(g, train)
    ck = {k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items() if ref[k].op == "param"}
    inp = {k: torch.from_numpy(np.asarray(feeds[k])) for k in ("x", "target")}
    d = _program(tmp_path / "p", g, "mesh pp=2\n", train)
    (d / "signalled.py").write_text(SIGNALLED)
    ckpt = tmp_path / "ckpt"

    def run(out, *extra, program="program.py"):
        return run_torchrun(d, 2, ck, inp, str(d / out), ("--timeout", "60", *extra), timeout=300, program=program)

    res = run("stopped.pt", "--steps", "6", "--save", str(ckpt), program="signalled.py")
    text = res.stdout[-2000:] + res.stderr[-3000:]
    latest = (ckpt / "latest").read_text().strip() if (ckpt / "latest").exists() else None
    assert latest in ("step-2", "step-3"), text
    k = int(latest[5:])
    assert f"stopped by SIGTERM after step {k}: saved {ckpt / latest}; go on with --resume {ckpt}" in res.stdout, text
    assert res.returncode != 0, text
    assert f"step {k + 1} loss" not in res.stdout and not (d / "stopped.pt.stage0").exists()
    assert "program.py (rank" not in res.stderr, text  # no rank reports a failure
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", latest]
    res = run("resumed.pt", "--steps", str(6 - k), "--resume", str(ckpt))
    assert res.returncode == 0, res.stderr[-3000:]
    assert re.findall(r"step (\d+) loss", res.stdout) == [str(s) for s in range(k + 1, 7)]
    res = run("whole.pt", "--steps", "6")
    assert res.returncode == 0, res.stderr[-3000:]
    for s in range(2):
        want = torch.load(str(d / f"whole.pt.stage{s}"))
        got = torch.load(str(d / f"resumed.pt.stage{s}"))
        assert sorted(got) == sorted(want)
        for name in want:
            assert torch.equal(got[name], want[name][k:] if name == "losses" else want[name]), name


def test_inputs_are_given_by_one_of_input_and_data(tmp_path):
    # the SPMD program's argument check: exit 2 with one line, before any process group
    import os
    import subprocess
    import sys

    d = _program(tmp_path / "args", chain_graph(blocks=2), "mesh pp=2\n")
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    for extra, words in (((), "give the inputs (target, x): --input FILE.pt or --data MODULE:FUNCTION"),
                         (("--input", "i.pt", "--data", "data.py:dataset"), "--input and --data both give the inputs"),
                         (("--input", "i.pt", "--steps", "2", "--train-steps", "4"),
                          "--steps K (K more steps) and --train-steps N (until step N, resumed steps counted) both")):
        res = subprocess.run([sys.executable, "program.py", "--checkpoint", "model.pt", *extra], cwd=d, env=env,
                             text=True, capture_output=True, timeout=60)
        assert res.returncode == 2 and "Traceback" not in res.stderr and words in res.stderr, res.stderr[-2000:]


# a launcher whose rank 0 dies (exit 9, as a killed process) once DIR/latest names step-1
KILLED_AFTER_STEP_1 = """\
import os, runpy, sys
real = os.replace
def replace(src, dst, *args, **kw):
    real(src, dst, *args, **kw)
    if os.path.basename(dst) == "latest" and open(dst).read().strip() == "step-1":
        os._exit(9)
os.replace = replace
sys.argv[0] = "program.py"
runpy.run_path("program.py", run_name="__main__")
"""


@pytest.mark.slow
def test_train_steps_run_killed_and_rerun_with_the_same_command_ends_at_step_n_on_a_list_input(tmp_path):
    # --input holds one global batch per step; --train-steps 2 --save-every 1, killed after step 1's
    # save; the same command with --resume for step 2 only (on the list's 2nd batch) and ends as the
    # unsharded step run twice; a third time it has nothing left to train and exits 0
    g = chain_graph(blocks=2)
    ref, feeds, _ = reference(g)
    rng = np.random.default_rng(5)
    x, t = (rng.standard_normal((16, 8, 4)).astype("float32") * 0.5 for _ in range(2))
    want = _two_steps(ref, feeds, [(x[:8], t[:8]), (x[8:], t[8:])])
    d = _program(tmp_path / "p", g, "mesh pp=2\n")
    (d / "killed.py").write_text(KILLED_AFTER_STEP_1)
    torch.save([{"x": torch.from_numpy(x[8 * k:8 * k + 8]), "target": torch.from_numpy(t[8 * k:8 * k + 8])}
                for k in range(2)], d / "inputs.pt")
    ck = {k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items() if ref[k].op == "param"}
    save = d / "ckpt"
    command = ("--train-steps", "2", "--save", str(save), "--save-every", "1")

    def run(*resume, program="program.py"):
        return run_torchrun(d, 2, ck, str(d / "inputs.pt"), str(d / "out.pt"), command + resume, timeout=300,
                            program=program)

    killed = run(program="killed.py")
    assert killed.returncode != 0 and (save / "latest").read_text().strip() == "step-1", killed.stderr[-3000:]
    resumed = run("--resume", str(save))
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert f"resumed from {save / 'step-1'} (step 1)" in resumed.stdout
    assert re.findall(r"step (\d+) loss", resumed.stdout) == ["2"]
    assert (save / "latest").read_text().strip() == "step-2"
    got = _stages(d / "out.pt")
    assert_all_equivalent({k: v for k, v in got.items() if k != "losses"}, want[1])
    assert_all_equivalent({"losses": got["losses"]}, {"losses": np.array([want[1]["loss"]])})
    again = run("--resume", str(save))
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert "step 2 is saved, --train-steps is 2: nothing left to train" in again.stdout
    assert not re.findall(r"step (\d+) loss", again.stdout)


def _flags(d):
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "program.py", "--help"], cwd=d, text=True, capture_output=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", res.stdout))


def test_the_pipelined_program_takes_the_same_flags_as_the_spmd_program(tmp_path):
    # one runtime: every flag of the SPMD program.py is a flag of the pipelined one, and no other
    pipelined = _flags(_program(tmp_path / "pp", chain_graph(blocks=2), "mesh pp=2\n"))
    spmd = tmp_path / "spmd"
    spmd.mkdir()
    (spmd / "program.py").write_text(emit_program(compile_graph(chain_graph(blocks=2), spec(f"mesh dp=2\n{TRAIN}\n"))))
    assert "--train-steps" in pipelined and "--save-every" in pipelined
    assert pipelined == _flags(spmd)
