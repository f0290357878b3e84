"""The spec ``parcomp plan`` writes: the chosen layouts in the words a person would use.

A parameter's rule is written as Megatron / DTensor users write it: ``colwise`` or
``rowwise`` when that word (resolved by use, as bind-layouts resolves it) gives the chosen
layout, ``replicated`` for none, else the explicit per-axis list ``[S(1), R]``.  Numbered
blocks alike are one rule (``transformer.h.*.mlp.c_fc.weight colwise``) when that pattern
names exactly those parameters; a parameter that would get its layout with no rule (a
replicated one, a bias following its colwise weight) gets none and is listed in a comment.
Every rule carries a comment: the parameter's type and what its layout splits.

The text is bound once more and compared with the search's layouts; any parameter the
shorter form would change gets an explicit rule of its own, so the written spec always
compiles to the plan the search chose.
"""
from __future__ import annotations

import re
from types import SimpleNamespace

from ..errors import ParcompError
from ..ir.types import Replicate, Shard, layout_str
from ..spec import parse_spec
from ..spec.model import default_axis, pattern_regex

#: what each layout word means in the written comments
_WORDS = {"colwise": "ColumnParallelLinear", "rowwise": "RowParallelLinear"}


def io_phrase(layout) -> str:
    """``replicated`` for an all-R layout, else its list form ``[S(0), R]``."""
    return "replicated" if all(isinstance(p, Replicate) for p in layout) else layout_str(layout)


def param_lines(graph, layouts: dict, mesh, check_text) -> list:
    """The parameter rules of a plan, readable and commented (module docstring).

    Args:
        graph: the model graph (its params, in order).
        layouts: param name -> chosen layout.
        mesh: the spec's mesh.
        check_text: ``lines -> {param: layout}``, how the spec with these rule lines binds
            (used to make sure the short form gives exactly ``layouts``).

    Returns:
        The lines (rules, and comments naming the parameters with no rule).
    """
    users = graph.users()
    names = [n.name for n in graph.params]
    phrases = {n.name: _phrase(graph, users, n, layouts[n.name], mesh) for n in graph.params}
    omitted = {n for n in names if phrases[n][0].split()[0] not in _WORDS}
    explicit = set()
    for _ in range(4):
        lines = _lines(graph, mesh, layouts, phrases, omitted, explicit)
        try:
            bound = check_text(lines)
        except ParcompError:  # a word that does not resolve here: write every layout explicitly
            break
        wrong = {n for n in names if bound.get(n) != layouts[n]}
        if not wrong:
            return lines
        if wrong & omitted:
            omitted -= wrong
        else:
            explicit |= wrong
    return _lines(graph, mesh, layouts, phrases, set(), set(names))


def _lines(graph, mesh, layouts, phrases, omitted, explicit) -> list:
    """Rule lines: groups of numbered blocks collapsed, the ``omitted`` parameters listed."""
    names = [n.name for n in graph.params]
    word = {n: (layout_str(layouts[n]), _what(graph[n], layouts[n], mesh)) if n in explicit
            else phrases[n] for n in names}
    written = [n for n in names if n not in omitted]
    groups = {}
    for n in written:
        groups.setdefault(_block_pattern(n), []).append(n)
    rows, done = [], set()
    for n in written:
        pat = _block_pattern(n)
        if pat in done:
            continue
        members = groups[pat]
        text, what = word[n]
        if pat != n and len(members) > 1 and len({word[m] for m in members}) == 1 \
                and _names_exactly(pat, names, members):
            done.add(pat)
            rows.append((pat, text, f"{len(members)} alike: {what}"))
        else:
            rows.append((n, text, what))
    wide = [max((len(r[k]) for r in rows), default=0) for k in (0, 1)]
    out = [f"{a:<{wide[0]}}  {b:<{wide[1]}}  # {c}" for a, b, c in rows]
    skipped = [n for n in names if n in omitted]
    if skipped:
        by_pat = {}
        for n in skipped:
            by_pat.setdefault(_block_pattern(n), []).append(n)
        shown = [p if _names_exactly(p, names, ms) else ", ".join(ms) for p, ms in by_pat.items()]
        out += ["", "# no rule needed (replicated, or a bias that follows its colwise weight):"]
        out += _wrap("#   ", shown)
    return out


