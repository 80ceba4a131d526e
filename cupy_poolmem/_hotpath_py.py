"""Pure-Python twin of ``_hotpath.pyx``, used when the extension is not built.

Same classes, same behaviour, roughly 1.6x slower per allocation (see
``benchmarks/alloc.py``).  Keep the two files in step: ``tests/test_hotpath_cpu.py``
compares their names and signatures, and ``.ci/gpu tests`` runs the GPU suites of
the pools, sharing and Dask a second time with ``CUPY_POOLMEM_PURE_PYTHON=1``.
"""

from __future__ import annotations

import operator
from gc import is_finalized as _gc_is_finalized
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
# Bumped whenever the interface the pools use changes: a stale build is not used.
VERSION = 6

FLAG_RECORDED = 1
FLAG_CAPTURED = 2
FLAG_ADVISED = 4
_FLAG_SPECIAL = FLAG_CAPTURED | FLAG_ADVISED
_SIZE_MAX = 2**64 - 1
# Allocations in a row that a non-empty reuse cache cannot serve before it is flushed.
FLUSH_AFTER_MISSES = 16

_shared_release = None
_shared_retire = None
_alloc = _drv.cuMemAllocFromPoolAsync
_free = _drv.cuMemFreeAsync
_ctx_device = _drv.cuCtxGetDevice
_is_capturing = _drv.cuStreamIsCapturing


def set_shared_release(fn: Any, retire: Any = None) -> None:
    global _shared_release, _shared_retire
    _shared_release = fn
    _shared_retire = retire


def _as_size(size: Any) -> int:
    """What Cython's ``size_t`` conversion does: ``__index__``, then the range check."""
    n = operator.index(size)  # TypeError for floats, strings, None ...
    if n < 0:
        raise OverflowError("can't convert negative value to size_t")
    if n > _SIZE_MAX:
        raise OverflowError("int too big to convert")
    return n


class Block:
    """One live pool allocation; CuPy's memory object owns it through ``UnownedMemory``."""

    __slots__ = (
        "ptr",
        "size",
        "stream_ptr",
        "stream",
        "core",
        "share",
        "info",
        "flags",
        "_recorded",
        "__weakref__",
    )
    ptr: int
    size: int
    stream_ptr: int
    stream: Any
    core: Any
    share: Any
    info: Any
    flags: int
    _recorded: list[Any] | None

    @property
    def recorded_streams(self) -> tuple:
        """The streams given to ``record_stream`` for this block, as a tuple."""
        if self._recorded is None:
            return ()
        return tuple(e[2] for e in self._recorded)

    def wait_recorded(self, stream: Any) -> None:
        """Make ``stream`` wait (on the device) for the work now on the recorded streams."""
        if self._recorded is not None:
            self.core._wait_recorded(stream, self._recorded)

    def _record(self, entry: Any) -> None:
        """Add a ``(handle, device, stream)`` entry (``record_stream`` validated it)."""
        if self._recorded is None:
            self._recorded = []
        for e in self._recorded:
            if e[0] == entry[0] and e[1] == entry[1]:
                return
        self._recorded.append(entry)
        self.flags |= FLAG_RECORDED

    def _mark_advised(self) -> None:
        self.flags |= FLAG_ADVISED

    def __del__(self) -> None:
        core = self.core
        if core is None:
            return
        if self.ptr == 0:  # a size-0 allocation: counted, nothing to free
            core.n_frees += 1
            if core.closed and core.n_frees == core.n_allocs:
                core._drained()
            return
        core.live_bytes -= self.size
        kept = False
        try:
            if (
                core.finalized
                or _gc_is_finalized(self.stream)
                or (self.flags & FLAG_RECORDED and _any_finalized(self._recorded))
            ):  # see _hotpath.pyx
                if core.observer is not None:
                    core.observer.on_free(core, self.ptr, self.size, self.stream_ptr, self.info)
                # An exported block goes to its exporter first (see _hotpath.pyx).
                if self.share is not None and core._retire_shared(
                    self.ptr, self.size, None, self.share
                ):
                    kept = True
                else:
                    kept = core._orphan(self.ptr, self.size, self.flags)
            else:
                if self.flags & FLAG_RECORDED:
                    core._wait_recorded(self.stream, self._recorded)
                if core.observer is not None:
                    core.observer.on_free(core, self.ptr, self.size, self.stream_ptr, self.info)
                if self.share is not None and _shared_release is not None:
                    if _shared_release(core, self.ptr, self.size, self.stream, self.share):
                        core.n_frees += 1  # in limbo: the exporter frees it, then drains
                        return
                if core.release_hook is not None:  # pinned deferral, graph memory
                    kept = core.release_hook(self.ptr, self.size, self.stream)
                if not kept and self.flags & _FLAG_SPECIAL:
                    kept = core._free_flagged(self.ptr, self.size, self.stream, self.flags)
        except BaseException:
            core.n_free_errors += 1
            core.n_frees += 1
            return
        if not kept:
            core._release(self.ptr, self.size, self.stream_ptr, self.stream)
        # Counted once the free (or its hand-off) is queued (see _hotpath.pyx).
        core.n_frees += 1
        if core.closed and core.n_frees == core.n_allocs:
            core._drained()  # a closed pool's last block, however it went


