"""Numba External Memory Management (EMM) plugin: Numba allocates from cupy_poolmem's pools.

Numba's device arrays come from the same :class:`~cupy_poolmem.DevicePool` as CuPy's
(created with ``set_allocator()``'s defaults if nobody called it), pinned arrays from
the :class:`~cupy_poolmem.PinnedPool`, and ``get_ipc_handle()`` works on pool memory
(:class:`PoolIpcHandle`).  Enable it before Numba creates its context, with
``NUMBA_CUDA_MEMORY_MANAGER=cupy_poolmem.numba`` or in code; docs/numba.rst has the
rules (streams, pinned memory, IPC).

Examples
--------
>>> from numba import cuda  # doctest: +SKIP
>>> import cupy, cupy_poolmem, cupy_poolmem.numba  # doctest: +SKIP
>>> cuda.set_memory_manager(cupy_poolmem.numba.PoolmemNumbaManager)  # doctest: +SKIP
>>> d = cuda.device_array(1000)  # doctest: +SKIP
>>> cupy.asarray(d).fill(1.0)  # zero-copy view, same pool  # doctest: +SKIP
>>> cupy_poolmem.get_pool().stats().n_allocs >= 1  # doctest: +SKIP
True
"""

from __future__ import annotations

import contextlib
import os
import uuid as _uuid
import weakref
from typing import Any

try:
    from numba.cuda import (
        GetIpcHandleMixin,
        HostOnlyCUDAMemoryManager,
        IpcHandle,
        MemoryInfo,
        MemoryPointer,
        PinnedMemory,
    )
except ImportError as _exc:  # pragma: no cover - depends on the environment
    from ._errors import MissingDependencyError

    raise MissingDependencyError(
        "cupy_poolmem.numba",
        str(_exc),
        needs="Numba's CUDA target (numba-cuda)",
        install='pip install "cupy_poolmem[numba]" (or "numba-cuda[cu13]")',
    ) from _exc

import cupy

from ._device import ensure_access, local_device, require_access, require_gpu
from ._driver import get as drv
from ._errors import (
    HandleStateError,
    SharingError,
    UsageError,
    check_driver,
)
from ._numba_memory import (
    SENT,
    Held,
    check_size,
    close_fd,
    device_pool,
    drop,
    forget,
    pinned_pool,
)
from ._pools import DevicePool, Pool, all_pools

__all__ = ["PoolmemNumbaManager", "PoolIpcHandle"]

_INTERFACE_VERSION = 1


