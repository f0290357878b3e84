"""Locating a train option's error at the option's own column (a leaf module: the option
readers in train_config, train_options, precision and amp all import it)."""
from __future__ import annotations

import dataclasses
import re


def option_loc(loc, key: str):
    """``loc`` moved to the column where option ``key=`` is written on its line (``loc``
    itself when the line does not show it), so an error points at the option."""
    text = getattr(loc, "text", "") or ""
    m = re.search(rf"(?<![\w.]){re.escape(key)}\s*=", text)
    return dataclasses.replace(loc, col=m.start() + 1) if m else loc
