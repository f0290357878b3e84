"""A torch model's vocab not divisible by tp: GPT-2's tied table (101 rows, as
50257 is odd) split over tp=2 is padded to 102 rows the way Megatron pads it; the padded
logits are masked and sliced off, the loss stays vocab-parallel, and everything equals the
unsharded transformers model and torch.optim (parcomp/passes/vocab_pad.py)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from parcomp.cli.main import main
from parcomp.compile.compiler import compile_graph
from parcomp.errors import SpecError
from parcomp.ir import parse_graph
from parcomp.passes.fused_weights import to_stored_shapes, to_view_shapes

from graphs import spec
from numerics import assert_check_ok

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..")
MODELS = os.path.join(ROOT, "specs", "models.py")
SPEC = ("mesh tp=2\nlm_head.weight [S(0)]   # the tied wte/lm_head table, 101 rows\n"
        "transformer.h.*.attn.c_attn.weight colwise\ntransformer.h.*.attn.c_proj.weight rowwise\n"
        "transformer.h.*.mlp.c_fc.weight colwise\ntransformer.h.*.mlp.c_proj.weight rowwise\n"
        "train loss=cross_entropy optimizer=adamw(lr=0.001) steps=2\n")

LM = """\
%ids: i64[2,4] = input()
%wte: f32[7,4] = param()
%x: f32[2,4,4] = embedding(%ids, %wte)
%wt: f32[4,7] = permute(%wte) {perm=(1, 0)}
%logits: f32[2,4,7] = matmul(%x, %wt)
return %logits as logits
"""


def test_table_is_padded_logits_masked_and_sliced_back():
    c = compile_graph(parse_graph(LM), spec("mesh tp=2\nwte [S(0)]\n"))
    g = c.logical
    assert g["wte"].type.shape == (8, 4) and g["wte"].attr("stored_shape") == (7, 4)
    assert g["logits"].op == "slice" and g["logits"].type.shape == (2, 4, 7)
    (mask,) = [n for n in g.nodes if n.op == "mask_pad"]
    assert mask.attr("size") == 7 and mask.type.shape == (2, 4, 8)
    table = np.arange(28, dtype="f4").reshape(7, 4)
    padded = to_view_shapes({"wte": table, "wte.grad": table}, g)
    assert padded["wte"].shape == (8, 4) and not padded["wte.grad"][7].any()
    np.testing.assert_array_equal(to_stored_shapes(padded, g)["wte"], table)


def test_an_uneven_split_that_is_no_vocab_is_still_an_error():
    text = "%x: f32[2,7] = input()\n%w: f32[7,4] = param()\n%y: f32[2,4] = matmul(%x, %w)\nreturn %y\n"
    with pytest.raises(SpecError, match="not divisible"):
        compile_graph(parse_graph(text), spec("mesh tp=2\nw [S(0)]\n"))
    hidden = MLP.replace("%y: f32[2,7] = matmul(%x, %wt)\nreturn %y", "%y: f32[2,7] = matmul(%x, %wt)\n"
                         "%z: f32[2,7] = relu(%y)\nreturn %z")
    with pytest.raises(SpecError, match="not divisible"):  # a colwise hidden layer is no LM head
        compile_graph(parse_graph(hidden), spec("mesh tp=2\nw colwise\ntrain loss=cross_entropy\n"))


MLP = """\
%x: f32[2,4] = input()
%w: f32[7,4] = param()
%wt: f32[4,7] = permute(%w) {perm=(1, 0)}
%y: f32[2,7] = matmul(%x, %wt)
return %y
"""


def test_an_untied_lm_head_is_padded_only_under_a_cross_entropy_loss():
    with pytest.raises(SpecError, match="not divisible"):
        compile_graph(parse_graph(MLP), spec("mesh tp=2\nw colwise\n"))
    c = compile_graph(parse_graph(MLP), spec("mesh tp=2\nw colwise\ntrain loss=cross_entropy\n"))
    assert c.logical["w"].type.shape == (8, 4) and c.logical["w"].attr("stored_shape") == (7, 4)
    assert any(n.op == "mask_pad" for n in c.logical.nodes)


def test_gpt2_with_odd_vocab_split_over_tp_trains_like_torch(capsys, tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "vocab.pcs"
    path.write_text(SPEC)
    rc = main(["check", f"{MODELS}:gpt2_lm", "--spec", str(path), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0
    assert_check_ok(out)


@pytest.mark.slow
def test_gpt2_with_odd_vocab_under_torchrun(capsys, tmp_path):
    """program.py pads the checkpoint's 101 rows to 102 as it loads them."""
    pytest.importorskip("transformers")
    path = tmp_path / "vocab.pcs"
    path.write_text(SPEC)
    rc = main(["run", f"{MODELS}:gpt2_lm", "--spec", str(path), "--nproc", "2", "--json",
               "--keep", str(tmp_path / "out")])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out.get("verdict") == "OK", out
    assert ('torch.nn.functional.pad(whole(take_tied(ckpt, ("lm_head.weight", "transformer.wte.weight")'
            in (tmp_path / "out" / "program.py").read_text())  # tied: read under either name


