"""Blocks the driver does not pool, cached by size, their reuse ordered by events.

:class:`BlockCache` is shared by the backends that are not a CUDA pool (ManagedPool's
``cuMemAllocManaged`` blocks, DevicePool's mapped blocks): a subclass makes and
destroys blocks, the cache decides when a freed block may serve again and when it goes
back to the driver.  See docs/device_pool.rst, "How it works".
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from threading import get_ident
from typing import Any

from . import _device, _driver
from ._errors import check_driver

__all__ = ["BlockCache"]

_UINT64_MAX = 2**64 - 1
_OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY
_IDLE_EVENTS = 64  # events of given-back blocks kept for the next frees
_PER_THREAD = 2  # CU_STREAM_PER_THREAD


class BlockCache:
    """Blocks for one device from ``_create``, cached by size class for reuse.

    ``alloc`` and ``free`` run only when the pool's own reuse cache misses or
    overflows.  ``reserved`` is what the driver gave (live and cached blocks),
    ``peak_reserved`` its high-water mark, ``cached`` the freed blocks held.

    Examples
    --------
    A cache over a pretend driver whose events complete at once:

    >>> class Blocks(BlockCache):
    ...     made = iter(range(0x1000, 0x100000, 0x1000))
    ...     def _create(self, r): return 0, next(self.made)
    ...     def _destroy(self, ptr, r): pass
    ...     def _event(self): return None
    ...     def _record(self, ev, stream_ptr): pass
    ...     @staticmethod
    ...     def _done(ev): return True
    >>> c = Blocks(0, granule=1024, fit=0.5)
    >>> err, p = c.alloc(3000, stream_ptr=7)
    >>> c.free(p, 7)
    >>> c.alloc(2048, stream_ptr=9) == (0, p)  # 3 KiB serves 2 KiB (fit), event done
    True
    >>> c.reserved, c.n_driver_allocs
    (3072, 1)
    """

    default_keep = _UINT64_MAX  # release_threshold when the pool's is None (keep all)

    def __init__(self, device: int, granule: int, fit: float = 0.0) -> None:
        self.device = device
        self.granule = int(granule)
        self.fit = float(fit)  # a block serves a request down to 1/(1+fit) its size
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread holding _lock
        self._queued: deque = deque()  # (size class, ptr, stream, event) of nested frees
        self._free: dict[int, deque] = {}  # size class -> deque of (ptr, stream, event)
        self._classes: list[int] = []  # size classes with a freed block, ascending
        self._order: dict[int, int] = {}  # ptr -> size class of freed blocks, oldest first
        self._sizes: dict[int, int] = {}  # ptr -> size class, live or cached
        self._idle_events: list[Any] = []
        self.reserved = 0  # bytes from the driver held now (live + cached)
        self.peak_reserved = 0
        self.live_high = 0  # the most bytes live in blocks at once (high-water mark)
        self.cached = 0
        self.release_threshold = self.default_keep
        self.n_driver_allocs = 0
        self.n_hits = 0
        self.n_errors = 0  # blocks the driver refused to take back (leaked, never reused)
        self.leaked = 0  # their bytes

    # -- what a subclass provides --------------------------------------------------
    def _create(self, r: int) -> tuple[int, int]:
        """``(CUresult, ptr)``: a new block of ``r`` bytes (a multiple of the granule)."""
        raise NotImplementedError

    def _destroy(self, ptr: int, r: int) -> None:
        """Give a block back to the driver (its stream is past its free)."""
        raise NotImplementedError

    def _keep(self) -> int:
        """Cached bytes beyond which a free gives the oldest done blocks back."""
        return self.release_threshold

    def _make_room(self, r: int) -> None:
        """Before a new block of ``r`` bytes is made (a subclass may give some back)."""

    def is_pinned(self, ptr: int) -> bool:
        """Whether another process maps the block at ``ptr`` (a subclass that exports
        its blocks says; then :meth:`release` keeps it)."""
        return False

    def _round(self, size: int) -> int:
        g = self.granule
        return max(1, (size + g - 1) // g) * g

    def owns(self, ptr: int) -> bool:
        """Whether ``ptr`` is a block of this cache (live or cached)."""
        return ptr in self._sizes

    # -- the lock ----------------------------------------------------------------------
    def _acquire(self) -> bool:
        """Take the lock; False, without taking it, when this thread holds it already
        (a call from a garbage collection that started under it)."""
        ident = get_ident()
        if self._owner == ident:
            return False
        self._lock.acquire()
        self._owner = ident
        return True

    def _unlock(self) -> None:
        """Cache what nested frees queued, then release the lock."""
        try:
            q = self._queued
            while q:  # a collection in here queues more: taken in this loop too
                self._cache_entry(*q.popleft())
        finally:
            self._owner = None
            self._lock.release()

    def _cache_entry(self, r: int, ptr: int, stream_ptr: int, ev: Any) -> None:
        """Under the lock: a freed block waits for reuse behind ``ev``."""
        entries = self._free.get(r)
        if entries is None:
            entries = self._free[r] = deque()
        if not entries:
            bisect.insort(self._classes, r)
        entries.append((ptr, stream_ptr, ev))
        self._order[ptr] = r
        self.cached += r

    def _uncache(self, r: int, entries: deque, entry: tuple) -> None:
        """Under the lock: ``entry`` (of size class ``r``) leaves the cache."""
        entries.remove(entry)
        if not entries:
            i = bisect.bisect_left(self._classes, r)
            if i < len(self._classes) and self._classes[i] == r:
                del self._classes[i]
        self._order.pop(entry[0], None)
        self.cached -= r

    # -- events ----------------------------------------------------------------------
    def _event(self) -> Any:
        if self._acquire():  # (nested: a new event, the idle list may be in use)
            try:
                if self._idle_events:
                    return self._idle_events.pop()
            finally:
                self._unlock()
        drv = _driver.get()
        # An event belongs to the context current at its creation: the cache's device's.
        with _device.on_device(self.device):
            return check_driver(
                drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate"
            )

    def _record(self, ev: Any, stream_ptr: int) -> None:
        # Events and the stream are the cache's device's, whatever the freeing thread
        # has current (another GPU, or no context at all).
        with _device.on_device(self.device):
            check_driver(_driver.get().cuEventRecord(ev, stream_ptr), "cuEventRecord")

    def _idle_event(self, ev: Any) -> None:
        """An event no block waits behind any more: kept for the next free (up to
        ``_IDLE_EVENTS``), else destroyed."""
        locked = self._acquire()
        try:
            if locked and len(self._idle_events) < _IDLE_EVENTS:
                self._idle_events.append(ev)  # for the next free
                return
        finally:
            if locked:
                self._unlock()
        with _device.on_device(self.device):
            _driver.get().cuEventDestroy(ev)

    @staticmethod
    def _done(event: Any) -> bool:
        # NOT_READY, or a query refused during someone's global-mode capture: not yet.
        return int(_driver.get().cuEventQuery(event)[0]) == 0

    @staticmethod
    def _wait(stream_ptr: int, event: Any) -> bool:
        """Order ``stream_ptr``'s next work after ``event``; False when the driver
        refuses (the stream is not usable: the block waits for its event instead)."""
        return int(_driver.get().cuStreamWaitEvent(stream_ptr, event, 0)[0]) == 0

    def _may_serve(self, entry: tuple, stream_ptr: int) -> bool:
        """Under the lock: whether a freed block (``entry``) may serve an allocation on
        ``stream_ptr`` now.  Its own stream: at once, behind a wait on its event when
        that has not completed and the handle is not the legacy stream's (0, 1: never
        destroyed); the per-thread default stream (2) is another stream in each
        thread.  Any other stream: once the event has completed."""
        if entry[1] != stream_ptr or stream_ptr == _PER_THREAD:
            return self._done(entry[2])
        if stream_ptr <= 1 or self._done(entry[2]):
            return True
        return self._wait(stream_ptr, entry[2])

    # -- allocation --------------------------------------------------------------------
    def _take(self, r: int, stream_ptr: int) -> int:
        """Under the lock: a cached block that may serve ``r`` bytes on the stream, or 0.

        The smallest size class that fits first; in a class, the oldest block."""
        classes = self._classes
        limit = r + int(r * self.fit)
        i = bisect.bisect_left(classes, r)
        while i < len(classes) and classes[i] <= limit:
            c = classes[i]
            entries = self._free[c]
            for entry in entries:
                if self._may_serve(entry, stream_ptr):
                    self._uncache(c, entries, entry)
                    self._idle_events.append(entry[2])
                    return entry[0]
            i += 1
        return 0

    def alloc(self, size: int, stream_ptr: int) -> tuple[int, int]:
        """``(CUresult, ptr)``: a cached block when one is safe to reuse, else a new one."""
        r = self._round(size)
        if self._acquire():  # (nested: a new block, the cache may be being iterated)
            try:
                ptr = self._take(r, stream_ptr)
                if ptr:
                    self.n_hits += 1
                    self.live_high = max(self.live_high, self.reserved - self.cached)
                    return 0, ptr
            finally:
                self._unlock()
        self._make_room(r)
        err, ptr = self._create(r)
        if err == _OUT_OF_MEMORY and self.cached:
            # Freed blocks whose streams are past their frees go back first.
            self._release_quietly(0)
            err, ptr = self._create(r)
        if err:
            return err, 0
        locked = self._acquire()  # (nested: this thread holds it, nothing iterates these)
        try:
            self._sizes[ptr] = r
            self.reserved += r
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            self.live_high = max(self.live_high, self.reserved - self.cached)
            self.n_driver_allocs += 1
        finally:
            if locked:
                self._unlock()
        return 0, ptr

    def free(self, ptr: int, stream_ptr: int) -> None:
        """Cache a freed block behind an event recorded on its stream now."""
        r = self._sizes.get(ptr)
        if r is None:
            return
        ev = self._event()
        try:
            self._record(ev, stream_ptr)
        except BaseException:
            # (the legacy stream during another thread's capture, say): the block stays
            # live, and the caller may free it again later.
            self._idle_event(ev)
            raise
        if not self._acquire():  # from a collection under the lock: its holder adds it
            self._queued.append((r, ptr, stream_ptr, ev))
            return
        try:
            self._cache_entry(r, ptr, stream_ptr, ev)
        finally:
            self._unlock()
        keep = self._keep()
        if self.cached > keep:
            self._release_quietly(keep)

    def free_leftover(self, ptr: int) -> None:
        """Free a block its pool's finalizer left to the retirer (its stream may be gone):
        on the legacy stream, which the retirer's device sync has already drained."""
        self.free(ptr, 0)

    def release(self, keep: int = 0, wait: bool = True, at_least: bool = False) -> int:
        """Destroy cached blocks, oldest first, until at most ``keep`` bytes stay cached
        (``at_least``: only blocks whose going leaves at least ``keep`` cached).

        Blocks whose events have not completed stay unless ``wait``.  Returns the
        bytes given back.  A block the driver refuses to take back is forgotten and
        counted (``n_errors``, ``leaked``), the others go back, then the first error is
        raised.
        """
        freed = 0
        victims: list = []
        if not self._acquire():  # from a collection under the lock: the cache is in use
            return 0
        try:
            for ptr, r in list(self._order.items()):
                if self.cached <= keep:
                    break
                if at_least and self.cached - r < keep:
                    continue  # this one would take the cache below ``keep``
                if self.is_pinned(ptr):
                    continue  # another process maps it: not unmapped under it
                entries = self._free[r]
                entry = next(e for e in entries if e[0] == ptr)
                if wait or self._done(entry[2]):
                    self._uncache(r, entries, entry)
                    # Forgotten before it is destroyed: the driver may hand its
                    # address to another thread's new block at once.
                    del self._sizes[ptr]
                    self.reserved -= r
                    victims.append((r, entry))
                    freed += r
        finally:
            self._unlock()
        if not victims:
            return 0
        drv = _driver.get()
        error: BaseException | None = None
        with _device.on_device(self.device):
            for r, (ptr, _sptr, ev) in victims:
                try:
                    if wait:
                        drv.cuEventSynchronize(ev)
                    self._destroy(ptr, r)
                except BaseException as exc:  # the others go back still; this one leaks
                    self.n_errors += 1
                    self.leaked += r
                    error = error or exc
                finally:
                    self._idle_event(ev)
        if error is not None:
            raise error
        return freed

    def _release_quietly(self, keep: int) -> None:
        """:meth:`release` without waiting, from a free or an allocation: a block the
        driver refuses to take back is counted (``n_errors``, ``leaked``), never raised
        into the unrelated allocation or free that made room."""
        try:
            self.release(keep=keep, wait=False)
        except Exception:
            pass

    def reset_peak(self) -> None:
        """The reserved peak starts again from now (``live_high``, which a subclass's
        policy may read, is the most ever live and stays)."""
        self.peak_reserved = self.reserved

    def close(self) -> None:
        """Give every cached block back and drop the idle events (the pool is drained);
        the events go even when a block's give-back fails (raised after)."""
        try:
            self.release(0, wait=True)
        finally:
            self._drop_idle_events()

    def _drop_idle_events(self) -> None:
        locked = self._acquire()
        try:
            events, self._idle_events = self._idle_events, []
        finally:
            if locked:
                self._unlock()
        if events:
            with _device.on_device(self.device):
                for ev in events:
                    _driver.get().cuEventDestroy(ev)
