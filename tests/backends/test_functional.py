"""Functional collectives and ``program.py --compile``.

A tp=2 AdamW training program emitted with ``functional=True`` runs twice under torchrun
(CPU/gloo): eager, with every ``train_step`` counted for host syncs (none), and under
``torch.compile`` (one whole graph per step, collectives included).  Both train like
torch.optim, and equal each other, within float32's tolerance.
"""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from parcomp_backends.torch import assemble_training_outputs, emit_program, run_torchrun  # noqa: E402
from parcomp_backends.torch.launch import write_program  # noqa: E402

from numerics import assert_all_equivalent  # noqa: E402
from test_torch_training import (GPT2_TP2, _batches, _compile, _model, _mse, assert_trained_like_torch,  # noqa: E402
                                 torch_training)

TIMEOUT = 420
ADAMW = "adamw(lr=0.01)"

# runs program.py's main with every train_step counted for reads of a device value on the host
# (.item(), bool(tensor), .tolist(): aten._local_scalar_dense / is_nonzero), then writes
# {"syncs": [per step], "graphs": torch.compile's graph count, "probe": a known .item() counted}
PROBE = """\
import importlib.util, json, os, sys, torch
from torch.utils._python_dispatch import TorchDispatchMode
SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default}

class Syncs(TorchDispatchMode):
    count = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        Syncs.count += func in SYNCS
        return func(*args, **(kwargs or {}))

spec = importlib.util.spec_from_file_location("program", "program.py")
program = importlib.util.module_from_spec(spec)
spec.loader.exec_module(program)
per_step, step = [], program.train_step

def counted(p, inp):
    Syncs.count = 0
    with Syncs():
        out = step(p, inp)
    per_step.append(Syncs.count)
    return out

Syncs.count = 0
with Syncs():
    torch.ones(1).item()
probe = Syncs.count
if "--compile" not in sys.argv:
    program.train_step = counted
program.main(sys.argv[1:])
from torch._dynamo.utils import counters
graphs = counters["stats"]["unique_graphs"]
with open(f"probe.{os.environ['RANK']}.json", "w") as f:
    json.dump({"syncs": per_step, "graphs": graphs, "probe": probe}, f)
"""


def test_functional_program_text_has_no_in_place_collective():
    text = emit_program(_compile("gpt2_mlp", GPT2_TP2.format(opt=ADAMW)), "cpu", functional=True)
    start = text.index("import torch.distributed._functional_collectives as funcol")
    for fn in ("all_reduce", "all_reduce_", "all_gather", "reduce_scatter", "all_to_all", "wait"):
        assert text.rindex(f"\ndef {fn}(") > start, f"{fn} is not redefined by the functional section"
    plain = emit_program(_compile("gpt2_mlp", GPT2_TP2.format(opt=ADAMW)), "cpu")
    # the default program has no functional section; only while torch.compile traces it do its
    # started collectives call the functional ones (tests/backends/test_compile_graph_breaks.py)
    assert "import torch.distributed._functional_collectives as funcol" not in plain
    assert "\ndef all_gather(" in plain and plain.count("\ndef all_gather(") == 1


@pytest.mark.slow
def test_compiled_functional_training_equals_eager_and_steps_have_no_host_sync(tmp_path):
    c = _compile("gpt2_mlp", GPT2_TP2.format(opt=ADAMW))
    _, module, example = _model("gpt2_mlp")
    batches = _batches(example, 2, per_step=False)
    want = torch_training(module, lambda p: torch.optim.AdamW(p, lr=0.01), batches, _mse)
    runs = {}
    for mode in ("eager", "compile"):
        d = tmp_path / mode
        write_program(c, d, "cpu", functional=True)
        (d / "probe.py").write_text(PROBE)
        extra = ("--device", "cpu", "--steps", "3") + (("--compile",) if mode == "compile" else ())
        res = run_torchrun(d, 2, module, batches[0], d / "out.pt", extra, timeout=TIMEOUT, program="probe.py")
        assert res.returncode == 0, res.stderr[-4000:]
        out, losses = assemble_training_outputs(d / "out.pt", c.program)
        assert_trained_like_torch(out, losses, res, want)
        runs[mode] = (out, [json.loads((d / f"probe.{r}.json").read_text()) for r in (0, 1)])
    for probe in runs["eager"][1]:
        assert probe["probe"] == 1, "the counter misses a known .item()"
        assert probe["syncs"] == [0, 0, 0]
    for probe in runs["compile"][1]:
        assert probe["graphs"] >= 1 and probe["syncs"] == []
    assert_all_equivalent(runs["compile"][0], runs["eager"][0])


def test_training_loop_keeps_losses_on_the_device_and_logs_every_n_steps(monkeypatch, capsys):
    from parcomp_backends.torch.runtime import program_train as pt

    seen = []

    def step(params, inputs):
        seen.append(inputs["k"])
        return {"loss": inputs["k"] * 2, "w": params["w"] + 1}

    monkeypatch.setattr(pt, "STEP_INPUT", "k")
    monkeypatch.setattr(pt, "CARRIED", ("w",))
    outputs, losses = pt.train({"w": torch.zeros(2)}, [{}] * 5, step=step, log_every=2)
    assert losses == [2.0, 4.0, 6.0, 8.0, 10.0] and torch.equal(outputs["w"], torch.full((2,), 5.0))
    assert capsys.readouterr().out.splitlines() == ["step 2 loss 4", "step 4 loss 8", "step 5 loss 10"]
    # every step number is a view of one tensor made before the loop (no copy per step)
    assert len({t.untyped_storage().data_ptr() for t in seen}) == 1