def _phrase(graph, users, node, layout, mesh) -> tuple:
    """``(layout text, comment)`` of one parameter's chosen ``layout``."""
    what = _what(node, layout, mesh)
    if all(isinstance(p, Replicate) for p in layout):
        return "replicated", what
    split = [(a, p) for a, p in zip(mesh.names, layout) if not isinstance(p, Replicate)]
    if len(split) == 1 and isinstance(split[0][1], Shard):
        axis, place = split[0]
        for w in ("colwise", "rowwise"):
            if _word_dim(graph, users, node, w) == place.dim:
                over = "" if axis == default_axis(mesh) else f" over {axis}"
                return f"{w}{over}", f"{what} ({_WORDS[w]}{_parts(node)})"
    return layout_str(layout), what


def _parts(node) -> str:
    """For a fused weight's view: how a colwise / rowwise split reads on its parts."""
    from ..passes.fused_weights import fused_split_dim

    stored = node.attr("stored_shape")  # the parts dim is the one before colwise's per-part dim
    if not stored:
        return ""
    k = node.type.shape[fused_split_dim(node, 'colwise') - 1]
    if node.attr("stored_order"):  # grouped q|k|v: R query parts, the keys, the values
        return f", its {k - 2} query, key and value parts split by kv group"
    return f", each of its {k} parts split"


def _word_dim(graph, users, node, word):
    """The stored dim ``word`` splits on ``node`` (bind-layouts' resolution), or None."""
    from ..passes.fused_weights import fused_split_dim
    from ..passes.bind_layouts import weight_split_dim

    if node.attr("stored_shape"):  # a fused weight's view [in, k, out] (its bias: [k, out])
        return fused_split_dim(node, word) if node.type.rank >= 3 else None
    rule = SimpleNamespace(layout=SimpleNamespace(word=word), loc=None)
    try:
        return weight_split_dim(graph, node, rule, users)
    except ParcompError:
        return None


def _what(node, layout, mesh) -> str:
    """``f32[32,128]: dim 1 (128) split over tp`` (the view of a fused weight named)."""
    stored = node.attr("stored_shape")
    view = f" (view of the fused [{','.join(map(str, stored))}])" if stored else ""
    if node.attr("part_of"):  # a multi-query weight's query or kv rows
        a, b = node.attr("part_rows")
        view = f" (rows {a}:{b} of the fused [{','.join(map(str, node.attr('part_of_shape')))}])"
    names = mesh.names
    parts = [f"dim {p.dim} ({node.type.shape[p.dim]}) split over {a}"
             for a, p in zip(names, layout) if isinstance(p, Shard)]
    parts += [f"partial over {a}" for a, p in zip(names, layout)
              if not isinstance(p, (Shard, Replicate))]
    return f"{node.type}{view}: {'; '.join(parts) or 'replicated'}"


def _block_pattern(name: str) -> str:
    """``transformer.h.3.attn.c_attn.weight`` -> ``transformer.h.*.attn.c_attn.weight``."""
    return ".".join("*" if re.fullmatch(r"[0-9]+", part) else part for part in name.split("."))


def _names_exactly(pattern: str, names: list, members: list) -> bool:
    """Whether ``pattern`` matches exactly ``members`` among ``names``."""
    rx = pattern_regex(pattern)
    return [n for n in names if rx.fullmatch(n)] == list(members)


def _wrap(prefix: str, items: list, width: int = 96) -> list:
    lines, cur = [], prefix
    for it in items:
        piece = it if cur == prefix else ", " + it
        if len(cur) + len(piece) > width and cur != prefix:
            lines.append(cur + ",")
            cur, piece = prefix, it
        cur += piece
    return lines + [cur]


def bound_params(graph, text: str) -> dict:
    """``{param: layout}`` that the spec ``text`` binds on ``graph``.

    Raises:
        ParcompError: the text does not parse or bind.
    """
    from ..passes.pass_list import bind_layouts

    bound = bind_layouts(graph, parse_spec(text, "plan.pcs"))
    return {n.name: n.layout for n in bound.params}
