"""The torch emitter's rows for ring attention (``context-parallel lowering=ring``, issue 14).

A ring-marked ``sdpa`` / ``sdpa_grad`` prints a call of the ``ring`` runtime section
(:mod:`.program_ring`) instead of ``scaled_dot_product_attention``, with a comment above it
listing the point-to-point passes of the Program's ``send_recv`` records (what moves, how many
shifts, bytes per rank, why).
"""
from __future__ import annotations

from .runtime import sections

RING_FORMATS = {
    "sdpa_ring": "ring_sdpa({0}, {1}, {2}, {scale}, {causal}, {cp_axis}, {chunking})",
    "sdpa_grad_ring": "ring_sdpa_grad({0}, {1}, {2}, {3}, {scale}, {causal}, {cp_axis}, {chunking}, {wrt})",
}
HELPER_NAMES = ("ring_line", "ring_shift", "ring_positions", "ring_scores", "ring_stats",
                "ring_sdpa", "ring_sdpa_grad")


def is_ring(n) -> bool:
    """Whether ``n`` is an sdpa / sdpa_grad of the ring lowering."""
    return n.op in ("sdpa", "sdpa_grad") and n.attr("cp") == "ring"


def ring_key(n, key: str) -> str:
    """The format key of ``n``: ``sdpa_ring`` / ``sdpa_grad_ring`` for a ring node, else ``key``."""
    return f"{n.op}_ring" if is_ring(n) else key


def ring_kw(n) -> dict:
    """Format fields a ring node needs beyond its attributes (the chunking's default)."""
    return {"chunking": '"contiguous"'} if is_ring(n) and not n.attr("chunking") else {}


def ring_sections(program) -> list:
    """``[the ring runtime section]`` if ``program`` has a ring node, else ``[]``."""
    return [sections("program_ring")["ring"]] if any(is_ring(n) for n in program.nodes) else []


def ring_axes(graph) -> set:
    """The mesh axes ring nodes send over (their process groups must exist)."""
    return {n.attr("cp_axis") for n in graph.nodes if is_ring(n)}


def ring_comment(prog, n) -> list:
    """The comment texts above ring node ``n``: one per ``send_recv`` record of it."""
    if not is_ring(n):
        return []
    recs = [c for c in prog.collectives if c.kind == "send_recv" and c.producer == n.name]
    return [f"send_recv over {c.axis} {c.src_layout}, bytes/rank {c.bytes}: {c.reason}" for c in recs]
