"""``at_rank``: a node with the attributes that place one rank's block in the global tensor.

Two parts need them: dropout and vocab-parallel embedding (``index_start`` /
``index_shape`` / ``vocab_start``: :func:`parcomp.reference.norm_ops.at_rank`), and the ops that
index a split dim (``pick``, ``argmax_key``, ``mask_pad``: ``index_start``,
:func:`parcomp.reference.reduce_ops.at_rank`). The interpreter calls this one
function; each part's own returns other ops unchanged.
"""
from __future__ import annotations

from . import cp_ops, norm_ops, reduce_ops


def at_rank(program, node, rank: int):
    """``node`` of local ``program`` as mesh rank ``rank`` runs it (unchanged for other ops)."""
    node = cp_ops.at_rank(program, node, rank)  # context parallel: q_start
    return reduce_ops.at_rank(program, norm_ops.at_rank(program, node, rank), rank)
