"""The default program.py (no ``--functional-collectives``) under ``torch.compile``: its
``train_step`` is one graph, with no graph break.

A 2-block GPT-2 LM (``specs/models.py:gpt2_lm``) compiled for tp=2 training, as Megatron
(an async all_reduce of dx overlapping the weight gradients, vocab-parallel embedding
gradients) and as Megatron-SP (all_gather / reduce_scatter of the sequence), runs on 2 gloo
ranks; each rank counts the graphs and graph breaks of its ``train_step`` with
``torch._dynamo.explain`` (a count, not a time). Each break found is named in the message.
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
SPECS = ("gpt2_lm_tp2_train.pcs", "gpt2_lm_tp2_sp_train.pcs")
JOIN_S = 600  # a hard bound on the two ranks


def _rank(rank, port, directory):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    # what program.py's compiled_step does before torch.compile
    importlib.import_module("torch.distributed._functional_collectives")
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
                ex = torch._dynamo.explain(program.train_step)(params, inputs)
            counts[name] = {"graphs": ex.graph_count, "breaks": ex.graph_break_count,
                            "reasons": [f"{b.reason.splitlines()[0]} at "
                                        f"{'; '.join(f'{f.name}: {f.line}' for f in b.user_stack[-2:])}"
                                        for b in ex.break_reasons]}
    finally:
        torch.distributed.destroy_process_group()
    with open(os.path.join(directory, f"counts.{rank}.json"), "w") as f:
        json.dump(counts, f)


def test_default_tp2_training_step_compiles_without_graph_break(tmp_path):
    import torch.multiprocessing as mp

    graph, module, example = load_model(os.path.join(ROOT, "specs", "models.py") + ":gpt2_lm")
    for name in SPECS:
        compiled = compile_graph(graph, load_spec(os.path.join(ROOT, "specs", name)))
        (tmp_path / f"{name}.py").write_text(emit_program(compiled, "cpu"))  # the default: no functional=True
    ids = example[0]
    params = {**module.state_dict(), **computed_constants(graph, module)}
    labels = torch.randint(0, module.config.vocab_size, ids.shape, generator=torch.Generator().manual_seed(0))
    torch.save({"params": params, "inputs": {"input_ids": ids, "labels": labels}}, tmp_path / "state.pt")
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
