"""`parcomp plan`: layouts for every parameter with no rules given, written as a spec."""
from __future__ import annotations

import time

import pytest

from parcomp.cli import main
from parcomp.compiler import compile_graph
from parcomp.frontends.loader import load_model
from parcomp.plan import plan
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

    from parcomp.frontends.torch_export import import_torch

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
