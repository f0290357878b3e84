"""Stamping: a stage graph of the reduced model (``M`` blocks) -> the same stage for ``N``.

In the reduced model block ``t`` (:data:`TEMPLATE`) is the *template*: a block with blocks
before and after it that are neither the first nor the last (a plan may differ at the ends:
a ``partial_mask`` where the last block's gradient meets the one before). Every name of
every stage is made of *tokens* of the input graph's names (``addmm_4`` in
``bw.addmm_4_mm.permute_2``, ``transformer.h.1`` in ``opt.transformer.h.1.mlp.c_fc.bias.mul``);
a token belongs to block ``b >= 1`` when it names a node of window ``b`` or is
``<prefix>.<b>`` (block 0's fx names have no counter, ``layer_norm``, and would match the
passes' own suffixes: its nodes count as unowned and are never renamed). A node is *owned* by
the block of the first token of its name (none: prefix, block 0, suffix, loss, step). The
N-block stage is the reduced one with:

- nodes owned by blocks ``< t`` kept as they are, but for tokens of the last block (a
  ``reason`` naming where a partial sum began) shifted by ``N-M``;
- each maximal run of template nodes kept (tokens of the last block shifted as above), and
  ``N-M`` copies of it inserted next to it, copy ``j`` (``t+1..t+N-M``) with every token of
  blocks ``t-1, t, t+1`` shifted by ``j-t`` (to the same position of window ``j-1, j, j+1``)
  and those of later blocks by ``N-M`` (a ``reason`` naming the last block's matmul, where a
  partial sum began), after the run where the run's neighbours
  say the blocks ascend there (forward, optimizer), before it where they descend (backward);
- every other node (the tail blocks ``t+1..M-1``, suffix, unowned) with the tokens of blocks
  ``t..M-1`` shifted by ``N-M`` (the last block becomes ``N-1``; the suffix reads it).

A norm-gradient bucket (one node reading every block) is stamped by
:mod:`parcomp.compile.repeat_bucket`.

The outputs are stamped alike. Names in string attributes (``frees="..."``, ``reason="..."``)
and module paths (``source``) are renamed alike. :func:`stamp` returns None where the stamp
does not fit (:func:`fits`: a node reading a value of a block not next to its own, an unowned
node reading the template, as a dp bucket of every block's gradients does; a run whose direction
its neighbours do not tell) or the result is not SSA with operands made before use; the
caller then compiles the whole graph (or the passes from that stage on).
"""
from __future__ import annotations

import re

from ..ir.graph import Graph, Node
from .repeat import Blocks
from .repeat_bucket import ascending, bucket_fits, is_norm_bucket, runs, stamp_buckets, stamp_seq

_WORD = re.compile(r"[A-Za-z0-9_.]*")
#: the template block of the reduced model (blocks 0, 1 before it; two after it)
TEMPLATE = 2


class Stamper:
    """Tokens of the reduced model's blocks and their names in the full model."""

    def __init__(self, blocks: Blocks, m: int):
        self.blocks, self.m, self.t = blocks, m, TEMPLATE
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
        self._owner = {}  # node name -> owner(name)

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
        got = self._owner.get(name, self)
        if got is self:
            p = self.parts(name)
            got = self._owner[name] = self.block_of[p[1]] if len(p) > 1 else None
        return got

    def shift_map(self, of_blocks, by: int, tail_by: int | None = None) -> dict:
        """token -> its name ``by`` blocks later, for the tokens of ``of_blocks``; with
        ``tail_by``, the tokens of the blocks after ``of_blocks`` ``tail_by`` later (a template
        copy's ``reason`` names where a partial sum began: the last block's matmul)."""
        out, top = {}, max(of_blocks)
        for tok, b in self.block_of.items():
            shift = by if b in of_blocks else tail_by if b > top else None
            if shift is not None:
                k = self.pos[tok]
                out[tok] = (self.blocks.block_tag(b + shift) if k is None
                            else self.blocks.window(b + shift)[k])
        return out


def _renamer(st: Stamper, mapping: dict):
    """``(node, name)``: functions renaming a node (name, operands, string attributes,
    module path) and a string by ``mapping`` (token -> token)."""
    cache, parts = {}, st.parts

    def rn(s):
        got = cache.get(s)
        if got is None:
            p = parts(s)
            if len(p) == 1:
                got = s
            elif len(p) == 3:  # one token, the usual case
                got = p[0] + mapping.get(p[1], p[1]) + p[2]
            else:
                got = "".join([mapping.get(x, x) if i % 2 else x for i, x in enumerate(p)])
            cache[s] = got
        return got

    def node(x):
        new = object.__new__(Node)  # ir.graph.evolve without its checks (a Node, known fields)
        fields = new.__dict__
        fields.update(x.__dict__)
        fields["name"] = rn(x.name)
        fields["inputs"] = tuple(map(rn, x.inputs))
        attrs = x.attrs
        if attrs and any(type(v) is str for _, v in attrs):
            fields["attrs"] = tuple((k, rn(v) if type(v) is str else v) for k, v in attrs)
        if x.source:
            fields["source"] = rn(x.source)
        return new
    return node, rn


