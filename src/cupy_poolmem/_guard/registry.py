"""The process's guards (for :func:`check` on raw pointers and the exit report of
errors never raised), and whether a garbage collection is under way."""

from __future__ import annotations

import atexit
import contextlib
import sys
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .guard import Guard

# Guards alive, for check() on raw pointers and the exit report of unraised errors.
_GUARDS: weakref.WeakSet[Guard] = weakref.WeakSet()
# Whether a garbage collection is under way (its finalizers free blocks): set by a
# gc callback installed with the first guard.
_IN_GC = [False]


def _gc_phase(phase: str, info: Any) -> None:
    _IN_GC[0] = phase == "start"


def _watch_gc() -> None:
    import gc

    if _gc_phase not in gc.callbacks:
        gc.callbacks.append(_gc_phase)


@atexit.register
def _unraised_at_exit() -> None:
    for g in list(_GUARDS):
        for err in list(g._pending):
            with contextlib.suppress(Exception):
                sys.stderr.write(f"cupy_poolmem guard (found, never raised): {err}\n")
