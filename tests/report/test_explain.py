"""parcomp explain: each collective with its producer, consumer, reason and alternatives; the
static cost (bytes per rank per axis and phase, an alpha-beta time per link class); specs side
by side; the static bytes equal what the reference interpreter logs when it runs the program."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest

from parcomp.cli.main import main
from parcomp.compile.compiler import compile_graph
from parcomp.cost.links import LINKS, collective_seconds, ring_hops, spec_links
from parcomp.errors import SpecError
from parcomp.reference.interpreter import run_spmd
from parcomp.report.explain import explain
from parcomp.spec import load_spec, parse_spec

from faults import model_of
from graphs import random_feeds

ROOT = Path(__file__).resolve().parents[1].parent
SPECS = ROOT / "specs"
MODELS = str(SPECS / "models.py")
SHIPPED = sorted(p.stem for p in SPECS.glob("*.pcs"))
TINY = str(SPECS / "tiny_relu_mlp.pcir")


@functools.lru_cache(maxsize=None)
def _model(spec_name):
    from parcomp.frontends.loader import load_model

    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return load_model(model_of(spec_name))[0]


def _compiled(spec_name, spec=None):
    return compile_graph(_model(spec_name), spec or load_spec(SPECS / f"{spec_name}.pcs"))


def _json(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_megatron_mlp_names_the_all_reduce_why_and_the_alternative(capsys):
    pytest.importorskip("transformers")
    spec = str(SPECS / "gpt2_mlp_tp2.pcs")
    assert main(["explain", f"{MODELS}:gpt2_mlp", "--spec", spec]) == 0
    text = capsys.readouterr().out
    assert "all_reduce over tp" in text and "gpt2_mlp_tp2.pcs:5" in text
    assert "row-parallel" in text and "partial sum" in text  # why: partial sums -> replicated output
    assert "instead reduce_scatter(dim 0) over tp + all_gather(dim 0) over tp" in text
    assert main(["explain", f"{MODELS}:gpt2_mlp", "--spec", spec, "--json"]) == 0
    (edge,) = _json(capsys)["explain"]["edges"]
    assert [s["kind"] for s in edge["steps"]] == ["all_reduce"]
    assert (edge["from"], edge["to"], edge["module"]) == ("[P]", "[R]", "c_proj")
    assert edge["producer"]["op"] == "matmul" and edge["consumers"][0]["source"] == "c_proj"
    rs_ag = next(a for a in edge["alternatives"] if a["kinds"].startswith("reduce_scatter"))
    assert [s["kind"] for s in rs_ag["steps"]] == ["reduce_scatter", "all_gather"]
    # a ring all_reduce sends what reduce_scatter + all_gather send, in one call instead of two
    assert rs_ag["bytes"] == edge["bytes"] == 2 * 16 * 32 * 4 // 2
    assert rs_ag["seconds"] > edge["seconds"]


@pytest.mark.parametrize("spec_name", SHIPPED)
def test_static_bytes_equal_what_the_interpreter_logs(spec_name):
    c = _compiled(spec_name)
    feeds = random_feeds(c.logical, 0)
    for n in c.logical.params:
        if n.name.endswith("exp_avg_sq"):
            feeds[n.name] = np.abs(feeds[n.name])
    if "step" in feeds:
        feeds["step"] = np.array(2.0, "f4")
    run = run_spmd(c.program, feeds)
    x = explain(c)
    static = sorted((s["name"], s["axis"], s["bytes"]) for e in x["edges"] for s in e["steps"] if s["bytes"])
    assert static == sorted((r["name"], r["axis"], r["bytes"]) for r in run.log)
    logged = {}
    for r in run.log:
        key = f"{r['axis']}/{c.program_.phases[r['name']]}"
        logged[key] = logged.get(key, 0) + r["bytes"]
    assert {k: v["bytes"] for k, v in x["totals"]["per_axis_phase"].items()} == logged
    assert sum(v["bytes"] for v in x["totals"]["per_axis"].values()) == sum(r["bytes"] for r in run.log)


def test_cross_node_axis_uses_the_inter_node_link_and_the_spec_overrides_it():
    c = _compiled("gpt2_mlp_dp2_tp2_train")
    x = explain(c)
    assert (x["links"]["dp"]["name"], x["links"]["tp"]["name"]) == ("infiniband", "nvlink")
    text = (SPECS / "gpt2_mlp_dp2_tp2_train.pcs").read_text().replace(
        "devices_per_node=2", "devices_per_node=2 inter=roce intra=hccs intra_latency_ns=5000")
    y = explain(_compiled("gpt2_mlp_dp2_tp2_train", parse_spec(text, "o.pcs")))
    assert (y["links"]["dp"]["name"], y["links"]["tp"]["name"]) == ("roce", "hccs")
    assert y["links"]["tp"]["hop_us"] == 5.0
    for axis in ("dp", "tp"):  # slower links, same bytes
        assert y["totals"]["per_axis"][axis]["bytes"] == x["totals"]["per_axis"][axis]["bytes"]
        assert y["totals"]["per_axis"][axis]["seconds"] > x["totals"]["per_axis"][axis]["seconds"]


def test_alpha_beta_model():
    nv = LINKS["nvlink"]
    assert ring_hops("all_reduce", 4) == 6 and ring_hops("all_gather", 4) == 3
    assert ring_hops("shard_slice", 4) == 0 and ring_hops("all_reduce", 1) == 0
    assert collective_seconds("shard_slice", 4, 0, nv) == 0.0
    one_gb = collective_seconds("all_gather", 2, 10 ** 9, nv)
    assert one_gb == pytest.approx((nv.call_us + nv.hop_us) * 1e-6 + 1 / nv.gb_per_s)
    assert collective_seconds("all_gather", 2, 10 ** 9, LINKS["pcie"]) > one_gb
    assert spec_links((("inter_gb_per_s", 100),))["inter"].gb_per_s == 100.0


@pytest.mark.parametrize("line, where, words", [
    ("topology intra=nvlnk", "t.pcs:2:16", "did you mean nvlink"),
    ("topology nodes=1 devices_per_node=2 inter=3", "t.pcs:2:43", "not a link class"),
    ("topology intra_gb_per_s=fast", "t.pcs:2:25", "give a whole number (GB/s)"),
    ("topology intra_gb_per_s=0", "t.pcs:2:25", "must be >= 1"),
    ("topology nodes=1 intra=pcie", "t.pcs:2:1", "needs both"),
])
def test_bad_link_keys_are_located(line, where, words):
    with pytest.raises(SpecError) as e:
        parse_spec(f"mesh tp=2\n{line}\n", "t.pcs")
    assert str(e.value.loc) == where and words in e.value.message


def test_links_without_nodes_leave_the_placement_unknown():
    s = parse_spec("mesh tp=2\ntopology intra=pcie\n", "t.pcs")
    assert s.topology is None and s.links == (("intra", "pcie"),)


def test_two_specs_side_by_side(capsys):
    spec_a, spec_b = str(SPECS / "torch_mlp_tp2.pcs"), str(SPECS / "torch_mlp_tp4.pcs")
    pytest.importorskip("torch")
    assert main(["explain", f"{MODELS}:torch_mlp", spec_a, spec_b]) == 0
    text = capsys.readouterr().out
    assert "torch_mlp_tp2.pcs" in text and "torch_mlp_tp4.pcs" in text and "est. comm time/step" in text
    assert main(["explain", f"{MODELS}:torch_mlp", spec_a, "--spec", spec_b, "--json"]) == 0
    a, b = _json(capsys)["compare"]
    assert (a["world_size"], b["world_size"]) == (2, 4)
    # tp=4 holds half the weights of tp=2 per rank, and its all_reduce takes more ring hops
    assert b["memory_bytes_per_rank"]["weights"] < a["memory_bytes_per_rank"]["weights"]


def test_explain_needs_a_spec(capsys):
    assert main(["explain", TINY, "--json"]) == 2
    err = _json(capsys)
    assert err["where"] == "--spec" and "needs a spec" in err["error"]


def test_plain_text_when_not_a_terminal_and_rich_tables_otherwise():
    import io

    from parcomp.report.explain_text import blocks, render_plain, render_rich

    x = explain(_compiled("tiny_relu_mlp_tp2"))
    plain = render_plain(blocks(x))
    assert "all_reduce over tp" in plain and "\x1b[" not in plain
    buf = io.StringIO()
    render_rich(blocks(x), buf)
    assert "all_reduce over tp" in buf.getvalue() and "┃" in buf.getvalue()  # a rich table frame


def _svg_texts(path) -> str:
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()  # SVG is XML: parse errors fail the test
    assert root.tag.endswith("svg")
    drawn = [e for e in root.iter() if e.tag.rsplit("}", 1)[-1] in ("path", "text", "rect", "polygon", "use")]
    assert len(drawn) > 10, f"{path} is blank"
    return " ".join("".join(e.itertext()) for e in root.iter() if e.tag.endswith("text"))


def test_plots_render_and_keep_what_parcomp_did_not_write(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    pytest.importorskip("transformers")
    out = tmp_path / "plots"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    spec = str(SPECS / "gpt2_mlp_dp2_tp2_train.pcs")
    args = ["explain", f"{MODELS}:gpt2_mlp", "--spec", spec, "--plots", str(out), "--json"]
    assert main(args) == 2  # a non-empty directory parcomp did not write: refused, untouched
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    capsys.readouterr()
    (out / "notes.txt").unlink()
    assert main(args) == 0
    plots = _json(capsys)["plots"]
    assert plots["files"] == ["devices.svg", "graph.svg", "memory.svg", "trace.json"]
    (out / "notes.txt").write_text("mine")
    assert main(args) == 0 and _json(capsys)["plots"]["kept"] == ["notes.txt"]  # written again, kept
    assert (out / "notes.txt").read_text() == "mine"
    graph = _svg_texts(out / "graph.svg")
    assert "all_reduce" in graph and "dp,tp" in graph and "[S(0), P]" in graph  # the loss: one joint call
    devices = _svg_texts(out / "devices.svg")
    assert all(f"r{r}" in devices for r in range(4)) and "node 1" in devices and "tp groups" in devices
    assert "peak live" in _svg_texts(out / "memory.svg")
    trace = json.loads((out / "trace.json").read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    c = _compiled("gpt2_mlp_dp2_tp2_train")
    assert len(slices) == 4 * len(c.program_.collectives)
    first = [e for e in slices if e["tid"] == 3]
    assert [e["args"]["value"] for e in first] == [n.name for n in c.program.nodes if c.program_.collective(n.name)]
    assert all(e["dur"] > 0 for e in first) and first[0]["args"]["group"] in ([2, 3], [1, 3])
    assert all(b["ts"] >= a["ts"] + a["dur"] - 1e-6 for a, b in zip(first, first[1:]))


def test_graph_dot_source_marks_collectives_and_labels_layouts():
    from parcomp.report.plots_graph import dot_source, layered_positions

    c = _compiled("tiny_relu_mlp_tp2")
    cols = {k.name: k for k in c.program_.collectives}
    src = dot_source(c.sharded, cols)
    assert src.startswith("digraph") and 'fillcolor="#f4a3a3"' in src and 'label="[P]"' in src
    pos = layered_positions(c.sharded, list(c.sharded.nodes))
    for n in c.sharded.nodes:  # every node below its operands
        assert all(pos[i][1] < pos[n.name][1] for i in n.inputs)


@pytest.mark.parametrize("schedule,micro,bubble", [("1f1b", 1, "(pp-1)/(m+pp-1) = 1/2"),
                                                   ("gpipe", 2, "(pp-1)/(m+pp-1) = 1/3"),
                                                   ("zb-h1", 2, "(pp-1)/(3m+pp-1) = 1/7"),
                                                   ("interleaved virtual=3", 2, "(pp-1)/(virtual*m+pp-1) = 1/7")])
def test_a_pipeline_spec_explains_its_stages_p2p_and_bubble(schedule, micro, bubble, capsys, tmp_path):
    """explain of a pp spec: each stage's modules and ranks, what it sends per microbatch
    (the bytes of the activation's type), the schedule and the bubble: the analytic one of
    parcomp/passes/pipeline/schedule.py with its formula, and the simulated one."""
    from parcomp.passes.pipeline.schedule import analytic

    spec = tmp_path / "pp.pcs"
    spec.write_text(f"mesh pp=2\ntrain loss=mse optimizer=sgd(lr=0.1) microbatches={micro} schedule={schedule}\n")
    assert main(["explain", f"{MODELS}:mlp_chain", "--spec", str(spec)]) == 0
    text = capsys.readouterr().out
    words = f"{micro} microbatch{'es' if micro > 1 else ''} of {2 // micro} x dp 1"  # mlp_chain's batch is 2
    assert f"pipeline: pp=2 schedule {schedule.split()[0]}" in text and words in text, text[-2000:]
    assert "pipeline stages" in text and bubble in text, text[-2000:]
    assert main(["explain", f"{MODELS}:mlp_chain", "--spec", str(spec), "--json"]) == 0
    p = _json(capsys)["pipeline"]
    virtual = 3 if "virtual" in schedule else 1
    assert len(p["stages"]) == 2 * virtual and p["bubble_analytic"] == analytic(p["schedule"], 2, micro, virtual)
    assert [s["ranks"] for s in p["stages"]] == [[k % 2] for k in range(2 * virtual)]
    mods = [m for s in p["stages"] for m in s["modules"]]
    assert mods == [str(i) for i in range(144)]  # mlp_chain's modules, each in one stage, in order
    for s in p["stages"][:-1]:  # one [microbatch, 32] float32 activation to the next stage
        assert [(v["shape"], v["bytes"]) for v in s["send"]] == [([2 // micro, 8, 32], 4 * 8 * 32 * (2 // micro))]
    assert p["stages"][-1]["send"] == [] and 0 <= p["bubble_simulated"] < 1
    assert "per-rank memory" in text and "stash peak" in text
    for r in p["ranks"]:  # per pp rank: its chunks' weights, grads (as large), state, stash
        mine = [s for s in p["stages"] if s["pp_rank"] == r["pp_rank"]]
        assert r["weight_bytes"] == r["grad_bytes"] == sum(s["weight_bytes"] for s in mine) > 0
        assert r["peak_inflight_bytes"] == sum(s["stash_bytes_per_microbatch"] * s["peak_inflight_microbatches"]
                                               for s in mine) > 0
        assert r["total_bytes"] == r["weight_bytes"] * 2 + r["optimizer_state_bytes"] + r["peak_inflight_bytes"]
        assert r["p2p_bytes_per_step"] == micro * sum(v["bytes"] for s in mine for v in s["send"] + s["recv"]) > 0


def test_moe_comparison_is_a_table_of_short_lines(capsys):
    """explain's TP vs EP comparison of an MoE layer is a table (rich on a terminal), no
    one-line row of every figure: every plain line is at most 130 characters."""
    assert main(["explain", f"{MODELS}:moe_block_skewed", "--spec", str(SPECS / "moe_ep2_train.pcs")]) == 0
    lines = capsys.readouterr().out.splitlines()
    i = next(k for k, ln in enumerate(lines) if "TP vs EP" in ln)
    assert lines[i + 2].split() == ["way", "collective", "bytes/rank", "load/rank", "max/mean", "comm", "us",
                                   "experts", "us", "step", "us"]
    assert lines[i + 3].startswith("TP inside every expert") and lines[i + 4].startswith("EP ")
    assert max(map(len, lines[i - 4:i + 5])) <= 130


def test_side_by_side_lists_the_chosen_changes_one_short_row_per_kind(capsys):
    """SP vs no SP side by side: the layout changes each spec chose are one row per kind with
    its count per spec (they sum to the edges of each explanation), no row of every edge."""
    specs = [str(SPECS / "gpt2_lm_tp2_sp_train.pcs"), str(SPECS / "gpt2_lm_tp2_train.pcs")]
    assert main(["explain", f"{MODELS}:gpt2_lm", *specs]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 100, max(lines, key=len)
    assert main(["explain", f"{MODELS}:gpt2_lm", *specs, "--json"]) == 0
    xs = _json(capsys)["compare"]
    i = next(k for k, ln in enumerate(lines) if ln.startswith("layout changes chosen"))
    rows = [ln.split("  ") for ln in lines[i + 1:] if ln.startswith("  ")]
    per_kind = [[c.strip() for c in r if c.strip()] for r in rows]
    assert lines[i].split()[-2:] == [str(len(x["edges"])) for x in xs]
    for j, x in enumerate(xs):
        assert sum(int(r[1 + j]) for r in per_kind if r[1 + j] != "-") == len(x["edges"])
    assert {r[0] for r in per_kind} == {e["kinds"] for x in xs for e in x["edges"]}
