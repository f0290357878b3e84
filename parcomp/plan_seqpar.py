"""``parcomp plan`` under a memory limit: Megatron sequence parallel when memory says so.

Tensor parallelism splits the matmuls' activations but leaves the norm regions (layer
norms, dropouts, residual additions: ``[batch, seq, hidden]`` values) replicated over tp,
so their activation memory does not shrink with tp.  Megatron's sequence parallelism
splits them along the sequence (the ``sequence-parallel`` statement, :mod:`.passes.seqpar`),
which trades an all_reduce for an all_gather / reduce_scatter pair: more calls, the same
bytes, less memory.  Under the comm-and-compute cost model it never pays for itself, so
the planner writes it only when the memory limit asks for it:

1. compile the planned spec; if it fits the limit (the search's resident bytes and the
   compiled plan's liveness peak, :mod:`parcomp.memory`), it is the plan;
2. else compile it with ``sequence-parallel``; if that fits, that is the plan, written
   with a comment saying why (both peaks);
3. else the first error stands, saying by how much the plan misses (and that sequence
   parallel was tried).
"""
from __future__ import annotations

import textwrap

from .errors import ParcompError
from .report import format_bytes
from .spec import parse_spec

ACTIVATIONS = "# activations (chosen by the search"
SP_LINE = "sequence-parallel  # Megatron --sequence-parallel: norm regions on the split sequence"


def choose_seqpar(graph, text: str, memory_loc) -> str:
    """``text`` (a planned spec with a ``memory`` line), or the same spec with
    ``sequence-parallel`` when only that one fits the limit (module docstring).

    Raises:
        ParcompError: neither fits (at ``memory_loc``, the ``--memory`` option), or the
            planned spec fails for another reason.
    """
    _, plain = _compile(graph, text)
    if plain is None:
        return text
    sp_text = _with_sp(text, [])
    try:
        compiled, sp = _compile(graph, sp_text)
    except ParcompError:  # no norm over [batch, seq, hidden], or a sequence tp does not divide
        raise ParcompError(plain.message, memory_loc) from None
    if sp is not None:
        raise ParcompError(f"{plain.message}; with sequence-parallel: {sp.message.split(' (weights')[0]}",
                           memory_loc) from None
    peak = compiled.report["memory_bytes_per_rank"]["peak_live"]
    without = plain.message.split(" (weights")[0].split("; ")[0]
    why = ["# sequence parallel, chosen for the memory limit:",
           *textwrap.wrap(f"without it {without}", 94, initial_indent="#   ", subsequent_indent="#     "),
           f"#   with it the plan's peak is {format_bytes(peak)} per rank ({peak:,} B)"]
    return _with_sp(text, why)


def _compile(graph, text: str) -> tuple:
    """``(compiled, None)`` when ``text`` compiles within its memory limit, else
    ``(None, the memory error)``.

    Raises:
        ParcompError: any error not at the ``memory`` statement.
    """
    from .compiler import compile_graph

    spec = parse_spec(text, "plan.pcs")
    try:
        return compile_graph(graph, spec), None
    except ParcompError as e:
        if e.loc is not None and spec.memory_loc is not None and e.loc.line == spec.memory_loc.line:
            return None, e
        raise


def _with_sp(text: str, comment: list) -> str:
    """``text`` with the statement (and ``comment`` above it) after its ``memory`` line; the
    listed activation layouts (the search's without the statement) give way to a pointer."""
    lines = text.split("\n")
    at = next(i for i, ln in enumerate(lines) if ln.startswith("memory ")) + 1
    end = next((i for i, ln in enumerate(lines) if ln.startswith(ACTIVATIONS)), len(lines))
    acts = [ln for ln in lines[end:end + 1] if ln]
    if acts:
        acts = ["# activations: sequence-parallel places them; `parcomp explain MODEL --spec THIS_FILE`",
                "# lists every collective and why", ""]
    return "\n".join(lines[:at] + comment + [SP_LINE] + lines[at:end] + acts)
