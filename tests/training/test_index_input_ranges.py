"""Token ids and labels outside the table they index: torch raises (IndexError, "Target out of
bounds"); program.py and the numpy check refuse them at load with a located error, exit 2,
instead of training on zero rows (docs/design/backends.md, "Out-of-range token ids and labels")."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parcomp.cli import commands  # noqa: E402
from parcomp.ir.index_inputs import index_inputs  # noqa: E402

from token_loss_models import MODELS, VOCAB  # noqa: E402

SPECS = {"dp": "mesh dp=2\ninput input_ids [S(0)]\ninput labels [S(0)]\n"
               "train loss=output optimizer=sgd(lr=0.1) batch=2 steps=2\n",
         "tp": "mesh tp=2\nemb.weight S(1)\ntrain loss=output optimizer=sgd(lr=0.1) batch=2 steps=2\n"}


def _compile(tmp_path, spec="dp"):
    path = tmp_path / f"{spec}.pcs"
    path.write_text(SPECS[spec])
    return commands.compile_model(SimpleNamespace(model=f"{MODELS}:shifted_token_mean", spec=str(path)),
                                  numeric="check")


@pytest.mark.parametrize("spec", ["dp", "tp"])
def test_the_ids_and_the_shifted_labels_are_found_with_their_bounds(tmp_path, spec):
    c, _, _ = _compile(tmp_path, spec)
    want = {"input_ids": (VOCAB, None, "embedding table emb.weight"),
            "labels": (VOCAB, -100, "cross-entropy labels")}
    assert index_inputs(c.logical) == want
    assert index_inputs(c.program) == want


def test_program_refuses_out_of_range_ids_and_labels_on_every_rank(tmp_path):
    from parcomp_backends.torch import run_torchrun
    from parcomp_backends.torch.launch import write_program

    c, module, (ids, labels) = _compile(tmp_path)
    write_program(c, tmp_path)
    ok_labels = labels.clone()
    ok_labels[0, 0] = -100  # ignore_index: allowed
    res = run_torchrun(tmp_path, 2, module.state_dict(), {"input_ids": ids + 200, "labels": ok_labels},
                       extra_args=("--steps", "2"), timeout=120)
    assert res.returncode != 0
    for rank in (0, 1):
        assert (f"program.py (rank {rank}): error: input 'input_ids' in {tmp_path / 'inputs.pt'} holds "
                f"{int(ids.max()) + 200}, outside the embedding table emb.weight of size {VOCAB} "
                f"(allowed: 0..{VOCAB - 1})") in res.stderr, res.stderr
    assert 'program.py", line' not in res.stderr  # torchrun's own traceback aside, none from program.py
    bad = labels.clone()
    bad[1, 2] = -3
    steps = [{"input_ids": ids, "labels": ok_labels}, {"input_ids": ids, "labels": bad}]
    res = run_torchrun(tmp_path, 2, module.state_dict(), steps, extra_args=("--steps", "2"), timeout=120)
    assert res.returncode != 0
    assert (f"input 'labels' in {tmp_path / 'inputs.pt'} holds -3, outside the cross-entropy labels of size "
            f"{VOCAB} (allowed: 0..{VOCAB - 1} or -100 (ignore_index))") in res.stderr, res.stderr
    assert 'program.py", line' not in res.stderr  # torchrun's own traceback aside, none from program.py


@pytest.mark.parametrize("name,shift", [("input_ids", 200), ("input_ids", -20), ("labels", 200), ("labels", -20)])
def test_parcomp_check_refuses_out_of_range_example_inputs(tmp_path, name, shift):
    from parcomp.cli.common import require_finite
    from parcomp.errors import ParcompError

    c, _, (ids, labels) = _compile(tmp_path, "tp")
    feeds = {"input_ids": ids.numpy(), "labels": labels.numpy()}
    feeds[name] = feeds[name] + shift
    with pytest.raises(ParcompError, match=f"{name} holds .* outside the .* {VOCAB}") as e:
        require_finite(c.logical, feeds)
    assert e.value.where == name


def test_parcomp_check_allows_ignored_labels(tmp_path):
    from parcomp.cli.common import require_finite

    c, _, (ids, labels) = _compile(tmp_path, "tp")
    labels = labels.numpy().copy()
    labels[0, :2] = -100
    require_finite(c.logical, {"input_ids": ids.numpy(), "labels": labels})


PP_SPEC = ("mesh pp=2\nstage 0: transformer transformer.h.0\nstage 1: transformer.h.1 transformer.ln_f lm_head\n"
           "train loss=cross_entropy optimizer=sgd(lr=0.1) microbatches=1\n")


def test_pipelined_program_refuses_out_of_range_labels(tmp_path):
    from parcomp_backends.torch import run_torchrun
    from parcomp_backends.torch.launch import write_program

    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    path = tmp_path / "pp.pcs"
    path.write_text(PP_SPEC)
    c, module, (ids,) = commands.compile_model(SimpleNamespace(model=f"{root / 'specs' / 'models.py'}:gpt2_lm",
                                                               spec=str(path)), numeric="check")
    write_program(c, tmp_path)
    res = run_torchrun(tmp_path, 2, module.state_dict(), {"input_ids": ids, "labels": ids + 200}, timeout=180)
    assert res.returncode != 0
    assert (f"error: input 'labels' in {tmp_path / 'inputs.pt'} holds {int(ids.max()) + 200}, outside the "
            f"cross-entropy labels of size 101 (allowed: 0..100 or -100 (ignore_index))") in res.stderr, res.stderr
    assert 'program.py", line' not in res.stderr


def test_program_refuses_an_out_of_range_id_of_a_data_step(tmp_path):
    from parcomp_backends.torch import run_torchrun
    from parcomp_backends.torch.launch import write_program

    c, module, _ = _compile(tmp_path)
    write_program(c, tmp_path)
    (tmp_path / "samples.py").write_text(
        "import torch\n\n\ndef samples():\n"
        "    g = torch.Generator().manual_seed(0)\n"
        f"    out = [{{'input_ids': torch.randint(0, {VOCAB}, (4,), generator=g), "
        f"'labels': torch.randint(0, {VOCAB}, (4,), generator=g)}} for _ in range(4)]\n"
        "    out[3]['input_ids'][1] = -7  # step 2, dp rank 1's sample\n"
        "    return out\n")
    res = run_torchrun(tmp_path, 2, module.state_dict(), None,
                       extra_args=("--steps", "2", "--data", f"{tmp_path / 'samples.py'}:samples"), timeout=120)
    assert res.returncode != 0
    assert (f"program.py (rank 1): error: input 'input_ids' of sample 3 in --data {tmp_path / 'samples.py'}:samples "
            f"(step 2) holds -7 at [1], outside the embedding table emb.weight of size {VOCAB} "
            f"(allowed: 0..{VOCAB - 1})") in res.stderr, res.stderr


# a launcher that runs program.py with rank 1's exit hanging once it has failed (as a process
# whose CUDA context a device-side assert broke can hang in its teardown): its connections stay
# open, so the other rank's collective does not fail when rank 1 stops, as with NCCL, which
# never notices a peer that is gone; torchrun's SIGTERM, once the other rank has exited, ends it
LINGERING = """\
import os, runpy, signal, sys, time
import torch.distributed as dist
real = dist.destroy_process_group
def lingering(*args, **kw):
    if os.environ["RANK"] == "1":
        signal.signal(signal.SIGTERM, lambda *_: os._exit(2))
        time.sleep(600)
    return real(*args, **kw)
