"""torch.distributed backend: emit a self-contained ``program.py`` for torchrun and launch it.

- :func:`emit_program` turns a :class:`parcomp.compiler.Compiled` into program text.
- :data:`PROFILES` holds the device profiles (``cpu``/gloo, ``cuda``/nccl, ``ascend``/hccl).
- :func:`run_torchrun` launches a program locally; :func:`assemble_outputs` reads its outputs.
"""
from .emit import EmitError, emit_program
from .launch import (assemble_outputs, free_port, run_torchrun, write_checkpoint, write_inputs,
                     write_program)
from .profiles import PROFILES, DeviceProfile, get_profile

__all__ = ["emit_program", "EmitError", "PROFILES", "DeviceProfile", "get_profile", "run_torchrun",
           "assemble_outputs", "free_port", "write_checkpoint", "write_inputs", "write_program"]
