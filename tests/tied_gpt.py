"""A hand-written pre-norm GPT (new-user trial F): hand-written RMSNorm (or nn.LayerNorm),
fused qkv Linear, F.scaled_dot_product_attention(is_causal=True), SwiGLU MLP, embedding tied
to the LM head; 2 layers, d=32. Factories for ``parcomp check tests/tied_gpt.py:NAME``."""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS, LAYERS, FFN, SEQ, BATCH = 64, 32, 4, 2, 64, 8, 2


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.h, d // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class SwiGLU(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.w1 = nn.Linear(d, f, bias=False)
        self.w3 = nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, d, h, f, norm):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = norm(d), Attention(d, h), norm(d), SwiGLU(d, f)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, norm=RMSNorm, layers=LAYERS):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(DIM, HEADS, FFN, norm) for _ in range(layers)])
        self.norm = norm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, idx):
        x = self.tok(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def _model(norm, small: bool):
    torch.manual_seed(0)
    m = GPT(norm=norm).eval()
    if small:  # the usual 0.02-scaled embedding
        with torch.no_grad():
            m.tok.weight.mul_(0.02)
    return m, (torch.randint(0, VOCAB, (BATCH, SEQ)),), ["idx"]


def rms_small_init():
    return _model(RMSNorm, True)


def ln_small_init():
    return _model(nn.LayerNorm, True)


def gpt_ln():
    return _model(nn.LayerNorm, False)
