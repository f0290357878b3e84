"""Compile speed, post-pass work: the faster emitter, Program/report
builders and verifier give what the plain code gives. Each reference below is the code
before the change (or a plain statement of what it computes): comment wrapping is
``textwrap.wrap``; ``_plain_code`` is the emitter's per-node text without its shortcuts;
``_plain_verify`` checks every node of every graph (no memo, no alike-node dedup);
``_plain_peak`` / ``_plain_saved`` are the liveness peak and saved activations as first
written. No timing is asserted.
"""
from __future__ import annotations

import dataclasses
import os
import random
import textwrap

import pytest

from parcomp.errors import VerifyError
from parcomp.ir.types import Partial, Shard, TensorType

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..")
SPECS = os.path.join(ROOT, "specs")


def _compiled(spec_name, factory):
    from parcomp.compile.compiler import compile_graph
    from parcomp.frontends.loader import load_model
    from parcomp.spec import load_spec

    graph, _, _ = load_model(os.path.join(SPECS, f"models.py:{factory}"))
    return compile_graph(graph, load_spec(os.path.join(SPECS, spec_name)))


CASES = [("gpt2_lm_tp2_sp_train.pcs", "gpt2_lm"), ("attention_cp2_ring_balanced_train.pcs", "causal_attention"),
         ("attention_cp2_tp2_train.pcs", "causal_attention"), ("moe_ep2_tp2_train.pcs", "moe_block"),
         ("gpt2_lm_dp2_tp2_train.pcs", "gpt2_lm")]


@pytest.fixture(scope="module")
def compiled():
    return {spec: _compiled(spec, factory) for spec, factory in CASES}


# ---- comments: emit_text.wrap is textwrap.wrap ----

def test_wrap_gives_textwrap_lines():
    from parcomp_backends.torch.emit.text import wrap

    rng = random.Random(17)
    alphabet = "ab %:-.,'()[]S0_"
    for _ in range(20000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 70)))
        if rng.random() < 0.05:
            text = text.replace(" ", rng.choice("\t\n\xa0"), 1)  # other whitespace: textwrap's own
        width = rng.randint(1, 40)
        first = " " * rng.randint(0, 6) + rng.choice(["", "# "])
        later = " " * rng.randint(0, 6) + rng.choice(["", "#   "])
        assert wrap(text, width, first, later) == textwrap.wrap(
            text, width, initial_indent=first, subsequent_indent=later, break_long_words=False,
            break_on_hyphens=False), (text, width, first, later)


# ---- the emitter's per-node text ----

def _plain_code(n, args, program=None) -> str:
    """emit.node_code before the speed pass: every helper asked for every node."""
    from parcomp_backends.torch import emit as E
    from parcomp_backends.torch.emit.cp import cp_kw
    from parcomp_backends.torch.emit.cp_ring import ring_key, ring_kw
    from parcomp_backends.torch.emit.moe import moe_key
    from parcomp_backends.torch.emit.norms import norm_kw
    from parcomp_backends.torch.emit.reduce import reduce_key, reduce_kw

    table = (E.ASYNC_FORMATS if n.attr("async_op") else E.IN_PLACE_FORMATS if n.attr("inplace") else E.OP_FORMATS)
    key = ring_key(n, moe_key(n, reduce_key(n) + ("_" if n.attr("async_op") and n.attr("inplace") else "")))
    if key not in table:
        raise E.EmitError(f"op {n.op!r} (%{n.name}) has no torch mapping")
    if n.op == "sum" and not n.attr("dims"):
        return args[0]
    if n.op == "pow_grad" and n.attr("exponent") == 2.0:
        return f"{args[0]} * ({args[1]} * 2.0)"
    if n.type.dtype not in E.TORCH_DTYPES:
        raise E.EmitError(f"%{n.name} has dtype {n.type.dtype}, which has no torch name")
    attrs = dict(E.ATTR_DEFAULTS.get(n.op, {}))
    attrs.update(n.attrs)
    kw = {k: E.py_literal(v) for k, v in attrs.items()}
    kw["local_shape"] = repr(tuple(n.type.shape))
    kw["dtype"] = E.TORCH_DTYPES[n.type.dtype]
    kw["args"] = ", ".join(args)
    kw.update(norm_kw(program, n, args))
    kw.update(reduce_kw(program, n, E.py_literal))
    kw.update(cp_kw(program, n))
    kw.update(ring_kw(n))
    if n.op == "expand":
        kw["kept_shape"] = repr(tuple(1 if d in n.attr("dims") else s for d, s in enumerate(n.type.shape)))
    if n.op == "sdpa_grad":
        kw["wrt_index"] = "qkv".index(n.attr("wrt"))
    return table[key].format(*args, **kw)


def test_code_gives_the_plain_text_on_every_node(compiled):
    import json

    from parcomp_backends.torch import emit as E

    for spec, c in compiled.items():
        program = c.program
        names = E.python_names(c.program_)
        for n in program.nodes:
            if n.op in ("input", "param"):
                continue
            args = [names[i] for i in n.inputs]
            assert E.node_code(n, args, program) == _plain_code(n, args, program), (spec, n)
            assert E.py_literal(n.name) == json.dumps(n.name)


# ---- the Program and the report ----

