"""Model factories for ``parcomp`` (``specs/models.py:FACTORY`` on the command line).

Every factory returns ``(module, example_inputs, input_names)``: an eval-mode
``nn.Module`` with deterministic random weights (fixed ``torch.manual_seed``,
nothing downloaded), a tuple of example tensors fixing the static shapes, and
the names of the graph's ``input`` nodes.
"""
from __future__ import annotations

import copy
import math
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


def gpt2_lm(batch: int = 2, seq: int = 8):
    """transformers' ``GPT2LMHeadModel``: 2 blocks, n_embd=32, 4 heads, vocab 101 (odd, as
    GPT-2's 50257 is: a tp split of the vocab needs padding), 64 positions, tied
    ``wte``/``lm_head`` weights (torch.export keeps one, ``lm_head.weight`` [101,32]),
    eval mode (dropout off), sdpa attention, ``use_cache=False``.

    Input ``input_ids``: int64[batch,seq] (seq <= 64); output ``logits`` f32[batch,seq,101]
    (the ``ModelOutput``'s key). ``train loss=cross_entropy`` adds the int64 input
    ``labels`` [batch,seq].
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    config = GPT2Config(vocab_size=101, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0, use_cache=False,
                        attn_implementation="sdpa")
    module = GPT2LMHeadModel(config).eval()
    return module, (torch.randint(0, 101, (batch, seq)),), ["input_ids"]


def llama_lm():
    """transformers' ``LlamaForCausalLM``: 2 blocks, hidden 64, MLP 128 (SiLU-gated),
    4 query heads and 2 kv heads (GQA) of dim 16, RoPE, RMSNorm, vocab 128, untied
    ``lm_head``, eval mode, sdpa attention, ``use_cache=False``.

    Input ``input_ids``: int64[2,8]; output ``logits`` f32[2,8,128]. RoPE's cos/sin and
    the causal mask are folded at import (no op; see docs/design/frontends.md).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
                         pad_token_id=None, use_cache=False, attn_implementation="sdpa")
    module = LlamaForCausalLM(config).eval()
    return module, (torch.randint(0, 128, (2, 8)),), ["input_ids"]


# ---- a model computing its own loss (loss part) ----
def with_labels(module):
    """``module`` (a transformers ``*ForCausalLM``) with ``forward(input_ids, labels)``: its own
    forward called with ``labels=``, so it returns ``loss`` (``ForCausalLMLoss``: labels padded
    with -100 and shifted left, mean cross-entropy over the counted tokens) and ``logits``.
    The class is swapped, not wrapped: the parameters keep their names."""
    base = type(module)

    def forward(self, input_ids, labels):
        return base.forward(self, input_ids=input_ids, labels=labels)

    module.__class__ = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__})
    return module


def _labels(ids, vocab: int):
    """Seeded labels for ``ids`` [batch, seq] with one ignored (-100) token per row."""
    g = torch.Generator().manual_seed(SEED + 1)
    labels = torch.randint(0, vocab, ids.shape, generator=g)
    labels[:, 2] = -100
    return labels


def gpt2_lm_loss(batch: int = 2, seq: int = 8):
    """:func:`gpt2_lm` called with ``labels``: inputs ``input_ids``, ``labels`` int64[batch,seq];
    outputs ``loss`` f32[] (transformers' shifted cross-entropy) and ``logits``
    (``train loss=output output=loss``)."""
    module, (ids,), _ = gpt2_lm(batch, seq)
    return with_labels(module), (ids, _labels(ids, 101)), ["input_ids", "labels"]


def llama_lm_loss():
    """:func:`llama_lm` called with ``labels`` (as :func:`gpt2_lm_loss`)."""
    module, (ids,), _ = llama_lm()
    return with_labels(module), (ids, _labels(ids, 128)), ["input_ids", "labels"]


