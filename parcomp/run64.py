"""``parcomp run``'s verdict when its float32 comparison cannot vouch: the float64 re-check.

``run`` compares what program.py computed under torchrun with the unsharded reference,
within the worst-case error bound of the model's dtype. Through a deep model that bound can
grow past the outputs themselves (docs/design.md, "Resolution"): no error beyond it is seen,
but a wrong collective could hide under it, so the float32 verdict alone is CANNOT VOUCH.
``parcomp check`` then re-checks the plan in float64 (:mod:`parcomp.check64`); ``run`` does
the same, so both say the same of one spec:

- the torchrun result is still compared with the reference within its bound: an error
  beyond a finite bound is a MISMATCH whatever float64 says, and is never re-checked;
- when the only failures are bounds too loose to resolve (``unbounded``), the same compiled
  programs run promoted to float64 on the numpy interpreter (sharded vs unsharded), where
  the bound resolves: OK there makes run's verdict OK (the note says what was vouched for and
  how); a MISMATCH there is run's MISMATCH; a float64 bound that cannot vouch either leaves
  CANNOT VOUCH, with a note.
"""
from __future__ import annotations

from .check64 import promote_compiled, promote_feeds, run_precision
from .train_check import brief, verdict

VOUCHED = ("torchrun's {dtype} result is within its error bound wherever that bound is finite, but "
           "the bound is too loose to resolve a 10% error ({why}); the same plan (every rank vs the "
           "unsharded graph, numpy interpreter) re-checked in float64 is OK ({float64}): the sharding "
           "is vouched for in float64, {dtype} rounding is not the compiler's")
REFUTED = ("torchrun's {dtype} result is within its error bound wherever that bound is finite, but the "
           "bound is too loose to resolve a 10% error; the same plan re-checked in float64 (numpy "
           "interpreter), where the bound resolves, differs beyond rounding: {float64}")
UNVOUCHED = "the float64 re-check of the plan (numpy interpreter) cannot vouch either: {float64}"


def _summary(r: dict) -> str:
    return (f"max abs error {r['max_abs_err']:.3e}, error/tolerance {r['err_over_tol']:.2g} at "
            f"{r['worst']}" + (f"; {brief(r['why'])}" if r.get("why") else ""))


def _apply(result: dict, wide: dict, dtype: str) -> dict:
    """``result`` (run's float32 verdict, only ``unbounded`` failures) with the float64
    re-check ``wide`` (``ok``/``unbounded``/``why`` and errors of the plan) applied."""
    out = {**result, "float64": {k: wide[k] for k in ("ok", "unbounded", "max_abs_err", "tolerance",
                                                      "err_over_tol", "worst", "why") if k in wide}}
    why = brief(result["why"])
    if wide["ok"]:  # as check: the verdict's error/tolerance is the re-check's (float32's kept)
        return {**out, "ok": True, "unbounded": False, "why": "", "err_over_tol": wide["err_over_tol"],
                "err_over_tol_float32": result.get("err_over_tol"),
                "note": VOUCHED.format(dtype=dtype, why=why, float64=_summary(wide))}
    if not wide.get("unbounded"):
        return {**out, "ok": False, "unbounded": False, "why": "float64 re-check: " + wide["why"],
                "note": REFUTED.format(dtype=dtype, float64=_summary(wide))}
    return {**out, "note": UNVOUCHED.format(float64=_summary(wide))}


def recheck_forward(compiled, example, feeds: dict, result: dict) -> dict:
    """Run's forward ``result`` (:func:`parcomp.tolerance.compare_outputs` of the torchrun
    outputs) as is when it is OK or a MISMATCH; when it cannot vouch, the float64 re-check
    of the plan applied (see the module docstring). ``feeds``: the full inputs and params."""
    if result["ok"] or not result.get("unbounded"):
        return result
    from .commands_check import _forward_check

    wide = _forward_check(promote_compiled(compiled), None, example, promote_feeds(feeds))
    return _apply(result, wide, run_precision(compiled))


def recheck_training(compiled, example, feeds: dict, steps: int, result: dict) -> dict:
    """Run's training ``result`` (each step from the reference state, with ``free_running``)
    as is unless its verdict is CANNOT VOUCH; then the float64 lockstep of the plan
    (:func:`parcomp.train_check.lockstep` of the promoted programs, against the unsharded
    steps) applied, and the free-running trajectory's loose bounds reported, not failed."""
    free = result["free_running"]
    if verdict(result, free) != "CANNOT VOUCH":
        return result
    from .train_check import lockstep

    wide = lockstep(promote_compiled(compiled), None, example, promote_feeds(feeds), steps)["vs_unsharded"]
    out = _apply({**result, "ok": False, "unbounded": True, "why": "; ".join(
        r["why"] for r in (result, free) if not r["ok"])}, wide, run_precision(compiled))
    out["free_running"] = {**free, "ok": free["ok"] or out["ok"]}
    return out
