"""DevicePool: a stream-ordered pool of one GPU's memory, with peer grants and placements."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import cuda.core as cc
import cupy

from .. import _expandable, _guard, _retire
from .._device import (
    can_access_peer,
    check_device,
    device_count,
    grant_access,
    require_attribute,
    resolve_peer_access,
)
from .._errors import InvalidOptionError, SharingError, UnsupportedError, add_note
from .._mapped import MappedBlocks
from .._runtime import hp as _hp
from .._sizes import format_bytes, parse_bytes
from .._streams import sync_device
from . import _driver, _recycle
from ._base import Pool
from ._options import (
    check_bool,
    check_expandable,
    large_blocks_mode,
    mapped_threshold,
    small_pool_size,
)


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
        and frees come out of order (see Notes).  Not with ``max_size`` (the cap is
        a CUDA pool's): :class:`~cupy_poolmem.InvalidOptionError`; ``small_pool``
        must then be at least 2 MiB.  ``"expandable"``: every block is placed, first fit, in two
        address ranges per stream that grow by mapping device memory (blocks up to
        1 MiB in one, larger ones in the other), as torch's ``expandable_segments``
        do: a freed block's room serves any size on its stream at once, with no
        driver call (see Notes).  Not with ``max_size`` nor ``release_threshold``
        (:class:`~cupy_poolmem.InvalidOptionError`).  With ``ipc=True`` either
        placement creates its memory exportable, and an array travels to another
        process as the physical memory under its block (:doc:`sharing`, "Mapped and
        expandable blocks"); a Numba IPC handle cannot carry such a block.

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
        ipc = check_bool(ipc, "ipc")
        mode = large_blocks_mode(large_blocks)
        mapped = mode == "mapped"
        if mode == "expandable":
            check_expandable(small_pool, release_threshold, max_size)
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
                map_above = mapped_threshold(small_pool)
                small_max = 0
                backend: Any = new_mapped_blocks(dev, peers, exportable=ipc)
            elif mode == "expandable":
                # Every block from the ranges (see _expandable.py); the CUDA pool
                # serves graph captures only.
                small_max = 0
                backend = new_expandable_blocks(dev, peers, int(total), exportable=ipc)
            else:
                small_max = small_pool_size(small_pool, max_b)
                backend = None
            # A plain pool's CUDA pools are reused by the next plain pool of the same
            # shape once it is drained (not destroyed, so no device sync); a shareable
            # one's are destroyed (other processes know their handles).
            # Not with max_size: the driver counts the last owner's pending frees
            # against it until they complete.  Not with mapped blocks (their own).
            key = None if ipc or max_b or mode != "pool" else ("device", dev, max_b, small_max)
            mrs = _recycle.recycled_mrs(key) if key is not None else []
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
                raise _driver.wrap(exc, "creating a device pool") from exc
            self._peers_set = False
            self._peers_lock = threading.RLock()  # one peer_access change at a time
            if peers or device_count() > 1:
                # Always set on a multi-GPU machine: a new pool can come back with the
                # handle of a destroyed one, and with its peer access (nvbug 5698116).
                # cuda.core compares with what *it* granted (nothing, for a new pool),
                # so stale grants are revoked here, by the driver call itself.
                try:
                    for m in mrs:
                        revoke_stale(m, dev)
                        self._peers_set = set_peers(m, dev, peers) or self._peers_set
                except BaseException:
                    if recycled:  # frees of the last owner may be pending: parked again
                        r = _retire.retirer()
                        r.retire(r.adopt(_recycle.Resources.owner(mrs), key, _recycle.park), dev)
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
            return granted_peers(self._mr)
        except Exception as exc:
            if self.closed:
                return ()
            raise _driver.wrap(exc, "querying a device pool's peer access") from exc

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
                raise _driver.wrap(
                    exc, f"waiting for GPU {dev} before revoking its access"
                ) from exc
        granted = False
        before = self.peer_access
        try:
            for mr in self._mrs:
                if self._parked:  # retired by a collection in this thread meanwhile
                    self._raise_closed()
                granted = set_peers(mr, self.device_id, peers) or granted
            if self._backend is not None:  # mapped blocks: each block's own access
                try:
                    self._backend.set_peers(peers)  # all or nothing
                except Exception as exc:
                    raise _driver.wrap(exc, "setting the peer access of mapped blocks") from exc
        except Exception as exc:
            for mr in self._mrs:  # the CUDA pools go back to what they granted
                try:
                    set_peers(mr, self.device_id, before)
                except Exception as undo:
                    self._peers_set = True  # a grant may stay: revoked at retirement
                    add_note(exc, f"the CUDA pool's previous peer access stays unset: {undo}")
            raise
        self._peers_set = granted or getattr(self, "_peers_set", False)

    def _ipc_pool_of(self, ptr: int, handle: int = 0) -> tuple[str, Any]:
        """The shareable CUDA pool holding ``ptr``; a block of the mapped or expandable
        placement has none (it travels as steps, see :meth:`_steps_of`; a Numba IPC
        handle, which names a CUDA pool, cannot carry it: SharingError)."""
        if self._backend is not None and self._backend.owns(ptr):
            raise SharingError(
                f"this array's memory is a block of a DevicePool(large_blocks="
                f"{self.large_blocks!r}), which is in no CUDA pool: it cannot be sent as a "
                "Numba IPC handle; send the CuPy array through multiprocessing (or Dask), "
                "or allocate it from a DevicePool(ipc=True) with large_blocks='pool'"
            )
        return super()._ipc_pool_of(ptr, handle)

    def _describe(self) -> str:
        mode = self.__dict__.get("large_blocks", "pool")  # (unset in a half-built pool)
        if mode == "pool":
            return super()._describe()
        return f"{type(self).__name__}(device={self.device_id}, large_blocks={mode!r})"

    def _steps_of(self, ptr: int) -> Any:
        """The mapped or expandable placement holding ``ptr`` when its memory is
        exportable (an ``ipc=True`` pool's: the block travels as the steps under it),
        else None."""
        b = self._backend
        if b is not None and getattr(b, "exportable", False) and b.owns(ptr):
            return b
        return None

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
                before_destroy = _recycle.Revoke(self._mrs)
            super()._retire_now(leftovers, before_destroy)


def new_expandable_blocks(
    device: int, peers: tuple[int, ...], total: int, exportable: bool = False
) -> Any:
    """The expandable ranges of a DevicePool on ``device`` (VMM checked first), each
    range with address space for all of the device's ``total`` bytes; ``exportable``:
    its memory can be exported as file descriptors (an ``ipc=True`` pool)."""
    require_attribute(
        device,
        "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
        "virtual memory management, which large_blocks='expandable' needs; use large_blocks='pool'",
    )
    try:
        return _expandable.ExpandableBlocks(
            device, peers, span=total, arena=_hp.ARENA, exportable=exportable
        )
    except Exception as exc:
        raise _driver.wrap(exc, "setting up expandable ranges") from exc


def new_mapped_blocks(device: int, peers: tuple[int, ...], exportable: bool = False) -> Any:
    """The mapped-blocks backend of a DevicePool on ``device`` (VMM checked first);
    ``exportable``: its memory can be exported as file descriptors (an ``ipc=True``
    pool)."""
    require_attribute(
        device,
        "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
        "virtual memory management, which large_blocks='mapped' needs; use large_blocks='pool'",
    )
    try:
        return MappedBlocks(device, peers, exportable=exportable)
    except Exception as exc:
        raise _driver.wrap(exc, "setting up mapped blocks") from exc


def granted_peers(mr: Any) -> tuple[int, ...]:
    """The devices a cuda.core ``DeviceMemoryResource`` grants access (driver state)."""
    return tuple(sorted(int(getattr(d, "device_id", d)) for d in mr.peer_accessible_by))


def revoke_stale(mr: Any, owner: int) -> None:
    """Revoke (``PROT_NONE``) every GPU that could reach ``owner``: a new pool starts
    with its own GPU only, whatever a destroyed pool with the same handle granted."""
    others = [d for d in range(device_count()) if d != owner and can_access_peer(d, owner)]
    if others:
        grant_access(int(mr.handle), others, read_write=False)


def set_peers(mr: Any, owner: int, peers: tuple[int, ...]) -> bool:
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
        raise _driver.wrap(exc, "setting a device pool's peer access") from exc
    return bool(peers)
