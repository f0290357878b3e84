"""The one textual form of the IR (``.pcir``): printer and lark parser side by side.

Example::

    mesh tp=2
    %x: f32[8,16] [R] = input()
    %fc1.weight: f32[16,64] [S(1)] = param()
    %h: f32[8,64] [S(1)] = matmul(%x, %fc1.weight)
    %y: f32[8,64] [S(1)] = gelu(%h) {approximate="tanh"}
    return %y

Layouts are written as everywhere else in parcomp (:func:`parcomp.ir.types.layout_str`,
the ``.pcs`` explicit form): one placement per mesh axis, ``[S(0), R]``.

A ``param`` training must never update (a buffer, a frozen parameter) carries
``{trainable=false}``.

The printer is canonical: the same graph always gives the same bytes
(attributes sorted, floats by ``repr``).  ``parse_graph(print_graph(g)) == g``
is a hypothesis property in the tests.

Strings are JSON strings; a raw tab or other control character inside the
quotes is accepted as itself (the printer writes it escaped, ``\\t``).  Whole
numbers have at most 18 digits (they must fit in int64).  A leading UTF-8 byte
order mark is skipped.  Every problem is an :class:`IRParseError` at
``file:line:col``; syntax errors say in words what was expected
(:data:`WORDS`, one phrase per grammar terminal).
"""
from __future__ import annotations

import json
import math
import re

from lark import Lark, Transformer, UnexpectedCharacters, UnexpectedInput, v_args
from lark.exceptions import VisitError

from ..errors import IRParseError, SourceLoc, bad_char, char_name, join_words, source_lines
from .graph import Graph, Node
from .ops import OPS
from .printer import print_graph, print_node  # noqa: F401 (re-exported)
from .types import DTYPE_LONG, DTYPE_SHORT, Mesh, TensorType, make_placement

GRAMMAR = r"""
start: header* line* ret
header: "mesh" axis+           -> mesh
      | "stage" CNAME          -> stage
axis: CNAME "=" INT
line: VALUE ":" type [layout] "=" CNAME "(" args ")" [attrs]
args: [arg ("," arg)*]
arg: VALUE [layout]
ret: "return" [retval ("," retval)*]
retval: VALUE ["as" RETNAME]
RETNAME: /[A-Za-z0-9_.\-]+/
type: CNAME "[" [INT ("," INT)*] "]"
layout: "[" [placement ("," placement)*] "]"
placement: "R"              -> rep
         | "S" "(" INT ")"  -> shard
         | "P" ["(" CNAME ")"] -> partial
attrs: "{" [attr ("," attr)*] "}"
attr: CNAME "=" value
?value: SIGNED_NUMBER -> number
      | ESCAPED_STRING -> string
      | "true" -> true
      | "false" -> false
      | "(" [SIGNED_INT ("," SIGNED_INT)*] ","? ")" -> tuple
VALUE: "%" /[A-Za-z0-9_.\-]+/
COMMENT: "#" /[^\n]*/
%import common.CNAME
%import common.INT
%import common.SIGNED_INT
%import common.SIGNED_NUMBER
%import common.ESCAPED_STRING
%import common.WS
%ignore WS
%ignore COMMENT
"""

_PARSER = Lark(GRAMMAR, parser="lalr", propagate_positions=True)


_PLACEMENT = "a placement R, S(d) or P"
_LAYOUT = "a layout such as `[S(0), R]`"
WORDS = {  # every terminal of GRAMMAR, as a syntax error says it
    "MESH": "a line `mesh AXIS=SIZE ...`", "STAGE": "a line `stage global` or `stage local`",
    "VALUE": "a line `%name: dtype[shape] = op(%operands)`", "RETURN": "a line `return %value`",
    "COLON": "`:` and the type", "CNAME": "a name (a dtype such as f32, an op, an attribute or axis)",
    "LSQB": "`[` and the shape", "RSQB": "`]`", "INT": "a whole number", "SIGNED_INT": "a whole number",
    "SIGNED_NUMBER": "a number", "ESCAPED_STRING": 'a quoted string such as "tanh"',
    "TRUE": "`true` or `false`", "FALSE": "`true` or `false`", "R": _PLACEMENT, "S": _PLACEMENT, "P": _PLACEMENT,
    "EQUAL": "`=`", "LPAR": "`(`", "RPAR": "`)`", "COMMA": "`,`",
    "LBRACE": "attributes `{key=value, ...}`", "RBRACE": "`}`", "AS": "`as NAME`",
    "RETNAME": "an output name", "LAYOUT": _LAYOUT, "WS": "a space or a line break", "COMMENT": "a comment `# ...`",
    "$END": "the end of the file",
}
_FIRST = {"MESH": 0, "STAGE": 1, "VALUE": 2, "RETURN": 3}  # line kinds first, in file order
_OPERAND = "a value name such as `%x`"  # VALUE where no new line may start
_NAME_CHARS = "names use A-Z, a-z, 0-9 and _ (value names also . and -)"
MAX_DIGITS = 18  # a whole number must fit in int64
MAX_ELEMENTS = 1 << 48  # elements of one value: beyond, sizes overflow float64 sums and int64 bytes
_ALPHABET = ("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
             "_%:[],()={}\"#.-+")  # what the grammar uses outside strings and comments
