"""Pure-Python twin of ``_hotpath.pyx``, used when the extension is not built.

Same classes, same behaviour, roughly 1.6x slower per allocation; keep the two in step
(``tests/test_hotpath_cpu.py`` compares them).  Its driver calls go through one object,
``driver``, which tests replace with ``use_driver``; docs/hotpath.rst has the design.
"""

from __future__ import annotations

from gc import is_finalized as _gc_is_finalized
from typing import Any

from cuda.bindings import driver as _drv
from cupy.cuda.memory import MemoryPointer as _MemoryPointer
from cupy.cuda.memory import UnownedMemory as _UnownedMemory
from cupy.cuda.pinned_memory import PinnedMemoryPointer as _PinnedMemoryPointer
from cupy.cuda.stream import get_current_stream

from ._arena_py import Arena as ARENA  # noqa: F401  (the arena class of this hot path)

# LOG_BATCH and Recorder are re-exported: ``_runtime`` makes the process's recorder here.
from ._recorder_py import LOG_BATCH as LOG_BATCH
from ._recorder_py import Observed, as_size
from ._recorder_py import Recorder as Recorder
from ._streams import stream_key as _stream_key

KIND_DEVICE = 0
KIND_PINNED = 1
KIND_MANAGED = 2
IMPLEMENTATION = "python"
# Bumped whenever the compiled modules change shape: a stale build is not used.
VERSION = 16

FLAG_RECORDED = 1
FLAG_CAPTURED = 2
FLAG_ADVISED = 4
_FLAG_SPECIAL = FLAG_CAPTURED | FLAG_ADVISED
_SIZE_MAX = 2**64 - 1
# Misses beyond hits (see PoolCore._cache_missed) at which a non-empty reuse cache is flushed.
FLUSH_AFTER_MISSES = 16

_shared_release = None
_shared_retire = None


class Driver:
    """The calls this hot path makes: cuda.bindings' driver functions and CuPy's
    current stream, each replaceable (a test hands in fakes through ``use_driver``)."""

    __slots__ = ("alloc", "free", "ctx_device", "is_capturing", "current_stream")

    def __init__(
        self,
        alloc: Any = _drv.cuMemAllocFromPoolAsync,
        free: Any = _drv.cuMemFreeAsync,
        ctx_device: Any = _drv.cuCtxGetDevice,
        is_capturing: Any = _drv.cuStreamIsCapturing,
        current_stream: Any = get_current_stream,
    ) -> None:
        self.alloc = alloc
        self.free = free
        self.ctx_device = ctx_device
        self.is_capturing = is_capturing
        self.current_stream = current_stream


#: The driver this hot path calls.
driver = Driver()


def use_driver(new: Driver) -> Driver:
    """Make this hot path call ``new``; returns the driver it called until now.

    Examples
    --------
    >>> from cupy_poolmem import _hotpath_py
    >>> old = _hotpath_py.use_driver(_hotpath_py.Driver(ctx_device=lambda: (0, 0)))
    >>> _hotpath_py.use_driver(old).ctx_device()
    (0, 0)
    """
    global driver
    old, driver = driver, new
    return old


def set_shared_release(fn: Any, retire: Any = None) -> tuple[Any, Any]:
    """Install the sharing package's callbacks; returns the two it replaced."""
    global _shared_release, _shared_retire
    old = _shared_release, _shared_retire
    _shared_release = fn
    _shared_retire = retire
    return old


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


class PoolCore(Observed):
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
        self.backend_min = as_size(backend_min)

    def _attach_arenas(self, arenas: dict, small_max: int) -> None:
        """Every block from the arenas in ``arenas`` before the backend (see
        ``_hotpath.pyx``)."""
        self._arenas = arenas
        self.arena_small_max = as_size(small_max)
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

    def _observe(self, observer: Any) -> int:
        self.observer = observer
        return self.live_bytes

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
                size = as_size(size)
            except (TypeError, OverflowError):
                self._bad_size(size)
                raise
        if self.closed:
            self._raise_closed()
        if self.kind != KIND_PINNED:
            err, cur = driver.ctx_device()
            if err or int(cur) != self.device_id:
                self._raise_wrong_device(int(cur) if not err else -1)
        stream = driver.current_stream()
        sptr = stream.ptr
        if sptr > 1:  # 0 and 1 are the legacy stream, which cannot capture
            err, cap = driver.is_capturing(sptr)
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
                    err, p = driver.alloc(size, self._pool_for(size), sptr)
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
        err, p = driver.alloc(size, self._pool_for(size), stream_ptr)
        return int(err), (int(p) if not err else 0)

    def _free_now(self, ptr: int, stream_ptr: int, stream: Any = None) -> None:
        """Free a block a hook kept earlier (limbo, deferred pinned frees)."""
        # ``stream``: the stream object when the caller has it (kept alive while held).
        if stream_ptr > 1:
            err, cap = driver.is_capturing(stream_ptr)
            if err or cap:
                self._hold_free(ptr, stream_ptr, int(err), stream)
                return
        if self._pool is None or (self._backend_ptrs is not None and ptr in self._backend_ptrs):
            self._backend_free(ptr, stream_ptr)
            return
        (err,) = driver.free(ptr, stream_ptr)
        if err:
            self._free_failed(ptr, stream_ptr, int(err), stream)

    def _free_direct(self, ptr: int, stream_ptr: int) -> int:
        """The driver (or backend) free without the capture check; returns the CUresult."""
        if self._pool is None or (self._backend_ptrs is not None and ptr in self._backend_ptrs):
            self._backend_free(ptr, stream_ptr)
            return 0
        (err,) = driver.free(ptr, stream_ptr)
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
                size = as_size(size)
            except (TypeError, OverflowError):
                self._bad_size(size)
                raise
        err, d = driver.ctx_device()
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
