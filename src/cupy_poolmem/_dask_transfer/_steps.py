"""The steps of a transfer that touch the GPU and the sharing package.

:class:`GpuSteps` is what the serializers, the refetch and the meetings call for them:
the process's :class:`~._process.TransferState` holds one (``gpu``), made when the path is
installed on a worker; a test hands the state a fake with the same methods.  This
module imports the sharing package (which hooks into the pools and pickling), so
only ``install`` loads it: a client or scheduler importing ``cupy_poolmem.dask`` never
does.
"""

from __future__ import annotations

import time
from typing import Any

import cupy

from .. import _runtime
from .._allocator import get_pool
from .._device import device_count, device_uuid
from .._errors import SharingError
from .._sharing import context
from .._sharing._reducers import _owner as owner_of
from .._sharing._reducers import _shareable as shareable
from .._sharing._reducers import array_on, describe, rebuild, receive
from .._sharing._wire import step_block
from ._header import make_header
from ._process import TransferState
from ._receiver import first_steps, refetch
from ._warm import MiB, warm_sizes

__all__ = ["GpuSteps"]


class GpuSteps:
    """The GPU and sharing steps of this worker's transfers (``state``: the process's
    transfer state, read for the worker's GPU, config, address and counters)."""

    def __init__(self, state: TransferState) -> None:
        self.state = state

    def sharing(self) -> Any:
        """The process's sharing context."""
        return context()

    def device_uuids(self) -> list[str]:
        """The UUIDs of the GPUs this process sees."""
        return [device_uuid(i) for i in range(device_count())]

    def refetch(self, sender: str, header: dict, cause: BaseException) -> Any:
        """The chunk of ``header`` asked again from ``sender`` (Dask's serialization)."""
        return refetch(sender, header, cause)

    def facts(self, x: Any) -> tuple[bool, str]:
        """``(shareable, device_uuid)`` of a CuPy array's memory."""
        owner = owner_of(x.data.mem)
        return owner is not None and shareable(owner), device_uuid(x.device.id)

    def export(self, x: Any) -> tuple:
        """The sharing descriptor of a new message for ``x`` (contiguous), ticket registered."""
        owner = owner_of(x.data.mem)
        offset = x.data.ptr - owner.ptr
        return describe(context(), owner, "cupy", offset, x.shape, x.strides, x.dtype.str)

    def contiguous(self, x: Any) -> Any:
        """``x``, or a C-contiguous copy on its GPU (from the worker's pool)."""
        if x.flags.c_contiguous or x.flags.f_contiguous:
            return x
        with cupy.cuda.Device(x.device.id):
            return cupy.ascontiguousarray(x)

    def allocator_replaced(self) -> str | None:
        """A description of CuPy's current allocator when it is no longer the one
        cupy_poolmem installed (RMM's, set after the plugin ran...); else None."""
        mine = _runtime.installed_allocator("device")
        cur = cupy.cuda.get_allocator()
        if mine is None or cur is mine:
            return None
        owner = getattr(cur, "__self__", None)
        mod = type(owner).__module__ if owner is not None else getattr(cur, "__module__", None)
        name = getattr(cur, "__qualname__", None) or type(cur).__qualname__
        return f"{mod or '?'}.{name}"

    def local_array(self, d: Any) -> Any:
        """The array ``d`` describes, read in the process that sent it (None if gone)."""
        try:
            return rebuild(d)  # the ticket is live (or was claimed): the sharing round trip
        except SharingError:
            pass
        ctx = context()
        if ctx.exporter_address() != d.address:
            return None
        hold = ctx.exporter.hold_live(d.export_id, d.export_data, d.life)
        if hold is None or hold.size != d.size:  # the header names bytes outside the block
            return None
        return array_on(hold, d, hold.rec.dev)

    def worker_device(self) -> Any:
        """A context manager making the worker's GPU current (CuPy's ``Device``)."""
        return cupy.cuda.Device(self.state.device)

    def receive(self, d: Any, step: str = "receive") -> tuple[Any, str]:
        """Map the block of ``d``: ``(array, "view" | "copy")`` on this worker's GPU.

        The seconds each step took go to the counters' ``timings``: ``<step>.<kind>``
        (:func:`first_steps`; ``step`` is ``"receive"`` for a chunk, ``"warm"`` for a
        meeting's block, so ``receive.first-contact`` counts chunks only) and ``copy``
        (the device-to-device copy from another GPU).
        """
        ctx = context()
        counters = self.state.counters
        kind = first_steps(ctx, d, steps=step_block(d.export_data) is not None)
        t0 = time.perf_counter()
        owner, dev = receive(ctx, d)
        counters.timed(f"{step}.{kind}", time.perf_counter() - t0)
        view = array_on(owner, d, dev)
        mine = self.state.device
        if dev == mine:
            return view, "view"
        t0 = time.perf_counter()
        try:
            with self.worker_device():
                order = "F" if view.flags.f_contiguous and not view.flags.c_contiguous else "C"
                out = cupy.empty(view.shape, view.dtype, order=order)
                stream = cupy.cuda.get_current_stream()
                # One device-to-device copy; CuPy enables peer access between the two GPUs
                # where they allow it, and the imported pool was granted to this GPU.
                out.data.copy_from_device_async(view.data, view.nbytes, stream)
                stream.synchronize()  # done before the mapping goes, ready on every stream
        finally:
            del view, owner  # the mapping is let go now (unmapped, lease returned)
        counters.timed("copy", time.perf_counter() - t0)
        return out, "copy"

    def pool_small_limit(self) -> int:
        """The worker's pool's small-block limit (0: none, or no pool)."""
        try:
            return int(getattr(get_pool(), "small_pool", 0) or 0)
        except Exception:  # noqa: BLE001 - no pool: the one size
            return 0

    def export_blocks(self) -> list[dict[str, Any]]:
        """Headers of fresh blocks of this worker's pool (their tickets registered); the
        blocks go back to the pool once the peer has claimed (or dropped) them."""
        st = self.state
        cfg = st.config
        min_bytes = cfg.min_bytes if cfg is not None else MiB
        headers = []
        with cupy.cuda.Device(st.device):
            for n in warm_sizes(self.pool_small_limit(), min_bytes):
                x = cupy.empty(n, dtype="u1")
                if not self.facts(x)[0]:
                    continue  # not IPC memory: nothing to meet
                headers.append(make_header(tuple(self.export(x)), st.address or ""))
        return headers
