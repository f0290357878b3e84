"""A hand-written Megatron-style GPT: pre-norm, hand-written RMSNorm (or
nn.LayerNorm), fused qkv Linear, F.scaled_dot_product_attention(is_causal=True), SwiGLU MLP,
embedding tied to the LM head; 2 layers, d=32. Factories for ``parcomp check
tests/handwritten_gpt.py:NAME`` (tests/frontends/test_hand_written_gpt.py, test_tied_lm.py, test_explain_counts.py,
test_pinned_gathers.py, test_plan_estimates.py)."""
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
        q = q.view(b, s, self.h, d // self.h).transpose(1, 2)
        k = k.view(b, s, self.h, d // self.h).transpose(1, 2)
        v = v.view(b, s, self.h, d // self.h).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, s, d)
        return self.proj(y)


class SwiGLU(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.w1 = nn.Linear(d, f, bias=False)  # gate
        self.w3 = nn.Linear(d, f, bias=False)  # up
        self.w2 = nn.Linear(f, d, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, d, h, f, norm=RMSNorm):
        super().__init__()
        self.ln1 = norm(d)
        self.attn = Attention(d, h)
        self.ln2 = norm(d)
        self.mlp = SwiGLU(d, f)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=VOCAB, d=DIM, h=HEADS, layers=LAYERS, f=FFN, norm=RMSNorm):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d, h, f, norm) for _ in range(layers)])
        self.norm = norm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, idx):
        x = self.tok(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def gpt():
    torch.manual_seed(0)
    m = GPT().eval()
    return m, (torch.randint(0, VOCAB, (BATCH, SEQ)),), ["idx"]


def gpt_ln():
    torch.manual_seed(0)
    m = GPT(norm=nn.LayerNorm).eval()
    return m, (torch.randint(0, VOCAB, (BATCH, SEQ)),), ["idx"]


def gpt_ln_nobias():
    """LayerNorm without bias: float32's bound of the norms' gradients is not finite."""
    torch.manual_seed(0)
    m = GPT(norm=lambda d: nn.LayerNorm(d, bias=False)).eval()
    return m, (torch.randint(0, VOCAB, (BATCH, SEQ)),), ["idx"]


def _small(norm):
    """The usual 0.02-scaled embedding (Megatron / nanoGPT init)."""
    torch.manual_seed(0)
    m = GPT(norm=norm).eval()
    with torch.no_grad():
        m.tok.weight.mul_(0.02)
    return m, (torch.randint(0, VOCAB, (BATCH, SEQ)),), ["idx"]


def rms_small_init():
    return _small(RMSNorm)


def ln_small_init():
    return _small(nn.LayerNorm)