# ---- expert parallel MoE ----
class MixtralMoE(nn.Module):
    """transformers' ``MixtralSparseMoeBlock`` written with parcomp's MoE custom ops, so that
    ``torch.export`` keeps static shapes (parcomp/frontends/torch/moe.py says why).

    Params: ``gate.weight`` [E, H] (the router), ``experts.gate_proj`` / ``experts.up_proj``
    [E, F, H] (Mixtral's fused ``gate_up_proj`` [E, 2F, H] cut in its two halves) and
    ``experts.down_proj`` [E, H, F]. ``capacity``: slots per expert per batch row (0: the
    sequence length, nothing dropped, as Mixtral); ``capacity_factor`` f > 0 instead sets
    ``min(ceil(f * S * top_k / E), S)`` (an expert takes at most one slot per token) and drops
    the later tokens of an expert that is full.
    """

    def __init__(self, moe, seq: int, capacity_factor: float = 0.0):
        super().__init__()
        e, f2, h = moe.experts.gate_up_proj.shape
        self.top_k, self.experts_n, self.seq = moe.top_k, e, seq
        self.capacity = min(math.ceil(capacity_factor * seq * moe.top_k / e), seq) if capacity_factor else 0
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(moe.gate.weight.detach().clone())
        self.experts = nn.Module()
        self.experts.gate_proj = nn.Parameter(moe.experts.gate_up_proj.detach()[:, :f2 // 2].clone())
        self.experts.up_proj = nn.Parameter(moe.experts.gate_up_proj.detach()[:, f2 // 2:].clone())
        self.experts.down_proj = nn.Parameter(moe.experts.down_proj.detach().clone())

    def forward(self, x):
        from parcomp.frontends.torch.moe import moe_combine, moe_dispatch, moe_route

        b, s, h = x.shape
        e, slots = self.experts_n, self.capacity or s
        c = moe_route(torch.nn.functional.linear(x, self.gate.weight), self.top_k, self.capacity)
        d = moe_dispatch(x, c, slots, False).permute(1, 0, 2, 3).reshape(e, b * slots, h)
        g = torch.matmul(d, self.experts.gate_proj.transpose(1, 2))
        u = torch.matmul(d, self.experts.up_proj.transpose(1, 2))
        y = torch.matmul(torch.nn.functional.silu(g) * u, self.experts.down_proj.transpose(1, 2))
        return moe_combine(y.reshape(e, b, slots, h).permute(1, 0, 2, 3), c, True)


def mixtral_moe(experts: int = 4, top_k: int = 2, hidden: int = 16, inter: int = 32, seed: int = SEED):
    """transformers' ``MixtralSparseMoeBlock`` (small config, random weights: its params are
    ``torch.empty``, so drawn here: normal, std 0.3 router / 0.2 experts)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(seed)
    config = MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                           num_experts_per_tok=top_k, router_jitter_noise=0.0)
    moe = MixtralSparseMoeBlock(config).eval()
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.3)
        moe.experts.gate_up_proj.normal_(0, 0.2)
        moe.experts.down_proj.normal_(0, 0.2)
    return moe


def skew_routing(moe, x):
    """Feature 0 of ``x`` made a positive bias (>= 2) that the router reads: expert 0 gets
    (nearly) every token, the last expert none."""
    with torch.no_grad():
        x[..., 0] = x[..., 0].abs() + 2.0
        moe.gate.weight[:, 0] = 0.0
        moe.gate.weight[0, 0] = 2.0
        moe.gate.weight[-1, 0] = -8.0
    return moe, x


def moe_block(routing: str = "random", batch: int = 4, seq: int = 8, capacity_factor: float = 0.0, **kw):
    """Mixtral's MoE block (E=4 experts, top-2, hidden 16, intermediate 32) as
    :class:`MixtralMoE`. Input ``x``: f32[batch, seq, 16] (a row is a routing group); output
    f32[batch, seq, 16]. ``routing="skewed"``: :func:`skew_routing`."""
    moe = mixtral_moe(**kw)
    x = torch.randn(batch, seq, moe.experts.gate_up_proj.shape[2])
    if routing == "skewed":
        moe, x = skew_routing(moe, x)
    return MixtralMoE(moe, seq, capacity_factor).eval(), (x,), ["x"]


def moe_block_skewed():
    """:func:`moe_block` with ``routing="skewed"``: expert 0 takes most tokens, expert 3 none."""
    return moe_block("skewed")


class QwenMoE(MixtralMoE):
    """transformers' ``Qwen2MoeSparseMoeBlock`` (``norm_topk_prob=True``, as Qwen3-MoE): the
    routed experts of :class:`MixtralMoE` plus a *shared expert* every token goes through, a
    SwiGLU MLP (``shared_expert.{gate,up,down}_proj.weight``, torch Linear [out, in]) scaled by
    ``sigmoid(shared_expert_gate(x))`` (``shared_expert_gate.weight`` [1, H])."""

    def __init__(self, moe, seq: int, capacity_factor: float = 0.0):
        moe.top_k = moe.gate.top_k
        super().__init__(moe, seq, capacity_factor)
        self.shared_expert = copy.deepcopy(moe.shared_expert)
        self.shared_expert_gate = copy.deepcopy(moe.shared_expert_gate)

    def forward(self, x):
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return super().forward(x) + shared


def qwen_moe(experts: int = 4, top_k: int = 2, hidden: int = 16, inter: int = 32, shared: int = 24,
             seed: int = SEED):
    """transformers' ``Qwen2MoeSparseMoeBlock`` (small config, ``norm_topk_prob=True``; its
    expert params are ``torch.empty``, so all are drawn here: normal, std 0.3 router / 0.2 else)."""
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    torch.manual_seed(seed)
    config = Qwen2MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                            num_experts_per_tok=top_k, shared_expert_intermediate_size=shared,
                            norm_topk_prob=True)
    moe = Qwen2MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.normal_(0, 0.3 if name == "gate.weight" else 0.2)
    return moe


def moe_block_shared(routing: str = "random", batch: int = 4, seq: int = 8, capacity_factor: float = 0.0):
    """Qwen-MoE's block with a shared expert (:class:`QwenMoE`; E=4, top-2, hidden 16, expert
    intermediate 32, shared 24). Input ``x``: f32[batch, seq, 16]; output the same shape.
    ``routing="skewed"``: :func:`skew_routing`, expert 0 takes most tokens (in float32 its
    router gradient is then too close to rounding to vouch for: ``check`` re-runs it in float64)."""
    moe = qwen_moe()
    x = torch.randn(batch, seq, moe.experts.gate_up_proj.shape[2])
    if routing == "skewed":
        moe, x = skew_routing(moe, x)
    return QwenMoE(moe, seq, capacity_factor).eval(), (x,), ["x"]


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
    """Causal self-attention for context parallel: transformers' ``LlamaAttention``
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


# ---- more transformers models for tensor-parallel training (small configs, random weights) ----
# Each is transformers' own class, unedited, with its config's defaults where they matter:
# OPT, BERT and Gemma-2 keep their default ``pad_token_id``, so transformers builds
# ``nn.Embedding(padding_idx=...)`` (the pad row gets no gradient from the lookup).
def qwen2_lm():
    """transformers' ``Qwen2ForCausalLM``: as :func:`llama_lm` (2 blocks, hidden 64, MLP 128,
    4 query and 2 kv heads of dim 16, RoPE, RMSNorm, vocab 128, untied ``lm_head``) plus
    Qwen2's biases on ``q_proj``/``k_proj``/``v_proj``. Input ``input_ids``: int64[2,8];
    output ``logits`` f32[2,8,128]."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(SEED)
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
                         use_cache=False, attn_implementation="sdpa")
    return Qwen2ForCausalLM(config).eval(), (torch.randint(0, 128, (2, 8)),), ["input_ids"]


def mistral_lm():
    """transformers' ``MistralForCausalLM`` with a sliding window (4) shorter than the sequence
    (8): 2 blocks, hidden 64, SiLU-gated MLP 128, 4 query and 2 kv heads of dim 16, RoPE,
    RMSNorm, untied ``lm_head``, vocab 128, sdpa attention whose mask (each query sees itself
    and the 3 keys before it) folds to ``sdpa {causal, window=4}``. Input ``input_ids``:
    int64[2,8]; output ``logits`` f32[2,8,128]."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(SEED)
    config = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, max_position_embeddings=64, sliding_window=4,
                           use_cache=False, attn_implementation="sdpa")
    return MistralForCausalLM(config).eval(), (torch.randint(0, 128, (2, 8)),), ["input_ids"]


def gemma_lm():
    """transformers' ``GemmaForCausalLM``: 2 blocks, hidden 64, GeGLU MLP 128 (tanh GELU),
    4 query and 2 kv heads of dim 16, RoPE, RMSNorm (1 + weight), embeddings scaled by
    sqrt(hidden) and tied to the LM head, vocab 128, sdpa attention; the default
    ``pad_token_id`` (0), so the token embedding has ``padding_idx=0``. Input ``input_ids``:
    int64[2,8]; output ``logits`` f32[2,8,128]."""
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(SEED)
    config = GemmaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=64, use_cache=False,
                         attn_implementation="sdpa")
    return GemmaForCausalLM(config).eval(), (torch.randint(0, 128, (2, 8)),), ["input_ids"]


