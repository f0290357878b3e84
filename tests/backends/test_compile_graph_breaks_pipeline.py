"""The pipelined program.py under ``--compile``: every stage program it runs (forward, ZB-H1's
input-gradient B and weight-gradient W, the update) is one graph with no graph break, compiled
at its first call and never again (no recompile for a later microbatch or step), while the
schedule loop and its point-to-point slots (``batch_isend_irecv``, which the compiler cannot
trace) run eagerly around them; the compiled steps equal the eager ones.

A 2-block GPT-2 LM (``specs/models.py:gpt2_lm``) compiled for pp=2 (dp=1) with 2 microbatches
and the ZB-H1 schedule runs on 2 gloo ranks. Each rank runs two training steps eagerly, then the
same two steps as ``--compile`` runs them (``train`` with the parsed option), with
``torch._dynamo.config.error_on_recompile`` set, and counts graph breaks and graphs with
``torch._dynamo.utils.counters`` (counts, not times).
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
from parcomp_backends.torch import emit_program  # noqa: E402
from parcomp_backends.torch.launch import free_port  # noqa: E402

from graphs import spec  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC = ("mesh pp=2\nstage 0: transformer transformer.h.0\nstage 1: transformer.h.1 transformer.ln_f lm_head\n"
        "train loss=cross_entropy optimizer=sgd(lr=0.1, momentum=0.9) microbatches=2 schedule=zb-h1\n")
STEPS = 2
JOIN_S = 600  # a hard bound on the two ranks (inductor compiles each stage program on first call)
STAGE_KINDS = ("forward", "backward", "backward_input", "backward_weight")


def _rank(rank, port, directory):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    from torch._dynamo.utils import counters

    got = {}
    try:
        spec_ = importlib.util.spec_from_file_location("program_pipelined", os.path.join(directory, "program.py"))
        program = importlib.util.module_from_spec(spec_)
        spec_.loader.exec_module(program)
        state = program.setup(120)
        ckpt = torch.load(os.path.join(directory, "model.pt"))
        data = program.load_inputs(program.load_batch(os.path.join(directory, "inputs.pt")))
        results = {}
        for mode in ("eager", "compile"):
            args = program.parse_args(["--checkpoint", "model.pt", "--input", "inputs.pt", "--steps", str(STEPS)]
                                      + (["--compile"] if mode == "compile" else []))
            params = program.load_params(ckpt)
            torch._dynamo.reset()
            counters.clear()
            torch._dynamo.config.error_on_recompile = mode == "compile"
            with torch.no_grad():
                results[mode] = program.train(args, state, params, [data] * STEPS, 1)
        ran = {(kind, s) for kind, _, _, s in program.ACTIONS[rank] if kind in STAGE_KINDS}
        ran |= {("optimizer", s) for s in program.STAGES[state[0]]}
        eager, compiled = results["eager"], results["compile"]
        got = {"breaks": sum(counters["graph_break"].values()),
               "reasons": sorted(counters["graph_break"]),
               "graphs": counters["stats"]["unique_graphs"], "functions": len(ran),
               "keys": [sorted(eager), sorted(compiled)],
               "diff": {k: [float((compiled[k] - eager[k]).abs().max()), float(eager[k].abs().max())]
                        for k in eager if k in compiled}}
    except Exception as e:  # noqa: BLE001 - reported by the test (a break under fullgraph, a recompile)
        got = {"error": f"{type(e).__name__}: {str(e)[:3000]}"}
    finally:
        torch.distributed.destroy_process_group()
    with open(os.path.join(directory, f"counts.{rank}.json"), "w") as f:
        json.dump(got, f)


def test_pipelined_zb_h1_stage_programs_compile_once_without_graph_break(tmp_path):
    import torch.multiprocessing as mp

    graph, module, example = load_model(os.path.join(ROOT, "specs", "models.py") + ":gpt2_lm")
    compiled = compile_graph(graph, spec(SPEC))
    assert compiled.program_.pipeline.schedule == "zb-h1" and compiled.program_.pipeline.microbatches == 2
    (tmp_path / "program.py").write_text(emit_program(compiled, "cpu"))
    ids = example[0]
    labels = torch.randint(0, module.config.vocab_size, ids.shape, generator=torch.Generator().manual_seed(0))
    torch.save({**module.state_dict(), **computed_constants(graph, module)}, tmp_path / "model.pt")
    torch.save({"input_ids": ids, "labels": labels}, tmp_path / "inputs.pt")
    ctx = mp.start_processes(_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + JOIN_S
    while not ctx.join(max(1.0, deadline - time.monotonic())):  # True once both have exited (raises if one failed)
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the two ranks did not finish within {JOIN_S} s")
    for rank in (0, 1):
        got = json.loads((tmp_path / f"counts.{rank}.json").read_text())
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        assert got["breaks"] == 0, f"rank {rank}: {got['breaks']} graph breaks:\n" + "\n".join(got["reasons"])
        # one graph per stage program at most (stage 0's B is empty: no graph), never one per
        # microbatch or step (error_on_recompile above would have raised)
        assert 1 <= got["graphs"] <= got["functions"], (
            f"rank {rank}: {got['graphs']} graphs for {got['functions']} stage programs")
        eager_keys, compiled_keys = got["keys"]
        assert eager_keys == compiled_keys, got["keys"]
        assert any(k.endswith(".grad") for k in eager_keys) and ("losses" in eager_keys) == (rank == 1), eager_keys
        for k, (diff, scale) in got["diff"].items():  # float32: a few roundings of each value's scale
            assert diff <= 1e-6 + 1e-5 * scale, f"rank {rank}, {k}: compiled differs from eager by {diff}"
