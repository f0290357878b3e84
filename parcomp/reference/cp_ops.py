"""Where a context-parallel rank's query rows start.

A causal ``sdpa`` / ``sdpa_grad`` marked ``cp`` (``parcomp/passes/attention/ctxpar.py``) may run on a
block of the query rows; its causal mask must then be taken at the block's global row offset.
:func:`at_rank` gives such a node ``q_start`` (read by
:func:`parcomp.reference.numpy_attn.attention_probs`), the interpreter and the per-rank error
bounds both call it through :func:`parcomp.reference.ranked.at_rank`.
"""
from __future__ import annotations

import numpy as np

from ..ir.types import shard_offsets
from .cp_ring import storage_order

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
    """``node`` of local ``program`` with ``q_start`` for mesh rank ``rank`` (others unchanged).
    Balanced chunking (parcomp/passes/attention/cp_balance.py): a marked ``arange`` gets ``storage=True``
    (positions in storage order), a marked sdpa ``balanced_mask=True`` (mask by positions); an
    unsharded run (no ``at_rank``) keeps the natural order."""
    if node.op == "arange" and node.attr("balanced"):
        return node.with_attrs(storage=True)
    if not needs_q_start(node) or program.mesh is None:
        return node
    node = node.with_attrs(q_start=q_start(program, node, program.mesh.coords(rank)))
    return node.with_attrs(balanced_mask=True) if node.attr("chunking") == "balanced" else node


def causal_keep(node, sq: int, sk: int) -> np.ndarray:
    """[sq, sk] bool: key j kept for local query row i. Contiguous: ``j <= q_start + i``;
    ``balanced_mask``: by the global positions of storage rows (k whole, in storage order).
    A sliding ``window`` w > 0 keeps only the last w of those: ``j > q_start + i - w``."""
    w, start = node.attr("window", 0), node.attr("q_start", 0)
    if not node.attr("balanced_mask"):
        keep = np.tril(np.ones((sq, sk), bool), start)
        return keep & ~np.tril(np.ones((sq, sk), bool), start - w) if w else keep
    order = storage_order(node.attr("cp_size"), sk)
    qpos = order[start:start + sq]
    keep = order[None, :] <= qpos[:, None]
    return keep & (order[None, :] > qpos[:, None] - w) if w else keep