def gemma2_lm():
    """transformers' ``Gemma2ForCausalLM``: 2 blocks, hidden 64, GeGLU MLP 128, 4 query and
    2 kv heads of dim 16, RoPE, RMSNorm (1 + weight) before and after attention and MLP,
    embeddings scaled by sqrt(hidden) and tied to the LM head, attention logits soft-capped at
    50 and final logits at 30 (Gemma-2's defaults), vocab 128, the default ``pad_token_id``
    (0: ``padding_idx=0``). ``eager`` attention (transformers refuses sdpa for Gemma-2): its
    masks are constants added to the scores. A sliding window of 4 over the sequence of 8:
    layer 0 (local) sees the last 4 keys, layer 1 (global) every earlier key. Input
    ``input_ids``: int64[2,8]; output ``logits`` f32[2,8,128]."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(SEED)
    config = Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
                          sliding_window=4, use_cache=False, attn_implementation="eager")
    return Gemma2ForCausalLM(config).eval(), (torch.randint(0, 128, (2, 8)),), ["input_ids"]


def opt_lm():
    """transformers' ``OPTForCausalLM``: 2 blocks, hidden 64, ReLU MLP 128 (``fc1``/``fc2``),
    4 heads, learned positions (offset 2), LayerNorm before attention and MLP, LM head tied to
    the token embedding, vocab 128, sdpa attention, dropout 0. Input ``input_ids``:
    int64[2,8]; output ``logits`` f32[2,8,128]."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(SEED)
    config = OPTConfig(vocab_size=128, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                       num_attention_heads=4, word_embed_proj_dim=64, max_position_embeddings=64,
                       dropout=0.0, attention_dropout=0.0, use_cache=False,
                       attn_implementation="sdpa")
    return OPTForCausalLM(config).eval(), (torch.randint(0, 128, (2, 8)),), ["input_ids"]


