"""Mixtral-style MoE blocks as ``.pcir`` text (the graph ``specs/models.py:moe_block``
exports to), their expert-parallel specs and feeds, for tests/moe/test_moe.py's properties."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MoeCase:
    experts: int
    top_k: int
    batch: int          # rows: routing groups, split over dp x ep
    seq: int
    hidden: int
    inter: int
    capacity: int       # slots per expert per row dropped past (0: none dropped)
    ep: int
    dp: int = 1
    skew: float = 0.0   # > 0: feature 0 a bias the router favours expert 0 by, the last against

    @property
    def slots(self):
        return self.capacity or self.seq


def model_text(c: MoeCase) -> str:
    """The MoE block: router, moe_route, dispatch, SwiGLU experts batched over E, combine."""
    b, s, h, f, e, cs = c.batch, c.seq, c.hidden, c.inter, c.experts, c.slots
    bc = b * cs
    return f"""\
%x: f32[{b},{s},{h}] = input()
%gate.weight: f32[{e},{h}] = param()
%experts.gate_proj: f32[{e},{f},{h}] = param()
%experts.up_proj: f32[{e},{f},{h}] = param()
%experts.down_proj: f32[{e},{h},{f}] = param()
%gate.wt: f32[{h},{e}] = permute(%gate.weight) {{perm=(1, 0)}}
%logits: f32[{b},{s},{e}] = matmul(%x, %gate.wt)
%c: f32[{b},{s},{e}] = moe_route(%logits) {{top_k={c.top_k}, capacity={c.capacity}}}
%d: f32[{b},{e},{cs},{h}] = moe_dispatch(%x, %c) {{capacity={cs}}}
%dp: f32[{e},{b},{cs},{h}] = permute(%d) {{perm=(1, 0, 2, 3)}}
%dr: f32[{e},{bc},{h}] = reshape(%dp)
%gt: f32[{e},{h},{f}] = permute(%experts.gate_proj) {{perm=(0, 2, 1)}}
%g: f32[{e},{bc},{f}] = matmul(%dr, %gt)
%ut: f32[{e},{h},{f}] = permute(%experts.up_proj) {{perm=(0, 2, 1)}}
%u: f32[{e},{bc},{f}] = matmul(%dr, %ut)
%sg: f32[{e},{bc},{f}] = silu(%g)
%a: f32[{e},{bc},{f}] = mul(%sg, %u)
%dt: f32[{e},{f},{h}] = permute(%experts.down_proj) {{perm=(0, 2, 1)}}
%y: f32[{e},{bc},{h}] = matmul(%a, %dt)
%yr: f32[{e},{b},{cs},{h}] = reshape(%y)
%yp: f32[{b},{e},{cs},{h}] = permute(%yr) {{perm=(1, 0, 2, 3)}}
%output: f32[{b},{s},{h}] = moe_combine(%yp, %c)
return %output
"""


def spec_text(c: MoeCase, train: bool = True) -> str:
    """Experts over ep; rows over dp x ep (dp outer); the all_to_all pinned both ways."""
    if c.dp > 1:  # the experts' tokens [E, B*C, H]: experts over ep, their rows still over dp
        mesh, rows, experts, tokens = f"mesh dp={c.dp} ep={c.ep}", "[S(0), S(0)]", "[R, S(0)]", "[S(1), S(0)]"
    else:
        mesh, rows, experts, tokens = f"mesh ep={c.ep}", "[S(0)]", "[S(0)]", "[S(0)]"
    lines = [mesh, f"experts.* {experts}", "gate.weight replicated", f"input x {rows}",
             f"output output {rows}", f"activation d {rows}", f"activation dr {tokens}",
             f"activation yp {rows}"]
    if train:
        lines.append("train loss=mse optimizer=sgd(lr=0.1)")
    return "\n".join(lines) + "\n"


def feeds(graph, c: MoeCase, seed: int) -> dict:
    """x N(0, 1), router N(0, 0.3^2), experts N(0, 1/in^2); with ``skew``, x[..., 0] >= 2 and
    the router's column 0 is ``+skew`` for expert 0, ``-4 skew`` for the last expert."""
    rng = np.random.default_rng(seed)
    out = {}
    for n in graph.nodes:
        if n.op not in ("input", "param"):
            continue
        shape = n.type.shape
        scale = 1.0 if n.name in ("x", "target") else 0.3 if n.name == "gate.weight" else 1.0 / shape[-1]
        out[n.name] = (rng.standard_normal(shape) * scale).astype(n.type.dtype)
    if c.skew:
        out["x"][..., 0] = np.abs(out["x"][..., 0]) + 2
        w = out["gate.weight"]
        w[:, 0] = 0
        w[0, 0], w[-1, 0] = c.skew, -4 * c.skew
    return out
