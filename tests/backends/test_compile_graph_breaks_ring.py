"""Ring attention (``context-parallel lowering=ring``) under ``torch.compile``: the training
step of program.py is one graph, with no graph break.

``batch_isend_irecv`` cannot be traced (a break at every ring step), so under compile each
ring shift is a functional ``all_to_all_single`` (``ring_start_functional``), and the
fully-masked-block test, a host read of the mask, is left out (such a block adds exact
zeros). Transformers' LlamaAttention (``specs/models.py:causal_attention``) compiled for cp=2
with contiguous and balanced chunks runs on 2 gloo ranks; each rank counts the graphs and
breaks of its ``train_step`` with ``torch._dynamo.explain`` (a count, not a time), and runs
the step eagerly with the traced branches taken (``torch.compiler.is_compiling`` true): the
loss and gradients equal the plain eager step's.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from graph_break_ranks import assert_one_graph, explain_counts, measure_on_two_ranks  # noqa: E402

SPECS = ("attention_cp2_ring_train.pcs", "attention_cp2_ring_balanced_train.pcs")


def _inputs(module, example):
    x = example[0]
    return {"x": x, "target": torch.randn(x.shape, generator=torch.Generator().manual_seed(0))}


def _explain_and_compare(program, params, inputs):
    """The graphs and breaks of ``train_step``, and the largest difference between the step run
    eagerly with the traced branches taken and the plain eager step."""
    fresh = lambda: {k: v.clone() for k, v in params.items()}  # noqa: E731 (the step updates in place)
    counts = explain_counts(torch._dynamo.explain(program.train_step)(fresh(), inputs))
    want = program.train_step(fresh(), dict(inputs))
    real = torch.compiler.is_compiling
    torch.compiler.is_compiling = lambda: True
    try:
        got = program.train_step(fresh(), dict(inputs))
    finally:
        torch.compiler.is_compiling = real
    counts["diff"] = max(float((torch.as_tensor(got[k]) - torch.as_tensor(want[k])).abs().max()) for k in want)
    return counts


def test_ring_attention_training_step_compiles_without_graph_break(tmp_path):
    per_rank = measure_on_two_ranks(tmp_path, "causal_attention", SPECS, _inputs, _explain_and_compare)
    assert_one_graph(per_rank, SPECS)
    for rank, counts in enumerate(per_rank):
        for name in SPECS:
            assert counts[name]["diff"] == 0.0, (
                f"rank {rank}, {name}: the traced branches differ from eager by {counts[name]['diff']}")
