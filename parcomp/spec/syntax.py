"""Words of the spec parser's errors: what each grammar terminal is called (:data:`WORDS`),
what a syntax error expected and got, and the small located-error helpers the tree
transformer (:mod:`.tree`) and the builder (:mod:`.builder`) share.

Every message is a :class:`~parcomp.errors.SpecError` at ``file:line:col`` with a caret.
"""
from __future__ import annotations

from lark import UnexpectedInput

from ..errors import SourceLoc, SpecError, bad_char, char_name, closest, join_words
from .model import LAYOUT_WORDS

LAYOUT_WORDS_TEXT = ", ".join(LAYOUT_WORDS)
_LAYOUT = (f"a layout: a layout word ({LAYOUT_WORDS_TEXT}), a placement R, S(d) or P, "
           "a per-axis list such as [S(0), R], or axis=placement such as tp=S(1)")
_STATEMENT = ("a statement: mesh, topology, memory, sequence-parallel, train, stage, or a rule such as 'c_fc.weight colwise' "
              "(a name pattern and a layout, after param, input, output or activation if you like)")
_PLACEMENT = "a placement (R, S(d) or P)"
WORDS = {  # every terminal of grammar.lark, as a syntax error says it
    "PATTERN": "a name pattern such as h.*.mlp.c_fc.weight",
    "NAME": "a name", "DIGIT_NAME": "a name such as 1f1b", "SIGNED_INT": "a whole number", "INT": "a tensor dim (a whole number)",
    "NUMBER": "a number", "ESCAPED_STRING": "a quoted string",
    "EQUAL": "'='", "LPAR": "'('", "RPAR": "')'", "COMMA": "','", "LSQB": "'['", "RSQB": "']'",
    "OVER": "'over AXIS'", "_NL": "the end of the line", "$END": "the end of the file",
    "REP": _PLACEMENT, "SHARD": _PLACEMENT, "PART": _PLACEMENT,
    "MESH": "'mesh'", "TOPOLOGY": "'topology'", "TRAIN": "'train'", "MEMORY": "'memory'",
    "SEQPAR": "'sequence-parallel'",
    "CTXPAR": "'context-parallel'",  # context parallel
    "MOE": "'moe'",  # MoE capacity policy
    "MEMSIZE": "a memory size such as 80GiB (units B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)",
    "STAGE": "'stage'", "COLON": "':'", "RANGE": "a range of numbered modules such as h.0-5",
    "PARAM": "a rule target (param, input, output or activation)",
    "INPUT": "a rule target (param, input, output or activation)",
    "OUTPUT": "a rule target (param, input, output or activation)",
    "ACTIVATION": "a rule target (param, input, output or activation)",
    "COMMENT": "a comment", "WS_INLINE": "a space",
}
_PHRASES = WORDS  # the name this table had before
_ALPHABET = ("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
             "_*.-+=,()[]#\"")  # what the grammar uses outside strings and comments
_NAME_CHARS = "names use A-Z, a-z, 0-9, _ and . (patterns also *, layout words and keys also -)"
MAX_DIGITS = 18  # a whole number must fit in int64
_NAME_PHRASES = {"mesh": "a mesh axis such as tp=2", "topology": "nodes=N, devices_per_node=N or intra=nvlink",
                 "train": "an option such as batch=8"}
_KEYWORDS = ("mesh", "topology", "memory", "train", "stage", "sequence-parallel")


def did_you_mean(name: str, known) -> str:
    """``"; did you mean X?"`` for the closest of ``known``, or ``""``."""
    near = closest(name, known)
    return f"; did you mean {near}?" if near else ""


def spec_int(tok, file: str, lines: list) -> int:
    """``int(tok)``; a SpecError at the token when it has more than :data:`MAX_DIGITS` digits."""
    digits = str(tok).lstrip("+-").lstrip("0")
    if len(digits) > MAX_DIGITS:
        raise SpecError(f"this number has {len(digits)} digits; at most {MAX_DIGITS}",
                        source_loc(file, lines, getattr(tok, "line", 1), getattr(tok, "column", 1)))
    return int(str(tok))


def show_token(tok, most: int = 60) -> str:
    """``repr`` of a token, cut to ``most`` characters."""
    s = str(tok)
    return repr(s) if len(s) <= most else repr(s[:most]) + "..."


def source_loc(file: str, lines: list, line: int, col: int) -> SourceLoc:
    line = max(line or 1, 1)
    text = lines[line - 1] if line <= len(lines) else ""
    return SourceLoc(file, line, max(col or 1, 1), text)


