"""The memory and checkpoint-load lines of ``parcomp compile`` / ``check`` for a pp spec: one per
stage (per pp coordinate), what one rank of it holds and reads, not the unpipelined program's
whole-model figures (report.json's ``pipeline.ranks``)."""
import pytest

from parcomp.compile.compiler import compile_graph
from parcomp.report.report import format_bytes, format_load, format_memory

from graphs import spec
from test_pipeline import chain_graph

TRAIN = "train optimizer=adamw(lr=0.01) input_grads=no microbatches=2"
TP = "".join(f"{3 * k}.weight colwise\n{3 * k + 2}.weight rowwise\n" for k in range(4))


def _compiled(head, extra=""):
    return compile_graph(chain_graph(blocks=4), spec(f"{head}{TRAIN} {extra}\n"))


@pytest.mark.parametrize("head,extra", [("mesh pp=2\n", ""), ("mesh dp=2 pp=2\n", "zero=1"),
                                        (f"mesh dp=2 pp=2 tp=2\n{TP}", "")], ids=["pp2", "dp2pp2zero1", "dp2pp2tp2"])
def test_one_memory_and_one_load_line_per_stage(head, extra):
    c = _compiled(head, extra)
    plan, rep = c.program_.pipeline, c.report
    ranks = rep["pipeline"]["ranks"]
    mem = format_memory(rep).splitlines()
    load = format_load(rep["checkpoint_load"], rep["pipeline"]).splitlines()
    assert [x.split(":")[0] for x in mem[:2]] == ["memory per rank of stage 0", "memory per rank of stage 1"]
    assert [x.split(":")[0] for x in load] == ["checkpoint load per rank of stage 0",
                                               "checkpoint load per rank of stage 1"]
    whole = sum(n.type.nbytes for n in chain_graph(blocks=4).params)
    assert rep["checkpoint_load"]["checkpoint_bytes"] == whole
    per_stage = [sum(st.forward[p].type.nbytes for p in st.params) for st in plan.stages]
    split = 2 if "tp=2" in head else 1  # a tp rank reads its block (a row-parallel bias whole)
    for r, want in zip(ranks, per_stage):
        assert want // split <= r["checkpoint_bytes_read"] <= want
        assert r["weight_bytes"] == r["checkpoint_bytes_read"]  # every param of the chain is trained
        state = r["optimizer_state_bytes"]
        assert state == (r["weight_bytes"] if extra == "zero=1" else 2 * r["weight_bytes"])  # zero: halves
        assert f"reads {format_bytes(r['checkpoint_bytes_read'])} of {format_bytes(whole)}" in load[r["pp"]]
    assert sum(r["checkpoint_bytes_read"] for r in ranks) * split >= whole  # the stages cover the model
    assert not any(x.startswith("memory per rank:") for x in mem)


def test_an_interleaved_rank_names_its_stages():
    c = compile_graph(chain_graph(blocks=4), spec(f"mesh pp=2\n{TRAIN} schedule=interleaved\n"))
    ranks = c.report["pipeline"]["ranks"]
    assert [r["stages"] for r in ranks] == [[0, 2], [1, 3]]
    assert format_memory(c.report).startswith("memory per rank of pp=0 (stages 0, 2): weights ")
