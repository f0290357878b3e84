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


def make_stage(builder, tok, payload, earlier) -> StageRule:
    """One ``stage`` statement, checked against the mesh and the earlier stage statements.

    Raises:
        SpecError: no ``pp`` mesh axis, a stage index outside ``0 .. pp-1`` or given
            twice, a reversed or too long range, an item given twice.
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
    paths, seen = [], {p: o.index for o in earlier for p in o.items}
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
            paths.append(p)
    return StageRule(index, tuple(paths), tuple(str(i) for i in items), builder.loc(tok))


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
