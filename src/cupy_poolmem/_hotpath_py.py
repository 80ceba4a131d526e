"""Pure-Python twin of ``_hotpath.pyx``, used when the extension is not built.

Same classes, same behaviour, roughly 1.6x slower per allocation (see
``benchmarks/alloc.py``).  Keep the two files in step: ``tests/test_hotpath_cpu.py``
compares their names and signatures, and ``.ci/gpu tests`` runs the GPU suites of
the pools, sharing and Dask a second time with ``CUPY_POOLMEM_PURE_PYTHON=1``.
"""

from __future__ import annotations

import operator
import sys
import threading
import time
import weakref
from collections import deque
from gc import is_finalized as _gc_is_finalized
from typing import Any

from cuda.bindings import driver as _drv
from cupy.cuda.memory import MemoryPointer as _MemoryPointer
from cupy.cuda.memory import UnownedMemory as _UnownedMemory
from cupy.cuda.pinned_memory import PinnedMemoryPointer as _PinnedMemoryPointer
from cupy.cuda.stream import get_current_stream as _get_current_stream

from ._arena_py import Arena as ARENA  # noqa: F401  (the arena class of this hot path)
from ._streams import stream_key as _stream_key

KIND_DEVICE = 0
KIND_PINNED = 1
KIND_MANAGED = 2
IMPLEMENTATION = "python"
# Bumped whenever the interface the pools use changes: a stale build is not used.
VERSION = 15

FLAG_RECORDED = 1
FLAG_CAPTURED = 2
FLAG_ADVISED = 4
_FLAG_SPECIAL = FLAG_CAPTURED | FLAG_ADVISED
_SIZE_MAX = 2**64 - 1
# Misses beyond hits (see PoolCore._cache_missed) at which a non-empty reuse cache is flushed.
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
            try:
                core._release(self.ptr, self.size, self.stream_ptr, self.stream)
            except BaseException:
                core.n_free_errors += 1  # leaked, and counted below (see _hotpath.pyx)
        # Counted once the free (or its hand-off) is queued (see _hotpath.pyx).
        core.n_frees += 1
        if core.closed and core.n_frees == core.n_allocs:
            core._drained()  # a closed pool's last block, however it went


def _take_bin(core: Any, b: _Bin) -> list[tuple[int, Any]]:
    """A bin of a swapped-out cache (``_swap_cache``): its pairs, their bytes taken off
    ``cached_bytes`` (counted here, not zeroed by the swap: a block another thread took
    from it or put in it after the swap, having found it before, counted itself)."""
    b.live = False  # with the next line, one step (see _Bin)
    items = b.items
    core.cached_bytes -= len(items) * b.size
    return items


def _any_finalized(recorded: Any) -> bool:
    """Whether a stream given to record_stream was finalized (destroyed by cupy)."""
    return bool(recorded) and any(_gc_is_finalized(e[2]) for e in recorded)


class _Bin:
    """The reuse cache's blocks of one (stream handle, size); the last freed is reused
    first (see ``_hotpath.pyx``): ``(address, stream object that freed it)`` pairs.

    Thread switches: the GIL passes to another thread only at a call or a loop's jump
    (CPython's eval breaker), and a collection runs only at an allocation.  So a test of
    ``live`` followed, with neither in between, by the append or pop of one pair cannot
    be split by another thread's flush, which sets ``live`` False and takes ``items``
    in one such step: a bin found before a flush is then left alone (the .pyx runs
    these steps in C, where no other thread can come in).
    """

    __slots__ = ("stream_ptr", "size", "items", "live")

    def __init__(self, stream_ptr: int, size: int) -> None:
        self.stream_ptr, self.size = stream_ptr, size
        self.items: list[tuple[int, Any]] = []
        self.live = True  # False once a flush took it: nothing goes in or out any more

    @property
    def n(self) -> int:
        return len(self.items)

    def entries(self) -> list[tuple[int, Any]]:
        """``[(ptr, stream), ...]``, first cached first (flush, tests)."""
        return list(self.items)


