"""Stamping: a stage graph of the reduced model (``M`` blocks) -> the same stage for ``N``.

In the reduced model block ``t = M-2`` is the *template* (a block with a block before and
after it) and ``M-1`` the last. Every name of every stage is made of *tokens* of the input
graph's names (``addmm_4`` in ``bw.addmm_4_mm.permute_2``, ``transformer.h.1`` in
``opt.transformer.h.1.mlp.c_fc.bias.mul``); a token belongs to block ``b`` when it names a
node of window ``b`` or is ``<prefix>.<b>``. A node is *owned* by the block of the first
token of its name (none: prefix, suffix, loss, step). The N-block stage is the reduced one
with:

- nodes owned by blocks ``< t`` kept as they are;
- each maximal run of template nodes kept, and ``N-M`` copies of it inserted next to it,
  copy ``j`` (``t+1..N-2``) with every token of blocks ``t-1, t, t+1`` shifted by ``j-t``
  (to the same position of window ``j-1, j, j+1``), after the run where the run's neighbours
  say the blocks ascend there (forward, optimizer), before it where they descend (backward);
- every other node with the tokens of blocks ``t, t+1`` shifted by ``N-M`` (the last block
  becomes ``N-1``; the suffix reads it).

Names in string attributes (``frees="..."``, ``reason="..."``) and module paths
(``source``) are renamed alike. :func:`stamp` returns None where the result is not a
well-formed SSA graph (a run whose direction its neighbours do not tell, a name made twice, a
value read before it is made); the caller then compiles the whole graph.
"""
from __future__ import annotations

import re

from .ir.graph import Graph, evolve
from .repeat import Blocks

_WORD = re.compile(r"[A-Za-z0-9_.]*")


class Stamper:
    """Tokens of the reduced model's blocks and their names in the full model."""

    def __init__(self, blocks: Blocks, m: int):
        self.blocks, self.m, self.t = blocks, m, m - 2
        self.block_of = {}  # token -> block (reduced index)
        self.pos = {}  # token -> position in its window, or None for the block tag
        for b in range(1, m):  # block 0's fx names have no counter (``addmm``, ``layer_norm``)
            for k, name in enumerate(blocks.window(b)):
                self.block_of[name], self.pos[name] = b, k
            tag = blocks.block_tag(b)
            self.block_of[tag], self.pos[tag] = b, None
        alts = "|".join(re.escape(s) for s in sorted(self.block_of, key=len, reverse=True))
        self._re = re.compile(rf"(?<![A-Za-z0-9_])(?:{alts})(?![0-9]|_[0-9])")
        self._parts = {}  # string -> (pieces, token indices)

    def parts(self, s: str) -> tuple:
        """``s`` split into literal pieces and tokens: ``(pieces, odd indices are tokens)``.
        A word (a run of name characters) has at most one token, its first: the rest of a
        derived name is the pass's own (``bw.addmm_5_mm.permute_2``)."""
        got = self._parts.get(s)
        if got is None:
            pieces, last = [], 0
            for mt in self._re.finditer(s):
                if last and _WORD.fullmatch(s, last, mt.start()):
                    continue  # a second token in one word
                pieces += [s[last:mt.start()], mt.group(0)]
                last = mt.end()
            pieces.append(s[last:])
            got = self._parts[s] = tuple(pieces)
        return got

    def owner(self, name: str):
        """The block owning node ``name`` (its first token's), or None."""
        p = self.parts(name)
        return self.block_of[p[1]] if len(p) > 1 else None

    def shift_map(self, of_blocks, by: int) -> dict:
        """token -> its name ``by`` blocks later, for the tokens of ``of_blocks``."""
        out = {}
        for tok, b in self.block_of.items():
            if b in of_blocks:
                k = self.pos[tok]
                out[tok] = (self.blocks.block_tag(b + by) if k is None
                            else self.blocks.window(b + by)[k])
        return out


def _renamer(st: Stamper, mapping: dict):
    cache = {}

    def rn(s):
        got = cache.get(s)
        if got is None:
            p = st.parts(s)
            got = s if len(p) == 1 else "".join(mapping.get(x, x) if i % 2 else x for i, x in enumerate(p))
            cache[s] = got
        return got

    def node(x):
        attrs = x.attrs
        if any(type(v) is str for _, v in attrs):
            attrs = tuple((k, rn(v) if type(v) is str else v) for k, v in attrs)
        return evolve(x, name=rn(x.name), inputs=tuple(rn(i) for i in x.inputs), attrs=attrs,
                      source=rn(x.source) if x.source else x.source)
    return node, rn


def stamp(st: Stamper, graph: Graph, n: int, **kw) -> Graph | None:
    """The ``n``-block version of ``graph`` (a stage of the reduced model), or None where
    the stamp does not fit (see the module docstring). ``kw`` replace Graph fields."""
    t, m = st.t, st.m
    last_node, last_name = _renamer(st, st.shift_map((t, t + 1), n - m))
    maps = [_renamer(st, st.shift_map((t - 1, t, t + 1), j - t)) for j in range(t + 1, n - 1)]
    nodes = _stamp_seq(graph.nodes, [st.owner(x.name) for x in graph.nodes], t,
                       [f for f, _ in maps], last_node if n != m else None)
    outs = list(zip(graph.outputs, graph.output_names))
    pairs = _stamp_seq(outs, [st.owner(o) if st.owner(o) is not None else st.owner(p) for o, p in outs],
                       t, [lambda op, rn=rn: (rn(op[0]), rn(op[1])) for _, rn in maps],
                       (lambda op: (last_name(op[0]), last_name(op[1]))) if n != m else None)
    if nodes is None or pairs is None or not _well_formed(nodes):
        return None
    return graph.with_nodes(nodes, tuple(o for o, _ in pairs),
                            output_names=tuple(p for _, p in pairs), **kw)


def _stamp_seq(items, owners, t, copies, last):
    """``items`` with each run of template-owned ones repeated by ``copies`` (ascending or
    descending as the run's neighbours say) and ``last`` applied to those of later blocks
    or none; None where a run's direction is not told."""
    out, k = [], 0
    while k < len(items):
        b = owners[k]
        if b is not None and b < t:
            out.append(items[k])
            k += 1
        elif b != t:
            out.append(last(items[k]) if last is not None else items[k])
            k += 1
        else:
            end = k
            while end < len(items) and owners[end] == t:
                end += 1
            run = items[k:end]
            asc = _ascending(owners, k, end, t)
            if asc is None:
                return None
            stamped = [[f(x) for x in run] for f in copies]
            if not asc:
                stamped.reverse()
            for chunk in ([run] + stamped if asc else stamped + [run]):
                out.extend(chunk)
            k = end
    return out


def _ascending(owners, start, end, t):
    """Whether the blocks ascend around ``owners[start:end]`` (a template run): the nearest
    block-owned node before is an earlier block or the nearest after a later; None when the
    neighbours disagree or say nothing."""
    before = next((b for b in reversed(owners[:start]) if b is not None), None)
    after = next((b for b in owners[end:] if b is not None), None)
    votes = set()
    if before is not None:
        votes.add(before < t)
    if after is not None:
        votes.add(after > t)
    return votes.pop() if len(votes) == 1 else None


def _well_formed(nodes) -> bool:
    """Every name made once and every operand made before it is read."""
    seen = set()
    for x in nodes:
        if x.name in seen or any(i not in seen for i in x.inputs):
            return False
        seen.add(x.name)
    return True
