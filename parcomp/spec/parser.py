"""Parser of the parallel spec language (``.pcs``), grammar in ``grammar.lark``.

Lark (LALR, contextual lexer) builds the tree; :class:`_Tree` turns it into raw
statements that still carry their tokens; :class:`_Builder` checks them against
the mesh and makes the frozen :class:`~parcomp.spec.model.Spec`.  Every problem
is a :class:`~parcomp.errors.SpecError` at ``file:line:col`` with a caret; a
syntax error says in words (:data:`WORDS`, one phrase per grammar terminal) what
was expected, a character that cannot be in a name says which one.  A leading
UTF-8 byte order mark is skipped.
"""
from __future__ import annotations

import json
import re
from importlib import resources

from lark import Lark, Token, Transformer, UnexpectedCharacters, UnexpectedInput, v_args
from lark.exceptions import VisitError

from ..errors import SourceLoc, SpecError, bad_char, char_name, closest, join_words, source_lines
from ..ir.types import Mesh, R, make_placement
from ..links import LINK_KEYS, LINKS
from ..memory import parse_size
from ..passes.train_config import train_config
from .model import (LAYOUT_WORDS, LayoutSpec, Rule, Spec, TrainSpec, check_mesh_size, default_axis,
                    suggest)
from .stages import make_stage, check_stages
from .ctxpar import make_context_parallel  # context parallel (issue 14)
from .moe import make_moe  # MoE capacity policy (issue 14)

_GRAMMAR = resources.files(__package__).joinpath("grammar.lark").read_text(encoding="utf-8")
_PARSER = Lark(_GRAMMAR, parser="lalr", propagate_positions=True, maybe_placeholders=True)