class PoolCore:
    """The per-pool state the hot path needs; Python pool classes subclass it.

    See ``_hotpath.pyx`` for the reuse cache (``_cache``: (stream handle, size) ->
    ``_Bin``, the last bin used remembered; ``_shares``: ptr -> sharing record) and the
    capture check.
    """

    def __init__(self) -> None:  # pragma: no cover - subclasses call _attach
        pass

    _pool: Any = None
    _small: Any = None  # the small-block pool (``_pool`` when there is none)
    small_max = 0  # blocks up to this size come from ``_small`` (0: none)
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
    _backend: Any = None  # allocator object for blocks no CUDA pool serves
    backend_min = 0  # blocks of at least this size come from ``_backend``
    _backend_ptrs: Any = None  # the backend's blocks (``in``), when it serves some only
    _retire_token = 0
    finalized = False
    cache_misses = 0  # the cache's misses less its hits (see _cache_missed)
    _cache: Any = None  # (stream_ptr, size) -> _Bin, from _attach on
    _last_bin: Any = None  # the bin of (_last_sptr, _last_size), or None
    _last_sptr = 0
    _last_size = 0
    # large_blocks="expandable": see _hotpath.pyx's PoolCore._attach_arenas
    _arenas: Any = None
    _arena_sptr = 0
    _arena_small: Any = None
    _arena_large: Any = None
    arena_small_max = 0

    def _attach(self, pool_handle: int, device_id: int, kind: int) -> None:
        self._pool = _drv.CUmemoryPool(pool_handle) if pool_handle else None
        self._small = self._pool
        self.small_max = 0
        # No CUDA pool: every block from ``_backend``; else none until _attach_backend.
        self.backend_min = _SIZE_MAX if pool_handle else 0
        self._backend_ptrs = None
        self.device_id = device_id
        self.kind = kind
        self._cache: dict[tuple[int, int], _Bin] = {}
        self._shares: dict[int, Any] = {}

    def _attach_small(self, pool_handle: int, small_max: int) -> None:
        """Blocks of 1 to ``small_max`` bytes come from the CUDA pool ``pool_handle``."""
        self._small = _drv.CUmemoryPool(pool_handle)
        self.small_max = small_max

    def _attach_backend(self, backend: Any, backend_min: int, ptrs: Any) -> None:
        """Blocks of ``backend_min`` bytes or more come from ``backend`` (its
        ``_backend_alloc``); a freed address in ``ptrs`` goes back to it."""
        self._backend = backend
        self._backend_ptrs = ptrs
        self.backend_min = _as_size(backend_min)

    def _attach_arenas(self, arenas: dict, small_max: int) -> None:
        """Every block from the arenas in ``arenas`` before the backend (see
        ``_hotpath.pyx``)."""
        self._arenas = arenas
        self.arena_small_max = _as_size(small_max)
        self._arena_small = self._arena_large = None

    def _arena(self, sptr: int, size: int) -> Any:
        """The arena of (``sptr``, ``size``), or None when the stream has none yet
        (handle 2, the per-thread default stream: this thread's arenas)."""
        if sptr == 2:
            sptr = _stream_key(2)
        if self._arena_small is None or sptr != self._arena_sptr:
            pair = self._arenas.get(sptr)
            if pair is None:
                return None
            self._arena_small, self._arena_large = pair
            self._arena_sptr = sptr
        return self._arena_small if size <= self.arena_small_max else self._arena_large

    def _arena_take(self, size: int, sptr: int) -> int:
        """A block from the stream's arena without a driver call; 0 when it has no room."""
        a = self._arena(sptr, size)
        p = 0
        if a is not None:
            p = a.take(size)
            if not p:
                self._arena_small = None  # the backend may replace the stream's arenas
        return p

    def _arena_give(self, ptr: int, size: int, sptr: int) -> bool:
        """Whether the block at ``ptr`` went back to its stream's arena."""
        a = self._arena(sptr, size)
        if a is not None and a.give(ptr):
            return True
        self._arena_small = None
        return False

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
        """A miss while the cache holds blocks; a hit takes one back: at
        FLUSH_AFTER_MISSES the blocks it holds go back to the CUDA pool (see
        ``_hotpath.pyx``)."""
        self.cache_misses += 1
        if self.cache_misses >= FLUSH_AFTER_MISSES:
            self.cache_misses = 0
            self.flush_cache()

    def _pool_for(self, size: int) -> Any:
        """The CUDA pool a block of ``size`` bytes comes from (``_small`` up to ``small_max``)."""
        return self._small if size <= self.small_max else self._pool

    def _bin(self, sptr: int, size: int, create: bool) -> _Bin | None:
        """The cache's bin of (sptr, size); None when it has none and not ``create``.

        It may be taken by a flush (``live`` False) by the time the caller uses it."""
        b = self._last_bin
        if b is not None and size == self._last_size and sptr == self._last_sptr and b.live:
            return b
        b = self._cache.get((sptr, size))
        if b is None:
            if not create:
                return None
            new = _Bin(sptr, size)  # first: a flush while it is made swaps _cache
            b = self._cache.setdefault((sptr, size), new)
        self._last_bin, self._last_sptr, self._last_size = b, sptr, size
        return b

    def _release(self, ptr: int, size: int, stream_ptr: int, stream: Any) -> None:
        if self._arenas is not None and self._arena_give(ptr, size, stream_ptr):
            return  # back in its stream's arena: the next allocation there may take it
        if (
            size <= self.cache_max_block
            and self.cached_bytes + size <= self.cache_limit
            and not self.closed
        ):
            item = (ptr, stream)  # made first: a collection may run here
            b = self._last_bin  # the .pyx's _bin, its first test inline (a call costs here)
            if b is None or size != self._last_size or stream_ptr != self._last_sptr:
                b = self._bin(stream_ptr, size, True)
            while not b.live:  # another thread's flush took it after the lookup
                b = self._bin(stream_ptr, size, True)
            # From the test of live to the append no call and no allocation (see _Bin).
            if not self.closed:
                self.cached_bytes += size
                try:
                    b.items.append(item)
                except BaseException:  # no memory: not cached
                    self.cached_bytes -= size
                    raise
                return
        self._free_now(ptr, stream_ptr, stream)

    def _cache_shared(self, ptr: int, size: int, stream_ptr: int, stream: Any, share: Any) -> bool:
        """Keep an exported block with its sharing record ``share`` (any size within
        ``cache_limit``); False when the cache cannot take it."""
        if self.closed or self.finalized or self.cached_bytes + size > self.cache_limit:
            return False
        self._shares[ptr] = share  # first: never cached without it (see _hotpath.pyx)
        counted = False
        try:
            item = (ptr, stream)
            b: Any = self._bin(stream_ptr, size, True)
            while not b.live:  # taken by another thread's flush (see _release)
                b = self._bin(stream_ptr, size, True)
            if self.closed or self.finalized:  # closed by a collection in _bin
                self._shares.pop(ptr, None)
                return False
            self.cached_bytes += size
            counted = True
            b.items.append(item)
        except BaseException:
            if counted:
                self.cached_bytes -= size
            self._shares.pop(ptr, None)
            raise
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
        freed = 0
        err = None
        for b in self._swap_cache().values():
            items = _take_bin(self, b)
            freed += len(items) * b.size
            for ptr, stream in items:
                try:
                    share = self._shares.pop(ptr, None) if self._shares else None
                    if _gc_is_finalized(stream):
                        self._drop_stale(ptr, b.size, share)
                        continue
                    if share is not None and self._retire_shared(ptr, b.size, stream, share):
                        continue
                    self._free_now(ptr, b.stream_ptr, stream)
                except BaseException as e:  # the rest is freed still (see _hotpath.pyx)
                    if err is None:
                        err = e
        if err is not None:
            raise err
        return freed

    def _drop_stale(self, ptr: int, size: int, share: Any) -> None:
        """A cached block whose stream object was finalized since: neither reused nor
        freed on it (see _hotpath.pyx)."""
        if share is not None and self._retire_shared(ptr, size, None, share):
            return
        self._orphan(ptr, size, 0)

    def _swap_cache(self) -> dict:
        """Empty the cache: its old ``_cache``, whose bins the caller takes with
        ``_take_bin`` (the sharing records stay in ``_shares``: see _hotpath.pyx)."""
        fresh: dict = {}  # made first: a collection may run here
        old = self._cache  # from here to the end no call and no allocation (see _Bin)
        self._cache = fresh
        self._last_bin, self._last_sptr, self._last_size = None, 0, 0
        return old

    def _take_cache(self) -> list[int]:
        """Empty the reuse cache without freeing: ``[ptr, ...]`` for the caller to free
        (an exported block only once no receiver maps it: see ``_hotpath.pyx``)."""
        out = []
        for b in self._swap_cache().values():
            for ptr, _stream in _take_bin(self, b):
                share = self._shares.pop(ptr, None) if self._shares else None
                if share is not None and self._retire_shared(ptr, b.size, None, share):
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
                hit = self._last_bin  # the .pyx's _bin, its first test inline
                if hit is None or size != self._last_size or sptr != self._last_sptr:
                    hit = self._bin(sptr, size, False)
                # From the test of live to the pop no call and no allocation (see _Bin).
                if hit is not None and hit.live and hit.items:
                    self.cached_bytes -= size
                    dptr, freer = hit.items.pop()  # and the stream object that freed it
                    if self._shares:  # an exported block comes back with its record
                        share = self._shares.pop(dptr, None)
                    if self.cache_misses:  # a hit takes one miss back (see _cache_missed)
                        self.cache_misses -= 1
                    if _gc_is_finalized(freer):  # see _hotpath.pyx's _drop_stale
                        self._drop_stale(dptr, size, share)
                        dptr, share = 0, None
                    else:
                        stream = freer
                else:
                    self._cache_missed()
            if not dptr:
                if self.n_capture_held:
                    self._drain_capture_held()
                if self._arenas is not None:
                    dptr = self._arena_take(size, sptr)
                    if not dptr:
                        dptr = self._backend_alloc(size, stream)
                elif size < self.backend_min:
                    err, p = _alloc(size, self._pool_for(size), sptr)
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
        if size >= self.backend_min:
            return self._backend_try(size, stream_ptr)
        err, p = _alloc(size, self._pool_for(size), stream_ptr)
        return int(err), (int(p) if not err else 0)

    def _free_now(self, ptr: int, stream_ptr: int, stream: Any = None) -> None:
        """Free a block a hook kept earlier (limbo, deferred pinned frees)."""
        # ``stream``: the stream object when the caller has it (kept alive while held).
        if stream_ptr > 1:
            err, cap = _is_capturing(stream_ptr)
            if err or cap:
                self._hold_free(ptr, stream_ptr, int(err), stream)
                return
        if self._pool is None or (self._backend_ptrs is not None and ptr in self._backend_ptrs):
            self._backend_free(ptr, stream_ptr)
            return
        (err,) = _free(ptr, stream_ptr)
        if err:
            self._free_failed(ptr, stream_ptr, int(err), stream)

    def _free_direct(self, ptr: int, stream_ptr: int) -> int:
        """The driver (or backend) free without the capture check; returns the CUresult."""
        if self._pool is None or (self._backend_ptrs is not None and ptr in self._backend_ptrs):
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


