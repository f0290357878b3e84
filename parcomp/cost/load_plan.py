"""What loading the checkpoint costs each rank, for the compile report.

program.py reads only each rank's own slice of every parameter (the torch runtime's
loading section, backends/torch/runtime/program_loading.py): a parameter is read straight
into the tensor that is kept, so on CPU the host memory loading needs is the bytes
read; on an accelerator each slice passes through host memory once, one at a time.
A fused weight (``stored_shape``, viewed per part) is read whole.
"""
from __future__ import annotations

from ..ir.types import TensorType


def _full_bytes(program, node) -> int:
    """Bytes of a param's full (unsharded) tensor as the checkpoint stores it."""
    shape = node.attr("stored_shape") or node.attr("global_shape")
    if shape is None:
        shape = list(node.type.shape)
        for a, p in enumerate(node.layout):
            if hasattr(p, "dim"):
                shape[p.dim] *= program.mesh.sizes[a]
    return TensorType(tuple(shape), node.type.dtype).nbytes


def checkpoint_load(program, model_params) -> dict:
    """Per-rank load of the checkpoint of a :class:`parcomp.compile.program.Program`'s params
    named in ``model_params`` (optimizer state is not read from it). Bytes:

    ``bytes_read`` (this rank's slices), ``checkpoint_bytes`` (the whole checkpoint),
    ``largest_slice_bytes``; ``peak_host_bytes_cpu`` (params kept in host memory) and
    ``peak_host_bytes_accelerator`` (one slice at a time) are what loading adds to a
    rank's host memory.
    """
    graph = program.graph
    slices, full = [], 0
    for n in graph.params:
        if n.name not in model_params:
            continue
        whole = _full_bytes(program, n)
        full += whole
        slices.append(whole if n.attr("stored_shape") else n.type.nbytes)
    read = int(sum(slices))
    largest = int(max(slices, default=0))
    return {"bytes_read": read, "checkpoint_bytes": int(full), "largest_slice_bytes": largest,
            "peak_host_bytes_cpu": read, "peak_host_bytes_accelerator": largest}