def bert_mlm():
    """transformers' ``BertForMaskedLM``: 2 post-norm encoder blocks, hidden 64, GELU MLP 128,
    4 heads, learned positions, token type 0, the MLM head (dense, GELU, LayerNorm, decoder
    tied to the word embeddings), vocab 128, bidirectional sdpa attention, dropout 0. Input
    ``input_ids``: int64[2,8]; output ``logits`` f32[2,8,128]."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(SEED)
    config = BertConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=64,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        attn_implementation="sdpa")
    return BertForMaskedLM(config).eval(), (torch.randint(0, 128, (2, 8)),), ["input_ids"]


class ViTClassifier(nn.Module):
    """A ViT image classifier built from transformers' ``ViTLayer`` blocks (pre-norm, sdpa).

    ``ViTForImageClassification`` embeds patches with a ``Conv2d`` (kernel = stride = patch),
    which the frontend lowers to a matmul over the patches (:func:`vit_classifier` is that
    class itself); here the same map is written as a ``Linear`` over each flattened patch
    (``patch_embed``). Then a class token, learned positions, the blocks (``layers.N``), a final
    LayerNorm and a linear ``classifier`` on the class token, as ``ViTForImageClassification``.
    """

    def __init__(self, config):
        from transformers.models.vit.modeling_vit import ViTLayer

        super().__init__()
        c, p, h = config.num_channels, config.patch_size, config.hidden_size
        self.patch = p
        self.patch_embed = nn.Linear(c * p * p, h)
        self.cls_token = nn.Parameter(torch.randn(1, 1, h) * 0.02)
        self.position_embeddings = nn.Parameter(torch.randn(1, (config.image_size // p) ** 2 + 1, h) * 0.02)
        self.layers = nn.ModuleList([ViTLayer(config) for _ in range(config.num_hidden_layers)])
        self.layernorm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.classifier = nn.Linear(h, config.num_labels)

    def forward(self, pixel_values):
        b, c, height, width = pixel_values.shape
        p = self.patch
        x = pixel_values.reshape(b, c, height // p, p, width // p, p).permute(0, 2, 4, 1, 3, 5)
        x = self.patch_embed(x.reshape(b, (height // p) * (width // p), c * p * p))
        x = torch.cat([self.cls_token.expand(b, -1, -1), x], dim=1) + self.position_embeddings
        for layer in self.layers:
            x = layer(x)
        return self.classifier(self.layernorm(x)[:, 0])


def vit_style():
    """:class:`ViTClassifier`: 8x8 RGB images in 4x4 patches (4 patches and the class token),
    2 blocks, hidden 64, GELU MLP 128 (``mlp.fc1``/``mlp.fc2``), 4 heads, 10 classes, dropout 0.
    Input ``pixel_values``: f32[2,3,8,8]; output ``output`` f32[2,10]."""
    from transformers import ViTConfig

    torch.manual_seed(SEED)
    config = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       attn_implementation="sdpa")
    return ViTClassifier(config).eval(), (torch.randn(2, 3, 8, 8),), ["pixel_values"]


def vit_classifier():
    """transformers' ``ViTForImageClassification`` as it comes: 8x8 RGB images cut into 4x4
    patches by its ``Conv2d`` patch embedding (kernel = stride = 4: lowered to a matmul over
    the patches), a class token and learned positions (5 tokens), 2 pre-norm blocks, hidden 64,
    GELU MLP 128, 4 heads, sdpa attention, the classifier on the class token, 10 classes,
    dropout 0. Input ``pixel_values``: f32[2,3,8,8]; output ``logits`` f32[2,10]."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(SEED)
    config = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       attn_implementation="sdpa")
    return ViTForImageClassification(config).eval(), (torch.randn(2, 3, 8, 8),), ["pixel_values"]


