"""Limits: inputs that used to hang, exhaust memory or print nonsense.

- A mesh has at most 2^20 ranks, checked at the mesh line before anything is
  enumerated; the topology check and placement summary are arithmetic.
- ``check`` / ``run`` estimate their memory first and refuse with the estimate and the limit.
- A mesh axis of size 1 needs no collective (and no local slice or mask).
- program.py never casts a checkpoint or input to another dtype; unused keys are noted once.
- Bytes for people are in human units (B, KiB, ... TiB); counts agree with their nouns.
"""
from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import numpy as np
import pytest

from parcomp.check.budget import (FALLBACK_LIMIT_BYTES, MEMORY_FRACTION, available_memory, check_estimate,
                            check_memory, memory_limit)
from parcomp.check.training import data_for, initial_state
from parcomp.cli.main import main
from parcomp.compile.compiler import compile_graph
from parcomp.cost.topology import axis_groups, check_topology, group_ranks
from parcomp.errors import ParcompError, SpecError
from parcomp.ir.text import parse_graph
from parcomp.ir.types import Mesh
from parcomp.reference.interpreter import run_spmd
from parcomp.reference.numpy_ops import run_unsharded
from parcomp.report.report import format_collectives, format_memory
from parcomp.spec import parse_spec
from parcomp.spec.model import MAX_MESH_RANKS
from parcomp.units import format_bytes, plural

from test_megatron import TINY

HUGE = """\
%x: f32[1000000,1000000] = input()
%w: f32[1000000,1000000] = param()
%y: f32[1000000,1000000] = matmul(%x, %w)
return %y
"""


def write(tmp_path, name, text) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# --- 1. the mesh bound; nothing enumerates ranks before the cheap checks --------------------


@pytest.fixture
def no_rank_loops(monkeypatch):
    """Make every per-rank walk of a Mesh an error: what runs under it is O(axes) by construction."""
    def refuse(*_args, **_kw):
        raise AssertionError("a rank of the mesh was enumerated")
    for name in ("groups", "coords", "rank_of"):
        monkeypatch.setattr(Mesh, name, refuse)


def test_huge_mesh_is_refused_at_the_mesh_line(no_rank_loops):
    with pytest.raises(SpecError) as info:
        parse_spec("mesh tp=1000000000000\nfc1.weight colwise\n", "big.pcs")
    err = info.value
    assert (err.loc.line, err.loc.col) == (1, 9)
    assert ("mesh tp=1000000000000 has 1000000000000 ranks, more than parcomp's limit of 1048576 (2^20"
            in err.message)


@pytest.mark.parametrize("mesh,col,count", [
    ("dp=1024 tp=1025", 17, "has 1049600 ranks"),              # the product passes the bound at tp
    ("tp=" + "9" * 5000 + " dp=2", 9, "has at least 10^4999 ranks"),  # too many digits for int()
])
def test_mesh_bound_points_at_the_size_that_passes_it(no_rank_loops, mesh, col, count):
    with pytest.raises(SpecError) as info:
        parse_spec(f"mesh {mesh}\n", "big.pcs")
    assert (info.value.loc.line, info.value.loc.col) == (1, col) and count in info.value.message


def test_largest_mesh_compiles_without_enumerating_ranks(no_rank_loops):
    tiny = parse_graph(TINY, "tiny.pcir")
    spec = parse_spec("mesh dp=1024 tp=1024\ntopology nodes=1024 devices_per_node=1024\n", "max.pcs")
    compiled = compile_graph(tiny, spec)  # everything replicated: legal, and O(axes) to compile
    assert compiled.report["world_size"] == MAX_MESH_RANKS and compiled.report["collectives"] == []
    place = compiled.report["placement"]
    assert place["groups"] == {"dp": {"size": 1024, "stride": 1024, "count": 1024},
                               "tp": {"size": 1024, "stride": 1, "count": 1024}}
    assert (place["intra_node_axes"], place["cross_node_axes"]) == (["tp"], ["dp"])
    with pytest.raises(SpecError, match="not divisible by mesh axis tp of size 1048576") as info:
        compile_graph(tiny, parse_spec(f"mesh tp={MAX_MESH_RANKS}\nfc1.weight colwise\n", "max.pcs"))
    assert info.value.loc.line == 2
    with pytest.raises(SpecError) as info:
        compile_graph(tiny, parse_spec(f"mesh tp={MAX_MESH_RANKS}\ntopology nodes=2 devices_per_node="
                                       f"{MAX_MESH_RANKS // 2}\n", "max.pcs"))
    assert ("tp group [0, 1, 2, 3, 4, 5, 6, ..., 1048575 (1048576 ranks)] spans nodes 0, 1 "
            in info.value.message)


def test_cli_on_a_huge_mesh_exits_2_at_once(tmp_path, capsys):
    model, spec = write(tmp_path, "tiny.pcir", TINY), write(tmp_path, "big.pcs",
                                                            "mesh tp=1000000000000\nfc1.weight colwise\n")
    assert main(["check", model, "--spec", spec]) == 2
    err = capsys.readouterr().err
    assert "big.pcs:1:9" in err and "more than parcomp's limit" in err and "Traceback" not in err


