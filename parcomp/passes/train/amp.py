"""fp16 dynamic loss scaling: ``train ... precision=fp16 [loss_scale=65536] [growth_interval=2000]``.

torch.amp.GradScaler's algorithm, written on the *global* graph by autodiff (so the
planner places its one collective and every rank agrees by construction):

- the backward seed is the loss scale ``s`` (``scaler.scale(loss).backward()``);
- every gradient (parameters and inputs) is multiplied by ``1/s`` once widened
  (``scaler.unscale_``), before clipping;
- ``found = sum over every gradient element of nonfinite(g)``: a tp shard's count is a partial
  sum, a replicated gradient's is counted on one rank, so one 4-byte all_reduce gives every
  rank the same number;
- when ``found > 0`` the step is skipped: every carried value (parameters, optimizer state)
  keeps its old value (``amp_select``), the scale halves and the growth counter restarts;
  otherwise the counter grows and after ``growth_interval`` clean steps the scale doubles.

The scale is carried as ``amp.scale_ratio`` = s / loss_scale - 1 (0 at step 1, like all
optimizer state: halving and doubling stay exact), with ``amp.growth_tracker`` and
``amp.skipped`` (skipped steps: AdamW's bias correction counts taken steps, as torch.optim's
``step`` does when the scaler skips ``optimizer.step()``).
"""
from __future__ import annotations

from parcomp.ir.types import TensorType, replicated

#: the carried loss-scaling state (scalars, zeros at step 1)
RATIO, TRACKER, SKIPPED = "amp.scale_ratio", "amp.growth_tracker", "amp.skipped"


def enabled(cfg) -> bool:
    return getattr(cfg.options, "precision", "fp32") == "fp16"


def _scalar(b, name, spec):
    """The carried scalar ``name`` (a 0-d float32 optimizer-state param), made once."""
    return name if name in b.types else b.source(name, "param", TensorType((), "float32"), replicated(len(spec.mesh.axes)), "optimizer")


def scaled_seed(b, seed: str, cfg, spec) -> str:
    """The backward seed times the loss scale (fp16), else ``seed``."""
    if not enabled(cfg):
        return seed
    s0 = cfg.options.loss_scale
    ratio = _scalar(b, RATIO, spec)
    b.amp = {"scale": b.op("add_scalar", [b.op("scale", [ratio], value=s0)], value=s0, name="amp.scale")}
    return b.op("mul", [seed, b.amp["scale"]], name="bw.loss_scaled")


def unscale(b, grads: dict, cfg) -> dict:
    """Every gradient times ``1/scale`` (fp16), and ``b.amp["found"]``: the count of
    non-finite gradient elements of the whole model."""
    if not enabled(cfg):
        return grads
    b.prefix, b.phase = "amp", "backward"
    one = b.op("ones", [], type=TensorType((), "float32"))
    inv = b.op("div", [one, b.amp["scale"]], name="amp.inv_scale")
    out, total = {}, None
    for k, g in grads.items():
        if not b.type(g).dtype.startswith("float"):
            out[k] = g
            continue
        g32 = g if b.type(g).dtype == "float32" else b.op("cast", [g], type=TensorType(b.type(g).shape, "float32"))
        out[k] = b.op("mul", [g32, inv], name=f"amp.{k}.unscaled")
        bad = b.op("nonfinite", [out[k]], name=f"amp.{k}.nonfinite")
        rank = b.type(bad).rank
        n = b.op("sum", [bad], dims=tuple(range(rank))) if rank else bad
        total = n if total is None else b.op("add", [total, n], name="amp.found_sum")
    b.amp["found"] = total
    return out


def adam_step(b, step: str, cfg, spec) -> str:
    """AdamW's step count: steps taken so far + 1 = ``step - skipped`` (fp16), else ``step``."""
    if not enabled(cfg):
        return step
    if "step" not in b.amp:
        b.amp["step"] = b.op("sub", [step, _scalar(b, SKIPPED, spec)], name="amp.adam_step")
    return b.amp["step"]


def skip_on_overflow(b, outs: list, cfg, spec, pin) -> list:
    """``outs`` with every carried value (an output named like a param) kept at its old value
    when the step found inf/NaN, plus the scaler's carried state (fp16)."""
    if not enabled(cfg):
        return outs
    found, nodes = b.amp["found"], {n.name: n for n in b.nodes}
    b.prefix, b.phase = "amp", "optimizer"
    out = []
    for public, v in outs:
        src = nodes.get(public)
        if src is not None and src.op == "param" and public in b.types:
            new = nodes[v].inputs[0]  # the value under its output pin
            v = pin(b, b.op("amp_select", [found, new, public], name=f"amp.{public}.kept"), src.layout,
                    f"{public} (kept on overflow)")
        out.append((public, v))
    r, t = _scalar(b, RATIO, spec), _scalar(b, TRACKER, spec)
    k = _scalar(b, SKIPPED, spec)
    interval = cfg.options.growth_interval
    lay = replicated(len(spec.mesh.axes))
    new_r = b.op("amp_ratio", [found, r, t], interval=interval, name="amp.scale_ratio_next")
    new_t = b.op("amp_tracker", [found, t], interval=interval, name="amp.growth_tracker_next")
    new_k = b.op("amp_select", [found, k, b.op("add_scalar", [k], value=1.0)], name="amp.skipped_next")
    return out + [(RATIO, pin(b, new_r, lay, "loss scale")), (TRACKER, pin(b, new_t, lay, "growth tracker")),
                  (SKIPPED, pin(b, new_k, lay, "skipped steps"))]