dist.destroy_process_group = lingering
sys.argv[0] = "program.py"
runpy.run_path("program.py", run_name="__main__")
"""


def _data(tmp_path, name, bad, seq):
    """``samples.py:samples``: 4 samples of ``input_ids`` and ``labels`` [seq] (2 steps of 2),
    ``name`` of sample 3 (step 2's second: dp rank 1's, or the last stage's labels) holding
    ``bad`` at position 2."""
    (tmp_path / "samples.py").write_text(
        "import torch\n\n\ndef samples():\n"
        "    g = torch.Generator().manual_seed(0)\n"
        f"    out = [{{'input_ids': torch.randint(0, {VOCAB}, ({seq},), generator=g), "
        f"'labels': torch.randint(0, {VOCAB}, ({seq},), generator=g)}} for _ in range(4)]\n"
        f"    out[3][{name!r}][2] = {bad}\n"
        "    return out\n")
    return f"{tmp_path / 'samples.py'}:samples"


@pytest.mark.slow
@pytest.mark.parametrize("program", ["spmd", "pipelined"])
def test_a_bad_data_sample_stops_every_rank_naming_the_rank_and_the_sample(tmp_path, program):
    """Rank 1 alone reads an out-of-range value at step 2 (a token id on dp=2, a label on the
    pipelined pp=2's last stage) and fails; its exit hangs, so its connections stay open. The
    other rank, waiting for it in a collective, learns of the failure from the launcher's store
    and exits 2 well before --timeout (300 s; the launch is bounded by 150 s), naming rank 1, the
    sample and the value; both ranks exit 2."""
    import re

    from parcomp_backends.torch import run_torchrun
    from parcomp_backends.torch.launch import write_program

    if program == "spmd":
        c, module, _ = _compile(tmp_path)  # dp=2, samples of 4 tokens
        name, bad, what, seq = "input_ids", -7, f"embedding table emb.weight of size {VOCAB}", 4
    else:
        root = __import__("pathlib").Path(__file__).resolve().parents[2]
        path = tmp_path / "pp.pcs"
        path.write_text(PP_SPEC)
        c, module, _ = commands.compile_model(SimpleNamespace(model=f"{root / 'specs' / 'models.py'}:gpt2_lm",
                                                              spec=str(path)), numeric="check")
        name, bad, what, seq = "labels", 500, "cross-entropy labels of size 101", 8
    write_program(c, tmp_path)
    (tmp_path / "lingering.py").write_text(LINGERING)
    data = _data(tmp_path, name, bad, seq)
    from parcomp.cli.common import computed_constants

    params = {**module.state_dict(), **computed_constants(c.logical, module)}  # GPT-2's position ids
    res = run_torchrun(tmp_path, 2, params, None, program="lingering.py", timeout=150,
                       extra_args=("--steps", "2", "--data", data, "--timeout", "300"))
    codes = dict(re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", res.stderr))
    assert codes == {"0": "2", "1": "2"}, res.stderr[-4000:]
    found = f"input {name!r} of sample 3 in --data {data} (step 2) holds {bad} at [2], outside the {what}"
    assert f"program.py (rank 1): error: {found}" in res.stderr, res.stderr[-4000:]
    line = next(s for s in res.stderr.splitlines() if s.startswith("program.py (rank 0): error:"))
    assert "the run failed on rank 1" in line and found in line, line
    assert 'program.py", line' not in res.stderr, res.stderr[-4000:]
