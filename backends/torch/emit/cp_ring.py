"""The torch emitter's rows for ring attention (``context-parallel lowering=ring``).

A ring-marked ``sdpa`` / ``sdpa_grad`` prints a call of the ``ring`` runtime section
(:mod:`parcomp_backends.torch.runtime.program_ring`) instead of ``scaled_dot_product_attention``, with a comment above it
listing the point-to-point passes of the Program's ``send_recv`` records (what moves, how many
shifts, bytes per rank, why).
"""
from __future__ import annotations

from ..runtime import sections

RING_FORMATS = {
    "sdpa_ring": "ring_sdpa({0}, {1}, {2}, {scale}, {causal}, {cp_axis}, {chunking}{window_arg})",
    # balanced chunking: positions in storage order (emit.OP_FORMATS["arange"], reordered)
    "arange_balanced": ("balance_rows(torch.arange({local_shape}[0], dtype=torch.float64, device=DEVICE)"
                        ".mul({step}).add({start}).to({dtype}), (0,), {balanced})"),
    "sdpa_grad_ring": "ring_sdpa_grad({0}, {1}, {2}, {3}, {scale}, {causal}, {cp_axis}, {chunking}, {wrt}{window_arg})",
}
HELPER_NAMES = ("ring_line", "ring_start", "ring_finish", "ring_shift", "ring_positions", "ring_scores", "ring_stats",
                "ring_sdpa", "ring_sdpa_saved", "ring_sdpa_grad", "ring_sdpa_grads", "balance_order", "balance_rows", "balanced_keep")


def is_ring(n) -> bool:
    """Whether ``n`` is an sdpa / sdpa_grad of the ring lowering."""
    return n.op in ("sdpa", "sdpa_grad") and n.attr("cp") == "ring"


def ring_key(n, key: str) -> str:
    """The format key of ``n``: ``sdpa_ring`` / ``sdpa_grad_ring`` for a ring node,
    ``arange_balanced`` for positions under balanced chunking, else ``key``."""
    if n.op == "arange" and n.attr("balanced"):
        return "arange_balanced"
    return f"{n.op}_ring" if is_ring(n) else key


def ring_kw(n) -> dict:
    """Format fields a ring node needs beyond its attributes (the chunking's default, and the
    sliding window's argument when it has one)."""
    if not is_ring(n):
        return {}
    w = n.attr("window", 0)
    return {"window_arg": f", window={w}" if w else "",
            **({"chunking": '"contiguous"'} if not n.attr("chunking") else {})}


def balanced_of(program):
    """``(mesh axis index, n)`` of a program with balanced chunking, or None (as
    parcomp/passes/attention/cp_balance.py's: backends read only the program); found once per program."""
    return program.memo("emit_cp_ring.balanced_of", _balanced_of)


def _balanced_of(program):
    for n in program.nodes:
        if n.op == "sdpa" and n.attr("chunking") == "balanced":
            return program.mesh.axis_index(n.attr("cp_axis")), n.attr("cp_size")
    return None


def ring_sections(program) -> list:
    """The ``ring`` runtime section if ``program`` has a ring node, the ``balanced`` one if it
    has balanced chunking."""
    got = sections("program_ring")
    return ([got["ring"]] if any(is_ring(n) for n in program.nodes) else []) + \
        ([got["balanced"]] if balanced_of(program) else [])


def balance_src(program, node, src: str) -> str:
    """The load expression of source ``node`` (full tensor ``src``) under balanced chunking: an
    input split over the axis, or a constant position table (``balanced_dims``), in storage order."""
    got = balanced_of(program)
    if got is None:
        return src
    if node.op == "param" and node.attr("balanced"):
        return f"balance_rows(whole({src}), {tuple(node.attr('balanced_dims'))!r}, {got[1]})"
    dim = getattr(node.layout[got[0]], "dim", None) if node.op == "input" else None
    return src if dim is None else f"balance_rows({src}, ({dim},), {got[1]})"


def ring_axes(graph) -> set:
    """The mesh axes ring nodes send over (their process groups must exist)."""
    return {n.attr("cp_axis") for n in graph.nodes if is_ring(n)}


def ring_comment(prog, n, kept: bool = False) -> list:
    """The comment texts above ring node ``n``: one per ``send_recv`` record of it (the records
    are the passes the program runs: parcomp/passes/attention/cp_ring.py's program_ring_steps);
    ``kept``: an ``sdpa_grad`` whose backward ring reads the statistics its forward ring kept
    (emit/attention.py)."""
    if not is_ring(n):
        return []
    recs = [c for c in prog.collectives if c.kind == "send_recv" and c.producer == n.name]
    out = [f"send_recv over {c.axis} {c.src_layout}, bytes/rank {c.bytes}: {c.reason}" for c in recs]
    return out + (["no statistics pass: the forward ring's output and row logsumexp are kept (saved=)"]
                  if kept and n.op == "sdpa_grad" else [])
