"""Whether an error bound is tight enough to vouch for anything (docs/design.md, "Resolution").

A check compares two computations within ``SAFETY * (bound_a + bound_b)``. A bound that
is sound but loose can allow as much as the values themselves, and then "within the
bound" says nothing: a wrong collective passes. So a comparison also asks the bound to
*resolve*: at every element the allowed difference must stay below :data:`RESOLVE` times
the compared tensor's scale (max |reference|). When it does not, the verdict is
``CANNOT VOUCH`` (never ``OK``), naming the element and, where the graph is at hand, the
op where the bound first grew past that fraction of its own value's scale.

``RESOLVE = 0.05``: an error of 10% of the output's scale is then at least twice the
tolerance anywhere, so the check resolves (fails on) every such error.
"""
from __future__ import annotations

import numpy as np

RESOLVE = 0.05
#: the explanation a loose bound's reason ends with (said once when several values fail)
LOOSE_TAIL = ("the error bound is too loose to tell a wrong result from rounding, so parcomp cannot "
              "vouch for it")


def loose_element(allowed, want, resolve: float = RESOLVE):
    """``(index, allowed, scale)`` of the element whose allowed error is the largest
    against ``resolve * max|want|`` when it exceeds it (or is not finite), else None.

    ``allowed``, ``want``: arrays of one shape (the allowed difference per element and the
    reference). Elements where ``want`` is not finite are skipped, and so is a tensor whose
    reference is all zero (no scale to be relative to)."""
    w = np.asarray(want, np.float64)
    a = np.broadcast_to(np.asarray(allowed, np.float64), w.shape)
    fin = np.isfinite(w)
    if not fin.any():
        return None
    scale = float(np.abs(w[fin]).max())
    if scale == 0.0:
        return None
    over = np.where(fin, np.where(np.isfinite(a), a, np.inf), 0.0)
    i = np.unravel_index(int(np.argmax(over)), w.shape)
    return (i, float(a[i]), scale) if not over[i] <= resolve * scale else None


def where_bound_grew(graph, values: dict, bounds: dict, resolve: float = RESOLVE) -> str:
    """The first node of ``graph`` whose bound exceeds ``resolve`` times its own value's
    scale (``values``/``bounds``: :func:`parcomp.tolerance.propagate`'s), as
    ``"%name (op)"``; "" when none does (the looseness came from the comparison's inputs)."""
    for n in graph.nodes:
        if n.op in ("input", "param") or n.name not in bounds:
            continue
        if loose_element(bounds[n.name], values[n.name], resolve) is not None:
            return f"%{n.name} ({n.op})"
    return ""


def loose_reason(key: str, found, resolve: float = RESOLVE) -> str:
    """The sentence of a comparison whose bound does not resolve (``found``: :func:`loose_element`)."""
    i, allowed, scale = found
    at = key + str([int(j) for j in i]).replace(" ", "")
    return (f"the tolerance at {at} ({allowed:.3e}) is more than {resolve:.0%} of the value's scale "
            f"({scale:.3e}): {LOOSE_TAIL}")
