"""DevicePool, PinnedPool and ManagedPool: cuda.core memory pools behind CuPy's allocator hooks.

Each pool owns its own CUDA memory pool (created by cuda.core); creating one never
changes process-wide state: the device's default and current pools, and their
attributes, stay as they were.  The per-allocation work is in ``_hotpath.pyx``.
"""

from __future__ import annotations

import gc
import os
import threading
import weakref
from collections import deque
from typing import Any

import cuda.core as cc
import cupy
from cuda.bindings import driver as _drv

from ._device import check_device, grant_access, nearest_numa_node, require_gpu
from ._errors import (
    CUDADriverError,
    InvalidOptionError,
    OptionTypeError,
    OutOfPoolMemoryError,
    PinnedOutOfMemoryError,
    PoolClosedError,
    UnsupportedError,
    WrongDeviceError,
    check_driver,
)
from ._poolstats import PoolStats
from ._sizes import format_bytes, parse_bytes

if os.environ.get("CUPY_POOLMEM_PURE_PYTHON"):
    from . import _hotpath_py as _hp
else:
    try:
        from . import _hotpath as _hp  # type: ignore[no-redef]
    except (ImportError, TypeError, ValueError):  # not built, or built against other ABIs
        from . import _hotpath_py as _hp  # type: ignore[no-redef]

__all__ = [
    "DevicePool",
    "PinnedPool",
    "ManagedPool",
    "Pool",
    "all_pools",
    "hotpath_implementation",
]

_UINT64_MAX = 2**64 - 1
_CACHE_MAX_BLOCK = 64 << 20  # blocks above this size always go back to the CUDA pool
_CUDA_ERROR_OUT_OF_MEMORY = 2
_A = _drv.CUmemPool_attribute

# Every pool alive in this process (statistics(), logs and sharing walk it).
_ALL_POOLS: weakref.WeakSet[Pool] = weakref.WeakSet()
_ALL_LOCK = threading.Lock()
# Callables run before an out-of-memory retry (sharing's limbo collection registers here).
_OOM_CALLBACKS: list[Any] = []
# Observer (stats/log/tracking) installed on every pool, present and future.
_GLOBAL_OBSERVER: list[Any] = [None]


def hotpath_implementation() -> str:
    """``"cython"`` when the compiled hot path is in use, else ``"python"``."""
    return _hp.IMPLEMENTATION


def all_pools() -> list[Pool]:
    """The pools alive in this process, oldest first."""
    with _ALL_LOCK:
        return sorted(_ALL_POOLS, key=lambda p: p._serial)


def _set_global_observer(observer: Any) -> None:
    """Install ``observer`` (or ``None``) on every pool, and on pools created later."""
    _GLOBAL_OBSERVER[0] = observer
    for p in all_pools():
        p.observer = observer


def _check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise OptionTypeError(f"{name} must be True or False; got {value!r}")
    return value


def _pool_handle(mr: Any) -> Any:
    return _drv.CUmemoryPool(int(mr.handle))


def _set_attr(mr: Any, attr: Any, value: int) -> None:
    check_driver(
        _drv.cuMemPoolSetAttribute(_pool_handle(mr), attr, _drv.cuuint64_t(value)),
        "cuMemPoolSetAttribute",
    )


