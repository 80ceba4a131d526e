"""Pure-Python twin of ``_hotpath.pyx``, used when the extension is not built.

Same classes, same behaviour, roughly 1.6x slower per allocation (see
``benchmarks/alloc.py``).  Keep the two files in step.
"""

from __future__ import annotations

from typing import Any

from cuda.bindings import driver as _drv
from cupy.cuda.memory import MemoryPointer as _MemoryPointer
from cupy.cuda.memory import UnownedMemory as _UnownedMemory
from cupy.cuda.pinned_memory import PinnedMemoryPointer as _PinnedMemoryPointer
from cupy.cuda.stream import get_current_stream as _get_current_stream

KIND_DEVICE = 0
KIND_PINNED = 1
KIND_MANAGED = 2
IMPLEMENTATION = "python"

_shared_release = None
_alloc = _drv.cuMemAllocFromPoolAsync
_free = _drv.cuMemFreeAsync
_ctx_device = _drv.cuCtxGetDevice


def set_shared_release(fn: Any) -> None:
    global _shared_release
    _shared_release = fn


class Block:
    """One live pool allocation; CuPy's memory object owns it through ``UnownedMemory``."""

    __slots__ = ("ptr", "size", "stream_ptr", "stream", "core", "share", "info", "__weakref__")

    def __del__(self) -> None:
        core = self.core
        if core is None or self.ptr == 0:
            return
        core.n_frees += 1
        core.live_bytes -= self.size
        try:
            if core.observer is not None:
                core.observer.on_free(core, self.ptr, self.size, self.stream_ptr, self.info)
            if self.share is not None and _shared_release is not None:
                if _shared_release(self.ptr, self.size, self.stream, self.share):
                    return
            if core.release_hook is not None:
                if core.release_hook(self.ptr, self.size, self.stream):
                    return
        except BaseException:
            core.n_free_errors += 1
            return
        core._release(self.ptr, self.size, self.stream_ptr, self.stream)
        if core.closed and core.n_frees == core.n_allocs:
            core._drained()


class PoolCore:
    """The per-pool state the hot path needs; Python pool classes subclass it.

    See ``_hotpath.pyx`` for the reuse cache.
    """

    def __init__(self) -> None:  # pragma: no cover - subclasses call _attach
        pass

    _pool: Any = None
    device_id = -1
    kind = KIND_DEVICE
    closed = False
    observer: Any = None
    release_hook: Any = None
    n_allocs = 0
    n_frees = 0
    n_free_errors = 0
    n_oom = 0
    live_bytes = 0
    peak_live_bytes = 0
    cache_limit = 0
    cache_max_block = 0
    cached_bytes = 0
    soft_limit = 0

    def _attach(self, pool_handle: int, device_id: int, kind: int) -> None:
        self._pool = _drv.CUmemoryPool(pool_handle)
        self.device_id = device_id
        self.kind = kind
        self._cache: dict = {}

    def _mark_closed(self) -> None:
        self.closed = True
        self.flush_cache()

    def _poison(self) -> None:
        """Refuse allocations without touching CUDA (after a fork)."""
        self.closed = True

    def _release(self, ptr: int, size: int, stream_ptr: int, stream: Any) -> None:
        if (
            size <= self.cache_max_block
            and self.cached_bytes + size <= self.cache_limit
            and not self.closed
        ):
            self._cache.setdefault((stream_ptr, size), []).append((ptr, stream))
            self.cached_bytes += size
            return
        self._free_now(ptr, stream_ptr)

    def flush_cache(self) -> int:
        """Free every block held in the reuse cache (stream-ordered); returns bytes freed."""
        freed, cache = self.cached_bytes, self._cache
        self._cache, self.cached_bytes = {}, 0
        for (sptr, _size), entries in cache.items():
            for ptr, _stream in entries:
                self._free_now(ptr, sptr)
        return freed

    def malloc(self, size: int) -> Any:
        """Allocate ``size`` bytes on CuPy's current stream; see the pool's docstring."""
        if self.closed:
            self._raise_closed()
        if size < 0:
            raise OverflowError(f"can't allocate a negative size ({size})")
        if self.kind != KIND_PINNED:
            err, cur = _ctx_device()
            if err or int(cur) != self.device_id:
                self._raise_wrong_device(int(cur) if not err else -1)
        stream = _get_current_stream()
        sptr = stream.ptr
        dptr = 0
        if size:
            if self.soft_limit and self.live_bytes + size > self.soft_limit:
                dptr = self._alloc_failed(2, size, stream)
            elif self.cached_bytes:
                hit = self._cache.get((sptr, size))
                if hit:
                    dptr, _ = hit.pop()
                    self.cached_bytes -= size
            if not dptr:
                err, p = _alloc(size, self._pool, sptr)
                dptr = int(p) if not err else self._alloc_failed(int(err), size, stream)
        b = Block()
        b.ptr, b.size, b.stream_ptr, b.stream, b.core = dptr, size, sptr, stream, self
        b.share = b.info = None
        self.n_allocs += 1
        self.live_bytes += size
        if self.live_bytes > self.peak_live_bytes:
            self.peak_live_bytes = self.live_bytes
        if self.observer is not None:
            self.observer.on_alloc(b)
        if self.kind == KIND_PINNED:
            return _PinnedMemoryPointer(b, 0)
        return _MemoryPointer(_UnownedMemory(dptr, size, b, self.device_id), 0)

    def _try_alloc(self, size: int, stream_ptr: int) -> tuple[int, int]:
        err, p = _alloc(size, self._pool, stream_ptr)
        return int(err), (int(p) if not err else 0)

    def _free_now(self, ptr: int, stream_ptr: int) -> None:
        (err,) = _free(ptr, stream_ptr)
        if err:
            self.n_free_errors += 1

    def _raise_closed(self) -> None:
        raise RuntimeError("pool is closed")

    def _raise_wrong_device(self, current: int) -> None:
        raise RuntimeError(f"wrong device {current}")

    def _alloc_failed(self, err: int, size: int, stream: Any) -> int:
        raise MemoryError(f"CUresult {err} allocating {size} bytes")

    def _drained(self) -> None:
        pass


class Dispatch:
    """``malloc(size)`` that forwards to the current device's pool (created on first use)."""

    def __init__(self, create: Any, n_devices: int) -> None:
        self._mallocs: list[Any] = [None] * n_devices
        self._create = create

    def __call__(self, size: int) -> Any:
        err, d = _ctx_device()
        d = int(d)
        if err or d >= len(self._mallocs):
            return self._slow(-1).malloc(size)
        p = self._mallocs[d]
        if p is None:
            p = self._slow(d)
        return p.malloc(size)

    def _slow(self, d: int) -> Any:
        if d < 0:
            import cupy

            d = cupy.cuda.runtime.getDevice()
        p = self._create(d)
        self._mallocs[d] = p
        return p

    def _forget(self) -> None:
        self._mallocs = [None] * len(self._mallocs)
