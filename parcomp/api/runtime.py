"""Running an emitted program.py in this process, on the user's process group.

The program's text is executed as a module (its ``__main__`` block does not run); its rank,
coordinates and device are set from ``torch.distributed`` and its process groups made by its
own :func:`make_groups`, the two programs of one module sharing them (one communicator per mesh
line). ``fail()`` in a program exits; here it becomes a :class:`ProgramError` with its message.
"""
from __future__ import annotations

import types

from ..errors import ParcompError


class ProgramError(ParcompError):
    """An emitted program refused its input (a shape or dtype that does not match the compile)."""


def load_program(text: str, name: str, device, line_groups: dict | None = None, timeout: int = 600):
    """Execute program.py ``text`` as module ``name`` bound to this rank: returns the module.

    ``line_groups`` is shared between the programs of one parallelized module, so their process
    groups are made once. torch.distributed must be initialised, with one rank per mesh rank.
    """
    import torch.distributed as dist

    mod = types.ModuleType(name)
    mod.__dict__["__file__"] = f"<{name}>"
    exec(compile(text, f"<{name}>", "exec"), mod.__dict__)  # noqa: S102 - parcomp's own emitted program
    if not dist.is_available() or not dist.is_initialized():
        raise ParcompError("parcomp.parallelize needs torch.distributed initialised (run under torchrun "
                           "and call torch.distributed.init_process_group first)")
    world = dist.get_world_size()
    if world != mod.MESH_SIZE:
        raise ParcompError(f"the spec's mesh {mod.MESH_TEXT} has {mod.MESH_SIZE} ranks but the process group "
                           f"has {world}; start {mod.MESH_SIZE} processes (torchrun --nproc-per-node "
                           f"{mod.MESH_SIZE}) or change the mesh")
    mod.RANK, mod.WORLD_SIZE = dist.get_rank(), world
    mod.COORD = mod.mesh_coords(mod.RANK)
    mod.DEVICE = device
    if line_groups is not None:
        mod.LINE_GROUPS = line_groups
    call(mod, "make_groups", timeout)
    return mod


def call(mod, fn: str, *args):
    """``mod.fn(*args)``; a ``fail()`` inside becomes :class:`ProgramError` with its message."""
    try:
        return getattr(mod, fn)(*args)
    except SystemExit as e:
        message = mod.FAILED[-1] if mod.FAILED else f"{fn} exited with {e.code}"
        raise ProgramError(message) from None
