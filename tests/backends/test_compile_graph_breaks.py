"""The default program.py (no ``--functional-collectives``) under ``torch.compile``: its
``train_step`` is one graph, with no graph break.

A 2-block GPT-2 LM (``specs/models.py:gpt2_lm``) compiled for tp=2 training, as Megatron
(an async all_reduce of dx overlapping the weight gradients, vocab-parallel embedding
gradients) and as Megatron-SP (all_gather / reduce_scatter of the sequence), runs on 2 gloo
ranks; each rank counts the graphs and graph breaks of its ``train_step`` with
``torch._dynamo.explain`` (a count, not a time). Each break found is named in the message.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from graph_break_ranks import assert_one_graph, explain_counts, measure_on_two_ranks  # noqa: E402

SPECS = ("gpt2_lm_tp2_train.pcs", "gpt2_lm_tp2_sp_train.pcs")


def _inputs(module, example):
    ids = example[0]
    labels = torch.randint(0, module.config.vocab_size, ids.shape, generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": labels}


def _explain(program, params, inputs):
    return explain_counts(torch._dynamo.explain(program.train_step)(params, inputs))


def test_default_tp2_training_step_compiles_without_graph_break(tmp_path):
    assert_one_graph(measure_on_two_ranks(tmp_path, "gpt2_lm", SPECS, _inputs, _explain), SPECS)