class Pool(_hp.PoolCore):
    """Behaviour shared by the three pool kinds (not instantiated directly)."""

    _kind_name = "pool"
    _serial_counter = 0

    def _setup(
        self,
        mr: Any,
        device: int,
        kind: int,
        release_threshold: int | None,
        max_size: int,
        reuse_cache: int = 0,
    ) -> None:
        self._mr = mr
        self._max_size = max_size
        self._lock = threading.Lock()
        Pool._serial_counter += 1
        self._serial = Pool._serial_counter
        self._held_for_sharing = 0
        self._attach(int(mr.handle), device, kind)
        self.soft_limit = max_size  # enforced in the hot path too (host pools ignore maxSize)
        self.cache_limit = reuse_cache
        self.cache_max_block = min(reuse_cache, _CACHE_MAX_BLOCK)
        self.set_release_threshold(release_threshold)
        self.observer = _GLOBAL_OBSERVER[0]
        self._pool_uuid = ""
        if getattr(mr, "is_ipc_enabled", False):
            # Export the pool's handle now, not in the middle of a first send.
            mr.allocation_handle  # noqa: B018
            self._pool_uuid = str(mr.uuid)
        with _ALL_LOCK:
            _ALL_POOLS.add(self)

    # -- hot-path slow paths -------------------------------------------------------
    def _raise_closed(self) -> None:
        if getattr(self, "_forked", False):
            raise PoolClosedError(
                f"{self._describe()} belongs to the parent process: this process was forked "
                "after CUDA was initialised, and CUDA cannot be used in it. Start workers with "
                "multiprocessing.get_context('spawn') or 'forkserver'."
            )
        raise PoolClosedError(
            f"{self!r} is closed; create a new pool or stop allocating "
            "from this one (cupy.cuda.set_allocator(None) restores CuPy's)"
        )

    def _raise_wrong_device(self, current: int) -> None:
        if current < 0:
            # No context bound to this thread yet (a fresh thread: dask workers, executors).
            # CuPy's current device decides; bind its primary context and carry on.
            current = cupy.cuda.runtime.getDevice()
            if current == self.device_id or self.kind == _hp.KIND_PINNED:
                cupy.cuda.runtime.free(0)  # makes the primary context current
                return
        raise WrongDeviceError(
            f"{self._describe()} was asked to allocate while device {current} is current. "
            f"Allocate inside `with cupy.cuda.Device({self.device_id}):`, or use "
            "cupy_poolmem.set_allocator(), which keeps one pool per device."
        )

    def _alloc_failed(self, err: int, size: int, stream: Any) -> int:
        if err != _CUDA_ERROR_OUT_OF_MEMORY:
            check_driver((_drv.CUresult(err),), "cuMemAllocFromPoolAsync")
        self.n_oom += 1
        self._reclaim()
        if self.soft_limit and self.live_bytes + size > self.soft_limit:
            err, ptr = _CUDA_ERROR_OUT_OF_MEMORY, 0
        else:
            err, ptr = self._try_alloc(size, stream.ptr)
        if err == 0:
            return ptr
        if err != _CUDA_ERROR_OUT_OF_MEMORY:
            check_driver((_drv.CUresult(err),), "cuMemAllocFromPoolAsync")
        cls = PinnedOutOfMemoryError if self.kind == _hp.KIND_PINNED else OutOfPoolMemoryError
        raise cls(self._describe(), size, self.stats())

    def _reclaim(self) -> None:
        """Before an out-of-memory retry: collect garbage, shared blocks, then trim."""
        gc.collect()
        self.flush_cache()
        for cb in list(_OOM_CALLBACKS):
            try:
                cb()
            except Exception:  # a failing collector must not hide the OOM
                pass
        self.trim()

    # -- public API ------------------------------------------------------------------
    @property
    def memory_resource(self) -> Any:
        """The cuda.core memory resource that owns this pool's CUDA memory pool."""
        return self._mr

    @property
    def handle(self) -> int:
        """The ``CUmemoryPool`` handle, as an int."""
        return int(self._mr.handle)

    @property
    def max_size(self) -> int:
        """Hard cap in bytes (``0``: limited only by the device or host)."""
        return self._max_size

    def set_release_threshold(self, value: int | str | None) -> None:
        """Set how many reserved bytes the pool keeps across synchronisations.

        ``None`` keeps everything (the pool never shrinks on its own; :meth:`trim`
        releases memory explicitly); ``0`` releases unused memory at every
        synchronisation, which makes later allocations slow.
        """
        v = _UINT64_MAX if value is None else parse_bytes(value, name="release_threshold")
        _set_attr(self._mr, _A.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, v)
        self._release_threshold = v

    def stats(self) -> PoolStats:
        """Return a :class:`~cupy_poolmem.PoolStats` snapshot of this pool.

        Examples
        --------
        >>> pool = cupy_poolmem.DevicePool()  # doctest: +SKIP
        >>> pool.stats().used_bytes  # doctest: +SKIP
        0
        """
        a = self._mr.attributes
        return PoolStats(
            kind=self._kind_name,
            device=self.device_id,
            used_bytes=int(self.live_bytes),
            peak_used_bytes=int(self.peak_live_bytes),
            reserved_bytes=int(a.reserved_mem_current),
            peak_reserved_bytes=int(a.reserved_mem_high),
            n_allocs=int(self.n_allocs),
            n_frees=int(self.n_frees),
            held_for_sharing_bytes=int(self._held_for_sharing),
            max_size=self._max_size,
            release_threshold=self._release_threshold,
            cached_bytes=int(self.cached_bytes),
        )

    def reset_peak(self) -> None:
        """Reset the peak used/reserved counters to the current values."""
        self.peak_live_bytes = self.live_bytes
        _set_attr(self._mr, _A.CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0)
        _set_attr(self._mr, _A.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 0)

    def trim(self, keep: int | str = 0, *, sync: bool = True) -> int:
        """Release unused reserved memory back to the system, keeping at least ``keep`` bytes.

        With ``sync=True`` (default) the pool's device is synchronised first, so that
        frees still pending on streams complete and their memory can be released.
        Returns the bytes released.

        Examples
        --------
        >>> released = pool.trim()  # doctest: +SKIP
        """
        keep_b = parse_bytes(keep, name="keep")
        self.flush_cache()
        if sync:
            self._synchronize()
        before = int(self._mr.attributes.reserved_mem_current)
        check_driver(_drv.cuMemPoolTrimTo(_pool_handle(self._mr), keep_b), "cuMemPoolTrimTo")
        return max(0, before - int(self._mr.attributes.reserved_mem_current))

    def outstanding(self, limit: int = 20) -> list:
        """Live allocations of this pool, biggest first (call sites when tracking is on).

        See :func:`cupy_poolmem.stats.outstanding`.
        """
        from .stats import outstanding

        return outstanding(self, limit=limit)

    def _synchronize(self) -> None:
        with cupy.cuda.Device(max(self.device_id, 0)):
            cupy.cuda.runtime.deviceSynchronize()

    def close(self) -> None:
        """Stop allocating from this pool; release the CUDA pool once nothing uses it.

        Live allocations stay valid and are freed normally; the CUDA pool is
        destroyed when the last one is gone (never under live allocations).
        Closing twice is harmless.
        """
        if self.closed:
            return
        self._mark_closed()
        with _ALL_LOCK:
            _ALL_POOLS.discard(self)
        if self.n_allocs == self.n_frees:
            self._drained()
        # else: the hot path calls _drained() when the last live block is freed.

    def _drained(self) -> None:
        """Closed and no live block left: release the CUDA pool."""
        try:
            self._mr.close()
        except Exception:
            pass

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _describe(self) -> str:
        return f"{type(self).__name__}(device={self.device_id})"

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"used={format_bytes(self._safe_used())}"
        return f"<{self._describe()} {state}>"

    def _safe_used(self) -> int:
        try:
            return int(self._mr.attributes.used_mem_current)
        except Exception:
            return 0


