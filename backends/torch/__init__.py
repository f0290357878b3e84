"""torch.distributed backend: emit a self-contained ``program.py`` for torchrun and launch it.

- :func:`emit_program` turns a :class:`parcomp.compile.compiler.Compiled` into program text.
- :data:`PROFILES` holds the device profiles (``cpu``/gloo, ``cuda``/nccl, ``ascend``/hccl).
- :func:`run_torchrun` launches a program locally; :func:`assemble_outputs` reads its outputs.
- A training program (``train_step`` in a loop, see :func:`training_facts`) also writes every
  step's loss: :func:`assemble_training_outputs` returns ``(outputs, losses)``.
"""
from .emit import EmitError, Training, emit_program, training_facts
from .launch import (assemble_outputs, assemble_training_outputs, free_port, read_losses, run_torchrun,
                     write_checkpoint, write_inputs, write_program)
from .profiles import PROFILES, DeviceProfile, get_profile

__all__ = ["emit_program", "EmitError", "PROFILES", "DeviceProfile", "get_profile", "run_torchrun",
           "assemble_outputs", "free_port", "write_checkpoint", "write_inputs", "write_program",
           "Training", "training_facts", "assemble_training_outputs", "read_losses"]
