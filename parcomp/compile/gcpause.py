"""Python's cycle collector paused around a compile or an emit (compile speed).

The passes and the emitter allocate many small objects that form no reference cycles
(immutable nodes, tuples, strings; reference counting frees them), and on a deep model every
full collection rescans all the graphs alive: on a 48-block GPT-2 ~20% of the compile went
to collections that found nothing. Pausing it changes no result, only when memory of a
cycle (none is made here) would be reclaimed.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def no_cycle_collection():
    """Pause the cycle collector for the ``with`` body, then restore it as it was (also when
    the body raises)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