def _expected(exp, line_text: str, col: int) -> str:
    """Plain words for a set of lark terminal names (what the parser wanted)."""
    exp = set(exp)
    if "PATTERN" in exp and exp & {"MESH", "_NL"}:  # keywords may be folded into PATTERN
        return _STATEMENT
    if "LSQB" in exp:
        return _LAYOUT
    if "NUMBER" in exp:
        return "a value: a number, a name, a quoted string or name(key=value, ...)"
    if "OVER" in exp:
        exp.discard("EQUAL")
    words, before = line_text.split(), line_text[:col - 1].split()
    out = []
    for t in sorted(exp, key=lambda t: (t in ("_NL", "$END"), t)):
        if t == "NAME":
            if before and before[-1] == "over":
                p = "a mesh axis name"
            elif words and words[0] in _NAME_PHRASES:
                p = _NAME_PHRASES[words[0]]
            else:
                p = "another axis=placement such as dp=S(0)"
        else:
            p = WORDS.get(t, t)
        out.append(p)
    return join_words(out)


def syntax_error(e: UnexpectedInput, file: str, lines: list) -> SpecError:
    tok = getattr(e, "token", None)
    line, col = e.line if e.line and e.line > 0 else 1, e.column if e.column and e.column > 0 else 1
    text = lines[line - 1] if 0 < line <= len(lines) else ""
    if tok is not None and tok.type == "_NL":  # point just past the code, not past a comment
        col = min(col, len(text.split("#", 1)[0].rstrip()) + 1)
    exp = getattr(e, "expected", None) or getattr(e, "allowed", None) or ()
    if tok is None:
        c = text[col - 1] if 0 < col <= len(text) else ""
        problem = bad_char(c, text[col - 2] if col > 1 else "", _ALPHABET, _NAME_CHARS,
                           "outside comments and strings")
        if problem:
            return SpecError(problem, source_loc(file, lines, line, col))
        got = f"the character {char_name(c)}" if c else "input"
    else:
        got = WORDS[tok.type] if tok.type in ("_NL", "$END") else show_token(tok)
    msg = f"expected {_expected(exp, text, col)}; got {got}" if exp else f"unexpected {got}"
    if tok is not None and str(tok).startswith(".") and col > 1 and text[col - 2].isalnum():
        start = col - 1  # 'output=a.0': '.0' read as a number; the whole name must be quoted
        while start > 0 and (text[start - 1].isalnum() or text[start - 1] in "_."):
            start -= 1
        name = text[start:col - 1] + str(tok)
        msg += f" (a name with a number after a dot is written quoted: \"{name}\")"
    listed = _list_over(text, col) if tok is not None and tok.type == "OVER" else None
    if listed:  # '[S(0)] over dp': a per-axis list already names every axis
        msg = listed
    size = _memory_value(text, col)
    if size:  # 'memory 80 GiB', 'memory 80GiBs': the whole value, not its first token
        col, msg = size[0], f"expected {WORDS['MEMSIZE']}; got {show_token(size[1])}"
    word = text.split("#", 1)[0].split()[:1]
    near = closest(word[0], _KEYWORDS) if word and word[0] not in _KEYWORDS else None
    if near:  # 'trian loss=mse' read as a rule for the name 'trian': say the likely typo first
        col = len(text) - len(text.lstrip()) + 1
        msg = f"'{word[0]}' is not a statement; did you mean '{near}'? (read as a rule, {msg})"
    return SpecError(msg, source_loc(file, lines, line, col))



def _list_over(text: str, col: int) -> str | None:
    """The message for ``over AXIS`` after a per-axis list (``[S(0)] over dp``), which gives
    every mesh axis's placement and so takes no axis; None when ``over`` at ``col`` follows
    no list."""
    before = text[:col - 1].rstrip()
    if not before.endswith("]") or "[" not in before:
        return None
    inner = before[before.rindex("[") + 1:-1].strip()
    after = text[col - 1:].split("#", 1)[0].split()
    axis = after[1] if len(after) > 1 else "AXIS"
    one = inner if inner and "," not in inner else "S(0)"
    return (f"a per-axis list such as [{inner}] gives the placement on every mesh axis, in the mesh's order, "
            f"and takes no 'over {axis}'; for one axis write '{one} over {axis}' or '{axis}={one}' (no "
            f"brackets), or list every axis of the mesh, e.g. [{one}, R] on a mesh of two axes")


def _memory_value(text: str, col: int):
    """``(column, value)`` of a ``memory`` line's value when the syntax error at ``col`` is in
    it (the text after ``memory`` up to a comment), else None."""
    code = text.split("#", 1)[0]
    head = code.lstrip()
    if not head.startswith("memory") or head[6:7] not in (" ", "\t"):
        return None
    start = len(code) - len(head) + 6
    value = code[start:].strip()
    vcol = start + len(code[start:]) - len(code[start:].lstrip()) + 1
    return (vcol, value) if value and col >= vcol else None

