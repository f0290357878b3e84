"""Small torch models that compute their own loss (``train loss=output``), for the tests of
gradient accumulation of a token-mean loss (tests/training/test_accumulate_token_mean.py)."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

MODELS = str(Path(__file__).resolve())
VOCAB, HIDDEN, BATCH, SEQ = 11, 8, 2, 4


class TokenLoss(nn.Module):
    """Embedding, tanh, a vocab head, and the mean cross-entropy over the tokens whose label is
    not ignore_index (-100), optionally shifted as transformers' causal LMs shift it; ``extra``:
    "" (the token mean alone), "aux" (plus a small mean-square term: a token mean inside a
    larger expression)."""

    def __init__(self, extra: str = "", shift: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB)
        self.extra, self.shift = extra, shift

    def forward(self, input_ids, labels):
        logits = self.head(torch.tanh(self.emb(input_ids)))
        if self.shift:  # ForCausalLMLoss: pad with ignore_index, then shift left by one
            labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
        flat, target = logits.reshape(-1, VOCAB), labels.reshape(-1)
        loss = F.cross_entropy(flat, target, ignore_index=-100)
        if self.extra == "aux":
            loss = loss + 0.01 * logits.pow(2).mean()
        return loss


def _example():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def token_mean():
    return TokenLoss(), _example(), ["input_ids", "labels"]


def shifted_token_mean():
    return TokenLoss(shift=True), _example(), ["input_ids", "labels"]


def token_mean_plus_aux():
    return TokenLoss("aux"), _example(), ["input_ids", "labels"]
