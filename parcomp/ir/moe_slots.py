"""The dims of an MoE slot value held as its routed rows: each dim a tuple of atoms
``(name, size)``; the slot atoms are B (rows), E (experts), C (capacity slots), a feature atom
is ``("f", id)`` with an identity only compared, never printed. The torch emitter's dropless
plan (backends/torch/emit/moe_dropless.py) and the numpy reference's packed values
(parcomp/reference/moe_packed.py) follow a reshape or permute of a slot value with these."""
from __future__ import annotations

import itertools

SLOT_ATOMS = ("B", "E", "C")
_FEATURE_IDS = itertools.count()


class SlotLayoutError(Exception):
    """A reshape of a slot value that the routed rows cannot follow."""


def feature_atom(size: int) -> tuple:
    """A new feature atom of ``size``."""
    return (("f", next(_FEATURE_IDS)), size)


def is_slot_dim(dims: tuple, d: int) -> bool:
    return all(a[0] in SLOT_ATOMS for a in dims[d])


def feature_dims(dims: tuple) -> list:
    return [d for d in range(len(dims)) if not is_slot_dim(dims, d)]


def signature(dims: tuple) -> tuple:
    """The layout with feature atoms by size only: what element-wise operands must share."""
    return tuple(tuple(a if a[0] in SLOT_ATOMS else ("f", a[1]) for a in d) for d in dims)


def regroup(dims: tuple, shape: tuple) -> tuple:
    """The atoms of ``dims`` regrouped, in order, into ``shape`` (a reshape); SlotLayoutError
    where the reshape cuts an atom, leaves atoms over, or mixes slots and features in one dim."""
    atoms = [a for d in dims for a in d]
    out, i = [], 0
    for k, size in enumerate(shape):
        group, prod = [], 1
        while i < len(atoms) and (prod < size or (atoms[i][1] == 1 and prod == size and not group)):
            group.append(atoms[i])
            prod *= atoms[i][1]
            i += 1
        last = k + 1 == len(shape) or shape[k + 1] != 1  # no size-1 dim follows to take them
        while i < len(atoms) and atoms[i][1] == 1 and prod == size and atoms[i][0] in SLOT_ATOMS and last:
            group.append(atoms[i])  # a size-1 slot atom rides with the group before it
            i += 1
        if prod != size:
            raise SlotLayoutError(f"a reshape to {tuple(shape)} cuts an atom of {dims}")
        out.append(tuple(group) if group else (feature_atom(1),))
    if i != len(atoms):
        raise SlotLayoutError(f"a reshape to {tuple(shape)} leaves atoms of {dims}")
    for d in out:
        if len({a[0] in SLOT_ATOMS for a in d if a[1] != 1}) > 1:
            raise SlotLayoutError(f"a reshape to {tuple(shape)} mixes slots and features in one dim")
    return tuple(out)
