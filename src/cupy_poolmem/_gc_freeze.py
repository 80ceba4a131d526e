"""Moving a worker's start-up objects out of the garbage collector's way.

A Dask worker holds about 200,000 objects once distributed, dask, CuPy and the
pools are loaded; every full (generation 2) collection walks them all, which on
an H200 host stalls the worker for about 0.1 s at moments nobody chose (the runs
of docs/dask.rst, "Steady runs").  :class:`GcFreeze` collects once and then
freezes what is alive (``gc.freeze``): later collections walk only what was made
after.  Frozen objects are still freed by reference counting; only reference
cycles among them stay until :meth:`GcFreeze.unfreeze`.  Only a worker's objects are
frozen: a plain process's are the application's (their cycles must stay collectable).
"""

from __future__ import annotations

import gc
import importlib
from collections.abc import Sequence
from typing import Any

__all__ = ["GcFreeze"]

#: Modules a CuPy worker loads with its first task anyway: loaded before the freeze.
PRELOAD = ("dask.array",)


class GcFreeze:
    """The one freeze of a worker process's start-up objects.

    ``gc_module``: the garbage collector (``gc``; a test hands a fake), ``preload``:
    modules imported before freezing, so the objects they make are frozen too.

    Examples
    --------
    >>> f = GcFreeze()
    >>> f.freeze(busy=True)
    'skipped: the worker holds tasks (their reference cycles must stay collectable)'
    >>> f.frozen
    False
    """

    def __init__(self, gc_module: Any = gc, preload: Sequence[str] = PRELOAD) -> None:
        self.gc = gc_module
        self.preload = tuple(preload)
        self.frozen = False

    def freeze(self, busy: bool = False) -> str:
        """Collect, then freeze every object alive now; what was done, in words.

        ``busy``: the worker holds tasks already (a plugin registered on a running
        cluster); their objects must stay collectable, so nothing is frozen.
        """
        if self.frozen:
            return "frozen already"
        if busy:
            return "skipped: the worker holds tasks (their reference cycles must stay collectable)"
        for name in self.preload:
            try:
                importlib.import_module(name)  # late: what the worker's tasks will load
            except Exception:  # noqa: BLE001 - not installed: nothing of it to freeze
                pass
        self.gc.collect()
        self.gc.freeze()
        self.frozen = True
        return f"froze {self.gc.get_freeze_count()} start-up objects"

    def freeze_for(self, worker: Any) -> str:
        """:meth:`freeze` for the plugin's ``worker``; what was done, in words.

        Nothing is frozen without a worker (``setup()`` called in a plain process,
        whose objects are the application's) or when the worker holds tasks
        (``worker.state.tasks``).
        """
        if worker is None:
            return "skipped: not a Dask worker (a plain process keeps its collections)"
        held = getattr(getattr(worker, "state", None), "tasks", None)
        return self.freeze(busy=bool(held))

    def unfreeze(self) -> None:
        """Hand the frozen objects back to the collector (when this froze them)."""
        if self.frozen:
            self.gc.unfreeze()
            self.frozen = False
