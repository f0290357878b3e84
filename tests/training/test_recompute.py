"""``train ... recompute=all``: full recomputation with one checkpoint per layer.

Only the values one layer hands to the next are kept; everything else backward reads
(matmul outputs, bias sums, activations) is recomputed from them where that layer's backward
starts, and dies with it. Checked three ways: the report's model (saved activations, liveness
peak), a measurement of the emitted torch program (live CPU tensor bytes of one
``train_step``, counted by a TorchDispatchMode: tests/live_bytes.py), and values: the step
equals the step without recomputation, sharded (TP=2) and unsharded.
"""
from __future__ import annotations

import numpy as np
import torch

from parcomp.compile.compiler import compile_graph
from parcomp.reference.interpreter import run_spmd
from parcomp.reference.numpy_ops import run_unsharded
from parcomp.spec.train_options import layer_checkpoints
from parcomp_backends.torch import emit_program

from graphs import mlp_graph, random_feeds, spec as parse
from live_bytes import step_peak
from numerics import assert_all_equivalent

WIDTHS = [16, 64, 64, 64, 16]


def _build(mesh, rules, extra):
    g = mlp_graph((64, 8), WIDTHS, [True] * 4, ["gelu"] * 3)
    return compile_graph(g, parse(f"mesh {mesh}\n{rules}train loss=mse optimizer=sgd(lr=0.1) "
                                  f"input_grads=no {extra}\n"))


TP2 = ("tp=2", "l0.weight colwise\nl1.weight rowwise\n")


def test_recompute_all_keeps_only_layer_boundaries_and_changes_no_value():
    plain, sel, full = (_build(*TP2, e) for e in ("", "recompute=selective", "recompute=all"))
    rc = sorted(n.name for n in full.logical.nodes if n.name.startswith("rc."))
    assert rc == sorted(f"rc.l{k}.{v}" for k in range(3) for v in ("mm", "out"))  # matmuls recomputed too
    keep = layer_checkpoints(mlp_graph((64, 8), WIDTHS, [True] * 4, ["gelu"] * 3))
    assert {"l0.act", "l1.act", "l2.act"} <= keep and not keep & {"l0.mm", "l1.out"}
    # the row-parallel matmul's all_reduce runs again in backward, on the recomputed value
    assert [r["phase"] for r in full.report["collectives"]] == ["forward", "backward"]
    m = [c.report["memory_bytes_per_rank"] for c in (plain, sel, full)]
    assert m[2]["saved_activations"] < m[0]["saved_activations"]
    assert m[2]["peak_live"] < m[1]["peak_live"] < m[0]["peak_live"]
    feeds = random_feeds(full.logical)
    want = run_unsharded(plain.logical, feeds)
    assert_all_equivalent(run_unsharded(full.logical, feeds), want)
    run = run_spmd(full.program, feeds)
    assert_all_equivalent(run.outputs(full.program), want)
    # the interpreter's own live-bytes peak (same program order and frees) drops too
    assert max(run.peak_bytes) < max(run_spmd(plain.program, feeds).peak_bytes)


def test_recompute_all_lowers_the_measured_peak_of_the_torch_program(tmp_path):
    """program.py (world size 1) run in-process: its measured peak of live CPU tensor bytes
    in one train_step is lower with recompute=all than without, and so is the report's."""
    peaks, reports = {}, {}
    for mode in ("none", "all"):
        c = _build("tp=1", "", f"recompute={mode}")
        path = tmp_path / f"program_{mode}.py"
        path.write_text(emit_program(c, "cpu"))
        feeds = random_feeds(c.logical)
        params = {n.name: torch.from_numpy(np.asarray(feeds[n.name])) for n in c.logical.params}
        inputs = {n.name: torch.from_numpy(np.asarray(feeds[n.name])) for n in c.logical.inputs}
        peaks[mode] = step_peak(str(path), params, inputs)
        reports[mode] = c.report["memory_bytes_per_rank"]["peak_live"]
    assert peaks["all"] < peaks["none"], peaks
    assert reports["all"] < reports["none"], reports
    # the measurement sees the activations: at least the largest one (64*8*64 floats)
    assert peaks["all"] >= 64 * 8 * 64 * 4