LLAMA = '''
import torch


def llama_odd_vocab():
    """transformers' LlamaForCausalLM, untied lm_head, vocab 97 (odd: tp=2 pads it to 98)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=0, eos_token_id=1, pad_token_id=None, use_cache=False,
                      attn_implementation="sdpa", tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval(), (torch.randint(0, 97, (2, 8)),), ["input_ids"]


def llama_odd_vocab_loss():
    """llama_odd_vocab called with labels: it returns transformers' own loss and logits."""
    module, (ids,), _ = llama_odd_vocab()
    base = type(module)
    module.__class__ = type(base.__name__, (base,), {
        "forward": lambda self, input_ids, labels: base.forward(self, input_ids=input_ids, labels=labels),
        "__module__": base.__module__})
    labels = torch.randint(0, 97, ids.shape, generator=torch.Generator().manual_seed(1))
    labels[:, 2] = -100
    return module, (ids, labels), ["input_ids", "labels"]
'''
LLAMA_RULES = ("mesh tp=2\nmodel.embed_tokens.weight [S(0)]\n"
               "model.layers.*.self_attn.q_proj.weight colwise\nmodel.layers.*.self_attn.k_proj.weight colwise\n"
               "model.layers.*.self_attn.v_proj.weight colwise\nmodel.layers.*.self_attn.o_proj.weight rowwise\n"
               "lm_head.weight colwise   # the untied LM head: vocab-parallel, 97 rows\n")
LLAMA_TRAIN = {"cross_entropy": ("llama_odd_vocab", "train loss=cross_entropy optimizer=adamw(lr=0.001) steps=2\n"),
               "output": ("llama_odd_vocab_loss", "train loss=output output=loss optimizer=adamw(lr=0.001) steps=2\n"),
               "inference": ("llama_odd_vocab", "")}


def _llama(tmp_path, case):
    fn, train = LLAMA_TRAIN[case]
    (tmp_path / "llama_odd.py").write_text(LLAMA)
    (tmp_path / "head.pcs").write_text(LLAMA_RULES + train)
    return f"{tmp_path / 'llama_odd.py'}:{fn}", str(tmp_path / "head.pcs")


@pytest.mark.parametrize("case", ["cross_entropy", "output", "inference"])
def test_untied_llama_head_with_odd_vocab_is_padded_and_checks(capsys, tmp_path, case):
    """The untied lm_head (97 rows, colwise) is padded like the embedding: 98 rows inside, 97
    in the checkpoint; a cross-entropy step never gathers the logits (vocab-parallel)."""
    pytest.importorskip("transformers")
    from parcomp.frontends.loader import load_model
    from parcomp.spec import load_spec

    model, spec_path = _llama(tmp_path, case)
    graph, _, _ = load_model(model)
    c = compile_graph(graph, load_spec(spec_path))
    head = c.logical["lm_head.weight"]
    assert head.type.shape == (98, 32) and head.attr("stored_shape") == (97, 32)
    gathers = [r for r in c.report["collectives"] if r["kind"] == "all_gather"]
    if case == "cross_entropy":  # the loss reads the masked, padded logits split over tp
        assert all(len(r["local_shape"]) == 2 for r in gathers), gathers  # at most the [32,49] weight
    rc = main(["check", model, "--spec", spec_path, "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0
    assert_check_ok(out)


@pytest.mark.slow
def test_untied_llama_head_with_odd_vocab_under_torchrun(capsys, tmp_path):
    """program.py pads the untied head's 97 checkpoint rows to 98 as it loads them; the model
    computes its own loss (loss=output) on 2 gloo ranks and equals the unsharded model."""
    pytest.importorskip("transformers")
    model, spec_path = _llama(tmp_path, "output")
    rc = main(["run", model, "--spec", spec_path, "--nproc", "2", "--json", "--keep", str(tmp_path / "out")])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out.get("verdict") == "OK", out
    assert ('torch.nn.functional.pad(whole(take(ckpt, "lm_head.weight", (97, 32)'
            in (tmp_path / "out" / "program.py").read_text())


BIASED = '''
import torch
from torch import nn


class BiasedHead(nn.Module):
    """An embedding (7 rows) and an untied nn.Linear LM head with a bias: 7 classes."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 8)
        self.head = nn.Linear(8, 7)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


def biased_head():
    torch.manual_seed(0)
    return BiasedHead(), (torch.randint(0, 7, (2, 4)),), ["ids"]
'''


@pytest.mark.parametrize("train", ["train loss=cross_entropy optimizer=adamw(lr=0.01) steps=2\n", ""])
def test_an_untied_head_with_a_bias_pads_its_bias_too(capsys, tmp_path, train):
    (tmp_path / "biased.py").write_text(BIASED)
    (tmp_path / "head.pcs").write_text("mesh tp=2\nhead.weight colwise\n" + train)
    model, spec_path = f"{tmp_path / 'biased.py'}:biased_head", str(tmp_path / "head.pcs")
    from parcomp.frontends.loader import load_model
    from parcomp.spec import load_spec

    g = compile_graph(load_model(model)[0], load_spec(spec_path)).logical
    assert g["head.weight"].type.shape == (8, 8) and g["head.weight"].attr("stored_shape") == (7, 8)
    assert g["head.bias"].type.shape == (8,) and g["head.bias"].attr("stored_shape") == (7,)
    rc = main(["check", model, "--spec", spec_path, "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0
    assert_check_ok(out)
