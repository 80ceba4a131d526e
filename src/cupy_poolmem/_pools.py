"""DevicePool, PinnedPool and ManagedPool: cuda.core memory pools behind CuPy's allocator hooks.

Each pool owns its own CUDA memory pool (created by cuda.core); creating one never
changes process-wide state: the device's default and current pools, and their
attributes, stay as they were.  The per-allocation work is in ``_hotpath.pyx``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
from collections import deque
from typing import Any

import cuda.core as cc
import cupy
from cuda.bindings import driver as _drv

from . import _expandable, _guard, _retire, _runtime, _streams
from ._device import (
    can_access_peer,
    check_device,
    device_count,
    grant_access,
    nearest_numa_node,
    on_device,
    require_attribute,
    require_gpu,
    resolve_peer_access,
    sync_device,
)
from ._errors import (
    CUDADriverError,
    InvalidOptionError,
    InvalidSizeError,
    OptionTypeError,
    OutOfPoolMemoryError,
    PinnedOutOfMemoryError,
    PoolClosedError,
    SharingError,
    UnsupportedError,
    WrongDeviceError,
    add_note,
    check_driver,
)
from ._poolstats import PoolStats
from ._runtime import GLOBAL_OBSERVER as _GLOBAL_OBSERVER
from ._runtime import IPC_POOL_CALLBACKS as _IPC_POOL_CALLBACKS
from ._runtime import OOM_CALLBACKS as _OOM_CALLBACKS
from ._runtime import all_pools, hotpath_implementation
from ._runtime import hp as _hp
from ._runtime import registry_lock as _registry_lock
from ._sizes import format_bytes, parse_bytes

log = logging.getLogger(__name__)

__all__ = [
    "DevicePool",
    "PinnedPool",
    "ManagedPool",
    "Pool",
    "all_pools",
    "hotpath_implementation",
    "managed_backend",
]

_UINT64_MAX = 2**64 - 1
_CACHE_MAX_BLOCK = 64 << 20  # blocks above this size always go back to the CUDA pool
#: DevicePool(small_pool="auto"): blocks up to this size come from a CUDA pool of their
#: own, when the pool has no max_size (see DevicePool's Notes).
SMALL_POOL_AUTO = 8 << 20
_MAP_ABOVE_MIN = 2 << 20  # large_blocks="mapped": blocks up to this size stay pooled
_CUDA_ERROR_OUT_OF_MEMORY = 2
_CUDA_ERROR_NOT_SUPPORTED = 801
_A = _drv.CUmemPool_attribute


def _check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise OptionTypeError(f"{name} must be True or False; got {value!r}")
    return value


def _pool_handle(mr: Any) -> Any:
    return _drv.CUmemoryPool(int(mr.handle))


def _raise_bad_size(size: Any, who: str) -> None:
    """The typed error for a size CuPy's ``size_t`` conversion refused."""
    import operator

    try:
        n = operator.index(size)
    except TypeError:
        raise OptionTypeError(
            f"{who}(size={size!r}): the size must be an integer number of bytes, not "
            f"{type(size).__name__}; pass int(nbytes)"
        ) from None
    what = "negative" if n < 0 else f"larger than {_UINT64_MAX:,} (size_t)"
    raise InvalidSizeError(
        f"{who}(size={n}): the size is {what}; pass the number of bytes to allocate, "
        "an integer >= 0"
    ) from None


_graph_templates: dict[int, Any] = {}


def _graph_template(device: int) -> Any:
    """A pool without IPC whose properties graph allocation nodes of ``device`` can use.

    Created on first need, which is during a capture: under the relaxed capture mode
    so that a global-mode capture does not forbid it.  It never allocates itself.
    """
    mr = _graph_templates.get(device)
    if mr is None:
        with _streams.relaxed_capture_mode():
            mr = cc.DeviceMemoryResource(device, cc.DeviceMemoryResourceOptions(ipc_enabled=False))
        mr = _graph_templates.setdefault(device, mr)
    return _pool_handle(mr)


def _host_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def _set_attr(mr: Any, attr: Any, value: int) -> None:
    check_driver(
        _drv.cuMemPoolSetAttribute(_pool_handle(mr), attr, _drv.cuuint64_t(value)),
        "cuMemPoolSetAttribute",
    )


