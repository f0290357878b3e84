"""The suite's numerical assertions: ``parcomp.check.differential``'s comparison with pytest's messages.

Tolerances are never typed in a test: a comparison is scale-relative within the tolerance of
the least precise dtype of the two sides (:data:`parcomp.check.differential.DTYPE_TOLERANCE`;
float64 against float64: :data:`parcomp.check.differential.THRESHOLD`, what ``parcomp check``
decides by). :func:`assert_program_equivalent` is ``check``'s own comparison: a compiled
program (every rank) against its unsharded graph, both promoted to float64.
Exact small-integer tests use ``np.testing.assert_array_equal`` instead.
"""
from __future__ import annotations

import numpy as np

from parcomp.check.check64 import promote_compiled, promote_feeds, promote_graph
from parcomp.check.differential import compare, compare_all, tolerance_for
from parcomp.reference.interpreter import run_spmd
from parcomp.reference.numpy_ops import run_unsharded

__all__ = ["assert_equivalent", "assert_all_equivalent", "assert_program_equivalent", "assert_check_ok",
           "rtol_of"]

_ORDER = ("bfloat16", "float16", "float32", "float64")


def rtol_of(*arrays) -> float:
    """The tolerance of the least precise float dtype among ``arrays`` (float64 if none is)."""
    names = [np.asarray(a).dtype.name for a in arrays]
    floats = [n for n in names if n in _ORDER]
    return tolerance_for(min(floats, key=_ORDER.index) if floats else "float64")


def assert_equivalent(got, want, what="value", rtol=None):
    """``got`` and ``want`` are two computations of one value: equal within ``rtol`` (default:
    :func:`rtol_of` the two) of its scale; fails with the worst element and the ratio."""
    res = compare(got, want, rtol_of(got, want) if rtol is None else rtol)
    assert res["ok"], (f"{what}: {res['why']} (max abs error {res['max_abs_err']:.3e}, "
                       f"error/tolerance {res['err_over_tol']:.3g})")
    return res


def assert_all_equivalent(got: dict, want: dict, keys=None, rtol=None):
    """:func:`assert_equivalent` for every key of ``want`` (or ``keys``), each at its module's
    floor (:func:`parcomp.check.differential.compare_all`); a missing key fails."""
    keys = list(want) if keys is None else list(keys)
    if rtol is None:
        rtol = rtol_of(*[got[k] for k in keys if k in got], *[want[k] for k in keys])
    res = compare_all(got, want, keys, rtol)
    assert res["ok"], f"{res['why']} (worst {res['worst']}, error/tolerance {res['err_over_tol']:.3g})"
    return res


def assert_program_equivalent(compiled, feeds: dict, keys=None, program=None, reference=None):
    """``check``'s comparison: ``compiled.program`` (or ``program``) on every rank against the
    unsharded ``compiled.logical`` (or ``reference``), both promoted to float64, one forward
    or training step from ``feeds``; every output within the float64 threshold of its scale.
    Returns ``(got, want)`` (float64)."""
    wide = promote_compiled(compiled) if compiled is not None else None
    prog = promote_graph(program) if program is not None else wide.program
    ref = promote_graph(reference) if reference is not None else wide.logical
    f64 = promote_feeds(feeds)
    got, want = run_spmd(prog, f64).outputs(prog), run_unsharded(ref, f64)
    assert_all_equivalent(got, want, keys)
    return got, want


def assert_check_ok(out: dict) -> None:
    """A ``check --json`` result of a training spec: OK, and OK against torch.optim where
    compared."""
    assert out["verdict"] == "OK", out.get("why")
    vs = out.get("vs_torch")
    if vs is not None:
        assert vs["ok"], vs["why"]