class DevicePool(Pool):
    """A stream-ordered device memory pool for one GPU, usable as CuPy's allocator.

    Parameters
    ----------
    device : int or cupy.cuda.Device, optional
        Device ordinal; defaults to the current device.
    max_size : int or str, optional
        Hard cap: bytes, a string such as ``"40GB"``, or a fraction of the device's
        memory such as ``0.9`` or ``"90%"``.  Default: no cap beyond the device.
    release_threshold : int or str, optional
        Reserved bytes kept across synchronisations.  ``None`` (default) keeps all
        memory reserved so steady-state allocations never go to the OS; ``0`` releases
        at every synchronisation.
    ipc : bool
        Make the pool exportable so arrays on it can be shared with other processes
        (see :mod:`cupy_poolmem` sharing).  Default ``False``.
    reuse_cache : int or str
        Bytes of freed blocks (each up to 64 MiB) kept for reuse by the next
        allocation of the same size on the same stream, skipping the driver call.
        Same-stream reuse is what stream ordering already allows, so this changes
        speed only.  Flushed on out-of-memory, :meth:`~Pool.trim` and :meth:`~Pool.close`.
        Default ``"1GiB"``; ``0`` disables it.

    Notes
    -----
    ``malloc(size)`` allocates on CuPy's *current stream* and returns a
    :class:`cupy.cuda.MemoryPointer`; the memory is freed, stream-ordered, on that
    same stream once the last array using it is gone.  Calling ``malloc`` while
    another device is current raises :class:`~cupy_poolmem.WrongDeviceError`.

    Examples
    --------
    >>> import cupy, cupy_poolmem
    >>> pool = cupy_poolmem.DevicePool(device=0, max_size="40GB")  # doctest: +SKIP
    >>> cupy.cuda.set_allocator(pool.malloc)  # doctest: +SKIP
    >>> x = cupy.arange(10)  # doctest: +SKIP
    >>> pool.stats().n_allocs  # doctest: +SKIP
    1
    """

    _kind_name = "device"

    def __init__(
        self,
        device: int | Any = None,
        max_size: int | str | None = None,
        release_threshold: int | str | None = None,
        ipc: bool = False,
        reuse_cache: int | str = "1GiB",
    ) -> None:
        dev = check_device(device)
        ipc = _check_bool(ipc, "ipc")
        cache = parse_bytes(reuse_cache, name="reuse_cache")
        with cupy.cuda.Device(dev) as d:
            total = d.mem_info[1]
            max_b = parse_bytes(max_size, name="max_size", total=total, allow_none=True) or 0
            if max_b > total:
                raise InvalidOptionError(
                    f"max_size={max_size!r} ({format_bytes(max_b)}) is more "
                    f"than device {dev} has ({format_bytes(total)})"
                )
            parse_bytes(release_threshold, name="release_threshold", allow_none=True)
            try:
                mr = cc.DeviceMemoryResource(
                    dev, cc.DeviceMemoryResourceOptions(ipc_enabled=ipc, max_size=max_b)
                )
            except Exception as exc:
                raise _wrap(exc, "creating a device pool") from exc
            self.ipc = ipc
            self._setup(mr, dev, _hp.KIND_DEVICE, release_threshold, max_b, cache)


