"""The float64 re-check: what ``parcomp check`` does when the model's own dtype cannot vouch.

A sound worst-case error bound compounds through a deep model: in float32 each layer norm
and each matmul multiplies the elementwise bound (|W| e sums errors that real rounding
mostly cancels), and after two transformer blocks it can exceed the output itself
(docs/design.md, "Resolution"). Such a bound cannot tell a wrong collective from rounding,
so the float32 verdict is CANNOT VOUCH. The sharding itself (which collective, which
layout, which rank holds what) does not depend on the dtype, so ``check`` then runs the
same compiled programs with every float value promoted to float64 (u = 2**-53 instead of
2**-24: the same bound, 2**29 times smaller) against the unsharded run of the same graph in
float64 (not the torch module: a model's explicit float32 casts, Llama's RoPE, stay float32
in torch), and vouches for the program's arithmetic there. A sharding bug is a MISMATCH in float64 as in float32; what float64 cannot vouch
for is float32 rounding, which is the same everywhere and not the compiler's.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

WIDE = "float64"


def _wide(t):
    return replace(t, dtype=WIDE) if t.dtype.startswith(("float", "bfloat")) and t.dtype != WIDE else t


def promote_graph(graph):
    """``graph`` with every floating-point value's type (and a ``type`` attr) made float64."""
    def node(n):
        attrs = tuple((k, _wide(v) if k == "type" and hasattr(v, "dtype") else v) for k, v in n.attrs)
        return replace(n, type=_wide(n.type), attrs=attrs)
    return graph.with_nodes([node(n) for n in graph.nodes])


def promote_compiled(compiled):
    """A :class:`parcomp.compiler.Compiled` whose graphs compute in float64 (same layouts,
    same collectives, same report)."""
    return replace(compiled, unsharded=promote_graph(compiled.unsharded),
                   logical=promote_graph(compiled.logical), sharded=promote_graph(compiled.sharded),
                   program=promote_graph(compiled.program))


def promote_feeds(feeds: dict) -> dict:
    """Float arrays as float64; integer and bool arrays (ids, labels) unchanged."""
    return {k: np.asarray(v, np.float64) if np.asarray(v).dtype.kind == "f" else v for k, v in feeds.items()}


NOTE = ("the {dtype} error bound cannot resolve a 10% error here (max abs error {err:.3e} against the "
        "reference in {dtype}; {why}); checked against the unsharded run in float64, where it can: the "
        "sharding is vouched for, {dtype} rounding is not the compiler's")
NOTE_MISMATCH = ("the {dtype} error bound cannot resolve a 10% error here (max abs error {err:.3e} against the "
                 "reference in {dtype}; {why}); re-checked against the unsharded run in float64, where the "
                 "bound resolves: the difference there is beyond rounding")


def run_precision(compiled) -> str:
    """The precision the checked run computes in, as the NOTE names it: ``float16 mixed
    precision`` / ``bfloat16 mixed precision`` for ``train ... precision=fp16|bf16``, else the
    least precise float dtype of the unsharded graph (``float32`` for most models)."""
    from .rules.error import unit_roundoff

    opts = ((compiled.report.get("training") or {}).get("options") or {})
    if opts.get("precision", "fp32") != "fp32":
        return f"{opts['compute_dtype']} mixed precision"
    floats = {n.type.dtype for n in compiled.unsharded.nodes if unit_roundoff(n.type.dtype) > 0}
    return max(floats, key=unit_roundoff, default="float32")
