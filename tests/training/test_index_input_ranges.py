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
    assert (f"program.py (rank 1): error: input 'input_ids' in --data {tmp_path / 'samples.py'}:samples (step 2) "
            f"holds -7, outside the embedding table emb.weight of size {VOCAB} (allowed: 0..{VOCAB - 1})"
            ) in res.stderr, res.stderr
