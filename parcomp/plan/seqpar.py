"""``parcomp plan`` under a memory limit: Megatron sequence parallel when memory says so.

Tensor parallelism splits the matmuls' activations but leaves the norm regions (layer
norms, dropouts, residual additions: ``[batch, seq, hidden]`` values) replicated over tp,
so their activation memory does not shrink with tp.  Megatron's sequence parallelism
splits them along the sequence (the ``sequence-parallel`` statement, :mod:`parcomp.passes.attention.seqpar`),
which trades an all_reduce for an all_gather / reduce_scatter pair: more calls, the same
bytes, less memory.  Under the comm-and-compute cost model it never pays for itself, so
the planner writes it only when the memory limit asks for it:

1. compile the planned spec; if it fits the limit (the search's resident bytes and the
   compiled plan's liveness peak, :mod:`parcomp.cost.memory`), it is the plan;
2. else compile it with ``sequence-parallel``; if that fits, that is the plan, written
   with a comment saying why (both peaks);
3. else :class:`parcomp.cost.memory.MemoryLimitError` (both peaks in the message); ``parcomp
   plan`` then looks for the smallest plan it can find, independent of the limit
   (:func:`parcomp.plan.planner.plan`).
"""
from __future__ import annotations

import textwrap

from ..cost.memory import MemoryLimitError
from ..errors import ParcompError
from ..spec import parse_spec
from ..units import format_bytes

ACTIVATIONS = "# activations (chosen by the search"
SP_LINE = "sequence-parallel  # Megatron --sequence-parallel: norm regions on the split sequence"


def choose_seqpar(graph, text: str, memory_loc) -> str:
    """``text`` (a planned spec with a ``memory`` line), or the same spec with
    ``sequence-parallel`` when only that one fits the limit (module docstring).

    Raises:
        MemoryLimitError: neither fits (at ``memory_loc``, the ``--memory`` option; ``need``:
            the smaller of the two).
        ParcompError: the planned spec fails for another reason.
    """
    _, plain = _compile(graph, text)
    if plain is None:
        return text
    sp_text = with_sp(text, [])
    try:
        compiled, sp = _compile(graph, sp_text)
    except ParcompError:  # no norm over [batch, seq, hidden], or a sequence tp does not divide
        raise _again(plain, plain.message, memory_loc) from None
    if sp is not None:
        need = min((e for e in (plain, sp) if getattr(e, "need", None) is not None),
                   key=lambda e: e.need, default=plain)
        raise _again(need, f"{plain.message}; with sequence-parallel: {_figure(sp)}", memory_loc) from None
    peak = compiled.report["memory_bytes_per_rank"]["peak_live"]
    without = plain.message.split(" (weights")[0].split("; ")[0]
    why = ["# sequence parallel, chosen for the memory limit:",
           *textwrap.wrap(f"without it {without}", 94, initial_indent="#   ", subsequent_indent="#     "),
           f"#   with it the plan's peak is {format_bytes(peak)} per rank ({peak:,} B)"]
    return with_sp(text, why)


def _again(err, message: str, loc) -> MemoryLimitError:
    return MemoryLimitError(message, loc, need=getattr(err, "need", None), peak=getattr(err, "peak", False))


def _figure(err) -> str:
    """What a memory error of the plan with ``sequence-parallel`` says it needs, whole."""
    need = getattr(err, "need", None)
    if need is None:
        return err.message
    what = "the plan's peak of live values" if err.peak else "the smallest layout plan's resident bytes"
    return f"{what} needs {format_bytes(need)} per rank ({need:,} B)"


def least_peak(graph, text: str):
    """``(peak, how)``: the smallest liveness peak per rank (bytes) of spec ``text``'s
    parameter layouts compiled with the activations laid out for speed (no ``memory`` line)
    or for the least resident bytes the search can reach (``memory`` that many bytes; the
    peak even where it is over that line), and which; None when it does not compile.
    Independent of ``text``'s own ``memory`` line."""
    try:
        compiled, _ = _compile(graph, set_memory(text, None))
    except ParcompError:  # e.g. sequence-parallel on a model it does not apply to
        return None
    best = (compiled.report["memory_bytes_per_rank"]["peak_live"], "activations for speed")
    try:
        _, least = _compile(graph, set_memory(text, "1B"))
        if least is not None and getattr(least, "need", None) is not None and not least.peak:
            compiled, err = _compile(graph, set_memory(text, f"{least.need}B"))
            peak = (compiled.report["memory_bytes_per_rank"]["peak_live"] if err is None
                    else err.need if getattr(err, "peak", False) else None)
            if peak is not None and peak < best[0]:
                best = (peak, "activations for the least memory")
    except ParcompError:
        pass
    return best


def set_memory(text: str, memory: str | None) -> str:
    """Spec ``text`` with its ``memory`` line set to ``memory`` (added after ``mesh`` if it has
    none), or removed (None)."""
    lines = [ln for ln in text.split("\n") if not (memory is None and ln.startswith("memory "))]
    at = next((i for i, ln in enumerate(lines) if ln.startswith("memory ")), None)
    if memory is None:
        pass
    elif at is not None:
        lines[at] = f"memory {memory}"
    else:
        lines.insert(next(i for i, ln in enumerate(lines) if ln.startswith("mesh ")) + 1, f"memory {memory}")
    return "\n".join(lines)


def _compile(graph, text: str) -> tuple:
    """``(compiled, None)`` when ``text`` compiles within its memory limit, else
    ``(None, the memory error)``.

    Raises:
        ParcompError: any error not at the ``memory`` statement.
    """
    from ..compile.compiler import compile_graph

    spec = parse_spec(text, "plan.pcs")
    try:
        return compile_graph(graph, spec), None
    except ParcompError as e:
        if e.loc is not None and spec.memory_loc is not None and e.loc.line == spec.memory_loc.line:
            return None, e
        raise


def with_sp(text: str, comment: list) -> str:
    """``text`` with the statement (and ``comment`` above it) after its ``memory`` (else ``mesh``) line; the
    listed activation layouts (the search's without the statement) give way to a pointer."""
    lines = text.split("\n")
    at = next((i for i, ln in enumerate(lines) if ln.startswith("memory ")),
              next(i for i, ln in enumerate(lines) if ln.startswith("mesh "))) + 1
    end = next((i for i, ln in enumerate(lines) if ln.startswith(ACTIVATIONS)), len(lines))
    acts = [ln for ln in lines[end:end + 1] if ln]
    if acts:
        acts = ["# activations: sequence-parallel places them; `parcomp explain MODEL --spec THIS_FILE`",
                "# lists every collective and why", ""]
    return "\n".join(lines[:at] + comment + [SP_LINE] + lines[at:end] + acts)
