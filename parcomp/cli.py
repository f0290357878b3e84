"""The ``parcomp`` command: compile, check, run.

Every user error (:class:`parcomp.errors.ParcompError`) is printed as a located
message and exits with status 2; output directories are written atomically
(a temporary directory renamed into place), so a failed compile leaves nothing.
With ``--json`` the last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys

from .errors import ParcompError

TARGETS = ("torch", "ascend", "reference")


def _common(p):
    p.add_argument("model", help="a .pcir file, FILE.py:FACTORY or package.module:factory")
    p.add_argument("--spec", required=True, help="the parallel spec (.pcs)")
    p.add_argument("--json", action="store_true", help="end with one JSON line")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``parcomp compile | check | run``."""
    ap = argparse.ArgumentParser(prog="parcomp", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile", help="write program.py, report.json and sharded.pcir")
    _common(c)
    c.add_argument("--target", choices=TARGETS, default="torch")
    c.add_argument("--profile", default=None, help="device profile: cpu | cuda | ascend")
    c.add_argument("-o", "--out", required=True, help="output directory (replaced atomically)")
    c.add_argument("--print-ir-after-all", action="store_true")
    k = sub.add_parser("check", help="run every rank in the numpy interpreter, compare with unsharded")
    _common(k)
    k.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run", help="launch the torch program on N local gloo ranks, compare")
    _common(r)
    r.add_argument("--nproc", type=int, required=True)
    r.add_argument("--profile", default="cpu")
    r.add_argument("--keep", default=None, help="keep the compiled program in this directory")
    r.add_argument("--steps", type=int, default=None, help="training steps (default: the spec's)")
    return ap


def main(argv=None) -> int:
    """Run the command line ``argv``; returns the exit status (0 ok, 1 mismatch, 2 user error)."""
    args = build_parser().parse_args(argv)
    from . import commands

    try:
        result = getattr(commands, args.cmd)(args)
    except ParcompError as e:
        print(e.render(), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if args.json and result is not None:
        print(json.dumps(result, sort_keys=True))
    return 0 if result is None or result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
