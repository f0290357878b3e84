"""Compile speed of deep transformers: the shortcuts that make a
deep model's compile linear in its depth give exactly the plans of the full work.

- shard-prop: nodes of repeated blocks share one option list (a relayout's ``origin``, the
  words naming its spec rule, is not part of the key), and the local-move search skips a
  node none of whose neighbourhood changed since its last attempt kept nothing;
- the verifier does not re-check a node object met again with the same operand objects.
- whole-program facts the emitter and the Program read per node (balanced chunking, a
  collective's record, a bucket's parts) are found once per program, as a scan finds them.
"""
from __future__ import annotations

import dataclasses
import os

import pytest

from parcomp.errors import VerifyError
from parcomp.ir.types import TensorType
from parcomp.passes import shard_prop as sp
from parcomp.passes.pass_list import passes_for, run_passes
from parcomp.passes.verify import verify
from parcomp.spec import load_spec

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

SPECS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "specs")


def _gpt2(n_layer):
    from transformers import GPT2Config, GPT2LMHeadModel

    from parcomp.frontends.torch.export import import_torch

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=101, n_positions=64, n_embd=32, n_layer=n_layer, n_head=4,
                        bos_token_id=0, eos_token_id=0, use_cache=False, attn_implementation="sdpa")
    return import_torch(GPT2LMHeadModel(config).eval(), (torch.randint(0, 101, (2, 8)),), ["input_ids"])


def _before_shard_prop(n_layer, spec_name):
    spec = load_spec(os.path.join(SPECS, spec_name))
    passes = passes_for(spec)
    upto = [p.name for p in passes].index("shard-prop")
    return list(run_passes(_gpt2(n_layer), spec, passes[:upto]).values())[-1]


def _improve_every_node(prob, sol, rounds=8):
    """The local-move search without skipping: every node tried in every round."""
    sol = dict(sol)
    for _ in range(rounds):
        if not [n for n in reversed(prob.g.nodes) if n.name in sol and prob._best_move(sol, n)]:
            break
    return sol


@pytest.mark.parametrize("n_layer,spec_name", [(2, "gpt2_lm_tp2_train.pcs"), (3, "gpt2_lm_tp2_sp_train.pcs")])
def test_skipping_unchanged_nodes_gives_the_plan_of_trying_every_node(n_layer, spec_name):
    prob = sp.ShardProblem(_before_shard_prop(n_layer, spec_name))
    for start in (prob.dp_solution(), prob.greedy_solution()):
        calls = []
        full = _improve_every_node(prob, start)
        move = prob._best_move
        prob._best_move = lambda sol, n: calls.append(n.name) or move(sol, n)
        fast = prob.improve(start)
        del prob._best_move
        assert fast == full
        assert all(fast[k][0] is full[k][0] and fast[k][1] is full[k][1] for k in full)  # interned
        assert len(calls) < 2 * len(start)  # a second round tries only what moved around it


def test_repeated_blocks_share_option_lists_and_the_plan_is_unchanged(monkeypatch):
    g = _before_shard_prop(3, "gpt2_lm_tp2_train.pcs")
    prob = sp.ShardProblem(g)
    outs = [f"opt.transformer.h.{b}.attn.c_attn.weight.adamw_param.as_output" for b in range(3)]
    assert len({g[o].attr("origin") for o in outs}) == 3  # the words differ per block ...
    assert prob.options[outs[0]] is prob.options[outs[1]] is prob.options[outs[2]]  # ... the options not
    shared = sp.shard_prop(g)
    monkeypatch.setattr(sp, "_strategy_attrs", lambda n: n.attrs)  # one option list per origin
    alone = sp.ShardProblem(g)
    assert alone.options[outs[0]] is not alone.options[outs[1]]
    separate = sp.shard_prop(g)
    assert [(n.layout, n.in_layouts) for n in shared.nodes] == [(n.layout, n.in_layouts) for n in separate.nodes]
    assert {k: v for k, v in shared.search.items() if k != "seconds"} == \
        {k: v for k, v in separate.search.items() if k != "seconds"}


def test_verify_memo_rechecks_a_changed_node_and_names_it_as_without_memo():
    g = _before_shard_prop(1, "gpt2_lm_tp2_train.pcs")
    memo = {}
    verify(g, memo)
    victim = next(n for n in g.nodes if n.op == "gelu" or n.op == "add")
    bad_type = TensorType(tuple(victim.type.shape) + (1,), victim.type.dtype)
    bad = g.with_nodes([dataclasses.replace(n, type=bad_type) if n is victim else n for n in g.nodes])
    with pytest.raises(VerifyError) as plain:
        verify(bad)
    with pytest.raises(VerifyError) as memoised:
        verify(bad, memo)
    assert memoised.value.message == plain.value.message and memoised.value.node == victim.name
    # an unchanged node whose operand changed is checked again: a param (a source: no type
    # check of its own) given another shape passes, and its first reader, the very node
    # object that passed before, fails on its operand's type
    param = next(p for p in g.params if any(p.name in n.inputs and n.op != "relayout" for n in g.nodes))
    reader = next(n for n in g.nodes if param.name in n.inputs)
    other = dataclasses.replace(param, type=TensorType(tuple(param.type.shape) + (1,), param.type.dtype))
    moved = g.with_nodes([other if n is param else n for n in g.nodes])
    assert moved[reader.name] is reader
    with pytest.raises(VerifyError) as plain:
        verify(moved)
    with pytest.raises(VerifyError) as memoised:
        verify(moved, memo)
    assert memoised.value.node == plain.value.node == reader.name
    assert memoised.value.message == plain.value.message
    verify(g, memo)  # a failed call leaves the memo as it was: the graph that passed passes


