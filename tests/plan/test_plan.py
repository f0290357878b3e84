"""`parcomp plan`: layouts for every parameter with no rules given, written as a spec."""
from __future__ import annotations

import time

import pytest

from parcomp.cli.main import main
from parcomp.compile.compiler import compile_graph
from parcomp.frontends.loader import load_model
from parcomp.plan.planner import plan
from parcomp.spec import load_spec, parse_spec

SPECS = "specs/models.py"


def _rows(compiled):
    return [(r["kind"], r["axis"], r["dim"], r["phase"], tuple(r["local_shape"]), r["bytes"])
            for r in compiled.report["collectives"]]


@pytest.mark.parametrize("factory, megatron", [("torch_mlp", "specs/torch_mlp_tp2.pcs"),
                                               ("gpt2_mlp", "specs/gpt2_mlp_tp2.pcs")])
def test_plan_rediscovers_megatron_for_the_mlps(tmp_path, factory, megatron):
    out = tmp_path / "plan.pcs"
    assert main(["plan", f"{SPECS}:{factory}", "--mesh", "tp=2", "-o", str(out)]) == 0
    graph = load_model(f"{SPECS}:{factory}")[0]
    planned = compile_graph(graph, load_spec(str(out)))
    want = compile_graph(graph, load_spec(megatron))
    assert _rows(planned) == _rows(want)
    assert [r[:4] for r in _rows(want)] == [("all_reduce", "tp", None, "forward")]


def test_plan_of_a_12_block_chain_is_megatron_in_under_a_second():
    import importlib.util

    from parcomp.frontends.torch.export import import_torch

    mod = importlib.util.spec_from_file_location("plan_models", SPECS)
    models = importlib.util.module_from_spec(mod)
    mod.loader.exec_module(models)
    graph = import_torch(*models.mlp_chain(blocks=12))
    megatron = "mesh tp=2\n" + "".join(f"{3 * k}.weight colwise\n{3 * k + 2}.weight rowwise\n" for k in range(12))
    t0 = time.perf_counter()
    text, chosen = plan(graph, "tp=2")
    assert time.perf_counter() - t0 < 1.0
    assert chosen.search["search"] == "dp" and chosen.search["proven_optimal"]
    planned = compile_graph(graph, parse_spec(text, "plan.pcs"))
    want = compile_graph(graph, parse_spec(megatron + "input x replicated\noutput output replicated\n", "m.pcs"))
    assert _rows(planned) == _rows(want) and len(_rows(want)) == 12


def test_plan_never_overwrites_a_file_it_did_not_write(tmp_path, capsys):
    out = tmp_path / "mine.pcs"
    out.write_text("mesh tp=2\n# my notes\n")
    assert main(["plan", f"{SPECS}:torch_mlp", "--mesh", "tp=2", "-o", str(out)]) == 2
    assert out.read_text() == "mesh tp=2\n# my notes\n"
    assert "never overwrites" in capsys.readouterr().err
    out.unlink()
    assert main(["plan", f"{SPECS}:torch_mlp", "--mesh", "tp=2", "-o", str(out)]) == 0
    assert main(["plan", f"{SPECS}:torch_mlp", "--mesh", "tp=2", "-o", str(out)]) == 0  # its own: replaced
    out.write_text(out.read_text() + "# edited\n")
    assert main(["plan", f"{SPECS}:torch_mlp", "--mesh", "tp=2", "-o", str(out)]) == 2


def test_bad_mesh_is_a_usage_error(tmp_path, capsys):
    assert main(["plan", f"{SPECS}:torch_mlp", "--mesh", "tp", "-o", str(tmp_path / "a.pcs")]) == 2
    assert "--mesh" in capsys.readouterr().err


def test_plan_with_a_memory_limit_and_training(tmp_path):
    """A training plan under a memory limit on dp x tp: the written spec compiles (its
    training step by the ILP), pins every parameter, and the search is reported."""
    from parcomp.ir import parse_graph

    g = parse_graph("%x: f32[8,16] = input()\n%w0: f32[16,32] = param()\n%h: f32[8,32] = matmul(%x, %w0)\n"
                    "%r: f32[8,32] = relu(%h)\n%w1: f32[32,16] = param()\n%output: f32[8,16] = matmul(%r, %w1)\n"
                    "return %output\n")
    text, chosen = plan(g, "dp=2 tp=2", "1MiB", "train loss=mse optimizer=sgd(lr=0.1)", seconds=30)
    assert chosen.search["proven_optimal"] and chosen.search["resident_bytes"] <= 2**20
    sp = parse_spec(text, "plan.pcs")
    assert sp.memory == 2**20 and {r.pattern for r in sp.rules_for("param")} == {"w0", "w1"}
    compiled = compile_graph(g, sp)
    assert compiled.report["search"]["search"] == "ilp" and compiled.report["training"]
    assert [r["kind"] for r in compiled.report["collectives"] if r["axis"] == "tp"]


def test_plan_needs_a_positive_time_budget(tmp_path, capsys):
    assert main(["plan", f"{SPECS}:torch_mlp", "--mesh", "tp=2", "--seconds", "0", "-o", str(tmp_path / "a.pcs")]) == 2
    assert "--seconds" in capsys.readouterr().err


@pytest.mark.parametrize("extra, where, needle", [
    (["--train", "loss=mse"], "--train", "starting with 'train'"),
    (["--train", "train loss=mse optimizer=sgd(lr=0.1, momentun=0.9)"], "--train:1:38",
     "sgd has no hyperparameter 'momentun'"),
    (["--memory", "1KiB"], "--memory:1:1", "over the memory limit 1.0 KiB"),
    (["--mesh", "tp=3"], "--mesh", "parameter 0.weight f32[128,32] cannot be split evenly"),
])
def test_plan_options_errors_point_at_the_option(tmp_path, capsys, extra, where, needle):
    import json

    argv = ["plan", f"{SPECS}:torch_mlp", "--mesh", "tp=2", "-o", str(tmp_path / "p.pcs"), "--json"]
    assert main(argv + extra) == 2
    out, err = capsys.readouterr()
    last = json.loads(out.strip().splitlines()[-1])
    assert last["where"] == where and needle in last["error"] and "plan.pcs" not in err
    assert not (tmp_path / "p.pcs").exists()


def test_plan_leaves_integer_buffers_replicated():
    from parcomp.ir.types import Mesh, R, TensorType
    from parcomp.plan.planner import param_layouts

    mesh = Mesh((("dp", 2), ("tp", 2)))
    assert param_layouts(TensorType((1, 8), "int64"), mesh, "arange") == [(R, R)]
    assert (R, R) not in param_layouts(TensorType((8, 8), "float32"), mesh, "w")  # matrices split
