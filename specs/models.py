"""Model factories for ``parcomp`` (``specs/models.py:FACTORY`` on the command line).

Every factory returns ``(module, example_inputs, input_names)``: an eval-mode
``nn.Module`` with deterministic random weights (fixed ``torch.manual_seed``,
nothing downloaded), a tuple of example tensors fixing the static shapes, and
the names of the graph's ``input`` nodes.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

SEED = 0


def gpt2_mlp():
    """transformers' ``GPT2MLP`` (Conv1D c_fc -> gelu_new -> Conv1D c_proj -> dropout).

    n_embd=32, intermediate 128, resid_pdrop=0. Conv1D weights are stored
    ``[in, out]``: ``c_fc.weight`` [32,128], ``c_proj.weight`` [128,32].
    Input ``x``: f32[2,8,32]; output f32[2,8,32].
    """
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    torch.manual_seed(SEED)
    config = GPT2Config(n_embd=32, n_layer=1, n_head=4, resid_pdrop=0.0,
                        activation_function="gelu_new")
    module = GPT2MLP(4 * config.n_embd, config).eval()
    return module, (torch.randn(2, 8, 32),), ["x"]


def torch_mlp():
    """``nn.Sequential(Linear(32,128), GELU(), Linear(128,32))``; params ``0.*`` and ``2.*``.

    ``nn.Linear`` weights are stored ``[out, in]``: ``0.weight`` [128,32].
    Input ``x``: f32[2,8,32]; output f32[2,8,32].
    """
    torch.manual_seed(SEED)
    module = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)).eval()
    return module, (torch.randn(2, 8, 32),), ["x"]


def mlp_chain(blocks: int = 48, hidden: int = 32):
    """``blocks`` x (Linear(h,4h), GELU, Linear(4h,h)) in one flat ``nn.Sequential``.

    For compile-time benchmarks. Block k owns params ``{3k}.*`` and ``{3k+2}.*``.
    Input ``x``: f32[2,8,hidden]; output f32[2,8,hidden].
    """
    torch.manual_seed(SEED)
    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)]
    return nn.Sequential(*layers).eval(), (torch.randn(2, 8, hidden),), ["x"]


def tiny_relu_mlp():
    """The worked example: x=[[1,2]] -> fc1 -> relu -> fc2 = [[17,10]], no biases.

    ``fc1.weight`` f32[4,2] (stored [out,in]) is the transpose of
    ``[[1,2,0,1],[0,1,3,2]]``, so x @ that = [[1,4,6,5]]; relu keeps it;
    ``fc2.weight`` f32[2,4] is the transpose of ``[[1,0],[0,1],[1,1],[2,0]]``,
    giving [[17,10]]. Input ``x``: f32[1,2]; output f32[1,2].
    """
    module = nn.Sequential(OrderedDict(
        fc1=nn.Linear(2, 4, bias=False), relu=nn.ReLU(), fc2=nn.Linear(4, 2, bias=False)))
    with torch.no_grad():
        module.fc1.weight.copy_(torch.tensor([[1., 2., 0., 1.], [0., 1., 3., 2.]]).T)
        module.fc2.weight.copy_(torch.tensor([[1., 0.], [0., 1.], [1., 1.], [2., 0.]]).T)
    return module.eval(), (torch.tensor([[1., 2.]]),), ["x"]


def gpt2_lm():
    """transformers' ``GPT2LMHeadModel``: 2 blocks, n_embd=32, 4 heads, vocab 101 (odd, as
    GPT-2's 50257 is: a tp split of the vocab needs padding), 64 positions, tied
    ``wte``/``lm_head`` weights (torch.export keeps one, ``lm_head.weight`` [101,32]),
    eval mode (dropout off), sdpa attention, ``use_cache=False``.

    Input ``input_ids``: int64[2,8]; output ``logits`` f32[2,8,101] (the ``ModelOutput``'s
    key). ``train loss=cross_entropy`` adds the int64 input ``labels`` [2,8].
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    config = GPT2Config(vocab_size=101, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0, use_cache=False,
                        attn_implementation="sdpa")
    module = GPT2LMHeadModel(config).eval()
    return module, (torch.randint(0, 101, (2, 8)),), ["input_ids"]


def llama_lm():
    """transformers' ``LlamaForCausalLM``: 2 blocks, hidden 64, MLP 128 (SiLU-gated),
    4 query heads and 2 kv heads (GQA) of dim 16, RoPE, RMSNorm, vocab 128, untied
    ``lm_head``, eval mode, sdpa attention, ``use_cache=False``.

    Input ``input_ids``: int64[2,8]; output ``logits`` f32[2,8,128]. RoPE's cos/sin and
    the causal mask are folded at import (no op; see docs/design.md).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
                         pad_token_id=None, use_cache=False, attn_implementation="sdpa")
    module = LlamaForCausalLM(config).eval()
    return module, (torch.randint(0, 128, (2, 8)),), ["input_ids"]


class _CausalAttention(nn.Module):
    """transformers' LlamaAttention with its rotary embedding; positions ``arange(seq)``."""

    def __init__(self, config):
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

        super().__init__()
        self.attn = LlamaAttention(config, layer_idx=0)
        self.rope = LlamaRotaryEmbedding(config)

    def forward(self, x):
        cos, sin = self.rope(x, torch.arange(x.shape[1]).unsqueeze(0))
        return self.attn(x, (cos, sin), None)[0]


def causal_attention(seq: int = 16):
    """Causal self-attention for context parallel (issue 14): transformers' ``LlamaAttention``
    (hidden 32, 4 query heads and 2 kv heads of dim 8, RoPE from global positions 0..seq-1,
    sdpa with ``is_causal``), eval mode, no cache.

    Input ``x``: float32[2, seq, 32]; output float32[2, seq, 32]. ``seq`` must divide by the
    cp size (16: cp=2 and cp=4).
    """
    from transformers import LlamaConfig

    torch.manual_seed(SEED)
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, num_hidden_layers=1, vocab_size=64,
                         max_position_embeddings=64, use_cache=False, attn_implementation="sdpa")
    module = _CausalAttention(config).eval()
    return module, (torch.randn(2, seq, 32),), ["x"]
