"""Where a context-parallel rank's query rows start (issue 14).

A causal ``sdpa`` / ``sdpa_grad`` marked ``cp`` (``parcomp/passes/ctxpar.py``) may run on a
block of the query rows; its causal mask must then be taken at the block's global row offset.
:func:`at_rank` gives such a node ``q_start`` (read by
:func:`parcomp.reference.numpy_attn.attention_probs`), the interpreter and the per-rank error
bounds both call it through :func:`parcomp.reference.ranked.at_rank`.
"""
from __future__ import annotations

from ..ir.types import shard_offsets

#: the operand holding q, per op
Q_OPERAND = {"sdpa": 0, "sdpa_grad": 1}
SEQ = 2


def needs_q_start(node) -> bool:
    """Whether ``node`` is a causal context-parallel sdpa / sdpa_grad."""
    return node.op in Q_OPERAND and bool(node.attr("cp")) and node.attr("causal", False)


def q_start(program, node, coords) -> int:
    """The global row where the block of q that mesh ``coords`` holds starts (0 unsplit)."""
    q = program[node.inputs[Q_OPERAND[node.op]]]
    if q.layout is None:
        return 0
    shape = list(q.type.shape)
    for a, p in enumerate(q.layout):
        if getattr(p, "dim", None) is not None:
            shape[p.dim] *= program.mesh.sizes[a]
    return int(shard_offsets(q.type.with_shape(tuple(shape)), q.layout, program.mesh, coords)[SEQ][0])


def at_rank(program, node, rank: int):
    """``node`` of local ``program`` with ``q_start`` for mesh rank ``rank`` (others unchanged)."""
    if not needs_q_start(node) or program.mesh is None:
        return node
    return node.with_attrs(q_start=q_start(program, node, program.mesh.coords(rank)))
