"""A transformers model that computes its own loss: called with ``labels``,
``GPT2LMHeadModel`` / ``LlamaForCausalLM`` pad the labels with -100, shift them and take the
mean cross-entropy over the counted tokens (``ForCausalLMLoss``). The frontend lowers
``aten.pad`` to parcomp's ``pad`` and ``aten.cross_entropy_loss`` / ``nll_loss`` to the
per-token ``cross_entropy`` (or ``-pick``) and the global mean, the same form as
``train loss=cross_entropy``: the same collectives, vocab-parallel where the logits are split.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from parcomp.check.differential import tolerance_for
from parcomp.cli.common import feeds_for
from parcomp.cli.main import main
from parcomp.errors import FrontendError
from parcomp.frontends.torch.export import import_torch
from parcomp.reference.numpy_ops import run_unsharded

from numerics import assert_equivalent, assert_check_ok  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..")
MODELS = os.path.join(ROOT, "specs", "models.py")
sys.path.insert(0, os.path.join(ROOT, "specs"))
import models  # noqa: E402
GPT2_RULES = ("mesh tp=2\ntransformer.h.*.attn.c_attn.weight colwise\ntransformer.h.*.attn.c_proj.weight rowwise\n"
              "transformer.h.*.mlp.c_fc.weight colwise\ntransformer.h.*.mlp.c_proj.weight rowwise\n")
LLAMA_RULES = "mesh tp=2\n" + "".join(
    f"model.layers.*.{m}.weight {w}\n" for m, w in (
        ("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"), ("self_attn.v_proj", "colwise"),
        ("self_attn.o_proj", "rowwise"), ("mlp.gate_proj", "colwise"), ("mlp.up_proj", "colwise"),
        ("mlp.down_proj", "rowwise")))
OWN = "train loss=output output=loss optimizer=adamw(lr=0.001)\n"
LOGITS = "train loss=cross_entropy optimizer=adamw(lr=0.001)\n"
# a vocab large enough that the plan keeps the logits split (Megatron's vocab-parallel loss)
BIG_VOCAB = '''
import torch
from models import with_labels, _labels
def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=65536, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0,
                      eos_token_id=1, pad_token_id=None, use_cache=False, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval(), torch.randint(0, 65536, (2, 16))
def logits():
    m, ids = _llama()
    return m, (ids,), ["input_ids"]
def own():
    m, ids = _llama()
    return with_labels(m), (ids, _labels(ids, 65536)), ["input_ids", "labels"]
'''


def _ours(module, inputs, names=None):
    """(the graph, parcomp's outputs of ``module`` by numpy, torch's outputs)."""
    graph = import_torch(module, inputs, names)
    feeds = feeds_for(graph, module, inputs)
    with torch.no_grad():
        out = module(*inputs)
    want = {k: v.detach().numpy() for k, v in (out.items() if isinstance(out, dict) else [("output", out)])
            if v is not None}
    return graph, run_unsharded(graph, feeds), want


# ---- the lowerings, against torch in float64 -------------------------------------------

class _Pads(torch.nn.Module):
    def forward(self, x, labels):
        return {"two_dims": F.pad(x, (1, 2, 0, 1), value=-1.5), "crop": F.pad(x, (-1, 2)),
                "shifted": F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous(),
                "nd": torch.constant_pad_nd(x, (0, 0, 2, 0), 3.0)}


def test_pad_lowers_to_pad_ops_equal_to_torch():
    x, labels = torch.randn(2, 3, 4, dtype=torch.float64), torch.randint(0, 5, (2, 6))
    graph, got, want = _ours(_Pads(), (x, labels))
    assert graph.by_op("pad") and graph["shifted"].type.dtype == "int64"
    for k in want:  # a pad is exact: the same numbers
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
        assert got[k].dtype == want[k].dtype, k


class _Losses(torch.nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, z, labels, z3, labels3):
        return {"ce": F.cross_entropy(z, labels, **self.kw),
                "ce_classes_dim1": F.cross_entropy(z3, labels3, **self.kw),
                "nll": F.nll_loss(torch.log_softmax(z, -1), labels, **{k: v for k, v in self.kw.items()
                                                                      if k != "label_smoothing"})}


@pytest.mark.parametrize("kw", [{}, {"reduction": "sum"}, {"reduction": "none"}, {"ignore_index": 2},
                                {"label_smoothing": 0.2, "ignore_index": -100}])
def test_cross_entropy_and_nll_loss_equal_torch(kw):
    rng = torch.Generator().manual_seed(0)
    z, z3 = torch.randn(6, 5, dtype=torch.float64, generator=rng), torch.randn(2, 5, 3, dtype=torch.float64)
    skip = kw.get("ignore_index", -100)  # one ignored token in each
    labels, labels3 = torch.tensor([0, 3, skip, 4, 2, 1]), torch.tensor([[1, 3, skip], [2, 0, 4]])
    graph, got, want = _ours(_Losses(**kw), (z, labels, z3, labels3))
    assert graph.by_op("cross_entropy") and graph.by_op("pick")
    for k in want:
        assert_equivalent(got[k], want[k], what=f"{k} {kw}")


def test_a_mean_loss_divides_by_the_counted_tokens_not_all():
    """The lowering can fail: dividing by every token (-100 counted) is off by 6/5."""
    z, labels = torch.randn(6, 5, dtype=torch.float64), torch.tensor([0, 2, -100, 4, 2, 1])
    _, got, _ = _ours(_Losses(), (z, labels, torch.randn(2, 5, 3, dtype=torch.float64),
                                          torch.tensor([[1, 2, 0], [2, 0, 4]])))
    all_tokens = F.cross_entropy(z, labels, reduction="sum").numpy() / 6
    with pytest.raises(AssertionError, match="tolerance"):
        assert_equivalent(got["ce"], all_tokens)


class _Bad(torch.nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, z, labels):
        if self.how == "reflect":
            return F.pad(z, (1, 1), mode="reflect")
        if self.how == "weight":
            return F.cross_entropy(z, labels, weight=torch.ones(5, dtype=z.dtype))
        return F.cross_entropy(z, torch.softmax(z, -1))


@pytest.mark.parametrize("how,needle", [("reflect", "pad mode 'reflect' is not supported"),
                                        ("weight", "class weights is not supported"),
                                        ("probs", "class probabilities")])
def test_unsupported_loss_options_are_located_errors(how, needle):
    with pytest.raises(FrontendError, match=needle) as e:
        import_torch(_Bad(how), (torch.randn(4, 5), torch.tensor([0, 1, 2, 3])))
    assert "test_model_loss.py:" in str(e.value)  # the user's source line


# ---- transformers models with labels ----------------------------------------------------

@pytest.mark.parametrize("factory", ["gpt2_lm_loss", "llama_lm_loss"])
def test_the_models_own_loss_equals_transformers_loss_in_float64(factory):
    pytest.importorskip("transformers")
    module, inputs, names = getattr(models, factory)()
    with torch.no_grad():  # sharper logits: each token's loss differs from the mean (random init: all ~ln V)
        module.lm_head.weight.mul_(20.0)
    graph, got, want = _ours(module.double(), inputs, names)
    assert graph.output_names[:2] == ("loss", "logits") and graph["labels"].type.dtype == "int64"
    assert not graph.by_op("all_gather")
    # ForCausalLMLoss upcasts the logits with .float(): its cross-entropy is float32 in both, and
    # Llama's RoPE computes in float32 in a float64 model: float32's tolerance
    assert_equivalent(got["loss"], want["loss"], what=factory, rtol=tolerance_for("float32"))
    assert_equivalent(got["logits"], want["logits"], what=factory, rtol=tolerance_for("float32"))


def _check(tmp_path, capsys, model, rules, train, name) -> dict:
    spec = tmp_path / f"{name}.pcs"
    spec.write_text(rules + train)
    rc = main(["check", model, "--spec", str(spec), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (rc == 0) == (out["verdict"] == "OK"), (rc, out.get("why"))
    return out


def _collectives(out) -> list:
    return [(c["kind"], c["axis"], c["dim"], c["bytes"]) for c in out["collectives"]]


@pytest.mark.parametrize("factory,rules", [("gpt2_lm", GPT2_RULES), ("llama_lm", LLAMA_RULES)])
def test_check_of_the_own_loss_matches_the_logits_form(tmp_path, capsys, factory, rules):
    pytest.importorskip("transformers")
    own = _check(tmp_path, capsys, f"{MODELS}:{factory}_loss", rules, OWN, "own")
    ref = _check(tmp_path, capsys, f"{MODELS}:{factory}", rules, LOGITS, "logits")
    assert_check_ok(own)
    assert own["verdict"] == ref["verdict"]
    assert _collectives(own) == _collectives(ref)


def test_vocab_parallel_own_loss_all_reduces_and_gathers_no_logits(tmp_path, capsys):
    pytest.importorskip("transformers")
    (tmp_path / "big.py").write_text(BIG_VOCAB)
    rules = LLAMA_RULES + "lm_head.weight colwise\n"
    own = _check(tmp_path, capsys, f"{tmp_path}/big.py:own", rules, OWN, "own")
    ref = _check(tmp_path, capsys, f"{tmp_path}/big.py:logits", rules, LOGITS, "logits")
    assert_check_ok(own)
    assert own["verdict"] == ref["verdict"] == "OK", own.get("why")
    assert "all_gather" not in {c["kind"] for c in own["collectives"]}
    assert _collectives(own) == _collectives(ref)
    # Megatron's three: the max and the sum of exps of the 32 tokens, the target logit riding on
    # the loss's scalar sum (tests/rules/test_reductions.py), never the [32, 65536] logits
    per_token = [c for c in own["collectives"] if c["local_shape"] == [32]]
    assert [c["kind"] for c in per_token] == ["all_reduce"] * 2 and "%logits" not in str(own["collectives"])


@pytest.mark.slow
@pytest.mark.parametrize("factory,rules", [("gpt2_lm_loss", GPT2_RULES), ("llama_lm_loss", LLAMA_RULES)])
def test_own_loss_trains_under_torchrun_like_the_unsharded_model(tmp_path, capsys, factory, rules):
    pytest.importorskip("transformers")
    spec = tmp_path / "own.pcs"
    spec.write_text(rules + OWN)
    main(["run", f"{MODELS}:{factory}", "--spec", str(spec), "--nproc", "2", "--steps", "1", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["world_size"] == 2 and len(out["losses"]) == 1
    assert_check_ok(out)
