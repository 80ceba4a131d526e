"""The process's guards (for :func:`check` on raw pointers and the exit report of
errors never raised), and whether a garbage collection is under way."""

from __future__ import annotations

import atexit
import contextlib
import gc
import sys
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .guard import Guard


class Guards:
    """The guards alive in this process (``alive``) and whether a garbage collection
    is under way (``in_gc``: its finalizers free blocks), with the gc callback that
    keeps it and the exit hook that prints errors found and never raised."""

    def __init__(self) -> None:
        self.alive: weakref.WeakSet[Guard] = weakref.WeakSet()
        self.in_gc = False
        self._on_gc = self._gc_phase  # one bound method: found again in gc.callbacks

    def _gc_phase(self, phase: str, info: Any) -> None:
        self.in_gc = phase == "start"

    def watch_gc(self) -> None:
        """Follow garbage collections (installed with the first guard)."""
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def report_unraised_at_exit(self) -> None:
        """Print the errors that guards found and never raised (at exit)."""
        for g in list(self.alive):
            for err in list(g._pending):
                with contextlib.suppress(Exception):
                    sys.stderr.write(f"cupy_poolmem guard (found, never raised): {err}\n")


GUARDS = Guards()
atexit.register(GUARDS.report_unraised_at_exit)
