"""What each gloo rank runs for tests/frontends/test_grouped_qkv.py (through gloo_ranks.run_ranks):
parcomp.parallelize on Phi-3, whose fused qkv_proj is viewed per kv group with its heads
reordered on load, against the unsharded model in the same loop."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

import parcomp

PHI3_TP = """mesh tp=2
model.layers.*.self_attn.qkv_proj.weight  colwise
model.layers.*.self_attn.o_proj.weight    rowwise
model.layers.*.mlp.gate_up_proj.weight    colwise
model.layers.*.mlp.down_proj.weight       rowwise
"""


def tiny_phi3():
    """transformers' Phi3ForCausalLM, 1 block, hidden 64, 4 query and 2 kv heads, vocab 101."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    config = Phi3Config(vocab_size=101, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                        bos_token_id=0, eos_token_id=1, pad_token_id=None, use_cache=False,
                        attn_implementation="sdpa")
    return Phi3ForCausalLM(config).eval()


def _train_equal(model, vocab, spec, steps, cache_dir):
    """``steps`` AdamW steps of ``model`` sharded by ``spec`` and of its unsharded copy on the
    same batches (token ids below ``vocab``): the sharded module and the largest difference of
    the losses."""
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, vocab, (2, 8), generator=g), torch.randint(0, vocab, (2, 8), generator=g))
               for _ in range(steps)]

    def loss_of(logits, labels):
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    def train(module, logits_of):
        opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
        losses = []
        for ids, labels in batches:
            loss = loss_of(logits_of(module(ids)), labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    ref_losses = train(ref, lambda out: out.logits)
    par = parcomp.parallelize(model, (batches[0][0],), spec, cache_dir=cache_dir)
    losses = train(par, lambda out: out["logits"])
    full = par.full_state_dict()
    dist.barrier()
    return full, {"loss_err": max(abs(a - b) for a, b in zip(ref_losses, losses)),
                  "param_err": max((full[k] - v).abs().max().item()
                                   for k, v in ref.state_dict().items() if k in full)}


def train_phi3_equal(rank, world, steps=3, cache_dir=None):
    """3 AdamW steps of the sharded and the unsharded Phi-3 on the same batches: the largest
    differences of the losses and of the full parameters (``full_state_dict``: the qkv_proj's
    heads back in the stored order) after them."""
    full, result = _train_equal(tiny_phi3(), 101, PHI3_TP, steps, cache_dir)
    return {**result, "qkv_shape": list(full["model.layers.0.self_attn.qkv_proj.weight"].shape)}


FALCON_TP = """mesh tp=2
transformer.h.*.self_attention.query_key_value.weight  colwise
transformer.h.*.self_attention.dense.weight            rowwise
transformer.h.*.mlp.dense_h_to_4h.weight               colwise
transformer.h.*.mlp.dense_4h_to_h.weight               rowwise
"""


def train_falcon_equal(rank, world, steps=3, cache_dir=None):
    """3 AdamW steps of the sharded and the unsharded Falcon (multi-query: query_key_value cut
    into its query rows and its kv rows on load) on the same batches: the largest differences of
    the losses and of the full parameters (``full_state_dict``: the two parts joined back into
    the stored rows) after them."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "specs"))
    import models

    full, result = _train_equal(models.falcon_lm()[0], 128, FALCON_TP, steps, cache_dir)
    qkv = "transformer.h.0.self_attention.query_key_value.weight"
    return {**result, "qkv_shape": list(full[qkv].shape), "kv_part_named": qkv + "_kv" in full}
