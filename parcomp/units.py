"""How parcomp writes quantities for people: bytes in binary units, counts with their noun."""
from __future__ import annotations


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n) -> str:
    """A byte count for people: ``"512 B"``, ``"1.5 MiB"``, ``"7.3 TiB"``.

    Below 1024 the exact count in B; above, one decimal in the largest binary
    unit (KiB = 1024 B ... TiB) whose value is below 1024 after rounding, so
    1048575 B is ``"1.0 MiB"``, never ``"1024.0 KiB"``.  TiB is the largest unit.

    Raises:
        ValueError: ``n`` is negative.
    """
    n = int(n)
    if n < 0:
        raise ValueError(f"a byte count is never negative; got {n}")
    if n < 1024:
        return f"{n} B"
    for power, unit in enumerate(_UNITS[1:], start=1):
        value = round(n / 1024 ** power, 1)
        if value < 1024 or unit == _UNITS[-1]:
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def plural(count: int, word: str, many: str | None = None) -> str:
    """``"1 rank"``, ``"2 ranks"``: a count with its noun in the right number."""
    return f"{count} {word if count == 1 else many or word + 's'}"
