"""The ``train`` line of a spec, checked: loss, optimizer and its hyperparameters.

Defaults follow torch.optim: SGD(momentum=0, weight_decay=0), AdamW(lr=1e-3,
betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import SpecError, closest

LOSSES = ("mse", "cross_entropy", "output")
OPTIMIZERS = {
    "sgd": {"lr": 0.01, "momentum": 0.0, "weight_decay": 0.0},
    "adamw": {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01},
}


@dataclass(frozen=True)
class TrainConfig:
    """What one training step does.

    Attributes:
        loss: ``mse`` | ``cross_entropy`` | ``output`` (the model returns its loss).
        optimizer: ``sgd`` | ``adamw``; ``hyper``: its hyperparameters (sorted pairs).
        batch: global batch (dim 0 of every input), or None to take the model's.
        steps: steps ``parcomp run`` trains; ``zero``: 0, or 1/2 for a sharded
            optimizer state over the ``dp`` axis (ZeRO-1/2: reduce_scatter of
            gradients, local update, all_gather of parameters).
        trainable: name pattern of the trained parameters.
        input_grads: whether float model inputs get gradients (``x.grad``): yes for a
            layer inside a larger model (Megatron's dx all_reduce), no for data inputs.
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

    def h(self, key):
        return dict(self.hyper)[key]


def train_config(spec) -> TrainConfig:
    """Read and check ``spec.train``. Raises SpecError at the train line."""
    t = spec.train
    known = {"loss", "optimizer", "batch", "steps", "zero", "trainable", "input_grads"}
    for k, _ in t.options:
        if k not in known:
            hint = closest(k, known)
            raise SpecError(f"unknown train option {k!r}" + (f"; did you mean {hint!r}?" if hint else
                            f"; known: {', '.join(sorted(known))}"), t.loc)
    loss = t.get("loss", "mse")
    if loss not in LOSSES:
        raise SpecError(f"loss {loss!r} is not supported; supported: {', '.join(LOSSES)}", t.loc)
    opt = t.get("optimizer", "sgd")
    name, args = (opt, ()) if isinstance(opt, str) else opt
    if name not in OPTIMIZERS:
        raise SpecError(f"optimizer {name!r} is not supported by the backends; supported: "
                        f"{', '.join(OPTIMIZERS)}", t.loc)
    hyper = dict(OPTIMIZERS[name])
    for k, v in args:
        if k not in hyper:
            raise SpecError(f"{name} has no hyperparameter {k!r}; it takes {', '.join(hyper)}", t.loc)
        hyper[k] = _number(v, f"{name}({k}=...)", t.loc, float)
        if hyper[k] < 0:
            raise SpecError(f"{name}({k}={v}) must not be negative", t.loc)
    zero = _number(t.get("zero", 0), "zero", t.loc, int)
    if zero not in (0, 1, 2):
        raise SpecError(f"zero={zero}: only 0, 1 and 2 exist", t.loc)
    if zero and "dp" not in spec.mesh.names:
        raise SpecError("zero=1/2 shards optimizer state over a 'dp' mesh axis, and the mesh has none",
                        t.loc)
    batch = t.get("batch")
    batch = None if batch is None else _number(batch, "batch", t.loc, int)
    steps = _number(t.get("steps", 1), "steps", t.loc, int)
    if steps < 1 or (batch is not None and batch < 1):
        raise SpecError(f"steps and batch must be at least 1 (steps={steps}, batch={batch})", t.loc)
    input_grads = t.get("input_grads", "yes")
    if input_grads not in ("yes", "no"):
        raise SpecError(f"input_grads={input_grads!r}: say yes or no", t.loc)
    return TrainConfig(loss, name, tuple(sorted(hyper.items())), batch, steps, zero,
                       str(t.get("trainable", "**")), t.loc, input_grads == "yes")


def _number(value, what, loc, kind):
    """``value`` as an int or float; SpecError naming ``what`` if it is not one."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and kind is int and float(value) != int(value):
        ok = False
    if not ok:
        raise SpecError(f"{what} must be {'a whole number' if kind is int else 'a number'}, "
                        f"not {value!r}", loc)
    return kind(value)
