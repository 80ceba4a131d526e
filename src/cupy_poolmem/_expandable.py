"""``DevicePool(large_blocks="expandable")``: every block placed first fit in address
ranges that grow by mapping device memory, two per stream.

:class:`ExpandableBlocks` owns the ranges of one pool (reserve, map at the top, unmap
the free top on release) and the arenas that place blocks in them; the hot path takes
and gives blocks in the arenas itself.  See docs/device_pool.rst, "How it works".
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

from . import _arena_py, _driver, _streams
from ._errors import add_note, check_driver
from ._mapped import MappingCalls, access_descriptors, device_allocation, restore_access
from ._streams import stream_key

__all__ = [
    "ExpandableBlocks",
    "SMALL_MAX",
    "SMALL_STEP",
    "LARGE_STEP",
    "expandable_range_of",
    "stream_key",
]

SMALL_MAX = 1 << 20  # blocks up to this size share a range of their own (per stream)
SMALL_STEP = 2 << 20  # which maps this much at a time
LARGE_STEP = 20 << 20  # the other range maps this much at least at a time
_OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY
_PER_THREAD = 2  # CU_STREAM_PER_THREAD: a different stream in each thread


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def _stream_object(stream_ptr: int) -> Any:
    """CuPy's current stream when it is ``stream_ptr`` (the allocation's), else None."""
    try:
        import cupy

        s = cupy.cuda.get_current_stream()
    except Exception:
        return None
    return s if int(s.ptr) == stream_ptr else None


class ExpandableBlocks(MappingCalls):
    """Two growing, mapped address ranges per stream, placed by :class:`Arena`\\ s.

    Parameters
    ----------
    device : int
        The GPU whose memory is mapped.
    peers : iterable of int
        Other GPUs given read and write access to every range (see :meth:`set_peers`).
    span : int
        Bytes of address space each range reserves (the device's memory: a range
        can grow to all of it).
    arena : type, optional
        The arena class: the compiled hot path's, or ``_arena_py.Arena``.
    driver : module, optional
        ``cuda.bindings.driver`` (tests give a fake).
    sync : callable, optional
        ``sync(device)`` waits until every stream of the device is idle (a release
        that waits calls it); default :func:`cupy_poolmem._streams.sync_device`.
    exportable : bool
        Create the ranges' memory exportable as POSIX file descriptors (an ``ipc=True``
        pool's: its steps travel to other processes); default False.
    pinned : callable, optional
        ``pinned(step_id) -> bool``: whether another process maps the step (the
        sharing layer's book, see :meth:`set_pins`); a pinned step is not unmapped
        by :meth:`release`.

    Examples
    --------
    >>> blocks = ExpandableBlocks(0, span=80 << 30)  # doctest: +SKIP
    >>> err, ptr = blocks.alloc(40 << 20, stream_ptr=0)  # doctest: +SKIP
    >>> blocks.free(ptr, 0)  # doctest: +SKIP
    >>> blocks.release(0)  # doctest: +SKIP
    62914560
    """

    default_keep: Any = None  # no release_threshold: see the pool
    mode = "expandable"  # the pool's large_blocks
    release_threshold: Any = None
    #: Every ExpandableBlocks alive: ``check_access`` finds a block by its address.
    _alive: ClassVar[weakref.WeakSet] = weakref.WeakSet()

    def __init__(
        self,
        device: int,
        peers: Any = (),
        span: int = 1 << 40,
        arena: Any = None,
        driver: Any = None,
        sync: Any = None,
        exportable: bool = False,
        pinned: Callable[[int], bool] | None = None,
    ) -> None:
        d = self._d = driver if driver is not None else _driver.get()
        self._sync = sync if sync is not None else _streams.sync_device
        self.device = device
        self.exportable = bool(exportable)
        self._prop, self.granule = device_allocation(d, device, self.exportable)
        self._pinned = pinned
        self._step_ids = itertools.count(1)
        #: mapped step's address -> its id (never reused: a step unmapped and mapped
        #: again at the same address is a new step)
        self.step_ids: dict[int, int] = {}
        self.span = _round_up(max(int(span), LARGE_STEP), self.granule)
        self._arena = arena if arena is not None else _arena_py.Arena
        self._lock = threading.RLock()  # growing, releasing, peers: one at a time
        self._failed = threading.local()  # .call: the mapping call that failed last
        self.peers: tuple[int, ...] = tuple(int(p) for p in peers)
        self._access = access_descriptors(d, (device, *self.peers), ())
        #: stream key (:func:`stream_key`) -> (small blocks' arena, large blocks'
        #: arena): the hot path looks arenas up here (a dict it holds too, changed
        #: only under the GIL).
        self.arenas: dict[int, tuple[Any, Any]] = {}
        self._small: set = set()  # the small blocks' arenas
        self._steps: dict[Any, list[tuple[int, int]]] = {}  # arena -> [(va, bytes) mapped]
        self.reserved = 0  # bytes mapped
        self.peak_reserved = 0
        self.n_errors = 0
        self.leaked = 0  # bytes a failed unmap left mapped and out of every arena
        self.closed = False
        ExpandableBlocks._alive.add(self)

    # -- what the pool reads --------------------------------------------------------
    @property
    def cached(self) -> int:
        """Bytes mapped and free in the ranges (what :meth:`release` may give back, at
        their tops)."""
        return sum(a.free_bytes for pair in list(self.arenas.values()) for a in pair)

    def _arena_of(self, ptr: int) -> Any:
        for pair in list(self.arenas.values()):
            for a in pair:
                if a.base <= ptr < a.top:
                    return a
        return None

    def owns(self, ptr: int) -> bool:
        """Whether ``ptr`` lies in a mapped part of one of the ranges."""
        return self._arena_of(ptr) is not None

    __contains__ = owns

    @classmethod
    def alive(cls) -> list[ExpandableBlocks]:
        return list(cls._alive)

    def block_at(self, ptr: int) -> int | None:
        """The start of the mapped step that holds ``ptr`` (for access checks), or None."""
        with self._lock:
            for steps in self._steps.values():
                for va, n in steps:
                    if va <= ptr < va + n:
                        return va
        return None

    # -- steps other processes map ----------------------------------------------------
    def steps_under(self, ptr: int, size: int) -> list[tuple[int, int, int]]:
        """``(step id, address, bytes)`` of every mapped step that holds a byte of the
        block ``[ptr, ptr + size)``, in address order (empty if none does)."""
        end = ptr + max(int(size), 1)
        with self._lock:
            for steps in self._steps.values():
                out = [(self.step_ids[va], va, n) for va, n in steps if va < end and ptr < va + n]
                if out:
                    return out
        return []

    def set_pins(self, pinned: Callable[[int], bool] | None) -> None:
        """``pinned(step_id) -> bool`` from now on (the sharing layer's book, installed
        when the pool's first block is exported); None: nothing is pinned."""
        self._pinned = pinned

    def is_pinned(self, va: int) -> bool:
        """Whether another process maps the step at ``va`` (then no release unmaps it)."""
        pinned = self._pinned
        return pinned is not None and bool(pinned(self.step_ids.get(va, 0)))

    # -- allocation (the hot path's arenas had no room) -------------------------------
    def alloc(self, size: int, stream_ptr: int) -> tuple[int, int]:
        """``(CUresult, address)`` of a block of ``size`` bytes on stream ``stream_ptr``:
        from its arena, after mapping more at the range's top if it has no room."""
        with self._lock:
            if self.closed:
                return _OUT_OF_MEMORY, 0
            a, err = self._arena_for(stream_ptr, size)
            if err:
                return err, 0
            ptr = a.take(size)
            if ptr:
                return 0, ptr
            # Another thread's hot path (no lock) may take the new room first: again.
            for _ in range(4):
                err = self._grow(a, size)
                if err:
                    return err, 0
                ptr = a.take(size)
                if ptr:
                    return 0, ptr
            return _OUT_OF_MEMORY, 0

    def _arena_for(self, stream_ptr: int, size: int) -> tuple[Any, int]:
        """The arena of ``stream_ptr`` for ``size``, its two ranges reserved if new."""
        key = stream_key(stream_ptr)
        pair = self.arenas.get(key)
        if pair is None:
            stream = _stream_object(stream_ptr)
            made: list[Any] = []
            for _ in range(2):
                self.failed_call = "cuMemAddressReserve"
                err, va = self._d.cuMemAddressReserve(self.span, self.granule, 0, 0)
                if int(err):
                    for m in made:
                        self._d.cuMemAddressFree(m.base, self.span)
                    return None, int(err)
                made.append(self._arena(int(va), self.span, stream_ptr, stream))
            self.failed_call = ""
            pair = (made[0], made[1])
            for m in made:
                self._steps[m] = []
            self._small.add(made[0])
            self.arenas[key] = pair
        return pair[0] if size <= SMALL_MAX else pair[1], 0

    def _grow(self, a: Any, size: int) -> int:
        """Map enough at the top of ``a`` for a block of ``size``; a CUresult."""
        need = _round_up(max(size, 1), _arena_py.UNIT) - a.tail_free
        step = SMALL_STEP if a in self._small else LARGE_STEP
        exact = _round_up(need, self.granule)
        if exact > a.limit - a.mapped:
            return _OUT_OF_MEMORY
        n = min(max(exact, step), a.limit - a.mapped)
        err = self._map(a.top, n)
        if err == _OUT_OF_MEMORY and n > exact:
            n = exact  # near the device's end: only what the block needs
            err = self._map(a.top, n)
        if err:
            return err
        try:
            a.extend(n)
        except BaseException:
            self._unmap(a.top, n)  # (only from a collection inside an arena call)
            return _OUT_OF_MEMORY
        self._steps[a].append((a.top - n, n))
        self.step_ids[a.top - n] = next(self._step_ids)
        self.reserved += n
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return 0

    def _map(self, va: int, n: int) -> int:
        """Map ``n`` bytes of new memory at ``va`` with the ranges' access; a CUresult.
        The mapping holds the memory (its handle is released at once), and each step
        that fails undoes the ones before."""
        d = self._d
        self.failed_call = "cuMemCreate"
        err, handle = d.cuMemCreate(n, self._prop, 0)
        if int(err):
            return int(err)
        try:
            self.failed_call = "cuMemMap"
            (err,) = d.cuMemMap(va, n, 0, handle, 0)
            if int(err):
                return int(err)
            self.failed_call = "cuMemSetAccess"
            (err,) = d.cuMemSetAccess(va, n, self._access, len(self._access))
            if int(err):
                d.cuMemUnmap(va, n)
                return int(err)
            self.failed_call = ""
            return 0
        finally:
            d.cuMemRelease(handle)

    # -- frees ------------------------------------------------------------------------
    def free(self, ptr: int, stream_ptr: int) -> None:
        """Give the block at ``ptr`` back to its arena (the hot path's own way did not:
        a free held for a capture, a leftover of a finalized pool)."""
        a = self._arena_of(ptr)
        if a is None or not a.give(ptr):
            self.n_errors += 1
            raise ValueError(f"{ptr:#x} is no live block of the expandable ranges")

    def free_leftover(self, ptr: int) -> None:
        """A block its pool's finalizer left to the retirer (after its device sync)."""
        self.free(ptr, 0)

    # -- giving memory back -----------------------------------------------------------
    def release(self, keep: int = 0, wait: bool = True, at_least: bool = False) -> int:
        """Unmap free memory at the ranges' tops, a mapped step at a time, until at most
        ``keep`` bytes stay free (``at_least``: only steps whose going leaves at least
        ``keep``); ranges left with nothing mapped are dropped.  Returns the bytes
        unmapped.

        A step is taken out of its arena first (in one step, only if it is all free),
        so no allocation gets it meanwhile.  Blocks freed there may still be in use on
        their stream: with ``wait`` the device is synchronised after the cut, else the
        steps of a stream that is busy or capturing (or that cannot be asked: another
        thread's per-thread stream) go back to their arena.  A step the driver refuses
        to unmap goes back too, with those below it, and the first error is raised
        after the other ranges went.  A step another process maps (``pinned``) stops
        the cut of its range, as a live block does: it and those below it stay.
        """
        error: BaseException | None = None
        with self._lock:
            free = self.cached
            cuts: list[tuple[Any, list[tuple[int, int]]]] = []  # (arena, steps cut)
            for pair in list(self.arenas.values()):
                for a in pair:
                    steps = self._steps.get(a, [])
                    cut: list[tuple[int, int]] = []
                    while len(cut) < len(steps) and free > keep:
                        va, n = steps[-1 - len(cut)]
                        if (
                            (at_least and free - n < keep)
                            or self.is_pinned(va)
                            or not a.cut_tail(n)
                        ):
                            break  # keep says stop, another process maps it, or a live block
                        cut.append((va, n))
                        free -= n
                    if cut:
                        cuts.append((a, cut))
            if not cuts:
                return 0
            if wait:
                try:
                    self._sync(self.device)
                except BaseException as exc:
                    for a, cut in cuts:
                        self._put_back(a, cut)
                    raise exc from None
            released = 0
            for a, cut in cuts:
                if not wait and not self._idle(a.stream_ptr):
                    self._put_back(a, cut)
                    continue
                steps = self._steps[a]
                for k, (va, n) in enumerate(cut):  # from the top down
                    try:
                        self._unmap(va, n)
                    except BaseException as exc:
                        self._put_back(a, cut[k:])  # still mapped: back in the arena
                        self.n_errors += 1
                        error = error or exc
                        break
                    steps.pop()
                    self.step_ids.pop(va, None)
                    self.reserved -= n
                    released += n
            for key, pair in list(self.arenas.items()):
                if all(a.mapped == 0 for a in pair):
                    self._drop(key, pair)
        if error is not None:
            raise error
        return released

    @staticmethod
    def _put_back(a: Any, cut: list[tuple[int, int]]) -> None:
        """Give ``a`` back the steps ``cut`` from its top (listed top down): still mapped."""
        for _va, n in reversed(cut):
            a.extend(n)

    def _idle(self, stream_ptr: int) -> bool:
        """Whether the work queued on ``stream_ptr`` is done, asked without waiting and
        without disturbing a capture: a stream that is capturing, the legacy stream
        while any capture is under way, and another thread's per-thread stream are
        not asked (not idle)."""
        if stream_ptr == _PER_THREAD:
            return False
        d = self._d
        try:
            if stream_ptr <= 1:
                if _streams.any_capture_underway():
                    return False
            else:
                err, status = d.cuStreamIsCapturing(stream_ptr)
                if int(err) or int(status):
                    return False
            (err,) = d.cuStreamQuery(stream_ptr)
        except Exception:
            return False
        return int(err) == 0

    def _unmap(self, va: int, n: int) -> None:
        check_driver(self._d.cuMemUnmap(va, n), "cuMemUnmap")

    def _drop(self, key: int, pair: tuple[Any, Any]) -> None:
        """Forget the empty ranges of stream ``key`` and their address space."""
        if self.arenas.get(key) is pair:
            del self.arenas[key]
        for a in pair:
            a.retire()
            self._steps.pop(a, None)
            self._small.discard(a)
            err = self._d.cuMemAddressFree(a.base, self.span)[0]
            if int(err):
                self.n_errors += 1

    def reset_peak(self) -> None:
        self.peak_reserved = self.reserved

    def close(self) -> None:
        """Unmap everything (the pool is drained and its device synchronised)."""
        self.closed = True
        with self._lock:
            for pair in list(self.arenas.values()):
                for a in pair:
                    a.retire()  # first: a hot path that remembers it takes nothing more
            for key, pair in list(self.arenas.items()):
                for a in pair:
                    for va, n in reversed(self._steps.get(a, [])):
                        try:
                            self._unmap(va, n)
                            self.step_ids.pop(va, None)
                            self.reserved -= n
                        except Exception:
                            self.n_errors += 1
                            self.leaked += n
                self._drop(key, pair)

    # -- peers ------------------------------------------------------------------------
    def set_peers(self, peers: Any) -> None:
        """Give exactly ``peers`` (other GPUs) access to every range, now and later.

        All or nothing: when the driver refuses one mapped step, the steps already
        changed get their previous access back and the error is raised (a step whose
        undo fails too is named in a note)."""
        peers = tuple(int(p) for p in peers)
        d = self._d
        with self._lock:
            old = self.peers
            grant = access_descriptors(d, (self.device, *peers), [p for p in old if p not in peers])
            undo = access_descriptors(d, (self.device, *old), [p for p in peers if p not in old])
            steps = [s for pair in self.arenas.values() for a in pair for s in self._steps[a]]
            for i, (va, n) in enumerate(steps):
                try:
                    check_driver(d.cuMemSetAccess(va, n, grant, len(grant)), "cuMemSetAccess")
                except Exception as exc:
                    mixed = restore_access(d, steps[:i], undo)
                    if mixed:
                        add_note(
                            exc,
                            "the previous peer access could not be restored on mapped "
                            f"range(s) at {', '.join(mixed)}",
                        )
                    raise
            self._access = access_descriptors(d, (self.device, *peers), ())
            self.peers = peers


def expandable_range_of(ptr: int) -> tuple[ExpandableBlocks, int] | None:
    """``(ranges, start of the mapped step)`` holding address ``ptr`` among every
    expandable pool's ranges (closed pools' too), else None."""
    for blocks in ExpandableBlocks.alive():
        step = blocks.block_at(ptr)
        if step is not None:
            return blocks, step
    return None