# ---- compile speed, second pass (speed17): shard-prop's costs, the verifier, Node copies ----
# The reference functions below are shard-prop's before the second pass, written plainly:
# every read priced every time, every option of every node tried, a fresh dict per copy.

def _naive_value_cost(prob, sol, name):
    reads = [(u, k) for u in dict.fromkeys(prob.users[name]) for k, i in enumerate(prob.g[u].inputs) if i == name]
    src, ty = prob.layout(sol, name), prob.g[name].type
    seen, total = set(), 0.0
    for u, k in reads:
        lay = sol[u][0][k]
        if id(lay) not in seen:
            seen.add(id(lay))
            total += prob.plan_cost(src, lay, ty, name)
    return total


def _naive_compute(prob, sol, name):
    return next(c for c, i, o in prob.options[name] if i is sol[name][0] and o is sol[name][1])


def _naive_total(prob, sol):
    compute = sum(_naive_compute(prob, sol, name) for name in sol)
    return compute + sum(_naive_value_cost(prob, sol, n.name) for n in prob.g.nodes)


def _naive_best_move(prob, sol, n):
    feeders = [i for i in dict.fromkeys(n.inputs) if i in sol and len(prob.users[i]) == 1]
    touched = set(n.inputs) | {n.name} | {j for i in feeders for j in prob.g[i].inputs}
    moved = [n.name] + feeders

    def local():
        return (sum(_naive_compute(prob, sol, m) for m in moved)
                + sum(_naive_value_cost(prob, sol, v) for v in touched))

    keep = {m: sol[m] for m in moved}
    best, best_cost = dict(keep), local()
    for _, ins, out in prob.options[n.name]:
        sol.update(keep)
        sol[n.name] = (ins, out)
        for i in feeders:
            want = ins[n.inputs.index(i)]
            fits = [(c, i_ins, o) for c, i_ins, o in prob.options[i] if o is want]
            if fits and sol[i][1] is not want:
                sol[i] = min(fits, key=lambda f: prob._feeder_cost(sol, i, f))[1:]
        cost = local()
        if cost < best_cost - 1e-13:
            best, best_cost = {m: sol[m] for m in moved}, cost
    sol.update(best)
    return best != keep


def _naive_dp(prob):
    best, memo = {}, {}
    for n in prob.g.nodes:
        if n.name not in prob.options:
            best[n.name] = {n.layout: 0.0}
            continue
        table = {}
        for c, ins, out in prob.options[n.name]:
            cost = c + sum(prob._cost_to(best, i, lay, memo) for i, lay in zip(n.inputs, ins))
            if out not in table or cost < table[out] - sp._TOL:
                table[out] = cost
        best[n.name] = table
    required, sol = {n.name: [] for n in prob.g.nodes}, {}
    for n in reversed(prob.g.nodes):
        if n.name not in prob.options:
            continue
        pick, pick_cost = None, None
        for c, ins, out in prob.options[n.name]:
            total = c + sum(prob._cost_to(best, i, lay, memo) for i, lay in zip(n.inputs, ins))
            total += sum(prob.plan_cost(out, lay, n.type, n.name) for lay in required[n.name])
            if pick is None or total < pick_cost - sp._TOL:
                pick, pick_cost = (ins, out), total
        sol[n.name] = pick
        for i, lay in zip(n.inputs, pick[0]):
            required[i].append(lay)
    return sol


def _same_plan(a, b):
    return a.keys() == b.keys() and all(a[k][0] is b[k][0] and a[k][1] is b[k][1] for k in a)


@pytest.mark.parametrize("n_layer,spec_name", [(2, "gpt2_lm_tp2_train.pcs"), (2, "gpt2_lm_tp2_sp_train.pcs"),
                                               (2, "gpt2_lm_dp2_tp2_train.pcs")])
