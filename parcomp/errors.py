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
        """``file:line:col``, the source line and a caret under the column.

        The line is shown printable: control characters (tabs aside) as ``?``, and
        a line longer than :data:`SHOWN` characters as a window around the column.
        """
        head = f"{self.file}:{self.line}:{self.col}"
        if not self.text:
            return head
        text, col = _window(self.text.rstrip("\r\n"), max(self.col, 1))
        shown = "".join(c if c == "\t" or c.isprintable() else "?" for c in text)
        caret = "".join(c if c == "\t" else " " for c in shown[:col - 1]) + "^"
        return f"{head}\n    {shown.rstrip()}\n    {caret}"

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


SHOWN = 100  # characters of a source line shown around the column


def _window(text: str, col: int) -> tuple:
    """At most about :data:`SHOWN` characters of ``text`` around 1-based ``col``,
    and the column inside them."""
    if len(text) <= SHOWN:
        return text, col
    start = max(0, min(col - 1 - SHOWN // 2, len(text) - SHOWN))
    part = text[start:start + SHOWN]
    pre, post = ("..." if start else ""), ("..." if start + SHOWN < len(text) else "")
    return pre + part + post, col - start + len(pre)


class ParcompError(Exception):
    """An error caused by the user's model, spec, IR text or command line.

    Args:
        message: what is wrong and, where possible, how to fix it.
        loc: the source position, if the error comes from a text file.
        where: otherwise, the thing the error is about (a path, an option such
            as ``--nproc``, a model reference), for ``--json``'s ``"where"``.
    """

    def __init__(self, message: str, loc: SourceLoc | None = None, *, where: str | None = None):
        self.message = message
        self.loc = loc
        self.where = str(loc) if loc is not None else where
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


def source_lines(text: str) -> list:
    """The lines of ``text`` as lark numbers them: split at ``\\n`` only (a form
    feed or ``\\x1c`` does not start a line), a trailing ``\\r`` dropped."""
    return [ln[:-1] if ln.endswith("\r") else ln for ln in text.split("\n")]


def char_name(c: str) -> str:
    """A character as an error message shows it: ``'é' (U+00E9)``, ``'\\x00' (U+0000)``."""
    return repr(c) if " " <= c <= "~" else f"{c!r} (U+{ord(c):04X})"


def join_words(phrases) -> str:
    """``"a"``, ``"a or b"``, ``"a, b or c"`` (repeated phrases once, in order)."""
    out = list(dict.fromkeys(phrases))
    return out[0] if len(out) == 1 else ", ".join(out[:-1]) + " or " + out[-1] if out else "nothing"


def bad_char(c: str, prev: str, alphabet: str, name_rule: str, where: str) -> str | None:
    """Why character ``c`` (after ``prev``) cannot appear in a text whose grammar uses only
    ``alphabet`` (outside strings and comments), or None for a plain syntax error.

    A character the grammar never uses, right after a name, is not allowed in a
    name (``name_rule`` says which are); a non-ASCII or control character
    elsewhere is not allowed ``where``.
    """
    if not c or c in alphabet or (c.isspace() and c.isascii()):
        return None
    if prev.isalnum() or (prev and prev in "_.-*"):
        return f"the character {char_name(c)} is not allowed in a name; {name_rule}"
    if not (" " <= c <= "~"):
        return f"the character {char_name(c)} is not allowed {where}"
    return None


def closest(name: str, candidates) -> str | None:
    """The candidate nearest to ``name`` (difflib ratio >= 0.6), or None."""
    import difflib

    hits = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return hits[0] if hits else None
