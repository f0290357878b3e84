"""The suite's one numerical assertion: ``parcomp.tolerance.compare`` with pytest's messages.

Tolerances are never typed in a test: they come from the error bound of the graph
the test computed (``parcomp.tolerance.output_bounds`` and friends, docs/design.md).
Exact small-integer tests use ``np.testing.assert_array_equal`` instead.
"""
from __future__ import annotations

import numpy as np

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


#: A secondary guard where the sound bound cannot vouch (CANNOT VOUCH): a sharding bug (a
#: dropped partial sum, a wrong slice, a missing all_gather) moves a loss by percents, while
#: the float32 rounding of these tiny models moves it by ~1e-7 of itself. Not a tolerance
#: the product uses: ``check`` says CANNOT VOUCH there, this only keeps the test able to fail.
LOSS_GUARD = 1e-4


def assert_never_wrong(out: dict) -> None:
    """A ``check --json`` result of a training spec: OK, or CANNOT VOUCH where the sound
    bound of a training step cannot resolve a 10% error (docs/design.md, "Resolution"),
    never MISMATCH; the same against torch.optim; and each step's loss within
    :data:`LOSS_GUARD` of the unsharded one."""
    assert out["verdict"] in ("OK", "CANNOT VOUCH"), out.get("why")
    vs = out.get("vs_torch")
    if vs is not None:
        assert vs["ok"] or vs["unbounded"], vs["why"]
    got, want = np.asarray(out["losses"], np.float64), np.asarray(out["reference_losses"], np.float64)
    assert got.shape == want.shape and (np.abs(got - want) <= LOSS_GUARD * np.abs(want)).all(), (got, want)


#: the training specs whose float64 re-check vouches (OK): their one-step bound resolves a
#: 10% error in float64 (issue 17, parcomp/rules/vjp_bounds.py; Llama's by the exact linear
#: maps of parcomp/segment_bounds.py)
VOUCHED_LMS = ("gpt2_lm", "llama_lm")


def assert_vouched_if_expected(out: dict, factory: str) -> None:
    """:func:`assert_never_wrong`, and OK (not CANNOT VOUCH) for a model in :data:`VOUCHED_LMS`."""
    assert_never_wrong(out)
    if factory in VOUCHED_LMS:
        assert out["verdict"] == "OK", out.get("why")