class Pool(_hp.PoolCore):
    """Behaviour shared by the three pool kinds (not instantiated directly).

    Examples
    --------
    >>> issubclass(cupy_poolmem.DevicePool, cupy_poolmem.Pool)
    True
    >>> pool = cupy_poolmem.get_pool()  # doctest: +SKIP
    >>> pool.trim()  # doctest: +SKIP
    """

    _kind_name = "pool"
    _serial_counter = 0
    _held_for_sharing = 0  # bytes of freed blocks other processes still map (limbo)
    _forked = False  # set in a child forked after CUDA started: the pool refuses to work
    guard: Any = None  # a _guard.Guard when the pool was created with guard=... (device pools)
    _ipc_pools: tuple = ()  # (handle, uuid, resource) per shareable CUDA pool (see _setup)
    _parked = False  # its CUDA pools went to another pool (see _retire_now)

    def _setup(
        self,
        mr: Any,
        device: int,
        kind: int,
        release_threshold: int | str | None,
        max_size: int,
        reuse_cache: int = 0,
        small: tuple[Any, int] | None = None,
        recycle_key: Any = None,
    ) -> None:
        self._mr = mr
        # Every CUDA pool of this pool: ``mr``, then the small-block pool if any
        # (``small``: its resource and the largest block it serves).
        self._mrs = tuple(m for m in (mr, small[0] if small else None) if m is not None)
        # The retirer owns the CUDA pool (or ManagedPool's "managed" backend) from now
        # on: it is destroyed only after its frees are done and seen (see _retire.py),
        # never by this object going away.  The token is a C field of the hot path's
        # PoolCore: it outlives a garbage collector's clearing of this __dict__.
        # With a ``recycle_key`` the CUDA pools are parked for the next pool of that
        # key once this one is drained, instead of destroyed (no device sync: see
        # _retire.py).
        owner = _Resources.owner(self._mrs, self._backend, device)
        park = _park if recycle_key is not None else None
        self._retire_token = (
            _retire.retirer().adopt(owner, recycle_key, park) if owner is not None else 0
        )
        self._max_size = max_size
        # Reentrant: a garbage collection can start under it (a tuple, a list), and a
        # block of this pool freed there can come back (a free held for a capture).
        # Lists are swapped out under it and worked on outside, so a nested call never
        # changes one being iterated.
        self._lock = threading.RLock()
        Pool._serial_counter += 1
        self._serial = Pool._serial_counter
        self._held_for_sharing = 0
        self._capacity = 0  # bytes no allocation can exceed (0: unknown)
        self._graph_blocks: dict[int, tuple[int, int]] = {}  # ptr -> (capture id, stream)
        self._graph_bytes = 0
        self.n_graph_allocs = 0
        self._capture_held: list[tuple] = []  # frees waiting for a capture to end
        self._alloc_call = "cuMemAllocFromPoolAsync"
        self._attach(int(mr.handle) if mr is not None else 0, device, kind)
        if small is not None:
            self._attach_small(int(small[0].handle), small[1])
        self.soft_limit = max_size  # enforced in the hot path too (host pools ignore maxSize)
        self.cache_limit = reuse_cache
        self.cache_max_block = min(reuse_cache, _CACHE_MAX_BLOCK)
        self.set_release_threshold(release_threshold)
        self.observer = _GLOBAL_OBSERVER[0]
        # (handle, uuid, resource) of each CUDA pool that can be shared: with a
        # small-block pool a block goes out under the uuid of the pool that holds it.
        self._ipc_pools: tuple[tuple[int, str, Any], ...] = ()
        if self._mrs and all(getattr(m, "is_ipc_enabled", False) for m in self._mrs):
            # Export the pools' handles now, not in the middle of a first send.
            for m in self._mrs:
                m.allocation_handle  # noqa: B018
            self._ipc_pools = tuple((int(m.handle), str(m.uuid), m) for m in self._mrs)
        with _registry_lock():
            _runtime.POOLS.add(self)
        if self._ipc_pools:
            from . import _sharing  # noqa: F401  (a pool that can share: sharing is hooked in)

            for cb in list(_IPC_POOL_CALLBACKS):
                cb(self)

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

    def _bad_size(self, size: Any) -> None:
        _raise_bad_size(size, f"{self._describe()}.malloc")

    def _oom_error(self, size: int, detail: str | None = None) -> Exception:
        cls = PinnedOutOfMemoryError if self.kind == _hp.KIND_PINNED else OutOfPoolMemoryError
        return cls(self._describe(), size, self.stats(), detail)

    def _alloc_failed(self, err: int, size: int, stream: Any) -> int:
        if self._capacity and size > self._capacity:
            # Nothing to reclaim can help: say so instead of trimming everything first.
            self.n_oom += 1
            raise self._oom_error(
                size,
                f"- that is more than the {format_bytes(self._capacity)} "
                f"{'of host memory' if self.kind == _hp.KIND_PINNED else 'the device has'}; "
                "check the size (a unit or shape mistake?) or split the allocation",
            )
        if err != _CUDA_ERROR_OUT_OF_MEMORY:
            check_driver((_drv.CUresult(err),), self._call_for(size))
        self.n_oom += 1
        self._reclaim()
        if self.soft_limit and self.live_bytes + size > self.soft_limit:
            err, ptr = _CUDA_ERROR_OUT_OF_MEMORY, 0
        else:
            err, ptr = self._try_alloc(size, stream.ptr)
        if err == 0:
            return ptr
        if err != _CUDA_ERROR_OUT_OF_MEMORY:
            check_driver((_drv.CUresult(err),), self._call_for(size))
        raise self._oom_error(size)

    def _reclaim(self) -> None:
        """Before an out-of-memory retry: collect garbage, shared blocks, then trim.

        While a stream capture is under way nothing here synchronises (that would
        invalidate the capture): the trim then releases only what is already free.
        """
        gc.collect()
        if self.guard is not None:
            self.guard.flush()  # blocks held in the guard's quarantine go back first
        self.flush_cache()
        for cb in list(_OOM_CALLBACKS):
            try:
                cb()
            except Exception:  # a failing collector must not hide the OOM
                pass
        self._drain_capture_held()
        self.trim(sync=not _streams.any_capture_underway())

    # -- blocks from a backend (ManagedPool's "managed", DevicePool's mapped blocks) -
    def _backend_alloc(self, size: int, stream: Any) -> int:
        err, ptr = self._backend_try(size, int(stream.ptr))
        return self._alloc_failed(err, size, stream) if err else ptr

    def _backend_try(self, size: int, stream_ptr: int) -> tuple[int, int]:
        if (self._capacity and size > self._capacity) or self._backend is None:
            # Out of memory before the backend makes room for a block that can never
            # fit (giving back every freed block) or rounds past size_t; and for the
            # largest size_t, which is not below backend_min of a pool with no backend.
            return _CUDA_ERROR_OUT_OF_MEMORY, 0
        return self._backend.alloc(size, stream_ptr)

    def _call_for(self, size: int) -> str:
        """The driver call that failed an allocation of ``size`` bytes: the backend's own
        (its ``failed_call`` in this thread) for the blocks it serves."""
        if self._backend is not None and size >= self.backend_min:
            return getattr(self._backend, "failed_call", "") or self._alloc_call
        return self._alloc_call

    def _backend_free(self, ptr: int, stream_ptr: int) -> None:
        try:
            self._backend.free(ptr, stream_ptr)
        except CUDADriverError as exc:
            if exc.code in _streams.CAPTURE_ERRORS:  # the legacy stream during a capture
                self._hold_free(ptr, stream_ptr, exc.code)
            else:
                self.n_free_errors += 1
        except Exception:
            self.n_free_errors += 1

    # -- streams: record_stream and graph capture (slow paths of the hot path) --------
    def _wait_recorded(self, stream: Any, recorded: list) -> None:
        """Make ``stream`` wait for the work now on the streams in ``recorded``."""
        dev = self.device_id if self.device_id >= 0 else -1
        ptr, sdev, _ = _streams.as_stream(stream, device=dev)
        _streams.wait_streams(ptr, sdev, recorded)

    def _capture_malloc(self, size: int, err: int, status: int) -> Any:
        """An allocation on a stream the driver says is capturing (or could not say)."""
        stream = cupy.cuda.get_current_stream()
        if err:
            check_driver((_drv.CUresult(err),), "cuStreamIsCapturing")
        sptr = int(stream.ptr)
        state, cap_id = _streams.capture_info(sptr)
        if state == _streams.CAPTURE_INVALIDATED:
            raise CUDADriverError(
                "cuStreamIsCapturing",
                901,
                "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
                f"the capture on stream {sptr:#x} was invalidated by an earlier error; "
                "end it with stream.end_capture() (which raises) and capture again",
            )
        if state == _streams.CAPTURE_NONE:  # capture ended in between: the plain path
            return _hp.PoolCore.malloc(self, size)  # the hot path's (a guard's adds nothing)
        _streams.note_capture(sptr, stream)
        if size == 0:
            return self._make_block(0, 0, stream, 0)
        if self.kind == _hp.KIND_PINNED:
            raise UnsupportedError(
                f"{self._describe()}: pinned host memory cannot be allocated while stream "
                f"{sptr:#x} is capturing a CUDA graph (a graph copy reads its host buffer "
                "at every launch, and graph memory is not host-accessible). Allocate pinned "
                "buffers before begin_capture() and keep them alive while the graph is used."
            )
        if self.kind == _hp.KIND_MANAGED:
            raise UnsupportedError(
                f"{self._describe()}: managed memory cannot be allocated while stream "
                f"{sptr:#x} is capturing a CUDA graph (graph memory is device memory). "
                "Allocate managed arrays before begin_capture(), or capture with a DevicePool."
            )
        ptr = self._graph_alloc(size, sptr)
        with self._lock:
            self._graph_blocks[ptr] = (cap_id, sptr)
            self._graph_bytes += size
            self.n_graph_allocs += 1
        return self._make_block(ptr, size, stream, _hp.FLAG_CAPTURED)

    def _graph_alloc(self, size: int, sptr: int) -> int:
        """Graph-owned memory: an allocation node of the capture on ``sptr``."""
        err, ptr = self._graph_try(size, sptr)
        if err == _CUDA_ERROR_OUT_OF_MEMORY:
            # Graph memory comes from the device, beside this pool: give back what the
            # pool holds unused (no synchronisation during a capture) and retry once.
            self.n_oom += 1
            gc.collect()
            self.flush_cache()
            self.trim(sync=False)
            err, ptr = self._graph_try(size, sptr)
            if err == _CUDA_ERROR_OUT_OF_MEMORY:
                raise self._oom_error(
                    size,
                    "for a CUDA graph being captured (graph memory, beside the pool's own), "
                    "after returning the pool's unused memory to the device",
                )
        if err:
            check_driver((_drv.CUresult(err),), "cuMemAllocAsync (stream capture)")
        return ptr

    def _graph_try(self, size: int, sptr: int) -> tuple[int, int]:
        if not getattr(self, "ipc", False):
            # The pool's own properties for the allocation node.
            err, p = _drv.cuMemAllocFromPoolAsync(size, _pool_handle(self._mr), sptr)
        else:
            # IPC pools cannot make graph nodes (CUDA_ERROR_NOT_SUPPORTED): the
            # device's current pool (its default unless someone changed it) can.
            err, p = _drv.cuMemAllocAsync(size, sptr)
            if int(err) == _CUDA_ERROR_NOT_SUPPORTED:
                err, p = _drv.cuMemAllocFromPoolAsync(size, _graph_template(self.device_id), sptr)
        return int(err), (int(p) if not int(err) else 0)

    def _free_flagged(self, ptr: int, size: int, stream: Any, flags: int) -> bool:
        """Free path of blocks with FLAG_CAPTURED or FLAG_ADVISED; True when handled."""
        if flags & _hp.FLAG_CAPTURED:
            self._free_captured(ptr, size, stream)
            return True
        if flags & _hp.FLAG_ADVISED:
            self._reset_advice(ptr, size)
        return False

    def _free_captured(self, ptr: int, size: int, stream: Any) -> None:
        """Free graph-owned memory: a free node inside its own capture, else after it."""
        with self._lock:
            cap_id, sptr = self._graph_blocks.pop(ptr, (0, int(stream.ptr)))
            self._graph_bytes -= size
        state, now_id = _streams.capture_info(sptr)
        if state == _streams.CAPTURE_INVALIDATED:
            return  # the graph is discarded with its allocations: nothing to free
        if state == _streams.CAPTURE_ACTIVE and now_id != cap_id:
            with self._lock:  # another capture on that stream: free once it is over
                self._capture_held.append(("graph", ptr, size, sptr, stream))
                self.n_capture_held = len(self._capture_held)
            return
        # In its capture: a free node.  After it: a plain stream-ordered free, which
        # must come after a launch of the graph (see the docs' rule).
        err = int(_drv.cuMemFreeAsync(ptr, sptr)[0])
        if err:
            self.n_free_errors += 1

    def _reset_advice(self, ptr: int, size: int) -> None:
        """Hints given to a managed block do not follow it to its next array."""
        from .managed import _reset_advice

        _reset_advice(ptr, size, self.device_id)

    def _hold_free(self, ptr: int, stream_ptr: int, err: int, stream: Any = None) -> None:
        """A driver free on a capturing stream: keep it until the capture ends.

        ``stream`` (the stream object, when the caller had it) stays referenced with the
        entry, so the handle is still valid when the free is done.
        """
        if err and err not in _streams.CAPTURE_ERRORS:
            # Not a capture: the query failed (a destroyed stream?); free directly.
            if self._free_direct(ptr, stream_ptr):
                self.n_free_errors += 1
            return
        if not err and stream is not None:
            # A capture the pools may not have seen (nothing allocated in it): the
            # retirer must not synchronise while it runs.
            _streams.note_capture(stream_ptr, stream)
        with self._lock:
            self._capture_held.append(("free", ptr, 0, stream_ptr, stream))
            self.n_capture_held = len(self._capture_held)

    def _free_failed(self, ptr: int, stream_ptr: int, err: int, stream: Any = None) -> None:
        if err in _streams.CAPTURE_ERRORS:  # the legacy stream during a capture
            self._hold_free(ptr, stream_ptr, err, stream)
        else:
            self.n_free_errors += 1

    def _drain_capture_held(self) -> None:
        """Do the frees held for captures that have ended since."""
        with self._lock:
            held, self._capture_held = self._capture_held, []
            self.n_capture_held = 0
        keep = []
        for entry in held:
            what, ptr, size, sptr, stream = entry
            if _streams.capture_status(sptr) != _streams.CAPTURE_NONE or (
                sptr <= 1 and _streams.any_capture_underway()
            ):
                keep.append(entry)
                continue
            if what == "pinned":
                self._defer_free(ptr, size, stream)  # type: ignore[attr-defined]
                continue
            if what == "graph":
                err = int(_drv.cuMemFreeAsync(ptr, sptr)[0])
            else:
                err = self._free_direct(ptr, sptr)
            if err in _streams.CAPTURE_ERRORS:  # a capture the pools did not see
                keep.append(entry)
            elif err:
                self.n_free_errors += 1
        if keep:
            with self._lock:
                self._capture_held.extend(keep)
                self.n_capture_held = len(self._capture_held)

    # -- public API ------------------------------------------------------------------
    @property
    def memory_resource(self) -> Any:
        """The cuda.core memory resource that owns this pool's CUDA memory pool.

        Raises :class:`~cupy_poolmem.PoolClosedError` once the pool is closed.

        Examples
        --------
        >>> mr = cupy_poolmem.DevicePool().memory_resource  # doctest: +SKIP
        """
        if self._parked:
            self._raise_closed()
        return self._mr

    @property
    def handle(self) -> int:
        """The ``CUmemoryPool`` handle, as an int.

        Raises :class:`~cupy_poolmem.PoolClosedError` once the pool is closed.

        Examples
        --------
        >>> cupy_poolmem.DevicePool().handle != 0  # doctest: +SKIP
        True
        """
        if self._parked:
            self._raise_closed()
        return int(self._mr.handle)

    @property
    def max_size(self) -> int:
        """Hard cap in bytes (``0``: limited only by the device or host).

        Examples
        --------
        >>> cupy_poolmem.DevicePool(max_size="1GiB").max_size  # doctest: +SKIP
        1073741824
        """
        return self._max_size

    def set_release_threshold(self, value: int | str | None) -> None:
        """Set how many reserved bytes the pool keeps across synchronisations.

        Parameters
        ----------
        value : int, str or None
            Bytes to keep (``"512MiB"`` works too).  ``None`` keeps everything (the
            pool never shrinks on its own; :meth:`trim` releases memory explicitly);
            ``0`` releases unused memory at every synchronisation, which makes later
            allocations slow.

        Raises
        ------
        InvalidOptionError
            For a pool with ``large_blocks="expandable"`` (its ranges keep no
            threshold), or a size that does not parse.

        Examples
        --------
        >>> pool = cupy_poolmem.DevicePool()  # doctest: +SKIP
        >>> pool.set_release_threshold("1GiB")  # doctest: +SKIP
        """
        v = _UINT64_MAX if value is None else parse_bytes(value, name="release_threshold")
        if value is not None and getattr(self, "large_blocks", "pool") == "expandable":
            _check_expandable("auto", value, None)  # raises: the ranges keep no threshold
        for mr in self._mrs:
            _set_attr(mr, _A.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, v)
        if self._backend is not None:  # freed bytes it keeps (see _block_cache.py)
            self._backend.release_threshold = self._backend.default_keep if value is None else v
        self._release_threshold = v

    def stats(self) -> PoolStats:
        """Return a :class:`~cupy_poolmem.PoolStats` snapshot of this pool.

        Returns
        -------
        PoolStats
            Bytes used and reserved now and at their peaks, counts of allocations and
            frees, and the pool's limits.

        Examples
        --------
        >>> pool = cupy_poolmem.DevicePool()  # doctest: +SKIP
        >>> pool.stats().used_bytes  # doctest: +SKIP
        0
        """
        if self.n_capture_held:
            self._drain_capture_held()
        reserved, peak_reserved = self._reserved()
        return PoolStats(
            kind=self._kind_name,
            device=self.device_id,
            used_bytes=int(self.live_bytes),
            peak_used_bytes=int(self.peak_live_bytes),
            reserved_bytes=reserved,
            peak_reserved_bytes=peak_reserved,
            n_allocs=int(self.n_allocs),
            n_frees=int(self.n_frees),
            held_for_sharing_bytes=int(self._held_for_sharing),
            max_size=self._max_size,
            release_threshold=self._release_threshold,
            cached_bytes=int(self.cached_bytes),
            graph_bytes=int(self._graph_bytes),
        )

    def _sum_attr(self, name: str) -> int:
        """The cuda.core attribute ``name`` (``reserved_mem_current``, ...) summed over
        this pool's CUDA pools (a DevicePool may have a small-block pool)."""
        return sum(int(getattr(mr.attributes, name)) for mr in self._mrs)

    def _reserved(self) -> tuple[int, int]:
        """Reserved bytes now and at the high-water mark, summed over the CUDA pools
        and the backend (with several, the sum of their peaks: an upper bound of the
        peak)."""
        now, high = self._sum_attr("reserved_mem_current"), self._sum_attr("reserved_mem_high")
        b = self._backend
        if b is not None:
            now, high = now + int(b.reserved), high + int(b.peak_reserved)
        return now, high

    def reset_peak(self) -> None:
        """Reset the peak used/reserved counters to the current values.

        Examples
        --------
        >>> pool = cupy_poolmem.DevicePool()  # doctest: +SKIP
        >>> pool.reset_peak()  # doctest: +SKIP
        >>> pool.stats().peak_used_bytes == pool.stats().used_bytes  # doctest: +SKIP
        True
        """
        self.peak_live_bytes = self.live_bytes
        for mr in self._mrs:
            _set_attr(mr, _A.CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0)
            _set_attr(mr, _A.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 0)
        if self._backend is not None:
            self._backend.reset_peak()

    def trim(self, keep: int | str = 0, *, sync: bool = True) -> int:
        """Release unused reserved memory back to the system, keeping at least ``keep`` bytes.

        Parameters
        ----------
        keep : int or str, default 0
            Reserved bytes to keep (``"1GiB"`` works too).
        sync : bool, default True
            Synchronise the pool's device first, so that frees still pending on
            streams complete and their memory can be released.

        Returns
        -------
        int
            The bytes released.

        Examples
        --------
        >>> released = pool.trim()  # doctest: +SKIP
        """
        keep_b = parse_bytes(keep, name="keep")
        if self.guard is not None:
            self.guard.flush()
        self.flush_cache()
        if self.n_capture_held:
            self._drain_capture_held()
        if sync:
            self._synchronize()
        # ``keep`` counts all the CUDA pools and the backend together: each keeps what
        # the others do not.
        cur = [int(mr.attributes.reserved_mem_current) for mr in self._mrs]
        before = sum(cur)
        b = self._backend
        held = int(b.reserved) if b is not None else 0
        for i, mr in enumerate(self._mrs):
            keep_here = max(0, keep_b - (sum(cur) - cur[i]) - held)
            check_driver(_drv.cuMemPoolTrimTo(_pool_handle(mr), keep_here), "cuMemPoolTrimTo")
            cur[i] = int(mr.attributes.reserved_mem_current)
        released = max(0, before - sum(cur))
        if b is not None:  # its live blocks stay: it keeps freed ones up to what is left
            live = int(b.reserved) - int(b.cached)
            released += b.release(max(0, keep_b - sum(cur) - live), wait=sync, at_least=True)
        return released

    def outstanding(self, limit: int = 20) -> list:
        """Live allocations of this pool, biggest first (call sites when tracking is on).

        Parameters
        ----------
        limit : int, default 20
            The most allocations listed.

        Returns
        -------
        list of cupy_poolmem.stats.Allocation
            As :func:`cupy_poolmem.stats.outstanding` returns them.

        Examples
        --------
        >>> pool = cupy_poolmem.DevicePool()  # doctest: +SKIP
        >>> with cupy_poolmem.using(pool):  # doctest: +SKIP
        ...     x = cupy.empty(1 << 20)
        >>> pool.outstanding()[0].size  # doctest: +SKIP
        1048576
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

        Examples
        --------
        >>> pool = cupy_poolmem.DevicePool()  # doctest: +SKIP
        >>> pool.close()  # doctest: +SKIP
        >>> pool.closed  # doctest: +SKIP
        True
        """
        if self.closed:
            return
        try:
            self._mark_closed()
        except BaseException:
            # A free in the cache flush raised (an interrupt in a driver free, say): the
            # flush freed the rest, and the pool still retires.
            self._finish_close()
            raise
        self._finish_close()

    def _finish_close(self) -> None:
        """:meth:`close` after the pool is marked closed: the guard's quarantine, the
        pool list, then the retirer once no block is live."""
        if self.guard is not None:
            # The quarantine is checked and freed on its blocks' streams before the
            # pool goes; what cannot be now (a capture under way) goes to the retirer.
            left = self.guard.close()
            if left:
                _retire.retirer().add_leftovers(self._retire_token, self._retire_device(), left)
        with _registry_lock():
            _runtime.POOLS.discard(self)
        # Only now may the pool be retired: a last free in another thread while the
        # quarantine was handed over above must not retire it first (its retirer entry
        # would be gone, and the quarantine's blocks with it).
        self._close_done = True
        if self.n_allocs == self.n_frees and not self._held_for_sharing:
            self._drained()
        # else: the hot path calls _drained() when the last live block is freed.

    def _drained(self) -> None:
        """Closed and no live block left: release the CUDA pool.

        Blocks in sharing limbo count as live: the pool is released when the exporter
        frees the last of them (other processes still map them).  Frees held for a
        stream capture are done first: the retirer polls the pool until the capture
        has ended (a closed pool allocates no more, so nothing else would do them).

        Also called for a finalized pool's last block, possibly after the garbage
        collector emptied the ``__dict__``: then only C fields are read.
        """
        if self._held_for_sharing or not self._close_done:
            return  # close() is still handing over (it drains at its end)
        if self.n_capture_held and not self.finalized:
            self._drain_capture_held()
            if self.n_capture_held:
                _retire.retirer().after_captures(self._drained_after_capture)
                return
        self._retire_now()

    def _drained_after_capture(self) -> bool:
        """The retirer's poll (its thread): True once the held frees are done and the
        pool is retired."""
        # A context bound to the retirer's thread, and a global-mode capture elsewhere
        # must not forbid the capture queries (and pinned event queries) here.
        with on_device(max(self.device_id, 0)), _streams.relaxed_capture_mode():
            self._drain_capture_held()
        if self.n_capture_held:
            return False
        self._drained()
        return True

    def _retire_now(self, leftovers: Any = (), before_destroy: Any = None) -> None:
        """Hand the CUDA pool to the retirer (C fields only: see :meth:`_drained`);
        ``before_destroy`` runs if it is to be destroyed rather than parked.

        CUDA pools parked for reuse (a plain DevicePool's) may be another pool's soon:
        from then on this object reads and sets nothing of them.
        """
        r = _retire.retirer()
        if r.retire(self._retire_token, self._retire_device(), leftovers, before_destroy):
            with contextlib.suppress(Exception):
                # Statistics read zero; trim, peaks and thresholds touch nothing;
                # handle, memory_resource and peer_access raise PoolClosedError.
                self._mrs = ()
                self._parked = True

    def _retire_device(self) -> int:
        """The device the retirer synchronises for this pool's frees."""
        return self.device_id if self.kind == _hp.KIND_DEVICE else _retire.ALL_DEVICES

    def _orphan(self, ptr: int, size: int, flags: int) -> bool:
        """A block freed after this pool's finalizer ran (see ``Block.__dealloc__``).

        Its stream may be destroyed and the ``__dict__`` empty: the retirer frees it
        after a sync, before it destroys the pool.  Graph memory (allocated during a
        capture) is its graph's, not the pool's: it is left alone.
        """
        if not flags & _hp.FLAG_CAPTURED:
            _retire.retirer().add_leftovers(
                self._retire_token,
                self._retire_device(),
                (ptr,),
                everywhere=bool(flags & _hp.FLAG_RECORDED),  # its streams' devices too
            )
        return True

    def _finalize_leftovers(self) -> list[int]:
        """A finalized pool's blocks that no stream will free: its reuse cache and the
        frees held for a capture ("graph" memory waits for its capture instead)."""
        left = self._take_cache()
        with self._lock:
            held, self._capture_held = self._capture_held, []
            self.n_capture_held = 0
        graph = []
        for entry in held:
            if entry[0] == "graph":
                graph.append(entry)
            else:
                left.append(entry[1])
        if graph:
            _retire.retirer().after_captures(_GraphFrees(graph, max(self.device_id, 0)))
        return left

    def __del__(self) -> None:
        # The pool was dropped: without close(), or inside a garbage cycle, then with
        # its live blocks (they hold it), whose streams a cupy Stream's own finalizer
        # may destroy first; the collector then empties this __dict__ before the blocks
        # are freed.  So from here on nothing of this pool touches a stream: its reuse
        # cache, held and deferred frees go to the retirer, which frees them after a
        # sync (a free on a destroyed stream crashed in the driver), and so do its live
        # blocks when freed (``_orphan``).  The CUDA pool is retired after the last one.
        try:
            was_closed = self.closed
            self._mark_finalized()
            left = self._finalize_leftovers()
            if self.guard is not None:  # the quarantine too, unchecked (same reason)
                left += self.guard.take_quarantine()
            r = _retire.retirer()
            r.add_leftovers(self._retire_token, self._retire_device(), left)
            self.close()  # its cache flush now has nothing to free
            if was_closed and self.n_allocs == self.n_frees and r.is_held(self._retire_token):
                # Closed and drained, yet not retired: the retirer gave up polling it
                # (its frees held for a capture went to the retirer above).
                self._drained()
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
            b = self._backend
            extra = int(b.reserved) - int(b.cached) if b is not None else 0
            return self._sum_attr("used_mem_current") + extra
        except Exception:
            return 0

    @property
    def _pool_uuid(self) -> str:
        """The uuid of the main shareable CUDA pool (``""``: the pool cannot be shared)."""
        return self._ipc_pools[0][1] if self._ipc_pools else ""

    def _ipc_pool_of(self, ptr: int, handle: int = 0) -> tuple[str, Any]:
        """``(uuid, memory resource)`` of this pool's shareable CUDA pool holding ``ptr``.

        With a small-block pool the driver says which (the pointer's
        ``CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE``; ``handle``: that attribute, when the
        caller has read it already): the sharing protocol sends each block under its own
        CUDA pool's uuid, and that pool's descriptor to a new receiver.
        """
        pools = self._ipc_pools
        if not pools:
            raise SharingError(
                f"{self!r} is not IPC-enabled, so its memory cannot be shared with other "
                "processes; create it with ipc=True (cupy_poolmem.set_allocator() does by "
                "default)"
            )
        if len(pools) == 1:
            return pools[0][1], pools[0][2]
        if not handle:
            handle = check_driver(
                _drv.cuPointerGetAttribute(
                    _drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
                    _drv.CUdeviceptr(ptr),
                ),
                "cuPointerGetAttribute",
            )
            handle = int(handle) if handle is not None else 0
        for h, uuid, mr in pools:
            if h == handle:
                return uuid, mr
        where = f"it belongs to pool {handle:#x}" if handle else "it is not pool memory"
        raise SharingError(
            f"address {ptr:#x} is not memory of {self!r}'s CUDA pools ({where}); share "
            "arrays allocated from the pool that exports them"
        )

    def _owns_handle(self, handle: int) -> bool:
        """Whether the CUDA pool ``handle`` is one of this pool's."""
        return any(int(mr.handle) == handle for mr in getattr(self, "_mrs", ()))


