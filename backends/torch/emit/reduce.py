"""The torch emitter's rows for the reductions part, merged into ``emit.OP_FORMATS``.

``{start}`` is the global index of this rank's first element along the dim a ranked op
indexes (``pick``, ``argmax_key``, ``mask_pad``), written from ``COORD`` like a parameter's
slice; ops with a runtime helper pull the ``reductions`` section of
:mod:`parcomp_backends.torch.runtime.program_reduce` into the program (only programs that use one).
"""
from __future__ import annotations

from parcomp.ir.ops import OPS, RANKED_OPS, index_dim
from parcomp.ir.types import shard_axes

from ..runtime import sections

REDUCE_FORMATS = {
    "log": "torch.log({0})",
    "amax": "torch.amax({0}, dim={dims})",
    "amax_grad": "amax_grad({0}, {1}, {2}, {dims})",
    "argmax": "torch.argmax({0}, dim={dim})",
    "argmax_key": "argmax_key({0}, {dim}, {start})",
    "argmax_index": "argmax_index({0})",
    "mean": "torch.mean({0}, dim={dims})",
    "softmax": "torch.softmax({0}, dim={dim})",
    "log_softmax": "torch.log_softmax({0}, dim={dim})",
    "pick": "pick({0}, {1}, {start}, {ignore_index})",
    "pick_grad": "pick_grad({0}, {1}, {local_shape}, {start}, {ignore_index})",
    "label_mask": "({0} != {ignore_index}).to({dtype})",
    "mask_pad": "mask_pad({0}, {size}, {start}, {fill})",
    "topk": "torch.topk({0}, {k}, dim={dim}).values",  # torch's tie order: the model's own
    "topk_index": "torch.topk({0}, {k}, dim={dim}).indices",
    "take_along": "torch.gather({0}, {dim}, {1})",
    "put_along": "put_along({0}, {1}, {dim}, {size})",
    "all_reduce_max": "all_reduce_max({0}, {axis})",
    "partial_mask_max": "{0}",  # R -> P(max): every rank keeps the value
}
IN_PLACE_REDUCE = {"all_reduce_max": "all_reduce_max_({0}, {axis})"}
ASYNC_REDUCE = {"all_reduce_max": "all_reduce_max_start({0}, {axis})",
                "all_reduce_max_": "all_reduce_max_start_({0}, {axis})"}
_HELPERS = ("amax_grad", "argmax_key", "argmax_index", "pick", "pick_grad", "mask_pad", "put_along")
HELPER_NAMES = ("all_reduce_max", "all_reduce_max_", "all_reduce_max_start", "all_reduce_max_start_",
                "ARGMAX_LOW", "_pick_cols") + _HELPERS


def reduce_key(n) -> str:
    """The format key of node ``n``: ``all_reduce_max`` / ``partial_mask_max`` for a P(max)."""
    return n.op + ("_max" if n.attr("reduce_op") == "max" else "")


def _start(program, n) -> str:
    if program is None or n.op not in RANKED_OPS or program.mesh is None:
        return "0"
    ty, layout, d = index_dim(program, n)
    index = None
    for a in shard_axes(layout, d):  # first mesh axis outer (parcomp.ir.types.shard_offsets)
        index = f"COORD[{a}]" if index is None else f"({index}) * {program.mesh.sizes[a]} + COORD[{a}]"
    return "0" if index is None else f"({index}) * {ty.shape[d]}"


def reduce_kw(program, n, py) -> dict:
    """Extra format fields of ``n``: ``start`` and its attributes' declared defaults."""
    if n.op not in REDUCE_FORMATS and reduce_key(n) not in REDUCE_FORMATS:
        return {}
    kw = {k: py(a.default) for k, a in OPS[n.op].attrs.items()  # {dtype}: the emitter's torch dtype
          if a.default is not None and k not in dict(n.attrs) and k != "dtype"}
    kw["start"] = _start(program, n)
    return kw


def reduce_sections(program) -> list:
    """The runtime section of :mod:`parcomp_backends.torch.runtime.program_reduce` if ``program`` uses one of its helpers."""
    used = any(n.op in _HELPERS or (n.op == "all_reduce" and n.attr("reduce_op") == "max")
               for n in program.nodes)
    return [sections("program_reduce")["reductions"]] if used else []
