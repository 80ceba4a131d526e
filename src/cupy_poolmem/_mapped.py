"""``DevicePool(large_blocks="mapped")``: each large block on device memory of its own.

:class:`MappedBlocks` maps a block per request above the small-block size (virtual
memory management, with cuda.bindings) and keeps freed ones in a
:class:`~cupy_poolmem._block_cache.BlockCache`.  See docs/device_pool.rst, "How it
works".
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from . import _driver
from ._block_cache import BlockCache
from ._errors import add_note, check_driver

__all__ = [
    "MappedBlocks",
    "MAPPED_FIT",
    "MAPPED_MARGIN",
    "MAPPED_MARGIN_SHARE",
    "access_descriptors",
    "access_flags",
    "device_allocation",
    "mapped_block_of",
]

MAPPED_FIT = 1 / 3  # a freed block serves requests of at least three quarters its size
MAPPED_MARGIN = 64 << 20  # reserved may pass the most ever live by this much at least,
MAPPED_MARGIN_SHARE = 16  # or by this fraction of it (unless release_threshold says)


_NO_LIMIT = 2**64 - 1


def device_allocation(d: Any, device: int, exportable: bool = False) -> tuple[Any, int]:
    """``(CUmemAllocationProp, granularity)`` of plain device memory on ``device`` for
    ``cuMemCreate`` (``d``: cuda.bindings' driver module, or a fake).  ``exportable``:
    the memory can be exported as a POSIX file descriptor (an ``ipc=True`` pool's);
    otherwise the properties ask for no shareable handle type at all."""
    prop = d.CUmemAllocationProp()
    prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    if exportable:
        prop.requestedHandleTypes = (
            d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        )
    flag = d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    granule = check_driver(
        d.cuMemGetAllocationGranularity(prop, flag), "cuMemGetAllocationGranularity"
    )
    return prop, int(granule)


def access_descriptors(d: Any, grant: Iterable[int], revoke: Iterable[int]) -> list[Any]:
    """``CUmemAccessDesc``s for ``cuMemSetAccess``: read-write for the GPUs in ``grant``,
    none for those in ``revoke`` (``d``: cuda.bindings' driver module, or a fake)."""
    out = []
    for dev, flags in [(g, "READWRITE") for g in grant] + [(r, "NONE") for r in revoke]:
        desc = d.CUmemAccessDesc()
        desc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = int(dev)
        desc.flags = getattr(d.CUmemAccess_flags, f"CU_MEM_ACCESS_FLAGS_PROT_{flags}")
        out.append(desc)
    return out


class MappingCalls:
    """What the mapped backends share: the mapping call that failed the calling
    thread's last allocation, and a GPU's access read back from the driver.  The
    backend sets ``_d`` (the driver), ``device`` and ``_failed`` (a ``threading.local``)."""

    _d: Any
    device: int
    _failed: threading.local

    @property
    def failed_call(self) -> str:
        """The mapping call that failed this thread's last allocation ("" if none)."""
        return getattr(self._failed, "call", "")

    @failed_call.setter
    def failed_call(self, call: str) -> None:
        self._failed.call = call

    def has_access(self, ptr: int, device: int) -> bool:
        """Whether GPU ``device`` may read and write the memory at ``ptr`` (the driver's
        word: ``cuMemGetAccess``); the memory's own GPU always may.  Only for memory of
        this backend: on ``cudaMalloc`` memory the driver answers success with no access
        (H100, driver 580), even for the memory's own GPU."""
        if device == self.device:
            return True
        rw = self._d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return int(self._access_flags(ptr, device)) == int(rw)

    def _access_flags(self, ptr: int, device: int) -> Any:
        """The driver's ``CUmemAccess_flags`` of GPU ``device`` on the memory at ``ptr``."""
        return access_flags(self._d, ptr, device)


def restore_access(
    d: Any, blocks: Iterable[tuple[int, int]], undo: list[Any], owns: Any = None
) -> list[str]:
    """Set ``undo`` (the access before a change that failed) on ``blocks``, ``(address,
    bytes)`` each; the addresses (hex) the driver refused again, of those ``owns`` (when
    given) says are still mapped."""
    return [
        f"{ptr:#x}"
        for ptr, r in blocks
        if int(d.cuMemSetAccess(ptr, r, undo, len(undo))[0]) and (owns is None or owns(ptr))
    ]


class MappedBlocks(BlockCache, MappingCalls):
    """Device memory blocks mapped one by one with virtual memory management.

    Freed blocks stay mapped for reuse up to ``release_threshold`` bytes.  When the
    pool sets none (``None``), they stay while the blocks reserve no more than the
    most bytes ever live in them plus a sixteenth (64 MiB at least, :meth:`budget`):
    a new block that would reserve more unmaps the oldest freed blocks first.

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
    exportable : bool
        Create the blocks' memory exportable as POSIX file descriptors (an
        ``ipc=True`` pool's); default False.
    pinned : callable, optional
        ``pinned(step_id) -> bool``: whether another process maps the block (each
        block is one step; the sharing layer's book, see :meth:`set_pins`); a pinned
        cached block is not unmapped by :meth:`release`.

    Examples
    --------
    >>> blocks = MappedBlocks(0)  # doctest: +SKIP
    >>> err, ptr = blocks.alloc(40 << 20, stream_ptr=0)  # doctest: +SKIP
    >>> blocks.free(ptr, 0)  # doctest: +SKIP
    >>> blocks.release(0)  # doctest: +SKIP
    41943040
    """

    default_keep: Any = None  # the pool's release_threshold=None: see _keep
    mode = "mapped"  # the pool's large_blocks
    #: Every MappedBlocks alive, open pool or closed: a closed pool's live arrays keep
    #: their blocks mapped, and ``check_access`` must still find them by address.
    _alive: ClassVar[weakref.WeakSet] = weakref.WeakSet()

    def __init__(
        self,
        device: int,
        peers: Iterable[int] = (),
        fit: float = MAPPED_FIT,
        driver: Any = None,
        exportable: bool = False,
        pinned: Callable[[int], bool] | None = None,
    ) -> None:
        d = self._d = driver if driver is not None else _driver.get()
        self.exportable = bool(exportable)
        self._prop, granule = device_allocation(d, device, self.exportable)
        super().__init__(device, granule, fit)
        self._pins = pinned
        self._step_ids = itertools.count(1)
        #: block address -> its step id (never reused: a block unmapped and mapped
        #: again at the same address is a new step)
        self.step_ids: dict[int, int] = {}
        self._map_lock = threading.RLock()
        self._failed = threading.local()  # .call: the mapping call that failed last
        self.peers: tuple[int, ...] = ()
        self._stray: set[int] = set()  # peers a failed undo may have left granted
        self._access = self._descriptors((device, *peers), ())
        self.peers = tuple(peers)
        MappedBlocks._alive.add(self)

    @classmethod
    def alive(cls) -> list[MappedBlocks]:
        """Every mapped-blocks cache not yet collected (open or closed pools')."""
        return list(cls._alive)

    def _keep(self) -> int:
        t = self.release_threshold
        return _NO_LIMIT if t is None else int(t)  # None: see _make_room

    def budget(self) -> int:
        """Bytes the blocks may reserve before a new one unmaps freed ones first (with
        no ``release_threshold``): the most ever live, plus a sixteenth (64 MiB at
        least)."""
        high = self.live_high
        return high + max(MAPPED_MARGIN, high // MAPPED_MARGIN_SHARE)

    def _make_room(self, r: int) -> None:
        """With no ``release_threshold``: unmap the oldest freed blocks whose frees have
        run until a new block of ``r`` bytes fits in :meth:`budget`."""
        if self.release_threshold is not None or not self.cached:
            return
        live = self.reserved - self.cached
        over = live + self.cached + r - max(self.budget(), live + r)
        if over > 0:
            self._release_quietly(max(0, self.cached - over))

    def alloc(self, size: int, stream_ptr: int) -> tuple[int, int]:
        # Under the mapping lock: set_peers waits, so a block is mapped with the access
        # list in force when it is registered (and then re-granted with the rest).
        with self._map_lock:
            return super().alloc(size, stream_ptr)

    def _descriptors(self, grant: Iterable[int], revoke: Iterable[int]) -> list[Any]:
        return access_descriptors(self._d, grant, revoke)

    def _create(self, r: int) -> tuple[int, int]:
        """Physical memory of ``r`` bytes, mapped at an address range of its own.

        The mapping holds the memory: the handle is released at once, so unmapping
        gives the memory back.  Each step that fails undoes the ones before.
        """
        d = self._d
        self.failed_call = "cuMemCreate"
        err, handle = d.cuMemCreate(r, self._prop, 0)
        if int(err):
            return int(err), 0
        va = 0
        try:
            self.failed_call = "cuMemAddressReserve"
            err, va = d.cuMemAddressReserve(r, self.granule, 0, 0)
            if int(err):
                return int(err), 0
            va = int(va)
            self.failed_call = "cuMemMap"
            (err,) = d.cuMemMap(va, r, 0, handle, 0)
            if int(err):
                d.cuMemAddressFree(va, r)
                return int(err), 0
            self.failed_call = "cuMemSetAccess"
            (err,) = d.cuMemSetAccess(va, r, self._access, len(self._access))
            if int(err):
                d.cuMemUnmap(va, r)
                d.cuMemAddressFree(va, r)
                return int(err), 0
            self.failed_call = ""
            self.step_ids[va] = next(self._step_ids)
            return 0, va
        finally:
            d.cuMemRelease(handle)

    def _destroy(self, ptr: int, r: int) -> None:
        d = self._d
        # Under the mapping lock: set_peers, which may have listed this block, is done
        # with it first.  Once the range is free the driver hands it to the next
        # mapping, any pool's, whose access set_peers would otherwise change.
        with self._map_lock:
            check_driver(d.cuMemUnmap(ptr, r), "cuMemUnmap")
            self.step_ids.pop(ptr, None)
            check_driver(d.cuMemAddressFree(ptr, r), "cuMemAddressFree")

    def steps_under(self, ptr: int, size: int) -> list[tuple[int, int, int]]:
        """``[(step id, address, bytes)]`` of the block that holds ``[ptr, ptr +
        size)`` (a mapped block is one step), or ``[]`` when no block holds all of it."""
        for va, r in self._blocks():
            if va <= ptr and ptr + max(int(size), 1) <= va + r and va in self.step_ids:
                return [(self.step_ids[va], va, r)]
        return []

    def set_pins(self, pinned: Callable[[int], bool] | None) -> None:
        """``pinned(step_id) -> bool`` from now on (the sharing layer's book)."""
        self._pins = pinned

    def is_pinned(self, va: int) -> bool:
        """Whether another process maps the block at ``va`` (no release unmaps it)."""
        pinned = self._pins
        return pinned is not None and bool(pinned(self.step_ids.get(va, 0)))

    def set_peers(self, peers: Iterable[int]) -> None:
        """Give exactly ``peers`` (other GPUs) access to every block, now and later.

        All or nothing: no block is mapped meanwhile, and when the driver refuses one
        block the blocks already changed get their previous access back and the error
        is raised (the peers stay as they were).  Should that undoing fail too, the
        error says which blocks may hold mixed access, and the next call revokes the
        peers they may hold.  Every block is set, even when ``peers`` is unchanged
        (one ``cuMemSetAccess`` each): that is what repairs mixed blocks.
        """
        peers = tuple(int(p) for p in peers)
        with self._map_lock:  # one change at a time, and no block mapped meanwhile
            old = self.peers
            # Peers an undo failed on may still hold a grant somewhere: revoked too.
            stale = sorted((set(old) | self._stray) - set(peers))
            grant = self._descriptors((self.device, *peers), stale)
            undo = self._descriptors((self.device, *old), [p for p in peers if p not in old])
            before = self._access
            self._access = self._descriptors((self.device, *peers), ())
            for ptr, r in self._blocks():
                try:
                    check_driver(
                        self._d.cuMemSetAccess(ptr, r, grant, len(grant)), "cuMemSetAccess"
                    )
                except Exception as exc:
                    if not self.owns(ptr):
                        continue  # unmapped meanwhile (a trim, a free past the threshold)
                    self._access = before
                    if self._undo_peers(self._blocks(), undo, exc):
                        self._stray.update(p for p in peers if p not in old)
                    raise
            self.peers = peers
            self._stray.clear()

    def _blocks(self) -> list[tuple[int, int]]:
        """``(address, bytes)`` of every block, live or cached, now."""
        locked = self._acquire()
        try:
            return list(self._sizes.items())
        finally:
            if locked:
                self._unlock()

    def _undo_peers(self, blocks: list[tuple[int, int]], undo: list[Any], exc: Exception) -> bool:
        """Set ``undo`` (the previous access) on ``blocks`` after ``exc`` failed a change
        (on all of them: setting an access a block has already changes nothing); blocks
        the driver refuses again are named in a note on ``exc``; True if there are any."""
        mixed = restore_access(self._d, blocks, undo, self.owns)
        if mixed:
            add_note(
                exc,
                "the previous peer access could not be restored on mapped block(s) "
                f"{', '.join(mixed)}: their access is mixed until peer_access is set again",
            )
        return bool(mixed)

    def block_at(self, ptr: int) -> int | None:
        """The address of the block (live or cached) that holds address ``ptr``, or None."""
        for va, r in self._blocks():
            if va <= ptr < va + r:
                return va
        return None


def access_flags(d: Any, ptr: int, device: int) -> Any:
    """The driver's ``CUmemAccess_flags`` of GPU ``device`` on mapped memory at ``ptr``
    (``cuMemGetAccess``; ``d``: cuda.bindings' driver module, or a fake)."""
    where = d.CUmemLocation()
    where.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    where.id = int(device)
    return check_driver(d.cuMemGetAccess(where, ptr), "cuMemGetAccess")


def mapped_block_of(array: Any, ptr: int | None = None) -> tuple[MappedBlocks, int] | None:
    """``(blocks, block address)`` when ``array`` lives on a mapped block of a
    ``DevicePool(large_blocks="mapped")``, else None.

    A ``cupy.ndarray`` from such a pool leads to its block; any other view of the
    memory (``__cuda_array_interface__``, DLPack, a Numba or torch array) is looked
    up by its address ``ptr`` among every pool's mapped blocks, closed pools'
    included (their live arrays keep their blocks).
    """
    owner = getattr(getattr(getattr(array, "data", None), "mem", None), "_owner", None)
    backend = getattr(getattr(owner, "core", None), "_backend", None)
    if isinstance(backend, MappedBlocks) and owner is not None and backend.owns(owner.ptr):
        return backend, int(owner.ptr)
    if ptr is not None:
        for blocks in MappedBlocks.alive():
            block = blocks.block_at(ptr)
            if block is not None:
                return blocks, block
    return None