class PinnedPool(Pool):
    """A stream-ordered pool of page-locked host memory on the GPU's nearest NUMA node.

    Use it as CuPy's pinned allocator (``cupyx.empty_pinned``, asynchronous copies).
    Every visible GPU (or those in ``devices``) is granted access to the pool, so
    copies run at full DMA speed.  (A host pool without device access copies through
    a staging path at a quarter of the bandwidth or less: the cause of slow copies
    from a default cuda.core ``PinnedMemoryResource``.)

    Parameters
    ----------
    numa_node : int, optional
        Host NUMA node; ``None`` picks the node nearest the current GPU (its
        ``host_numa_id``), or lets the OS place memory when the GPU reports none.
    max_size : int or str, optional
        Hard cap in bytes or as a string ("8GB").
    release_threshold : int or str, optional
        As for :class:`DevicePool`.
    devices : list of int, optional
        GPUs that get access; default all visible GPUs.
    ipc : bool
        Make the pool exportable to other processes.

    Notes
    -----
    A freed pinned block is not returned to the pool until the work enqueued on its
    stream (and on the stream current at free time) has finished: the host may write
    into a block as soon as ``malloc`` returns it, so a pending asynchronous copy
    must never see its buffer reused.

    Examples
    --------
    >>> import cupy, cupyx, cupy_poolmem
    >>> pinned = cupy_poolmem.PinnedPool()  # doctest: +SKIP
    >>> cupy.cuda.set_pinned_memory_allocator(pinned.malloc)  # doctest: +SKIP
    >>> h = cupyx.empty_pinned((1024,), dtype="f4")  # doctest: +SKIP
    """

    _kind_name = "pinned"

    def __init__(
        self,
        numa_node: int | None = None,
        max_size: int | str | None = None,
        release_threshold: int | str | None = None,
        devices: list[int] | None = None,
        ipc: bool = False,
    ) -> None:
        n = require_gpu("PinnedPool")
        ipc = _check_bool(ipc, "ipc")
        if numa_node is not None and (
            isinstance(numa_node, bool) or not isinstance(numa_node, int)
        ):
            raise OptionTypeError(f"numa_node must be an int or None; got {numa_node!r}")
        if numa_node is not None and numa_node < 0:
            raise InvalidOptionError(
                f"numa_node={numa_node} must be >= 0 (or None for the node nearest the current GPU)"
            )
        devs = (
            list(range(n)) if devices is None else [check_device(d, "devices[]") for d in devices]
        )
        max_b = parse_bytes(max_size, name="max_size", allow_none=True) or 0
        parse_bytes(release_threshold, name="release_threshold", allow_none=True)
        node = nearest_numa_node() if numa_node is None else numa_node
        cur = cupy.cuda.runtime.getDevice()
        with cupy.cuda.Device(cur):
            try:
                mr = cc.PinnedMemoryResource(
                    cc.PinnedMemoryResourceOptions(
                        ipc_enabled=ipc, max_size=max_b, numa_id=None if node < 0 else node
                    )
                )
            except Exception as exc:
                raise _wrap(exc, "creating a pinned pool") from exc
            grant_access(int(mr.handle), devs)
        self.ipc = ipc
        self.numa_node = node
        self.devices = devs
        self._pending: deque = deque()
        self._pending_lock = threading.Lock()
        self._setup(mr, -1, _hp.KIND_PINNED, release_threshold, max_b)
        self.release_hook = self._defer_free

    def _describe(self) -> str:
        return f"PinnedPool(numa_node={self.numa_node})"

    def _defer_free(self, ptr: int, size: int, stream: Any) -> bool:
        """Hold a freed block until its stream's work is done (see class Notes)."""
        events = []
        with cupy.cuda.Device(stream.device_id):
            ev = cupy.cuda.Event(disable_timing=True)
            ev.record(stream)
            events.append(ev)
            cur = cupy.cuda.get_current_stream()
            if cur.ptr != stream.ptr and cur.device_id == stream.device_id:
                ev2 = cupy.cuda.Event(disable_timing=True)
                ev2.record(cur)
                events.append(ev2)
        with self._pending_lock:
            self._pending.append((events, ptr, stream))
        self._release_done()
        return True

    def _release_done(self, wait: bool = False) -> int:
        """Return finished deferred blocks to the pool; with ``wait``, all of them."""
        done = 0
        while True:
            with self._pending_lock:
                if not self._pending:
                    return done
                events, ptr, stream = self._pending[0]
                if not wait and not all(e.done for e in events):
                    return done
                self._pending.popleft()
            for e in events:
                e.synchronize()
            self._free_now(ptr, stream.ptr)
            done += 1

    def _reclaim(self) -> None:
        self._release_done(wait=True)
        super()._reclaim()

    def trim(self, keep: int | str = 0, *, sync: bool = True) -> int:
        self._release_done(wait=sync)
        return super().trim(keep, sync=sync)

    def stats(self) -> PoolStats:
        self._release_done()
        return super().stats()


