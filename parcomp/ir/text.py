"""The one textual form of the IR (``.pcir``): printer and lark parser side by side.

Example::

    mesh tp=2
    %x: f32[8,16] <R> = input()
    %fc1.weight: f32[16,64] <S(1)> = param()
    %h: f32[8,64] <S(1)> = matmul(%x, %fc1.weight)
    %y: f32[8,64] <S(1)> = gelu(%h) {approximate="tanh"}
    return %y

A ``param`` training must never update (a buffer, a frozen parameter) carries
``{trainable=false}``.

The printer is canonical: the same graph always gives the same bytes
(attributes sorted, floats by ``repr``).  ``parse_graph(print_graph(g)) == g``
is a hypothesis property in the tests.
"""
from __future__ import annotations

import json

from lark import Lark, Transformer, UnexpectedInput, v_args

from ..errors import IRParseError, SourceLoc
from .graph import Graph, Node
from .ops import OPS
from .types import DTYPE_LONG, DTYPE_SHORT, Mesh, P, R, Shard, TensorType

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
layout: "<" [placement ("," placement)*] ">"
placement: "R"              -> rep
         | "S" "(" INT ")"  -> shard
         | "P" ("(" "sum" ")")? -> partial
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


def _fmt_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, tuple):
        return "(" + ", ".join(str(int(x)) for x in v) + ("," if len(v) == 1 else "") + ")"
    raise TypeError(f"attribute value {v!r} has no text form")


def _fmt_layout(layout) -> str:
    return "<" + ", ".join(str(p) for p in layout) + ">"


def print_node(n: Node) -> str:
    """One node as one line of ``.pcir`` text."""
    lay = "" if n.layout is None else " " + _fmt_layout(n.layout)
    if n.in_layouts is None:
        args = ", ".join("%" + i for i in n.inputs)
    else:
        args = ", ".join(f"%{i} {_fmt_layout(lay)}" for i, lay in zip(n.inputs, n.in_layouts))
    attrs = ""
    if n.attrs:
        attrs = " {" + ", ".join(f"{k}={_fmt_value(v)}" for k, v in n.attrs) + "}"
    return f"%{n.name}: {n.type}{lay} = {n.op}({args}){attrs}"


def print_graph(g: Graph) -> str:
    """Canonical text of ``g`` (ends with a newline)."""
    lines = []
    if g.mesh is not None and g.mesh.axes:
        lines.append("mesh " + str(g.mesh))
    if g.stage != "global":
        lines.append(f"stage {g.stage}")
    lines += [print_node(n) for n in g.nodes]
    lines.append("return " + ", ".join(
        "%" + v + ("" if v == name else f" as {name}") for name, v in g.named_outputs()))
    return "\n".join(lines) + "\n"


@v_args(inline=True)
class _Build(Transformer):
    def __init__(self, file, text):
        super().__init__()
        self.file, self.lines = file, text.splitlines()

    def axis(self, name, size):
        return (str(name), int(size))

    def mesh(self, *axes):
        return ("mesh", Mesh(tuple(axes)))

    def stage(self, name):
        return ("stage", str(name))

    def type(self, dt, *dims):
        if str(dt) not in DTYPE_LONG:
            raise self._err(dt, f"unknown dtype {dt!s}; known: {', '.join(DTYPE_SHORT.values())}")
        return TensorType(tuple(int(d) for d in dims if d is not None), DTYPE_LONG[str(dt)])

    def rep(self):
        return R

    def shard(self, d):
        return Shard(int(d))

    def partial(self):
        return P

    def layout(self, *ps):
        return tuple(p for p in ps if p is not None)

    def number(self, tok):
        s = str(tok)
        return float(s) if any(c in s for c in ".eEn") else int(s)

    def string(self, tok):
        return json.loads(str(tok))

    def true(self):
        return True

    def false(self):
        return False

    def tuple(self, *xs):
        return tuple(int(x) for x in xs if x is not None)

    def attr(self, k, v):
        return (str(k), v)

    def attrs(self, *kv):
        return tuple(sorted(x for x in kv if x is not None))

    def retval(self, val, name):
        return (val, str(val)[1:] if name is None else str(name))

    def ret(self, *vals):
        vals = [v for v in vals if v is not None]
        return ("return", tuple(str(v)[1:] for v, _ in vals), [v for v, _ in vals],
                tuple(n for _, n in vals))

    def _err(self, tok, msg):
        line = getattr(tok, "line", 1) or 1
        text = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        return IRParseError(msg, SourceLoc(self.file, line, getattr(tok, "column", 1) or 1, text))

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
        mesh, stage, nodes, toks = None, "global", [], {}
        for it in items:
            if it[0] == "mesh":
                mesh = it[1]
            elif it[0] == "stage":
                stage = it[1]
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
        return Graph(tuple(nodes), outs, mesh, stage, names)


def parse_graph(text: str, file: str = "<string>") -> Graph:
    """Parse ``.pcir`` text. Raises :class:`IRParseError` with file:line:col."""
    try:
        tree = _PARSER.parse(text)
    except UnexpectedInput as e:
        line = e.line if e.line and e.line > 0 else 1
        lines = text.splitlines()
        src = lines[line - 1] if 0 < line <= len(lines) else ""
        raise IRParseError(_describe_unexpected(e), SourceLoc(file, line, e.column or 1, src)) from None
    from lark.exceptions import VisitError

    try:
        return _Build(file, text).transform(tree)
    except VisitError as e:
        if isinstance(e.orig_exc, IRParseError):
            raise e.orig_exc from None
        raise


def _describe_unexpected(e) -> str:
    tok = getattr(e, "token", None)
    exp = sorted(getattr(e, "expected", None) or getattr(e, "allowed", None) or [])
    what = f"unexpected {tok!s:.20}" if tok is not None else "unexpected input"
    return what + (f" (expected one of: {', '.join(exp[:8])})" if exp else "")
