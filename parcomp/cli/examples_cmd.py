"""``parcomp check MODEL --examples N``: the property search of :mod:`parcomp.testing` from the
command line.

Hypothesis draws N specs for the model (:func:`parcomp.check.drawn_specs.graph_specs`, the
strategy ``parcomp.testing.specs`` draws from), each is checked as ``parcomp check --spec`` checks
it, and the first failure is shrunk by hypothesis to the smallest failing spec, printed as
``.pcs`` text (and written to ``-o FILE`` when given). A spec the compiler refuses as the user's
error is skipped and drawn again; a spec on which the verifier finds the compiler broke its own
IR, or whose program differs from the unsharded model, is a failure. With ``--spec``, the spec's
mesh is kept and every layout drawn on it (its other lines are not used).
"""
from __future__ import annotations

import contextlib
import io
import sys
from types import SimpleNamespace

from ..errors import ParcompError, VerifyError
from ..outdir import check_own_file, write_own_file
from ..frontends.loader import load_model, pointing_into
from ..spec import load_spec
from ..spec.parser import parse_spec
from ..units import plural
from .common import require_numpy_dtypes

#: the first line of a spec file ``--examples -o FILE`` writes; a file without it (or changed
#: since: the digest) is the user's and is never replaced
HEADER = "# written by parcomp check --examples; sha256 of the lines below: "


class _Failing(Exception):
    """A drawn spec that fails (hypothesis shrinks it and raises the smallest one's)."""

    def __init__(self, text: str, message: str):
        super().__init__(message)
        self.text, self.message = text, message


def check_examples(args, check):
    """``parcomp check MODEL --examples N [--spec S] [-o FILE]``: exit status 0 when every drawn
    spec passes, 1 with the smallest failing spec printed. ``check`` is ``parcomp check``'s body
    (:func:`parcomp.cli.check_cmd.check`), run on each drawn spec.

    Raises:
        ParcompError: hypothesis is not installed, ``--steps`` given (drawn specs have no train
            line), ``-o`` names a file parcomp did not write, the model or ``--spec`` is bad, or
            the compiler refused every drawn spec.
    """
    if args.steps is not None:
        raise ParcompError("--steps: the drawn specs have no train line (each is one forward pass); "
                           "drop --steps", where="--steps")
    try:
        from hypothesis import HealthCheck, Verbosity, assume, given, seed, settings
        from hypothesis.errors import Unsatisfiable

        from ..check.drawn_specs import graph_specs
    except ImportError as e:
        raise ParcompError(f"--examples draws specs with hypothesis, which cannot be imported ({e}); "
                           f"install it: pip install 'parcomp[test]'", where="--examples") from None
    if args.out:
        check_target(args.out)  # before any compile: a refused -o costs no search
    graph, module, example = load_model(args.model)
    with pointing_into(args.model):
        require_numpy_dtypes(graph, "check")
    mesh = dict(load_spec(args.spec).mesh.axes) if args.spec else None
    outcomes = {}  # spec text -> None (passes), "refused: ..." or the failure's message

    def outcome(text: str):
        if text not in outcomes:
            outcomes[text] = check_one(check, (graph, module, example), text, args.seed)
        return outcomes[text]

    @settings(max_examples=args.examples, deadline=None, database=None, report_multiple_bugs=False,
              suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet)
    @seed(args.seed)
    @given(graph_specs(graph, mesh))
    def search(text):
        got = outcome(text)
        if got is not None and got.startswith("refused: "):
            assume(False)
        elif got is not None:
            raise _Failing(text, got)

    found = None
    try:
        search()
    except _Failing as e:
        found = e
    except Unsatisfiable:
        pass
    refused = [t for t, o in outcomes.items() if o is not None and o.startswith("refused: ")]
    checked = len(outcomes) - len(refused)
    if not checked:
        last = outcomes[refused[-1]][len("refused: "):] if refused else "no spec drawn"
        raise ParcompError(f"the compiler refused all {plural(len(refused), 'drawn spec')}; the last: {last}",
                           where="--examples")
    how = (f"{plural(checked, 'drawn spec')} checked on the numpy interpreter in float64"
           + (f" ({len(refused)} more refused by the compiler as illegal, skipped)" if refused else ""))
    result = {"ok": found is None, "examples": args.examples, "checked": checked, "refused": len(refused),
              "mesh": mesh, "failing_spec": None, "failure": None, "out": None}
    if found is None:
        if not args.json:
            print(f"parcomp check --examples {args.examples}: OK: {how}; every one equals the unsharded model"
                  + (f" (no failing spec, {args.out} not written)" if args.out else ""))
        return result
    result.update(failing_spec=found.text, failure=found.message)
    if args.out:
        write_found(args.out, found.text)
        result["out"] = args.out
    if not args.json:
        print(f"parcomp check --examples {args.examples}: FAILED: {how}, drawn then shrunk; the smallest failing spec "
              f"(hypothesis's shrinking):")
        print(found.text.rstrip("\n"))
        print()
        print(found.message)
        print(f"rerun it: parcomp check {args.model} --spec "
              + (args.out if args.out else "FILE.pcs  (the spec above saved as FILE.pcs)"))
    return result


def check_one(check, model: tuple, text: str, seed: int):
    """``check`` (``parcomp check``'s body) of ``model`` (graph, module, example) under the spec ``text``, its output
    kept quiet: None when it passes, ``"refused: ..."`` when the compiler refuses the spec as the
    user's error, else the failure's message (the verifier's, or the comparison's)."""
    args = SimpleNamespace(model=model, spec=parse_spec(text, "<drawn spec>"), json=True, seed=seed, steps=None)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            raw = check(args)
        except VerifyError as e:  # the compiler broke its own IR on a legal spec: a bug, never skipped
            return "parcomp's compiler produced invalid IR for this spec:\n" + _indent(e.render())
        except ParcompError as e:
            return "refused: " + e.render()
    if raw.get("ok", True):
        return None
    lines = [f"{raw.get('verdict', 'MISMATCH')}: the sharded program differs from the unsharded model",
             f"  worst: {raw.get('worst')}; max abs error {raw.get('max_abs_err', float('nan')):.3e}; "
             f"error/tolerance {raw.get('err_over_tol', float('nan')):.3g}"]
    if raw.get("why"):
        lines.append(f"  why: {raw['why']}")
    return "\n".join(lines)


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def check_target(path: str) -> None:
    """ParcompError (naming ``-o``) unless ``path`` can take the found spec: a new file in an
    existing directory, or an unchanged one ``--examples`` wrote."""
    check_own_file(path, HEADER, "parcomp check --examples")


def write_found(path: str, text: str) -> None:
    """Write the found spec to ``path`` with :data:`HEADER`, all or nothing (a temporary file,
    then one rename)."""
    write_own_file(path, text, HEADER, "parcomp check --examples")
    print(f"wrote {path}", file=sys.stderr)
