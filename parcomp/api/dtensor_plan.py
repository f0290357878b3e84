"""DTensor's words as a parcomp spec (translation written below)."""
from __future__ import annotations

from ..errors import ParcompError


def plan_spec(plan, module=None):
    raise ParcompError("DTensor plan dicts are not translated yet")