class PoolmemNumbaManager(GetIpcHandleMixin, HostOnlyCUDAMemoryManager):
    """Numba EMM plugin backed by cupy_poolmem's device and pinned pools.

    Numba constructs one instance per CUDA context; do not instantiate it yourself.
    Register the class with :func:`numba.cuda.set_memory_manager`, or set
    ``NUMBA_CUDA_MEMORY_MANAGER=cupy_poolmem.numba``, before Numba creates its
    context.

    * ``memalloc``: a block from the device's :class:`~cupy_poolmem.DevicePool`
      (the pool :func:`cupy_poolmem.get_pool` returns; :func:`cupy_poolmem.set_allocator`
      is called on first use if nobody has called it).
    * ``memhostalloc``: a block from the :class:`~cupy_poolmem.PinnedPool` on the
      device's NUMA node; mapped or write-combined requests use ``cuMemHostAlloc``.
    * ``get_ipc_handle``: a :class:`PoolIpcHandle` (pool IPC) for pool memory; memory
      that is not from a CUDA pool keeps Numba's legacy ``cuIpcGetMemHandle`` path.
    * ``get_memory_info``: the pool's view, see :meth:`get_memory_info`.

    Parameters
    ----------
    *args, **kwargs
        What Numba passes (the CUDA context), forwarded to Numba's
        ``HostOnlyCUDAMemoryManager``.

    Examples
    --------
    >>> from numba import cuda  # doctest: +SKIP
    >>> from cupy_poolmem.numba import PoolmemNumbaManager  # doctest: +SKIP
    >>> cuda.set_memory_manager(PoolmemNumbaManager)  # doctest: +SKIP
    >>> x = cuda.to_device(numpy.arange(10))  # from the CuPy pool of device 0  # doctest: +SKIP
    """

    def initialize(self) -> None:
        """Do nothing: pools are resolved lazily (Numba calls this on every push).

        Examples
        --------
        >>> from numba import cuda  # doctest: +SKIP
        >>> cuda.set_memory_manager(PoolmemNumbaManager)  # doctest: +SKIP
        >>> cuda.current_context().memory_manager.initialize()  # doctest: +SKIP
        """

    def _device_id(self) -> int:
        if self.context is None:
            raise UsageError(
                "PoolmemNumbaManager has no CUDA context: Numba creates "
                "instances itself; register the class with "
                "numba.cuda.set_memory_manager(PoolmemNumbaManager)"
            )
        return int(self.context.device.id)

    def memalloc(self, size: int) -> MemoryPointer:
        """Allocate ``size`` bytes from the device's pool; freed when Numba drops the pointer.

        Parameters
        ----------
        size : int
            Bytes to allocate (``0``: a null pointer).

        Returns
        -------
        numba.cuda.cudadrv.driver.MemoryPointer
            The memory, in this manager's context.

        Raises
        ------
        OutOfPoolMemoryError
            The pool is full.

        Examples
        --------
        >>> from numba import cuda  # doctest: +SKIP
        >>> cuda.set_memory_manager(PoolmemNumbaManager)  # doctest: +SKIP
        >>> d = cuda.device_array(1024)  # calls memalloc  # doctest: +SKIP
        """
        size = check_size(size)
        dev = self._device_id()
        ctx = weakref.proxy(self.context)
        if size == 0:
            return MemoryPointer(ctx, drv().CUdeviceptr(0), 0)
        pool = device_pool(dev)
        mem = pool.malloc(size)  # raises OutOfPoolMemoryError when full
        ptr = int(mem.ptr)
        held = self.allocations[ptr] = Held(mem)
        guard = pool.guard
        gen = guard.generation(ptr) if guard is not None else 0
        return MemoryPointer(
            ctx,
            drv().CUdeviceptr(ptr),
            size,
            finalizer=forget(self.allocations, ptr, held, guard, gen),
        )

    def memhostalloc(
        self, size: int, mapped: bool = False, portable: bool = False, wc: bool = False
    ) -> Any:
        """Allocate pinned host memory from the :class:`~cupy_poolmem.PinnedPool`.

        Parameters
        ----------
        size : int
            Bytes to allocate.
        mapped : bool, default False
            Memory mapped into the device's address space: Numba's own
            ``cuMemHostAlloc`` serves it (pool memory cannot be mapped through
            ``cuMemHostGetDevicePointer``).
        portable : bool, default False
            Always satisfied: every visible GPU has access to the pinned pool.
        wc : bool, default False
            Write-combined memory: Numba's own ``cuMemHostAlloc`` serves it too.

        Returns
        -------
        object
            Numba's ``PinnedMemory`` (or what Numba's own allocation returns).

        Examples
        --------
        >>> from numba import cuda  # doctest: +SKIP
        >>> cuda.set_memory_manager(PoolmemNumbaManager)  # doctest: +SKIP
        >>> h = cuda.pinned_array(1024)  # calls memhostalloc  # doctest: +SKIP
        """
        size = check_size(size)
        if mapped or wc:
            return super().memhostalloc(size, mapped, portable, wc)
        dev = self._device_id()
        mem = pinned_pool(dev).malloc(size)
        return PinnedMemory(weakref.proxy(self.context), int(mem.ptr), size, finalizer=drop([mem]))

    def get_memory_info(self) -> MemoryInfo:
        """Return ``(free, total)`` as seen by the pool.

        Returns
        -------
        numba.cuda.cudadrv.driver.MemoryInfo
            ``free`` is the device's free memory plus what the pool holds reserved but
            unused (both can be handed out without a ``cudaMalloc``), capped by the
            pool's ``max_size`` headroom when it has one.  ``total`` is the device's
            memory, or the pool's ``max_size`` when that is smaller.

        Examples
        --------
        >>> from numba import cuda  # doctest: +SKIP
        >>> cuda.set_memory_manager(PoolmemNumbaManager)  # doctest: +SKIP
        >>> free, total = cuda.current_context().get_memory_info()  # doctest: +SKIP
        """
        dev = self._device_id()
        pool = device_pool(dev)
        st = pool.stats()
        with cupy.cuda.Device(dev):
            free, total = cupy.cuda.runtime.memGetInfo()
        avail = free + max(0, st.reserved_bytes - st.used_bytes)
        if pool.max_size:
            total = min(total, pool.max_size)
            avail = min(avail, max(0, pool.max_size - st.used_bytes))
        return MemoryInfo(free=min(avail, total), total=total)

    def get_ipc_handle(self, memory: Any) -> IpcHandle:
        """Export ``memory`` for another process.

        The device is synchronised first, so the allocation and the work enqueued so
        far are complete before the handle exists.

        Parameters
        ----------
        memory : numba.cuda.cudadrv.driver.MemoryPointer
            Device memory of this context.

        Returns
        -------
        numba.cuda.cudadrv.driver.IpcHandle
            A :class:`PoolIpcHandle` for pool memory; Numba's legacy handle for memory
            not from a CUDA pool (``cudaMalloc``).

        Raises
        ------
        SharingError
            The memory is from a pool that is not IPC-enabled (``set_allocator(ipc=False)``),
            from a CUDA pool that cupy_poolmem does not own, or a block of a
            ``DevicePool(large_blocks="mapped" or "expandable")``, which is in no CUDA
            pool (send the CuPy array through ``multiprocessing`` instead).

        Examples
        --------
        >>> from numba import cuda  # doctest: +SKIP
        >>> cuda.set_memory_manager(PoolmemNumbaManager)  # doctest: +SKIP
        >>> handle = cuda.device_array(1024).get_ipc_handle()  # doctest: +SKIP
        """
        base, alloc_size = self._find_allocation(memory)
        pool_handle = _pointer_pool(base)
        if pool_handle == 0:
            for p in all_pools():  # a mapped or expandable block is in no CUDA pool
                if isinstance(p, DevicePool) and p._backend is not None and p._backend.owns(base):
                    p._ipc_pool_of(base)  # raises SharingError naming the way out
            return GetIpcHandleMixin.get_ipc_handle(self, memory)
        pool = next((p for p in all_pools() if p._owns_handle(pool_handle) and not p.closed), None)
        if pool is None:
            raise SharingError(
                f"cannot export pointer 0x{base:x}: it comes from a CUDA memory pool that "
                "cupy_poolmem does not own (only cupy_poolmem pools and cudaMalloc memory "
                "can be shared from Numba)"
            )
        check_driver(drv().cuCtxSynchronize(), "cuCtxSynchronize")
        source_info = self.context.device.get_device_identity()
        return PoolIpcHandle._export(
            pool, memory, base, alloc_size, int(memory.handle) - base, source_info, pool_handle
        )

    def _find_allocation(self, memory: Any) -> tuple[int, int]:
        """Base pointer and size of the allocation that ``memory`` (maybe a view) is in."""
        owner = getattr(memory, "owner", None)
        ptr = getattr(owner, "device_pointer_value", None)
        if owner is not None and ptr is not None and int(ptr) in self.allocations:
            return int(ptr), int(owner.size)
        d = drv()
        err, base, size = d.cuMemGetAddressRange(d.CUdeviceptr(int(memory.handle)))
        check_driver((err,), "cuMemGetAddressRange")
        return int(base), int(size)

    def reset(self) -> None:
        """Free every allocation Numba made in this context (Numba's ``reset`` semantics).

        Examples
        --------
        >>> from numba import cuda  # doctest: +SKIP
        >>> cuda.current_context().reset()  # doctest: +SKIP
        """
        super().reset()

    @property
    def interface_version(self) -> int:
        """The EMM interface version implemented (1).

        Examples
        --------
        >>> from numba import cuda  # doctest: +SKIP
        >>> cuda.set_memory_manager(PoolmemNumbaManager)  # doctest: +SKIP
        >>> cuda.current_context().memory_manager.interface_version  # doctest: +SKIP
        1
        """
        return _INTERFACE_VERSION


