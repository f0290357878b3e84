"""Memory in the layout search: the spec's `memory` limit, infeasible plans, the errors."""
from __future__ import annotations

import pytest

from parcomp.compile.compiler import compile_graph
from parcomp.cost.memory import resident_bytes
from parcomp.errors import ParcompError, SpecError
from parcomp.passes.autodiff import add_training_step
from parcomp.passes.pass_list import bind_layouts
from parcomp.passes.shard_prop import shard_prop

from graphs import mlp_graph, spec

DP = "mesh dp=2\ninput x split-seq\ntrain loss=mse optimizer=sgd(lr=0.1)\n"
# the batch split over an axis not named dp: nothing keeps it split (on dp, shard-prop never
# gathers the batch: shard_prop.batch_values), so the small batch is gathered unless memory says no
BATCH_TP = DP.replace("mesh dp=2", "mesh tp=2")


def _bound():
    g = mlp_graph((4,), [16, 64, 16], [False, False], ["relu"])
    sp = spec(BATCH_TP)
    return add_training_step(bind_layouts(g, sp), sp)


@pytest.mark.parametrize("text, want", [("80GiB", 80 * 2**30), ("1.5GB", 1_500_000_000), ("4096B", 4096)])
def test_memory_statement(text, want):
    assert spec(f"mesh tp=2\nmemory {text}\n").memory == want


@pytest.mark.parametrize("text, msg", [("80", "expected a memory size"), ("0B", "below 1 B")])
def test_bad_memory_statement_is_located(text, msg):
    with pytest.raises(SpecError, match=msg) as e:
        spec(f"mesh tp=2\nmemory {text}\n")
    assert e.value.loc.line == 2


def test_memory_limit_makes_the_gathering_plan_infeasible():
    """Small batch split over tp: unlimited, the search all-gathers activations (fewer calls);
    a limit just under that plan's resident bytes forces the saved activations to stay
    split, at a higher cost, still proven optimal."""
    g = _bound()
    free = shard_prop(g)
    need = resident_bytes(free, {})
    limited = shard_prop(g, memory=need - 1)
    assert limited.search["resident_bytes"] <= need - 1 == limited.search["memory_limit"]
    assert limited.search["proven_optimal"]
    assert limited.search["cost_s"] > free.search["cost_s"]
    assert str(free["l0.mm"].layout) == "(Replicate(),)" != str(limited["l0.mm"].layout)


def test_no_plan_fits_says_by_how_much():
    with pytest.raises(ParcompError, match=r"over the memory limit 1000 B by .* \(8,600 B\)") as e:
        compile_graph(mlp_graph((4,), [16, 64, 16], [False, False], ["relu"]), spec(DP + "memory 1000B\n"))
    assert e.value.loc.line == 4


def test_peak_over_the_limit_is_an_error():
    """The search bounds resident bytes; the compiled plan's liveness peak is checked too."""
    g = mlp_graph((4,), [16, 64, 16], [False, False], ["relu"])
    with pytest.raises(ParcompError, match="the plan's peak of live values needs .* over the memory limit"):
        compile_graph(g, spec(DP + "memory 11000B\n"))
    c = compile_graph(g, spec(DP + "memory 1MiB\n"))
    assert c.report["memory_bytes_per_rank"]["peak_live"] <= 2**20
    assert c.report["search"]["memory_limit"] == 2**20 and "note" not in c.report["search"]


ZERO_MODEL = "%x: f32[4,6] = input()\n%w: f32[6,3] = param()\n%output: f32[4,3] = matmul(%x, %w)\nreturn %output\n"


@pytest.mark.parametrize("dp, warned", [(2, False), (4, True)])
def test_zero_that_cannot_be_applied_is_a_warning(tmp_path, capsys, dp, warned):
    """w is [6, 3]: dp=2 splits dim 0; on dp=4 no dim divides, and zero=1 is not applied."""
    from parcomp.cli.main import main
    from parcomp.ir import parse_graph

    text = f"mesh dp={dp}\ninput x split-seq\ntrain loss=mse optimizer=adamw(lr=0.1) zero=1\n"
    c = compile_graph(parse_graph(ZERO_MODEL), spec(text))
    assert bool(c.report["warnings"]) == warned
    (tmp_path / "m.pcir").write_text(ZERO_MODEL)
    (tmp_path / "s.pcs").write_text(text)
    assert main(["compile", str(tmp_path / "m.pcir"), "--spec", str(tmp_path / "s.pcs"), "-o", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert ("warning: zero=1 is not applied to w" in err) == warned
    if warned:
        assert "divisible by dp=4" in c.report["warnings"][0]