# ---- a whole MoE LM (expert parallel outside the MoE block) ----
def moe_lm(batch: int = 4, seq: int = 8):
    """transformers' ``MixtralForCausalLM``: 2 blocks, hidden 16, 4 query heads and 2 kv heads
    (GQA) of dim 4, RoPE, RMSNorm, vocab 64, untied ``lm_head``, eval mode, sdpa attention,
    ``use_cache=False``; each block's ``MixtralSparseMoeBlock`` (4 experts, top-2,
    intermediate 32) replaced by :class:`MixtralMoE` (the same routing, static shapes).

    Input ``input_ids``: int64[batch, seq]; output ``logits`` f32[batch, seq, 64]. The expert
    weights are ``model.layers.<i>.mlp.experts.*``, the router ``model.layers.<i>.mlp.gate.weight``.
    """
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(SEED)
    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=64, router_jitter_noise=0.0,
                           bos_token_id=0, eos_token_id=1, pad_token_id=None, use_cache=False,
                           attn_implementation="sdpa")
    module = MixtralForCausalLM(config).eval()
    for layer in module.model.layers:
        with torch.no_grad():  # the experts are torch.empty: drawn as mixtral_moe draws them
            layer.mlp.gate.weight.normal_(0, 0.3)
            layer.mlp.experts.gate_up_proj.normal_(0, 0.2)
            layer.mlp.experts.down_proj.normal_(0, 0.2)
        layer.mlp = MixtralMoE(layer.mlp, seq).eval()
    return module, (torch.randint(0, 64, (batch, seq)),), ["input_ids"]


# ---- transformers' MoE LMs as they come (the experts traced with static shapes on import) ----
def _draw_moe(module):
    """transformers leaves the experts (and routers) ``torch.empty``: drawn as
    :func:`mixtral_moe` draws them (normal, std 0.3 router / 0.2 experts)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if ".mlp.experts." in name or name.endswith(".mlp.gate.weight"):
                p.normal_(0, 0.3 if name.endswith("gate.weight") else 0.2)
    return module


def mixtral_lm(batch: int = 4, seq: int = 8):
    """transformers' ``MixtralForCausalLM`` unedited: as :func:`moe_lm` (2 blocks, hidden 16,
    4 query and 2 kv heads, 4 experts top-2, intermediate 32, vocab 64) with its own
    ``MixtralSparseMoeBlock``: the router's softmax and ``topk``, the experts' fused
    ``gate_up_proj`` [4, 64, 16] and ``down_proj`` [4, 16, 32]. Input ``input_ids``:
    int64[batch, seq]; output ``logits`` f32[batch, seq, 64]."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(SEED)
    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=64, router_jitter_noise=0.0,
                           bos_token_id=0, eos_token_id=1, pad_token_id=None, use_cache=False,
                           attn_implementation="sdpa")
    module = _draw_moe(MixtralForCausalLM(config).eval())
    return module, (torch.randint(0, 64, (batch, seq)),), ["input_ids"]


