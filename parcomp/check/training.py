"""Ground truth for training: the unsharded step run K times (numpy), and torch.optim.

``numpy_train`` runs the compiler's own unsharded training graph; ``torch_train``
trains the original torch module with ``torch.optim`` and autograd, an
independent reference that shares no code with parcomp.
"""
from __future__ import annotations

import copy

import numpy as np

from ..reference.numpy_ops import run_unsharded
from .torch_options import accumulate_backward, autocast, clip, make_scaler, make_scheduler, scaler_state, scaler_step


def initial_state(graph, feeds: dict) -> dict:
    """Feeds plus zero optimizer state (torch.optim starts from zero buffers)."""
    out = dict(feeds)
    for n in graph.params:
        if n.name not in out:
            out[n.name] = np.zeros(n.type.shape, n.type.dtype)
    return out


def _loss_input(graph, name) -> bool:
    """Whether ``name`` is an input the training loss added (phase ``loss``), not a model's own
    input of that name (a model computing its own loss takes ``labels``: loss part)."""
    return name in graph and graph[name].phase == "loss"


def data_for(graph, seed=0) -> dict:
    """Seeded training data for the loss inputs: ``target`` (mse) or ``labels`` (cross-entropy)."""
    rng = np.random.default_rng(seed + 1000)
    out = {}
    if _loss_input(graph, "target"):
        t = graph["target"].type
        out["target"] = rng.standard_normal(t.shape).astype(t.dtype)
    if _loss_input(graph, "labels"):
        # the classes of the logits the labels index (cross_entropy or its decomposition's
        # pick); a padded vocab (mask_pad) draws only real classes
        labels = {"labels"}  # and its microbatches (accumulate=K: reshape/slice of it)
        labels.update(n.name for n in graph.nodes if n.op in ("reshape", "slice") and n.inputs[0] in labels)
        classes = next(graph[n.inputs[0]].type.shape[-1] for n in graph.nodes
                       if n.op in ("cross_entropy", "pick") and n.inputs[1] in labels)
        classes = min([classes] + [n.attr("size") for n in graph.nodes if n.op == "mask_pad"])
        out["labels"] = rng.integers(0, classes, graph["labels"].type.shape).astype("int64")
    return out


def train_steps(run_step, graph, feeds: dict, steps: int, record: bool = False) -> dict:
    """Run ``run_step(state) -> outputs`` ``steps`` times, as program.py's loop does.

    Each step's outputs whose public name is a ``param`` of ``graph`` (updated
    parameters, optimizer state) replace it for the next step; every other
    source (buffers, frozen params, inputs) keeps its value.  ``step`` (AdamW's
    counter) is 1, 2, ... when the graph has it.

    Returns ``{"losses": [float per step], "outputs": outputs of the last step,
    "state": {param name: value after the last step}}`` (state: every ``param``
    of ``graph``, buffers and optimizer state included). With ``record``, also
    ``"starts"``: the state each step started from (``step`` included) and
    ``"per_step"``: each step's outputs, for a step-by-step (lockstep) check.
    """
    state, losses, out = initial_state(graph, feeds), [], {}
    params = [n.name for n in graph.params]
    carried = set(params)
    starts, per_step = [], []
    for k in range(1, steps + 1):
        if "step" in graph:
            state["step"] = np.array(float(k), graph["step"].type.dtype)  # float64 check: float64
        if record:
            starts.append(dict(state))  # the step returns new arrays: a shallow copy suffices
        out = run_step(state)
        if record:
            per_step.append(out)
        losses.append(float(out["loss"]))
        state.update({k2: v for k2, v in out.items() if k2 in carried})
    result = {"losses": losses, "outputs": out, "state": {p: state[p] for p in params}}
    return {**result, "starts": starts, "per_step": per_step} if record else result


def numpy_train(graph, feeds: dict, steps: int) -> dict:
    """The unsharded step of ``graph`` run ``steps`` times (see :func:`train_steps`)."""
    return train_steps(lambda state: run_unsharded(graph, state), graph, feeds, steps)


