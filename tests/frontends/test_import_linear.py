"""The torch frontend's import of an exported program does a constant amount of work per
block: the Python calls it makes (cProfile's call counts: deterministic, unlike time) grow by
the same number from each depth to the next, for every function. A walk over the whole graph
(or over the exported program's input specs) per node or per parameter makes some count grow
quadratically and fails here."""
from __future__ import annotations

import cProfile
import pstats

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from parcomp.frontends.torch.export import export_module, import_exported  # noqa: E402


def _gpt2(n_layer: int):
    """A tiny GPT-2 LM in training mode (dropout sites on: each gets its own seed)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=101, n_positions=64, n_embd=32, n_layer=n_layer, n_head=4,
                                     bos_token_id=0, eos_token_id=0, use_cache=False,
                                     attn_implementation="sdpa", attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).train(), (torch.randint(0, 101, (2, 8)),)


def _calls(n_layer: int) -> dict:
    """``{function: calls}`` of one ``import_exported`` of the ``n_layer`` GPT-2 (its
    torch.export outside the count); builtins (``len``, ``list.append``) left out."""
    module, inputs = _gpt2(n_layer)
    ep = export_module(module, inputs)
    prof = cProfile.Profile()
    prof.enable()
    graph = import_exported(module, ep, ["input_ids"])
    prof.disable()
    assert sum(n.op == "dropout" for n in graph.nodes) == 2 * n_layer + 1
    stats = pstats.Stats(prof).stats
    return {f"{f}:{line}({name})": v[1] for (f, line, name), v in stats.items() if f != "~"}


def test_import_calls_grow_by_a_constant_per_block():
    _calls(1)  # first import in the process: lazy imports and caches
    c2, c3, c4 = _calls(2), _calls(3), _calls(4)
    curved = {k: (c2.get(k, 0), c3.get(k, 0), c4[k]) for k in c4
              if c4[k] - 2 * c3.get(k, 0) + c2.get(k, 0) != 0}
    assert not curved, f"calls at 2, 3, 4 blocks not linear in the depth: {curved}"
    assert sum(c4.values()) - sum(c3.values()) == sum(c3.values()) - sum(c2.values())