def _pointer_pool(ptr: int) -> int:
    """The ``CUmemoryPool`` of a device pointer as an int, ``0`` when not from a pool."""
    d = drv()
    err, pool = d.cuPointerGetAttribute(
        d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, d.CUdeviceptr(ptr)
    )
    if int(err) != 0:
        return 0
    return int(pool) if pool is not None else 0


# --------------------------------------------------------------------------------------
# Pool IPC for Numba handles
# --------------------------------------------------------------------------------------
# The receiving process maps through the sharing package's one importer: each exporter
# CUDA pool is imported once (by pool UUID) and each allocation once (by export record),
# whether it arrives as a Numba handle or as a shared CuPy array; importing one
# allocation twice in a process breaks the first import.


def _sharing_context() -> Any:
    """This process's sharing context (its importer maps the handles' allocations)."""
    # Loaded late: importing the sharing package hooks it into the pools and pickling,
    # which a process using the plugin without pool IPC does not need.
    from ._sharing import context

    return context()


def _importer() -> Any:
    return _sharing_context().importer


class PoolIpcHandle(IpcHandle):
    """A Numba IPC handle for memory in an IPC-enabled cupy_poolmem pool.

    Created by ``device_array.get_ipc_handle()`` under :class:`PoolmemNumbaManager`
    (wrapped in Numba's ``IpcArrayHandle``).  Send it to another process on the same
    host, then ``open()``/``close()`` it there, or use it as a context manager::

        with handle as array:   # in the receiving process
            ...

    How it travels
        Pickling duplicates the pool's shareable handle (a file descriptor) through
        :func:`multiprocessing.reduction.DupFd`: inside ``multiprocessing`` (``Queue``,
        ``Pipe``, ``Pool``, ``Process`` arguments) the descriptor is passed over a Unix
        socket (``SCM_RIGHTS``).  The receiver must be a process of the same
        ``multiprocessing`` family (same authentication key), and the sender must be
        alive when the receiver unpickles.  The allocation itself travels as a 64-byte
        export record plus an offset.

    In the receiving process
        Each of the exporter's CUDA pools is imported once per process (cached by pool
        UUID) and each allocation once (cached by export record, reference-counted across
        handles): importing one allocation twice would break the first import.
        ``open()`` returns a Numba device pointer on the exporter's GPU (found by
        UUID, so ``CUDA_VISIBLE_DEVICES`` may differ between processes).  Opened in a
        context on another GPU, it first grants that GPU access to the imported pool
        (once per pool and GPU: an imported pool is mapped on its own GPU only);
        :class:`~cupy_poolmem.UnsupportedError` names both GPUs when they cannot
        access each other.  ``close()``
        frees the import, stream-ordered on the legacy default stream, and waits for
        it, so once ``close()`` returns the exporter may free the memory.

    Lifetime rule (CUDA's)
        Every importer must ``close()`` before the exporter frees the allocation.
        The exporting process's handle keeps the array alive (like Numba's own
        handles); keep it until the consumers are done.  Synchronise before telling
        the other side that data is ready.

    Trust boundary
        Unpickling a handle runs ``pickle`` (which can execute code) and makes this
        process import memory described by the sender.  Only unpickle handles from
        trusted, cooperating processes on the same host.

    Parameters
    ----------
    base : object
        The exported device memory (Numba's ``IpcHandle`` base), ``None`` once received.
    pool_uuid : uuid.UUID
        The exporter's CUDA pool.
    device_uuid : str
        The exporter's GPU, by UUID.
    payload : bytes
        The allocation's 64-byte export record.
    alloc_size : int
        Bytes of the whole allocation.
    size : int
        Bytes of the array the handle gives.
    offset : int, optional
        Offset of the array in the allocation.
    base_ptr : int, optional
        The allocation's address in the exporter.
    source_info : dict, optional
        Numba's description of the array's context.
    export_fd : int, optional
        Exporter: the pool's shareable handle (owned by the pool).
    received_fd : int, optional
        Receiver: the duplicated descriptor, closed once the pool is imported.
    pid : int, optional
        The exporting process (default: this one).
    keepalive : object, optional
        Exporter: what keeps the allocation alive while the handle exists.

    Examples
    --------
    >>> h = device_array.get_ipc_handle()  # exporter  # doctest: +SKIP
    >>> queue.put(h)  # doctest: +SKIP
    >>> h = queue.get()  # receiver  # doctest: +SKIP
    >>> with h as arr:  # doctest: +SKIP
    ...     host = arr.copy_to_host()
    """

    def __init__(
        self,
        base: Any,
        *,
        pool_uuid: _uuid.UUID,
        device_uuid: str,
        payload: bytes,
        alloc_size: int,
        size: int,
        offset: int = 0,
        base_ptr: int = 0,
        source_info: dict | None = None,
        export_fd: int | None = None,
        received_fd: int | None = None,
        pid: int | None = None,
        keepalive: Any = None,
    ) -> None:
        super().__init__(base, payload, size, source_info, offset=offset)
        self.pool_uuid = pool_uuid
        self.device_uuid = device_uuid
        self.payload = bytes(payload)
        self.alloc_size = int(alloc_size)
        self.base_ptr = int(base_ptr)
        self.pid = os.getpid() if pid is None else int(pid)
        self._export_fd = export_fd  # exporter: the pool's fd (owned by the pool)
        self._keepalive = keepalive  # exporter: the cuda.core allocation handle
        self._fd = received_fd  # receiver: our duplicate, until the pool is imported
        self._fd_finalizer = (
            weakref.finalize(self, close_fd, received_fd) if received_fd is not None else None
        )
        self._rec: Any = None  # the importer's mapping while open
        self._local = False

    # -- exporting -------------------------------------------------------------------
    @classmethod
    def _export(
        cls,
        pool: Pool,
        base: Any,
        base_ptr: int,
        alloc_size: int,
        offset: int,
        source_info: dict | None,
        pool_handle: int = 0,
    ) -> PoolIpcHandle:
        """A handle for ``base_ptr`` of ``pool`` (``pool_handle``: its CUDA pool, when
        the caller has asked the driver already)."""
        import cuda.core as cc

        if not isinstance(pool, DevicePool):
            raise SharingError(f"{pool!r}: only device pools can be shared through Numba")
        if not getattr(pool, "ipc", False):
            raise SharingError(
                f"{pool!r} is not IPC-enabled, so its memory cannot be shared with other "
                "processes; create it with ipc=True (cupy_poolmem.set_allocator() does by "
                "default) before Numba allocates"
            )
        # The CUDA pool that holds the block: a DevicePool may have two (small_pool).
        uuid_str, mr = pool._ipc_pool_of(base_ptr, pool_handle)
        try:
            ah = mr.allocation_handle
            ah = ah() if callable(ah) else ah
            pool_uuid = _uuid.UUID(uuid_str)
            fd = int(ah)
        except Exception as exc:
            raise SharingError(
                f"{pool!r}: could not get the pool's shareable handle: {exc}"
            ) from exc
        d = drv()
        data = check_driver(
            d.cuMemPoolExportPointer(d.CUdeviceptr(base_ptr)), "cuMemPoolExportPointer"
        )
        return cls(
            base,
            pool_uuid=pool_uuid,
            device_uuid=str(cc.Device(pool.device_id).uuid),
            payload=bytes(data.reserved),
            alloc_size=alloc_size,
            size=int(base.size),
            offset=offset,
            base_ptr=base_ptr,
            source_info=source_info,
            export_fd=fd,
            keepalive=ah,
        )

    def __reduce__(self) -> tuple:
        if self._export_fd is None:
            raise SharingError(
                "this PoolIpcHandle was received from another process and cannot be "
                "forwarded; send a handle made in the exporting process"
            )
        from multiprocessing.reduction import DupFd

        timeout = _sharing_context().settings.inflight_timeout
        if timeout is not None:
            SENT.close(older_than=timeout)
        try:
            dup = DupFd(self._export_fd)
        except OSError as exc:
            raise SharingError(
                f"the exporting pool's file descriptor is unusable (was the pool closed?): {exc}"
            ) from exc
        SENT.add(dup)
        return (
            _rebuild_pool_ipc_handle,
            (
                dup,
                str(self.pool_uuid),
                self.device_uuid,
                self.payload,
                self.alloc_size,
                self.size,
                self.offset,
                self.base_ptr,
                self.source_info,
                self.pid,
            ),
        )

    # -- importing -------------------------------------------------------------------
    def open(self, context: Any) -> MemoryPointer:
        """Import the memory into ``context`` (a Numba context) and return a device pointer.

        Parameters
        ----------
        context : numba.cuda.cudadrv.driver.Context
            The context to map the memory in.

        Returns
        -------
        numba.cuda.cudadrv.driver.MemoryPointer
            The exporter's allocation, mapped here.

        Raises
        ------
        HandleStateError
            In the exporting process's own handle, or when already open (a
            :class:`ValueError` too, as Numba's ``IpcHandle`` raises).
        SharingError
            The exporter's GPU is not visible here, or the import failed.
        UnsupportedError
            The context's GPU cannot access the exporter's GPU (both are named).
        WrongDeviceError
            Unpickled in the exporting process, on a GPU the pool grants no access.

        Examples
        --------
        >>> from numba import cuda  # doctest: +SKIP
        >>> handle = queue.get()._ipc_handle  # an IpcArrayHandle's, received  # doctest: +SKIP
        >>> ptr = handle.open(cuda.current_context())  # doctest: +SKIP
        >>> handle.close()  # doctest: +SKIP
        """
        if self.base is not None:
            raise HandleStateError(
                "opening a PoolIpcHandle in the process that exported it; use the original array"
            )
        if self._rec is not None or self._local:
            raise HandleStateError("PoolIpcHandle is already opened")
        require_gpu("PoolIpcHandle.open")
        ctx_dev = int(context.device.id)
        if self.pid == os.getpid():
            local, handle = next(
                (
                    (p, h)
                    for p in all_pools()
                    if getattr(p, "ipc", False)
                    and not p.closed
                    and (h := _pool_uuids(p).get(self.pool_uuid))
                ),
                (None, 0),
            )
            if local is not None:  # unpickled in the exporting process: no import needed
                if ctx_dev != local.device_id:  # the pool's own grants decide; say so now
                    require_access(handle, local.device_id, ctx_dev, repr(local))
                self._release_fd()
                self._local = True
                return MemoryPointer(
                    weakref.proxy(context),
                    drv().CUdeviceptr(self.base_ptr + self.offset),
                    self.size,
                )
        dev = local_device(self.device_uuid)
        try:
            rec = _importer().open_raw(
                str(self.pool_uuid),
                dev,
                self.payload,
                self.alloc_size,
                self._fd,
                (int(self.offset), int(self.size)),
            )
        except SharingError:
            raise
        except Exception as exc:
            raise SharingError(f"importing the exporter's memory failed: {exc}") from exc
        finally:
            self._release_fd()
        self._rec = rec
        if ctx_dev != dev:  # an imported pool is mapped on its own GPU only
            ensure_access(rec.pool.handle, ctx_dev, dev)
        mp = MemoryPointer(
            weakref.proxy(context), drv().CUdeviceptr(rec.ptr + self.offset), self.size
        )
        mp._cupy_poolmem_import = rec  # type: ignore[attr-defined]  # informative; the import ends at close()
        return mp

    def open_direct(self, context: Any) -> MemoryPointer:
        """Do as :meth:`open` does (Numba's two ways of opening are one here).

        Parameters
        ----------
        context : numba.cuda.cudadrv.driver.Context
            The context to map the memory in.

        Returns
        -------
        numba.cuda.cudadrv.driver.MemoryPointer
            The exporter's allocation, mapped here.

        Examples
        --------
        >>> from numba import cuda  # doctest: +SKIP
        >>> handle = queue.get()._ipc_handle  # an IpcArrayHandle's, received  # doctest: +SKIP
        >>> ptr = handle.open_direct(cuda.current_context())  # doctest: +SKIP
        >>> handle.close()  # doctest: +SKIP
        """
        return self.open(context)

    def open_staged(self, context: Any) -> MemoryPointer:
        """Do as :meth:`open` does (Numba's two ways of opening are one here).

        Parameters
        ----------
        context : numba.cuda.cudadrv.driver.Context
            The context to map the memory in.

        Returns
        -------
        numba.cuda.cudadrv.driver.MemoryPointer
            The exporter's allocation, mapped here.

        Examples
        --------
        >>> from numba import cuda  # doctest: +SKIP
        >>> handle = queue.get()._ipc_handle  # an IpcArrayHandle's, received  # doctest: +SKIP
        >>> ptr = handle.open_staged(cuda.current_context())  # doctest: +SKIP
        >>> handle.close()  # doctest: +SKIP
        """
        return self.open(context)

    def close(self) -> None:
        """Release this handle's import; the memory is freed when no open handle names it.

        The free is enqueued on the legacy default stream and waited for, so when
        ``close()`` returns the exporter may free the allocation.

        Examples
        --------
        >>> from numba import cuda  # doctest: +SKIP
        >>> handle = queue.get()._ipc_handle  # an IpcArrayHandle's, received  # doctest: +SKIP
        >>> ptr = handle.open(cuda.current_context())  # doctest: +SKIP
        >>> handle.close()  # doctest: +SKIP
        """
        if self._local:
            self._local = False
            return
        rec = self._rec
        if rec is None:
            raise HandleStateError("PoolIpcHandle is not opened")
        self._rec = None
        _importer().close_raw(rec)

    def _release_fd(self) -> None:
        if self._fd_finalizer is not None:
            self._fd_finalizer()  # closes our duplicate of the pool's descriptor
            self._fd_finalizer = None
        self._fd = None

    def __repr__(self) -> str:
        state = "open" if (self._rec is not None or self._local) else "closed"
        side = "exporter" if self.base is not None else "receiver"
        return (
            f"<PoolIpcHandle {side} pool={self.pool_uuid} size={self.size} "
            f"offset={self.offset} {state}>"
        )


