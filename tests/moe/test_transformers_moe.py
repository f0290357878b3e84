"""transformers' own MoE LMs, unedited: Mixtral's and Qwen2-MoE's routers (softmax, ``topk``)
traced as written, their experts modules (``@use_experts_implementation``: fused
``gate_up_proj`` / ``down_proj`` tensors, a data-dependent loop or grouped_mm in transformers)
traced with static shapes through the MoE ops (parcomp/frontends/torch/moe.py,
``static_experts``): the import equals the module in float64, the module is unchanged after,
and expert parallel training on Mixtral as it comes checks OK with the rewritten block's
exchanges (2 all_to_all per block each way)."""
from __future__ import annotations

import collections
import copy
import json
import os
import sys

import numpy as np
import pytest

from parcomp.cli.main import main
from parcomp.frontends.torch.export import import_torch
from parcomp.frontends.torch.fold import module_sources
from parcomp.reference.numpy_ops import run_unsharded

from numerics import assert_check_ok

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..")
MODELS = os.path.join(ROOT, "specs", "models.py")
sys.path.insert(0, os.path.join(ROOT, "specs"))
import models  # noqa: E402


@pytest.mark.parametrize("factory, moe_layers", [("mixtral_lm", 2), ("qwen2_moe_lm", 2), ("deepseek_v3_lm", 1)])
def test_a_transformers_moe_lm_imports_equal_to_the_module(factory, moe_layers):
    """DeepSeek-V3 also: its group-limited router (``scatter_`` of 1 at the best groups' topk
    indices, ``masked_fill(~mask.bool(), -inf)``, ``gather``), its float32 router next to a
    float64 correction bias (type promotion), and MLA's keys written into ``new_empty``."""
    m, (ids,), names = getattr(models, factory)()
    wide = copy.deepcopy(m).double()
    wide.set_experts_implementation("eager")  # transformers' grouped_mm takes no float64
    experts = wide.model.layers[-1].mlp.experts
    forward = type(experts).forward
    g = import_torch(wide, (ids,), names)
    assert "forward" not in vars(experts) and type(experts).forward is forward  # the module as it was
    ops = collections.Counter(n.op for n in g.nodes)
    assert ops["moe_dispatch"] == ops["moe_combine"] == moe_layers and ops["topk"] >= moe_layers
    assert {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"} <= {
        p.name for p in g.params}
    feeds = {k: v.detach().numpy() for k, v in module_sources(wide).items() if k in g}
    got = run_unsharded(g, {**feeds, "input_ids": ids.numpy()})["logits"]
    want = wide(ids).logits.detach().numpy()
    # the routers compute in float32 (``router_logits.float()``, ``softmax(dtype=float)``)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_expert_parallel_on_transformers_mixtral_checks_ok_as_the_rewritten_blocks(capsys):
    rc = main(["check", f"{MODELS}:mixtral_lm", "--spec", os.path.join(ROOT, "specs", "mixtral_lm_ep2_train.pcs"),
               "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0
    assert_check_ok(out)
    counts = collections.Counter((c["kind"], c["phase"]) for c in out["collectives"])
    assert counts[("all_to_all", "forward")] == counts[("all_to_all", "backward")] == 4
    assert not [c for c in out["collectives"] if c["kind"] == "all_gather"]  # no row is gathered
