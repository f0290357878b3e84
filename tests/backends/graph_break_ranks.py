"""The shared set-up of the graph-break tests (test_compile_graph_breaks*.py): compile a model of
``specs/models.py`` for each spec, write each program.py, run them on 2 gloo ranks (spawned,
with a hard bound), and on each rank hand every program's ``train_step`` with its loaded
parameters and inputs to the test's ``measure`` function; its JSON result per spec comes back
per rank."""
from __future__ import annotations

import importlib
import json
import os
import time

import pytest
import torch

from parcomp.cli.common import computed_constants
from parcomp.compile.compiler import compile_graph
from parcomp.frontends.loader import load_model
from parcomp.spec import load_spec
from parcomp_backends.torch import emit_program
from parcomp_backends.torch.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOIN_S = 600  # a hard bound on the two ranks


def explain_counts(ex) -> dict:
    """The graphs, graph breaks and each break's reason (with where it happened) of a
    ``torch._dynamo.explain`` result."""
    return {"graphs": ex.graph_count, "breaks": ex.graph_break_count,
            "reasons": [f"{b.reason.splitlines()[0]} at "
                        f"{'; '.join(f'{f.name}: {f.line}' for f in b.user_stack[-2:])}"
                        for b in ex.break_reasons]}


def _rank(rank, port, directory, specs, measure):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    # what program.py's compiled_step does before torch.compile
    importlib.import_module("torch.distributed._functional_collectives")
    counts = {}
    try:
        state = torch.load(os.path.join(directory, "state.pt"))
        for name in specs:
            spec = importlib.util.spec_from_file_location(f"program_{name[:-4]}", os.path.join(directory, f"{name}.py"))
            program = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(program)
            program.make_groups(120)
            params = program.load_params(state["params"])
            inputs = program.load_inputs(state["inputs"])
            inputs[program.STEP_INPUT] = torch.tensor(1.0)
            torch._dynamo.reset()
            with torch.no_grad():
                counts[name] = measure(program, params, inputs)
    finally:
        torch.distributed.destroy_process_group()
    with open(os.path.join(directory, f"counts.{rank}.json"), "w") as f:
        json.dump(counts, f)


def measure_on_two_ranks(directory, model, specs, inputs_of, measure) -> list[dict]:
    """Compile ``specs/models.py:MODEL`` for each of ``specs`` (files in specs/), write the
    programs and the state (the module's parameters and constants, ``inputs_of(module, example)``)
    into ``directory``, and run ``measure(program, params, inputs)`` for every program on each of
    2 gloo ranks: the per-rank ``{spec: result}``. ``measure`` must be a module-level function
    (the ranks are spawned)."""
    import torch.multiprocessing as mp

    graph, module, example = load_model(os.path.join(ROOT, "specs", "models.py") + ":" + model)
    for name in specs:
        compiled = compile_graph(graph, load_spec(os.path.join(ROOT, "specs", name)))
        (directory / f"{name}.py").write_text(emit_program(compiled, "cpu"))  # the default: no functional=True
    params = {**module.state_dict(), **computed_constants(graph, module)}
    torch.save({"params": params, "inputs": inputs_of(module, example)}, directory / "state.pt")
    ctx = mp.start_processes(_rank, args=(free_port(), str(directory), tuple(specs), measure), nprocs=2,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + JOIN_S
    while not ctx.join(max(1.0, deadline - time.monotonic())):  # True once both have exited (raises if one failed)
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the two ranks did not finish within {JOIN_S} s")
    return [json.loads((directory / f"counts.{rank}.json").read_text()) for rank in (0, 1)]


def assert_one_graph(per_rank: list[dict], specs) -> None:
    """Every rank's ``train_step`` of every spec is one graph with no break (each break named)."""
    for rank, counts in enumerate(per_rank):
        for name in specs:
            got = counts[name]
            assert got["breaks"] == 0 and got["graphs"] == 1, (
                f"rank {rank}, {name}: {got['graphs']} graphs, {got['breaks']} breaks:\n" + "\n".join(got["reasons"]))