# ----------------------------------------------------------------------------------------
# Observation: the counters and log records of statistics(), outstanding() and the log
# ----------------------------------------------------------------------------------------
# See _hotpath.pyx for the design.  The twin serialises its updates with a lock (its
# Python code can be interrupted anywhere) and queues an event re-entered from the
# garbage collector on the thread that holds it.
LOG_BATCH = 4096  # log records per batch handed to the writer
_SITE_CACHE_MAX = 8192  # code objects whose call sites are cached
_OP_ALLOC = "alloc"
_OP_FREE = "free"
_now = time.time
_now_ns = time.time_ns
_get_ident = threading.get_ident


class Counts:
    """Counters of one tag inside one ``statistics()`` scope."""

    __slots__ = ("n_allocs", "n_frees", "total_bytes", "current_bytes", "peak_bytes")

    def __init__(self) -> None:
        self.n_allocs = self.n_frees = self.total_bytes = 0
        self.current_bytes = self.peak_bytes = 0


class Scope:
    """Counters of one ``statistics()`` scope; ``per_tag`` maps a tag to its Counts."""

    __slots__ = (
        "n_allocs",
        "n_frees",
        "current_bytes",
        "peak_used_bytes",
        "total_bytes",
        "per_tag",
        "start_serial",
        "_device",
        "_kind",
    )

    def __init__(self) -> None:
        self.n_allocs = self.n_frees = self.total_bytes = 0
        self.current_bytes = self.peak_used_bytes = 0
        self.per_tag: dict[str, Counts] = {}
        self.start_serial = 0
        self._device: int | None = None
        self._kind: int | None = None

    def _matches(self, device: int, kind: int) -> bool:
        return (self._device is None or self._device == device) and (
            self._kind is None or self._kind == kind
        )


