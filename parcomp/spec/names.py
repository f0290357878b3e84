"""Checks a spec's rules against a model's names: every rule must match at least one
parameter, input, output or value of its kind, else a located error that says why."""
from __future__ import annotations

import re

from ..errors import SpecError
from .model import Spec, pattern_regex, suggest
from .syntax import show_token


def check_names(spec: Spec, param_names, input_names, output_names, value_names) -> None:
    """Check that every rule of ``spec`` matches at least one name of its kind in the model.

    ``param`` rules are matched against ``param_names``, ``input`` against
    ``input_names``, ``output`` against ``output_names``, ``activation``
    against ``value_names`` (the model's intermediate values).

    Raises:
        SpecError: at the first rule (in file order) that matches nothing, with
            "did you mean X?" when a close name exists, else the known names; when
            the model is wrapped (its names start with ``model.``, ``module.`` and the
            rule matches once that prefix is put in front), the prefix and the rule
            to write (:func:`_wrapper_hint`).
    """
    kinds = {"param": ("parameter", param_names), "input": ("input", input_names),
             "output": ("output", output_names), "activation": ("value", value_names)}
    for rule in spec.rules:
        noun, names = kinds[rule.target]
        names = list(names)
        if any(rule.matches(n) for n in names):
            continue
        msg = f"{rule.target} rule {show_token(rule.pattern)} matches no {noun} of the model"
        wrapped = _wrapper_hint(rule.pattern, names, noun)
        hint = None if wrapped else suggest(rule.pattern, names)
        if wrapped:
            msg += wrapped
        elif hint:
            msg += f"; did you mean {hint}?"
        elif names:
            more = f", ... ({len(names)} in all)" if len(names) > 8 else ""
            msg += f" (the model's {noun}s: {', '.join(names[:8])}{more})"
        else:
            msg += f" (the model has no {noun}s)"
        if not wrapped and "*" in rule.pattern and "**" not in rule.pattern and any("." in n for n in names):
            msg += "; `*` stops at a `.` and `**` crosses it (`**.weight`, `h.*.mlp.**`)"
        msg += _onnx_renamed(rule.target, names)
        raise SpecError(msg, rule.loc)


def _wrapper_hint(pattern: str, names: list, noun: str) -> str:
    """``"; the model's parameter names start with `model.`; write `model.h.*`"`` when
    ``pattern`` matches a name once a dotted prefix of it is put in front and the
    model's names share a leading part of that prefix (the model was wrapped:
    ``model.transformer.h.0...``, DDP's ``module.layers.0...``), else ``""``.

    The prefix is the shortest that makes the rule match (ties: the first in sorted
    order), so the rule to write keeps the user's wildcards; a "did you mean" with
    one concrete name such as ``model.transformer.h.1.mlp.c_fc.weight`` would point at one
    block only.
    """
    regex = pattern_regex(pattern)
    found = set()
    for name in names:
        comps = name.split(".")
        for k in range(1, len(comps)):
            prefix = ".".join(comps[:k]) + "."
            if regex.fullmatch(name[len(prefix):]):
                found.add(prefix)
                break
    if not found:
        return ""
    prefix = min(found, key=lambda p: (len(p.split(".")), p))
    shared = _common_prefix([prefix, *names])
    if not shared:
        return ""
    return f"; the model's {noun} names start with `{shared}`; write `{prefix}{pattern}`"


def _common_prefix(names: list) -> str:
    """The longest dotted prefix (ending in ``.``) that every one of ``names`` starts with."""
    comps = [n.split(".")[:-1] for n in names]
    out = []
    for parts in zip(*comps):
        if any(p != parts[0] for p in parts):
            break
        out.append(parts[0])
    return "".join(p + "." for p in out)


def _onnx_renamed(target: str, names: list) -> str:
    """A note when an ONNX model's weights carry generated names (``val_12``): torch.onnx's
    dynamo exporter with ``optimize=True`` (its default) renames the weights it folds, so a
    rule written with the module's names matches nothing."""
    made = [n for n in names if re.fullmatch(r"val_\d+", n)]
    if target != "param" or not made:
        return ""
    return (f"; {len(made)} of the model's weights have generated names such as {made[0]}: "
            f"torch.onnx.export(..., dynamo=True) with optimize=True (the default) renames the weights "
            f"it folds; export with optimize=False to keep the module names")