def _plain_peak(graph) -> int:
    from parcomp.ir.liveness import frees_of, storage_roots

    roots, holders, size, live, peak = storage_roots(graph), {}, {}, 0, 0
    for n in graph.nodes:
        r = roots[n.name]
        if r == n.name:
            size[r] = n.type.nbytes
            live += size[r]
        holders.setdefault(r, set()).add(n.name)
        peak = max(peak, live)
        for v in frees_of(n):
            holders[roots[v]].discard(v)
            if not holders[roots[v]]:
                live -= size[roots[v]]
    return int(peak)


def _plain_saved(program) -> int:
    graph, phase, users = program.graph, program.phases, program.graph.users()

    def read_by_backward(name):
        return any(phase[u] == "backward" for u in users[name])

    saved = [n.name for n in graph.nodes if n.op not in ("input", "param")
             and phase[n.name] in ("forward", "loss") and read_by_backward(n.name)]
    saved += [n.name for n in graph.inputs if read_by_backward(n.name)]
    # and what fused kernels keep for the backward: an attention's float32 logsumexp per query
    # row, a layer norm's mean and rstd per row (float32 or wider)
    from parcomp.ir.liveness import saved_attention, saved_layer_norm
    from parcomp.ir.types import DTYPE_BYTES

    def rows(t):
        return int(t.nbytes) // t.shape[-1] // DTYPE_BYTES[t.dtype]

    kernel = sum(rows(graph[v].type) * 4 for v in saved_attention(graph))
    kernel += sum(rows(graph[v].type) * 2 * max(4, DTYPE_BYTES[graph[v].type.dtype]) for v in saved_layer_norm(graph))
    return int(sum(graph[n].type.nbytes for n in set(saved))) + kernel


def test_program_and_report_facts_are_the_plain_ones(compiled):
    from parcomp.ir.liveness import peak_bytes
    from parcomp.compile.build import _provenance, _provenances

    for spec, c in compiled.items():
        prog, mem = c.program_, c.report["memory_bytes_per_rank"]
        assert mem["peak_live"] == peak_bytes(prog.graph) == _plain_peak(prog.graph), spec
        assert mem["saved_activations"] == _plain_saved(prog), spec
        assert _provenances(prog.graph.nodes) == {n.name: _provenance(n) for n in prog.graph.nodes}
        assert prog.graph.params == [n for n in prog.graph.nodes if n.op == "param"]
        assert prog.graph.params is not prog.graph.params  # a new list each time: callers may change it
        if prog.train is not None:
            state = {n.name for n in prog.graph.params if n.phase == "optimizer"}
            assert prog.train.state == tuple(x for x in prog.train.carried if x in state)


# ---- the verifier: memo and alike-node dedup find what checking every node finds ----

def _plain_verify(graph):
    """Every check on every node, in the verifier's order (no memo, no dedup)."""
    from parcomp.passes import verify as V

    V._check_ssa(graph, {}.get)
    if graph.stage == "global":
        V._check_types(graph, graph.nodes)
    if graph.mesh is not None:
        V.check_layout_shapes(graph, graph.mesh, graph.nodes)
    if graph.mesh is not None and all(n.layout is not None for n in graph.nodes):
        for n in graph.nodes:
            V._check_layouts(graph, n)


def _outcome(fn, graph):
    try:
        fn(graph)
    except VerifyError as e:
        return e.node, e.message
    return None


def _mutants(graph, rng, count):
    """Graphs with one node changed: its type, layout, operand layouts, an operand, or a word."""
    picks = [n for n in graph.nodes if n.inputs]
    for _ in range(count):
        n = rng.choice(picks)
        kind = rng.randrange(5)
        if kind == 0:
            new = dataclasses.replace(n, type=TensorType(tuple(n.type.shape) + (2,), n.type.dtype))
        elif kind == 1 and n.layout is not None:
            new = dataclasses.replace(n, layout=tuple(Partial() if rng.random() < 0.5 else Shard(0) for _ in n.layout))
        elif kind == 2 and n.layout is not None:
            new = dataclasses.replace(n, in_layouts=tuple(tuple(Partial() for _ in n.layout) for _ in n.inputs))
        elif kind == 3:
            new = dataclasses.replace(n, inputs=tuple(reversed(n.inputs)))
        else:
            new = n.with_attrs(reason="moved", origin="a rule", frees="")
        yield graph.with_nodes([new if m is n else m for m in graph.nodes])


def test_verify_with_memo_and_dedup_fails_where_checking_every_node_fails():
    from parcomp.passes.pass_list import run_passes
    from parcomp.passes.verify import verify
    from parcomp.spec import load_spec
    from parcomp.frontends.loader import load_model

    graph, _, _ = load_model(os.path.join(SPECS, "models.py:gpt2_lm"))
    stages = list(run_passes(graph, load_spec(os.path.join(SPECS, "gpt2_lm_tp2_sp_train.pcs"))).values())
    rng, failed, memo = random.Random(3), 0, {}
    for before, g in zip(stages, stages[1:]):
        verify(before, memo)
        for bad in _mutants(g, rng, 8):
            want = _outcome(_plain_verify, bad)
            assert _outcome(verify, bad) == want
            assert _outcome(lambda x: verify(x, memo), bad) == want
            failed += want is not None
        verify(g, memo)  # the memo, after failed calls, still passes the good graph
    assert failed >= 10  # the mutants do break invariants
