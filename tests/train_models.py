"""Small torch models for the training tests: what must not be trained, several outputs.

Each factory returns ``(module, example_inputs, input_names)`` like ``specs/models.py``;
``MODELS`` is this file, for ``parcomp check MODELS:factory``.
"""
from pathlib import Path

import torch
from torch import nn

MODELS = str(Path(__file__).resolve())

#: the spec of the buffer case: fc1 column-, fc2 row-parallel, 3 SGD steps
BUFFER_SPEC = ("mesh tp=2\nfc1.weight colwise\nfc2.weight rowwise\ninput x replicated\n"
               "train loss=mse optimizer=sgd(lr=0.5) steps=3\n")


class ScaledMLP(nn.Module):
    """``fc2(relu(fc1(x)) * s)`` with ``s`` a buffer (8 -> 16 -> 8); optionally fc1.bias frozen."""

    def __init__(self, frozen_bias: bool = False):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.register_buffer("s", torch.linspace(0.5, 2.0, 16))
        self.fc1.bias.requires_grad_(not frozen_bias)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)) * self.s)


def buffer_mlp():
    torch.manual_seed(0)
    return ScaledMLP().eval(), (torch.randn(4, 8),), ["x"]


def frozen_bias_mlp():
    torch.manual_seed(0)
    return ScaledMLP(frozen_bias=True).eval(), (torch.randn(4, 8),), ["x"]


class TwoOutputs(nn.Module):
    """``y = fc(x); return y, relu(y)``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return y, torch.relu(y)


def two_outputs():
    torch.manual_seed(0)
    return TwoOutputs().eval(), (torch.randn(4, 8),), ["x"]


# training options
def rowwise_linear():
    """``nn.Sequential(Linear(8, 4))``: with ``0.weight rowwise`` on tp=2 the weight is split
    and the bias replicated (added once after the sum): clipping's exact case."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 4)).eval(), (torch.randn(4, 8),), ["x"]


def classifier():
    """``nn.Sequential(Linear(8, 16), ReLU, Linear(16, 6))``: logits [4, 6] for cross_entropy."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 6)).eval(), (torch.randn(4, 8),), ["x"]


def mlp_batch8():
    """``Linear(8,16) -> ReLU -> Linear(16,8)`` on a batch of 8: splits over 4 ranks (2-D
    data parallel, ``input x [S(0), S(0)]`` on ``mesh dp=2 tp=2``)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).eval(), (torch.randn(8, 8),), ["x"]


def wide_batch_mlp():
    """``nn.Sequential(Linear(8, 16), GELU, Linear(16, 8))`` on 262144 tokens: on dp=2 x tp=2
    all-reducing each weight gradient over dp is cheaper than gathering activations (mixed
    precision's gradient reductions)."""
    torch.manual_seed(0)
    return (nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)).eval(), (torch.randn(262144, 8),),
            ["x"])
