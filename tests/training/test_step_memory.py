"""What the training loop of program.py keeps between steps, measured: live CPU tensor bytes
(tests/live_bytes.py) of K steps against one step. A step's gradients die before the next step
runs, and each step's batch is placed on the device when its step reads it."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parcomp.compile.compiler import compile_graph  # noqa: E402
from parcomp_backends.torch.emit import emit_program  # noqa: E402

from graphs import mlp_graph, random_feeds, spec as parse  # noqa: E402
from live_bytes import LiveBytes  # noqa: E402

WIDTHS = [16, 256, 256, 16]
BATCH = (512, 16)


def _program(tmp_path):
    g = mlp_graph(BATCH, WIDTHS, [True] * 3, ["gelu"] * 2)
    c = compile_graph(g, parse("mesh tp=1\ntrain loss=mse optimizer=sgd(lr=0.01) input_grads=no\n"))
    path = tmp_path / "program.py"
    path.write_text(emit_program(c, "cpu"))
    spec = importlib.util.spec_from_file_location("parcomp_step_memory_program", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return c, mod


def _peak(mod, params, batches, monkeypatch):
    """Peak live bytes of reading ``batches`` (host tensors, as the input file gives them: not
    counted) and training one step on each."""
    p = {k: v.clone() for k, v in params.items()}
    steps = len(batches)
    monkeypatch.setattr(mod, "read_tensors", lambda path, what: batches)
    with LiveBytes([*p.values(), *(t for b in batches for t in b.values())]) as m, torch.no_grad():
        outputs, losses = mod.train(p, mod.read_batches("inputs.pt", steps), step=mod.train_step)
        del outputs
    assert len(losses) == steps
    return m.peak


def test_k_steps_peak_no_higher_than_one_step(tmp_path, monkeypatch):
    """3 steps on 3 different batches peak within a few hundred bytes (the losses, the step
    numbers) of 1 step: the previous step's gradients (the size of the weights) and the other
    steps' batches are not alive while a step runs. Before, 3 steps held 2 more batches and one
    more set of gradients."""
    c, mod = _program(tmp_path)
    feeds = [random_feeds(c.logical, seed) for seed in range(3)]
    params = {n.name: torch.from_numpy(np.asarray(feeds[0][n.name])) for n in c.logical.params}
    batches = [{n.name: torch.from_numpy(np.asarray(f[n.name])) for n in c.logical.inputs} for f in feeds]
    one, three = _peak(mod, params, batches[:1], monkeypatch), _peak(mod, params, batches, monkeypatch)
    batch = sum(t.numel() * t.element_size() for t in batches[0].values())
    grads = sum(t.numel() * t.element_size() for t in params.values())
    assert three - one < 1024, (one, three, batch, grads)
    assert one >= batch  # the measurement sees the batch placed on the device