_ESCAPES = r'\\, \", \/, \b, \f, \n, \r, \t or \uXXXX'


def _expected_words(exp) -> str:
    exp = set(exp)
    if "LSQB" in exp and ("EQUAL" in exp or "RPAR" in exp):  # `[` here opens a layout
        exp = (exp - {"LSQB"}) | {"LAYOUT"}
    phrases = [(_OPERAND if t == "VALUE" and "RETURN" not in exp else WORDS.get(t, t))
               for t in sorted(exp, key=lambda t: (_FIRST.get(t, 9), t))]
    return join_words(phrases)


def _got(tok) -> str:
    if tok.type == "$END":
        return WORDS["$END"]
    s = str(tok)
    if len(s) <= 30 and s.isprintable():
        return f"`{s}`"
    return repr(s[:30]) + ("..." if len(s) > 30 else "")


def _syntax_error(e: UnexpectedInput, file: str, lines: list) -> IRParseError:
    line = e.line if e.line and e.line > 0 else 1
    col = e.column if e.column and e.column > 0 else 1
    src = lines[line - 1] if 0 < line <= len(lines) else ""
    exp = getattr(e, "expected", None) or getattr(e, "allowed", None) or ()
    if isinstance(e, UnexpectedCharacters):
        c = src[col - 1] if 0 < col <= len(src) else ""
        msg = bad_char(c, src[col - 2] if col > 1 else "", _ALPHABET, _NAME_CHARS,
                       "outside strings and comments")
        if c == "<" and "LSQB" in exp:
            msg = "layouts are written [S(0), R], not <S(0), R> (one notation everywhere, as in .pcs specs)"
        elif msg is None:
            msg = f"expected {_expected_words(exp)}; got the character {char_name(c)}"
    else:
        tok = getattr(e, "token", None)
        if tok is not None and tok.type == "$END":  # just past the last code on any line
            code = [i for i, ln in enumerate(lines)
                    if ln.strip() and not ln.lstrip().startswith("#")]
            line = code[-1] + 1 if code else 1
            src = lines[line - 1] if code else ""
            col = len(src.split("#", 1)[0].rstrip()) + 1
        got = _got(tok) if tok is not None else "something else"
        msg = f"expected {_expected_words(exp)}; got {got}" if exp else f"unexpected {got}"
    return IRParseError(msg, SourceLoc(file, line, col, src))


