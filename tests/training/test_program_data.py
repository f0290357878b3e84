"""program.py --data MODULE:FUNCTION: each rank reads only its dp share of each step's batch from
a dataset, one step's batch at a time, and trains as on the whole batch from --input."""
import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "api"))
from api_workers import MLP_DP_TP, _batches, small_mlp  # noqa: E402
from gloo_ranks import free_port  # noqa: E402

TRAIN = "train loss=mse optimizer=adamw(lr=1e-2, weight_decay=0.1)\n"
STEPS = 3

DATA = '''
import os
import sys

import torch

sys.path.insert(0, {api!r})
from api_workers import _batches

BATCHES = _batches({steps})
X = torch.cat([x for x, _ in BATCHES])
T = torch.cat([t for _, t in BATCHES])


def log(i):
    with open(os.environ["DATA_LOG"] + "." + os.environ["RANK"], "a") as f:
        f.write(f"{{i}}\\n")


class Samples:
    """Map-style: sample i of every step's batches, put end to end; logs every read."""

    def __len__(self):
        return len(X)

    def __getitem__(self, i):
        log(i)
        return {{"input": X[i], "target": T[i]}}


def dataset():
    return Samples()


def shards(shard, num_shards):
    """An iterable of shard ``shard``'s samples alone (the rows of each step's batch it holds)."""
    per = len(BATCHES[0][0]) // num_shards
    for k in range(len(BATCHES)):
        for j in range(per):
            i = k * len(BATCHES[0][0]) + shard * per + j
            log(i)
            yield (T[i], X[i])  # INPUTS order: target, input
'''


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    from parcomp.api.specs import resolve_spec
    from parcomp.compile.compiler import compile_graph
    from parcomp.frontends.torch.export import import_torch
    from parcomp_backends.torch import emit_program

    d = tmp_path_factory.mktemp("data")
    model, batches = small_mlp(), _batches(STEPS)
    graph = import_torch(model, (batches[0][0],))
    compiled = compile_graph(graph, resolve_spec(MLP_DP_TP + TRAIN, model, graph))
    (d / "program.py").write_text(emit_program(compiled, "cpu", model="small_mlp"))
    torch.save(model.state_dict(), d / "model.pt")
    (d / "data.py").write_text(textwrap.dedent(DATA.format(api=str(ROOT / "tests" / "api"), steps=STEPS)))
    ref, losses = copy.deepcopy(model), []
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for x, t in batches:
        loss = nn.functional.mse_loss(ref(x), t)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return d, losses


def _run(d, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DATA_LOG": str(d / "log"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()),
           "program.py", "--checkpoint", "model.pt", "--steps", str(STEPS), *args]
    return subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("function", ["dataset", "shards"])
def test_each_rank_reads_only_its_share_and_trains_as_the_unsharded_loop(program, function):
    """dp=2 x tp=2, a global batch of 4: the ranks of dp coordinate 0 (ranks 0, 1) read samples
    0-1 of each step's batch, those of coordinate 1 (ranks 2, 3) samples 2-3; the losses equal
    torch's unsharded AdamW loop."""
    d, want = program
    for f in d.glob("log.*"):
        f.unlink()
    out = _run(d, "--data", f"data.py:{function}", "--output", f"out_{function}.pt")
    assert out.returncode == 0, out.stderr[-3000:]
    reads = {r: [int(i) for i in (d / f"log.{r}").read_text().split()] for r in range(4)}
    first, second = [0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]
    assert reads == {0: first, 1: first, 2: second, 3: second}, reads
    losses = torch.load(d / f"out_{function}.rank0.pt")["losses"]  # every rank writes its own file
    assert max(abs(a - b) for a, b in zip(losses, want)) <= 1e-5 * max(want), (losses, want)


@pytest.mark.slow
def test_data_errors_are_clear(program):
    """A --data naming no function: every rank exits 2 with the message (torchrun then exits 1)."""
    d, _ = program
    out = _run(d, "--data", "data.py:nothing")
    assert out.returncode != 0 and "--data data.py:nothing: data.py has no function nothing" in out.stderr, \
        out.stderr[-2000:]