def _pool_uuids(pool: Pool) -> dict[_uuid.UUID, int]:
    """uuid -> handle of ``pool``'s shareable CUDA pools (two with a small-block pool)."""
    with contextlib.suppress(Exception):
        return {_uuid.UUID(u): h for h, u, _ in pool._ipc_pools}
    return {}


def _rebuild_pool_ipc_handle(
    dup: Any,
    pool_uuid: str,
    device_uuid: str,
    payload: bytes,
    alloc_size: int,
    size: int,
    offset: int,
    base_ptr: int,
    source_info: dict | None,
    pid: int,
) -> PoolIpcHandle:
    try:
        fd = dup.detach()
    except Exception as exc:
        raise SharingError(
            "could not receive the exporting pool's file descriptor; a PoolIpcHandle must "
            "travel between processes of one multiprocessing family on the same host "
            "(Queue, Pipe, Pool, Process arguments) while the sender is alive, and be "
            "received within cupy_poolmem.sharing.inflight_timeout of pickling (the "
            f"descriptor's duplicate is closed then): {exc}"
        ) from exc
    u = _uuid.UUID(pool_uuid)
    if str(u) in _importer().pools:
        # This process has the pool already: the duplicate descriptor is spare.
        close_fd(fd)
        fd = None
    return PoolIpcHandle(
        None,
        pool_uuid=u,
        device_uuid=device_uuid,
        payload=payload,
        alloc_size=alloc_size,
        size=size,
        offset=offset,
        base_ptr=base_ptr,
        source_info=source_info,
        received_fd=fd,
        pid=pid,
    )


# NUMBA_CUDA_MEMORY_MANAGER=cupy_poolmem.numba looks this name up.
_numba_memory_manager = PoolmemNumbaManager
