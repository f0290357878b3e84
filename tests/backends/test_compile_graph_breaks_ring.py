"""Ring attention (``context-parallel lowering=ring``) under ``torch.compile``: the training
step of program.py is one graph, with no graph break.

``batch_isend_irecv`` cannot be traced (a break at every ring step), so under compile each
ring shift is a functional ``all_to_all_single`` (``ring_start_functional``), and the
fully-masked-block test, a host read of the mask, is left out (such a block adds exact
zeros). Transformers' LlamaAttention (``specs/models.py:causal_attention``) compiled for cp=2
with contiguous and balanced chunks runs on 2 gloo ranks; each rank counts the graphs and
breaks of its ``train_step`` with ``torch._dynamo.explain`` (a count, not a time), and runs
the step eagerly with the traced branches taken (``torch.compiler.is_compiling`` true): the
loss and gradients equal the plain eager step's.
"""
from __future__ import annotations

import importlib
import json
import os
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from parcomp.cli.common import computed_constants  # noqa: E402
from parcomp.compile.compiler import compile_graph  # noqa: E402
from parcomp.frontends.loader import load_model  # noqa: E402
from parcomp.spec import load_spec  # noqa: E402
from parcomp_backends.torch import emit_program  # noqa: E402
from parcomp_backends.torch.launch import free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPECS = ("attention_cp2_ring_train.pcs", "attention_cp2_ring_balanced_train.pcs")
JOIN_S = 600  # a hard bound on the two ranks


def _rank(rank, port, directory):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    importlib.import_module("torch.distributed._functional_collectives")  # as compiled_step does
    counts = {}
    try:
        state = torch.load(os.path.join(directory, "state.pt"))
        for name in SPECS:
            spec = importlib.util.spec_from_file_location(f"program_{name[:-4]}", os.path.join(directory, f"{name}.py"))
            program = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(program)
            program.make_groups(120)
            params = program.load_params(state["params"])
            inputs = program.load_inputs(state["inputs"])
            inputs[program.STEP_INPUT] = torch.tensor(1.0)
            torch._dynamo.reset()
            with torch.no_grad():
                ex = torch._dynamo.explain(program.train_step)({k: v.clone() for k, v in params.items()}, inputs)
                fresh = lambda: {k: v.clone() for k, v in params.items()}  # noqa: E731 (the step updates in place)
                want = program.train_step(fresh(), dict(inputs))
                real = torch.compiler.is_compiling
                torch.compiler.is_compiling = lambda: True
                try:
                    got = program.train_step(fresh(), dict(inputs))
                finally:
                    torch.compiler.is_compiling = real
            diff = max(float((torch.as_tensor(got[k]) - torch.as_tensor(want[k])).abs().max()) for k in want)
            counts[name] = {"graphs": ex.graph_count, "breaks": ex.graph_break_count, "diff": diff,
                            "reasons": [f"{b.reason.splitlines()[0]} at "
                                        f"{'; '.join(f'{f.name}: {f.line}' for f in b.user_stack[-2:])}"
                                        for b in ex.break_reasons]}
    finally:
        torch.distributed.destroy_process_group()
    with open(os.path.join(directory, f"counts.{rank}.json"), "w") as f:
        json.dump(counts, f)


def test_ring_attention_training_step_compiles_without_graph_break(tmp_path):
    import torch.multiprocessing as mp

    graph, module, example = load_model(os.path.join(ROOT, "specs", "models.py") + ":causal_attention")
    for name in SPECS:
        compiled = compile_graph(graph, load_spec(os.path.join(ROOT, "specs", name)))
        (tmp_path / f"{name}.py").write_text(emit_program(compiled, "cpu"))
    x = example[0]
    params = {**module.state_dict(), **computed_constants(graph, module)}
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    torch.save({"params": params, "inputs": {"x": x, "target": target}}, tmp_path / "state.pt")
    ctx = mp.start_processes(_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + JOIN_S
    while not ctx.join(max(1.0, deadline - time.monotonic())):  # True once both have exited (raises if one failed)
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the two ranks did not finish within {JOIN_S} s")
    for rank in (0, 1):
        counts = json.loads((tmp_path / f"counts.{rank}.json").read_text())
        for name in SPECS:
            got = counts[name]
            assert got["breaks"] == 0 and got["graphs"] == 1, (
                f"rank {rank}, {name}: {got['graphs']} graphs, {got['breaks']} breaks:\n" + "\n".join(got["reasons"]))
            assert got["diff"] == 0.0, f"rank {rank}, {name}: the traced branches differ from eager by {got['diff']}"