_WORDS = ", ".join(LAYOUT_WORDS)
_LAYOUT = (f"a layout: a layout word ({_WORDS}), a placement R, S(d) or P, "
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
    "CTXPAR": "'context-parallel'",  # context parallel (issue 14)
    "MOE": "'moe'",  # MoE capacity policy (issue 14)
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
_TOPOLOGY = ("nodes", "devices_per_node")
# how program.py runs on a cluster (issue 16): key -> the words it takes, or None: whole seconds
_LAUNCH_KEYS = {"placement": ("refuse", "warn"), "timeout": None}
MAX_TIMEOUT_S = 10_000_000  # seconds (~116 days): program.py's --timeout takes at most this
_NAME_PHRASES = {"mesh": "a mesh axis such as tp=2", "topology": "nodes=N, devices_per_node=N or intra=nvlink",
                 "train": "an option such as batch=8"}


def _hint(name: str, known) -> str:
    """``"; did you mean X?"`` for the closest of ``known``, or ``""``."""
    near = closest(name, known)
    return f"; did you mean {near}?" if near else ""


def _int(tok, file: str, lines: list) -> int:
    """``int(tok)``; a SpecError at the token when it has more than :data:`MAX_DIGITS` digits."""
    digits = str(tok).lstrip("+-").lstrip("0")
    if len(digits) > MAX_DIGITS:
        raise SpecError(f"this number has {len(digits)} digits; at most {MAX_DIGITS}",
                        _loc(file, lines, getattr(tok, "line", 1), getattr(tok, "column", 1)))
    return int(str(tok))


def _show(tok, most: int = 60) -> str:
    """``repr`` of a token, cut to ``most`` characters."""
    s = str(tok)
    return repr(s) if len(s) <= most else repr(s[:most]) + "..."


def _loc(file: str, lines: list, line: int, col: int) -> SourceLoc:
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


def _syntax_error(e: UnexpectedInput, file: str, lines: list) -> SpecError:
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
            return SpecError(problem, _loc(file, lines, line, col))
        got = f"the character {char_name(c)}" if c else "input"
    else:
        got = WORDS[tok.type] if tok.type in ("_NL", "$END") else _show(tok)
    msg = f"expected {_expected(exp, text, col)}; got {got}" if exp else f"unexpected {got}"
    if tok is not None and str(tok).startswith(".") and col > 1 and text[col - 2].isalnum():
        start = col - 1  # 'output=a.0': '.0' read as a number; the whole name must be quoted
        while start > 0 and (text[start - 1].isalnum() or text[start - 1] in "_."):
            start -= 1
        name = text[start:col - 1] + str(tok)
        msg += f" (a name with a number after a dot is written quoted: \"{name}\")"
    size = _memory_value(text, col)
    if size:  # 'memory 80 GiB', 'memory 80GiBs': the whole value, not its first token
        col, msg = size[0], f"expected {WORDS['MEMSIZE']}; got {_show(size[1])}"
    word = text.split("#", 1)[0].split()[:1]
    near = closest(word[0], _KEYWORDS) if word and word[0] not in _KEYWORDS else None
    if near:  # 'trian loss=mse' read as a rule for the name 'trian': say the likely typo first
        col = len(text) - len(text.lstrip()) + 1
        msg = f"'{word[0]}' is not a statement; did you mean '{near}'? (read as a rule, {msg})"
    return SpecError(msg, _loc(file, lines, line, col))


#: the statements whose payload is ``key=value`` options (each key at most once: _Builder.no_repeats)
_OPTION_STATEMENTS = ("train", "moe", "context-parallel", "topology")
_KEYWORDS = ("mesh", "topology", "memory", "train", "stage", "sequence-parallel")


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


class _Tree(Transformer):
    """Lark tree -> raw statements ``(kind, first token, payload)`` with tokens kept."""

    def __init__(self, file: str, lines: list):
        super().__init__()
        self.file, self.lines = file, lines

    def start(self, c):
        return list(c)

    def _statement(kind):  # noqa: N805 - a method factory, used in the class body only
        return lambda self, c: (kind, c[0], c[1:])

    mesh, topology, train = _statement("mesh"), _statement("topology"), _statement("train")
    memory, seqpar = _statement("memory"), _statement("sequence-parallel")
    ctxpar = _statement("context-parallel")  # context parallel (issue 14)
    moe = _statement("moe")  # MoE capacity policy (issue 14)
    stage = _statement("stage")
    del _statement

    def pair(self, c):
        return (c[0], c[1])

    mesh_axis = topo_item = option = kwarg = axis_place = pair

    def first(self, c):
        return c[0]

    scalar = target = lword = stage_item = first

    def number(self, c):
        s = str(c[0])  # a whole number of thousands of digits is a float (inf), checked later
        return int(s) if s.lstrip("+-").isdigit() and len(s) < 400 else float(s)

    def name(self, c):
        return str(c[0])

    def string(self, c):
        return json.loads(str(c[0]))

    def call(self, c):
        return (c[0], [kv for kv in c[1:] if kv is not None])

    def rule(self, c):
        return ("rule", c[0] if c[0] is not None else c[1], (c[0], c[1], c[2]))

    def word_layout(self, c):
        return ("word", c[0], c[1])

    @v_args(meta=True)
    def list_layout(self, meta, c):
        return ("list", Token("LSQB", "[", line=meta.line, column=meta.column), c)

    def axis_layout(self, c):
        return ("axes", None, c)

    def over(self, c):
        return c[1]

    def rep(self, c):
        return make_placement("R")

    def shard(self, c):
        return make_placement("S", _int(c[1], self.file, self.lines))

    def partial(self, c):
        try:
            return make_placement("P", None if c[1] is None else str(c[1]))
        except ValueError as e:
            raise SpecError(str(e), _loc(self.file, self.lines, c[1].line, c[1].column)) from None


class _Builder:
    """Checks raw statements against the mesh and builds the :class:`Spec`."""

    def __init__(self, file: str, lines: list):
        self.file, self.lines = file, lines

    def loc(self, tok) -> SourceLoc:
        return _loc(self.file, self.lines, tok.line, tok.column)

    def err(self, tok, msg) -> SpecError:
        return SpecError(msg, self.loc(tok))

    def err_at(self, loc, msg) -> SpecError:
        return SpecError(msg, loc)

    def build(self, stmts: list) -> Spec:
        if not stmts:
            raise SpecError("the spec is empty: it has no statements, so no mesh statement; "
                            "start it with one such as 'mesh tp=2'",
                            _loc(self.file, self.lines, 1, 1))
        kind, tok, _ = stmts[0]
        if kind != "mesh":
            raise self.err(tok, "the first statement must be the mesh, such as 'mesh tp=2' "
                                "(one size per axis; the last axis varies fastest)")
        self.mesh = self.make_mesh(stmts[0][2])
        seen, rules, topology, train, links, memory, stages = {"mesh": tok}, [], None, None, (), None, []
        seqpar = ctxpar = moe = None
        for kind, tok, payload in stmts[1:]:
            if kind == "stage":
                stages.append(make_stage(self, tok, payload, stages))
            elif kind != "rule":
                if kind in seen:
                    raise self.err(tok, f"{kind} is given twice (first on line {seen[kind].line}); "
                                        f"a spec has at most one {kind} statement")
                seen[kind] = tok
            if kind in _OPTION_STATEMENTS:
                self.no_repeats(kind, payload)
            if kind == "topology":
                topology, links = self.make_topology(tok, payload)
            elif kind == "memory":
                memory = parse_size(str(payload[0]), lambda m: self.err(payload[0], m))
            elif kind == "stage":
                pass
            elif kind == "sequence-parallel":  # transformer SP (issue 17)
                seqpar = (default_axis(self.mesh) if payload[0] is None
                          else self.axis(payload[0], "'sequence-parallel over'"), self.loc(tok))
            elif kind == "context-parallel":  # context parallel attention (issue 14)
                ctxpar = make_context_parallel(self, tok, payload)
            elif kind == "moe":  # MoE capacity policy (issue 14)
                moe = make_moe(self, tok, payload)
            elif kind == "train":
                train = TrainSpec(self.options(payload, "option"), self.loc(tok))
                train_config(Spec(self.mesh, (), self.file, train=train))  # options and ranges
            else:
                rules.append(self.make_rule(*payload))
        topo_loc = self.loc(seen["topology"]) if "topology" in seen else None
        return Spec(self.mesh, tuple(rules), self.file, topology, train, topo_loc, links, memory,
                    self.loc(seen["memory"]) if "memory" in seen else None,
                    check_stages(self, stages, train),
                    launch=getattr(self, "launch", ()), sequence_parallel=seqpar,
                    context_parallel=ctxpar, moe=moe)

    def make_mesh(self, axes) -> Mesh:
        check_mesh_size(axes, self.err)
        names = {}
        for name, size in axes:
            _int(size, self.file, self.lines)
            if str(name) in names:
                raise self.err(name, f"mesh axis {name} is given twice (axis names must differ)")
            if int(size) < 1:
                raise self.err(size, f"mesh axis {name} has size {int(size)}; a size must be >= 1")
            names[str(name)] = int(size)
        return Mesh(tuple(names.items()))

    def make_topology(self, tok, items) -> tuple:
        """``((nodes, devices_per_node) or None, link pairs)``: node keys need both or neither."""
        vals, links = {}, {}
        items = self.launch_keys(items)
        for key, val in items:
            k = str(key)
            if k not in _TOPOLOGY and k not in LINK_KEYS:
                keys = (*_TOPOLOGY, *LINK_KEYS, *_LAUNCH_KEYS)
                raise self.err(key, f"unknown topology key {k!r}{_hint(k, keys)} (keys: {', '.join(keys)})")
            links_key = k in LINK_KEYS
            self.check_topo_value(k, val, LINK_KEYS.get(k, "a count"))
            (links if links_key else vals)[k] = str(val) if val.type == "NAME" else int(val)
        if not vals and (links or self.launch):
            return None, tuple(sorted(links.items()))
        if len(vals) != 2:
            raise self.err(tok, "topology needs both nodes=N and devices_per_node=N")
        nodes, per = vals["nodes"], vals["devices_per_node"]
        if nodes * per != self.mesh.size:
            raise self.err(tok, f"topology has {nodes}x{per}={nodes * per} devices but mesh "
                                f"{self.mesh} has {self.mesh.size} ranks")
        return (nodes, per), tuple(sorted(links.items()))

    def launch_keys(self, items) -> list:
        """The topology items other than ``placement=refuse|warn`` and ``timeout=SECONDS``,
        which go to ``self.launch`` (sorted pairs; the emitted program's defaults)."""
        rest, launch = [], {}
        for key, val in items:
            k = str(key)
            if k not in _LAUNCH_KEYS:
                rest.append((key, val))
                continue
            words = _LAUNCH_KEYS[k]
            if words and str(val) not in words:
                raise self.err(val, f"topology {k}={val}: give {' or '.join(words)}")
            if not words:
                self.check_topo_value(k, val, "seconds")
                if _int(val, self.file, self.lines) > MAX_TIMEOUT_S:  # program.py's --timeout bound
                    raise self.err(val, f"topology {k}={val}: at most {MAX_TIMEOUT_S:_} seconds")
            launch[k] = str(val) if words else int(val)
        self.launch = tuple(sorted(launch.items()))
        return rest

    def check_topo_value(self, key, val, wants: str) -> None:
        """A topology value of the right kind: a link class name, or a whole number >= 1."""
        if wants == "a link class":
            if val.type != "NAME" or str(val) not in LINKS:
                raise self.err(val, f"topology {key}={val}: not a link class{_hint(str(val), LINKS)} "
                                    f"(classes: {', '.join(LINKS)})")
            return
        if val.type == "NAME":
            raise self.err(val, f"topology {key}={val}: give a whole number ({wants}), such as {key}=2")
        _int(val, self.file, self.lines)
        if int(val) < 1:
            raise self.err(val, f"topology {key} is {int(val)}; it must be >= 1")

    def no_repeats(self, kind: str, payload) -> None:
        """Every ``key=value`` option of a statement once: ``context-parallel lowering=ring
        lowering=all_to_all`` is an error at the second ``lowering``, never "the last one wins".

        Raises:
            SpecError: at the repeated key, naming the column of the first.
        """
        first = {}
        for item in payload:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], Token)):
                continue  # 'over AXIS' of context-parallel, a memory size
            k = str(item[0])
            if k in first:
                raise self.err(item[0], f"{kind} option {k} is given twice (first at column "
                                        f"{first[k].column}); give it once")
            first[k] = item[0]

    def options(self, items, what: str) -> tuple:
        out = {}
        for key, val in items:
            if str(key) in out:
                raise self.err(key, f"{what} {key} is given twice")
            if isinstance(val, tuple):  # a call: name(k=v, ...)
                val = (str(val[0]), self.options(val[1], "argument"))
            out[str(key)] = val
        return tuple(sorted(out.items()))

    def axis(self, tok, where: str) -> str:
        names = self.mesh.names
        if str(tok) not in names:
            raise self.err(tok, f"unknown mesh axis {str(tok)!r} in {where}{_hint(str(tok), names)}"
                                f" (the mesh has axes: {', '.join(names)})")
        return str(tok)

    def axes_text(self) -> str:
        n = len(self.mesh.axes)
        return f"the mesh has {n} {'axis' if n == 1 else 'axes'}: {', '.join(self.mesh.names)}"

    def make_rule(self, target, pattern, layout) -> Rule:
        pat = str(pattern)
        if "" in pat.split("."):
            raise self.err(pattern, f"pattern {pat!r} has an empty dotted component")
        return Rule(str(target) if target is not None else "param", pat,
                    self.make_layout(layout), self.loc(pattern))

    def make_layout(self, layout) -> LayoutSpec:
        form, tok, body = layout
        naxes = len(self.mesh.axes)
        if form == "word":
            axis = default_axis(self.mesh) if body is None else self.axis(body, "'over'")
            if isinstance(tok, Token):
                if str(tok) not in LAYOUT_WORDS:
                    raise self.err(tok, f"unknown layout word {str(tok)!r}"
                                        f"{_hint(str(tok), LAYOUT_WORDS)} "
                                        f"(layout words: {_WORDS}; placements: R, S(d), P)")
                return LayoutSpec(str(tok), None, axis)
            full = [R] * naxes
            full[self.mesh.axis_index(axis)] = tok
            return LayoutSpec(None, tuple(full), axis)
        if form == "list":
            if len(body) != naxes:
                raise self.err(tok, f"the layout has {len(body)} placement"
                                    f"{'' if len(body) == 1 else 's'} but {self.axes_text()} "
                                    "(one placement per axis, in mesh order)")
            return LayoutSpec(None, tuple(body), None)
        given = {}
        for name, placement in body:
            axis = self.axis(name, "an axis=placement layout")
            if axis in given:
                raise self.err(name, f"mesh axis {axis} is given twice in the layout")
            given[axis] = placement
        return LayoutSpec(None, tuple(given.get(a, R) for a in self.mesh.names), None)