@v_args(inline=True)
class _Build(Transformer):
    def __init__(self, file, lines):
        super().__init__()
        self.file, self.lines = file, lines

    def _err(self, tok, msg, col_offset=0, at_line=False):
        """An IRParseError at ``tok`` (plus ``col_offset``), or at its line's start."""
        line = getattr(tok, "line", 1) or 1
        text = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        col = (getattr(tok, "column", 1) or 1) + col_offset
        if at_line:
            col = len(text) - len(text.lstrip()) + 1
        return IRParseError(msg, SourceLoc(self.file, line, col, text))

    def _int(self, tok, what) -> int:
        digits = str(tok).lstrip("+-").lstrip("0")
        if len(digits) > MAX_DIGITS:
            raise self._err(tok, f"{what} has {len(digits)} digits; at most {MAX_DIGITS} "
                                 f"(a whole number must fit in int64)")
        return int(str(tok))

    def axis(self, name, size):
        n = self._int(size, f"mesh axis {name}'s size")
        if n < 1:
            raise self._err(size, f"mesh axis {name} has size {n}; a size must be >= 1")
        return (name, n)

    def mesh(self, *axes):
        seen = set()
        for name, _ in axes:
            if str(name) in seen:
                raise self._err(name, f"mesh axis {name} is given twice (axis names must differ)")
            seen.add(str(name))
        return ("mesh", Mesh(tuple((str(a), n) for a, n in axes)), axes[0][0])

    def stage(self, name):
        if str(name) not in ("global", "local"):
            raise self._err(name, f"stage {name}: a graph is `stage global` (the default: "
                                  f"unsharded types) or `stage local` (per-rank types)")
        return ("stage", str(name), name)

    def type(self, dt, *dims):
        if str(dt) not in DTYPE_LONG:
            raise self._err(dt, f"unknown dtype {dt!s}; known: {', '.join(DTYPE_SHORT.values())}")
        shape = tuple(self._int(d, "a dim") for d in dims if d is not None)
        numel = math.prod(shape)
        if numel > MAX_ELEMENTS:
            raise self._err(dt, f"{dt!s}{list(shape)} has {numel:.3g} elements, more than parcomp's "
                                f"limit of 2^48 ({MAX_ELEMENTS:.3g}, a petabyte of float32): "
                                f"check the dims for a typo")
        return TensorType(shape, DTYPE_LONG[str(dt)])

    def rep(self):
        return make_placement("R")

    def shard(self, d):
        return make_placement("S", self._int(d, "the dim of S(d)"))

    def partial(self, op):
        try:
            return make_placement("P", None if op is None else str(op))
        except ValueError as e:
            raise self._err(op, str(e)) from None

    def layout(self, *ps):
        return tuple(p for p in ps if p is not None)

    def number(self, tok):
        s = str(tok)
        if not any(c in s for c in ".eE"):
            return self._int(tok, "the number")
        x = float(s)
        if not math.isfinite(x):
            raise self._err(tok, f"the number {s} is not finite in float64 (which holds at most "
                                 f"1.8e308); an attribute must be a finite number")
        return x

    def string(self, tok):
        try:
            s = json.loads(str(tok), strict=False)  # strict=False: a raw tab is a tab
        except json.JSONDecodeError as e:
            bad = str(tok)[e.pos:e.pos + 2]
            raise self._err(tok, f"unknown escape `{bad}` in a string; the escapes are {_ESCAPES}",
                            e.pos) from None
        half = re.search("[\ud800-\udfff]", s)
        if half:
            raise self._err(tok, f"the string holds half a surrogate pair "
                                 f"(\\u{ord(half.group()):04x}); write the character itself")
        return s

    def true(self):
        return True

    def false(self):
        return False

    def tuple(self, *xs):
        return tuple(self._int(x, "a tuple entry") for x in xs if x is not None)

    def attr(self, k, v):
        return (k, v)

    def attrs(self, *kv):
        kv = [x for x in kv if x is not None]
        seen = set()
        for k, _ in kv:
            if str(k) in seen:
                raise self._err(k, f"attribute {k} is given twice")
            seen.add(str(k))
        return tuple(sorted(((str(k), v) for k, v in kv), key=lambda x: x[0]))

    def retval(self, val, name):
        return (val, str(val)[1:] if name is None else str(name))

    def ret(self, *vals):
        vals = [v for v in vals if v is not None]
        names = [n for _, n in vals]
        for (tok, n) in vals:
            if names.count(n) > 1:
                raise self._err(tok, f"output name {n!r} is given twice; use `as NAME` to tell "
                                     f"them apart")
        return ("return", tuple(str(v)[1:] for v, _ in vals), [v for v, _ in vals], tuple(names))

    def arg(self, val, layout):
        return (str(val)[1:], layout)

    def args(self, *pairs):
        return tuple(p for p in pairs if p is not None)

    def line(self, name, ty, layout, op, args, attrs):
        if str(op) not in OPS:
            raise self._err(op, f"unknown op {op!s}")
        names = tuple(a for a, _ in args)
        ins = tuple(lay for _, lay in args)
        if any(lay is None for lay in ins) and any(lay is not None for lay in ins):
            raise self._err(name, "give a layout for every operand or for none")
        in_layouts = ins if ins and ins[0] is not None else None
        return (Node(str(name)[1:], str(op), names, ty, attrs or (), layout, in_layouts), name)

    def start(self, *items):
        heads, nodes, toks = {}, [], {}
        for it in items:
            if it[0] in ("mesh", "stage"):
                if it[0] in heads:
                    raise self._err(it[2], f"a second {it[0]} line (the first is on line "
                                           f"{heads[it[0]][2].line})", at_line=True)
                heads[it[0]] = it
            elif it[0] == "return":
                outs, otoks, names = it[1], it[2], it[3]
            else:
                node, tok = it
                if node.name in toks:
                    raise self._err(tok, f"value %{node.name} is defined twice")
                for a in node.inputs:
                    if a not in toks:
                        raise self._err(tok, f"%{node.name} uses %{a} before it is defined")
                toks[node.name] = tok
                nodes.append(node)
        for o, t in zip(outs, otoks):
            if o not in toks:
                raise self._err(t, f"return of undefined value %{o}")
        mesh = heads["mesh"][1] if "mesh" in heads else None
        stage = heads["stage"][1] if "stage" in heads else "global"
        return Graph(tuple(nodes), outs, mesh, stage, names)


