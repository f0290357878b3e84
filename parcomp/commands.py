"""The bodies of ``parcomp compile | check | run | export | explain | plan`` (argument parsing is in
:mod:`parcomp.cli`, which calls ``getattr(commands, args.cmd)``).

The bodies live in :mod:`parcomp.commands_check`, :mod:`parcomp.commands_run` and
:mod:`parcomp.commands_compile` (compile, export, explain, plan), what they share in
:mod:`parcomp.commands_common`; this module gathers them under the names callers import.
"""
from __future__ import annotations

from .commands_common import (NO_NUMPY_DTYPES, _compile, _file_report, _is_torch, _print_result,  # noqa: F401
                              _reference, _short_losses, _summary, _train_feeds, _vs_tolerance, feeds_for,
                              print_kept, print_warnings, program_files, reference_outputs, require_finite,
                              require_numpy_dtypes)
from .commands_check import _check_steps, _check_training, _forward_check, _print_training, check  # noqa: F401
from .commands_run import (RUN_FILES, _checkpoint, _end_work, _launch, _print_run_training,  # noqa: F401
                           _run_files, _run_training, _write_work, run)
from .commands_compile import compile, explain, export, plan  # noqa: F401, A004 - the subcommands' names
# what this module imported before the split and callers use through it
from .frontends.loader import load_model  # noqa: F401
from .outdir import MARKER  # noqa: F401 - part of this module's API
from .reference.numpy_ops import run_unsharded  # noqa: F401
from .differential import verdict  # noqa: F401
from .train_check import train_feeds  # noqa: F401