def _copier(st: Stamper, shifts: list):
    """A function of a run of template nodes giving, for each token map of ``shifts`` (one
    per copy), the run renamed by it (as :func:`_renamer`'s ``node``). Each string of a node
    is split into pieces once and formatted for every copy at once."""
    k, parts, cols = len(shifts), st.parts, {}

    def col(tok):  # the token's name in each copy
        got = cols.get(tok)
        if got is None:
            got = cols[tok] = [shift.get(tok, tok) for shift in shifts]
        return got

    def across(s):  # s in each copy, or None where no copy changes it
        p = parts(s)
        if len(p) == 1:
            return None
        if len(p) == 3:
            pre, post = p[0], p[2]
            return [pre + tok + post for tok in col(p[1])]
        toks = [col(x) if i % 2 else None for i, x in enumerate(p)]
        return ["".join([toks[i][j] if i % 2 else x for i, x in enumerate(p)]) for j in range(k)]

    def node_copies(x):
        fields = x.__dict__
        names = across(x.name) or [x.name] * k
        ins = [across(i) or [i] * k for i in x.inputs]
        inputs = list(zip(*ins)) if ins else [()] * k
        attrs = x.attrs
        if attrs and any(type(v) is str for _, v in attrs):
            cols_ = [across(v) if type(v) is str else None for _, v in attrs]
            attrs = [tuple((key, v if c is None else c[j]) for (key, v), c in zip(x.attrs, cols_))
                     for j in range(k)] if any(c is not None for c in cols_) else None
        else:
            attrs = None
        src = across(x.source) if x.source else None
        out = []
        for j in range(k):
            new = object.__new__(Node)
            d = new.__dict__
            d.update(fields)
            d["name"], d["inputs"] = names[j], inputs[j]
            if attrs is not None:
                d["attrs"] = attrs[j]
            if src is not None:
                d["source"] = src[j]
            out.append(new)
        return out

    return lambda run: [list(c) for c in zip(*map(node_copies, run))]


def fits(st: Stamper, graph: Graph) -> bool:
    """Whether ``graph`` (a stage of the reduced model) has the shape :func:`stamp` needs:
    every node reads unowned values or values of its own block or the next to it, an unowned
    node reads no template value (only block 1's, block 0's backward, or the last block's,
    the suffix), and every template run's direction is told."""
    owners = {x.name: st.owner(x.name) for x in graph.nodes}
    t, last = st.t, st.m - 1
    for x in graph.nodes:
        b = owners[x.name]
        if b is None and is_norm_bucket(x):
            if not bucket_fits(st, x):
                return False
            continue
        for i in x.inputs:
            o = owners[i]
            if o is None:
                continue
            if (o not in (t - 1, last)) if b is None else abs(o - b) > 1:
                return False
    seq = list(owners.values())
    return all(ascending(seq, k, e, t) is not None for k, e in runs(seq, t))


def stamp(st: Stamper, graph: Graph, n: int, **kw) -> Graph | None:
    """The ``n``-block version of ``graph`` (a stage of the reduced model), or None where
    the stamp does not fit (see the module docstring). ``kw`` replace Graph fields."""
    t, m = st.t, st.m
    if not fits(st, graph):
        return None
    last_node, last_name = _renamer(st, st.shift_map(range(t, m), n - m))
    shifts = [st.shift_map((t - 1, t, t + 1), j - t, n - m) for j in range(t + 1, t + 1 + n - m)]
    maps = [_renamer(st, shift) for shift in shifts]
    head_node, _ = _renamer(st, st.shift_map(range(t + 2, m), n - m))
    nodes = stamp_seq(graph.nodes, [st.owner(x.name) for x in graph.nodes], t,
                       _copier(st, shifts), last_node if n != m else None, head_node)
    if nodes is not None and n != m and any(is_norm_bucket(x) for x in graph.by_op("bucket_cat")):
        names = ([rn for _, rn in maps], last_name, _renamer(st, st.shift_map(range(t + 2, m), n - m))[1])
        nodes = stamp_buckets(st, graph, nodes, n, names)
    outs = list(zip(graph.outputs, graph.output_names))
    pairs = stamp_seq(outs, [st.owner(o) if st.owner(o) is not None else st.owner(p) for o, p in outs],
                       t, [lambda op, rn=rn: (rn(op[0]), rn(op[1])) for _, rn in maps],
                       (lambda op: (last_name(op[0]), last_name(op[1]))) if n != m else None)
    if nodes is None or pairs is None or not _well_formed(nodes):
        return None
    return graph.with_nodes(nodes, tuple(o for o, _ in pairs),
                            output_names=tuple(p for _, p in pairs), **kw)


def stamp_order(st: Stamper, graph: Graph, n: int) -> list:
    """For each node of ``graph``'s ``n``-block stamp, in order, the index in ``graph.nodes``
    of the node it is a copy (or the renamed original) of."""
    same = lambda k: k  # noqa: E731
    owners = [st.owner(x.name) for x in graph.nodes]
    return stamp_seq(list(range(len(owners))), owners, st.t, [same] * (n - st.m), same, same)


def _well_formed(nodes) -> bool:
    """Every name made once and every operand made before it is read."""
    seen = set()
    add, covers = seen.add, seen.issuperset
    for x in nodes:
        if x.name in seen or not covers(x.inputs):
            return False
        add(x.name)
    return True