def _park(resource: Any) -> None:
    """A drained pool's CUDA pools, parked for the next pool of their kind: they keep
    no memory (release threshold 0, so what their pending frees give back goes to the
    device at the next synchronising call; a trim now for what is free already)."""
    for mr in _Resources.members(resource):
        _set_attr(mr, _A.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, 0)
        check_driver(_drv.cuMemPoolTrimTo(_pool_handle(mr), 0), "cuMemPoolTrimTo")


def _recycled_mrs(key: Any) -> list[Any]:
    """The CUDA pools a drained pool of ``key`` left parked, or [] (create new ones)."""
    res = _retire.retirer().take_recycled(key)
    return [] if res is None else list(_Resources.members(res))


class _Revoke:
    """Revoke every peer grant of the CUDA pools ``mrs`` (a pool about to be destroyed)."""

    def __init__(self, mrs: tuple[Any, ...]) -> None:
        self.mrs = mrs

    def __call__(self) -> None:
        for mr in self.mrs:
            with contextlib.suppress(Exception):
                mr.peer_accessible_by = ()


class _Resources:
    """The retirer's resource for a pool made of several CUDA pools: closed together."""

    def __init__(self, mrs: tuple[Any, ...]) -> None:
        self.mrs = mrs

    @staticmethod
    def owner(mrs: Any, backend: Any = None, device: int = 0) -> Any:
        """What the retirer holds for the CUDA pools ``mrs`` and the ``backend``: the
        one, or all together (None: nothing)."""
        if not mrs:
            return backend
        if backend is None and len(mrs) == 1:
            return mrs[0]
        if backend is None:
            return _Resources(tuple(mrs))
        return _WithBackend(tuple(mrs), backend, device)

    @staticmethod
    def members(resource: Any) -> tuple[Any, ...]:
        """The CUDA pools of a resource :meth:`owner` made."""
        return resource.mrs if isinstance(resource, _Resources) else (resource,)

    def close(self) -> None:
        errors = []
        for mr in self.mrs:
            try:
                mr.close()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


