"""Whole transformers through torch.export: the ``gpt2_lm`` / ``llama_lm``
factories, the exact aten inventory each exports to, what constant folding removes,
and the located error for an op without a lowering."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from parcomp.cli.main import main  # noqa: E402
from parcomp.errors import FrontendError  # noqa: E402
from parcomp.frontends.torch.export import (_bind, export_module, _module_path, import_torch,  # noqa: E402
                                            op_inventory, supported_ops)
from parcomp.frontends.torch.fold import (causal_attention, defining, fold, materialized,  # noqa: E402
                                          module_sources)
from parcomp.reference.numpy_ops import run_unsharded  # noqa: E402

from numerics import assert_equivalent  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("_test_lm_models", ROOT / "specs" / "models.py")
models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(models)

# What each model's forward leaves for the aten TABLE after constant folding and the
# causal-mask rewrite (torch 2.13, transformers 5.24). docs/design/frontends.md has the same table.
LOWERED = {
    "gpt2_lm": {
        "aten.add.Tensor": 9, "aten.addmm.default": 8, "aten.alias.default": 1,
        "aten.dropout.default": 5, "aten.embedding.default": 2, "aten.layer_norm.default": 5,
        "aten.linear.default": 1, "aten.mul.Tensor": 8, "aten.pow.Tensor_Scalar": 2,
        "aten.reshape.default": 4, "aten.scaled_dot_product_attention.default": 2,
        "aten.split.Tensor": 2, "aten.tanh.default": 2, "aten.to.dtype_layout": 1,
        "aten.transpose.int": 8, "aten.view.default": 24},
    "llama_lm": {
        "aten.add.Tensor": 13, "aten.alias.default": 1, "aten.cat.default": 4,
        "aten.embedding.default": 1, "aten.expand.default": 4, "aten.linear.default": 15,
        "aten.mean.dim": 5, "aten.mul.Tensor": 20, "aten.neg.default": 4,
        "aten.pow.Tensor_Scalar": 5, "aten.reshape.default": 8, "aten.rsqrt.default": 5,
        "aten.scaled_dot_product_attention.default": 2, "aten.silu.default": 2,
        "aten.slice.Tensor": 8, "aten.to.dtype": 10, "aten.transpose.int": 8,
        "aten.unsqueeze.default": 4, "aten.view.default": 6},
}
# ops computed only from constants (position ids, the causal mask, RoPE tables): folded
FOLDED_AWAY = {
    "gpt2_lm": {"aten.__and__.Tensor", "aten.arange.default", "aten.cumsum.default", "aten.diff.default",
                "aten.eq.Tensor", "aten.expand.default", "aten.index.Tensor", "aten.le.Tensor",
                "aten.ne.Scalar", "aten.new_ones.default", "aten.slice.Tensor", "aten.sub.Tensor",
                "aten.unsqueeze.default"},
    "llama_lm": {"aten.__and__.Tensor", "aten.arange.default", "aten.cos.default", "aten.cumsum.default",
                 "aten.diff.default", "aten.eq.Tensor", "aten.index.Tensor", "aten.le.Tensor",
                 "aten.ne.Scalar", "aten.new_ones.default", "aten.sin.default", "aten.sub.Tensor",
                 "aten.to.device", "aten.to.dtype_layout"},
}
# lowerings another part adds (its own TABLE rows), until they are merged
OTHER_PARTS = {
    "aten.embedding.default": "norms", "aten.layer_norm.default": "norms",
    "aten.mean.dim": "reductions",
    "aten.scaled_dot_product_attention.default": "attention", "aten.split.Tensor": "attention",
    "aten.slice.Tensor": "attention", "aten.cat.default": "attention",
    "aten.expand.default": "attention", "aten.unsqueeze.default": "attention",
    "aten.to.dtype": "attention",
}
NAMES = sorted(LOWERED)


@pytest.fixture(scope="module", params=NAMES)
def made(request):
    return request.param, getattr(models, request.param)()


def test_factories_are_small_deterministic_and_realistic(made):
    name, (module, inputs, names) = made
    cfg = module.config
    assert names == ["input_ids"] and inputs[0].dtype == torch.int64 and inputs[0].shape == (2, 8)
    assert not module.training and cfg.use_cache is False and cfg.num_hidden_layers == 2
    assert int(inputs[0].max()) < cfg.vocab_size
    if name == "gpt2_lm":
        assert cfg.vocab_size % 2 == 1 and cfg.n_head == 4 and cfg.tie_word_embeddings
    else:
        assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    again, inputs2, _ = getattr(models, name)()
    assert torch.equal(inputs[0], inputs2[0])
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in module.state_dict().items())


def test_exact_op_inventory(made):
    name, (module, inputs, _) = made
    inv = op_inventory(module, inputs)
    assert inv["lowered"] == LOWERED[name]
    assert set(inv["exported"]) - set(inv["lowered"]) == FOLDED_AWAY[name]
    # every op left is lowered here or by another part
    missing = set(inv["lowered"]) - set(supported_ops())
    assert missing <= set(OTHER_PARTS), sorted(missing - set(OTHER_PARTS))


def _folded(module, inputs):
    ep = export_module(module, inputs)
    consts = fold(ep)
    causal_attention(ep, consts, _bind)
    sdpa = [_bind(n) for n in ep.graph.nodes if "scaled_dot_product" in str(n.target)]
    kept = materialized(ep, consts)
    names = {f"{_module_path(defining(n))}.{defining(n).name}" for n in kept}  # the params' names
    return [consts[n] for n in kept], sdpa, names


def test_gpt2_folds_position_ids_and_the_causal_mask():
    module, inputs, _ = models.gpt2_lm()
    values, sdpa, names = _folded(module, inputs)
    assert len(sdpa) == 2 and all(a["attn_mask"] is None and a["is_causal"] for a in sdpa)
    assert names == {"transformer.arange"}
    (pos,) = values  # the mask is gone: only wpe's position ids remain
    np.testing.assert_array_equal(pos.numpy(), np.arange(8)[None, :])


def test_llama_folds_rope_tables_and_the_causal_mask():
    module, inputs, _ = models.llama_lm()
    values, sdpa, names = _folded(module, inputs)
    assert len(sdpa) == 2 and all(a["attn_mask"] is None and a["is_causal"] for a in sdpa)
    assert names == {"model.rotary_emb.cos", "model.rotary_emb.sin"}
    x = torch.zeros(1, 8, 64)
    cos, sin = module.model.rotary_emb(x, torch.arange(8)[None, :])
    assert len(values) == 4  # cos and sin for each of the 2 layers: one param each after dedup
    for v, want in zip(values, [cos, sin, cos, sin]):
        np.testing.assert_array_equal(v[:, 0].numpy(), want.numpy())  # torch computed both


def test_whole_model_matches_transformers_or_names_the_missing_op(made):
    """With every op lowered, the numpy run of the graph equals the
    transformers model; before that, the import fails at an op another part lowers,
    naming it, its module and what to do about it (parcomp.frontends.torch.hints)."""
    name, (module, inputs, names) = made
    try:
        graph = import_torch(module, inputs, names)
    except FrontendError as e:
        msg = str(e)
        op = msg.split("unsupported op ")[1].split(" ")[0] if "unsupported op " in msg else msg
        assert op in set(LOWERED[name]) - set(supported_ops()) and op in OTHER_PARTS, msg
        assert "in module '" in msg and "parcomp has no lowering for it; " in msg
        return
    assert graph.output_names == ("logits",)
    state = {k: v.detach().numpy() for k, v in module_sources(module).items()}
    feeds = {**{p.name: state[p.name] for p in graph.params}, "input_ids": inputs[0].numpy()}
    got = run_unsharded(graph, feeds)[graph.outputs[0]]
    with torch.no_grad():
        want = module(*inputs).logits.numpy()
    assert_equivalent(got, want, what="logits")


def test_cli_unsupported_op_is_located_json(tmp_path, capsys):
    model = tmp_path / "m.py"
    model.write_text("import torch\n"
                     "class Block(torch.nn.Module):\n"
                     "    def forward(self, x):\n"
                     "        return torch.cummax(x, -1).values\n"
                     "class M(torch.nn.Module):\n"
                     "    def __init__(self):\n"
                     "        super().__init__(); self.fc = torch.nn.Linear(4, 4); self.inner = Block()\n"
                     "    def forward(self, x):\n"
                     "        return self.inner(self.fc(x))\n"
                     "def make():\n"
                     "    return M(), (torch.ones(2, 4),)\n")
    spec = tmp_path / "s.pcs"
    spec.write_text("mesh tp=2\nfc.weight colwise\n")
    assert main(["check", f"{model}:make", "--spec", str(spec), "--json"]) == 2
    captured = capsys.readouterr()
    last = json.loads(captured.out.strip().splitlines()[-1])
    assert not last["ok"] and last["where"] == f"{model}:4:9"  # the statement
    assert "aten.cummax" in last["error"] and "module 'inner'" in last["error"]
    # no rewrite, and amax is only 4 letters of cummax: no suggestion rather than a wrong one
    assert "no lowering for it; no supported op is close to it (" in last["error"]
    assert "Traceback" not in captured.err + captured.out
