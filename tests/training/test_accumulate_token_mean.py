"""Gradient accumulation of a model's own token-mean loss (``train loss=output accumulate=K``).

A model that returns the mean cross-entropy over its counted tokens (``ignore_index``) is
trained on the token mean of the global batch, as one full-batch step computes it: parcomp
accumulates the sum and the count of the K microbatches and divides once, not the mean of
the K microbatch means (which weighs a microbatch with few counted tokens as much as one
with many). A token mean inside a larger expression cannot be accumulated exactly: compile
warns, in its output and in report.json."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parcomp.check import train_check  # noqa: E402
from parcomp.check.microbatches import micro  # noqa: E402
from parcomp.cli import commands
from parcomp.cli.main import main  # noqa: E402
from parcomp.reference.interpreter import run_spmd  # noqa: E402
from parcomp.reference.numpy_ops import run_unsharded  # noqa: E402

from token_loss_models import MODELS  # noqa: E402

SPEC = ("mesh dp=2\ninput input_ids [S(0)]\ninput labels [S(0)]\n"
        "train loss=output optimizer=sgd(lr=0.1) accumulate={K} batch={B} steps=1\n")


def _compile(tmp_path, factory, K=2):
    path = tmp_path / f"{factory}{K}.pcs"
    path.write_text(SPEC.format(K=K, B=2 * K))
    c, module, example = commands.compile_model(SimpleNamespace(model=f"{MODELS}:{factory}", spec=str(path)),
                                           numeric="check")
    return c, module, example, path


def _uneven(feeds):
    """The step's feeds with labels ignored (-100) unevenly: microbatch 0 (rows 0 and 2 of the
    stacked batch, dp=2) keeps 2 of its 8 labels, microbatch 1 all 8."""
    labels = np.asarray(feeds["labels"]).copy()
    labels[0, 1:] = -100
    labels[2, :3] = -100
    assert [int(np.sum(micro(labels, k, 2, 2) != -100)) for k in (0, 1)] == [2, 8]
    return {**feeds, "labels": labels}


def _torch_full_batch(module, feeds):
    """Loss and parameter gradients of one float64 forward and backward of the whole stacked batch."""
    m = __import__("copy").deepcopy(module).double()
    loss = m(torch.from_numpy(np.asarray(feeds["input_ids"])), torch.from_numpy(np.asarray(feeds["labels"])))
    loss.backward()
    return float(loss.detach()), {f"{k}.grad": p.grad.numpy() for k, p in m.named_parameters()}


def _torch_mean_of_means(module, feeds):
    m = __import__("copy").deepcopy(module).double()
    losses = [m(torch.from_numpy(micro(feeds["input_ids"], k, 2, 2)), torch.from_numpy(micro(feeds["labels"], k, 2, 2)))
              for k in (0, 1)]
    return float(sum(losses).detach() / 2)


@pytest.mark.parametrize("factory", ["token_mean", "shifted_token_mean"])
def test_accumulated_token_mean_equals_the_full_batch_step(tmp_path, factory):
    """dp=2, accumulate=2, labels ignored unevenly across the microbatches: the loss and every
    gradient of the step (unsharded graph and all ranks of the sharded program) equal torch's
    full-batch step (float64), and the loss is not the mean of the microbatch means."""
    c, module, example, _ = _compile(tmp_path, factory)
    feeds = _uneven(commands.training_feeds(c, module, example, 0))
    want_loss, want_grads = _torch_full_batch(module, feeds)
    assert abs(_torch_mean_of_means(module, feeds) - want_loss) > 1e-3 * want_loss  # 100x the tolerance below
    for got in (run_unsharded(c.logical, feeds), run_spmd(c.program, feeds).outputs(c.program)):
        assert float(got["loss"]) == pytest.approx(want_loss, rel=1e-5)
        for k, v in want_grads.items():
            np.testing.assert_allclose(got[k], v, rtol=1e-4, atol=1e-6, err_msg=k)
    r = train_check.lockstep(c, module, example, feeds, 1)  # parcomp check's own verdict, torch included
    assert r["vs_unsharded"]["ok"] and r["vs_torch"]["ok"], (r["vs_unsharded"]["why"], r["vs_torch"]["why"])
    assert "token mean of the global batch" in c.report["training"]["loss_accumulation"]
    assert c.report["warnings"] == []


def test_a_token_mean_inside_a_larger_loss_is_warned_about_in_compile_and_report(tmp_path, capsys):
    """``ce_mean + 0.01 * aux`` cannot be accumulated as sum / count: compile says it trains on
    the mean of the microbatch losses, on stderr and in report.json; the same model without
    accumulation, and the plain token mean, get no warning."""
    out = tmp_path / "out"
    _, _, _, spec = _compile(tmp_path, "token_mean_plus_aux")
    assert main(["compile", f"{MODELS}:token_mean_plus_aux", "--spec", str(spec), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    (warning,) = [w for w in report["warnings"] if w.startswith("accumulate=2 with loss=output")]
    assert f"warning: {warning}" in err
    assert "mean of the 2 microbatch losses, not on the token mean of the global batch" in warning
    assert "%cross_entropy_loss_count" in warning and "F.cross_entropy(logits, labels, ignore_index=-100)" in warning
    assert report["training"]["loss_accumulation"] == "mean of the 2 microbatch losses"
    c, _, _, _ = _compile(tmp_path, "token_mean_plus_aux", K=1)
    assert not any("accumulate" in w for w in c.report["warnings"])
    assert "loss_accumulation" not in c.report["training"]
    c, _, _, _ = _compile(tmp_path, "token_mean")
    assert not any("accumulate" in w for w in c.report["warnings"])


def test_the_transformers_lm_loss_is_accumulated_as_a_token_mean():
    """transformers' ForCausalLMLoss (GPT-2 called with labels: padded, shifted cross-entropy,
    reduction mean) is the sum / count form accumulation takes exactly."""
    from parcomp.frontends.loader import load_model
    from parcomp.passes.train.accumulate import token_mean

    graph = load_model("specs/models.py:gpt2_lm_loss")[0]
    s, c = token_mean(graph, dict(graph.named_outputs())["loss"])
    assert graph[s].op == "sum" and graph[graph[c].inputs[0]].op == "label_mask"


def test_the_readme_spec_accumulates_gpt2s_own_loss_as_a_token_mean(tmp_path, capsys):
    """The spec README.md shows for token-exact accumulation compiles for gpt2_lm_loss as it says:
    4 microbatches on dp=2, the token mean of the global batch, no warning."""
    import os
    import re

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..")
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    marker = "<!-- tests/training/test_accumulate_token_mean.py compiles the next block"
    block = re.search(r"```\n(.*?)```", readme[readme.index(marker):], re.S).group(1)
    (tmp_path / "readme.pcs").write_text(block)
    model = os.path.join(root, "specs", "models.py") + ":gpt2_lm_loss"
    assert main(["compile", model, "--spec", str(tmp_path / "readme.pcs"), "-o", str(tmp_path / "out")]) == 0
    assert "warning: accumulate" not in capsys.readouterr().err
    training = json.loads((tmp_path / "out" / "report.json").read_text())["training"]
    assert training["batch_note"] == "global batch 8 = microbatch 1 x accumulate 4 x dp 2"
    assert training["loss_accumulation"].startswith("token mean of the global batch")