def qwen2_moe_lm(batch: int = 4, seq: int = 8):
    """transformers' ``Qwen2MoeForCausalLM`` unedited: 2 blocks, hidden 16, 4 query and 2 kv
    heads, 4 experts top-2 (intermediate 32) plus the shared expert (24) behind its sigmoid
    gate, vocab 64. Input ``input_ids``: int64[batch, seq]; output ``logits`` f32[batch, seq, 64]."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(SEED)
    config = Qwen2MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=32,
                            shared_expert_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                            max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=None,
                            use_cache=False, attn_implementation="sdpa")
    module = _draw_moe(Qwen2MoeForCausalLM(config).eval())
    return module, (torch.randint(0, 64, (batch, seq)),), ["input_ids"]


def phi3_lm():
    """transformers' ``Phi3ForCausalLM``: 2 blocks, hidden 64, 4 query and 2 kv heads of dim 16
    in one fused ``qkv_proj`` [128, 64] (q | k | v rows), a fused ``gate_up_proj`` [256, 64]
    (gate | up rows) before ``down_proj``, RoPE, RMSNorm, vocab 128, ``pad_token_id`` 0
    (``padding_idx=0``), sdpa attention. Input ``input_ids``: int64[2,8]; output ``logits``."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(SEED)
    config = Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        bos_token_id=0, eos_token_id=1, pad_token_id=0, use_cache=False,
                        attn_implementation="sdpa")
    return Phi3ForCausalLM(config).eval(), (torch.randint(0, 128, (2, 8)),), ["input_ids"]


def gpt_neox_lm():
    """transformers' ``GPTNeoXForCausalLM``: 2 parallel-residual blocks, hidden 64, 4 heads with
    q|k|v interleaved per head in ``query_key_value`` [192, 64], partial RoPE (25%), GELU MLP 128,
    LayerNorm, untied ``embed_out``, vocab 128, sdpa. Input ``input_ids``: int64[2,8]."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(SEED)
    config = GPTNeoXConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=64, bos_token_id=0,
                           eos_token_id=1, use_cache=False, attn_implementation="sdpa")
    return GPTNeoXForCausalLM(config).eval(), (torch.randint(0, 128, (2, 8)),), ["input_ids"]


def falcon_lm():
    """transformers' ``FalconForCausalLM`` with multi-query attention (Falcon-7B's layout):
    2 parallel-attention blocks, hidden 64, 4 query heads and one kv head of dim 16 in a fused
    ``query_key_value`` [96, 64], RoPE, GELU MLP 256, LayerNorm, LM head tied to the embedding,
    vocab 128, sdpa, dropout 0. Input ``input_ids``: int64[2,8]; output ``logits``."""
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(SEED)
    config = FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          multi_query=True, new_decoder_architecture=False, parallel_attn=True,
                          bias=False, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
                          hidden_dropout=0.0, attention_dropout=0.0, use_cache=False,
                          attn_implementation="sdpa")
    return FalconForCausalLM(config).eval(), (torch.randint(0, 128, (2, 8)),), ["input_ids"]


def deepseek_v3_lm():
    """transformers' ``DeepseekV3ForCausalLM``: 2 blocks (the first dense, the second MoE:
    4 routed experts top-2 with sigmoid scores, group-limited routing, one shared expert), MLA
    attention (q through a rank-32 LoRA, keys and values from a rank-16 latent, rotary part 8
    and no-position part 16 per head, 4 heads), hidden 64, vocab 128, sdpa. Input
    ``input_ids``: int64[2,8]; output ``logits`` f32[2,8,128]."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(SEED)
    config = DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
                              num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                              topk_group=1, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=16,
                              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                              max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
                              pad_token_id=None, use_cache=False, attn_implementation="sdpa")
    module = _draw_moe(DeepseekV3ForCausalLM(config).eval())
    return module, (torch.randint(0, 128, (2, 8)),), ["input_ids"]


def deepseek_v2_lm():
    """transformers' ``DeepseekV2ForCausalLM``: as :func:`deepseek_v3_lm` (MLA, a dense then an
    MoE block, hidden 64, vocab 128) with DeepSeek-V2's complex rotary embedding
    (``view_as_complex`` times the ``polar`` table, ``view_as_real``: real arithmetic on import)
    and its softmax router (greedy top-2 of 4 experts, one shared expert). Input ``input_ids``:
    int64[2,8]; output ``logits`` f32[2,8,128]."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(SEED)
    config = DeepseekV2Config(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
                              num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                              n_shared_experts=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                              qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=64,
                              bos_token_id=0, eos_token_id=1, pad_token_id=None, use_cache=False,
                              attn_implementation="sdpa")
    module = _draw_moe(DeepseekV2ForCausalLM(config).eval())
    return module, (torch.randint(0, 128, (2, 8)),), ["input_ids"]
