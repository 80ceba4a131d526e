"""A lock wrapper for tests of garbage collections that start while a lock is held.

Any gc-tracked allocation in a locked region (a tuple, a list, a generator, a deque)
can start a collection there, and a block freed inside it may come back to the same
lock in the same thread.  ``GcUnderLock`` wraps the lock the code under test created:
its outermost acquire runs ``gc.collect()`` with the lock held (``collect=True``), and
a nested acquire by the holding thread that the wrapped lock refuses (a plain
``threading.Lock``) is recorded in ``deadlocked`` and raises instead of hanging: a
thread stuck inside a collection would stop every later collection in the process.
"""

from __future__ import annotations

import gc
import threading
from typing import Any


class GcUnderLock:
    def __init__(self, lock: Any, collect: bool = True) -> None:
        self.lock, self.collect = lock, collect
        self.owner: int | None = None
        self.depth = 0
        self.deadlocked = False
        self.nested = 0  # nested acquires the wrapped lock allowed

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = threading.get_ident()
        if self.owner == me:
            if not self.lock.acquire(False):
                self.deadlocked = True
                raise RuntimeError("self-deadlock: this thread holds the lock already")
            self.depth += 1
            self.nested += 1
            return True
        ok = self.lock.acquire(blocking, timeout)
        if ok:
            self.owner, self.depth = me, 1
        return ok

    def release(self) -> None:
        self.depth -= 1
        if not self.depth:
            self.owner = None
        self.lock.release()

    def __enter__(self) -> GcUnderLock:
        self.acquire()
        if self.collect and self.depth == 1:
            gc.collect()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
