"""Text helpers of the torch emitter that run once per line of a deep program (compile
speed): a comment wrapper giving ``textwrap.wrap``'s lines without its per-call set-up.

A 48-block GPT-2's program.py has ~2k wrapped comments (one per parameter slice, one per
layout change); ``textwrap.wrap`` builds a ``TextWrapper``, munges whitespace and splits the
text into chunks with a regex for each. :func:`wrap` cuts the line at the same places with
string searches. ``tests/compile/test_compile_speed.py`` compares it with ``textwrap.wrap``.
"""
from __future__ import annotations

import re
import textwrap

_SPACES = re.compile(" +")


def wrap(text: str, width: int, initial: str = "", subsequent: str = "") -> list:
    """``textwrap.wrap(text, width, initial_indent=initial, subsequent_indent=subsequent,
    break_long_words=False, break_on_hyphens=False)``, the same lines.

    Text of printable ASCII (whitespace: only spaces) with room for a character after either
    indent is cut here: each line takes the most whole words (and the spaces between them)
    that fit, a word longer than the room gets a line of its own, spaces at the end of a line
    and at the start of a later one are dropped. Any other text goes to ``textwrap.wrap``.
    """
    if not (text.isascii() and text.isprintable()) or width <= max(len(initial), len(subsequent)):
        return textwrap.wrap(text, width, initial_indent=initial, subsequent_indent=subsequent,
                             break_long_words=False, break_on_hyphens=False)
    if len(initial) + len(text) <= width:  # the common case: one line
        line = text.rstrip(" ")
        return [initial + line] if line else []
    lines, p, n = [], 0, len(text)
    while p < n:
        indent = subsequent if lines else initial
        if lines and text[p] == " ":  # a later line starts after the spaces
            p = _run_end(text, p)
            if p >= n:
                break
        room = width - len(indent)
        end = _fill(text, p, p + room) if n - p > room else n
        if end == p:  # the next word (or first-line spaces) is longer than the room: alone
            end = _run_end(text, p)
        line = text[p:end].rstrip(" ")
        if line:
            lines.append(indent + line)
        p = end
    return lines


def _fill(text: str, p: int, e: int) -> int:
    """The last chunk boundary (word/spaces change) in ``text[p:e + 1]``: where a line that
    starts at ``p`` and may reach ``e`` (exclusive) ends; ``p`` if none (the first chunk is too long)."""
    before, after = text[e - 1] == " ", text[e] == " "
    if before != after:
        return e
    if after:  # inside a run of spaces: the line ends before it
        return p + len(text[p:e].rstrip(" "))
    s = text.rfind(" ", p, e)  # inside a word: the line ends at its start
    return s + 1 if s >= 0 else p


def _run_end(text: str, p: int) -> int:
    """The end of the chunk (a word or a run of spaces) starting at ``p``."""
    if text[p] == " ":
        return _SPACES.match(text, p).end()
    q = text.find(" ", p)
    return len(text) if q < 0 else q
