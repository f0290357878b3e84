"""Tensor types, placements, layouts and meshes: the frozen value types of the IR.

Placements follow PyTorch DTensor (``torch/distributed/tensor/placement_types.py``)
and OneFlow SBP: one placement per mesh axis.

Shard-order convention (fixed up front, see DTensor's ``_StridedShard`` for what
happens otherwise): when several mesh axes shard the same tensor dim, the axis
that comes first in the mesh is the *outer* one.  On a mesh ``dp=2 tp=2`` with
layout ``[S(0), S(0)]`` the rank at coordinates ``(i, j)`` holds chunk
``i * 2 + j`` of dim 0.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import reduce
from typing import Union

import numpy as np


@dataclass(frozen=True)
class Replicate:
    """Every rank of the mesh axis holds the whole tensor. Printed ``R``."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    """Rank k of a mesh axis of size n holds chunk k (of n equal chunks) of ``dim``.

    ``dim`` is a non-negative tensor dim. Printed ``S(dim)``.
    """

    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Partial:
    """The true value is the reduction over the ranks of the axis of their local values.

    ``op="sum"`` (printed ``P``, long form ``P(sum)``): the sum, DTensor's Partial.
    ``op="max"`` (printed ``P(max)``): the elementwise max (a max over a split dim). It is
    never summed: only ``all_reduce{reduce_op="max"}`` makes it whole, and only ops whose
    rule lists it (amax, identity and movement ops) take it.
    """

    op: str = "sum"

    def __str__(self) -> str:
        return "P" if self.op == "sum" else f"P({self.op})"


Placement = Union[Replicate, Shard, Partial]
Layout = tuple  # tuple[Placement, ...], one per mesh axis, in mesh order

R = Replicate()
P = Partial()
PMAX = Partial("max")
REDUCE_OPS = ("sum", "max")  # the partial kinds, Partial.op


def layout_str(layout: Layout) -> str:
    """The one text form of a layout, ``[S(0), R]`` (one placement per mesh axis): in
    ``.pcir`` files, ``.pcs`` specs, reports, emitted comments and error messages."""
    return "[" + ", ".join(str(p) for p in layout) + "]"


def make_placement(letter: str, arg=None) -> Placement:
    """The placement text names: ``R``, ``S(arg)`` (``arg`` a dim >= 0), ``P`` / ``P(sum)``
    or ``P(max)``.

    Both parsers (``.pcir`` and ``.pcs``) build placements with this function.

    Raises:
        ValueError: a negative or non-integer dim, a reduction other than ``sum``/``max``,
            an unknown letter (the caller adds the file location).
    """
    if letter == "R" and arg is None:
        return R
    if letter == "S":
        if isinstance(arg, bool) or not isinstance(arg, int) or arg < 0:
            raise ValueError(f"S({arg}): a dim is a whole number >= 0")
        return Shard(arg)
    if letter == "P":
        if arg not in (None,) + REDUCE_OPS:
            raise ValueError(f"only P(sum) and P(max) are supported; got P({arg})")
        return P if arg in (None, "sum") else Partial(arg)
    raise ValueError(f"{letter}{'' if arg is None else f'({arg})'} is not a placement R, S(d) or P")


_PLACEMENT_RE = re.compile(r"\s*([A-Za-z]+)\s*(?:\(\s*([A-Za-z0-9_+-]*)\s*\))?\s*")


def parse_layout(text: str) -> Layout:
    """The layout :func:`layout_str` printed: ``"[S(0), R]"`` -> ``(Shard(0), R)``.

    Raises:
        ValueError: the text is not ``[placement, ...]``.
    """
    body = text.strip()
    if not (body.startswith("[") and body.endswith("]")):
        raise ValueError(f"{text!r} is not a layout such as [S(0), R]")
    parts = body[1:-1].split(",") if body[1:-1].strip() else []
    out = []
    for part in parts:
        m = _PLACEMENT_RE.fullmatch(part)
        if m is None:
            raise ValueError(f"{part.strip()!r} is not a placement R, S(d) or P")
        arg = m.group(2)
        out.append(make_placement(m.group(1), int(arg) if arg and arg.lstrip("+-").isdigit() else arg))
    return tuple(out)


def replicated(naxes: int) -> Layout:
    """The all-``R`` layout on a mesh with ``naxes`` axes."""
    return tuple(R for _ in range(naxes))


@dataclass(frozen=True)
class TensorType:
    """A dense tensor: ``shape`` (elements per dim) and numpy ``dtype`` name."""

    shape: tuple
    dtype: str = "float32"

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return int(reduce(lambda a, b: a * b, self.shape, 1))

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return self.numel * DTYPE_BYTES[self.dtype]

    def with_shape(self, shape) -> "TensorType":
        return TensorType(tuple(int(s) for s in shape), self.dtype)

    def __str__(self) -> str:
        return f"{DTYPE_SHORT[self.dtype]}[{','.join(str(s) for s in self.shape)}]"


DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
               "bool": 1}  # numpy has no bfloat16, so sizes come from this table
DTYPE_SHORT = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16",
               "int64": "i64", "int32": "i32", "bool": "bool"}
DTYPE_LONG = {v: k for k, v in DTYPE_SHORT.items()}


@dataclass(frozen=True)
class Mesh:
    """A named device mesh, e.g. ``dp=2 tp=2``.

    Ranks are numbered row-major: the *last* axis varies fastest (Megatron's
    ``tp`` innermost), so on ``dp=2 tp=2`` rank 1 is at coordinates (0, 1).
    """

    axes: tuple  # tuple[tuple[str, int], ...]

    @property
    def names(self) -> tuple:
        return tuple(a for a, _ in self.axes)

    @property
    def sizes(self) -> tuple:
        return tuple(n for _, n in self.axes)

    @property
    def size(self) -> int:
        return int(np.prod(self.sizes, dtype=np.int64)) if self.axes else 1

    def axis_index(self, name: str) -> int:
        return self.names.index(name)

    def coords(self, rank: int) -> tuple:
        """Mesh coordinates of a global rank (row-major, last axis fastest)."""
        return tuple(int(c) for c in np.unravel_index(rank, self.sizes)) if self.axes else ()

    def rank_of(self, coords) -> int:
        return int(np.ravel_multi_index(tuple(coords), self.sizes)) if self.axes else 0

    def groups(self, axis) -> list:
        """Rank lists along mesh axis ``axis``: one list per line of the mesh, in rank order.

        ``axis`` may be a tuple of axes (a joint group): the ranks that differ only in
        those axes, in rank order (the first of them outermost, as the shard order)."""
        axes = set(axis) if isinstance(axis, tuple) else {axis}
        out = {}
        for r in range(self.size):
            key = tuple(0 if i in axes else c for i, c in enumerate(self.coords(r)))
            out.setdefault(key, []).append(r)
        return list(out.values())

    def axes_of(self, axis: str) -> tuple:
        """Mesh axis indices of a layout op's ``axis`` attribute: ``"tp"`` or, for a collective
        over a joint group, ``"dp,tp"`` (names in mesh order). Raises ValueError on an unknown name."""
        return tuple(self.names.index(a) for a in axis.split(","))

    def __str__(self) -> str:
        return " ".join(f"{a}={n}" for a, n in self.axes)


def shard_axes(layout: Layout, dim: int) -> list:
    """Mesh axes (indices, outer first) that shard tensor dim ``dim``."""
    return [i for i, p in enumerate(layout) if isinstance(p, Shard) and p.dim == dim]


def local_shape(ty: TensorType, layout: Layout, mesh: Mesh) -> tuple:
    """Per-rank shape of a tensor of type ``ty`` under ``layout`` (even shards only)."""
    shape = list(ty.shape)
    for i, p in enumerate(layout):
        if isinstance(p, Shard):
            shape[p.dim] //= mesh.sizes[i]
    return tuple(shape)


def shard_offsets(ty: TensorType, layout: Layout, mesh: Mesh, coords) -> tuple:
    """(start, length) per dim of the block a rank at ``coords`` holds."""
    out = []
    for d, size in enumerate(ty.shape):
        chunk, index = size, 0
        for a in shard_axes(layout, d):  # outer axis first
            chunk //= mesh.sizes[a]
            index = index * mesh.sizes[a] + coords[a]
        out.append((index * chunk, chunk))
    return tuple(out)


def divisibility_problem(ty: TensorType, layout: Layout, mesh: Mesh) -> str | None:
    """Why ``layout`` cannot split ``ty`` evenly on ``mesh``, or None if it can."""
    for d in range(ty.rank):
        axes = shard_axes(layout, d)
        parts = math.prod(mesh.sizes[a] for a in axes)  # ints: exact, no numpy call per dim
        if ty.shape[d] % parts:
            names = "x".join(mesh.names[a] for a in axes)
            return (f"dim {d} of size {ty.shape[d]} is not divisible by mesh axis {names} "
                    f"of size {parts}")
    for p in layout:
        if isinstance(p, Shard) and not 0 <= p.dim < ty.rank:
            return f"S({p.dim}) names a dim a rank-{ty.rank} tensor does not have"
    return None