class _WithBackend(_Resources):
    """CUDA pools and a backend for the large blocks: closed together, the backend
    first; a leftover block goes back to whichever holds it."""

    def __init__(self, mrs: tuple[Any, ...], backend: Any, device: int) -> None:
        super().__init__(mrs)
        self.backend = backend
        self.device = device

    def close(self) -> None:
        try:
            self.backend.close()
        finally:
            super().close()

    def free_leftover(self, ptr: int) -> None:
        if self.backend.owns(ptr):
            self.backend.free_leftover(ptr)
        else:
            _retire._free_on_legacy_stream(ptr, self.device)


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
        speed only.  Flushed on out-of-memory, :meth:`~Pool.trim` and :meth:`~Pool.close`,
        and once the allocations it could not serve outrun the ones it served by 16
        (a miss counts one up, a hit one down, never below zero: sizes or streams no
        longer asked for, or sizes that seldom repeat, go back to the CUDA pool, where
        any size reuses the memory).
        Default ``"1GiB"``; ``0`` disables it.
    peer_access : "all", None or list of int
        Other GPUs that may read and write this pool's memory (kernels and copies
        there).  ``"all"`` (default): every GPU that ``cudaDeviceCanAccessPeer`` allows,
        as CuPy's own pool gives.  ``None`` (or ``[]``): this GPU only.  A list of
        ordinals: exactly those; a GPU that cannot access this one raises
        :class:`~cupy_poolmem.UnsupportedError` naming both.  Settable later with
        :attr:`peer_access`.
    guard : bool, str, dict, GuardOptions or None
        Debug mode that catches use-after-free, double frees, out-of-bounds writes and
        unordered cross-stream reuse (:doc:`guard`): ``True``, ``"raise"``,
        ``"warn"``, a dict of :class:`~cupy_poolmem.GuardOptions` fields or a
        ``GuardOptions``; ``False`` turns it off.  ``None`` (default) reads
        ``CUPY_POOLMEM_GUARD`` (unset: off).  It slows every allocation and free
        (fills, checks that synchronise the block's stream) and disables the reuse
        cache; the pool's statistics count each block with its red zone.
    small_pool : "auto", int, str or None
        Blocks up to this size (bytes or a string such as ``"8MiB"``) come from a
        second CUDA pool, so small blocks do not pin the 32 MiB chunks in which the
        driver maps a pool's memory, chunks that large blocks could use again (see
        Notes).  ``"auto"`` (default): ``8MiB`` when the pool has no ``max_size``,
        else one CUDA pool.  ``None`` (or ``0``): one CUDA pool.  An explicit size
        with ``max_size`` raises :class:`~cupy_poolmem.InvalidOptionError`.  With
        ``ipc=True`` both CUDA pools can be shared, each block under its own.  With
        ``large_blocks="mapped"``: the size above which blocks are mapped.  With
        ``large_blocks="expandable"``: ``"auto"`` only (its ranges split blocks at
        1 MiB).
    large_blocks : {"pool", "mapped", "expandable"}
        ``"pool"`` (default): large blocks come from a CUDA pool too.  ``"mapped"``:
        each block above ``small_pool`` is device memory of its own, mapped with
        virtual memory management and unmapped once freed (beyond a cache of freed
        blocks), so the memory reserved follows the memory live where sizes vary
        and frees come out of order (see Notes).  Not with ``ipc=True`` (mapped
        blocks cannot be shared) nor ``max_size`` (the cap is a CUDA pool's):
        :class:`~cupy_poolmem.InvalidOptionError`; ``small_pool`` must then be at
        least 2 MiB.  ``"expandable"``: every block is placed, first fit, in two
        address ranges per stream that grow by mapping device memory (blocks up to
        1 MiB in one, larger ones in the other), as torch's ``expandable_segments``
        do: a freed block's room serves any size on its stream at once, with no
        driver call (see Notes).  Not with ``ipc=True``, ``max_size`` nor
        ``release_threshold`` (:class:`~cupy_poolmem.InvalidOptionError`).

    Attributes
    ----------
    large_blocks : str
        ``"pool"``, ``"mapped"`` or ``"expandable"``: where blocks above
        :attr:`small_pool` come from (every block, for ``"expandable"``).

    Notes
    -----
    ``malloc(size)`` allocates on CuPy's *current stream* and returns a
    :class:`cupy.cuda.MemoryPointer`; the memory is freed, stream-ordered, on that
    same stream once the last array using it is gone.  Work on another stream that
    uses the array must be declared with :func:`~cupy_poolmem.record_stream` (or
    ordered by hand) before the array is dropped.  During a CUDA graph capture the
    pool hands out graph-owned memory (see the "Streams and graphs" section of the
    device-pool guide).  Calling ``malloc`` while another device is current raises
    :class:`~cupy_poolmem.WrongDeviceError`.

    A CUDA pool maps memory in 32 MiB chunks and gives a chunk back (:meth:`~Pool.trim`)
    only when no block is left in it, so a few small blocks scattered over chunks keep
    them reserved while large blocks need new ones.  With a small-block pool
    (``small_pool``) the small blocks share a few chunks of their own: on the churn
    benchmark's traces the reserved peak fell from 0.95-1.16x CuPy's ``MemoryPool`` to
    0.78-0.92x, at the same speed.  Memory freed in one of the two CUDA pools is used by
    the other after :meth:`~Pool.trim` or an out-of-memory retry (which trims both).
    :attr:`small_pool` gives the size in use, ``stats().peak_reserved_bytes`` the sum of
    both pools' peaks.  An IPC pool shares both: a block goes to other processes under
    the CUDA pool that holds it.

    With ``large_blocks="mapped"`` a block above ``small_pool`` (8 MiB) is mapped on
    memory of its own (``cuMemCreate``, ``cuMemMap``) at the device's 2 MiB
    granularity.  A freed one serves the next request of its size, or of at least three
    quarters of it, at once on its own stream and on another once an event recorded at its
    free has completed.  Freed blocks stay mapped while the mapped blocks reserve at
    most the most bytes ever live in them plus a sixteenth (64 MiB at least); a new
    block that would reserve more first unmaps the oldest freed blocks whose frees
    have run, and their memory goes back to the device.  A ``release_threshold``
    instead caps the freed bytes kept; :meth:`~Pool.trim` gives them all back.  On the
    churn benchmark this reserves 0.78x CuPy's ``MemoryPool``'s peak at about 4x its
    time per step (a CUDA pool: 0.98x at 1.5x); a block mapped and later unmapped
    costs about 165 us of driver calls, paid on a miss, so allocation-heavy loops are
    faster on the default.  Blocks allocated during a graph capture
    are graph memory as usual.

    With ``large_blocks="expandable"`` each stream gets two address ranges, each as
    large as the device's memory (address space only), mapped from their start as
    they fill: 20 MiB at a time (2 MiB for the range of blocks up to 1 MiB).  A block
    is placed at the lowest free place in its range that fits; a freed one merges with
    free neighbours and serves the next allocation of any size on the stream it was
    allocated on, at once (stream order, as CuPy's ``MemoryPool`` reuses blocks).  The
    hot path does this itself, without a driver call, so allocation costs what
    ``MemoryPool``'s does.  Nothing is unmapped on a free: :meth:`~Pool.trim` and an
    out-of-memory retry unmap the free memory at the top of each range (a stream's
    ranges go once nothing is mapped in them); memory free below a live block stays
    mapped.  A range keeps its stream object alive.  On the churn benchmark this
    reserves 0.78x CuPy's ``MemoryPool``'s peak at 0.88-0.95x its time per step.  It has no
    reuse cache (``reuse_cache`` is ignored: the ranges are the cache).

    Pool memory is mapped only on the GPUs the pool grants (``cuMemPoolSetAccess``);
    ``cudaDeviceEnablePeerAccess``, which CuPy calls, does not cover it.  A kernel on
    a GPU without a grant fails with ``cudaErrorIllegalAddress``;
    :func:`~cupy_poolmem.check_access` tells beforehand.

    Examples
    --------
    >>> import cupy, cupy_poolmem
    >>> pool = cupy_poolmem.DevicePool(device=0, max_size="40GB")  # doctest: +SKIP
    >>> cupy.cuda.set_allocator(pool.malloc)  # doctest: +SKIP
    >>> x = cupy.arange(10)  # doctest: +SKIP
    >>> pool.stats().n_allocs  # doctest: +SKIP
    1
    >>> lean = cupy_poolmem.DevicePool(large_blocks="mapped")  # doctest: +SKIP
    >>> lean.small_pool  # blocks above 8 MiB are mapped one by one  # doctest: +SKIP
    8388608
    >>> packed = cupy_poolmem.DevicePool(large_blocks="expandable")  # doctest: +SKIP
    >>> packed.small_pool  # blocks up to 1 MiB share a range of their own  # doctest: +SKIP
    1048576
    """

    _kind_name = "device"
    large_blocks = "pool"

    def __init__(
        self,
        device: int | Any = None,
        max_size: int | str | None = None,
        release_threshold: int | str | None = None,
        ipc: bool = False,
        reuse_cache: int | str = "1GiB",
        peer_access: Any = "all",
        guard: Any = None,
        small_pool: int | str | None = "auto",
        large_blocks: str = "pool",
    ) -> None:
        dev = check_device(device)
        ipc = _check_bool(ipc, "ipc")
        mode = _large_blocks_mode(large_blocks, ipc)
        mapped = mode == "mapped"
        if mode == "expandable":
            _check_expandable(small_pool, release_threshold, max_size)
        guard_options = _guard.resolve(guard)
        cache = parse_bytes(reuse_cache, name="reuse_cache")
        peers = resolve_peer_access(peer_access, dev)
        with cupy.cuda.Device(dev) as d:
            total = d.mem_info[1]
            max_b = parse_bytes(max_size, name="max_size", total=total, allow_none=True) or 0
            if max_b > total:
                raise InvalidOptionError(
                    f"max_size={max_size!r} ({format_bytes(max_b)}) is more "
                    f"than device {dev} has ({format_bytes(total)})"
                )
            parse_bytes(release_threshold, name="release_threshold", allow_none=True)
            if mapped:
                # Blocks up to the small-block size from one CUDA pool, larger ones
                # mapped one by one (see _mapped.py).
                if max_b:
                    raise InvalidOptionError(
                        f"max_size={max_size!r} cannot be used with large_blocks='mapped': "
                        "the cap is a CUDA pool's, and mapped blocks are not in one. Use "
                        "large_blocks='pool' for a capped pool"
                    )
                map_above = _mapped_threshold(small_pool)
                small_max = 0
                backend: Any = _new_mapped_blocks(dev, peers)
            elif mode == "expandable":
                # Every block from the ranges (see _expandable.py); the CUDA pool
                # serves graph captures only.
                small_max = 0
                backend = _new_expandable_blocks(dev, peers, int(total))
            else:
                small_max = _small_pool_size(small_pool, max_b)
                backend = None
            # A plain pool's CUDA pools are reused by the next plain pool of the same
            # shape once it is drained (not destroyed, so no device sync); a shareable
            # one's are destroyed (other processes know their handles).
            # Not with max_size: the driver counts the last owner's pending frees
            # against it until they complete.  Not with mapped blocks (their own).
            key = None if ipc or max_b or mode != "pool" else ("device", dev, max_b, small_max)
            mrs = _recycled_mrs(key) if key is not None else []
            recycled = bool(mrs)
            try:
                if not mrs:
                    mrs.append(
                        cc.DeviceMemoryResource(
                            dev, cc.DeviceMemoryResourceOptions(ipc_enabled=ipc, max_size=max_b)
                        )
                    )
                    if small_max:
                        mrs.append(
                            cc.DeviceMemoryResource(
                                dev, cc.DeviceMemoryResourceOptions(ipc_enabled=ipc)
                            )
                        )
            except Exception as exc:
                for m in mrs:
                    m.close()
                raise _wrap(exc, "creating a device pool") from exc
            self._peers_set = False
            self._peers_lock = threading.RLock()  # one peer_access change at a time
            if peers or device_count() > 1:
                # Always set on a multi-GPU machine: a new pool can come back with the
                # handle of a destroyed one, and with its peer access (nvbug 5698116).
                # cuda.core compares with what *it* granted (nothing, for a new pool),
                # so stale grants are revoked here, by the driver call itself.
                try:
                    for m in mrs:
                        _revoke_stale(m, dev)
                        self._peers_set = _set_peers(m, dev, peers) or self._peers_set
                except BaseException:
                    if recycled:  # frees of the last owner may be pending: parked again
                        r = _retire.retirer()
                        r.retire(r.adopt(_Resources.owner(mrs), key, _park), dev)
                    else:
                        for m in mrs:
                            m.close()
                    raise
            self.ipc = ipc
            self.large_blocks = mode
            small = (mrs[1], small_max) if small_max else None
            self._backend = backend
            self._setup(mrs[0], dev, _hp.KIND_DEVICE, release_threshold, max_b, cache, small, key)
            if mapped:
                self._attach_backend(backend, map_above + 1, backend._sizes)
                # Large blocks skip the reuse cache: the mapped blocks' own serves them
                # across sizes, and gives back what it does not keep.
                self.cache_max_block = min(self.cache_max_block, map_above)
            elif mode == "expandable":
                self._attach_backend(backend, 0, backend)  # the slow paths' frees too
                self._attach_arenas(backend.arenas, _expandable.SMALL_MAX)
                # No reuse cache: a freed block goes straight back to its arena,
                # whose room serves every size.
                self.cache_limit = self.cache_max_block = 0
            if recycled:
                self.reset_peak()  # the last owner's peaks are not this pool's
            self._capacity = int(total)
            if guard_options is not None:
                try:
                    _guard.attach(self, guard_options)
                except BaseException:
                    self.close()
                    raise

    @property
    def small_pool(self) -> int:
        """The largest block the small-block pool serves, in bytes (``0``: none).

        With ``large_blocks="mapped"``: the largest block the pool's CUDA pool serves
        (larger ones are mapped); with ``"expandable"``: the largest block placed in
        the small blocks' range.

        Examples
        --------
        >>> cupy_poolmem.DevicePool(small_pool="1MiB").small_pool  # doctest: +SKIP
        1048576
        """
        if self.large_blocks == "mapped":
            return int(self.backend_min) - 1
        if self.large_blocks == "expandable":
            return int(self.arena_small_max)
        return int(self.small_max)

    @property
    def peer_access(self) -> tuple[int, ...]:
        """The other GPUs that may read and write this pool's memory, as the driver says.

        Assign ``"all"``, ``None`` or a list of ordinals (as for the constructor) to
        change it; the change covers the memory already allocated too.  Removing a GPU
        (``PROT_NONE``) first waits until that GPU is idle (``cuCtxSynchronize``), so
        work already queued there that reads the pool's memory finishes with access;
        work queued there afterwards fails with ``cudaErrorIllegalAddress``.

        Examples
        --------
        >>> pool = cupy_poolmem.DevicePool(device=0, peer_access=None)  # doctest: +SKIP
        >>> pool.peer_access  # doctest: +SKIP
        ()
        >>> pool.peer_access = [1]  # doctest: +SKIP
        >>> pool.peer_access  # doctest: +SKIP
        (1,)
        """
        if self._parked:
            return ()
        try:
            return _granted_peers(self._mr)
        except Exception as exc:
            if self.closed:
                return ()
            raise _wrap(exc, "querying a device pool's peer access") from exc

    @peer_access.setter
    def peer_access(self, value: Any) -> None:
        peers = resolve_peer_access(value, self.device_id)
        if self.closed and self.n_allocs == self.n_frees:
            self._raise_closed()
        # (setdefault: a pool built without __init__, as tests do, gets one here)
        with self.__dict__.setdefault("_peers_lock", threading.RLock()):
            self._change_peers(peers)

    def _change_peers(self, peers: tuple[int, ...]) -> None:
        """:attr:`peer_access`'s setter under its lock: wait for revoked GPUs, grant the
        CUDA pools, then the mapped blocks; all or nothing (when one refuses, the CUDA
        pools go back to their grants, and the mapped blocks undo their own)."""
        for dev in sorted(set(self.peer_access) - set(peers)):
            try:  # its queued kernels may read this pool's memory: let them finish first
                sync_device(dev)
            except Exception as exc:
                raise _wrap(exc, f"waiting for GPU {dev} before revoking its access") from exc
        granted = False
        before = self.peer_access
        try:
            for mr in self._mrs:
                if self._parked:  # retired by a collection in this thread meanwhile
                    self._raise_closed()
                granted = _set_peers(mr, self.device_id, peers) or granted
            if self._backend is not None:  # mapped blocks: each block's own access
                try:
                    self._backend.set_peers(peers)  # all or nothing
                except Exception as exc:
                    raise _wrap(exc, "setting the peer access of mapped blocks") from exc
        except Exception as exc:
            for mr in self._mrs:  # the CUDA pools go back to what they granted
                try:
                    _set_peers(mr, self.device_id, before)
                except Exception as undo:
                    self._peers_set = True  # a grant may stay: revoked at retirement
                    add_note(exc, f"the CUDA pool's previous peer access stays unset: {undo}")
            raise
        self._peers_set = granted or getattr(self, "_peers_set", False)

    def _retire_now(self, leftovers: Any = (), before_destroy: Any = None) -> None:
        """Retire; revoke the peer grants first if the pool is to be destroyed.

        A pool parked for reuse keeps its grants (the next owner revokes stale ones): no
        driver call, where a capture may be under way.  One destroyed must not: the
        driver may hand its handle to the next pool created with the grants still set
        (nvbug 5698116), which cuda.core 1.2 does not undo.  The retirer decides, and
        runs the revoke before any drain may destroy the pool.  Not while peer_access
        is being set in another thread (a change in this one, which a collection
        interrupted here, stops at the pool parked).
        """
        lock = self.__dict__.get("_peers_lock")  # (None once __dict__ is cleared)
        with lock if lock is not None else contextlib.nullcontext():
            if getattr(self, "_peers_set", False):  # (False once __dict__ is cleared)
                before_destroy = _Revoke(self._mrs)
            super()._retire_now(leftovers, before_destroy)


def _small_pool_size(value: Any, max_size: int) -> int:
    """Bytes of the largest block a DevicePool's small-block pool serves (0: none).

    Examples
    --------
    >>> _small_pool_size("auto", max_size=0) == SMALL_POOL_AUTO
    True
    >>> _small_pool_size("auto", max_size=1 << 30), _small_pool_size(None, 0)
    (0, 0)
    >>> _small_pool_size("1MiB", max_size=0)
    1048576
    """
    if isinstance(value, str) and value == "auto":
        return 0 if max_size else SMALL_POOL_AUTO
    size = parse_bytes(value, name="small_pool", allow_none=True) or 0
    if size and max_size:
        raise InvalidOptionError(
            f"small_pool={value!r} cannot be used with max_size={format_bytes(max_size)} "
            "(a second CUDA pool could exceed the cap); pass small_pool=None or 'auto' "
            "(which uses one CUDA pool there)"
        )
    return size


def _large_blocks_mode(value: Any, ipc: bool) -> str:
    """``large_blocks=value``, checked first: "pool", "mapped" or "expandable"."""
    if not isinstance(value, str):
        raise OptionTypeError(
            "large_blocks must be 'pool', 'mapped' or 'expandable'; got "
            f"{value!r} of type {type(value).__name__}"
        )
    if value not in ("pool", "mapped", "expandable"):
        raise InvalidOptionError(
            f"large_blocks={value!r} is not one of 'pool' (blocks from the CUDA pool), "
            "'mapped' (each large block mapped on memory of its own) or 'expandable' "
            "(every block placed in growing mapped ranges, one pair per stream)"
        )
    if value != "pool" and ipc:
        raise InvalidOptionError(
            f"large_blocks={value!r} cannot be used with ipc=True: mapped blocks are not "
            "in a CUDA pool that other processes can import. Use large_blocks='pool' for "
            "a pool whose arrays are shared"
        )
    return value


def _check_expandable(small_pool: Any, release_threshold: Any, max_size: Any) -> None:
    """Refuse the options ``large_blocks="expandable"`` has no use for."""
    for name, value, why in (
        ("max_size", max_size, "the cap is a CUDA pool's, and the ranges are not in one"),
        (
            "release_threshold",
            release_threshold,
            "the ranges keep freed memory mapped until trim() or an out-of-memory retry",
        ),
    ):
        if value is not None:
            raise InvalidOptionError(
                f"{name}={value!r} cannot be used with large_blocks='expandable': {why}. "
                f"Leave {name} unset, or use large_blocks='pool'"
            )
    if not (isinstance(small_pool, str) and small_pool == "auto"):
        raise InvalidOptionError(
            f"small_pool={small_pool!r} cannot be used with large_blocks='expandable': "
            f"blocks up to {format_bytes(_expandable.SMALL_MAX)} share a range of their "
            "own per stream. Leave small_pool='auto'"
        )


def _mapped_threshold(small_pool: Any) -> int:
    """The largest block a mapped pool's CUDA pool serves: ``small_pool``'s size.

    Examples
    --------
    >>> _mapped_threshold("auto") == SMALL_POOL_AUTO
    True
    >>> _mapped_threshold("2MiB")
    2097152
    """
    if isinstance(small_pool, str) and small_pool == "auto":
        return SMALL_POOL_AUTO
    size = parse_bytes(small_pool, name="small_pool", allow_none=True) or 0
    if size < _MAP_ABOVE_MIN:
        raise InvalidOptionError(
            f"small_pool={small_pool!r} is below {format_bytes(_MAP_ABOVE_MIN)}, the "
            "smallest size large_blocks='mapped' maps above (each mapped block takes a "
            "2 MiB granule at least); pass small_pool='auto' (8 MiB) or a larger size"
        )
    return size


def _new_expandable_blocks(device: int, peers: tuple[int, ...], total: int) -> Any:
    """The expandable ranges of a DevicePool on ``device`` (VMM checked first), each
    range with address space for all of the device's ``total`` bytes."""
    require_attribute(
        device,
        "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
        "virtual memory management, which large_blocks='expandable' needs; use large_blocks='pool'",
    )
    try:
        return _expandable.ExpandableBlocks(device, peers, span=total, arena=_hp.ARENA)
    except Exception as exc:
        raise _wrap(exc, "setting up expandable ranges") from exc


def _new_mapped_blocks(device: int, peers: tuple[int, ...]) -> Any:
    """The mapped-blocks backend of a DevicePool on ``device`` (VMM checked first)."""
    from ._mapped import MappedBlocks

    require_attribute(
        device,
        "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
        "virtual memory management, which large_blocks='mapped' needs; use large_blocks='pool'",
    )
    try:
        return MappedBlocks(device, peers)
    except Exception as exc:
        raise _wrap(exc, "setting up mapped blocks") from exc


def _granted_peers(mr: Any) -> tuple[int, ...]:
    """The devices a cuda.core ``DeviceMemoryResource`` grants access (driver state)."""
    return tuple(sorted(int(getattr(d, "device_id", d)) for d in mr.peer_accessible_by))


def _revoke_stale(mr: Any, owner: int) -> None:
    """Revoke (``PROT_NONE``) every GPU that could reach ``owner``: a new pool starts
    with its own GPU only, whatever a destroyed pool with the same handle granted."""
    others = [d for d in range(device_count()) if d != owner and can_access_peer(d, owner)]
    if others:
        grant_access(int(mr.handle), others, read_write=False)


def _set_peers(mr: Any, owner: int, peers: tuple[int, ...]) -> bool:
    """Make ``peers`` exactly the GPUs granted access to ``mr``; True if any is granted.

    cuda.core's ``peer_accessible_by`` compares with the driver's state and makes one
    ``cuMemPoolSetAccess`` call for the difference (grants read-write, revokes with
    ``PROT_NONE``); ``peers`` was checked with ``cudaDeviceCanAccessPeer`` already.
    """
    try:
        mr.peer_accessible_by = peers
    except ValueError as exc:  # cuda.core's own check (it asks the owner -> peer direction)
        raise UnsupportedError(
            f"GPU {owner}'s pool cannot be made accessible from GPU(s) "
            f"{', '.join(map(str, peers))}: {exc}"
        ) from exc
    except Exception as exc:
        raise _wrap(exc, "setting a device pool's peer access") from exc
    return bool(peers)


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
        self._setup(mr, -1, _hp.KIND_PINNED, release_threshold, max_b)
        self._capacity = _host_memory_bytes()
        self.release_hook = self._defer_free

    def _setup(self, *args: Any, **kwargs: Any) -> None:
        # Frees deferred until their streams' work is done (see _defer_free).  The lock
        # is reentrant: a garbage collection can start under it, and a pinned block
        # freed there defers its free under it again (same thread).
        self._pending: deque = deque()
        self._pending_lock = threading.RLock()
        super()._setup(*args, **kwargs)

    def _describe(self) -> str:
        return f"PinnedPool(numa_node={self.numa_node})"

    def _defer_free(self, ptr: int, size: int, stream: Any) -> bool:
        """Hold a freed block until its stream's work is done (see class Notes).

        A block whose stream is capturing a graph waits for the capture to end
        first: an event recorded there would be part of the graph.
        """
        if _streams.capture_status(int(stream.ptr)) != _streams.CAPTURE_NONE:
            with self._lock:
                self._capture_held.append(("pinned", ptr, size, int(stream.ptr), stream))
                self.n_capture_held = len(self._capture_held)
            return True
        events = []
        # CuPy's null stream names no device (-1): the current one is the block's.
        dev = stream.device_id if stream.device_id >= 0 else cupy.cuda.runtime.getDevice()
        with cupy.cuda.Device(dev):
            ev = cupy.cuda.Event(disable_timing=True)
            ev.record(stream)
            events.append(ev)
            cur = cupy.cuda.get_current_stream()
            if (
                cur.ptr != stream.ptr
                and cur.device_id in (stream.device_id, -1)
                and _streams.capture_status(int(cur.ptr)) == _streams.CAPTURE_NONE
            ):
                ev2 = cupy.cuda.Event(disable_timing=True)
                ev2.record(cur)
                events.append(ev2)
        with self._pending_lock:
            self._pending.append((events, ptr, stream))
        try:
            self._release_done()
        except Exception:  # e.g. an event query refused during a global-mode capture
            pass
        return True

    def _release_done(self, wait: bool = False) -> int:
        """Return finished deferred blocks to the pool; with ``wait``, all of them."""
        done = 0
        while True:
            # Nothing is allocated under the lock, and the first entry is taken only if
            # it is still first: a collection while its events are asked (a nested
            # deferral may release it first) or another thread cannot make this free
            # an entry twice, or one whose events are not done.
            with self._pending_lock:
                if not self._pending:
                    return done
                entry = self._pending[0]
            events, ptr, stream = entry
            if not wait and not all(e.done for e in events):
                return done
            with self._pending_lock:
                if not self._pending or self._pending[0] is not entry:
                    continue  # released meanwhile
                self._pending.popleft()
            for e in events:
                e.synchronize()
            self._free_now(ptr, stream.ptr, stream)
            done += 1

    def _reclaim(self) -> None:
        self._release_done(wait=True)
        super()._reclaim()

    def _take_pending(self) -> list[int]:
        # Blocks still waiting for their streams go to the retirer, which frees them
        # after its sync (never lost, never freed before their streams' work).
        lock = getattr(self, "_pending_lock", None)  # None: a collector cleared __dict__
        if lock is None:
            return []
        with lock:  # swapped, then read outside: a collection here cannot change it
            pending, self._pending = self._pending, deque()
        return [ptr for _, ptr, _ in pending]

    def _retire_now(self, leftovers: Any = (), before_destroy: Any = None) -> None:
        super()._retire_now([*leftovers, *self._take_pending()], before_destroy)

    def _finalize_leftovers(self) -> list[int]:
        left = super()._finalize_leftovers()  # "pinned" held frees: no deferral now
        return [*left, *self._take_pending()]

    def trim(self, keep: int | str = 0, *, sync: bool = True) -> int:
        """Release unused reserved host memory, keeping at least ``keep`` bytes.

        Blocks whose stream-ordered frees have completed are released first.

        Parameters
        ----------
        keep : int or str, default 0
            Reserved bytes to keep (``"1GiB"`` works too).
        sync : bool, default True
            Wait for frees still pending on streams first, so their memory is released.

        Returns
        -------
        int
            The bytes released.

        Examples
        --------
        >>> released = cupy_poolmem.PinnedPool().trim()  # doctest: +SKIP
        """
        self._release_done(wait=sync)
        return super().trim(keep, sync=sync)

    def stats(self) -> PoolStats:
        """Return a :class:`~cupy_poolmem.PoolStats` snapshot of this pool.

        Returns
        -------
        PoolStats
            Bytes used and reserved now and at their peaks, and the counts.

        Examples
        --------
        >>> cupy_poolmem.PinnedPool().stats().used_bytes  # doctest: +SKIP
        0
        """
        self._release_done()
        return super().stats()


class ManagedPool(Pool):
    """A pool of managed (unified) memory, preferring one GPU, that takes advice.

    Use :func:`cupy_poolmem.prefetch` and :func:`cupy_poolmem.advise` to place its
    arrays: both work on this pool's memory with every driver.

    Parameters
    ----------
    device : int, optional
        Preferred device (and the device whose allocator this pool serves); default
        the current device.
    max_size, release_threshold, reuse_cache : int or str, optional
        As for :class:`DevicePool`.  ``max_size`` caps the bytes live at once
        (checked by the pool itself: the driver has no cap for managed memory).
    backend : {"auto", "pool", "managed"}
        ``"pool"``: a CUDA managed memory pool (stream-ordered, CUDA 13).
        ``"managed"``: ``cuMemAllocManaged`` blocks cached for reuse, with reuse on
        another stream ordered by events.  ``"auto"`` (default) uses the pool where
        the driver takes advice on its memory, found by a one-time probe of 4 KiB
        per device, and ``"managed"`` elsewhere (driver 580 / CUDA 13.0 refuses
        advice on managed-pool memory; CUDA 12 has no managed pools).

    Attributes
    ----------
    backend : str
        ``"pool"`` or ``"managed"``, the backend in use.
    backend_reason : str
        Why: the probe's finding, or that it was asked for.

    Notes
    -----
    Hints given with :func:`advise` belong to an array: when its block is freed,
    the pool resets them (preferred location back to the pool's device, no
    read-mostly, no accessed-by) before the block serves another array.  Managed
    memory cannot be allocated during a CUDA graph capture
    (:class:`UnsupportedError`); allocate it before ``begin_capture()``.

    Examples
    --------
    >>> managed = cupy_poolmem.ManagedPool(device=0)  # doctest: +SKIP
    >>> managed.backend  # doctest: +SKIP
    'managed'
    >>> with cupy_poolmem.using(managed):  # doctest: +SKIP
    ...     x = cupy.zeros(1 << 20)
    >>> cupy_poolmem.advise(x, preferred_location=0, accessed_by=[0])  # doctest: +SKIP
    >>> cupy_poolmem.prefetch(x, device="cpu")  # doctest: +SKIP
    """

    _kind_name = "managed"

    def __init__(
        self,
        device: int | Any = None,
        max_size: int | str | None = None,
        release_threshold: int | str | None = None,
        reuse_cache: int | str = "1GiB",
        backend: str = "auto",
    ) -> None:
        from . import _managed_alloc as ma

        if not isinstance(backend, str):
            raise OptionTypeError(
                f"backend must be 'auto', 'pool' or 'managed'; got {backend!r} of type "
                f"{type(backend).__name__}"
            )
        if backend not in ("auto", "pool", "managed"):
            raise InvalidOptionError(
                f"backend={backend!r} is not one of 'auto', 'pool' (a CUDA managed memory "
                "pool) or 'managed' (cached cuMemAllocManaged blocks)"
            )
        dev = check_device(device)
        cache = parse_bytes(reuse_cache, name="reuse_cache")
        with cupy.cuda.Device(dev) as d:
            total = d.mem_info[1]
            max_b = parse_bytes(max_size, name="max_size", total=total, allow_none=True) or 0
            parse_bytes(release_threshold, name="release_threshold", allow_none=True)
            ma.require_managed_memory(dev)
            mr, reason = None, ""
            if backend == "auto":
                known = ma.recorded_choice(dev)
                missing = _cuda13_missing()
                if known is not None:
                    choice, reason = known
                elif missing:
                    choice, reason = ma.record_choice(
                        dev, "managed", f"managed memory pools need CUDA 13 ({missing})"
                    )
                else:
                    choice = "pool"
            else:
                choice, reason = backend, f"backend={backend!r} was asked for"
            if choice == "pool":
                if backend == "pool":
                    _require_cuda13("ManagedPool(backend='pool')")
                mr = _managed_resource(dev)
                if backend == "auto" and ma.recorded_choice(dev) is None:
                    ok, why = ma.probe_pool_advice(int(mr.handle), dev)
                    choice, reason = ma.record_choice(dev, "pool" if ok else "managed", why)
                    if choice != "pool":
                        _retire.retirer().retire_resource(mr, dev)  # the probe's free
                        mr = None
            self.backend = choice
            self.backend_reason = reason
            if backend == "auto" and choice != "pool":
                log.info(
                    "ManagedPool on device %d: fallback to backend %r: %s", dev, choice, reason
                )
            if mr is None:
                self._backend = ma.ManagedAllocator(dev)
            self._setup(mr, dev, _hp.KIND_MANAGED, release_threshold, max_b, cache)
            if mr is None:
                self._alloc_call = "cuMemAllocManaged"
            self._capacity = int(total)

    @property
    def memory_resource(self) -> Any:
        """The cuda.core memory resource of the ``"pool"`` backend (``None`` otherwise).

        Examples
        --------
        >>> cupy_poolmem.ManagedPool(backend="managed").memory_resource is None  # doctest: +SKIP
        True
        """
        return self._mr

    @property
    def handle(self) -> int:
        """The ``CUmemoryPool`` handle as an int (``0`` for the ``"managed"`` backend).

        Examples
        --------
        >>> cupy_poolmem.ManagedPool(backend="managed").handle  # doctest: +SKIP
        0
        """
        return 0 if self._mr is None else int(self._mr.handle)

    def _describe(self) -> str:
        return f"ManagedPool(device={self.device_id}, backend={self.backend!r})"


class _GraphFrees:
    """The retirer's poll for graph memory whose free waited for a capture to end, of a
    pool finalized meanwhile: freed on its stream (as ``_drain_capture_held`` does)
    once that stream's capture is over; dropped if the stream itself was finalized
    (destroyed: the graph and its memory go with it or stay the graph's)."""

    def __init__(self, entries: list, device: int) -> None:
        self.entries, self.device = entries, device

    def __call__(self) -> bool:
        keep = []
        with on_device(self.device), _streams.relaxed_capture_mode():
            for entry in self.entries:
                _what, ptr, _size, sptr, stream = entry
                if stream is not None and gc.is_finalized(stream):
                    continue
                if _streams.capture_status(sptr) != _streams.CAPTURE_NONE:
                    keep.append(entry)
                    continue
                _drv.cuMemFreeAsync(ptr, sptr)
        self.entries = keep
        return not keep


def _cuda13_missing() -> str:
    """Empty when managed pools are possible here, else what is missing."""
    import cuda.bindings

    drv_version = check_driver(_drv.cuDriverGetVersion(), "cuDriverGetVersion")
    major = int(cuda.bindings.__version__.split(".")[0])
    if drv_version >= 13000 and major >= 13:
        return ""
    return (
        f"driver {drv_version // 1000}.{drv_version % 1000 // 10}, "
        f"cuda-bindings {cuda.bindings.__version__}"
    )


def _managed_resource(dev: int) -> Any:
    try:
        opts = cc.ManagedMemoryResourceOptions(
            preferred_location=dev, preferred_location_type="device"
        )
        return cc.ManagedMemoryResource(opts)
    except Exception as exc:
        raise _wrap(exc, "creating a managed pool") from exc


def managed_backend(device: int | None = None) -> tuple[str, str]:
    """The backend ``ManagedPool(backend="auto")`` uses on ``device``, and why.

    Runs the one-time probe (a 4 KiB allocation from a temporary managed pool) when
    no pool on that device has yet.

    Parameters
    ----------
    device : int, optional
        Device ordinal; defaults to the current device.

    Returns
    -------
    tuple of (str, str)
        ``"pool"`` or ``"managed"``, and the reason for the choice.

    Examples
    --------
    >>> cupy_poolmem.managed_backend(0)  # doctest: +SKIP
    ('managed', 'this driver refuses advice on managed-pool memory: ...')
    """
    from . import _managed_alloc as ma

    dev = check_device(device)
    known = ma.recorded_choice(dev)
    if known is not None:
        return known
    with cupy.cuda.Device(dev):
        ma.require_managed_memory(dev)
        missing = _cuda13_missing()
        if missing:
            return ma.record_choice(
                dev, "managed", f"managed memory pools need CUDA 13 ({missing})"
            )
        mr = _managed_resource(dev)
        try:
            ok, why = ma.probe_pool_advice(int(mr.handle), dev)
        finally:
            _retire.retirer().retire_resource(mr, dev)  # after the probe's free is done
    return ma.record_choice(dev, "pool" if ok else "managed", why)


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
