"""The driver operations the sharing protocol uses, behind one small object.

The exporter and importer never call ``cuda.bindings`` themselves: they call a
:class:`Driver`, which asks the package's provider (``cupy_poolmem._driver``) for it at
each call.  The CPU test suite passes a fake with the same methods (see
``tests/fakes/sharing.py``), so every protocol path runs without a GPU; the GPU suite
runs the same code against this class.

Handles are plain Python values: pointers and streams are ints, export records and
IPC event handles are ``bytes`` (64 bytes each), opened events and pool handles are
opaque objects only the driver interprets.
"""

from __future__ import annotations

import threading
from typing import Any

from .. import _driver as provider
from .._device import (
    can_access_peer,
    device_count,
    device_uuid,
    ensure_peer_access,
    forget_access,
    local_device,
    on_device,
)
from .._errors import check_driver
from .._streams import CAPTURE_NONE, capture_status, relaxed_capture_mode
from ._wire import POOL_PINNED

__all__ = ["Driver"]

_NOT_READY = 600  # CUDA_ERROR_NOT_READY


class Driver:
    """CUDA driver calls for pool IPC, with the process's event caches.

    One instance per process (owned by the sharing context).  Thread-safe: the
    caches are guarded by one lock, and CUDA calls are made with the right device
    current through :meth:`on_device`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (device, stream) -> (CUevent, handle bytes): re-recorded for each message, so a
        # receiver that waits after a later re-record waits for more work, never less.
        self._ipc_events: dict[tuple[int, int], tuple[Any, bytes]] = {}
        self._get_stream: Any = None  # cupy.cuda.get_current_stream, once imported

    @property
    def _d(self) -> Any:
        """The package's driver (``cuda.bindings.driver`` unless a test handed in another)."""
        return provider.get()

    @property
    def _ipc_flags(self) -> Any:
        flags = self._d.CUevent_flags
        return flags.CU_EVENT_INTERPROCESS | flags.CU_EVENT_DISABLE_TIMING

    @property
    def _plain_flags(self) -> Any:
        return self._d.CUevent_flags.CU_EVENT_DISABLE_TIMING

    # -- devices ------------------------------------------------------------------------
    def on_device(self, dev: int) -> on_device:
        """A context manager making ``dev`` current (primary context bound)."""
        return on_device(dev)

    def device_uuid(self, dev: int) -> str:
        return device_uuid(dev)

    def local_device(self, uuid: str) -> int:
        return local_device(uuid)

    def current_device(self) -> int:
        import cupy

        return int(cupy.cuda.runtime.getDevice())

    def current_stream(self) -> Any:
        """CuPy's current stream object in this thread."""
        get = self._get_stream
        if get is None:
            import cupy

            get = self._get_stream = cupy.cuda.get_current_stream
        return get()

    # -- allocations ----------------------------------------------------------------------
    def export_pointer(self, ptr: int) -> bytes:
        """The 64-byte export record of a pool allocation."""
        data = check_driver(self._d.cuMemPoolExportPointer(ptr), "cuMemPoolExportPointer")
        return bytes(data.reserved)

    def import_pool(self, fd: int, kind: int, dev: int) -> tuple[int, Any]:
        """Import an exporter's pool from its file descriptor: ``(handle, keepalive)``.

        ``keepalive`` is the cuda.core resource that owns the imported pool; the caller
        keeps it as long as any mapping of the pool exists.  The descriptor is not closed.
        """
        import cuda.core as cc

        if kind == POOL_PINNED:
            mr = cc.PinnedMemoryResource.from_allocation_handle(fd)
        else:
            mr = cc.DeviceMemoryResource.from_allocation_handle(dev, fd)
        return int(mr.handle), mr

    def grant_peers(self, pool_handle: int, owner: int) -> None:
        """Let every GPU that can access ``owner``'s memory use an imported pool (once).

        An imported pool is mapped on its own GPU only; a received array may be used
        from any GPU CuPy lets read it (``owner=-1``: a host pool).
        """
        if device_count() > 1:
            ensure_peer_access(pool_handle, owner)

    def forget_pool(self, pool_handle: int) -> None:
        """The imported pool is closed: forget what was granted on it."""
        forget_access(pool_handle)

    def close_pool(self, keepalive: Any) -> None:
        """Let go of an imported pool (no mapping of it is left)."""
        try:
            keepalive.close()
        except Exception:
            pass

    def import_pointer(self, pool_handle: int, data: bytes) -> int:
        share = self._d.CUmemPoolPtrExportData()
        share.reserved = data
        ptr = check_driver(
            self._d.cuMemPoolImportPointer(self._d.CUmemoryPool(pool_handle), share),
            "cuMemPoolImportPointer",
        )
        return int(ptr)

    # -- steps of mapped and expandable pools ---------------------------------------------
    def vmm(self) -> Any:
        """The driver module the steps' export, import and mapping use (``cuda.bindings``'
        unless a test handed in another): :mod:`~cupy_poolmem._sharing._steps` calls it."""
        return self._d

    def step_peers(self, dev: int) -> tuple[int, ...]:
        """The GPUs given access to another process's steps mapped here on ``dev``: every
        visible GPU that can access ``dev``'s memory, as an imported pool grants."""
        return tuple(p for p in range(device_count()) if p != dev and can_access_peer(p, dev))

    def free_async(self, ptr: int, stream: int) -> None:
        check_driver(self._d.cuMemFreeAsync(ptr, stream), "cuMemFreeAsync")

    # -- streams and events ---------------------------------------------------------------
    def record_ipc_event(self, dev: int, stream: int) -> tuple[Any, bytes]:
        """Record this process's IPC event of ``(dev, stream)`` on ``stream``.

        Returns ``(event, handle)``: the event for this process's own waits, the
        64-byte handle for other processes.
        """
        key = (dev, stream)
        ent = self._ipc_events.get(key)
        if ent is None:
            with self._lock:
                ent = self._ipc_events.get(key)
                if ent is None:
                    ev = check_driver(self._d.cuEventCreate(self._ipc_flags), "cuEventCreate")
                    h = check_driver(self._d.cuIpcGetEventHandle(ev), "cuIpcGetEventHandle")
                    ent = self._ipc_events[key] = (ev, bytes(h.reserved))
        check_driver(self._d.cuEventRecord(ent[0], stream), "cuEventRecord")
        return ent

    def sync_own_events(self) -> None:
        """Wait on the host for the work every IPC event of this process covers."""
        for ev, _ in list(self._ipc_events.values()):
            self._d.cuEventSynchronize(ev)

    def open_event(self, handle: bytes) -> Any:
        """Open a peer's IPC event (the caller caches it and closes it with :meth:`close_event`)."""
        h = self._d.CUipcEventHandle()
        h.reserved = handle
        return check_driver(self._d.cuIpcOpenEventHandle(h), "cuIpcOpenEventHandle")

    def close_event(self, ev: Any) -> None:
        self._d.cuEventDestroy(ev)

    def wait_event(self, stream: int, ev: Any) -> None:
        """Make ``stream`` wait, on the device, for the work ``ev`` covers."""
        check_driver(self._d.cuStreamWaitEvent(stream, ev, 0), "cuStreamWaitEvent")

    def sync_event(self, ev: Any) -> None:
        """Wait on the host for the work ``ev`` covers."""
        check_driver(self._d.cuEventSynchronize(ev), "cuEventSynchronize")

    def plain_event(self, stream: int, ev: Any = None) -> Any:
        """Record a plain (process-local) event on ``stream``; reuses ``ev`` when given."""
        if ev is None:
            ev = check_driver(self._d.cuEventCreate(self._plain_flags), "cuEventCreate")
        check_driver(self._d.cuEventRecord(ev, stream), "cuEventRecord")
        return ev

    def event_done(self, ev: Any) -> bool:
        """Whether the work ``ev`` covers has finished (no wait).

        Any answer but "not ready" counts as finished: after a sticky context error (an
        illegal address, say) that work never runs, and a caller polling for it would
        poll for ever; the next synchronising call reports the error by name.
        """
        (err,) = self._d.cuEventQuery(ev)
        return int(err) != _NOT_READY

    def relaxed(self) -> Any:
        """A context manager: this thread may query, wait on and destroy while another
        thread captures a graph in global mode (those calls would otherwise fail and
        invalidate that capture)."""
        return relaxed_capture_mode()

    def sync_stream(self, stream: int) -> None:
        check_driver(self._d.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def is_capturing(self, stream: int) -> bool:
        """Whether work on ``stream`` must wait for a graph capture (frees must wait).

        The pools' rule (:func:`cupy_poolmem._streams.capture_status`): a stream being
        captured, or one the driver will not touch because a capture is under way.
        """
        return capture_status(stream) != CAPTURE_NONE
