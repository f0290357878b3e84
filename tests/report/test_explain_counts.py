"""parcomp explain counts and prices the collectives the program runs: a
bucket of fused gradient all_reduces (passes/lowering/bucket.py, passes/lowering/dp_buckets.py) is one
collective with the flat buffer's bytes, as in report.json's list; backward collectives are
listed under the module of the forward op they differentiate."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest

from parcomp.compile.compiler import compile_graph
from parcomp.cost.links import axis_links
from parcomp.report.explain import explain, program_comm
from parcomp.spec import parse_spec

pytest.importorskip("torch")

MODEL = str(Path(__file__).resolve().parents[1] / "handwritten_gpt.py") + ":gpt"
RULES = """blocks.*.attn.qkv.weight   colwise{o}
blocks.*.attn.proj.weight  rowwise{o}
blocks.*.mlp.w1.weight     colwise{o}
blocks.*.mlp.w3.weight     colwise{o}
blocks.*.mlp.w2.weight     rowwise{o}
"""
TRAIN = "train loss=cross_entropy optimizer=adamw(lr=0.001) steps=2\n"
SPECS = {"tp2": "mesh tp=2\n" + RULES.format(o="") + TRAIN,
         "tp2_sp": "mesh tp=2\nsequence-parallel\n" + RULES.format(o="") + TRAIN,
         "dp2tp2": "mesh dp=2 tp=2\n" + RULES.format(o=" over tp") + "input idx [S(0), R]\n" + TRAIN}


@functools.lru_cache(maxsize=None)
def _compiled(name):
    from parcomp.frontends.loader import load_model

    return compile_graph(load_model(MODEL)[0], parse_spec(SPECS[name], f"{name}.pcs"))


def _count(x, key=None, table="per_axis_phase"):
    t = x["totals"][table]
    return t.get(key, {}).get("count", 0) if key else sum(v["count"] for v in t.values())


@pytest.mark.parametrize("name", sorted(SPECS))
def test_explain_totals_are_the_programs_collectives(name):
    c = _compiled(name)
    x = explain(c)
    want = program_comm(c.program_, axis_links(c.spec, c.report["placement"]))
    assert _count(x) == want["count"] == len(c.report["collectives"])
    assert sum(v["bytes"] for v in x["totals"]["per_axis"].values()) == want["bytes"]
    assert x["estimated_comm_seconds"] == pytest.approx(want["seconds"], rel=1e-12)


def test_sequence_parallel_norm_grads_are_one_all_reduce():
    c = _compiled("tp2_sp")
    x = explain(c)
    assert _count(x) == 19  # 9 forward, 9 backward gather/scatter, one bucket of 5 norm grads
    reduces = [s for e in x["edges"] for s in e["steps"] if s["kind"] == "all_reduce"]
    counted = [s for s in reduces if not s["in_bucket"]]
    assert len(reduces) == 5 and len(counted) == 1
    bucket = c.program_.collective(counted[0]["name"])
    assert bucket is not None and counted[0]["bytes"] == bucket.bytes > 0
    assert all(s["in_bucket"] == bucket.name and s["seconds"] == 0 for s in reduces if s is not counted[0])


def test_dp_backward_buckets_count_once():
    x = explain(_compiled("dp2tp2"))
    assert _count(x, "dp/backward") == 2  # the dp gradient bucket and the norm-grad bucket


def test_backward_collectives_are_listed_under_their_forward_module():
    x = explain(_compiled("tp2_sp"))
    for e in x["edges"]:
        if e["phase"] == "backward":
            assert e["module"].endswith("(backward)"), (e["value"], e["module"])
    norm = [e for e in x["edges"] if e["value"] == "bw.rms_norm_5.sum"]
    assert norm and norm[0]["module"] == "norm (backward)"
