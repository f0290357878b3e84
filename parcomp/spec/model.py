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

import math
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

#: The most ranks a mesh may have: 2^20 = 1,048,576, about ten times the largest
#: training clusters built so far (~10^5 accelerators).  Up to it everything that
#: is per rank (program.py's process-group table, the numpy interpreter's ranks)
#: stays within seconds and megabytes; beyond it a typo (``tp=1000000000000``)
#: would make those loops run for hours.  See docs/design/cost.md, "Limits".
MAX_MESH_RANKS = 2 ** 20


def check_mesh_size(axes, err) -> None:
    """Reject a mesh with more than :data:`MAX_MESH_RANKS` ranks, at the size that passes it.

    Cheap on any input: a size of more than 18 digits is over the limit without
    being converted, so a size of a thousand digits costs nothing.  Sizes are
    read in order up to the first one below 1 (the parser reports that one).

    Args:
        axes: ``[(name token, size token), ...]`` of the ``mesh`` statement, in order.
        err: ``err(token, message) -> SpecError`` locating the message at a token.

    Raises:
        SpecError: from ``err``, at the size token where the running product of
            the sizes first exceeds :data:`MAX_MESH_RANKS`.
    """
    sizes = [str(size).lstrip("+") for _, size in axes]
    total = 1
    for i, ((_, size), digits) in enumerate(zip(axes, sizes)):
        if digits.startswith("-") or set(digits) <= {"0"}:
            return
        total *= int(digits) if len(digits) <= 18 else MAX_MESH_RANKS + 1
        if total > MAX_MESH_RANKS:
            raise err(size, f"mesh {_mesh_text(axes)} has {_rank_count(sizes)} ranks, more than "
                            f"parcomp's limit of {MAX_MESH_RANKS} (2^20, about ten times the "
                            f"largest clusters built); "
                            f"{'the product of the sizes up to here' if i else 'this size'}"
                            f" passes it: check the sizes for a typo")


def _mesh_text(axes) -> str:
    """``tp=2 dp=4`` from mesh tokens; a size of more than 20 digits is shortened."""
    out = []
    for name, size in axes:
        d = str(size).lstrip("+")
        short = d if len(d) <= 20 else f"{d[:8]}...{d[-4:]} ({len(d)} digits)"
        out.append(f"{name}={short}")
    return " ".join(out)


def _rank_count(sizes) -> str:
    """The product of the mesh sizes (digit strings), or ``at least ...`` if it is not exact."""
    bad = next((i for i, d in enumerate(sizes) if d.startswith("-") or set(d) <= {"0"}), len(sizes))
    good = sizes[:bad]
    if sum(len(d) for d in good) > 40:
        return f"at least 10^{sum(len(d) - 1 for d in good)}"
    count = str(math.prod(int(d) for d in good))
    return count if bad == len(sizes) else f"at least {count}"


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
class StageRule:
    """``stage K: ITEM ...``: the modules pipeline stage ``index`` holds.

    ``items`` are module paths (a node belongs to the first item that equals its
    module path or is a dotted prefix of it); a range ``h.0-5`` is expanded here to
    ``h.0 ... h.5``.  ``raw`` keeps the items as written, for messages; ``locs`` is the
    place of each of ``items`` (the item as written that names it), ``()`` for rules the
    cost model made.
    """

    index: int
    items: tuple
    raw: tuple
    loc: SourceLoc
    locs: tuple = ()


@dataclass(frozen=True)
class Spec:
    """A whole parsed spec: the mesh, the layout rules in file order, options."""

    mesh: Mesh
    rules: tuple
    file: str
    topology: tuple | None = None  # (nodes, devices_per_node)
    train: TrainSpec | None = None
    topology_loc: SourceLoc | None = None  # where the topology statement is
    links: tuple = ()  # the topology's link keys, sorted (key, value) pairs (parcomp/cost/links.py)
    memory: int | None = None  # bytes per device (the `memory` statement), or None
    memory_loc: SourceLoc | None = None
    stages: tuple = ()  # StageRule per pipeline stage, in stage order (empty: none given)
    launch: tuple = ()  # the topology's placement= / timeout= pairs, sorted (program.py's defaults)
    # `sequence-parallel [over AXIS]` (transformer SP): (axis, loc) or None
    sequence_parallel: tuple | None = None
    # `context-parallel [over AXIS] [lowering=...]`: parcomp.passes.attention.ctxpar.ContextParallel or None
    context_parallel: object = None
    # `moe capacity_factor=F [drop=tokens]` / `moe drop=none`: parcomp.spec.moe.MoeSpec or None
    moe: object = None

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
