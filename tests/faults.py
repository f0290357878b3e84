"""Faults injected into a compiled program as the numpy interpreter runs it: the errors a
differential check must catch (tests/check/test_verdict.py, tools/noise_floor.py).

- ``scale``: one collective's result times (1 + 1e-6) on every rank;
- ``bias``: one collective's operand plus a bias vector of 1e-6 of its scale on every rank (a
  bias added on each rank before the sum, Megatron's row-parallel bias bug in small; a vector,
  not a constant, which a following norm would cancel);
- ``drop``: one rank's operand of one collective taken as zeros (a dropped partial sum, a
  missing shard of a gather);
- ``swap``: the shards 0 and 1 of one split input or parameter exchanged on every rank that
  holds them (a wrong slice).

Each is a context manager patching the interpreter's tables for the node (or source) named.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np

from parcomp.ir.transitions import TRANSITIONS
from parcomp.ir.types import Shard
from parcomp.reference import interpreter
from parcomp.reference.moe_packed import SlotRows

FACTOR = 1 + 1e-6
KINDS = ("scale", "bias", "drop", "swap")
SPECS = Path(__file__).resolve().parent.parent / "specs"
#: every shipped spec, by name (specs/NAME.pcs)
SHIPPED = sorted(p.stem for p in SPECS.glob("*.pcs"))


def model_of(spec: str) -> str:
    """The model a shipped spec is written for (``FILE.py:FACTORY`` or a .pcir path)."""
    if spec.startswith("tiny_relu_mlp"):
        return str(SPECS / "tiny_relu_mlp.pcir")
    factory = spec.split("_tp")[0].split("_dp")[0].split("_ep")[0]
    if spec.startswith("moe_") and not spec.startswith("moe_lm"):
        factory = "moe_block_shared" if spec.startswith("moe_shared") else "moe_block"
    if spec.startswith("attention_cp"):
        factory = "causal_attention"
    return f"{SPECS / 'models.py'}:{factory}"


def collectives(program) -> list:
    """The names of ``program``'s collectives, in program order."""
    return [n.name for n in program.nodes if n.op in TRANSITIONS and TRANSITIONS[n.op].collective]


def reductions(program) -> list:
    """The names of ``program``'s summing collectives (all_reduce, reduce_scatter)."""
    return [n.name for n in program.nodes if n.op in ("all_reduce", "reduce_scatter")
            and n.attr("reduce_op") != "max"]


def split_sources(program) -> list:
    """The names of ``program``'s inputs and params split over some mesh axis of size > 1,
    optimizer state (zeros in a first step) left out."""
    state = (".momentum_buffer", ".exp_avg", ".exp_avg_sq")
    return [n.name for n in program.nodes if n.op in ("input", "param") and not n.name.endswith(state)
            and any(isinstance(p, Shard) and program.mesh.sizes[a] > 1 for a, p in enumerate(n.layout))]


def target(program, kind: str) -> str:
    """The node ``kind`` is injected at by default: the first summing collective (the first
    collective where there is none), or for ``swap`` the first split source."""
    if kind == "swap":
        return split_sources(program)[0]
    return (reductions(program) or collectives(program))[0]


def _on_rows(f, x):
    """``f`` applied to an array, or to the routed rows of MoE slots held packed."""
    return x.with_rows(f(x.rows)) if isinstance(x, SlotRows) else f(np.asarray(x))


def _faulty(f, kind, name):
    def op(xs, n, *rest):
        if n.name != name:
            return f(xs, n, *rest)
        if kind == "scale":
            return [_on_rows(lambda y: y * np.asarray(FACTOR, y.dtype), y) for y in f(xs, n, *rest)]
        xs = list(xs)
        if kind == "bias":
            last = (xs[0].rows if isinstance(xs[0], SlotRows) else np.asarray(xs[0])).shape[-1:]
            bias = np.random.default_rng(0).standard_normal(last)
            xs = [_on_rows(lambda x: x + (1e-6 * float(np.abs(x).max() or 1.0) * bias).astype(x.dtype), x)
                  for x in xs]
        elif kind == "drop":
            xs[-1] = _on_rows(np.zeros_like, xs[-1])
        return f(xs, n, *rest)
    return op


@contextmanager
def injected(kind: str, name: str):
    """Run every program on the interpreter with fault ``kind`` at node ``name``."""
    if kind == "swap":
        real = interpreter.split_for_ranks
        mesh_of = {}

        def split(full, layout, mesh, rng=None):
            pieces = real(full, layout, mesh, rng)
            if mesh_of.get("name") == name:
                a = next(a for a, p in enumerate(layout) if isinstance(p, Shard) and mesh.sizes[a] > 1)
                at = {mesh.coords(r): r for r in range(mesh.size)}
                pieces = list(pieces)
                for r in range(mesh.size):
                    c = mesh.coords(r)
                    if c[a] == 0:  # its partner holds shard 1 and is the same on every other axis
                        o = at[c[:a] + (1,) + c[a + 1:]]
                        pieces[r], pieces[o] = pieces[o], pieces[r]
            return pieces

        real_source = interpreter.source_array

        def source(node, value):
            mesh_of["name"] = node.name
            return real_source(node, value)

        interpreter.split_for_ranks, interpreter.source_array = split, source
        try:
            yield
        finally:
            interpreter.split_for_ranks, interpreter.source_array = real, real_source
        return
    saved, ragged = dict(interpreter._LAYOUT_OPS), interpreter.ragged_all_to_all
    packed = interpreter._packed_layout_op
    for op, f in saved.items():
        interpreter._LAYOUT_OPS[op] = _faulty(f, kind, name)
    interpreter.ragged_all_to_all = _faulty(ragged, kind, name)  # MoE's token exchange
    interpreter._packed_layout_op = _faulty(packed, kind, name)  # collectives of MoE slots held packed
    try:
        yield
    finally:
        interpreter._LAYOUT_OPS.update(saved)
        interpreter.ragged_all_to_all = ragged
        interpreter._packed_layout_op = packed
