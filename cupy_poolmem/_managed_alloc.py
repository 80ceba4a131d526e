"""The two backends of ``ManagedPool`` and the probe that chooses between them.

``"pool"``: a CUDA managed memory pool (``cuMemAllocFromPoolAsync``, CUDA 13).  Some
drivers (580 / CUDA 13.0) refuse every ``cuMemAdvise`` on memory from such a pool
with ``CUDA_ERROR_NOT_SUPPORTED``.

``"managed"``: :class:`ManagedAllocator`, blocks from ``cuMemAllocManaged`` kept for
reuse.  Advice and prefetch work on them with any driver that has managed memory.
``cuMemAllocManaged`` is slow and may synchronise, so freed blocks are cached by
size: a block is reused at once on the stream that freed it (stream order covers
it), and on another stream only once an event recorded at its free has completed.
The pool's own reuse cache sits in front of this one, as for the other backends.

The probe (once per device and process) allocates 4 KiB from the pool it is about
to use and asks for the hints ``advise`` gives; a refusal selects ``"managed"``.
"""

from __future__ import annotations

import threading
from collections import deque
from threading import get_ident
from typing import Any

from ._errors import UnsupportedError, check_driver

__all__ = ["ManagedAllocator", "probe_pool_advice", "recorded_choice", "record_choice"]

_GRANULE = 4096  # sizes are rounded up to pages: blocks of one class serve each other
_UINT64_MAX = 2**64 - 1

_choices: dict[int, tuple[str, str]] = {}  # device -> (backend, reason)
_choices_lock = threading.Lock()


def _drv() -> Any:
    from cuda.bindings import driver

    return driver


def recorded_choice(device: int) -> tuple[str, str] | None:
    """The backend the probe chose for ``device`` in this process, with its reason."""
    return _choices.get(device)


def record_choice(device: int, backend: str, reason: str) -> tuple[str, str]:
    with _choices_lock:
        return _choices.setdefault(device, (backend, reason))


def _device_location(device: int) -> Any:
    drv = _drv()
    loc = drv.CUmemLocation()
    loc.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    loc.id = device
    return loc


def mem_advise(ptr: int, size: int, advice: Any, device: int) -> int:
    """``cuMemAdvise`` toward ``device`` with the signature of this cuda-bindings; CUresult."""
    drv = _drv()
    import cuda.bindings

    if int(cuda.bindings.__version__.split(".")[0]) >= 13:
        (res,) = drv.cuMemAdvise(ptr, size, advice, _device_location(device))
    elif hasattr(drv, "cuMemAdvise_v2"):
        (res,) = drv.cuMemAdvise_v2(ptr, size, advice, _device_location(device))
    else:  # pragma: no cover - old 12.x bindings
        (res,) = drv.cuMemAdvise(ptr, size, advice, device)
    return int(res)


def _error_name(code: int) -> str:
    try:
        return _drv().CUresult(code).name
    except ValueError:
        return f"CUresult {code}"


def probe_pool_advice(pool_handle: int, device: int) -> tuple[bool, str]:
    """Whether the driver takes placement advice on memory from the managed pool.

    Allocates 4 KiB from the pool (nothing near the GPU's free memory), gives it the
    pool's own preferred location and read-mostly on then off, and frees it.
    """
    drv = _drv()
    A = drv.CUmem_advise
    err, ptr = drv.cuMemAllocFromPoolAsync(_GRANULE, drv.CUmemoryPool(pool_handle), 0)
    if int(err):
        return False, f"probe allocation failed ({_error_name(int(err))})"
    try:
        check_driver(drv.cuStreamSynchronize(0), "cuStreamSynchronize")
        for advice in (
            A.CU_MEM_ADVISE_SET_PREFERRED_LOCATION,
            A.CU_MEM_ADVISE_SET_READ_MOSTLY,
            A.CU_MEM_ADVISE_UNSET_READ_MOSTLY,
        ):
            res = mem_advise(ptr, _GRANULE, advice, device)
            if res:
                return False, (
                    f"this driver refuses advice on managed-pool memory: cuMemAdvise "
                    f"({advice.name}) returned {_error_name(res)}"
                )
        return True, "this driver takes advice on managed-pool memory"
    finally:
        drv.cuMemFreeAsync(ptr, 0)
        drv.cuStreamSynchronize(0)


def require_managed_memory(device: int) -> None:
    drv = _drv()
    err, ok = drv.cuDeviceGetAttribute(
        drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY, device
    )
    if int(err) or not int(ok):
        raise UnsupportedError(
            f"device {device} does not support managed memory (CU_DEVICE_ATTRIBUTE_MANAGED_"
            "MEMORY is 0); ManagedPool needs it. Use DevicePool instead."
        )


