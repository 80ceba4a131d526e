"""Pool: what the three pool kinds share (options, statistics, trim, close and retirement)."""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Any

import cupy

from .. import _retire, _runtime, _streams
from .._errors import (
    CUDADriverError,
    OutOfPoolMemoryError,
    PinnedOutOfMemoryError,
    PoolClosedError,
    SharingError,
    UsageError,
    WrongDeviceError,
    check_driver,
)
from .._poolstats import PoolStats
from .._runtime import hp as _hp
from .._sizes import format_bytes, parse_bytes
from . import _capture, _driver, _recycle
from ._options import check_expandable, raise_bad_size

_UINT64_MAX = 2**64 - 1
_CACHE_MAX_BLOCK = 64 << 20  # blocks above this size always go back to the CUDA pool


class Pool(_capture.CaptureMixin):
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
        owner = _recycle.Resources.owner(self._mrs, self._backend, device)
        park = _recycle.park if recycle_key is not None else None
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
        self.observer = _runtime.HOOKS.observer
        # (handle, uuid, resource) of each CUDA pool that can be shared: with a
        # small-block pool a block goes out under the uuid of the pool that holds it.
        self._ipc_pools: tuple[tuple[int, str, Any], ...] = ()
        if self._mrs and all(getattr(m, "is_ipc_enabled", False) for m in self._mrs):
            # Export the pools' handles now, not in the middle of a first send.
            for m in self._mrs:
                m.allocation_handle  # noqa: B018
            self._ipc_pools = tuple((int(m.handle), str(m.uuid), m) for m in self._mrs)
        with _runtime.registry_lock():
            _runtime.POOLS.add(self)
        if self._ipc_pools:  # sharing, installed by the public layer, hooks in here
            for cb in list(_runtime.HOOKS.ipc_pool):
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
        raise_bad_size(size, f"{self._describe()}.malloc")

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
        if err != _driver.CUDA_ERROR_OUT_OF_MEMORY:
            check_driver((_driver.drv().CUresult(err),), self._call_for(size))
        self.n_oom += 1
        self._reclaim()
        if self.soft_limit and self.live_bytes + size > self.soft_limit:
            err, ptr = _driver.CUDA_ERROR_OUT_OF_MEMORY, 0
        else:
            err, ptr = self._try_alloc(size, stream.ptr)
        if err == 0:
            return ptr
        if err != _driver.CUDA_ERROR_OUT_OF_MEMORY:
            check_driver((_driver.drv().CUresult(err),), self._call_for(size))
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
        for cb in list(_runtime.HOOKS.oom):
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
            return _driver.CUDA_ERROR_OUT_OF_MEMORY, 0
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

    def _reset_advice(self, ptr: int, size: int) -> None:
        """Only managed memory takes advice: ManagedPool resets it (see its method)."""

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
            check_expandable("auto", value, None)  # raises: the ranges keep no threshold
        for mr in self._mrs:
            _driver.set_attr(mr, _driver.A.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, v)
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
            _driver.set_attr(mr, _driver.A.CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0)
            _driver.set_attr(mr, _driver.A.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 0)
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
            check_driver(
                _driver.drv().cuMemPoolTrimTo(_driver.pool_handle(mr), keep_here), "cuMemPoolTrimTo"
            )
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
        tracked = _runtime.HOOKS.outstanding  # installed by the public layer
        if tracked is None:
            raise UsageError(
                "Pool.outstanding() needs cupy_poolmem's statistics: import cupy_poolmem "
                "(not only its private modules) first"
            )
        return tracked(self, limit=limit)

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
        with _runtime.registry_lock():
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
            _retire.retirer().after_captures(_capture.GraphFrees(graph, max(self.device_id, 0)))
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

    def __reduce__(self) -> Any:
        # A pool is this process's memory and locks: never pickled (a spawn or
        # forkserver Process's arguments, a Queue).  Its arrays travel instead.
        raise SharingError(
            f"{self._describe()} cannot be sent to another process: send arrays allocated "
            "from it (an ipc=True pool shares them without a copy), or create a pool with "
            "the same options in that process"
        )

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
            drv = _driver.drv()
            handle = check_driver(
                drv.cuPointerGetAttribute(
                    drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
                    drv.CUdeviceptr(ptr),
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
