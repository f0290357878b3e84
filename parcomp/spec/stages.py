"""``stage K: ITEM ...`` statements: which modules each pipeline (``pp``) stage holds.

An item is a module path (``ln_f``, ``h.3``, ``0``) or a range of numbered modules
(``0-5``, ``h.0-11``), expanded here to the paths it names, or an open range ``h.12-end``
(``h.12`` to the model's last numbered ``h.N``), kept as written and matched against the
model's modules by :func:`parcomp.passes.pipeline.split_stages.assign_stages` (the spec does not
know how many layers the model has).  A spec either gives one
stage statement for every stage ``0 .. pp-1`` or none (then the stages are balanced by
the cost model of :mod:`parcomp.passes.pipeline.split_stages`, or ``train stages=balanced`` says
so explicitly).  Every error is a :class:`~parcomp.errors.SpecError` at the statement.
"""
from __future__ import annotations

import re

from .model import StageRule

#: the most module paths one range may name (``0-999999999`` is a typo, not a model)
MAX_RANGE = 100_000
_RANGE = re.compile(r"(?:(.*)\.)?([0-9]+)-([0-9]+)")


def expand_item(item: str) -> tuple | None:
    """The module paths of a range item (``h.0-2`` -> ``h.0 h.1 h.2``), or None for a
    plain path; ``()`` for a range whose end is below its start."""
    m = _RANGE.fullmatch(item)
    if m is None:
        return None
    prefix, lo, hi = m.group(1), int(m.group(2)), int(m.group(3))
    return tuple(f"{prefix}.{i}" if prefix else str(i) for i in range(lo, hi + 1))


def open_range(item: str):
    """``(prefix, first)`` of an open range item ``h.12-end`` (the numbered modules
    ``h.12``, ``h.13``, ... to the model's last), else None."""
    head, sep, tail = item.rpartition("-")
    if not sep or tail != "end":
        return None
    prefix, _, first = head.rpartition(".")
    return (prefix, int(first)) if first.isdigit() else None


def _claims(a: str, b: str) -> str | None:
    """The module both items ``a`` and ``b`` name when one is an open range (``h.2-end``)
    and the other a numbered path at or after its start (``h.2``) or an open range with the
    same prefix (``h.4-end``); else None (two plain paths are compared as equal strings)."""
    ra, rb = open_range(a), open_range(b)
    if ra is None and rb is None:
        return None
    if ra is not None and rb is not None:
        return f"{ra[0]}.{max(ra[1], rb[1])}" if ra[0] == rb[0] else None
    (prefix, first), path = (ra, b) if ra is not None else (rb, a)
    head, _, last = path.rpartition(".")
    return path if head == prefix and last.isdigit() and int(last) >= first else None


def make_stage(builder, tok, payload, earlier) -> StageRule:
    """One ``stage`` statement, checked against the mesh and the earlier stage statements.

    Raises:
        SpecError: no ``pp`` mesh axis, a stage index outside ``0 .. pp-1`` or given twice;
            at the item: a reversed or too long range, a module two items name (the same path
            twice, or a path inside an open range ``h.2-end`` of this or an earlier statement).
    """
    index_tok, items = payload[0], payload[1:]
    if "pp" not in builder.mesh.names:
        raise builder.err(tok, f"a stage statement needs a 'pp' mesh axis; mesh {builder.mesh} "
                               f"has none (e.g. 'mesh pp=2 tp=2')")
    pp = builder.mesh.sizes[builder.mesh.axis_index("pp")]
    index = int(str(index_tok))
    if not 0 <= index < pp:
        raise builder.err(index_tok, f"stage {index} does not exist: the pp axis has size {pp}, "
                                     f"so the stages are 0 to {pp - 1}")
    for other in earlier:
        if other.index == index:
            raise builder.err(index_tok, f"stage {index} is given twice (first on line "
                                         f"{other.loc.line})")
    paths, locs, seen = [], [], {p: o.index for o in earlier for p in o.items}
    opened = [(q, f"stage {o.index}") for o in earlier for q in o.items if open_range(q)]
    for it in items:
        name = str(it)
        expanded = expand_item(name)
        if expanded == ():
            raise builder.err(it, f"range {name} ends below its start; write it low-high")
        if expanded is not None and len(expanded) > MAX_RANGE:
            raise builder.err(it, f"range {name} names {len(expanded):,} modules; at most "
                                  f"{MAX_RANGE:,}")
        for p in expanded or (name,):
            if p in seen or p in paths:
                where = f"stage {seen[p]}" if p in seen else "this stage"
                raise builder.err(it, f"module {p} is already in {where}; a module belongs to "
                                      f"one stage")
            named = [*((q, f"stage {o.index}") for o in earlier for q in o.items),
                     *((q, "this stage") for q in paths)] if open_range(p) else opened
            for q, where in named:  # an open range against every item, a path against open ones
                both = _claims(p, q)
                if both is not None:
                    raise builder.err(it, f"module {both} is already in {where}; a module "
                                          f"belongs to one stage")
            paths.append(p)
            locs.append(builder.loc(it))
            if open_range(p):
                opened.append((p, "this stage"))
    return StageRule(index, tuple(paths), tuple(str(i) for i in items), builder.loc(tok),
                     tuple(locs))


def check_stages(builder, stages: list, train) -> tuple:
    """The stage rules in stage order; every stage ``0 .. pp-1`` must have one when any does.

    Raises:
        SpecError: at the last stage statement, naming the stages without one; at the
            train line when it also says ``stages=balanced``; at the first one with
            ``schedule=interleaved`` (its chunks are balanced).
    """
    if not stages:
        return ()
    pp = builder.mesh.sizes[builder.mesh.axis_index("pp")]
    missing = sorted(set(range(pp)) - {s.index for s in stages})
    if missing:
        raise builder.err_at(stages[-1].loc, f"stage {', '.join(map(str, missing))} "
                                             f"{'has' if len(missing) == 1 else 'have'} no stage "
                                             f"statement: give one for every stage 0 to {pp - 1}, "
                                             f"or none (train stages=balanced)")
    if train is not None and train.get("stages") is not None:
        raise builder.err_at(train.loc, "stages=balanced and stage statements both say where "
                                        "the stages are: keep one")
    if train is not None and train.get("schedule") == "interleaved":  # virtual stages
        raise builder.err_at(stages[0].loc, "schedule=interleaved cuts the model into pp x virtual "
                                            "balanced chunks; drop the stage statements")
    return tuple(sorted(stages, key=lambda s: s.index))
