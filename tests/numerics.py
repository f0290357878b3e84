"""The suite's one numerical assertion: ``parcomp.tolerance.compare`` with pytest's messages.

Tolerances are never typed in a test: they come from the error bound of the graph
the test computed (``parcomp.tolerance.output_bounds`` and friends, docs/design.md).
Exact small-integer tests use ``np.testing.assert_array_equal`` instead.
"""
from __future__ import annotations

from parcomp.tolerance import compare, compare_all


def assert_equivalent(got, want, bound, bound_want=None, what="value"):
    """``got`` and ``want`` are two computations of one value with error bounds ``bound``
    (and ``bound_want``, default the same); fails with the worst element and the ratio."""
    res = compare(got, want, bound, bound_want)
    assert res["ok"], (f"{what}: {res['why']} (max abs error {res['max_abs_err']:.3e}, "
                       f"error/tolerance {res['err_over_tol']:.3g})")
    return res


def assert_all_equivalent(got: dict, want: dict, bounds: dict, keys=None):
    """:func:`assert_equivalent` for every key of ``want`` (or ``keys``); a missing key fails."""
    res = compare_all(got, want, bounds, keys)
    assert res["ok"], f"{res['why']} (worst {res['worst']}, error/tolerance {res['err_over_tol']:.3g})"
    return res
