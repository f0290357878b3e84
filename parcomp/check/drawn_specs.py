"""Hypothesis strategies that draw specs for an imported graph: a mesh, a layout for every
parameter and input, and a layout (or none) for every output.

:mod:`parcomp.testing` (a user's pytest) and ``parcomp check --examples N`` (the command line)
draw from these same strategies, so both run the same search and shrink the same way: the
layouts are drawn replicated-first and the mesh smallest-first, so a failure shrinks towards
the smallest mesh and the fewest splits. Needs hypothesis (``pip install 'parcomp[test]'``).
"""
from __future__ import annotations

import itertools
import math

from hypothesis import strategies as st

#: mesh axis names, in the order a drawn mesh lists them (the last varies fastest)
AXES = ("dp", "tp")


@st.composite
def meshes(draw, max_ranks: int = 4, axes=AXES):
    """``{axis: size}``: one axis (``tp``) or two (``dp``, ``tp``), sizes powers of two, at most
    ``max_ranks`` ranks. Shrinks to ``{"tp": 2}``."""
    sizes = [2 ** k for k in range(1, int(math.log2(max_ranks)) + 1)]
    two = max_ranks >= 4 and len(axes) > 1 and draw(st.booleans())
    if not two:
        return {axes[-1]: draw(st.sampled_from(sizes))}
    outer = draw(st.sampled_from([s for s in sizes if s * 2 <= max_ranks]))
    inner = draw(st.sampled_from([s for s in sizes if s * outer <= max_ranks]))
    return {axes[0]: outer, axes[-1]: inner}


@st.composite
def layouts(draw, shape, mesh: dict, dims=None):
    """A layout ``[p, ...]`` (one placement per mesh axis) of a tensor of ``shape``: ``R`` or
    ``S(d)`` for a dim ``d`` (of ``dims``, default every dim) the axis's size divides, each dim
    split by one axis at most. ``R`` first, so a failure shrinks towards fewer splits."""
    used, out = set(), []
    for size in mesh.values():
        options = ["R"] + [f"S({d})" for d in (range(len(shape)) if dims is None else dims)
                           if d < len(shape) and d not in used and shape[d] % size == 0 and shape[d] >= size]
        pick = draw(st.sampled_from(options))
        if pick != "R":
            used.add(int(pick[2:-1]))
        out.append(pick)
    return "[" + ", ".join(out) + "]"


def output_layouts(mesh: dict) -> list:
    """An output's layouts to draw from: none (the search's), then each axis R or P
    (partial sums: ``check`` adds the ranks' pieces up)."""
    return [None] + ["[" + ", ".join(c) + "]" for c in itertools.product("RP", repeat=len(mesh))]


@st.composite
def graph_specs(draw, graph, mesh=None, max_ranks: int = 4, split_inputs: bool = True):
    """A spec's text for ``graph``: a mesh (``mesh``, or one of :func:`meshes`), a layout for
    every parameter (:func:`layouts`; replicated ones are left out) and every input (replicated
    or its batch, dim 0, split: ``split_inputs``), and every output left to the search,
    replicated, or a partial sum over some axes (:func:`output_layouts`)."""
    m = mesh if mesh is not None else draw(meshes(max_ranks))
    lines = ["mesh " + " ".join(f"{a}={s}" for a, s in m.items())]
    for n in graph.params:
        if n.type.rank == 0:
            continue
        lay = draw(layouts(n.type.shape, m))
        if lay != "[" + ", ".join("R" for _ in m) + "]":
            lines.append(f"{n.name} {lay}")
    for n in graph.inputs:
        dims = (0,) if split_inputs and n.type.rank else ()
        lines.append(f"input {n.name} {draw(layouts(n.type.shape, m, dims))}")
    for pub in graph.output_names:
        lay = draw(st.sampled_from(output_layouts(m)))
        if lay is not None:
            lines.append(f"output {pub} {lay}")
    return "\n".join(lines) + "\n"
