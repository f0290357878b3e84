"""The fixed parts of every emitted ``program.py``, pasted from real modules.

The runtime is Python in :mod:`.program_common` (process facts, collectives,
loading, the world check, ``main``), :mod:`.program_loading` (checkpoints: each
rank reads only its own bytes), :mod:`.program_forward` and
:mod:`.program_train` (outputs, argument parsing, ``run`` / the training loop).
Each marks what program.py holds with ``# >>> program.py: NAME`` ...
``# <<< program.py``; this module pastes those sections (read as text, so
emitting needs no torch) into :data:`RUNTIME` and :data:`MAIN` (after the runtime line that
follows the generated constants, loaders and ``forward``), or :data:`TRAIN_RUNTIME` and
:data:`TRAIN_MAIN` for a training program.  The same files give the same bytes.

The sections use only names the emitter defines: ``MESH``, ``GROUP_RANKS``,
``PARAMS``, ``INPUTS``, ``OUTPUT_LAYOUTS``, ``OUTPUT_GLOBAL_SHAPES``,
``SHARDED_OUTPUT``, ``RUN_HINT``, ``PROFILE``, ``DIST_BACKEND``, ``PRELUDE``,
``profile_device``, ``load_params``, ``load_inputs``, ``forward``, and for the cluster
section (:mod:`.program_cluster`) ``COMM_AXES``, ``HOST_AXES``, ``PLACEMENT``, ``TIMEOUT_S``,
``TOPOLOGY``, ``LAUNCH_ENV``, ``BIND_DEVICE_ID``; a training
program's also ``STATE``, ``CARRIED``, ``STEP_INPUT``, ``TRAIN_STEPS``,
``MAX_STEPS`` and ``train_step``.
"""
from __future__ import annotations

import os
import re

_HERE = os.path.dirname(os.path.abspath(__file__))
_SECTION = re.compile(r"^# >>> program\.py: (\w+)\n(.*?)\n# <<< program\.py$", re.M | re.S)


def sections(module: str) -> dict:
    """``{name: source text}`` of the marked sections of ``backends/torch/runtime/<module>.py``."""
    with open(os.path.join(_HERE, module + ".py"), encoding="utf-8") as f:
        return {m.group(1): m.group(2) for m in _SECTION.finditer(f.read())}


# ---- the header: imports and the option lines of the docstring ({out}: where outputs go) ----
IMPORTS = """\
import argparse
import datetime
import importlib
import json
import math
import os
import shlex
import signal
import socket
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist"""

# the option lines of the module docstring; {out}: where the outputs go
FORWARD_HELP = """\
--checkpoint  .safetensors, torch state_dict (.pt), or transformers' sharded layout (a directory
              or model.safetensors.index.json) with the full (unsharded) parameters; each rank
              reads only its own slices (docs/deploy.md, "Loading checkpoints")
--key-map     PARAM_PREFIX=KEY_PREFIX,...: checkpoint keys that differ from the param names
--load-report FILE: each rank writes its load (bytes read, peak memory) to FILE.rank{{r}}.json
--input       .pt or .safetensors dict {{input name: full tensor}} (or one tensor: one input)
--output      {out}
--device cpu  run on CPU with gloo whatever the profile (see the PROFILE block)
--bench N     N warm-up + N timed forward steps; rank 0 prints {{"step_ms": [...]}}
{cluster}\
"""

TRAIN_HELP = """\
--checkpoint  .safetensors, torch state_dict (.pt), or transformers' sharded layout (a directory
              or model.safetensors.index.json) with the full (unsharded) parameters; each rank
              reads only its own slices; optimizer state starts at zeros
--key-map     PARAM_PREFIX=KEY_PREFIX,...: checkpoint keys that differ from the param names
--load-report FILE: each rank writes its load (bytes read, peak memory) to FILE.rank{{r}}.json
--input       .pt dict {{input name: full tensor}} used by every step, or a list of one such
              dict per step (.safetensors: one dict)
--steps K     train steps k = 1..K (default {steps}){step}; rank 0 prints "step k loss L"
--train-steps N  train until step N, a resumed run's saved steps counted: a requeued job's same
              command with --resume ends at step N (at or past it: exits 0)
--output      the last step's outputs, and "losses": [loss of every step] in the file(s):
              {out}
--device cpu  run on CPU with gloo whatever the profile (see the PROFILE block)
--bench N     N warm-up + N timed training steps (not applied); rank 0 prints {{"step_ms": [...]}}
--log-every N rank 0 prints the loss of every N-th step and the last; losses stay on the device
{cluster}\
"""

# the option lines every program has (the cluster section, :mod:`.program_cluster`)
CLUSTER_HELP = """\
--compile     run the step under torch.compile
--timeout S   seconds a collective may wait (default: TIMEOUT_S below)
--placement   refuse (default: PLACEMENT below) or warn when a tp group spans hosts
--print-launch [NODESxDEVICES]  print each node's environment and torchrun line, then exit\
"""


def _join(*chunks) -> str:
    """Chunks of program text, two blank lines apart."""
    return "\n\n\n".join(chunks)


_COMMON, _FORWARD, _TRAIN = sections("program_common"), sections("program_forward"), sections("program_train")
_LOADING = sections("program_loading")["loading"]  # checkpoint loading: each rank reads its own bytes
_CLUSTER = _join(*sections("program_cluster").values())  # "timeout" is pasted alone too (pipeline_emit)
RUNTIME = _join(_COMMON["process"], _COMMON["read_inputs"], _COMMON["take_place"], _LOADING)
MAIN = _join(_COMMON["rank_path"], _FORWARD["write_outputs"], _COMMON["sync"], _COMMON["bench"],
             _FORWARD["parse_args"], _COMMON["world"], _CLUSTER, _FORWARD["run"], _COMMON["main"],
             _COMMON["entry"])
TRAIN_RUNTIME = _join(_COMMON["process"], _COMMON["take_place"], _LOADING, _TRAIN["updates"])
FUNCTIONAL = sections("program_functional")["functional"]  # emit_program(functional=True)
CONSTANT_LOADER = _COMMON["constants"]  # a program with params computed at import (constants.safetensors)
TIED_LOADER = _COMMON["tied"]  # a program with tied weights (param attr ``aliases``)
ONNX_READER = _COMMON["onnx"]  # appended to the runtime of a program compiled from an .onnx file
TRAIN_MAIN = _join(_COMMON["rank_path"], _TRAIN["write_outputs"], _COMMON["sync"], _COMMON["bench"],
                   _TRAIN["step_count"], _TRAIN["input_args"], _TRAIN["parse_args"], _COMMON["world"], _CLUSTER,
                   _TRAIN["data"], _TRAIN["checkpoint"], _TRAIN["checkpoint_checks"], _TRAIN["resume"],
                   _TRAIN["loop"], _TRAIN["replay"], _TRAIN["stop"], _TRAIN["run"], _COMMON["main"],
                   _COMMON["entry"])
