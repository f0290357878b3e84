"""Torch emitter rows of the norms + embedding part.

:data:`NORM_FORMATS` joins :data:`parcomp_backends.torch.emit.OP_FORMATS`;
:func:`norm_kw` gives the extra format fields a node needs (its operands as arguments,
and for dropout / vocab-parallel embedding where this rank's block lies, as expressions
of ``COORD``); :func:`runtime_sections` the helpers (``program_norms.py``) a program needs.
"""
from __future__ import annotations

from parcomp.ir.types import shard_axes

from ..runtime import sections

NORM_FORMATS = {
    "layer_norm": "torch.nn.functional.layer_norm({norm_args})",
    "rms_norm": "torch.nn.functional.rms_norm({norm_args})",
    "layer_norm_grad": "norm_grad({grad_args}, rms=False)",
    "rms_norm_grad": "norm_grad({grad_args}, rms=True)",
    "dropout": "dropout_by_index({0}, {p}, {seed}, {index_shape}, {index_start}{step})",
    "embedding": "embedding_rows({0}, {1}, {vocab_start})",
    "embedding_grad": "embedding_grad_rows({0}, {1}, {rows}, {vocab_start}{padding})",
    # lowered (parcomp/passes/lowering/bucket.py)
    "bucket_cat": "torch.cat([{flat_args}])",
    "bucket_part": "{0}.narrow(0, {offset}, {numel}).view({local_shape})",
}
NEEDS_RUNTIME = ("layer_norm_grad", "rms_norm_grad", "dropout", "embedding", "embedding_grad")
NORM_RUNTIME = sections("program_norms")["norms"]
HELPER_NAMES = ("M32", "mul32", "mix32", "dropout_keep", "dropout_by_index", "norm_grad",
                "embedding_rows", "embedding_grad_rows")


def _global_shape(program, node) -> tuple:
    shape = list(node.type.shape)
    for a, p in enumerate((node.layout or ()) if program is not None else ()):
        if hasattr(p, "dim"):
            shape[p.dim] *= program.mesh.sizes[a]
    return tuple(shape)


def block_start(program, node, d) -> str:
    """The expression of where dim ``d`` of this rank's block of ``node`` starts."""
    axes = shard_axes(node.layout, d) if program is not None and node.layout else ()
    if not axes:
        return "0"
    index = None
    for a in axes:  # the first mesh axis is the outer one (parcomp.ir.types.shard_offsets)
        size = program.mesh.sizes[a]
        index = f"COORD[{a}]" if index is None else f"({index}) * {size} + COORD[{a}]"
    return f"{f'({index})' if '+' in index else index} * {node.type.shape[d]}"


def norm_kw(program, n, args) -> dict:
    """Extra ``str.format`` fields of node ``n`` (operand variables ``args``) of local ``program``
    (None: an unsharded node, every block starting at 0)."""
    if n.op not in NORM_FORMATS:
        return {}
    eps = repr(float(n.attr("eps", 0.0)))
    if n.op in ("layer_norm", "rms_norm"):
        names = ("weight", "bias")
        extra = "".join(f", {k}={v}" for k, v in zip(names, args[1:]))
        return {"norm_args": f"{args[0]}, ({n.type.shape[-1]},){extra}, eps={eps}"}
    if n.op in ("layer_norm_grad", "rms_norm_grad"):
        return {"grad_args": f"{args[0]}, {args[1]}, {args[2] if len(args) > 2 else None}, {eps}"}
    if n.op == "dropout":
        starts = ", ".join(block_start(program, n, d) for d in range(n.type.rank))
        return {"index_shape": repr(_global_shape(program, n)),
                "index_start": f"({starts}{',' if n.type.rank == 1 else ''})",
                "step": f", step={args[1]}" if len(args) > 1 else ""}
    if n.op == "bucket_cat":
        return {"flat_args": ", ".join(f"{a}.reshape(-1)" for a in args)}
    if n.op == "embedding":
        return {"vocab_start": block_start(program, program[n.inputs[1]], 0) if program is not None else "0"}
    if n.op == "embedding_grad":
        pad = n.attr("padding_idx")
        return {"vocab_start": block_start(program, n, 0), "rows": str(n.type.shape[0]),
                "padding": "" if pad is None else f", padding_idx={int(pad)}"}
    return {}


def runtime_sections(program) -> list:
    """``[helpers text]`` if ``program`` uses an op whose format calls them, else ``[]``."""
    return [NORM_RUNTIME] if any(n.op in NEEDS_RUNTIME for n in program.nodes) else []
