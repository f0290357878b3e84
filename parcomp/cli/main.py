"""The ``parcomp`` command: compile, check, run.

Every user error (:class:`parcomp.errors.ParcompError`, a bad command line, a
file that cannot be written) is printed as a located message and exits with
status 2, never a traceback.  Output directories are written all or nothing,
and parcomp replaces only files it wrote there (see :mod:`parcomp.outdir`).
With ``--json`` the last line printed is one JSON object, also on failure:
``{"ok": false, "error": MESSAGE, "where": "file:line:col" or the thing named, "kind": ...}``.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from ..errors import ParcompError

TARGETS = ("torch", "ascend", "reference")


class UsageError(Exception):
    """A command line argparse rejects (exit 2)."""

    def __init__(self, message: str, usage: str, prog: str):
        super().__init__(message)
        self.message, self.usage, self.prog = message, usage, prog


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is raised (so ``--json`` can report it), not printed and exited."""

    def error(self, message):
        raise UsageError(message, self.format_usage(), self.prog)


def _count(least: int):
    """An argparse type: a whole number >= ``least``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"give a whole number >= {least}, not {text!r}")
        return value
    parse.__name__ = f"whole number >= {least}"
    return parse


def _common(p, spec_required: bool = True):
    p.add_argument("model", help="a .pcir or .onnx file, FILE.py:FACTORY or package.module:factory")
    p.add_argument("--spec", required=spec_required,
                   help="the parallel spec (.pcs)" + ("" if spec_required else "; with --examples, its mesh"))
    p.add_argument("--json", action="store_true", help="end with one JSON line")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``parcomp compile | check | run | export | explain`` (errors raise :class:`UsageError`)."""
    ap = _Parser(prog="parcomp", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile", help="write program.py, report.json and sharded.pcir")
    _common(c)
    c.add_argument("--target", choices=TARGETS, default="torch")
    c.add_argument("--profile", default=None, help="device profile: cpu | cuda | ascend")
    c.add_argument("-o", "--out", required=True,
                   help="output directory (parcomp's files replaced all or nothing; others kept)")
    c.add_argument("--print-ir-after-all", action="store_true")
    c.add_argument("--functional-collectives", action="store_true",
                   help="program.py uses functional collectives, so its --compile captures whole steps")
    k = sub.add_parser("check", help="run every rank in the numpy interpreter, compare with unsharded")
    _common(k, spec_required=False)
    k.add_argument("--seed", type=_count(0), default=0)
    k.add_argument("--steps", type=int, default=None, help="training steps (default: the spec's)")
    k.add_argument("--examples", type=_count(1), default=None,
                   help="draw N specs (parcomp.testing's search), check each, print the smallest failing one")
    k.add_argument("-o", "--out", default=None, help="with --examples: write the smallest failing spec here")
    pl = sub.add_parser("plan", help="choose every layout for a mesh and write it as a spec")
    pl.add_argument("model", help="a .pcir file, FILE.py:FACTORY or package.module:factory")
    pl.add_argument("--mesh", required=True, help="axis sizes, such as dp=2,tp=4")
    pl.add_argument("--memory", default=None, help="memory per device, such as 80GiB")
    pl.add_argument("--train", default=None, help="a train line, such as 'train loss=mse'")
    pl.add_argument("--seconds", type=float, default=None,
                    help="time budget of the exact search, seconds (default 300, a safety net: a node budget decides first); past it, the best plan found")
    pl.add_argument("-o", "--out", required=True, help="the spec file to write (.pcs)")
    pl.add_argument("--json", action="store_true", help="end with one JSON line")
    r = sub.add_parser("run", help="launch the torch program on N local gloo ranks, compare")
    _common(r)
    r.add_argument("--nproc", type=_count(1), required=True)
    r.add_argument("--profile", default="cpu")
    r.add_argument("--keep", default=None, help="keep the compiled program in this directory")
    r.add_argument("--steps", type=int, default=None, help="training steps (default: the spec's)")
    x = sub.add_parser("export", help="a saved training checkpoint as a from_pretrained directory")
    _common(x)
    x.add_argument("checkpoint", help="program.py --save's directory (its latest step) or one step-K in it")
    x.add_argument("-o", "--out", required=True, help="the directory to write (new, empty, or an earlier export's)")
    e = sub.add_parser("explain", help="each collective, why, its cost and the alternatives; no run")
    e.add_argument("model", help="a .pcir file, FILE.py:FACTORY or package.module:factory")
    e.add_argument("specs", nargs="*", help="specs (.pcs); two or more are set side by side")
    e.add_argument("--spec", action="append", help="a spec (.pcs); may be repeated")
    e.add_argument("--json", action="store_true", help="end with one JSON line")
    e.add_argument("--plots", default=None, help="write SVG pictures and a Chrome trace to this directory")
    return ap


def check_flags(args) -> None:
    """The numeric flags argparse's types leave unbounded (``--steps``, ``--seconds``), checked
    before any model is loaded or compiled: a bad flag costs no compile.

    Raises:
        ParcompError: naming the flag.
    """
    if getattr(args, "steps", None) is not None:
        from ..spec.train_config import check_steps

        check_steps(args.steps)
    if getattr(args, "seconds", None) is not None:
        from ..plan.planner import check_seconds

        check_seconds(args.seconds)


def _check_usage() -> tuple:
    """``(usage, prog)`` of ``parcomp check``, for a :class:`UsageError` argparse cannot raise."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    k = sub.choices["check"]
    return k.format_usage(), k.prog


def _fail_json(kind: str, message: str, where) -> None:
    print(json.dumps({"ok": False, "error": message, "where": where, "kind": kind}, sort_keys=True))


def main(argv=None) -> int:
    """Run the command line ``argv``; returns the exit status (0 ok, 1 mismatch, 2 user error,
    130 interrupted).  With ``--json`` the last stdout line is the result, or the error."""
    argv = sys.argv[1:] if argv is None else list(argv)
    want_json = "--json" in argv
    try:
        args = build_parser().parse_args(argv)
        if args.cmd == "check" and args.spec is None and args.examples is None:
            raise UsageError("check needs --spec FILE (or --examples N to draw specs)", *_check_usage())
        if args.cmd == "check" and args.out is not None and args.examples is None:
            raise UsageError("check -o/--out writes the smallest failing spec of --examples N; give --examples",
                             *_check_usage())
    except UsageError as e:
        print(f"{e.usage}{e.prog}: error: {e.message}", file=sys.stderr)
        if want_json:
            _fail_json("UsageError", e.message, "command line")
        return 2
    from . import commands

    try:
        # overflow and 0/0 in the interpreter are reported by the comparison (inf/NaN is never
        # OK), so numpy's RuntimeWarnings would only repeat it as noise with a source line
        check_flags(args)
        with np.errstate(all="ignore"):
            result = getattr(commands, args.cmd)(args)
    except ParcompError as e:
        print(e.render(), file=sys.stderr)
        if args.json:
            _fail_json(type(e).__name__, e.message, e.where)
        return 2
    except OSError as e:  # reading or writing a file the user named, outside parcomp's checks
        where = e.filename if isinstance(e.filename, str) else None
        msg = f"{e.strerror or e}" + (f": {where}" if where else "")
        print(f"error: {msg}", file=sys.stderr)
        if args.json:
            _fail_json("OSError", msg, where)
        return 2
    except KeyboardInterrupt:
        if args.json:
            _fail_json("KeyboardInterrupt", "interrupted", None)
        return 130
    except Exception as e:  # a bug in parcomp: keep the traceback, but end the JSON stream
        if args.json:
            _fail_json("InternalError", f"internal error: {type(e).__name__}: {e}", None)
        raise
    if args.json and result is not None:
        print(json.dumps(result, sort_keys=True))
    return 0 if result is None or result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
