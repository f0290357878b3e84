"""Functional collectives for ``program.py``: ``emit_program(..., functional=True)``.

The section below is pasted after the collectives of :mod:`.program_common` (and of
:mod:`.program_reduce`) and redefines them with ``torch.distributed._functional_collectives``:
each returns a new tensor and nothing is written in place, so ``torch.compile``
(``program.py --compile``) can capture a whole step, collectives included, and reorder it.
``wait_tensor`` marks where a value is needed; the started forms (``all_reduce_start``)
return the unwaited tensor, so the overlap the scheduler chose stays expressible.  Same
semantics as the in-place versions (groups in coordinate order, concatenation never sums).
"""
# flake8: noqa: E402,F403,F405 (program.py is one namespace: the common sections are in it)
import torch

from .program_common import *


# >>> program.py: functional
import torch.distributed._functional_collectives as funcol  # noqa: E402 - only in functional programs


def functional(new, old):
    """The function of ``torch.distributed._functional_collectives`` this torch has (``new``
    where it exists, else ``old``)."""
    return getattr(funcol, new, None) or getattr(funcol, old)


def all_reduce(x, axis, op="sum"):
    """P -> R: the sum (``op``) over the group of ``axis``, as a new tensor."""
    return funcol.wait_tensor(funcol.all_reduce(x, op, GROUPS[axis]))


def all_reduce_(x, axis):
    """Functional programs write nothing in place: the same as :func:`all_reduce`."""
    return all_reduce(x, axis)


def all_reduce_start(x, axis):
    """Start all_reduce(x, axis); ``wait(handle)`` returns the sum."""
    return funcol.all_reduce(x, "sum", GROUPS[axis])


all_reduce_start_ = all_reduce_start


def wait(handle):
    """The value of a started collective, once it has arrived (a gather or scatter along a dim
    other than 0 is moved back to it)."""
    if isinstance(handle, tuple):
        return funcol.wait_tensor(handle[0]).movedim(0, handle[1]).contiguous()
    return funcol.wait_tensor(handle)


def all_reduce_max(x, axis):
    """P(max) -> R: the elementwise max over the group of ``axis``."""
    return all_reduce(x, axis, "max")


def all_reduce_max_start(x, axis):
    """Start all_reduce_max(x, axis); ``wait(handle)`` returns the max."""
    return funcol.all_reduce(x, "max", GROUPS[axis])


all_reduce_max_, all_reduce_max_start_ = all_reduce_max, all_reduce_max_start


def all_gather(x, dim, axis):
    """S(dim) -> R: concatenate the group's shards along ``dim``, in coordinate order."""
    out = functional("all_gather_single", "all_gather_tensor")(x.movedim(dim, 0).contiguous(), 0, GROUPS[axis])
    return funcol.wait_tensor(out).movedim(0, dim).contiguous()


def all_gather_start(x, dim, axis):
    """Start all_gather(x, dim, axis); ``wait(handle)`` returns the gathered value."""
    out = functional("all_gather_single", "all_gather_tensor")(x.movedim(dim, 0).contiguous(), 0, GROUPS[axis])
    return out if dim == 0 else (out, dim)


def reduce_scatter_start(x, dim, axis):
    """Start reduce_scatter(x, dim, axis); ``wait(handle)`` returns this rank's chunk."""
    out = functional("reduce_scatter_single", "reduce_scatter_tensor")(
        x.movedim(dim, 0).contiguous(), "sum", 0, GROUPS[axis])
    return out if dim == 0 else (out, dim)


def reduce_scatter(x, dim, axis):
    """P -> S(dim): sum over the group, keep this rank's chunk of ``dim``."""
    out = functional("reduce_scatter_single", "reduce_scatter_tensor")(
        x.movedim(dim, 0).contiguous(), "sum", 0, GROUPS[axis])
    return funcol.wait_tensor(out).movedim(0, dim).contiguous()


def all_to_all(x, src_dim, dim, axis):
    """S(src_dim) -> S(dim): chunk j of ``dim`` goes to coordinate j; concatenate along ``src_dim``."""
    send = torch.stack(x.chunk(MESH[axis], dim))
    recv = funcol.wait_tensor(funcol.all_to_all_single(send, None, None, GROUPS[axis]))
    return torch.cat(recv.unbind(0), dim=src_dim)
# <<< program.py
