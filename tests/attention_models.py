"""Small transformers attention blocks (random weights) for tests/rules/test_attention.py.

Factories return ``(module, example_inputs, input_names)`` as ``parcomp check FILE:FACTORY``
expects. Llama's block includes its rotary embedding (cos/sin computed from the
``inv_freq`` buffer and ``arange`` positions, applied with slice/neg/cat/mul/add).
"""
import torch
from transformers import GPT2Config, LlamaConfig
from transformers.masking_utils import create_causal_mask
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding, apply_rotary_pos_emb


class GptAttention(torch.nn.Module):
    def __init__(self, heads=4, hidden=16, impl="sdpa"):
        super().__init__()
        cfg = GPT2Config(n_embd=hidden, n_head=heads, n_layer=1, vocab_size=50, n_positions=8,
                         use_cache=False, attn_pdrop=0.0, resid_pdrop=0.0)
        cfg._attn_implementation = impl
        self.attn = GPT2Attention(cfg, layer_idx=0)

    def forward(self, x):
        return self.attn(x)[0]


class LlamaBlockAttention(torch.nn.Module):
    def __init__(self, heads=4, kv_heads=2, hidden=16, impl="sdpa"):
        super().__init__()
        cfg = LlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                          intermediate_size=32, num_hidden_layers=1, vocab_size=50,
                          max_position_embeddings=16, use_cache=False)
        cfg._attn_implementation = impl
        self.attn = LlamaAttention(cfg, layer_idx=0)
        self.rope = LlamaRotaryEmbedding(cfg)

    def forward(self, x):
        cos, sin = self.rope(x, torch.arange(x.shape[1]).unsqueeze(0))
        return self.attn(x, (cos, sin), None)[0]


class MaskedLlamaAttention(LlamaBlockAttention):
    """Llama attention with the causal mask transformers' LlamaModel builds (masking_utils:
    arange positions, packed-sequence detection, an explicit boolean [B, 1, S, S] mask)."""

    def forward(self, x):
        pos = torch.arange(x.shape[1]).unsqueeze(0).expand(x.shape[0], -1)
        mask = create_causal_mask(config=self.attn.config, inputs_embeds=x, attention_mask=None,
                                  cache=None, position_ids=pos)
        cos, sin = self.rope(x, pos)
        return self.attn(x, (cos, sin), mask)[0]


class Rope(torch.nn.Module):
    """RoPE alone on q, k [batch, heads, seq, head_dim], tables from the module's buffer."""

    def __init__(self, head_dim=8):
        super().__init__()
        cfg = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, max_position_embeddings=16)
        self.rope = LlamaRotaryEmbedding(cfg)

    def forward(self, q, k):
        cos, sin = self.rope(q, torch.arange(q.shape[2]).unsqueeze(0))
        return apply_rotary_pos_emb(q, k, cos, sin)


def _x(seq=8, hidden=16):
    torch.manual_seed(0)
    return (torch.randn(2, seq, hidden),)


def gpt2_attention():
    torch.manual_seed(0)
    return GptAttention().eval(), _x(), ["x"]


def llama_attention():  # 4 query heads, 2 kv heads
    torch.manual_seed(0)
    return LlamaBlockAttention().eval(), _x(), ["x"]


def llama_attention_kv2_h8():  # 8 query heads, 2 kv heads: fewer kv heads than 4 ranks
    torch.manual_seed(0)
    return LlamaBlockAttention(8, 2).eval(), _x(), ["x"]


def llama_attention_h6():  # 6 heads of 4, no GQA: not splittable over 4 ranks
    torch.manual_seed(0)
    return LlamaBlockAttention(6, 6, hidden=24).eval(), _x(hidden=24), ["x"]


def rope():
    torch.manual_seed(0)
    return Rope().eval(), (torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)), ["q", "k"]


def llama_attention_masked():
    torch.manual_seed(0)
    return MaskedLlamaAttention().eval(), _x(), ["x"]


def gpt2_attention_h3():  # 3 heads of 4: not splittable over 2 ranks
    torch.manual_seed(0)
    return GptAttention(3, 12).eval(), _x(hidden=12), ["x"]


class FusedGateUp(torch.nn.Module):
    """A Llama-style MLP with gate|up fused in one Linear [2 * ffn, hidden]."""

    def __init__(self, hidden=8, ffn=12):
        super().__init__()
        self.gate_up = torch.nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(torch.nn.functional.silu(gate) * up)


def fused_gate_up():
    torch.manual_seed(0)
    return FusedGateUp().eval(), (torch.randn(2, 4, 8),), ["x"]


class Mha(torch.nn.Module):
    """torch's nn.MultiheadAttention (batch_first): q, k, v packed in ``attn.in_proj_weight``
    [3 * embed, embed], cut apart after ``unflatten(-1, (3, embed))``."""

    def __init__(self, embed=16, heads=4):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(embed, heads, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


class PackedAttention(torch.nn.Module):
    """nn.MultiheadAttention's self-attention (no mask, no dropout) with its parameter names,
    q, k, v cut out of the in-projection's last dim (``chunk``), as GPT-2's c_attn: what the
    error on ``in_proj_weight colwise`` tells a user to write."""

    def __init__(self, embed=16, heads=4):
        super().__init__()
        self.heads = heads
        self.in_proj_weight = torch.nn.Parameter(torch.empty(3 * embed, embed))
        self.in_proj_bias = torch.nn.Parameter(torch.empty(3 * embed))
        self.out_proj = torch.nn.Linear(embed, embed)

    def forward(self, x):
        b, s, e = x.shape
        qkv = torch.nn.functional.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, -1)
        q, k, v = (t.view(b, s, self.heads, e // self.heads).transpose(1, 2) for t in qkv)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out_proj(o.transpose(1, 2).reshape(b, s, e))


class PackedBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = PackedAttention()

    def forward(self, x):
        return self.attn(x)


def mha():
    torch.manual_seed(0)
    return Mha().eval(), _x(), ["x"]


def mha_h6():  # 6 heads of 4: not splittable over 4 ranks
    torch.manual_seed(0)
    return Mha(24, 6).eval(), _x(hidden=24), ["x"]


def mha_packed():
    """:class:`PackedAttention` holding :func:`mha`'s weights (its state_dict)."""
    ref, x, names = mha()
    module = PackedBlock().eval()
    module.attn.load_state_dict(ref.attn.state_dict())
    return module, x, names
