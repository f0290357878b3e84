"""User-facing errors of parcomp.

Every error a user can cause is a :class:`ParcompError` carrying the place it
happened (a file position, a tensor, a parameter, a mesh axis).  The CLI prints
``str(err)`` and exits with status 2; it never shows a Python traceback for
these.  Rendering follows xDSL's ``Span.print_with_context`` and lark's
``get_context``: ``file:line:col``, the source line, a caret under the column.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SourceLoc:
    """A position in a text file (1-based line and column)."""

    file: str
    line: int
    col: int
    text: str = ""  # the whole source line, for the caret display

    def render(self) -> str:
        head = f"{self.file}:{self.line}:{self.col}"
        if not self.text:
            return head
        caret = " " * (max(self.col, 1) - 1) + "^"
        return f"{head}\n    {self.text.rstrip()}\n    {caret}"

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


class ParcompError(Exception):
    """An error caused by the user's model, spec, IR text or command line.

    Args:
        message: what is wrong and, where possible, how to fix it.
        loc: the source position, if the error comes from a text file.
    """

    def __init__(self, message: str, loc: SourceLoc | None = None):
        self.message = message
        self.loc = loc
        super().__init__(self.render())

    def render(self) -> str:
        if self.loc is None:
            return f"error: {self.message}"
        return f"{self.loc.render()}\nerror: {self.message}"


class SpecError(ParcompError):
    """A problem in a parallel spec (.pcs file)."""


class IRParseError(ParcompError):
    """A problem in a textual IR (.pcir) file."""


class FrontendError(ParcompError):
    """A model the frontend cannot import (unsupported op, bad factory)."""


class ShardingError(ParcompError):
    """A layout that cannot be honoured (indivisible dim, impossible layout)."""


class VerifyError(ParcompError):
    """The IR broke an invariant (internal error, or a hand-written .pcir)."""


def closest(name: str, candidates) -> str | None:
    """The candidate nearest to ``name`` (difflib ratio >= 0.6), or None."""
    import difflib

    hits = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return hits[0] if hits else None
