"""What the Numba plugin keeps beside its two classes (``cupy_poolmem.numba``): the
pools it allocates from (created lazily, as ``set_allocator()`` would), its allocations'
finalizers and size check, and the duplicates of pools' descriptors that pickled
handles leave for their receivers."""

from __future__ import annotations

import contextlib
import operator
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import cupy

from ._allocator import get_pinned_pool, get_pool, set_allocator, set_pinned_memory_allocator
from ._errors import InvalidOptionError, OptionTypeError, PoolClosedError
from ._pools import Pool

__all__ = [
    "device_pool",
    "pinned_pool",
    "check_size",
    "Held",
    "forget",
    "drop",
    "SentDescriptors",
    "SENT",
    "close_fd",
]

_init_lock = threading.Lock()


# --------------------------------------------------------------------------------------
# Pools: the same ones CuPy uses, created lazily through set_allocator() semantics.
# --------------------------------------------------------------------------------------
def device_pool(device: int) -> Pool:
    try:
        return get_pool(device)
    except PoolClosedError:
        with _init_lock:
            try:
                return get_pool(device)
            except PoolClosedError:
                with cupy.cuda.Device(device):
                    set_allocator()
                return get_pool(device)


def pinned_pool(device: int) -> Pool:
    try:
        return get_pinned_pool(device)
    except PoolClosedError:
        with _init_lock:
            try:
                return get_pinned_pool(device)
            except PoolClosedError:
                with cupy.cuda.Device(device):
                    set_pinned_memory_allocator()
                return get_pinned_pool(device)


def check_size(size: Any) -> int:
    try:
        if isinstance(size, bool):
            raise TypeError
        size = operator.index(size)  # int, numpy integers
    except TypeError:
        raise OptionTypeError(
            f"allocation size must be an int number of bytes; got {size!r} "
            f"of type {type(size).__name__}"
        ) from None
    if size < 0:
        raise InvalidOptionError(f"allocation size must be >= 0 bytes; got {size}")
    return size


class Held:
    """What the plugin keeps in ``allocations`` for one pointer: the pool memory.

    The pointer's finalizer holds it weakly and frees only if the dictionary still
    holds *this* object under its address: after ``reset()`` (which freed everything)
    the address may already belong to a newer allocation, which a stale finalizer must
    not free.
    """

    __slots__ = ("mem", "__weakref__")

    def __init__(self, mem: Any) -> None:
        self.mem = mem


def forget(
    allocations: Any, key: int, held: Held, guard: Any = None, generation: int = 0
) -> Callable[[], None]:
    """Finalizer for a Numba pointer: drop the pool block it owns (freeing it).

    A second free of the allocation (its entry is gone already) is not done; a guarded
    pool reports it as a :class:`~cupy_poolmem.DoubleFreeError`.
    """
    ref = weakref.ref(held)

    def finalizer() -> None:
        # Context.reset() may have cleared the dict already (also at interpreter exit).
        with contextlib.suppress(Exception):
            h = ref()
            if h is not None and allocations.get(key) is h:
                allocations.pop(key, None)
                return
            if guard is not None:
                guard.report_foreign_free(key, generation, "a Numba pointer's finalizer")

    return finalizer


def drop(holder: list) -> Callable[[], None]:
    def finalizer() -> None:
        holder.clear()

    return finalizer


class SentDescriptors:
    """Duplicates of pools' descriptors that pickled handles left in ``multiprocessing``'s
    resource sharer for their receivers to take.

    One is made per pickle; a receiver that unpickles takes it (the sharer closes it
    then).  One nobody takes is closed here once it is older than
    ``cupy_poolmem.sharing.inflight_timeout`` (checked at each pickle): a handle
    pickled but never unpickled kept one open descriptor per pickle for ever.  (Not
    when the handle goes: ``queue.put(array.get_ipc_handle())`` drops it at once.)
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._out: dict[Any, float] = {}  # the sharer's key -> when it was made

    def add(self, dup: Any) -> None:
        key = getattr(dup, "_id", None)  # (a spawn launch's DupFd closes its own)
        if key is not None:
            with self._lock:
                self._out[key] = self._clock()

    def close(self, older_than: float = 0.0) -> int:
        """Close the untaken duplicates made more than ``older_than`` seconds ago; how
        many were closed."""
        sharer = resource_sharer()
        now = self._clock()
        with self._lock:
            keys = [k for k, made in self._out.items() if now - made > older_than]
            for k in keys:
                del self._out[k]
        closed = 0
        for k in keys:
            ent = None
            if sharer is not None:
                with sharer._lock:
                    ent = sharer._cache.pop(k[1], None)  # None: a receiver took it
            if ent is not None:
                with contextlib.suppress(OSError):
                    ent[1]()  # the sharer's close()
                closed += 1
        return closed

    def untaken(self) -> int:
        """Duplicates made and still waiting for a receiver."""
        sharer = resource_sharer()
        with self._lock:
            keys = list(self._out)
        if sharer is None:
            return 0
        with sharer._lock:
            return sum(1 for k in keys if k[1] in sharer._cache)


def resource_sharer() -> Any:
    """``multiprocessing``'s resource sharer (where a pickled DupFd waits), if any."""
    from multiprocessing import resource_sharer

    rs = getattr(resource_sharer, "_resource_sharer", None)
    return rs if hasattr(rs, "_cache") and hasattr(rs, "_lock") else None


SENT = SentDescriptors()


def close_fd(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