class ManagedPool(Pool):
    """A stream-ordered pool of managed (unified) memory, preferring one GPU.

    Needs a CUDA 13 driver and cuda-bindings 13.  Use :func:`cupy_poolmem.prefetch`
    and :func:`cupy_poolmem.advise` to place arrays.

    Parameters
    ----------
    device : int, optional
        Preferred device (and the device whose allocator this pool serves); default
        the current device.
    max_size, release_threshold, reuse_cache
        As for :class:`DevicePool`.  ``max_size`` caps the bytes live at once
        (checked by the pool itself: the driver has no cap for managed pools).

    Examples
    --------
    >>> managed = cupy_poolmem.ManagedPool(device=0)  # doctest: +SKIP
    >>> cupy.cuda.set_allocator(managed.malloc)  # doctest: +SKIP
    >>> x = cupy.zeros(1 << 20)  # doctest: +SKIP
    >>> cupy_poolmem.prefetch(x, device="cpu")  # doctest: +SKIP
    """

    _kind_name = "managed"

    def __init__(
        self,
        device: int | Any = None,
        max_size: int | str | None = None,
        release_threshold: int | str | None = None,
        reuse_cache: int | str = "1GiB",
    ) -> None:
        dev = check_device(device)
        cache = parse_bytes(reuse_cache, name="reuse_cache")
        _require_cuda13("ManagedPool")
        with cupy.cuda.Device(dev) as d:
            max_b = (
                parse_bytes(max_size, name="max_size", total=d.mem_info[1], allow_none=True) or 0
            )
            parse_bytes(release_threshold, name="release_threshold", allow_none=True)
            try:
                opts = cc.ManagedMemoryResourceOptions(
                    preferred_location=dev, preferred_location_type="device"
                )
                mr = cc.ManagedMemoryResource(opts)
            except Exception as exc:
                raise _wrap(exc, "creating a managed pool") from exc
            self._setup(mr, dev, _hp.KIND_MANAGED, release_threshold, max_b, cache)


def _require_cuda13(what: str) -> None:
    drv_version = check_driver(_drv.cuDriverGetVersion(), "cuDriverGetVersion")
    import cuda.bindings

    major = int(cuda.bindings.__version__.split(".")[0])
    if drv_version < 13000 or major < 13:
        raise UnsupportedError(
            f"{what} needs CUDA 13 (driver >= 13.0 and cuda-bindings 13); this process has "
            f"driver {drv_version // 1000}.{drv_version % 1000 // 10} and cuda-bindings "
            f"{cuda.bindings.__version__}. Install cupy_poolmem[cu13] or use DevicePool."
        )


def _wrap(exc: Exception, what: str) -> Exception:
    if isinstance(exc, CUDADriverError):
        return exc
    text = str(exc)
    name = next(
        (
            w
            for w in text.replace(":", " ").replace("'", " ").split()
            if w.startswith("CUDA_ERROR_")
        ),
        None,
    )
    if name:
        return CUDADriverError(what, getattr(_drv.CUresult, name, -1), name, text)
    return exc
