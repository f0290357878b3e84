"""The one fresh-name generator for IR values (frontends, autodiff, passes).

A value keeps the name it asks for when that is free; otherwise it gets the
first free ``<base>_2``, ``<base>_3``, ... .  Names, once given or taken, are
never given again by the same generator.
"""
from __future__ import annotations


class NameGen:
    """Hands out value names unique within one graph under construction.

    ``taken``: names already in use (the graph's values, say).
    """

    def __init__(self, taken=()):
        self._taken = set(taken)

    def __contains__(self, name: str) -> bool:
        return name in self._taken

    def take(self, name: str) -> str:
        """Mark ``name`` used as is (a parameter's state_dict key) and return it."""
        self._taken.add(name)
        return name

    def fresh(self, base: str) -> str:
        """``base`` if unused, else ``base_k`` for the smallest free k >= 2; marked used."""
        name, k = base, 2
        while name in self._taken:
            name, k = f"{base}_{k}", k + 1
        return self.take(name)
