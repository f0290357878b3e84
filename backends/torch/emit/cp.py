"""Torch emitter fields of context-parallel attention.

A causal ``sdpa`` / ``sdpa_grad`` marked ``cp`` (``parcomp/passes/attention/ctxpar.py``) may hold a block
of the query rows; torch's ``is_causal`` would put the mask at row 0, so such a node gets an
explicit boolean mask ``tril`` at the rank's global row offset (an expression of ``COORD``, the
same offset :mod:`parcomp.reference.cp_ops` gives the interpreter). A sliding ``window`` w adds
``triu(offset - (w - 1))``: only the last w keys up to each row's global position. Every other
sdpa keeps ``is_causal``.
"""
from __future__ import annotations

from .norms import block_start

#: the operand holding q, per op (as parcomp/reference/cp_ops.py: backends see only parcomp.ir
#: and parcomp.compile.program)
Q_OPERAND = {"sdpa": 0, "sdpa_grad": 1}
SEQ = 2


def needs_q_start(node) -> bool:
    """Whether ``node`` is a causal context-parallel sdpa / sdpa_grad."""
    return node.op in Q_OPERAND and bool(node.attr("cp")) and node.attr("causal", False)


def cp_kw(program, n, args=None) -> dict:
    """``{"mask_args": ...}``: the mask arguments of ``scaled_dot_product_attention`` for node
    ``n`` of local ``program`` (``is_causal=...``, or a causal mask at this rank's ``q_start``);
    ``args``: the operand variables (read only without a program)."""
    if n.op not in Q_OPERAND:
        return {}
    w = n.attr("window", 0) if n.attr("causal", False) else 0
    if not w and (program is None or not needs_q_start(n)):
        return {"mask_args": f"is_causal={bool(n.attr('causal', False))}"}
    qi = Q_OPERAND[n.op]
    if program is None:  # one node on its own (whole operands): sizes from the variables
        lq, lk, start = f"{args[qi]}.shape[{SEQ}]", f"{args[qi + 1]}.shape[{SEQ}]", "0"
    else:
        q, k = program[n.inputs[qi]], program[n.inputs[qi + 1]]
        lq, lk = q.type.shape[SEQ], k.type.shape[SEQ]
        start = block_start(program, q, SEQ) if needs_q_start(n) else "0"
    if n.attr("chunking") == "balanced":  # balanced chunking: by global positions (emit_cp_ring.py)
        band = f", {w}" if w else ""
        return {"mask_args": f"attn_mask=balanced_keep({lq}, {lk}, {start}, {n.attr('cp_size')}{band})"}
    keep = f"torch.ones({lq}, {lk}, dtype=torch.bool, device=DEVICE).tril({start})"
    if w:  # a sliding window: only the last w keys up to the row's global position
        keep += f".triu({start} - {w - 1})" if start != "0" else f".triu({1 - w})"
    return {"mask_args": f"attn_mask={keep}"}