def _meshes():
    for naxes in (1, 2, 3):
        for sizes in itertools.product([1, 2, 3, 4], repeat=naxes):
            for names in itertools.permutations(("dp", "pp", "tp")[:naxes]):
                yield Mesh(tuple(zip(names, sizes)))


def test_topology_arithmetic_equals_enumerating_every_group():
    checked = 0
    for mesh in _meshes():
        for i in range(len(mesh.axes)):
            assert group_ranks(axis_groups(mesh, i)) == mesh.groups(i), (mesh, i)
        for per in (d for d in range(1, mesh.size + 1) if mesh.size % d == 0):
            spec = SimpleNamespace(mesh=mesh, topology=(mesh.size // per, per), file="t.pcs",
                                   topology_loc=None)
            spanning = {a: next((g for g in mesh.groups(i) if len({r // per for r in g}) > 1), None)
                        for i, a in enumerate(mesh.names)}
            if spanning.get("tp"):
                with pytest.raises(SpecError, match=r"tp group \[" + ", ".join(map(str, spanning["tp"]))):
                    check_topology(spec)
            else:
                got = check_topology(spec)
                assert got["cross_node_axes"] == [a for a in mesh.names if spanning[a]], (mesh, per)
            checked += 1
    assert checked > 300


# --- 2. memory budgets of check and run -------------------------------------------------


@pytest.mark.parametrize("command", ["check", "run"])
def test_check_and_run_refuse_a_model_larger_than_memory(tmp_path, capsys, command):
    model = write(tmp_path, "huge.pcir", HUGE)
    spec = write(tmp_path, "huge.pcs", "mesh tp=2\nw colwise\n")
    assert main([command, model, "--spec", spec, *(["--nproc", "2"] if command == "run" else [])]) == 2
    err = capsys.readouterr().err
    assert f"error: parcomp {command} would need about " in err and "TiB of memory: 2 ranks x " in err
    assert "the largest value is %x f32[1000000,1000000] (3.6 TiB)" in err
    assert "The limit is " in err and "Traceback" not in err and "ArrayMemoryError" not in err


def tiny_tp2():
    return compile_graph(parse_graph(TINY, "tiny.pcir"), parse_spec(
        "mesh tp=2\nfc1.weight colwise\nfc2.weight rowwise\noutput output replicated\n", "t.pcs"))


def test_check_estimate_counts_every_value_of_every_rank():
    compiled = tiny_tp2()
    est = check_estimate(compiled)
    local = sum(n.type.nbytes for n in compiled.program.nodes)
    assert est["ranks"] == 2 and est["per_rank"] == 1024 + local + 128 * len(compiled.program.nodes)
    assert est["total"] == 2 * est["per_rank"] + est["reference"]
    assert check_memory(compiled, "check", available=2 * est["total"])["limit"] == est["total"]
    with pytest.raises(ParcompError) as info:
        check_memory(compiled, "check", available=est["total"])
    limit = format_bytes(int(est["total"] * MEMORY_FRACTION))
    assert (f"The limit is {limit} (50% of the {format_bytes(est['total'])} available on this machine)"
            in info.value.message)


def test_memory_limit_is_a_fraction_of_what_is_available():
    assert memory_limit(None) == FALLBACK_LIMIT_BYTES
    assert memory_limit(10 * 1024 ** 3) == int(10 * 1024 ** 3 * MEMORY_FRACTION)
    avail = available_memory()
    assert avail is None or avail > 0


# --- 3. a mesh axis of size 1 needs no collective ----------------------------------------


def int_feeds(graph, seed=0):
    """Small integer values: every float32 sum is exact, so any order gives the same bits."""
    rng = np.random.default_rng(seed)
    return {n.name: rng.integers(-3, 4, n.type.shape).astype(n.type.dtype)
            for n in graph.nodes if n.op in ("input", "param")}


TP_RULES = "fc1.weight colwise\nfc2.weight rowwise\noutput output replicated\n"
TRAIN = "train loss=mse optimizer=sgd(lr=0.5)\n"


def run_both(compiled):
    if compiled.report.get("training"):
        feeds = int_feeds(compiled.unsharded)
        feeds.update({k: np.round(v * 4) for k, v in data_for(compiled.logical, 0).items()})
        feeds = initial_state(compiled.logical, feeds)
    else:
        feeds = int_feeds(compiled.unsharded)
    return run_spmd(compiled.program, feeds).outputs(compiled.program), run_unsharded(compiled.logical, feeds)


@pytest.mark.parametrize("train", ["", TRAIN])
def test_tp1_has_no_collective_and_equals_unsharded(train):
    spec = parse_spec("mesh tp=1\n" + TP_RULES + train, "t.pcs")
    compiled = compile_graph(parse_graph(TINY, "tiny.pcir"), spec)
    assert compiled.report["collectives"] == []
    assert not [n.op for n in compiled.program.nodes if n.attr("axis") is not None]  # no slice, no mask
    got, want = run_both(compiled)
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("train", ["", TRAIN])
def test_dp1_tp2_has_only_the_tp2_collectives(train):
    tiny = parse_graph(TINY, "tiny.pcir")
    alone = compile_graph(tiny, parse_spec("mesh tp=2\ninput x replicated\n" + TP_RULES + train, "t.pcs"))
    # x split over dp (legal: dp=1 divides anything); one dp rank holds all of it: nothing to gather
    both = compile_graph(tiny, parse_spec("mesh dp=1 tp=2\ninput x [S(0), R]\n" + TP_RULES + train, "t.pcs"))
    kinds = [(r["kind"], r["axis"], r["phase"], r["bytes"]) for r in both.report["collectives"]]
    assert kinds and kinds == [(r["kind"], r["axis"], r["phase"], r["bytes"])
                               for r in alone.report["collectives"]]
    assert {r["axis"] for r in both.report["collectives"]} == {"tp"}
    got, want = run_both(both)
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_tp1_check_prints_no_collective_and_one_rank(tmp_path, capsys):
    model, spec = write(tmp_path, "tiny.pcir", TINY), write(tmp_path, "one.pcs", "mesh tp=1\n" + TP_RULES)
    assert main(["check", model, "--spec", spec]) == 0
    out = capsys.readouterr().out
    assert "collectives: none" in out and "numpy interpreter, 1 rank, in float64:" in out


# --- 4. program.py: no silent dtype cast, unused keys noted once --------------------------


@pytest.mark.slow
def test_program_refuses_a_float64_checkpoint_and_notes_unused_keys(tmp_path):
    from parcomp_backends.torch import run_torchrun
    from parcomp_backends.torch.launch import write_program

    from test_torch_backend import TINY_PARAMS, TINY_X, tiny_compiled

    write_program(tiny_compiled(), tmp_path)
    ckpt = {**TINY_PARAMS, "fc1.weight": TINY_PARAMS["fc1.weight"].astype("f8"),
            "fc3.weight": np.zeros(3, "f4"), "extra": np.zeros(1, "f4")}
    res = run_torchrun(tmp_path, 2, ckpt, {"x": TINY_X}, timeout=90)
    assert res.returncode != 0
    assert (f"param 'fc1.weight' in {tmp_path / 'model.pt'} has dtype torch.float64, but the program "
            f"was compiled for torch.float32; nothing is cast") in res.stderr
    assert res.stderr.count("program.py: note:") == 1  # rank 0 only, once
    assert (f"program.py: note: checkpoint file {tmp_path / 'model.pt'} has 2 keys this "
            f"program does not use: extra, fc3.weight\n") in res.stderr


# --- 5. human units -------------------------------------------------------------------------


@pytest.mark.parametrize("n,text", [
    (0, "0 B"), (1, "1 B"), (512, "512 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
    (1024 ** 2 - 1, "1.0 MiB"), (1024 ** 2, "1.0 MiB"), (3 * 1024 ** 2 // 2, "1.5 MiB"),
    (1024 ** 3 - 1, "1.0 GiB"), (1024 ** 4, "1.0 TiB"), (int(7.3 * 1024 ** 4), "7.3 TiB"),
    (2 * 10 ** 12, "1.8 TiB"), (1024 ** 5, "1024.0 TiB"),
])
def test_format_bytes_at_the_unit_boundaries(n, text):
    assert format_bytes(n) == text


def test_format_bytes_rejects_negative_counts():
    with pytest.raises(ValueError):
        format_bytes(-1)


def test_memory_and_collective_tables_use_human_units():
    report = tiny_tp2().report
    line = format_memory(report)
    assert line == ("memory per rank: weights 32 B, gradients 0 B, optimizer state 0 B, "
                    "saved activations 0 B, peak live 56 B")
    huge = {"memory_bytes_per_rank": {"weights": 2 * 10 ** 12}}
    assert format_memory(huge) == "memory per rank: weights 1.8 TiB"
    table = format_collectives(report["collectives"])
    assert "bytes/rank" in table and " 8 B " in table


def test_plural():
    assert [plural(1, "rank"), plural(2, "rank"), plural(0, "node"), plural(1, "gloo rank")] == \
        ["1 rank", "2 ranks", "0 nodes", "1 gloo rank"]


def test_report_json_keeps_exact_bytes(tmp_path, capsys):
    model = write(tmp_path, "tiny.pcir", TINY)
    spec = write(tmp_path, "tp.pcs", "mesh tp=2\n" + TP_RULES)
    assert main(["compile", model, "--spec", spec, "-o", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["memory_bytes_per_rank"]["weights"] == 32 and report["collectives"][0]["bytes"] == 8
    assert "weights 32 B" in capsys.readouterr().out
