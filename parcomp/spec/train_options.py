"""Training options of the ``train`` line: gradient clipping, LR schedules, accumulation.

``clip_grad_norm=C``
    torch.nn.utils.clip_grad_norm_(params, C) before the update: every gradient times
    ``min(1, C / (||g|| + 1e-6))``, ``||g||`` the 2-norm over every element of every trained
    parameter of the *unsharded* model. It is written on the global graph (squares, one sum
    per parameter, their total, ``clip_coef``), so sharding rules decide what each rank sums:
    a tp-split gradient's sum is a partial sum (all_reduced once), a replicated one is summed
    by every rank and counted once (its total is masked to one rank before the partial add),
    a ZeRO slice is a partial sum over dp. No element is counted twice by construction, and
    the interpreter checks it against torch.
``lr_schedule=constant | linear(...) | cosine(...)``
    torch.optim.lr_scheduler's LinearLR, CosineAnnealingLR, and LinearLR warmup followed
    by CosineAnnealingLR (SequentialLR), as closed forms of the step counter (the program's
    ``step`` input, k = 1, 2, ...; the scheduler has stepped k - 1 times before step k).
    The factor ``lr_k / lr`` is computed in the graph from ``step``, so every executor that
    feeds ``step`` (interpreter, program.py, a resumed run) gets the schedule.
``accumulate=K``
    see :mod:`parcomp.passes.train.accumulate`.
``recompute=selective``
    a forward value made by a one-operand pointwise op (activation functions, dropout,
    scale, ...) that backward reads is not kept: backward recomputes it from its operand
    right where a gradient rule first needs it (:func:`recompute_view`). Those values die
    after the forward pass, so the saved activations and the liveness peak of the report
    drop (``memory_bytes_per_rank``); matmul outputs and inputs stay saved.
``recompute=all``
    full recomputation (Megatron's ``--recompute-granularity full``, one checkpoint per
    layer): only the values a layer hands to another layer (its *checkpoints*: read by a
    node of another unit, see :func:`layer_checkpoints`) are kept; every other forward value
    backward reads, matmul outputs and attention included, is recomputed from them where the
    layer's backward first needs it, and dies after that layer's backward. Collectives inside
    the layer run again (the planner places them on the recomputed values).

Every value is checked when the spec is parsed (SpecError at the train line).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import SpecError


#: precision= value -> compute dtype (None: no casts; ``pure``: a bf16/fp16 model trained in its own
#: dtype throughout, parameters, gradients and optimizer state, chosen on purpose)
PRECISIONS = {"fp32": None, "bf16": "bfloat16", "fp16": "float16", "pure": None}

#: grad_reduce= values: reduce gradients in float32, or in the compute dtype
GRAD_REDUCE = ("fp32", "compute")


def precision_options(t) -> tuple:
    """``(precision, grad_reduce, loss_scale, growth_interval)`` of TrainSpec ``t`` (the last two:
    fp16's dynamic loss scaling, :mod:`parcomp.passes.train.amp`). Raises SpecError at the option's column."""
    from .option_loc import option_loc

    p, g = t.get("precision", "fp32"), t.get("grad_reduce", "fp32")
    if p not in PRECISIONS:
        raise SpecError(f"precision={p!r} is not supported; supported: {', '.join(PRECISIONS)}",
                        option_loc(t.loc, "precision"))
    if g not in GRAD_REDUCE:
        raise SpecError(f"grad_reduce={g!r}: say fp32 (reduce gradients in float32) or compute "
                        f"(in the compute dtype)", option_loc(t.loc, "grad_reduce"))
    if PRECISIONS[p] is None and t.get("grad_reduce") is not None:
        raise SpecError(f"grad_reduce= needs precision=bf16 or fp16 (with {p} every gradient is reduced in "
                        f"the parameter's own dtype)",
                        option_loc(t.loc, "grad_reduce"))

    return (p, g, *amp_options(t, p))


def amp_options(t, precision: str) -> tuple:
    """``(loss_scale, growth_interval)`` of TrainSpec ``t`` (torch's GradScaler defaults).
    Raises SpecError at the option's column: values out of range or given without fp16."""
    from .option_loc import option_loc

    given = [k for k in ("loss_scale", "growth_interval") if t.get(k) is not None]
    if given and precision != "fp16":
        raise SpecError(f"{given[0]}= is fp16's dynamic loss scaling; it needs precision=fp16",
                        option_loc(t.loc, given[0]))
    scale, interval = t.get("loss_scale", 65536.0), t.get("growth_interval", 2000)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 1 <= scale <= 2.0 ** 64:
        raise SpecError(f"loss_scale={scale!r} must be a number from 1 to 2**64",
                        option_loc(t.loc, "loss_scale"))
    if isinstance(interval, bool) or not isinstance(interval, int) or not 1 <= interval <= 1_000_000:
        raise SpecError(f"growth_interval={interval!r} must be a whole number from 1 to 1000000",
                        option_loc(t.loc, "growth_interval"))
    return float(scale), int(interval)


OPTION_KEYS = ("clip_grad_norm", "lr_schedule", "accumulate", "recompute", "precision", "grad_reduce",
               "loss_scale", "growth_interval")
#: ``recompute=``: none, selective (one-operand pointwise values recomputed in backward), or
#: all (every value inside a layer recomputed from the layer's input: full recomputation)
RECOMPUTE_MODES = ("none", "selective", "all")

#: schedule -> {argument: (kind, default (None: required), (low, high or None, high allowed))}
SCHEDULES = {
    "constant": {},
    "linear": {"start_factor": (float, 1 / 3, (0.0, 1.0, True)), "end_factor": (float, 1.0, (0.0, 1.0, True)),
               "total_iters": (int, 5, (1, 1_000_000, True))},
    "cosine": {"T_max": (int, None, (1, 1_000_000, True)), "eta_min": (float, 0.0, (0.0, None, False)),
               "warmup": (int, 0, (0, 1_000_000, True)), "start_factor": (float, 1 / 3, (0.0, 1.0, True))},
}
#: most microbatches one step may accumulate (each is a copy of forward and backward)
MAX_ACCUMULATE = 64
#: torch.nn.utils.clip_grad_norm_'s guard against a zero norm
CLIP_EPS = 1e-6


@dataclass(frozen=True)


class TrainOptions:
    """The issue-13 options of a train line.

    Attributes:
        clip_grad_norm: max 2-norm of all gradients together, or None (no clipping).
        schedule: ``(name, ((arg, value), ...))`` with every argument (defaults filled).
        accumulate: microbatches per step (1: none).
        recompute: ``none`` | ``selective`` | ``all``.
        precision: ``fp32`` | ``bf16`` | ``fp16`` | ``pure``; grad_reduce: ``fp32`` | ``compute``
            (mixed precision: :mod:`parcomp.passes.train.precision`).
    """

    clip_grad_norm: float | None = None
    schedule: tuple = ("constant", ())
    accumulate: int = 1
    recompute: str = "none"
    precision: str = "fp32"
    grad_reduce: str = "fp32"
    loss_scale: float = 65536.0  # fp16: the initial loss scale (torch.amp.GradScaler's init_scale)
    growth_interval: int = 2000  # fp16: clean steps before the scale doubles

    def schedule_args(self) -> dict:
        return dict(self.schedule[1])


def train_options(t, hyper: dict, number, check_range) -> TrainOptions:
    """Read the options of :data:`OPTION_KEYS` from TrainSpec ``t``; ``hyper``: the
    optimizer's checked hyperparameters; ``number``/``check_range``: train_config's checks.

    Raises SpecError at the option's column: a non-positive or non-finite ``clip_grad_norm``, an
    unknown schedule or argument, a value out of torch's range, ``eta_min`` above ``lr``,
    ``accumulate`` outside 1..:data:`MAX_ACCUMULATE`."""
    from .option_loc import option_loc  # each error at its option's column

    clip = t.get("clip_grad_norm")
    if clip is not None:
        clip = number(clip, "clip_grad_norm", option_loc(t.loc, "clip_grad_norm"), float)
        if not 0 < clip < 3.4e38:
            raise SpecError(f"clip_grad_norm={clip!r} must be positive and below 3.4e38 (legal: "
                            f"0 < x < 3.4e38); leave it out to train without clipping",
                            option_loc(t.loc, "clip_grad_norm"))
    acc = number(t.get("accumulate", 1), "accumulate", option_loc(t.loc, "accumulate"), int)
    if not 1 <= acc <= MAX_ACCUMULATE:
        raise SpecError(f"accumulate={acc} is out of range: 1 to {MAX_ACCUMULATE} microbatches per step",
                        option_loc(t.loc, "accumulate"))
    recompute = t.get("recompute", "none")
    if recompute not in RECOMPUTE_MODES:
        raise SpecError(f"recompute={recompute!r} is not supported; supported: {', '.join(RECOMPUTE_MODES)}",
                        option_loc(t.loc, "recompute"))

    return TrainOptions(clip, _schedule(t, hyper, number, check_range), acc, recompute,
                        *precision_options(t))


def _schedule(t, hyper, number, check_range) -> tuple:
    from .option_loc import option_loc  # each error at its option's (or argument's) column

    at = option_loc(t.loc, "lr_schedule")
    value = t.get("lr_schedule", "constant")
    name, args = (value, ()) if isinstance(value, str) else value
    if not isinstance(name, str) or name not in SCHEDULES:
        raise SpecError(f"lr_schedule {name!r} is not supported; supported: {', '.join(SCHEDULES)}", at)
    table, out = SCHEDULES[name], {}
    for k, v in args:
        if k not in table:
            raise SpecError(f"lr_schedule {name} has no argument {k!r}"
                            + (f"; it takes {', '.join(table)}" if table else "; it takes none"), option_loc(at, k))
        kind, _, bounds = table[k]
        out[k] = number(v, f"{name}({k}=...)", option_loc(at, k), kind)
        check_range(f"{name}({k}={v})", out[k], bounds, option_loc(at, k))
    for k, (kind, default, _) in table.items():
        if k not in out and default is None:
            raise SpecError(f"lr_schedule {name} needs {k}= (e.g. {name}({k}=100))", at)
        out.setdefault(k, default)
    for k in ("start_factor",):
        if k in out and out[k] == 0:
            raise SpecError(f"{name}({k}=0): torch's LinearLR needs 0 < start_factor <= 1", option_loc(at, k))
    if name == "cosine" and out["eta_min"] > hyper["lr"]:
        raise SpecError(f"cosine(eta_min={out['eta_min']:g}) is above the optimizer's lr={hyper['lr']:g}: "
                        f"the schedule decays from lr down to eta_min", option_loc(at, "eta_min"))
    return name, tuple(sorted(out.items()))


def lr_at(schedule: tuple, lr: float, k: int) -> float:
    """The learning rate of step ``k`` (1-based) in float64, as torch.optim.lr_scheduler
    gives it after k - 1 ``scheduler.step()`` calls (closed forms)."""
    name, a = schedule[0], dict(schedule[1])
    i = k - 1
    if name == "constant":
        return lr
    if name == "linear":
        s, e, n = a["start_factor"], a["end_factor"], a["total_iters"]
        return lr * (s + (e - s) * min(i, n) / n)
    w = a["warmup"]
    if i < w:
        return lr * (a["start_factor"] + (1 - a["start_factor"]) * i / w)
    j = i - w
    return a["eta_min"] + (lr - a["eta_min"]) * (1 + math.cos(math.pi * j / a["T_max"])) / 2


# ---- lowering on the global graph (called by parcomp/passes/autodiff.py) ----


def clip_gradients(b, grads: dict, max_norm: float) -> dict:
    """``{param: gradient * clip_coef}``: torch.nn.utils.clip_grad_norm_ on the unsharded
    gradients (global graph; sharding decides the partial sums and their one all_reduce)."""
    b.prefix, b.phase = "opt.clip", "optimizer"
    total = None
    for p, g in grads.items():
        sq = b.op("mul", [g, g], name=f"opt.{p}.grad_sq")
        rank = b.type(g).rank
        s = b.op("sum", [sq], dims=tuple(range(rank)), name=f"opt.{p}.grad_sq_sum") if rank else sq
        total = s if total is None else b.op("add", [total, s], name="opt.clip.norm_sq")
    coef = b.op("clip_coef", [total], max_norm=max_norm, name="opt.clip.coef")
    return {p: b.op("mul", [g, coef], name=f"opt.{p}.clipped_grad") for p, g in grads.items()}


def lr_factor(b, schedule: tuple, lr: float, step) -> str | None:
    """The node holding ``lr_k / lr`` computed from the step counter (``step()`` returns the
    0-d float32 input k = 1, 2, ...), or None for a constant schedule (or lr = 0: every
    lr_k is 0 then)."""
    name, a = schedule[0], dict(schedule[1])
    if name == "constant" or lr == 0:
        return None
    b.prefix, b.phase = "opt.lr", "optimizer"
    i = b.op("add_scalar", [step()], value=-1.0, name="opt.lr.epoch")  # scheduler steps taken
    if name == "linear":
        s, e, n = a["start_factor"], a["end_factor"], a["total_iters"]
        return _ramp(b, i, n, s, e - s)
    w, tmax = a["warmup"], a["T_max"]
    j = b.op("relu", [b.op("add_scalar", [i], value=-float(w))], name="opt.lr.cos_epoch") if w else i
    c = b.op("cos", [b.op("scale", [j], value=math.pi / tmax)])
    e = a["eta_min"] / lr
    f = b.op("add_scalar", [b.op("scale", [c], value=(1 - e) / 2)], value=e + (1 - e) / 2,
             name="opt.lr.cosine")
    if not w:
        return f
    return b.op("mul", [_ramp(b, i, w, a["start_factor"], 1 - a["start_factor"]), f], name="opt.lr.factor")


def _ramp(b, i, n, start, rise):
    """``start + rise * min(i, n) / n`` (LinearLR's factor), min written with relu:
    ``n - relu(n - i)`` (exact for whole numbers below 2**24)."""
    over = b.op("relu", [b.op("add_scalar", [b.op("neg", [i])], value=float(n))])
    m = b.op("add_scalar", [b.op("neg", [over])], value=float(n), name="opt.lr.ramp_epoch")
    return b.op("add_scalar", [b.op("scale", [m], value=rise / n)], value=start, name="opt.lr.ramp")


def scheduled_sgd_step(b, step: str, f: str | None) -> str:
    """SGD's step direction times the schedule's factor (``lr_k = lr f``), or unchanged."""
    return step if f is None else b.op("mul", [step, f])


def scheduled_update(b, p: str, new: str, f: str | None) -> str:
    """``p - f (p - new)``: an update ``new`` made with the base lr, rescaled to ``lr_k = lr f``
    (AdamW: decay and step are both proportional to lr)."""
    if f is None:
        return new
    return b.op("sub", [p, b.op("mul", [b.op("sub", [p, new]), f])])


# ---- recompute=selective ----


def _recomputable():
    from ..ir.ops import OPS, same_type

    return frozenset(op for op, d in OPS.items() if d.kind in ("nonlinear", "linear")
                     and (d.arity == 1 or op == "dropout")  # dropout's step operand is a source
                     and d.infer is same_type and op not in ("clip_coef",))


RECOMPUTE_OPS = _recomputable()


def start_recompute(b, graph, opts) -> None:
    """Arm Builder ``b`` for ``recompute=selective``: producers of its values (refreshed from
    ``b.nodes`` when a name is new) and a cache of recomputed values (None for ``none``)."""
    if opts.recompute == "none":
        b.recompute = None
        return
    keep = layer_checkpoints(graph) if opts.recompute == "all" else None
    b.recompute = {"producers": {}, "done": {}, "keep": keep}


def _unit(path: str) -> str:
    """A module path's layer: up to its first numbered component (``h.3.attn`` -> ``h.3``,
    ``12`` -> ``12``), else its first component (``ln_f``, ``l0``)."""
    parts = path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return parts[0]


def layer_checkpoints(graph) -> frozenset:
    """The forward values ``recompute=all`` keeps: those read by a node of another layer (the
    unit of its module path ``Node.source``; a ``.pcir`` node without one takes its param
    operand's, else its latest input's) or by the loss, plus every source and output."""
    unit, keep = {}, {n.name for n in graph.nodes if n.op in ("input", "param")} | set(graph.outputs)
    for n in graph.nodes:
        if n.op in ("input", "param"):
            unit[n.name] = _unit(n.name) if n.op == "param" else None
            continue
        params = [unit[i] for i in n.inputs if graph[i].op == "param"]
        known = [unit[i] for i in n.inputs if unit.get(i) is not None]
        unit[n.name] = _unit(n.source) if n.source else (params or known or [None])[-1]
        for i in n.inputs:
            if graph[i].op != "param" and unit.get(i) != unit[n.name]:
                keep.add(i)
    return frozenset(keep)


def recompute_view(b, n):
    """``n`` as its gradient rule should read it: its operands and its own value replaced by
    backward-phase recomputations where they are recomputable forward values (emitted into
    ``b`` now, once each, operands first)."""
    state = getattr(b, "recompute", None)
    if state is None:
        return n
    from dataclasses import replace

    def rc(v):
        if v not in state["producers"]:
            state["producers"] = {m.name: m for m in b.nodes}
        node = state["producers"].get(v)
        if node is None or node.phase != "forward" or (
                node.op not in RECOMPUTE_OPS if state["keep"] is None else v in state["keep"]):
            return v
        if v not in state["done"]:
            ins = tuple(rc(i) for i in node.inputs)
            name = b.names.fresh(f"rc.{v}")
            b.nodes.append(replace(node, name=name, inputs=ins, phase="backward"))
            b.types[name], b.phases[name] = node.type, "backward"
            state["done"][v] = name
        return state["done"][v]

    return replace(n, name=rc(n.name), inputs=tuple(rc(i) for i in n.inputs))