class PoolObs:
    """What the recorder keeps of one pool (found by ``id(core)``)."""

    __slots__ = ("ref", "core_id", "device", "kind", "used", "reserved", "reserved_t", "dev")
    ref: Any
    core_id: int
    device: int
    kind: int
    used: int
    reserved: int
    reserved_t: float
    dev: DevObs

    def _is(self, core: Any) -> bool:
        return self.ref() is core


class DevObs:
    """Bytes used and last known reserved (-1: unknown) in the pools of one device."""

    __slots__ = ("used", "reserved")

    def __init__(self) -> None:
        self.used = 0
        self.reserved = -1


class Info:
    """What the recorder knows of one observed allocation (``Block.info``)."""

    __slots__ = (
        "serial",
        "time",
        "tag",
        "callsite",
        "ptr",
        "size",
        "stream",
        "device",
        "_ns",
        "_pool",
    )
    serial: int
    time: float
    tag: str
    callsite: str | None
    ptr: int
    size: int
    stream: int
    device: int
    _ns: int
    _pool: PoolObs

    @property
    def core_id(self) -> int:
        return self._pool.core_id


class Batch:
    """Log records, in order: (time_ns, ptr, size, stream, used, reserved, device, op,
    thread, tag, callsite); ``format`` makes their CSV lines."""

    __slots__ = ("recs",)

    def __init__(self) -> None:
        self.recs: list[tuple] = []

    def __len__(self) -> int:
        return len(self.recs)

    def rows(self) -> list[tuple]:
        """The records (for tests)."""
        return list(self.recs)

    def format(self, pid: int) -> bytes:
        """The CSV lines of the records (``stats.LOG_COLUMNS``), UTF-8."""
        out = []
        for ns, ptr, size, stream, used, reserved, dev, op, thread, tag, site in self.recs:
            out.append(
                f"{ns // 1_000_000_000}.{ns // 1000 % 1_000_000:06d},{pid},{_csv(thread)},{dev},{stream},{_csv(op)},0x{ptr:x},{size},"
                f"{_csv(tag)},{_csv(site)},{'' if used < 0 else used},"
                f"{'' if reserved < 0 else reserved}\n"
            )
        return "".join(out).encode("utf-8", "backslashreplace")