class ManagedAllocator:
    """``cuMemAllocManaged`` blocks for one device, cached by size, reuse ordered by events.

    ``alloc`` and ``free`` run only when the pool's reuse cache misses or overflows.
    ``release`` (trim, close, out-of-memory) gives cached blocks back with
    ``cuMemFree`` once their events have completed (all of them with ``wait``).

    A garbage collection can start while a thread holds the lock (any allocation under
    it), and a block freed there comes back to :meth:`free` in the same thread, while
    the outer call may be iterating the cache.  Such a nested free does not take the
    lock: it queues its entry, and the lock's holder adds it before releasing (as
    ``stats._Observer._run`` does).  No reentrant critical section, no deadlock.
    """

    def __init__(self, device: int) -> None:
        self.device = device
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread holding _lock
        self._queued: deque = deque()  # (rounded size, ptr, stream, event) of nested frees
        self._free: dict[int, deque] = {}  # rounded size -> deque of (ptr, stream, event)
        self._sizes: dict[int, int] = {}  # ptr -> rounded size, live or cached
        self._idle_events: list[Any] = []
        self.reserved = 0  # bytes from cuMemAllocManaged held now (live + cached)
        self.peak_reserved = 0
        self.cached = 0
        self.release_threshold = _UINT64_MAX
        self.n_driver_allocs = 0

    @staticmethod
    def _round(size: int) -> int:
        return (size + _GRANULE - 1) // _GRANULE * _GRANULE

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
        entries.append((ptr, stream_ptr, ev))
        self.cached += r

    # -- events ----------------------------------------------------------------------
    def _event(self) -> Any:
        if self._acquire():  # (nested: a new event, the idle list may be in use)
            try:
                if self._idle_events:
                    return self._idle_events.pop()
            finally:
                self._unlock()
        drv = _drv()
        return check_driver(
            drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate"
        )

    @staticmethod
    def _done(event: Any) -> bool:
        # NOT_READY, or a query refused during someone's global-mode capture: not yet.
        return int(_drv().cuEventQuery(event)[0]) == 0

    # -- allocation --------------------------------------------------------------------
    def alloc(self, size: int, stream_ptr: int) -> tuple[int, int]:
        """``(CUresult, ptr)``: a cached block when one is safe to reuse, else a new one."""
        r = self._round(size)
        if self._acquire():  # (nested: a new block, the cache may be being iterated)
            try:
                entries = self._free.get(r)
                if entries:
                    for i, (ptr, sptr, ev) in enumerate(entries):
                        if sptr == stream_ptr or self._done(ev):
                            del entries[i]
                            self.cached -= r
                            self._idle_events.append(ev)
                            return 0, ptr
            finally:
                self._unlock()
        drv = _drv()
        err, p = drv.cuMemAllocManaged(r, drv.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL.value)
        if int(err):
            return int(err), 0
        ptr = int(p)
        # The pool prefers its GPU, as a managed pool created for it does.
        mem_advise(ptr, r, drv.CUmem_advise.CU_MEM_ADVISE_SET_PREFERRED_LOCATION, self.device)
        locked = self._acquire()  # (nested: this thread holds it, nothing iterates these)
        try:
            self._sizes[ptr] = r
            self.reserved += r
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            self.n_driver_allocs += 1
        finally:
            if locked:
                self._unlock()
        return 0, ptr

    def free(self, ptr: int, stream_ptr: int) -> None:
        """Cache a freed block behind an event recorded on its stream now."""
        from ._device import on_device

        r = self._sizes.get(ptr)
        if r is None:
            return
        with on_device(self.device):
            ev = self._event()
            check_driver(_drv().cuEventRecord(ev, stream_ptr), "cuEventRecord")
        if not self._acquire():  # from a collection under the lock: its holder adds it
            self._queued.append((r, ptr, stream_ptr, ev))
            return
        try:
            self._cache_entry(r, ptr, stream_ptr, ev)
        finally:
            self._unlock()
        if self.cached > self.release_threshold:
            self.release(keep=self.release_threshold, wait=False)

    def free_leftover(self, ptr: int) -> None:
        """Free a block its pool's finalizer left to the retirer (its stream may be gone):
        on the legacy stream, which the retirer's device sync has already drained."""
        self.free(ptr, 0)

    def release(self, keep: int = 0, wait: bool = True) -> int:
        """``cuMemFree`` cached blocks until at most ``keep`` bytes stay cached.

        Blocks whose events have not completed stay unless ``wait``.  Returns the
        bytes given back.
        """
        from ._device import on_device

        drv = _drv()
        freed = 0
        victims: list = []
        if not self._acquire():  # from a collection under the lock: the cache is in use
            return 0
        try:
            for r, entries in self._free.items():
                for entry in list(entries):
                    if self.cached - freed <= keep:
                        break
                    if wait or self._done(entry[2]):
                        entries.remove(entry)
                        victims.append((r, entry))
                        freed += r
            self.cached -= freed
        finally:
            self._unlock()
        if not victims:
            return 0
        with on_device(self.device):
            for r, (ptr, _sptr, ev) in victims:
                if wait:
                    drv.cuEventSynchronize(ev)
                drv.cuMemFree(ptr)
                drv.cuEventDestroy(ev)
                locked = self._acquire()
                try:
                    self._sizes.pop(ptr, None)
                    self.reserved -= r
                finally:
                    if locked:
                        self._unlock()
        return freed

    def close(self) -> None:
        """Give every cached block back and drop the idle events (the pool is drained)."""
        from ._device import on_device

        self.release(0, wait=True)
        locked = self._acquire()
        try:
            events, self._idle_events = self._idle_events, []
        finally:
            if locked:
                self._unlock()
        if events:
            with on_device(self.device):
                for ev in events:
                    _drv().cuEventDestroy(ev)
