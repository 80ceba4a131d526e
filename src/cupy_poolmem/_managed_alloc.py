"""The two backends of ``ManagedPool`` and the probe that chooses between them.

``"pool"``: a CUDA managed memory pool (``cuMemAllocFromPoolAsync``, CUDA 13).  Some
drivers (580 / CUDA 13.0) refuse every ``cuMemAdvise`` on memory from such a pool
with ``CUDA_ERROR_NOT_SUPPORTED``.

``"managed"``: :class:`ManagedAllocator`, blocks from ``cuMemAllocManaged`` kept for
reuse.  Advice and prefetch work on them with any driver that has managed memory.
``cuMemAllocManaged`` is slow and may synchronise, so freed blocks are cached by
size (``_block_cache.py``): a block is reused at once on the stream that freed it
(stream order covers it), and on another stream only once an event recorded at its
free has completed.  The pool's own reuse cache sits in front of this one, as for
the other backends.

The probe (once per device and process) allocates 4 KiB from the pool it is about
to use and asks for the hints ``advise`` gives; a refusal selects ``"managed"``.
"""

from __future__ import annotations

import threading
from typing import Any

from . import _device
from ._block_cache import BlockCache
from ._errors import check_driver, error_name

__all__ = ["ManagedAllocator", "probe_pool_advice", "recorded_choice", "record_choice"]

_GRANULE = 4096  # sizes are rounded up to pages: blocks of one class serve each other

_choices: dict[int, tuple[str, str]] = {}  # device -> (backend, reason)
_choices_lock = threading.Lock()


def _drv() -> Any:
    from cuda.bindings import driver

    return driver


def recorded_choice(device: int) -> tuple[str, str] | None:
    """The backend the probe chose for ``device`` in this process, with its reason."""
    return _choices.get(device)


def record_choice(device: int, backend: str, reason: str) -> tuple[str, str]:
    with _choices_lock:
        return _choices.setdefault(device, (backend, reason))


def _device_location(device: int) -> Any:
    drv = _drv()
    loc = drv.CUmemLocation()
    loc.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    loc.id = device
    return loc


def mem_advise(ptr: int, size: int, advice: Any, device: int) -> int:
    """``cuMemAdvise`` toward ``device`` with the signature of this cuda-bindings; CUresult."""
    drv = _drv()
    import cuda.bindings

    if int(cuda.bindings.__version__.split(".")[0]) >= 13:
        (res,) = drv.cuMemAdvise(ptr, size, advice, _device_location(device))
    elif hasattr(drv, "cuMemAdvise_v2"):
        (res,) = drv.cuMemAdvise_v2(ptr, size, advice, _device_location(device))
    else:  # pragma: no cover - old 12.x bindings
        (res,) = drv.cuMemAdvise(ptr, size, advice, device)
    return int(res)


def probe_pool_advice(pool_handle: int, device: int) -> tuple[bool, str]:
    """Whether the driver takes placement advice on memory from the managed pool.

    Allocates 4 KiB from the pool (nothing near the GPU's free memory), gives it the
    pool's own preferred location and read-mostly on then off, and frees it.
    """
    drv = _drv()
    A = drv.CUmem_advise
    err, ptr = drv.cuMemAllocFromPoolAsync(_GRANULE, drv.CUmemoryPool(pool_handle), 0)
    if int(err):
        return False, f"probe allocation failed ({error_name(int(err))})"
    try:
        check_driver(drv.cuStreamSynchronize(0), "cuStreamSynchronize")
        for advice in (
            A.CU_MEM_ADVISE_SET_PREFERRED_LOCATION,
            A.CU_MEM_ADVISE_SET_READ_MOSTLY,
            A.CU_MEM_ADVISE_UNSET_READ_MOSTLY,
        ):
            res = mem_advise(ptr, _GRANULE, advice, device)
            if res:
                return False, (
                    f"this driver refuses advice on managed-pool memory: cuMemAdvise "
                    f"({advice.name}) returned {error_name(res)}"
                )
        return True, "this driver takes advice on managed-pool memory"
    finally:
        drv.cuMemFreeAsync(ptr, 0)
        drv.cuStreamSynchronize(0)


def require_managed_memory(device: int) -> None:
    _device.require_attribute(
        device, "MANAGED_MEMORY", "managed memory, which ManagedPool needs; use DevicePool"
    )


class ManagedAllocator(BlockCache):
    """``cuMemAllocManaged`` blocks for one device, cached by size, reuse ordered by events.

    A :class:`~cupy_poolmem._block_cache.BlockCache` of page-rounded blocks, each
    serving its own size class only.  ``release`` (trim, close, out-of-memory) gives
    cached blocks back with ``cuMemFree`` once their events have completed (all of
    them with ``wait``).
    """

    def __init__(self, device: int) -> None:
        super().__init__(device, _GRANULE)

    def _create(self, r: int) -> tuple[int, int]:
        drv = _drv()
        err, p = drv.cuMemAllocManaged(r, drv.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL.value)
        if int(err):
            return int(err), 0
        ptr = int(p)
        # The pool prefers its GPU, as a managed pool created for it does.
        mem_advise(ptr, r, drv.CUmem_advise.CU_MEM_ADVISE_SET_PREFERRED_LOCATION, self.device)
        return 0, ptr

    def _destroy(self, ptr: int, r: int) -> None:
        check_driver(_drv().cuMemFree(ptr), "cuMemFree")
