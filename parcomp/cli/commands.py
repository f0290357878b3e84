"""The bodies of ``parcomp compile | check | run | export | explain | plan`` (argument parsing is in
:mod:`parcomp.cli.main`, which calls ``getattr(commands, args.cmd)``).

The bodies live in :mod:`parcomp.cli.check_cmd`, :mod:`parcomp.cli.run_cmd` and
:mod:`parcomp.cli.compile_cmd` (compile, export, explain, plan), what they share in
:mod:`parcomp.cli.common`; this module gathers them under the names callers import.
"""
from __future__ import annotations

from .check_cmd import steps_to_check, check_training, forward_check, print_training, check  # noqa: F401
from .common import (NO_NUMPY_DTYPES, compile_model, file_report, is_torch_module, print_result,  # noqa: F401
                              reference_module, short_losses, collective_summary, training_feeds, vs_tolerance, feeds_for,
                              print_kept, print_warnings, program_files, reference_outputs, require_finite,
                              require_numpy_dtypes)
from .compile_cmd import compile, explain, export, plan  # noqa: F401, A004 - the subcommands' names
from .run_cmd import (RUN_FILES, checkpoint_file, end_work, launch_run, print_run_training,  # noqa: F401
                           run_files, run_training, write_work, run)
# what this module imported before the split and callers use through it
from ..check.differential import verdict  # noqa: F401
from ..check.train_check import train_feeds  # noqa: F401
from ..frontends.loader import load_model  # noqa: F401
from ..outdir import MARKER  # noqa: F401 - part of this module's API
from ..reference.numpy_ops import run_unsharded  # noqa: F401