def _any_finalized(recorded: Any) -> bool:
    """Whether a stream given to record_stream was finalized (destroyed by cupy)."""
    return bool(recorded) and any(_gc_is_finalized(e[2]) for e in recorded)


class PoolCore:
    """The per-pool state the hot path needs; Python pool classes subclass it.

    See ``_hotpath.pyx`` for the reuse cache (entries ``(ptr, stream, share)``) and
    the capture check.
    """

    def __init__(self) -> None:  # pragma: no cover - subclasses call _attach
        pass

    _pool: Any = None
    device_id = -1
    kind = KIND_DEVICE
    closed = False
    _close_done = False  # close() has handed everything over: may be retired
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
    n_capture_held = 0
    _backend: Any = None
    _retire_token = 0
    finalized = False
    cache_misses = 0  # allocations in a row the cache could not serve

    def _attach(self, pool_handle: int, device_id: int, kind: int) -> None:
        self._pool = _drv.CUmemoryPool(pool_handle) if pool_handle else None
        self.device_id = device_id
        self.kind = kind
        self._cache: dict = {}

    def _mark_closed(self) -> None:
        self.closed = True
        self.flush_cache()

    def _poison(self) -> None:
        """Refuse allocations without touching CUDA (after a fork)."""
        self.closed = True

    def _mark_finalized(self) -> None:
        """From now on a freed block goes to :meth:`_orphan`, never to its stream."""
        self.finalized = True

    def _cache_missed(self) -> None:
        """A miss while the cache holds blocks: after FLUSH_AFTER_MISSES in a row, the
        blocks it holds go back to the CUDA pool (see ``_hotpath.pyx``)."""
        self.cache_misses += 1
        if self.cache_misses >= FLUSH_AFTER_MISSES:
            self.cache_misses = 0
            self.flush_cache()

    def _release(self, ptr: int, size: int, stream_ptr: int, stream: Any) -> None:
        if (
            size <= self.cache_max_block
            and self.cached_bytes + size <= self.cache_limit
            and not self.closed
        ):
            self._cache.setdefault((stream_ptr, size), []).append((ptr, stream, None))
            self.cached_bytes += size
            return
        self._free_now(ptr, stream_ptr, stream)

    def _cache_shared(self, ptr: int, size: int, stream_ptr: int, stream: Any, share: Any) -> bool:
        """Keep an exported block with its sharing record ``share`` (any size within
        ``cache_limit``); False when the cache cannot take it."""
        if self.closed or self.finalized or self.cached_bytes + size > self.cache_limit:
            return False
        self._cache.setdefault((stream_ptr, size), []).append((ptr, stream, share))
        self.cached_bytes += size
        return True

    def _retire_shared(self, ptr: int, size: int, stream: Any, share: Any) -> bool:
        """Whether the exporter keeps an exported block for its final free (see
        ``_hotpath.pyx``)."""
        if _shared_retire is None:
            return False
        try:
            return bool(_shared_retire(self, ptr, size, stream, share))
        except BaseException:
            self.n_free_errors += 1  # leaking is safe, freeing while mapped elsewhere is not
            return True

    def flush_cache(self) -> int:
        """Free every block held in the reuse cache (stream-ordered); returns bytes freed.

        An exported block's final free is its exporter's, after its receivers unmap it.
        """
        freed, cache = self.cached_bytes, self._cache
        self._cache, self.cached_bytes = {}, 0
        for (sptr, size), entries in cache.items():
            for ptr, stream, share in entries:
                if share is not None and self._retire_shared(ptr, size, stream, share):
                    continue
                self._free_now(ptr, sptr, stream)
        return freed

    def _take_cache(self) -> list[int]:
        """Empty the reuse cache without freeing: ``[ptr, ...]`` for the caller to free
        (an exported block only once no receiver maps it: see ``_hotpath.pyx``)."""
        cache, self._cache = self._cache, {}
        self.cached_bytes = 0
        out = []
        for (_sptr, size), entries in cache.items():
            for ptr, _stream, share in entries:
                if share is not None and self._retire_shared(ptr, size, None, share):
                    continue
                out.append(ptr)
        return out

    def malloc(self, size: Any) -> Any:
        """Allocate ``size`` bytes on CuPy's current stream; see the pool's docstring."""
        if size.__class__ is not int or size < 0 or size > _SIZE_MAX:
            try:
                size = _as_size(size)
            except (TypeError, OverflowError):
                self._bad_size(size)
                raise
        if self.closed:
            self._raise_closed()
        if self.kind != KIND_PINNED:
            err, cur = _ctx_device()
            if err or int(cur) != self.device_id:
                self._raise_wrong_device(int(cur) if not err else -1)
        stream = _get_current_stream()
        sptr = stream.ptr
        if sptr > 1:  # 0 and 1 are the legacy stream, which cannot capture
            err, cap = _is_capturing(sptr)
            if err or cap:
                return self._capture_malloc(size, int(err), int(cap))
        dptr = 0
        share = None
        if size:
            if self.soft_limit and self.live_bytes + size > self.soft_limit:
                dptr = self._alloc_failed(2, size, stream)
            elif self.cached_bytes:
                hit = self._cache.get((sptr, size))
                if hit:
                    dptr, _, share = hit.pop()
                    self.cached_bytes -= size
                    self.cache_misses = 0
                else:
                    self._cache_missed()
            if not dptr:
                if self.n_capture_held:
                    self._drain_capture_held()
                if self._pool is not None:
                    err, p = _alloc(size, self._pool, sptr)
                    dptr = int(p) if not err else self._alloc_failed(int(err), size, stream)
                else:
                    dptr = self._backend_alloc(size, stream)
        return self._wrap(dptr, size, sptr, stream, 0, share)

    def _make_block(self, ptr: int, size: int, stream: Any, flags: int) -> Any:
        """A live block for memory a slow path allocated (graph capture)."""
        return self._wrap(ptr, size, stream.ptr, stream, flags, None)

    def _wrap(self, dptr: int, size: int, sptr: int, stream: Any, flags: int, share: Any) -> Any:
        b = Block()
        b.ptr, b.size, b.stream_ptr, b.stream, b.core = dptr, size, sptr, stream, self
        b.share = share  # None, or the record of an exported block back from the cache
        b.info = b._recorded = None
        b.flags = flags
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
        """One raw attempt: returns ``(CUresult, ptr)``; used by the slow paths."""
        if self._pool is None:
            return self._backend_try(size, stream_ptr)
        err, p = _alloc(size, self._pool, stream_ptr)
        return int(err), (int(p) if not err else 0)

    def _free_now(self, ptr: int, stream_ptr: int, stream: Any = None) -> None:
        """Free a block a hook kept earlier (limbo, deferred pinned frees)."""
        # ``stream``: the stream object when the caller has it (kept alive while held).
        if stream_ptr > 1:
            err, cap = _is_capturing(stream_ptr)
            if err or cap:
                self._hold_free(ptr, stream_ptr, int(err), stream)
                return
        if self._pool is None:
            self._backend_free(ptr, stream_ptr)
            return
        (err,) = _free(ptr, stream_ptr)
        if err:
            self._free_failed(ptr, stream_ptr, int(err), stream)

    def _free_direct(self, ptr: int, stream_ptr: int) -> int:
        """The driver (or backend) free without the capture check; returns the CUresult."""
        if self._pool is None:
            self._backend_free(ptr, stream_ptr)
            return 0
        (err,) = _free(ptr, stream_ptr)
        return int(err)

    # Slow paths, overridden by the Python pool classes.
    def _bad_size(self, size: Any) -> None:
        pass  # the caller re-raises the conversion error

    def _capture_malloc(self, size: int, err: int, status: int) -> Any:
        raise RuntimeError(f"stream capture (CUresult {err}, status {status})")

    def _free_flagged(self, ptr: int, size: int, stream: Any, flags: int) -> bool:
        return False

    def _orphan(self, ptr: int, size: int, flags: int) -> bool:
        self.n_free_errors += 1  # leaked: no retirer to free it safely
        return True

    def _wait_recorded(self, stream: Any, recorded: Any) -> None:
        raise RuntimeError("record_stream needs a cupy_poolmem pool")

    def _hold_free(self, ptr: int, stream_ptr: int, err: int, stream: Any) -> None:
        self.n_free_errors += 1

    def _free_failed(self, ptr: int, stream_ptr: int, err: int, stream: Any) -> None:
        self.n_free_errors += 1

    def _drain_capture_held(self) -> None:
        pass

    def _backend_alloc(self, size: int, stream: Any) -> int:
        raise MemoryError("no allocator")

    def _backend_try(self, size: int, stream_ptr: int) -> tuple[int, int]:
        return 2, 0

    def _backend_free(self, ptr: int, stream_ptr: int) -> None:
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

    def __call__(self, size: Any) -> Any:
        if size.__class__ is not int or size < 0 or size > _SIZE_MAX:
            try:
                size = _as_size(size)
            except (TypeError, OverflowError):
                self._bad_size(size)
                raise
        err, d = _ctx_device()
        # As the Cython version: no current context (a fresh thread) or an ordinal
        # past the table goes to the slow path, which asks CuPy for the device.
        if err or int(d) >= len(self._mallocs):
            return self._slow(-1).malloc(size)
        d = int(d)
        p = self._mallocs[d]
        if p is None:
            p = self._slow(d)
        return p.malloc(size)

    def _bad_size(self, size: Any) -> None:
        pass  # the caller re-raises the conversion error

    def _slow(self, d: int) -> Any:
        if d < 0:
            import cupy

            d = cupy.cuda.runtime.getDevice()
        p = self._create(d)
        self._mallocs[d] = p
        return p

    def _forget(self) -> None:
        self._mallocs = [None] * len(self._mallocs)
