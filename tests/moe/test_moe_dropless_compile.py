"""The dropless MoE step (backends/torch/runtime/program_moe.py) on one rank: each MoE layer
reads the host once per step (its per-expert counts, one copy), and under ``torch.compile``
with the program's own settings (``compile_settings``: scalar outputs captured) the training
step is one graph with no graph break, counted with ``torch._dynamo.explain`` (a count, not
a time)."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from parcomp.compile.compiler import compile_graph  # noqa: E402
from parcomp.frontends.torch.export import import_torch  # noqa: E402
from parcomp.spec import parse_spec  # noqa: E402
from parcomp_backends.torch.emit import emit_program  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..")
sys.path.insert(0, os.path.join(ROOT, "specs"))
import models  # noqa: E402

SPEC = "mesh ep=1\nexperts.* ep=S(0)\ninput x ep=S(0)\ntrain loss=mse optimizer=sgd(lr=0.1) batch=4\n"
# aten ops whose result the host must wait for (a scalar read, a data-dependent shape)
SYNC_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default"}


class _Syncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in SYNC_OPS:
            self.found.append(str(func))
        return func(*args, **(kwargs or {}))


def _program(tmp_path):
    moe = models.mixtral_moe()
    x, target = torch.randn(4, 8, 16), torch.randn(4, 8, 16)
    text = emit_program(compile_graph(import_torch(moe, (x,), ["x"]), parse_spec(SPEC, "moe.pcs")), "cpu")
    assert "= moe_route_plan(" in text, "the step is not dropless"
    path = tmp_path / "program.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"parcomp_moe_compile_{id(tmp_path)}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    params = {k: v.detach().clone() for k, v in moe.named_parameters()}
    return mod, params, {"x": x, "target": target}


def test_a_dropless_layer_reads_the_host_once_per_step(tmp_path, monkeypatch):
    mod, params, inputs = _program(tmp_path)
    copies = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: copies.append(t.numel()) or tolist(t))
    with _Syncs() as mode:
        mod.train_step(params, inputs)
    assert len(copies) + len(mode.found) == 1, (copies, mode.found)  # one MoE layer


def test_the_dropless_training_step_is_one_graph_under_compile(tmp_path):
    mod, params, inputs = _program(tmp_path)
    torch._dynamo.reset()
    saved = torch._dynamo.config.capture_scalar_outputs
    try:
        mod.compile_settings()
        ex = torch._dynamo.explain(mod.train_step)(params, inputs)
    finally:
        torch._dynamo.config.capture_scalar_outputs = saved
        torch._dynamo.reset()
    reasons = [f"{b.reason.splitlines()[0]} at {'; '.join(f'{f.name}: {f.line}' for f in b.user_stack[-2:])}"
               for b in ex.break_reasons]
    assert ex.graph_break_count == 0 and ex.graph_count == 1, "\n".join(reasons)
