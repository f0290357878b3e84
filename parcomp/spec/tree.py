"""Lark tree of a ``.pcs`` spec -> raw statements ``(kind, first token, payload)``
that still carry their tokens (for located errors); :mod:`.builder` checks them."""
from __future__ import annotations

import json

from lark import Token, Transformer, v_args

from ..errors import SpecError
from ..ir.types import make_placement
from .syntax import spec_int, source_loc


class SpecTree(Transformer):
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
    ctxpar = _statement("context-parallel")  # context parallel
    moe = _statement("moe")  # MoE capacity policy
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
        return make_placement("S", spec_int(c[1], self.file, self.lines))

    def partial(self, c):
        try:
            return make_placement("P", None if c[1] is None else str(c[1]))
        except ValueError as e:
            raise SpecError(str(e), source_loc(self.file, self.lines, c[1].line, c[1].column)) from None