def parse_spec(text: str, file: str = "<string>") -> Spec:
    """Parse the text of a ``.pcs`` spec into a :class:`Spec`.

    Raises:
        SpecError: a syntax error (saying what was expected), an unknown layout
            word or mesh axis, a layout with the wrong number of placements, a
            missing, misplaced or repeated ``mesh``, a bad mesh axis size or a
            repeated axis name, a bad ``topology``, a repeated ``train`` or a
            train option out of its range (see :mod:`parcomp.passes.train_config`).
    """
    text = text[1:] if text.startswith("\ufeff") else text
    lines = source_lines(text)
    try:
        tree = _PARSER.parse(text if text.endswith("\n") else text + "\n")
    except UnexpectedInput as e:
        raise _syntax_error(e, file, lines) from None
    try:
        stmts = _Tree(file, lines).transform(tree)
    except VisitError as e:
        if isinstance(e.orig_exc, SpecError):
            raise e.orig_exc from None
        meta = getattr(e.obj, "meta", e.obj)  # a Tree's meta, or the Token itself
        raise SpecError(f"cannot read this {e.rule}: {type(e.orig_exc).__name__}: {e.orig_exc}",
                        _loc(file, lines, getattr(meta, "line", 1), getattr(meta, "column", 1))
                        ) from None
    return _Builder(file, lines).build(stmts)


