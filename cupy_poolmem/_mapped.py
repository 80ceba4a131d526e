"""``DevicePool(large_blocks="mapped")``: each large block on device memory of its own.

A CUDA pool maps its memory in 32 MiB chunks and gives back only chunks left empty,
so blocks of many sizes freed out of order keep it reserving far more than is live
(the churn benchmark: 0.98x CuPy's ``MemoryPool`` at best).  Here a block above the
pool's small-block size is physical memory of its own, made with virtual memory
management (``cuMemCreate``, ``cuMemAddressReserve``, ``cuMemMap``,
``cuMemSetAccess``) at the device's granularity (2 MiB), and unmapped when it leaves
the cache of freed blocks (:class:`~cupy_poolmem._block_cache.BlockCache`): what the
pool reserves follows what is live.

The driver work, about 60 us to map a block and 50 us to unmap it (H100), is paid on a
cache miss only: a freed block serves the next request of its size, or up to a
quarter smaller (``fit``), on its own stream at once and on another once the event
recorded at its free has completed.  Beyond ``release_threshold`` cached bytes, the
oldest freed blocks whose streams are past their frees are unmapped; with no
threshold set, the cache keeps up to an eighth of the live mapped bytes (at least
64 MiB).

cuda.core 1.2's ``VirtualMemoryResource`` would do the mapping, but it keeps every
block's physical memory until the process exits (NVIDIA/cuda-python#2882, fixed
after 1.2) and reserves, maps and unmaps synchronously: the calls are made here with
cuda.bindings.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ._block_cache import BlockCache
from ._errors import check_driver

__all__ = ["MappedBlocks", "MAPPED_FIT", "MAPPED_KEEP", "MAPPED_KEEP_SHARE"]

MAPPED_FIT = 0.25  # a freed block serves a request down to 1/1.25 its size
MAPPED_KEEP = 64 << 20  # freed bytes kept mapped at least, unless release_threshold says
MAPPED_KEEP_SHARE = 8  # ... and up to this fraction of the live mapped bytes


def _drv() -> Any:
    from cuda.bindings import driver

    return driver


class MappedBlocks(BlockCache):
    """Device memory blocks mapped one by one with virtual memory management.

    Freed blocks stay mapped for reuse up to ``release_threshold`` bytes; when the
    pool sets none (``None``), up to an eighth of the bytes live in mapped blocks, at
    least :data:`MAPPED_KEEP`.

    Parameters
    ----------
    device : int
        The GPU whose memory the blocks are.
    peers : iterable of int
        Other GPUs given read and write access to every block (see :meth:`set_peers`).
    fit : float
        A freed block serves requests down to ``1 / (1 + fit)`` of its size.
    driver : module, optional
        ``cuda.bindings.driver`` (tests give a fake).

    Examples
    --------
    >>> blocks = MappedBlocks(0)  # doctest: +SKIP
    >>> err, ptr = blocks.alloc(40 << 20, stream_ptr=0)  # doctest: +SKIP
    >>> blocks.free(ptr, 0)  # doctest: +SKIP
    >>> blocks.release(0)  # doctest: +SKIP
    41943040
    """

    default_keep: Any = None  # the pool's release_threshold=None: see _keep

    def __init__(
        self,
        device: int,
        peers: Iterable[int] = (),
        fit: float = MAPPED_FIT,
        driver: Any = None,
    ) -> None:
        d = self._d = driver if driver is not None else _drv()
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        self._prop = prop
        flag = d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        granule = check_driver(
            d.cuMemGetAllocationGranularity(prop, flag), "cuMemGetAllocationGranularity"
        )
        super().__init__(device, int(granule), fit)
        self.peers: tuple[int, ...] = ()
        self._access = self._descriptors((device, *peers), ())
        self.peers = tuple(peers)

    def _keep(self) -> int:
        t = self.release_threshold
        if t is None:
            return max(MAPPED_KEEP, (self.reserved - self.cached) // MAPPED_KEEP_SHARE)
        return int(t)

    def _descriptors(self, grant: Iterable[int], revoke: Iterable[int]) -> list[Any]:
        d = self._d
        out = []
        for dev, flags in [(g, "READWRITE") for g in grant] + [(r, "NONE") for r in revoke]:
            desc = d.CUmemAccessDesc()
            desc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = int(dev)
            desc.flags = getattr(d.CUmemAccess_flags, f"CU_MEM_ACCESS_FLAGS_PROT_{flags}")
            out.append(desc)
        return out

    def _create(self, r: int) -> tuple[int, int]:
        """Physical memory of ``r`` bytes, mapped at an address range of its own.

        The mapping holds the memory: the handle is released at once, so unmapping
        gives the memory back.  Each step that fails undoes the ones before.
        """
        d = self._d
        err, handle = d.cuMemCreate(r, self._prop, 0)
        if int(err):
            return int(err), 0
        va = 0
        try:
            err, va = d.cuMemAddressReserve(r, self.granule, 0, 0)
            if int(err):
                return int(err), 0
            va = int(va)
            (err,) = d.cuMemMap(va, r, 0, handle, 0)
            if int(err):
                d.cuMemAddressFree(va, r)
                return int(err), 0
            (err,) = d.cuMemSetAccess(va, r, self._access, len(self._access))
            if int(err):
                d.cuMemUnmap(va, r)
                d.cuMemAddressFree(va, r)
                return int(err), 0
            return 0, va
        finally:
            d.cuMemRelease(handle)

    def _destroy(self, ptr: int, r: int) -> None:
        d = self._d
        check_driver(d.cuMemUnmap(ptr, r), "cuMemUnmap")
        check_driver(d.cuMemAddressFree(ptr, r), "cuMemAddressFree")

    def set_peers(self, peers: Iterable[int]) -> None:
        """Give exactly ``peers`` (other GPUs) access to every block, now and later."""
        peers = tuple(int(p) for p in peers)
        revoke = [p for p in self.peers if p not in peers]
        grant = self._descriptors((self.device, *peers), revoke)
        locked = self._acquire()
        try:
            blocks = list(self._sizes.items())
        finally:
            if locked:
                self._unlock()
        for ptr, r in blocks:
            check_driver(self._d.cuMemSetAccess(ptr, r, grant, len(grant)), "cuMemSetAccess")
        self._access = self._descriptors((self.device, *peers), ())
        self.peers = peers
