"""The ``train`` line of a spec, checked: loss, optimizer and its hyperparameters.

Defaults follow torch.optim: SGD(momentum=0, weight_decay=0), AdamW(lr=1e-3,
betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01).  Every number is checked
against its legal range (:data:`HYPER_RANGES`, torch.optim's) and the step and
batch counts against :data:`MAX_STEPS` / :data:`MAX_BATCH` when the spec is
parsed, so a bad value is an error at the train line, never torch.optim's
ValueError or an out-of-memory after compiling.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ParcompError, SpecError, closest
from ..errors import SpecError
from .model import pattern_regex
from .option_loc import option_loc
from .train_options import OPTION_KEYS, train_options


#: the train option and its default: DDP's ``bucket_cap_mb`` (MiB of gradients a bucket holds)
BUCKET_KEY = "bucket_cap_mb"

DEFAULT_CAP_MB = 25.0

MAX_CAP_MB = 1 << 20  # 1 TiB: any larger cap is "one bucket"


def bucket_cap_bytes(spec, loc=None) -> int:
    """Bytes one gradient bucket may hold, from ``train ... bucket_cap_mb=X`` (MiB, DDP's
    ``bucket_cap_mb``; default 25; 0 turns bucketing off). Raises SpecError at the train
    line (or ``loc``, the option's column) for a value that is not a number in 0 .. 1048576."""
    t = getattr(spec, "train", None)
    value = DEFAULT_CAP_MB if t is None else t.get(BUCKET_KEY, DEFAULT_CAP_MB)
    loc = loc or getattr(t, "loc", None)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 <= value <= MAX_CAP_MB:
        raise SpecError(f"{BUCKET_KEY}={value!r} must be a number of MiB from 0 (one all_reduce per "
                        f"gradient) to {MAX_CAP_MB}; DDP's default is {DEFAULT_CAP_MB:g}", loc)
    return int(value * (1 << 20))


LOSSES = ("mse", "cross_entropy", "output")
#: pipeline schedules (docs/design/pipeline.md, "Pipeline parallelism"); interleaved takes ``virtual=K``
SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved")
#: most model chunks per rank ``virtual=K`` may ask for (interleaved 1F1B)
MAX_VIRTUAL = 64
OPTIMIZERS = {
    "sgd": {"lr": 0.01, "momentum": 0.0, "weight_decay": 0.0},
    "adamw": {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01},
}
#: hyperparameter -> (low, high or None, whether high itself is allowed): torch.optim's ranges
HYPER_RANGES = {
    "lr": (0.0, None, False), "momentum": (0.0, None, False), "weight_decay": (0.0, None, False),
    "eps": (0.0, None, False), "beta1": (0.0, 1.0, False), "beta2": (0.0, 1.0, False),
}
#: most steps one ``train steps=K`` / ``--steps K`` may ask for (the program keeps every loss)
MAX_STEPS = 1_000_000
#: largest global batch (dim 0 of the inputs) a ``train batch=N`` may name
MAX_BATCH = 1 << 24


@dataclass(frozen=True)


class TrainConfig:
    """What one training step does.

    Attributes:
        loss: ``mse`` | ``cross_entropy`` | ``output`` (the model returns its loss);
            ``loss_args``: cross_entropy's ``ignore_index`` / ``label_smoothing``.
        optimizer: ``sgd`` | ``adamw``; ``hyper``: its hyperparameters (sorted pairs).
        batch: global batch (dim 0 of every input), or None to take the model's.
        steps: steps ``parcomp run`` trains; ``zero``: 0, or 1/2 for a sharded
            optimizer state over the ``dp`` axis (ZeRO-1/2: reduce_scatter of
            gradients, local update, all_gather of parameters).
        trainable: name pattern of the trained parameters.
        input_grads: whether float model inputs get gradients (``x.grad``): yes for a
            layer inside a larger model (Megatron's dx all_reduce), no for data inputs.
        input_grad_names: the name pattern of the float inputs that get one (``input_grads=x``:
            only ``x.grad``, as torch computes the gradients of the inputs that require grad;
            ``**`` for ``yes``); :meth:`wants_input_grad` reads it.
        output: public name of the model output the loss is computed on, or None
            (the model's only output; several outputs need it).
    """

    loss: str
    optimizer: str
    hyper: tuple
    batch: int | None
    steps: int
    zero: int
    trainable: str
    loc: object
    input_grads: bool = True
    output: str | None = None
    loss_args: tuple = ()  # cross_entropy's ignore_index / label_smoothing (torch's defaults)
    options: object = None  # training options: parcomp/spec/train_options.py
    microbatches: int = 1
    schedule: str = "1f1b"
    stages: str | None = None
    virtual: int = 1  # interleaved 1F1B: model chunks per rank (virtual stages pp x virtual)
    input_grad_names: str = "**"

    def h(self, key):
        return dict(self.hyper)[key]

    def wants_input_grad(self, name: str) -> bool:
        """Whether the step returns ``<name>.grad`` for float input ``name``."""
        return self.input_grads and bool(pattern_regex(self.input_grad_names).fullmatch(name))


def train_config(spec) -> TrainConfig:
    """Read and check ``spec.train``. Raises SpecError at the train line."""
    t = spec.train
    known = {"loss", "optimizer", "batch", "steps", "zero", "trainable", "input_grads", "output",
             "microbatches", "schedule", "stages", "virtual", BUCKET_KEY, *OPTION_KEYS}
    for k, _ in t.options:
        if k not in known:
            hint = closest(k, known)
            raise SpecError(f"unknown train option {k!r}" + (f"; did you mean {hint!r}?" if hint else
                            f"; known: {', '.join(sorted(known))}"), option_loc(t.loc, k))
    loss, loss_args = _loss(t.get("loss", "mse"), option_loc(t.loc, "loss"))
    opt = t.get("optimizer", "sgd")
    name, args = (opt, ()) if isinstance(opt, str) else opt
    if name not in OPTIMIZERS:
        raise SpecError(f"optimizer {name!r} is not supported by the backends; supported: "
                        f"{', '.join(OPTIMIZERS)}", option_loc(t.loc, "optimizer"))
    hyper = dict(OPTIMIZERS[name])
    for k, v in args:
        if k not in hyper:
            raise SpecError(f"{name} has no hyperparameter {k!r}; it takes {', '.join(hyper)}",
                            option_loc(t.loc, k))
        at = option_loc(t.loc, k)
        hyper[k] = _number(v, f"{name}({k}=...)", at, float)
        _check_range(f"{name}({k}={v})", hyper[k], HYPER_RANGES[k], at)
        _check_float32(f"{name}({k}={v})", hyper[k], HYPER_RANGES[k], at)
    zero = _number(t.get("zero", 0), "zero", option_loc(t.loc, "zero"), int)
    if zero not in (0, 1, 2):
        raise SpecError(f"zero={zero}: only 0, 1 and 2 exist", option_loc(t.loc, "zero"))
    if zero and "dp" not in spec.mesh.names:
        raise SpecError("zero=1/2 shards optimizer state over a 'dp' mesh axis, and the mesh has none",
                        option_loc(t.loc, "zero"))
    batch = t.get("batch")
    batch = None if batch is None else _count(batch, "batch", MAX_BATCH, option_loc(t.loc, "batch"))
    steps = _count(t.get("steps", 1), "steps", MAX_STEPS, option_loc(t.loc, "steps"))
    input_grads = t.get("input_grads", "yes")
    if not isinstance(input_grads, str) or not input_grads:
        raise SpecError(f"input_grads={input_grads!r}: say yes, no, or a pattern of input names "
                        f'(input_grads=x, input_grads="h*")', option_loc(t.loc, "input_grads"))
    grad_names = "**" if input_grads in ("yes", "no") else input_grads
    output = t.get("output")
    if output is not None and not isinstance(output, str):
        raise SpecError(f"output={output!r}: name a model output (quote a name with dots: "
                        f'output="a.b")', option_loc(t.loc, "output"))
    options = train_options(t, hyper, _number, _check_range)
    bucket_cap_bytes(spec, option_loc(t.loc, BUCKET_KEY))  # checked here, read by the bucket-dp-grads lowering
    return TrainConfig(loss, name, tuple(sorted(hyper.items())), batch, steps, zero,
                       str(t.get("trainable", "**")), t.loc, input_grads != "no", output, loss_args,
                       options, *_pipeline_options(spec, t), input_grad_names=grad_names)


# reductions part: loss=cross_entropy(ignore_index=-100, label_smoothing=0.0), torch's
CE_OPTIONS = {"ignore_index": (int, (-(1 << 62), 1 << 62, True)), "label_smoothing": (float, (0, 1, True))}


def _loss(value, loc) -> tuple:
    """``(loss name, sorted (option, value) pairs)``; options only for cross_entropy."""
    name, args = value if isinstance(value, tuple) and len(value) == 2 else (value, ())
    if not isinstance(name, str) or name not in LOSSES:
        raise SpecError(f"loss {name!r} is not supported; supported: {', '.join(LOSSES)}", loc)
    out = {}
    for k, v in args:
        if name != "cross_entropy" or k not in CE_OPTIONS:
            raise SpecError(f"loss {name} has no option {k!r}" + (
                f"; it takes {', '.join(CE_OPTIONS)}" if name == "cross_entropy" else
                "; the model computes this loss itself, with its own options (set them in the model, "
                "or take loss=cross_entropy(...) on its logits)" if name == "output" and k in CE_OPTIONS
                else ""), loc)
        kind, bounds = CE_OPTIONS[k]
        out[k] = _number(v, f"{name}({k}=...)", loc, kind)
        _check_range(f"{name}({k}={v})", out[k], bounds, loc)
    return name, tuple(sorted(out.items()))


def _pipeline_options(spec, t) -> tuple:
    """``(microbatches, schedule, stages)`` of the train line; they need a ``pp`` mesh axis."""
    micro = _count(t.get("microbatches", 1), "microbatches", MAX_BATCH, option_loc(t.loc, "microbatches"))
    schedule, stages = t.get("schedule", "1f1b"), t.get("stages")
    if schedule not in SCHEDULES:
        hint = closest(str(schedule), SCHEDULES)
        raise SpecError(f"schedule={schedule!r} is not a pipeline schedule parcomp has"
                        + (f"; did you mean {hint!r}?" if hint else "")
                        + f" (schedules: {', '.join(SCHEDULES)})", option_loc(t.loc, "schedule"))
    if stages not in (None, "balanced"):
        raise SpecError(f"stages={stages!r}: the only value is balanced (or give 'stage K: ...' "
                        f"statements)", option_loc(t.loc, "stages"))
    given = [k for k in ("microbatches", "schedule", "stages", "virtual") if t.get(k) is not None]
    if given and "pp" not in spec.mesh.names:
        raise SpecError(f"{given[0]}= is a pipeline option and mesh {spec.mesh} has no 'pp' axis "
                        f"(e.g. 'mesh pp=2')", option_loc(t.loc, given[0]))
    return micro, schedule, stages, _virtual(spec, t, schedule, micro)


def _virtual(spec, t, schedule, micro) -> int:
    """``virtual=K`` of interleaved 1F1B (default 2): model chunks per rank; 1 for the others.

    Raises:
        SpecError: at ``virtual=``: out of 1..:data:`MAX_VIRTUAL`, given with another schedule;
            at ``microbatches=``: interleaved needs a multiple of pp (as Megatron)."""
    loc = option_loc(t.loc, "virtual")
    if schedule != "interleaved":
        if t.get("virtual") is not None:
            raise SpecError(f"virtual= is the chunk count of schedule=interleaved, not of "
                            f"schedule={schedule}", loc)
        return 1
    k = _count(t.get("virtual", 2), "virtual", MAX_VIRTUAL, loc)  # stage statements: spec/stages.py
    pp = spec.mesh.sizes[spec.mesh.axis_index("pp")] if "pp" in spec.mesh.names else 1
    if micro % pp:
        raise SpecError(f"schedule=interleaved needs microbatches ({micro}) to be a multiple of "
                        f"pp ({pp})", option_loc(t.loc, "microbatches"))
    return k


def check_steps(steps, what: str = "--steps") -> int:
    """``steps`` if it is a whole number in 1..:data:`MAX_STEPS`.

    Raises ParcompError naming the option ``what`` otherwise.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise ParcompError(f"{what} {steps}: give 1 to {MAX_STEPS:,} training steps", where=what)
    return steps


def _count(value, what, most, loc) -> int:
    """A whole number option in 1..``most``; SpecError naming ``what`` otherwise."""
    n = _number(value, what, loc, int)
    if not 1 <= n <= most:
        raise SpecError(f"{what}={value} is out of range: it must be at least 1 and at most {most:,}",
                        loc)
    return n


def _check_range(what, x, bounds, loc) -> None:
    """SpecError at ``loc`` unless ``low <= x`` and ``x < high`` (or ``<=`` if allowed)."""
    low, high, high_ok = bounds
    legal = f"{low:g} <= x" + ("" if high is None else f" {'<=' if high_ok else '<'} {high:g}")
    if x < low:
        raise SpecError(f"{what} must not be {'negative' if low == 0 else f'below {low:g}'} "
                        f"(legal: {legal})", loc)
    if high is not None and (x > high or (x == high and not high_ok)):
        raise SpecError(f"{what} must be {'at most' if high_ok else 'less than'} {high:g} "
                        f"(legal: {legal})", loc)


#: the largest finite float32: hyperparameters must survive the model's float32 arithmetic
F32_MAX = 3.4028234663852886e38


def _check_float32(what, x, bounds, loc) -> None:
    """SpecError at ``loc`` unless ``x`` is representable in float32 and stays inside its legal
    range there (``beta1=0.99999999999`` is < 1 but rounds to 1.0 in float32, and its bias
    correction 1 - beta**t is then 0)."""
    if abs(x) > F32_MAX:
        raise SpecError(f"{what} is not representable in float32, the model's arithmetic "
                        f"(legal: 0 <= x <= {F32_MAX:.4g})", loc)
    low, high, high_ok = bounds
    if high is not None and not high_ok and float(_f32(x)) >= high:
        raise SpecError(f"{what} rounds to {float(_f32(x)):g} in float32, the model's arithmetic, "
                        f"which is not less than {high:g}; use at most {float(_below(high)):.9g}", loc)


def _f32(x):
    import numpy as np

    return np.float32(x)


def _below(high):
    import numpy as np

    return np.nextafter(np.float32(high), np.float32(0))


def _number(value, what, loc, kind):
    """``value`` as a finite int or float; SpecError naming ``what`` if it is not one."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        try:
            x = float(value)
        except OverflowError:  # an int of hundreds of digits
            x = math.inf
        if not math.isfinite(x):
            raise SpecError(f"{what} must be a finite number, not {value!r} (a float holds at most "
                            f"1.8e308)", loc)
        ok = kind is float or x == int(value)
    if not ok:
        raise SpecError(f"{what} must be {'a whole number' if kind is int else 'a number'}, "
                        f"not {value!r}", loc)
    return kind(value)