def load_spec(path) -> Spec:
    """Read and parse the spec file at ``path``.

    Raises:
        SpecError: the file cannot be read (naming the path), or any error of
            :func:`parse_spec`.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise SpecError(f"spec file {str(path)!r} does not exist", where=str(path)) from None
    except UnicodeDecodeError as e:
        raise SpecError(f"spec file {str(path)!r} is not UTF-8 text: byte 0x{e.object[e.start]:02x}"
                        f" at offset {e.start}", where=str(path)) from None
    except OSError as e:
        raise SpecError(f"cannot read spec file {str(path)!r}: {e.strerror or e}",
                        where=str(path)) from None
    return parse_spec(text, str(path))


def check_names(spec: Spec, param_names, input_names, output_names, value_names) -> None:
    """Check that every rule of ``spec`` matches at least one name of its kind in the model.

    ``param`` rules are matched against ``param_names``, ``input`` against
    ``input_names``, ``output`` against ``output_names``, ``activation``
    against ``value_names`` (the model's intermediate values).

    Raises:
        SpecError: at the first rule (in file order) that matches nothing, with
            "did you mean X?" when a close name exists, else the known names.
    """
    kinds = {"param": ("parameter", param_names), "input": ("input", input_names),
             "output": ("output", output_names), "activation": ("value", value_names)}
    for rule in spec.rules:
        noun, names = kinds[rule.target]
        names = list(names)
        if any(rule.matches(n) for n in names):
            continue
        msg = f"{rule.target} rule {_show(rule.pattern)} matches no {noun} of the model"
        hint = suggest(rule.pattern, names)
        if hint:
            msg += f"; did you mean {hint}?"
        elif names:
            more = f", ... ({len(names)} in all)" if len(names) > 8 else ""
            msg += f" (the model's {noun}s: {', '.join(names[:8])}{more})"
        else:
            msg += f" (the model has no {noun}s)"
        if "*" in rule.pattern and "**" not in rule.pattern and any("." in n for n in names):
            msg += "; `*` stops at a `.` and `**` crosses it (`**.weight`, `h.*.mlp.**`)"
        msg += _onnx_renamed(rule.target, names)
        raise SpecError(msg, rule.loc)


def _onnx_renamed(target: str, names: list) -> str:
    """A note when an ONNX model's weights carry generated names (``val_12``): torch.onnx's
    dynamo exporter with ``optimize=True`` (its default) renames the weights it folds, so a
    rule written with the module's names matches nothing (a new-user trial finding)."""
    made = [n for n in names if re.fullmatch(r"val_\d+", n)]
    if target != "param" or not made:
        return ""
    return (f"; {len(made)} of the model's weights have generated names such as {made[0]}: "
            f"torch.onnx.export(..., dynamo=True) with optimize=True (the default) renames the weights "
            f"it folds; export with optimize=False to keep the module names")
