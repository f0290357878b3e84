"""Whole small transformer LMs as ``.pcir`` text, for the hypothesis property of
tests/check/test_transformer_props.py: token + (optional) vocab-parallel embedding, ``layers``
pre-norm blocks (LayerNorm or RMSNorm; attention with ``heads`` query heads and ``kv_heads``
key/value heads repeated as transformers' ``repeat_kv`` does, causal sdpa; a GELU MLP or
Llama's SiLU-gated one), a final norm, an LM head over a vocab padded to a multiple of tp
(``mask_pad``: padded logits never win and never count), and its spec.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Config:
    tp: int
    dp: int
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int          # real vocab; the tables hold ``padded`` rows
    norm: str           # layer_norm | rms_norm
    mlp: str            # gelu | swiglu
    tied: bool          # lm_head reads the embedding table
    vocab_parallel: bool
    sequence_parallel: bool
    train: bool

    @property
    def hidden(self):
        return self.heads * self.head_dim

    @property
    def padded(self):
        return -(-self.vocab // self.tp) * self.tp  # Megatron pads the vocab to a multiple of tp


def _linear(lines, cfg, name, x, din, dout):
    """``x[B,S,din] @ name.weight.T`` (a torch Linear stored ``[out, in]``)."""
    b, s = cfg.batch, cfg.seq
    lines.append(f"%{name}.weight: f32[{dout},{din}] = param()")
    lines.append(f"%{name}.wt: f32[{din},{dout}] = permute(%{name}.weight) {{perm=(1, 0)}}")
    lines.append(f"%{name}: f32[{b},{s},{dout}] = matmul(%{x}, %{name}.wt)")
    return name


def _norm(lines, cfg, name, x):
    b, s, h = cfg.batch, cfg.seq, cfg.hidden
    lines.append(f"%{name}.weight: f32[{h}] = param()")
    if cfg.norm == "layer_norm":
        lines.append(f"%{name}.bias: f32[{h}] = param()")
        lines.append(f"%{name}: f32[{b},{s},{h}] = layer_norm(%{x}, %{name}.weight, %{name}.bias) {{eps=1e-05}}")
    else:
        lines.append(f"%{name}: f32[{b},{s},{h}] = rms_norm(%{x}, %{name}.weight) {{eps=1e-06}}")
    return name


def _heads(lines, cfg, name, x, n):
    """``[B,S,n*D] -> [B,n,S,D]``, repeated to ``cfg.heads`` heads when ``n`` is fewer."""
    b, s, d = cfg.batch, cfg.seq, cfg.head_dim
    lines.append(f"%{name}.4d: f32[{b},{s},{n},{d}] = reshape(%{x})")
    lines.append(f"%{name}.t: f32[{b},{n},{s},{d}] = permute(%{name}.4d) {{perm=(0, 2, 1, 3)}}")
    if n == cfg.heads:
        return f"{name}.t"
    rep = cfg.heads // n
    lines.append(f"%{name}.e: f32[{b},{n},{rep},{s},{d}] = expand(%{name}.t) {{dims=(2,)}}")
    lines.append(f"%{name}.r: f32[{b},{cfg.heads},{s},{d}] = reshape(%{name}.e)")
    return f"{name}.r"


def _block(lines, cfg, i, x):
    b, s, h, d = cfg.batch, cfg.seq, cfg.hidden, cfg.head_dim
    p = f"h.{i}"
    n1 = _norm(lines, cfg, f"{p}.ln_1", x)
    kvd = cfg.kv_heads * d
    q = _heads(lines, cfg, f"{p}.q", _linear(lines, cfg, f"{p}.attn.q_proj", n1, h, h), cfg.heads)
    k = _heads(lines, cfg, f"{p}.k", _linear(lines, cfg, f"{p}.attn.k_proj", n1, h, kvd), cfg.kv_heads)
    v = _heads(lines, cfg, f"{p}.v", _linear(lines, cfg, f"{p}.attn.v_proj", n1, h, kvd), cfg.kv_heads)
    lines.append(f"%{p}.sdpa: f32[{b},{cfg.heads},{s},{d}] = sdpa(%{q}, %{k}, %{v}) "
                 f"{{causal=true, scale={1 / d ** 0.5}}}")
    lines.append(f"%{p}.sdpa.t: f32[{b},{s},{cfg.heads},{d}] = permute(%{p}.sdpa) {{perm=(0, 2, 1, 3)}}")
    lines.append(f"%{p}.att: f32[{b},{s},{h}] = reshape(%{p}.sdpa.t)")
    o = _linear(lines, cfg, f"{p}.attn.o_proj", f"{p}.att", h, h)
    lines.append(f"%{p}.r1: f32[{b},{s},{h}] = add(%{x}, %{o})")
    n2 = _norm(lines, cfg, f"{p}.ln_2", f"{p}.r1")
    f = 2 * h
    if cfg.mlp == "gelu":
        up = _linear(lines, cfg, f"{p}.mlp.up_proj", n2, h, f)
        lines.append(f"%{p}.act: f32[{b},{s},{f}] = gelu(%{up}) {{approximate=\"tanh\"}}")
    else:
        g = _linear(lines, cfg, f"{p}.mlp.gate_proj", n2, h, f)
        up = _linear(lines, cfg, f"{p}.mlp.up_proj", n2, h, f)
        lines.append(f"%{p}.silu: f32[{b},{s},{f}] = silu(%{g})")
        lines.append(f"%{p}.act: f32[{b},{s},{f}] = mul(%{p}.silu, %{up})")
    down = _linear(lines, cfg, f"{p}.mlp.down_proj", f"{p}.act", f, h)
    lines.append(f"%{p}.r2: f32[{b},{s},{h}] = add(%{p}.r1, %{down})")
    return f"{p}.r2"


def model_text(cfg: Config) -> str:
    """The LM as ``.pcir``: input ``ids`` int64[batch, seq], output ``logits`` [batch, seq, padded]."""
    b, s, h, vp = cfg.batch, cfg.seq, cfg.hidden, cfg.padded
    lines = [f"%ids: i64[{b},{s}] = input()", f"%wte.weight: f32[{vp},{h}] = param()",
             f"%x0: f32[{b},{s},{h}] = embedding(%ids, %wte.weight)"]
    x = "x0"
    for i in range(cfg.layers):
        x = _block(lines, cfg, i, x)
    nf = _norm(lines, cfg, "ln_f", x)
    head = "wte.weight" if cfg.tied else "lm_head.weight"
    if not cfg.tied:
        lines.append(f"%lm_head.weight: f32[{vp},{h}] = param()")
    lines.append(f"%lm_head.wt: f32[{h},{vp}] = permute(%{head}) {{perm=(1, 0)}}")
    lines.append(f"%z: f32[{b},{s},{vp}] = matmul(%{nf}, %lm_head.wt)")
    out = "z"
    if vp != cfg.vocab:
        lines.append(f"%zp: f32[{b},{s},{vp}] = mask_pad(%z) {{size={cfg.vocab}}}")
        out = "zp"
    lines.append(f"return %{out} as logits")
    return "\n".join(lines) + "\n"


def spec_text(cfg: Config) -> str:
    """Megatron's plan for the config: q/k/v, gate/up colwise, o/down rowwise over tp, the
    batch over dp, optionally the vocab split (embedding rows, LM head columns) and SP."""
    over = " over tp"
    lines = [f"mesh dp={cfg.dp} tp={cfg.tp}" if cfg.dp > 1 else f"mesh tp={cfg.tp}"]
    if cfg.sequence_parallel:
        lines.append("sequence-parallel")
    lines += [f"h.*.attn.{n}_proj.weight colwise{over}" for n in "qkv"]
    lines += [f"h.*.attn.o_proj.weight rowwise{over}", f"h.*.mlp.down_proj.weight rowwise{over}"]
    lines += [f"h.*.mlp.{n}_proj.weight colwise{over}" for n in (("gate", "up") if cfg.mlp == "swiglu" else ("up",))]
    if cfg.vocab_parallel:
        split = "[S(0)]" if cfg.dp == 1 else "[R, S(0)]"
        lines.append(f"wte.weight {split}")
        if not cfg.tied:
            lines.append(f"lm_head.weight {split}")
    if cfg.dp > 1:
        lines.append("input ids [S(0), R]")
    if cfg.train:
        lines.append("train loss=cross_entropy optimizer=sgd(lr=0.1) input_grads=no")
    return "\n".join(lines) + "\n"


def feeds(graph, cfg: Config, seed: int) -> dict:
    """Token ids and labels in the real vocab (labels 20% ignored: -100); embedding rows
    N(0, 1) (the residual stream's scale), projection weights N(0, (1/in)^2), norm weights
    around 1: activations of order 1 through a few layers."""
    rng = np.random.default_rng(seed)
    out = {}
    for n in graph.nodes:
        if n.op not in ("input", "param"):
            continue
        shape = n.type.shape
        if n.type.dtype == "int64":
            ids = rng.integers(0, cfg.vocab, shape)
            if n.name == "labels":
                ids[rng.random(shape) < 0.2] = -100
            out[n.name] = ids.astype("int64")
            continue
        if n.name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            x = 1 + 0.1 * rng.standard_normal(shape)
        elif n.name.startswith("wte") or n.name.startswith("lm_head") or len(shape) == 1:
            x = rng.standard_normal(shape) * (1.0 if n.name.startswith("wte") else 0.1)
        else:
            x = rng.standard_normal(shape) / shape[-1]
        out[n.name] = x.astype(n.type.dtype)
    return out