def _csv(s: str | None) -> str:
    """A CSV field as ``csv.writer`` quotes it (QUOTE_MINIMAL, '\\n' lines)."""
    if not s:
        return ""
    if "," in s or '"' in s or "\n" in s or "\r" in s:
        return '"' + s.replace('"', '""') + '"'
    return s


class _Serial:
    """The twin's critical section: a lock, and a queue for re-entry on its thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.owner: int | None = None
        self.q: deque = deque()

    def run(self, fn: Any, *args: Any) -> Any:
        ident = _get_ident()
        if self.owner == ident:  # a free from a garbage collection inside fn: after it
            self.q.append((fn, args))
            return None
        with self.lock:
            self.owner = ident
            try:
                out = fn(*args)
                while self.q:
                    f, a = self.q.popleft()
                    f(*a)
                return out
            finally:
                self.owner = None

    def call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` under the lock, at once even when this thread holds it."""
        if self.owner == _get_ident():
            return fn(*args)
        with self.lock:
            return fn(*args)


class Recorder:
    """The pools' observer (``PoolCore.observer``): see ``_hotpath.pyx``."""

    active = False
    tracking = False
    logging = False
    scopes: tuple[Scope, ...] = ()
    n_errors = 0

    def __init__(self) -> None:
        self.active = False
        self.tracking = False
        self.logging = False
        self.scopes: tuple[Scope, ...] = ()
        self.n_errors = 0
        self._serial = 0
        self._live: set[Info] = set()
        self._pools: dict[int, PoolObs] = {}
        self._devs: dict[int, DevObs] = {}
        self._batch = Batch()
        self._sealed: list[Batch] = []
        self._tls: Any = None
        self._tags: Any = [1]  # stats' count of open tag() scopes: 0 skips the thread-local
        self._on_batch: Any = None
        self._on_error: Any = None
        self._refresh: Any = None
        self._depth = 32
        self._skip: tuple[str, ...] = ()
        self._codes: dict[int, tuple] = {}
        self._cs = _Serial()

    # -- configuration (stats.py) ------------------------------------------------------
    def configure(self, tls: Any, tags: Any, on_batch: Any, on_error: Any, refresh: Any) -> None:
        """The tag thread-local and the count of open tag scopes (``array('q', [n])``),
        then fn() for a full batch, fn(exc), fn(core) -> reserved bytes."""
        self._tls, self._tags = tls, tags
        self._on_batch, self._on_error, self._refresh = on_batch, on_error, refresh

    def set_sites(self, skip: tuple, depth: int) -> None:
        """Path prefixes whose frames are not call sites, and the most frames walked."""
        self._skip, self._depth, self._codes = tuple(skip), depth, {}

    def start(self) -> None:
        def start() -> None:
            self._live, self._pools, self._devs = set(), {}, {}
            self.active = True

        self._cs.run(start)

    def stop(self) -> None:
        def stop() -> None:
            self.active = False
            self._live, self._pools, self._devs = set(), {}, {}
            self._codes = {}  # the code objects met while tracking: not kept alive

        self._cs.run(stop)

    def install(self, core: Any, live_bytes: Any) -> None:
        """Become ``core``'s observer and count the bytes live in it at that instant
        (see ``_hotpath.pyx``; here the two are consecutive statements)."""
        p = self._pool_of(core)
        if core.observer is self:
            return
        if isinstance(core, PoolCore):
            core.observer = self
            n = core.live_bytes
        else:
            v = live_bytes(core)
            core.observer = self
            n = v if v is not None else 0

        def add() -> None:
            if n > 0:
                p.used += n
                p.dev.used += n

        self._cs.run(add)

    def baseline(self, core: Any, used: int | None, reserved: int | None) -> None:
        """Count ``used`` bytes already live in ``core`` (and its reserved bytes)."""
        p = self._pool_of(core)

        def add() -> None:
            if used:
                p.used += used
                p.dev.used += used
            if reserved is not None:
                self._set_reserved(p, reserved, _now())

        self._cs.run(add)

    def add_scope(self, device: int | None, kind: int | None) -> Scope:
        s = Scope()
        s._device, s._kind = device, kind

        def add() -> None:
            s.start_serial = self._serial
            self.scopes = (*self.scopes, s)

        self._cs.run(add)
        return s

    def remove_scope(self, scope: Scope) -> None:
        def remove() -> None:
            self.scopes = tuple(s for s in self.scopes if s is not scope)

        self._cs.run(remove)

    def set_logging(self, on: bool) -> None:
        self.logging = bool(on)

    def refresh_all(self) -> None:
        """Re-read the reserved bytes of every pool seen (a log starts)."""
        for p in list(self._pools.values()):
            core = p.ref()
            if core is not None:
                self._refresh_pool(p, core, _now())

    def after_fork(self) -> None:
        """In a forked child: the parent's records are the parent's to write."""
        self._cs = _Serial()
        self._batch, self._sealed = Batch(), []

    # -- hooks called by the hot path ----------------------------------------------------
    def on_alloc(self, block: Any) -> None:
        try:  # the conversions of the compiled version's C arguments
            ptr, size, sptr = _as_size(block.ptr), _as_size(block.size), _as_size(block.stream_ptr)
            core = block.core
        except Exception as exc:
            self._error(exc)
            return
        self._alloc(core, ptr, size, sptr, block)

    def on_free(self, core: Any, ptr: int, size: int, stream_ptr: int, info: Any) -> None:
        try:
            ptr, size, stream_ptr = _as_size(ptr), _as_size(size), _as_size(stream_ptr)
        except Exception as exc:
            self._error(exc)
            return
        self._free(core, ptr, size, stream_ptr, info)

    def note(
        self, core: Any, op: str, ptr: int, size: int, stream_ptr: int, tag: str, callsite: str
    ) -> None:
        """A log line for another event (a guard report).  Never raises."""
        try:
            if not self.logging:
                return
            ns, thread, dev = _now_ns(), self._thread_name(), int(core.device_id)
            ptr, size, stream_ptr = _as_size(ptr), _as_size(size), _as_size(stream_ptr)

            def append() -> bool:
                d = self._devs.get(dev)
                used, reserved = (d.used, d.reserved) if d is not None else (-1, -1)
                return self._append(
                    ns, ptr, size, stream_ptr, used, reserved, dev, op, thread, tag, callsite
                )

            sealed = self._cs.run(append)
            if sealed:
                self._on_batch()
        except Exception as exc:  # a KeyboardInterrupt, a SystemExit: the caller's
            self._error(exc)

    # -- reading (stats.py) --------------------------------------------------------------
    def live(self, core: Any) -> list[Info]:
        """Live observed allocations, of ``core`` only unless it is None."""
        infos = self._cs.call(lambda: list(self._live))
        return infos if core is None else [i for i in infos if i._pool.core_id == id(core)]

    def take_batches(self) -> list[Batch]:
        """The records so far, the partly filled batch included, for the writer."""

        def take() -> list[Batch]:
            out, self._sealed = self._sealed, []
            if self._batch.recs:
                out.append(self._batch)
                self._batch = Batch()
            return out

        return self._cs.call(take)

    # -- the work ------------------------------------------------------------------------
    def _alloc(self, core: Any, ptr: int, size: int, sptr: int, block: Any) -> None:
        """Count an allocation, log it and set ``block.info`` (see ``_hotpath.pyx``: an
        ``Exception`` is counted, any other ``BaseException`` raised once it is done)."""
        if not self.active:
            return
        thread = None
        stop: BaseException | None = None
        info = Info()
        info.serial = 0  # until _apply_alloc numbers it
        info._ns = _now_ns()
        t = info.time = info._ns * 1e-9
        info.tag, info.ptr, info.size, info.stream = "", ptr, size, sptr
        info.callsite = None
        try:
            # Everything that may run Python code first; the counters change in one go.
            if self._tags[0]:
                info.tag = self._tls.tag
            if self.tracking:
                info.callsite = self._site()
            p = info._pool = self._pool_of(core)
            info.device = p.device
            if self.logging:
                thread = self._thread_name()
                if p.reserved >= 0 and p.used + size > p.reserved or t - p.reserved_t > 1.0:
                    self._refresh_pool(p, core, t)
            self._prepare_tags(info.tag, p.device, p.kind)
        except Exception as exc:
            self._error(exc)
            return
        except BaseException as exc:
            stop = exc
        if stop is not None:
            if type(info.tag) is not str:
                info.tag = ""
            try:
                if getattr(info, "_pool", None) is None:
                    info._pool = self._pool_of(core)
                info.device = info._pool.device
            except BaseException:
                raise stop from None
            if thread is None and self.logging:
                thread = ""
        try:
            if self._cs.run(self._apply_alloc, info, thread):
                self._on_batch()
        except Exception as exc:
            self._error(exc)
        block.info = info
        if stop is not None:
            raise stop

    def _apply_alloc(self, info: Info, thread: Any) -> bool:
        self._serial += 1
        info.serial = self._serial
        p, size = info._pool, info.size
        p.used += size
        d = p.dev
        d.used += size
        if info.ptr:
            self._live.add(info)
        for s in self.scopes:
            if s._matches(p.device, p.kind):
                s.n_allocs += 1
                s.total_bytes += size
                s.current_bytes += size
                if s.current_bytes > s.peak_used_bytes:
                    s.peak_used_bytes = s.current_bytes
                c = s.per_tag.get(info.tag)
                if c is not None:
                    c.n_allocs += 1
                    c.total_bytes += size
                    c.current_bytes += size
                    if c.current_bytes > c.peak_bytes:
                        c.peak_bytes = c.current_bytes
        if thread is None or not self.logging:
            return False
        return self._append(
            info._ns,
            info.ptr,
            size,
            info.stream,
            d.used,
            d.reserved,
            p.device,
            _OP_ALLOC,
            thread,
            info.tag,
            info.callsite,
        )

    def _free(self, core: Any, ptr: int, size: int, sptr: int, info: Any) -> None:
        # From Block.__dealloc__: never raises.
        try:
            if not self.active:
                return
            ns = _now_ns()
            thread = self._thread_name() if self.logging else None
            p = info._pool if info is not None else None
            if p is None or self._pools.get(p.core_id) is not p:  # observed before a restart
                p = self._pool_of(core)
            if self._cs.run(self._apply_free, p, ptr, size, sptr, info, ns, thread):
                self._on_batch()
        except BaseException as exc:
            self._error(exc)

    def _apply_free(
        self, p: PoolObs, ptr: int, size: int, sptr: int, info: Any, ns: int, thread: Any
    ) -> bool:
        p.used = max(0, p.used - size)
        d = p.dev
        d.used = max(0, d.used - size)
        tag = site = ""
        if info is not None:
            self._live.discard(info)
            tag, site = info.tag, info.callsite
            for s in self.scopes:
                if info.serial > s.start_serial and s._matches(p.device, p.kind):
                    s.n_frees += 1
                    s.current_bytes -= size
                    c = s.per_tag.get(tag)
                    if c is not None:
                        c.n_frees += 1
                        c.current_bytes -= size
        if thread is None or not self.logging:
            return False
        return self._append(
            ns, ptr, size, sptr, d.used, d.reserved, p.device, _OP_FREE, thread, tag, site
        )

    def _append(
        self,
        ns: int,
        ptr: int,
        size: int,
        sptr: int,
        used: int,
        reserved: int,
        dev: int,
        op: str,
        thread: str,
        tag: str,
        site: Any,
    ) -> bool:
        """Add a record; True when it filled the batch (the writer is to be woken)."""
        b = self._batch
        b.recs.append((ns, ptr, size, sptr, used, reserved, dev, op, thread, tag, site))
        if len(b.recs) < LOG_BATCH:
            return False
        self._sealed.append(b)
        self._batch = Batch()
        return True

    def _prepare_tags(self, tag: str, device: int, kind: int) -> None:
        for s in self.scopes:
            if tag not in s.per_tag and s._matches(device, kind):
                s.per_tag[tag] = Counts()

    def _pool_of(self, core: Any) -> PoolObs:
        key = id(core)
        p = self._pools.get(key)
        if p is not None and p._is(core):
            return p
        p = PoolObs()
        try:
            p.ref = weakref.ref(core)
        except TypeError:  # an object without weak references: held
            p.ref = _Held(core)
        p.core_id, p.device, p.kind = key, int(core.device_id), int(core.kind)
        p.used, p.reserved, p.reserved_t = 0, -1, 0.0
        d = self._devs.get(p.device)
        if d is None:
            d = self._devs.setdefault(p.device, DevObs())
        p.dev = d
        return self._cs.call(self._add_pool, core, p)

    def _add_pool(self, core: Any, p: PoolObs) -> PoolObs:
        cur = self._pools.get(p.core_id)
        if cur is not None and cur._is(core):
            return cur  # another thread was first
        self._pools[p.core_id] = p
        return p

    def _refresh_pool(self, p: PoolObs, core: Any, t: float) -> None:
        r = self._refresh(core)
        self._cs.call(self._set_reserved, p, r, t)

    def _set_reserved(self, p: PoolObs, r: int | None, t: float) -> None:
        p.reserved_t = t
        if r is None:
            return
        d = p.dev
        d.reserved = max(d.reserved, 0) + r - max(p.reserved, 0)
        p.reserved = r

    def _thread_name(self) -> str:
        return self._tls.thread.name

    def _site(self) -> str | None:
        """The first frame above the recorder outside the skipped packages."""
        f: Any = sys._getframe(1)
        while f is not None and f.f_code.co_filename == __file__:
            f = f.f_back  # the recorder's own frames (none in the compiled version)
        codes = self._codes
        for _ in range(self._depth):
            if f is None:
                return None
            code = f.f_code
            entry = codes.get(id(code))
            if entry is None or entry[0] is not code:
                entry = self._code_lines(code)
            lines = entry[1]
            if lines is not None:
                lineno = f.f_lineno
                site = lines.get(lineno)
                if site is None:
                    site = lines[lineno] = f"{code.co_filename}:{lineno} in {code.co_name}"
                return site
            f = f.f_back
        return None

    def _code_lines(self, code: Any) -> tuple:
        """``(code, None)`` for a skipped frame's code, else ``(code, {line: site})``."""
        if len(self._codes) >= _SITE_CACHE_MAX:
            self._codes = {}
        entry: tuple = (code, None if code.co_filename.startswith(self._skip) else {})
        self._codes[id(code)] = entry
        return entry

    def _error(self, exc: BaseException) -> None:
        """Count an error in a hook (stats warns about the first).  Never raises."""
        self.n_errors += 1
        try:
            if self._on_error is not None:
                self._on_error(exc)
        except BaseException:
            pass


class _Held:
    """A strong reference that answers like a weak one."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __call__(self) -> Any:
        return self.obj
