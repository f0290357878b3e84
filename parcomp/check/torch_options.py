"""The torch side of the training options, for :func:`parcomp.check.training.torch_train`:
torch.nn.utils.clip_grad_norm_ and torch.optim.lr_scheduler themselves, never parcomp's formulas."""
from __future__ import annotations

import warnings


def make_scheduler(opt, cfg, first: int = 1):
    """The torch.optim.lr_scheduler of ``cfg``'s ``lr_schedule`` on ``opt``, stepped ``first - 1``
    times (step ``first`` of a run uses its lr), or None for ``constant``."""
    import torch.optim.lr_scheduler as L

    name, a = cfg.options.schedule[0], dict(cfg.options.schedule[1])
    if name == "constant":
        return None
    if name == "linear":
        sched = L.LinearLR(opt, a["start_factor"], a["end_factor"], a["total_iters"])
    elif not a["warmup"]:
        sched = L.CosineAnnealingLR(opt, a["T_max"], a["eta_min"])
    else:
        sched = L.SequentialLR(opt, [L.LinearLR(opt, a["start_factor"], 1.0, a["warmup"]),
                                     L.CosineAnnealingLR(opt, a["T_max"], a["eta_min"])],
                               milestones=[a["warmup"]])
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": on purpose
        warnings.simplefilter("ignore")
        for _ in range(first - 1):
            sched.step()
    return sched


def autocast(cfg):
    """``torch.autocast("cpu", dtype)`` for ``cfg``'s ``precision=bf16|fp16``, else a no-op context."""
    import contextlib

    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(getattr(cfg.options, "precision", "fp32"))
    return contextlib.nullcontext() if dtype is None else torch.autocast("cpu", dtype=dtype)


def make_scaler(cfg, start, opt, named):
    """torch.amp.GradScaler for ``precision=fp16`` (None otherwise), its scale and growth counter
    taken from ``start``'s ``amp.*`` values; AdamW's ``step`` then counts only the steps taken."""
    import torch

    if getattr(cfg.options, "precision", "fp32") != "fp16":
        return None
    s0 = cfg.options.loss_scale
    scaler = torch.amp.GradScaler("cpu", init_scale=s0, growth_interval=cfg.options.growth_interval)
    if start is not None and "amp.scale_ratio" in start:
        scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
        scaler._scale.fill_(s0 * (1 + float(start["amp.scale_ratio"])))
        scaler._growth_tracker.fill_(int(start["amp.growth_tracker"]))
        skipped = int(start["amp.skipped"])
        for _, p in named:
            if "step" in opt.state.get(p, {}):
                opt.state[p]["step"] -= skipped
    scaler.skipped = 0 if start is None else int(start.get("amp.skipped", 0))
    return scaler


def scaler_step(scaler, opt) -> None:
    """``scaler.step(opt); scaler.update()``, counting a skipped step (inf/NaN found)."""
    scaler.step(opt)
    found = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values()
    scaler.skipped += int(sum(float(v) for v in found) > 0)
    scaler.update()


def scaler_state(scaler, cfg) -> dict:
    """The scaler's carried values as parcomp names them (:mod:`parcomp.passes.train.amp`)."""
    import numpy as np

    if scaler is None:
        return {}
    return {"amp.scale_ratio": np.array(scaler.get_scale() / cfg.options.loss_scale - 1, "float32"),
            "amp.growth_tracker": np.array(float(scaler._get_growth_tracker()), "float32"),
            "amp.skipped": np.array(float(scaler.skipped), "float32")}


def clip(params, cfg) -> None:
    """torch.nn.utils.clip_grad_norm_ over ``params`` when ``cfg`` asks for clipping."""
    import torch

    if cfg.options.clip_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], cfg.options.clip_grad_norm)


def accumulate_backward(m, micro: list, input_names, cfg, output: int, scaler=None, whole_batch=False) -> float:
    """Forward and ``backward()`` of each microbatch of ``micro`` (K dicts {input, ``target`` or
    ``labels``: array}) on torch module ``m``, autograd summing the gradients: loss_k is the
    microbatch's loss *sum* over the global count (mse: every element of the K outputs,
    cross_entropy: the counted labels of all K, loss=output: its mean over K). Returns the
    loss of the global batch (the sum of the loss_k). Mixed precision: each forward under
    :func:`autocast`, the loss in float32, and with fp16's ``scaler`` each
    ``scaler.scale(loss_k).backward()`` (unscaled once by the caller). ``whole_batch``
    (loss=output, a token mean): one forward and backward of the K microbatches concatenated
    along dim 0, the full-batch step the accumulated one equals."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    if whole_batch:
        micro = [{n: np.concatenate([np.asarray(mb[n]) for mb in micro]) for n in micro[0]}]

    args = dict(cfg.loss_args)
    if cfg.loss == "mse":
        count = sum(mb["target"].size for mb in micro)
    elif cfg.loss == "cross_entropy":
        count = sum(int(np.sum(mb["labels"] != args.get("ignore_index", -100))) for mb in micro)
    else:
        count = len(micro)
    total = 0.0
    for mb in micro:
        with autocast(cfg):
            y = m(*[torch.from_numpy(np.asarray(mb[n])) for n in input_names])
        y = [o for o in torch.utils._pytree.tree_leaves(y) if o is not None][output].float()
        if cfg.loss == "mse":
            loss = F.mse_loss(y, torch.from_numpy(mb["target"]), reduction="sum") / count
        elif cfg.loss == "cross_entropy":
            loss = F.cross_entropy(y.reshape(-1, y.shape[-1]), torch.from_numpy(mb["labels"]).reshape(-1),
                                   reduction="sum", **args) / count
        else:
            loss = y / count
        (loss if scaler is None else scaler.scale(loss)).backward()
        total += float(loss.detach())
    return total
