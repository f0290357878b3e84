"""The parsed form of a parallel spec (``.pcs``): frozen dataclasses.

A spec says how a model is laid out on a device mesh, in the words of
Megatron-LM and PyTorch DTensor::

    mesh tp=2
    c_fc.weight    colwise           # Megatron ColumnParallelLinear
    c_proj.weight  rowwise           # Megatron RowParallelLinear
    input  x       replicated
    output output  replicated

:func:`parcomp.spec.parse_spec` builds these objects; every name, axis and
layout in them has already been checked against the mesh.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from ..errors import SourceLoc, closest
from ..ir.types import Mesh

#: Layout words and what they mean (for error messages and docs).
LAYOUT_WORDS = {
    "replicated": "every rank holds the whole tensor (DTensor Replicate, R)",
    "split-hidden": "split the last (hidden) dim across the axis",
    "split-seq": "split the sequence dim across the axis (Megatron sequence parallel)",
    "partial-sum": "each rank holds a partial sum (DTensor Partial, P)",
    "colwise": "Megatron ColumnParallelLinear: split the output features",
    "rowwise": "Megatron RowParallelLinear: split the input features",
}

#: Rule targets: what kind of model name a rule's pattern is matched against.
TARGETS = ("param", "input", "output", "activation")


@dataclass(frozen=True)
class LayoutSpec:
    """The layout a rule asks for.

    Exactly one of ``word`` and ``explicit`` is set.  ``word`` is one of
    :data:`LAYOUT_WORDS`; ``explicit`` is a full layout, one placement per mesh
    axis in mesh order.  ``axis`` is the mesh axis the word (or the single
    placement of ``S(1) over tp``) applies to; None for ``[..]`` and ``axis=..``.
    """

    word: str | None
    explicit: tuple | None
    axis: str | None


@dataclass(frozen=True)
class Rule:
    """``target pattern layout``: the layout for every model name matching ``pattern``."""

    target: str
    pattern: str
    layout: LayoutSpec
    loc: SourceLoc

    def matches(self, name: str) -> bool:
        """Whether ``name`` matches the pattern.

        ``*`` matches one or more characters inside one dotted component
        (``h.*.mlp`` matches ``h.0.mlp`` but not ``h.0.x.mlp``); ``**`` matches
        one or more characters across components (``**.weight``).
        """
        return pattern_regex(self.pattern).fullmatch(name) is not None


@lru_cache(maxsize=1024)
def pattern_regex(pattern: str) -> re.Pattern:
    """The compiled regex of a name pattern (see :meth:`Rule.matches`)."""
    out = []
    for part in re.split(r"(\*+)", pattern):
        if part.startswith("**"):
            out.append(r".+")
        elif part == "*":
            out.append(r"[^.]+")
        else:
            out.append(re.escape(part))
    return re.compile("".join(out))


def suggest(pattern: str, names: list) -> str | None:
    """The closest of ``names`` to ``pattern`` for a "did you mean" hint, or None.

    For a wildcard pattern, names with the same number of dotted components are
    first given the pattern's wildcard components (``h.0.mlp`` -> ``h.*.mlp``),
    so the hint is itself a pattern.
    """
    if "*" not in pattern:
        return closest(pattern, names)
    comps = pattern.split(".")
    shaped = {".".join(p if "*" in p else n for p, n in zip(comps, name.split(".")))
              for name in names if len(name.split(".")) == len(comps)}
    shaped.discard(pattern)
    return closest(pattern, sorted(shaped)) or closest(pattern.replace("*", ""), names)


@dataclass(frozen=True)
class TrainSpec:
    """``train key=value ...``: the training options, sorted by key.

    A value is an int, float or str, or ``(name, ((k, v), ...))`` for a call
    such as ``optimizer=sgd(lr=0.1)`` (arguments sorted by key).
    """

    options: tuple
    loc: SourceLoc

    def get(self, key: str, default=None):
        """The value of option ``key``, or ``default`` if it was not given."""
        for k, v in self.options:
            if k == key:
                return v
        return default


@dataclass(frozen=True)
class Spec:
    """A whole parsed spec: the mesh, the layout rules in file order, options."""

    mesh: Mesh
    rules: tuple
    file: str
    topology: tuple | None = None  # (nodes, devices_per_node)
    train: TrainSpec | None = None
    topology_loc: SourceLoc | None = None  # where the topology statement is

    def default_axis(self) -> str:
        """The mesh axis a layout word without ``over`` applies to.

        The only axis of a one-axis mesh; else ``tp`` if the mesh has it; else
        the last (fastest-varying) axis.
        """
        return default_axis(self.mesh)

    def rules_for(self, target: str) -> tuple:
        """The rules of one target kind (``param``, ``input``, ...), in file order."""
        return tuple(r for r in self.rules if r.target == target)


def default_axis(mesh: Mesh) -> str:
    """See :meth:`Spec.default_axis`."""
    names = mesh.names
    if len(names) == 1:
        return names[0]
    return "tp" if "tp" in names else names[-1]
