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

A norm-gradient bucket (:func:`_wide`: ``bucket-norm-grads`` under sequence parallel, one
``bucket_cat`` reading every block's norm-weight gradients) is the one unowned node allowed to
read the template: its operand list and its ``frees`` list are stamped as a sequence of nodes
is (template runs repeated next to themselves), its flat size and its all_reduce's (and a
``wait``'s) grow by the copies' members, the reason's member count follows, and its
``bucket_part`` offsets are laid again in program order (the reduced stage's must be so laid).

The outputs are stamped alike. Names in string attributes (``frees="..."``, ``reason="..."``)
and module paths (``source``) are renamed alike. :func:`stamp` returns None where the stamp
does not fit (:func:`fits`: a node reading a value of a block not next to its own, an unowned
node reading the template, as a bucket of every block's gradients does; a run whose direction
its neighbours do not tell) or the result is not SSA with operands made before use; the
caller then compiles the whole graph (or the passes from that stage on).
"""
from __future__ import annotations

import re
from dataclasses import replace

from .ir.graph import Graph, Node, evolve
from .passes.bucket import NORM_BUCKET, NORM_REASON
from .repeat import Blocks

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


def _copier(st: Stamper, shifts: list, made: list | None = None):
    """A function of a run of template nodes giving, for each token map of ``shifts`` (one
    per copy), the run renamed by it (as :func:`_renamer`'s ``node``). Each string of a node
    is split into pieces once and formatted for every copy at once. ``made``: see :func:`stamp`."""
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
        if made is not None and all(st.owner(i) in (st.t, None) for i in x.inputs):
            made.extend(out)
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
        if b is None and _wide(x):
            if not _wide_fits(st, x):
                return False
            continue
        for i in x.inputs:
            o = owners[i]
            if o is None:
                continue
            if (o not in (t - 1, last)) if b is None else abs(o - b) > 1:
                return False
    seq = list(owners.values())
    return all(_ascending(seq, k, e, t) is not None for k, e in _runs(seq, t))


def stamp(st: Stamper, graph: Graph, n: int, made: list | None = None, **kw) -> Graph | None:
    """The ``n``-block version of ``graph`` (a stage of the reduced model), or None where
    the stamp does not fit (see the module docstring). ``kw`` replace Graph fields. ``made``:
    a list to which the copies of template nodes reading only template or unowned values are
    appended (each equals its template node but for names, and so do its operands, or they
    are the template's own: :func:`parcomp.repeat_compile.copies_passed`)."""
    t, m = st.t, st.m
    if not fits(st, graph):
        return None
    last_node, last_name = _renamer(st, st.shift_map(range(t, m), n - m))
    shifts = [st.shift_map((t - 1, t, t + 1), j - t, n - m) for j in range(t + 1, t + 1 + n - m)]
    maps = [_renamer(st, shift) for shift in shifts]
    head_node, _ = _renamer(st, st.shift_map(range(t + 2, m), n - m))
    nodes = _stamp_seq(graph.nodes, [st.owner(x.name) for x in graph.nodes], t,
                       _copier(st, shifts, made), last_node if n != m else None, head_node)
    if nodes is not None and n != m and any(_wide(x) for x in graph.by_op("bucket_cat")):
        names = ([rn for _, rn in maps], last_name, _renamer(st, st.shift_map(range(t + 2, m), n - m))[1])
        nodes = _stamp_buckets(st, graph, nodes, n, names)
    outs = list(zip(graph.outputs, graph.output_names))
    pairs = _stamp_seq(outs, [st.owner(o) if st.owner(o) is not None else st.owner(p) for o, p in outs],
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
    return _stamp_seq(list(range(len(owners))), owners, st.t, [same] * (n - st.m), same, same)


def _runs(owners, t):
    """``(start, end)`` of each maximal run of ``t`` in ``owners``."""
    k = 0
    while k < len(owners):
        if owners[k] != t:
            k += 1
            continue
        end = k
        while end < len(owners) and owners[end] == t:
            end += 1
        yield k, end
        k = end


def _stamp_seq(items, owners, t, copies, last, head=None):
    """``items`` with each run of template-owned ones repeated by ``copies`` (one function per
    copy, or one function of a run giving every copy's: :func:`_copier`; ascending or
    descending as the run's neighbours say) and ``last`` applied to those of later blocks
    or none; None where a run's direction is not told."""
    out, k = [], 0
    while k < len(items):
        b = owners[k]
        if b is not None and b < t:
            out.append(head(items[k]) if head is not None and last is not None else items[k])
            k += 1
        elif b != t:
            out.append(last(items[k]) if last is not None else items[k])
            k += 1
        else:
            end = k
            while end < len(items) and owners[end] == t:
                end += 1
            run = items[k:end]
            if head is not None and last is not None:
                run = [head(x) for x in run]
            asc = _ascending(owners, k, end, t)
            if asc is None:
                return None
            stamped = copies(run) if callable(copies) else [[f(x) for x in run] for f in copies]
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
    add, covers = seen.add, seen.issuperset
    for x in nodes:
        if x.name in seen or not covers(x.inputs):
            return False
        add(x.name)
    return True


def _wide(x) -> bool:
    """Whether node ``x`` is a norm-gradient bucket (reads every block; module docstring)."""
    return x.op == "bucket_cat" and x.name.startswith(NORM_BUCKET)


def _frees(x) -> list:
    v = x.attr("frees")
    return v.split(" ") if type(v) is str and v else []


def _wide_fits(st: Stamper, x) -> bool:
    """Whether bucket ``x``'s operand and ``frees`` lists have a told direction per template run."""
    for seq in (x.inputs, _frees(x)):
        owners = [st.owner(i) for i in seq]
        if any(_ascending(owners, k, e, st.t) is None for k, e in _runs(owners, st.t)):
            return False
    return True


def _stamp_buckets(st: Stamper, graph: Graph, nodes: list, n: int, names) -> list | None:
    """``nodes`` (``graph``'s stamp, its buckets renamed as any unowned node) with each
    norm-gradient bucket stamped (module docstring); None where a bucket is not laid out as
    ``bucket-norm-grads`` lays it (one all_reduce reading it, parts in offset order)."""
    users, fix, sources = graph.users(), {}, set()
    for cat in filter(_wide, graph.by_op("bucket_cat")):
        got = _bucket_fixes(st, graph, cat, users, n, names)
        if got is None:
            return None
        fix.update(got[0])
        sources.update(got[1])
    out, offset = [], {}
    for x in nodes:
        f = fix.get(x.name)
        if f is not None:
            x = f(x)
        elif x.op == "bucket_part" and x.inputs[0] in sources:
            at = offset.get(x.inputs[0], 0)
            offset[x.inputs[0]] = at + x.attr("numel")
            x = x.with_attrs(offset=at)
        out.append(x)
    return out


def _bucket_fixes(st: Stamper, graph: Graph, cat, users, n: int, names) -> tuple | None:
    """``({name: stamped node -> fixed node}, {names the parts read})`` for bucket ``cat``."""
    copies, last, head = names
    t, m = st.t, st.m

    def seq(items):
        return _stamp_seq(list(items), [st.owner(i) for i in items], t, copies, last, head)

    ins, frees = seq(cat.inputs), seq(_frees(cat))
    grow = (n - m) * sum(graph[i].type.numel for i in cat.inputs if st.owner(i) == t)
    flat = replace(cat.type, shape=(cat.type.numel + grow,))
    ars = users[cat.name]
    if ins is None or frees is None or len(ars) != 1 or graph[ars[0]].op != "all_reduce":
        return None
    ar = graph[ars[0]]
    reason, was = ar.attr("reason", ""), f"{NORM_REASON}{len(cat.inputs)} "
    if not reason.startswith(was):
        return None
    reason = f"{NORM_REASON}{len(ins)} " + reason[len(was):]
    fix = {cat.name: lambda x: evolve(x, inputs=tuple(ins), type=flat, **(
               {"attrs": tuple(sorted({**dict(x.attrs), "frees": " ".join(frees)}.items()))}
               if frees else {})),
           ar.name: lambda x: evolve(x.with_attrs(reason=reason), type=flat)}
    sources = {ar.name}
    for w in users[ar.name]:
        if graph[w].op == "wait":
            fix[w] = lambda x: evolve(x, type=flat)
            sources.add(w)
    at = 0
    for p in graph.nodes:
        if p.op == "bucket_part" and p.inputs[0] in sources:
            if p.attr("offset") != at:
                return None
            at += p.attr("numel")
    return (fix, sources) if at == cat.type.numel else None