def torch_train(module, example, input_names, data: dict, cfg, steps: int, output: int = 0,
                start: dict | None = None, first: int = 1, micro: list | None = None,
                whole_batch: bool = False) -> dict:
    """Train a copy of ``module`` with torch.optim for ``steps`` steps on the same batch.

    The parameters ``cfg.trainable`` matches that have ``requires_grad`` are
    trained; the loss is on the model's output number ``output`` (when it returns
    a tuple). ``start``: carried values to begin from (``{state_dict name: array}`` and
    optimizer state ``"<param>.exp_avg"`` etc., as :func:`train_steps` records them), the
    first step being number ``first`` (AdamW's bias correction counts from it). ``micro``:
    with ``accumulate=K``, the K microbatches (dicts of inputs and ``target``/``labels``) each
    step trains on instead of ``example`` (see :func:`.torch_options.accumulate_backward`);
    ``whole_batch``: they are trained as one batch, one forward and backward of the K
    microbatches concatenated (the model's own loss is a token mean, which the accumulated
    step takes over the global batch: :func:`parcomp.passes.train.accumulate.token_mean`).

    Returns ``{"losses": [...], "params": {name: array after the last update},
    "sources": {state_dict and buffer name: array after the last step},
    "grads": {name: array of the last step}, "state": {"<param>.<optimizer state>":
    array}, "input_grads": {name: array}}`` (a parameter or input the loss does not
    reach has no gradient and, as in torch.optim, is not updated).
    """
    import torch
    import torch.nn.functional as F

    from ..spec.model import pattern_regex

    torch.manual_seed(0)
    m = copy.deepcopy(module).eval()
    rx = pattern_regex(cfg.trainable)
    named = [(k, p) for k, p in m.named_parameters() if rx.fullmatch(k) and p.requires_grad]
    for k, p in m.named_parameters():
        p.requires_grad_(any(p is q for _, q in named))
    h = dict(cfg.hyper)
    if cfg.optimizer == "sgd":
        opt = torch.optim.SGD([p for _, p in named], lr=h["lr"], momentum=h["momentum"],
                              weight_decay=h["weight_decay"])
    else:
        opt = torch.optim.AdamW([p for _, p in named], lr=h["lr"], betas=(h["beta1"], h["beta2"]),
                                eps=h["eps"], weight_decay=h["weight_decay"])
    if start is not None:
        _load_start(m, opt, named, start, first, cfg.optimizer)
    sched = make_scheduler(opt, cfg, first)  # training options
    scaler = make_scaler(cfg, start, opt, named)  # fp16: torch.amp.GradScaler
    names = _aliases(m)  # a tied weight (lm_head.weight is wte.weight) under export's name for it
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in example]
    losses, grads = [], {}
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        for x in xs:
            x.grad = None
        if micro is not None:  # accumulate=K, one backward() per microbatch
            loss = torch.tensor(accumulate_backward(m, micro, input_names, cfg, output, scaler, whole_batch))
        else:
            with autocast(cfg):  # precision=bf16|fp16 is torch.autocast's, the loss in float32
                y = m(*xs)
            y = [o for o in torch.utils._pytree.tree_leaves(y) if o is not None][output].float()  # export's order
            if cfg.loss == "mse":
                loss = F.mse_loss(y, torch.from_numpy(data["target"]))
            elif cfg.loss == "cross_entropy":
                loss = F.cross_entropy(y.reshape(-1, y.shape[-1]),
                                       torch.from_numpy(data["labels"]).reshape(-1), **dict(cfg.loss_args))
            else:
                loss = y
            (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is not None:  # parcomp's x.grad is unscaled too (GradScaler leaves inputs scaled)
            scaler.unscale_(opt)
            for x in xs:
                if x.grad is not None:
                    x.grad /= scaler.get_scale()
        clip([p for _, p in named], cfg)  # p.grad is the clipped gradient, as torch has it
        losses.append(float(loss.detach()))
        grads = {names[id(p)]: p.grad.detach().numpy().copy() for _, p in named if p.grad is not None}
        opt.step() if scaler is None else scaler_step(scaler, opt)
        if sched is not None:
            sched.step()
    state = {f"{names[id(p)]}.{s}": v.detach().numpy().copy() for _, p in named
             for s, v in opt.state[p].items() if s != "step" and isinstance(v, torch.Tensor)}
    state.update(scaler_state(scaler, cfg))
    from ..frontends.torch.fold import folded_constants

    sources = {**dict(m.named_buffers()), **m.state_dict(), **folded_constants(module)}  # constants too
    return {"losses": losses, "params": {names[id(p)]: p.detach().numpy().copy() for _, p in named},
            "sources": {k: v.detach().numpy().copy() for k, v in sources.items()},
            "grads": grads, "state": state,
            "input_grads": {f"{n}.grad": x.grad.numpy().copy() for n, x in zip(input_names, xs)
                            if x.grad is not None}}


_OPTIMIZER_STATE = {"sgd": ("momentum_buffer",), "adamw": ("exp_avg", "exp_avg_sq")}


def _aliases(m) -> dict:
    """``{id(parameter): the name torch.export gives it}``: a tied weight has several names
    (GPT-2's ``transformer.wte.weight`` is ``lm_head.weight``); named_parameters() keeps the
    first, torch.export (and so the compiled graph) the last (norms part)."""
    return {id(p): k for k, p in m.named_parameters(remove_duplicate=False)}


def _load_start(m, opt, named, start: dict, first: int, optimizer: str) -> None:
    """Set ``m``'s parameters and buffers and ``opt``'s state from ``start`` (see
    :func:`torch_train`): torch.optim keeps ``step`` = steps taken, so ``first - 1``."""
    import torch

    with torch.no_grad():
        for k, t in [*m.named_parameters(remove_duplicate=False), *m.named_buffers()]:
            if k in start:
                t.copy_(torch.from_numpy(np.asarray(start[k])))
    names = _aliases(m)
    for _, p in named:
        k = names[id(p)]
        st = {s: torch.from_numpy(np.array(start[f"{k}.{s}"])) for s in _OPTIMIZER_STATE[optimizer]
              if f"{k}.{s}" in start}
        if optimizer == "adamw":
            st["step"] = torch.tensor(float(first - 1))
        if st:
            opt.state[p] = st