def test_fast_costs_and_moves_give_the_plain_searchs_plans_and_costs(n_layer, spec_name):
    """The DP reusing its forward sums, value costs of fixed reads kept, one-read values
    priced directly, the current option not priced again, shared compute tables and a
    neighbourhood without the readers of fixed values: the same plans, the same floats."""
    prob = sp.ShardProblem(_before_shard_prop(n_layer, spec_name))
    assert prob._info("step")[4]  # the optimizer's step: every update reads it the same way
    dp = prob.dp_solution()
    assert _same_plan(dp, _naive_dp(prob))
    for start in (dp, prob.greedy_solution()):
        assert prob.total(start) == _naive_total(prob, start)
        plain = dict(start)
        for _ in range(8):
            if not [n for n in reversed(prob.g.nodes) if n.name in plain and _naive_best_move(prob, plain, n)]:
                break
        fast = prob.improve(start)
        assert _same_plan(fast, plain)
        assert prob.total(fast) == _naive_total(prob, fast)


def test_verify_checks_each_distinct_node_once_and_still_finds_a_bad_one_in_a_repeated_block():
    from parcomp.ir.types import Partial

    sharded = sp.shard_prop(_before_shard_prop(2, "gpt2_lm_tp2_train.pcs"))
    verify(sharded)
    # block 1's first matmul made to multiply two partial sums: alike block 0's in op, attrs,
    # types and layout, so only its operand layouts tell it apart; it is checked on its own
    victim = next(n for n in sharded.nodes if n.op == "matmul" and ".h.1." in (n.source or ""))
    twin = next(n for n in sharded.nodes if n.op == "matmul" and ".h.0." in (n.source or "")
                and (n.attrs, n.type, n.layout) == (victim.attrs, victim.type, victim.layout))
    assert twin.in_layouts == victim.in_layouts
    bad_ins = ((Partial(),), (Partial(),))
    bad = sharded.with_nodes([dataclasses.replace(n, in_layouts=bad_ins) if n is victim else n
                              for n in sharded.nodes])
    with pytest.raises(VerifyError) as err:
        verify(bad)
    assert err.value.node == victim.name and "partial" in err.value.message


def test_evolve_is_dataclasses_replace():
    from parcomp.ir.graph import Node, evolve
    from parcomp.ir.types import Shard

    n = Node("x", "add", ("a", "b"), TensorType((2, 3), "f32"), (("k", 1),), phase="backward", source="m.f")
    for changes in ({}, {"layout": (Shard(0),)}, {"name": "y", "inputs": ("b",), "attrs": ()},
                    {"phase": "loss"}, {"type": TensorType((3,), "f32"), "in_layouts": None}):
        fast, slow = evolve(n, **changes), dataclasses.replace(n, **changes)
        assert fast == slow and vars(fast) == vars(slow) and list(vars(fast)) == list(vars(slow))
        assert fast is not n and type(fast) is Node
    with pytest.raises(TypeError):
        evolve(n, shape=(1,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        evolve(n, name="z").name = "w"


# ---- linear in depth: whole-program facts found once, not per node ----

def _compiled_lm(n_layer, spec_name):
    from parcomp.compile.compiler import compile_graph

    return compile_graph(_gpt2(n_layer), load_spec(os.path.join(SPECS, spec_name)))


def test_graph_memo_computes_once_per_graph_and_a_new_graph_starts_empty():
    from parcomp.ir.graph import Graph, Node

    g = Graph((Node("x", "input", (), TensorType((2,))),), ("x",))
    calls = []
    assert g.memo("k", lambda gr: calls.append(gr) or len(gr.nodes)) == 1
    assert g.memo("k", lambda gr: calls.append(gr) or 99) == 1 and calls == [g]
    h = dataclasses.replace(g, outputs=("x",))  # a new graph: its own, empty memo
    assert h.memo("k", lambda gr: 7) == 7 and g.memo("k", None) == 1


def test_collective_index_and_bucket_parts_give_what_a_scan_gives():
    from parcomp.passes.lowering.bucket import bucketed_members

    c = _compiled_lm(2, "gpt2_lm_tp2_sp_train.pcs")
    prog, local = c.program_, c.program
    for n in prog.graph.nodes:
        assert prog.collective(n.name) is next((r for r in prog.collectives if r.name == n.name), None)
    bucketed = 0
    for n in c.sharded.nodes:
        got = bucketed_members(local, n.name)
        if got is not None:
            src = local[local[n.name].inputs[0]]
            scan = tuple(m.name for m in local.nodes if m.op == "bucket_part" and m.inputs == (src.name,))
            assert got[1] == scan and n.name in scan
            bucketed += 1
    assert bucketed  # the SP spec buckets the norm-weight gradients


def test_emit_looks_for_balanced_chunking_once_per_program(monkeypatch):
    import parcomp_backends.torch.emit.cp_ring as ring
    from parcomp_backends.torch import emit_program

    c = _compiled_lm(3, "gpt2_lm_tp2_train.pcs")
    calls = []
    real = ring._balanced_of
    monkeypatch.setattr(ring, "_balanced_of", lambda p: calls.append(p) or real(p))
    emit_program(c, "cpu")
    assert len(calls) == 1  # not once per loaded parameter (that was quadratic in depth)
