"""What each gloo rank runs in tests/api (through gloo_ranks.run_ranks)."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

import parcomp

MLP_TP = """mesh tp=2
0.weight colwise
2.weight rowwise
input  input replicated
output output replicated
"""

MLP_DP_TP = """mesh dp=2 tp=2
0.weight colwise over tp
2.weight rowwise over tp
input  input [S(0), R]
output output [S(0), R]
"""

SPECS = {"tp": MLP_TP, "dp_tp": MLP_DP_TP}


def small_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))


def _batches(steps, batch=4, seq=3, width=16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, seq, width, generator=g), torch.randn(batch, seq, width, generator=g))
            for _ in range(steps)]


def _dp_coord(spec_text, rank):
    """(dp size, this rank's dp coordinate) for a spec whose mesh is ``dp=D tp=T`` or ``tp=T``."""
    mesh = dict(kv.split("=") for kv in spec_text.splitlines()[0].split()[1:])
    dp, tp = int(mesh.get("dp", 1)), int(mesh.get("tp", 1))
    return dp, rank // tp


def train_equal(rank, world, spec="tp", steps=3, cache_dir=None):
    """3 AdamW steps of the unsharded MLP and of parcomp.parallelize(MLP), from the same start:
    max abs differences of losses and of the final parameters."""
    text = SPECS[spec]
    model = small_mlp()
    ref = copy.deepcopy(model)
    batches = _batches(steps)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ref_losses = []
    for x, t in batches:
        loss = nn.functional.mse_loss(ref(x), t)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())

    par = parcomp.parallelize(model, (batches[0][0],), text, cache_dir=cache_dir)
    opt = torch.optim.AdamW(par.parameters(), lr=1e-2, weight_decay=0.1)
    dp, coord = _dp_coord(text, rank)
    losses = []
    for x, t in batches:
        xl, tl = x.chunk(dp)[coord], t.chunk(dp)[coord]
        loss = nn.functional.mse_loss(par(xl), tl)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    # every tp rank of a dp group holds the same loss: the mean over ranks is the mean over dp
    full = par.full_state_dict()
    param_err = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    return {"ref_losses": ref_losses, "losses": losses, "param_err": param_err,
            "loss_err": max(abs(a - b) for a, b in zip(ref_losses, losses)),
            "from_cache": par.from_cache, "fingerprint": par.fingerprint}