def _is_empty(lines) -> bool:
    return all(not ln.strip() or ln.lstrip().startswith("#") for ln in lines)


def _code(line: str):
    """``(code, strings)`` of one line: ``code`` with strings blanked and the comment cut,
    ``strings``: the columns (0-based) of opening quotes with no closing quote."""
    out, i, unclosed = [], 0, []
    while i < len(line):
        c = line[i]
        if c == "#":
            break
        if c == '"':
            j = i + 1
            while j < len(line) and line[j] != '"':
                j += 2 if line[j] == "\\" else 1
            if j >= len(line):
                unclosed.append(i)
                break
            out.append('"' + " " * (j - i - 1) + '"')
            i = j + 1
            continue
        out.append(c)
        i += 1
    return "".join(out), unclosed


def _prescan(lines: list, file: str) -> None:
    """Errors the grammar would report badly: a non-ASCII character in a name, a string with
    no closing quote, a second ``return`` line (IRParseError at the spot)."""
    returns = []
    for k, line in enumerate(lines):
        code, unclosed = _code(line)
        if unclosed:
            raise IRParseError('this string has no closing quote `"` (a string ends on its line)',
                               SourceLoc(file, k + 1, unclosed[0] + 1, line))
        for col, c in enumerate(code):
            if not c.isascii():
                msg = bad_char(c, code[col - 1] if col else "", _ALPHABET, _NAME_CHARS,
                               "outside strings and comments")
                if col and (code[col - 1] == "%" or code[col - 1] in "_.-"):
                    msg = f"the character {char_name(c)} is not allowed in a name; {_NAME_CHARS}"
                raise IRParseError(msg or f"the character {char_name(c)} is not allowed here",
                                   SourceLoc(file, k + 1, col + 1, line))
        if code.lstrip().startswith("return") and code.lstrip()[6:7] in ("", " ", "\t", "%"):
            returns.append(k)
    if len(returns) > 1:
        at = returns[1]
        raise IRParseError(f"`return` must be the last line, and it appears twice (lines "
                           f"{returns[0] + 1} and {at + 1}); return every output on one line: "
                           f"`return %a, %b`", SourceLoc(file, at + 1, 1, lines[at]))


def parse_graph(text: str, file: str = "<string>") -> Graph:
    """Parse ``.pcir`` text (a leading byte order mark is skipped).

    Raises:
        IRParseError: at ``file:line:col``: an empty file, a syntax error (in
            words), a bad character, a bad string escape, a number too large, an
            unknown op or dtype, a value used before or defined twice, a repeated
            mesh/stage line, attribute or output name, a bad mesh axis size.
    """
    text = text[1:] if text.startswith("\ufeff") else text
    lines = source_lines(text)
    if _is_empty(lines):
        raise IRParseError("the file is empty: a .pcir has one line per value, "
                           "`%name: dtype[shape] = op(%operands)`, and ends with `return %value` "
                           "(see specs/tiny_relu_mlp.pcir)", SourceLoc(file, 1, 1, ""))
    _prescan(lines, file)
    try:
        tree = _PARSER.parse(text)
    except UnexpectedInput as e:
        raise _syntax_error(e, file, lines) from None
    try:
        return _Build(file, lines).transform(tree)
    except VisitError as e:
        if isinstance(e.orig_exc, IRParseError):
            raise e.orig_exc from None
        meta = getattr(e.obj, "meta", e.obj)  # a Tree's meta, or the Token itself
        line = min(max(getattr(meta, "line", 1) or 1, 1), len(lines))
        where = SourceLoc(file, line, getattr(meta, "column", 1) or 1, lines[line - 1])
        raise IRParseError(f"cannot read this {e.rule}: {type(e.orig_exc).__name__}: "
                           f"{e.orig_exc}", where) from None
