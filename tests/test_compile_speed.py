"""Compile speed of deep transformers (issue 17, issue 11 item 4): the shortcuts that make a
deep model's compile linear in its depth give exactly the plans of the full work.

- shard-prop: nodes of repeated blocks share one option list (a relayout's ``origin``, the
  words naming its spec rule, is not part of the key), and the local-move search skips a
  node none of whose neighbourhood changed since its last attempt kept nothing;
- the verifier does not re-check a node object met again with the same operand objects.
"""
from __future__ import annotations

import dataclasses
import os

import pytest

from parcomp.errors import VerifyError
from parcomp.ir.types import TensorType
from parcomp.passes import shard_prop as sp
from parcomp.passes.manager import forward_pipeline, run_pipeline
from parcomp.passes.verify import verify
from parcomp.spec import load_spec

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

SPECS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "specs")


def _gpt2(n_layer):
    from transformers import GPT2Config, GPT2LMHeadModel

    from parcomp.frontends.torch_export import import_torch

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=101, n_positions=64, n_embd=32, n_layer=n_layer, n_head=4,
                        bos_token_id=0, eos_token_id=0, use_cache=False, attn_implementation="sdpa")
    return import_torch(GPT2LMHeadModel(config).eval(), (torch.randint(0, 101, (2, 8)),), ["input_ids"])


def _before_shard_prop(n_layer, spec_name):
    spec = load_spec(os.path.join(SPECS, spec_name))
    passes = forward_pipeline(spec)
    upto = [p.name for p in passes].index("shard-prop")
    return list(run_pipeline(_gpt2(n_layer), passes[:upto]).values())[-1]


def _improve_every_node(prob, sol, rounds=8):
    """The local-move search without skipping: every node tried in every round."""
    sol = dict(sol)
    for _ in range(rounds):
        if not [n for n in reversed(prob.g.nodes) if n.name in sol and prob._best_move(sol, n)]:
            break
    return sol


@pytest.mark.parametrize("n_layer,spec_name", [(2, "gpt2_lm_tp2_train.pcs"), (3, "gpt2_lm_tp2_sp_train.pcs")])
def test_skipping_unchanged_nodes_gives_the_plan_of_trying_every_node(n_layer, spec_name):
    prob = sp._Problem(_before_shard_prop(n_layer, spec_name))
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
    prob = sp._Problem(g)
    outs = [f"opt.transformer.h.{b}.attn.c_attn.weight.adamw_param.as_output" for b in range(3)]
    assert len({g[o].attr("origin") for o in outs}) == 3  # the words differ per block ...
    assert prob.options[outs[0]] is prob.options[outs[1]] is prob.options[outs[2]]  # ... the options not
    shared = sp.shard_prop(g)
    monkeypatch.setattr(sp, "_strategy_attrs", lambda n: n.attrs)  # one option list per origin
    alone = sp._Problem(g)
    assert alone.options[outs[0]] is not alone.options[outs[1]]
    separate = sp.shard_prop(g)
    assert [(n.layout, n.in_layouts) for n in shared.nodes] == [(n.layout, n.in_layouts) for n in separate.nodes]
    assert {k: v for k, v in shared.search.items() if k != "seconds"} == \
        {k: v for k, v in separate.search.items() if k != "seconds"}


def test_verify_memo_rechecks_a_changed_node_and_names_it_as_without_memo():
    g = _before_shard_prop(1, "gpt2_lm_tp2_train.pcs")
    memo = {}
    verify(g, memo)
    assert len(memo) == len(g.nodes)
    victim = next(n for n in g.nodes if n.op == "gelu" or n.op == "add")
    bad_type = TensorType(tuple(victim.type.shape) + (1,), victim.type.dtype)
    bad = g.with_nodes([dataclasses.replace(n, type=bad_type) if n is victim else n for n in g.nodes])
    with pytest.raises(VerifyError) as plain:
        verify(bad)
    with pytest.raises(VerifyError) as memoised:
        verify(bad, memo)
    assert memoised.value.message == plain.value.message and memoised.value.node == victim.name
    # an unchanged node whose operand changed is checked again: a consumer of the victim
    # fails on its operand's type once the victim's own check is passed off as done
    consumer = next(n for n in g.nodes if victim.name in n.inputs)
    memo[victim.name] = (bad[victim.name], tuple(g[i] for i in victim.inputs), memo[victim.name][2])
    with pytest.raises(VerifyError) as downstream:
        verify(bad, memo)
    assert downstream.value.node == consumer.name
