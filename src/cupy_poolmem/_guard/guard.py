"""The guard of one pool: guarded allocation, the poisoned quarantine, frees checked
against their red zones and streams, and :func:`attach`."""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from typing import Any

from .._errors import DoubleFreeError, GuardError, InvalidOptionError, UseAfterFreeError
from .._sizes import format_bytes
from .options import GuardOptions
from .records import (
    FREED,
    GENERATIONS,
    LIVE,
    QUARANTINED,
    GuardedBlock,
    GuardEvent,
    Record,
    call_site,
    describe_site,
    tag_now,
)
from .registry import GUARDS
from .reports import Reports

_FLAG_CAPTURED = 2  # _hotpath FLAG_CAPTURED: graph-owned memory (never guarded)
_EVENTS_KEPT = 1000


# ----------------------------------------------------------------------------------------
# The guard
# ----------------------------------------------------------------------------------------
class Guard(Reports):
    """The guard of one :class:`~cupy_poolmem.DevicePool` (``pool.guard``).

    Created by ``DevicePool(guard=...)``; not instantiated directly.

    Parameters
    ----------
    pool : DevicePool
        The pool it guards.
    options : GuardOptions
        What to check and what to do on a finding.
    ops : object
        Does the device work: fills, compares, stream syncs (a fake in CPU tests).

    Attributes
    ----------
    options : GuardOptions
    events : collections.deque of GuardEvent
        The last 1000 reports, oldest first.
    counts : dict
        Reports by kind since the pool was created (``"use_after_free"``,
        ``"unordered_stream"``, ``"double_free"``, ``"unknown_free"``,
        ``"out_of_bounds"``).

    Examples
    --------
    >>> pool = cupy_poolmem.DevicePool(guard="warn")  # doctest: +SKIP
    >>> pool.guard.stats()["quarantined_blocks"]  # doctest: +SKIP
    0
    >>> pool.guard.verify()  # check every red zone and the quarantine now  # doctest: +SKIP
    """

    def __init__(self, pool: Any, options: GuardOptions, ops: Any) -> None:
        from cupy.cuda.memory import MemoryPointer, UnownedMemory

        self._MP, self._UM = MemoryPointer, UnownedMemory
        self.options = options
        self._pool = pool
        self._raw_malloc = type(pool).malloc  # the hot path's, not this guard's
        self._device = int(pool.device_id)
        self._ops = ops
        self._rz = options.red_zone
        self._q_max_bytes = int(options.quarantine_bytes)  # parsed by GuardOptions
        self._lock = threading.RLock()
        self._live: dict[int, Record] = {}
        self._sorted: list[int] | None = None
        self._passthrough: set[int] = set()  # graph-owned blocks (a capture): not guarded
        self._q: deque[Record] = deque()
        self._q_index: dict[int, Record] = {}
        self._q_bytes = 0
        self._history: OrderedDict[int, Record] = OrderedDict()  # generation -> freed record
        self._pending: deque[GuardError] = deque()
        self.events: deque[GuardEvent] = deque(maxlen=_EVENTS_KEPT)
        self.counts: dict[str, int] = {
            k: 0
            for k in (
                "use_after_free",
                "unordered_stream",
                "double_free",
                "unknown_free",
                "out_of_bounds",
            )
        }
        self.n_internal_errors = 0
        self._warned_internal = False
        self._closed = False  # the pool is closing: no block enters the quarantine
        self.n_unchecked = 0  # quarantined blocks handed to the retirer without a check
        GUARDS.alive.add(self)

    # -- allocation --------------------------------------------------------------------
    def malloc(self, size: Any) -> Any:
        """Allocate ``size`` bytes plus the red zone.

        Parameters
        ----------
        size : int
            Bytes the caller asked for.

        Returns
        -------
        cupy.cuda.MemoryPointer
            ``size`` bytes; the red zone follows them.

        Raises
        ------
        GuardError
            With ``mode="raise"``: the oldest error found since the last call, first.

        Examples
        --------
        >>> pool = cupy_poolmem.DevicePool(guard=True)  # doctest: +SKIP
        >>> ptr = pool.guard.malloc(1024)  # doctest: +SKIP
        """
        if self._pending:
            self._raise_pending()
        if size.__class__ is not int or size <= 0:
            return self._raw_malloc(self._pool, size)  # size 0 and bad sizes: the pool's way
        rz = self._rz
        mp = self._raw_malloc(self._pool, size + rz)
        block = mp.mem._owner
        ptr = int(block.ptr)
        if block.flags & _FLAG_CAPTURED:
            with self._lock:
                self._passthrough.add(ptr)
            return self._MP(self._UM(ptr, size, block, self._device), 0)
        stream = block.stream
        if rz:
            try:
                self._ops.fill(ptr + size, rz, self.options.canary, stream)
            except Exception as exc:
                self._internal(exc)
                rz = 0
        rec = Record(ptr, size, size + self._rz, next(GENERATIONS), stream, call_site(), tag_now())
        rec.red_zone = rz  # 0 when the canary could not be written: nothing to check
        with self._lock:
            self._live[ptr] = rec
            self._sorted = None
        return self._MP(self._UM(ptr, size, block, self._device), 0)

    def note_stream(self, ptr: int, stream_ptr: int) -> None:
        """Note that ``record_stream`` declared ``stream_ptr`` for the block at ``ptr``.

        Parameters
        ----------
        ptr : int
            Start address of a live block.
        stream_ptr : int
            Handle of the stream its free must also wait for.

        Examples
        --------
        >>> pool = cupy_poolmem.DevicePool(guard=True)  # doctest: +SKIP
        >>> with cupy_poolmem.using(pool):  # doctest: +SKIP
        ...     x = cupy.zeros(100)
        >>> s = cupy.cuda.Stream()  # doctest: +SKIP
        >>> pool.guard.note_stream(x.data.ptr, s.ptr)  # doctest: +SKIP
        """
        with self._lock:
            rec = self._live.get(ptr)
            if rec is not None and stream_ptr not in rec.streams:
                rec.streams.append(stream_ptr)

    def generation(self, ptr: int) -> int:
        """The generation of the live block at ``ptr``.

        Parameters
        ----------
        ptr : int
            Start address of a block.

        Returns
        -------
        int
            Its generation, ``0`` when no live block starts there.

        Examples
        --------
        >>> pool = cupy_poolmem.DevicePool(guard=True)  # doctest: +SKIP
        >>> pool.guard.generation(0)  # doctest: +SKIP
        0
        """
        rec = self._live.get(ptr)
        return rec.generation if rec is not None else 0

    # -- free (the pool's release_hook) ------------------------------------------------
    def release(self, ptr: int, size: int, stream: Any) -> bool:
        """Take a freed block: the pool's ``release_hook``.

        Never raises (it runs in destructors); what it finds is reported.

        Parameters
        ----------
        ptr : int
            Start address of the block freed.
        size : int
            Its size as the pool holds it.
        stream : object
            The stream of the free.

        Returns
        -------
        bool
            True when the guard keeps the block (in quarantine), False when the pool
            frees it.

        Examples
        --------
        >>> kept = pool.guard.release(ptr, size, stream)  # doctest: +SKIP
        """
        try:
            return self._release(int(ptr), stream)
        except BaseException as exc:
            self._internal(exc)
            return False

    def _release(self, ptr: int, stream: Any) -> bool:
        with self._lock:
            rec = self._live.pop(ptr, None)
            if rec is not None:
                self._sorted = None
            elif ptr in self._passthrough:
                self._passthrough.discard(ptr)
                return False
        ops = self._ops
        if rec is None:
            return self._bad_free(ptr, "the pool's free", call_site())
        rec.free_site = call_site()
        if GUARDS.in_gc:
            # Freed by the garbage collector: streams in the same garbage may be
            # destroyed already (a CuPy Stream's finalizer), and a check, a fill or an
            # eviction on one crashed the driver; the stream current now says nothing of
            # the block.  The pool frees it at once, unchecked.
            self._remember(rec)
            with self._lock:
                self.n_unchecked += 1
            return False
        cur = ops.current_stream()
        rec.free_stream = cur
        if self.options.cross_stream != "off" and not self._ordered(cur, rec):
            self._report_unordered(rec, cur)
        sptr = rec.stream_ptr
        if ops.capturing(sptr) or ops.capture_underway():
            # Nothing may synchronise now, and a fill would become part of a graph.
            self._remember(rec)
            return False
        if rec.red_zone:
            first, n = ops.find(ptr + rec.size, rec.red_zone, self.options.canary, stream)
            if n:
                self._report_oob(rec, first, n, "when it was freed")
        if self._closed:  # the pool frees it at once (it is closing: no quarantine)
            self._remember(rec)
            return False
        ops.fill(ptr, rec.total, self.options.poison, stream)
        with self._lock:
            # Checked again under the lock: close() empties the quarantine under it, and
            # a block entering after that would never be freed.
            if self._closed:
                entered = False
            else:
                entered = True
                rec.state = QUARANTINED
                self._q.append(rec)
                self._q_index[ptr] = rec
                self._q_bytes += rec.total
        if not entered:
            self._remember(rec)
            return False
        self._evict(everything=False)
        return True

    def _ordered(self, cur: int, rec: Record) -> bool:
        """Whether the free (on ``rec``'s stream) is ordered after work on ``cur``."""
        if cur == rec.stream_ptr or cur in rec.streams or cur <= 2:
            return True  # a default stream current at the free: no sign of other use
        # The legacy default stream and blocking streams order each other implicitly.
        return rec.stream_ptr <= 1 and not self._ops.non_blocking(cur)

    def _evict(self, everything: bool) -> int:
        """Free the oldest quarantined blocks (checked) until within bounds; count them."""
        n = 0
        opts = self.options
        while True:
            with self._lock:
                if not self._q:
                    return n
                if (
                    not everything
                    and self._q_bytes <= self._q_max_bytes
                    and len(self._q) <= opts.quarantine_blocks
                ):
                    return n
                rec = self._q.popleft()
                self._q_index.pop(rec.ptr, None)
                self._q_bytes -= rec.total
            self._leave_quarantine(rec)
            n += 1

    def _leave_quarantine(self, rec: Record) -> None:
        try:
            first, n = self._ops.find(rec.ptr, rec.total, self.options.poison, rec.stream)
        except Exception as exc:
            self._internal(exc)
            first, n = -1, 0
        try:
            if n:
                self._report_uaf(rec, first, n)
        finally:  # never lost: freed whatever the report did
            # Free first: _remember drops the record's reference to its stream, which
            # may be the last one (a stream the program has let go); the CUstream is
            # destroyed then, and a free enqueued on it afterwards crashed the driver.
            self._pool._free_now(rec.ptr, rec.stream_ptr, rec.stream)
            self._remember(rec)

    def take_quarantine(self) -> list[int]:
        """Empty the quarantine without checking or freeing: ``[ptr, ...]``, oldest first.

        For a pool that cannot free on its blocks' streams now (finalized inside a
        garbage cycle, where a stream may be destroyed already; closed during a graph
        capture): the pool hands them to its retirer, which frees them on the legacy
        stream after a device synchronisation.  Their poison is not checked
        (``stats()["unchecked_blocks"]`` counts them).

        Returns
        -------
        list of int
            The quarantined blocks' addresses, oldest first.

        Examples
        --------
        >>> pool = cupy_poolmem.DevicePool(guard=True)  # doctest: +SKIP
        >>> pool.guard.take_quarantine()  # doctest: +SKIP
        []
        """
        with self._lock:
            recs, self._q = list(self._q), deque()
            self._q_index.clear()
            self._q_bytes = 0
            self.n_unchecked += len(recs)
        for rec in recs:
            self._remember(rec)
        return [rec.ptr for rec in recs]

    def _remember(self, rec: Record) -> None:
        """``rec`` is freed (or about to be, by the pool): keep it in the history."""
        rec.state = FREED
        rec.stream = None  # the stream object is needed only until the real free
        if self.options.history:
            with self._lock:
                self._history[rec.generation] = rec
                while len(self._history) > self.options.history:
                    self._history.popitem(last=False)

    # -- lookups -----------------------------------------------------------------------
    def _find_live(self, ptr: int) -> Record | None:
        rec = self._live.get(ptr)
        if rec is not None:
            return rec
        import bisect

        with self._lock:
            if self._sorted is None:
                self._sorted = sorted(self._live)
            keys = self._sorted
            i = bisect.bisect_right(keys, ptr) - 1
            rec = self._live.get(keys[i]) if i >= 0 else None
        return rec if rec is not None and rec.contains(ptr) else None

    def _find_dead(self, ptr: int, generation: int | None = None) -> Record | None:
        with self._lock:
            if generation is not None:
                rec = self._history.get(generation)
                if rec is not None and rec.contains(ptr):
                    return rec
                for rec in self._q:
                    if rec.generation == generation:
                        return rec
            for rec in self._q_index.values():
                if rec.contains(ptr):
                    return rec
            for rec in reversed(self._history.values()):
                if rec.contains(ptr):
                    return rec
        return None

    def knows(self, ptr: int) -> bool:
        """Whether ``ptr`` is in a block this guard handed out.

        Parameters
        ----------
        ptr : int
            Any address.

        Returns
        -------
        bool
            True for an address in a live, quarantined or remembered block.

        Examples
        --------
        >>> pool = cupy_poolmem.DevicePool(guard=True)  # doctest: +SKIP
        >>> pool.guard.knows(0)  # doctest: +SKIP
        False
        """
        return self._find_live(ptr) is not None or self._find_dead(ptr) is not None

    # -- public checks -----------------------------------------------------------------
    def check(self, ptr: int, generation: int | None = None) -> GuardedBlock:
        """The block at ``ptr``, checked; see :func:`cupy_poolmem.check`.

        Parameters
        ----------
        ptr : int
            An address this guard knows (:meth:`knows`).
        generation : int, optional
            The generation the caller holds; an older one is a use after free.

        Returns
        -------
        GuardedBlock
            A snapshot of the live block.

        Raises
        ------
        GuardError
            When the block was freed (or reused) since, or a pending error is found.

        Examples
        --------
        >>> pool = cupy_poolmem.DevicePool(guard=True)  # doctest: +SKIP
        >>> with cupy_poolmem.using(pool):  # doctest: +SKIP
        ...     x = cupy.zeros(100)
        >>> pool.guard.check(x.data.ptr).state  # doctest: +SKIP
        'live'
        """
        if self._pending:
            self._raise_pending()
        rec = self._find_live(ptr)
        if rec is not None and (generation is None or generation == rec.generation):
            return rec.snapshot(self._device)
        dead = self._find_dead(ptr, generation)
        where = f"check(0x{ptr:x}" + (f", generation={generation})" if generation else ")")
        if dead is None and rec is not None:
            msg = (
                f"cupy_poolmem guard: {where}: the address is in live "
                f"{rec.snapshot(self._device).describe()}, allocated at "
                f"{describe_site(rec.alloc_site)}, but you hold generation {generation}, which this "
                f"guard no longer remembers (older than the last {self.options.history} frees). "
                "The allocation you kept the pointer for is gone and its memory was reused: "
                "keep the array (not its pointer) alive while the pointer is used."
            )
            self._report(UseAfterFreeError(msg, rec.snapshot(self._device)), direct=True)
            return rec.snapshot(self._device)
        if dead is None:
            raise InvalidOptionError(
                f"{where}: no block of this pool's guard contains this address"
            )
        snap = dead.snapshot(self._device)
        now = (
            f"the address now belongs to {rec.snapshot(self._device).describe()}, allocated at "
            f"{describe_site(rec.alloc_site)}"
            if rec is not None
            else (
                f"it is still in the quarantine, poisoned with 0x{self.options.poison:02X} bytes"
                if dead.state == QUARANTINED
                else "this pool has not handed the address out again"
            )
        )
        msg = (
            f"cupy_poolmem guard: use after free: {where} points into {snap.describe()}, "
            f"which was freed at {describe_site(dead.free_site)} (allocated at "
            f"{describe_site(dead.alloc_site)}); {now}. Something kept a raw pointer (arr.data.ptr, "
            "DLPack, a Numba or C-library view) after the last array went: keep the array "
            "alive while its pointer is used."
        )
        self._report(UseAfterFreeError(msg, snap), direct=True)
        return snap

    def verify(self) -> int:
        """Check every live block's red zone and every quarantined block now (synchronises).

        Returns
        -------
        int
            The number of problems found.

        Raises
        ------
        GuardError
            With ``mode="raise"``: the first pending error (found now or earlier).

        Examples
        --------
        >>> pool = cupy_poolmem.DevicePool(guard=True)  # doctest: +SKIP
        >>> pool.guard.verify()  # doctest: +SKIP
        0
        """
        found = 0
        with self._lock:
            live = list(self._live.values())
            quarantined = list(self._q)
        for rec in live:
            if not rec.red_zone or rec.state != LIVE or rec.stream is None:
                continue
            first, n = self._ops.find(
                rec.ptr + rec.size, rec.red_zone, self.options.canary, rec.stream
            )
            if n:
                found += 1
                self._report_oob(rec, first, n, "by Guard.verify()")
                # Write the canary again: the same damage is not reported twice.
                self._ops.fill(rec.ptr + rec.size, rec.red_zone, self.options.canary, rec.stream)
        for rec in quarantined:
            if rec.state != QUARANTINED or rec.stream is None:
                continue
            first, n = self._ops.find(rec.ptr, rec.total, self.options.poison, rec.stream)
            if n:
                found += 1
                self._report_uaf(rec, first, n, when="by Guard.verify()")
                self._ops.fill(rec.ptr, rec.total, self.options.poison, rec.stream)
        if self._pending:
            self._raise_pending()
        return found

    def flush(self) -> int:
        """Check and really free every quarantined block.

        The pools call it before a trim, an out-of-memory retry and a close.  Nothing
        is freed while a CUDA graph capture is under way (checks synchronise).

        Returns
        -------
        int
            How many blocks were freed.

        Examples
        --------
        >>> pool = cupy_poolmem.DevicePool(guard=True)  # doctest: +SKIP
        >>> pool.guard.flush()  # doctest: +SKIP
        0
        """
        try:
            if self._ops.capture_underway():
                return 0
        except Exception as exc:
            self._internal(exc)
            return 0
        return self._evict(everything=True)

    def close(self) -> list[int]:
        """Empty the quarantine for a pool that is closing.

        From now on freed blocks are checked and freed at once, never quarantined.
        The quarantine is checked and freed on its blocks' streams (which the records
        keep alive); what cannot be (a graph capture is under way, so nothing may
        synchronise) is returned unchecked, for the retirer to free after its sync.

        Returns
        -------
        list of int
            The addresses the pool must hand to its retirer.

        Examples
        --------
        >>> pool = cupy_poolmem.DevicePool(guard=True)  # doctest: +SKIP
        >>> pool.guard.close()  # doctest: +SKIP
        []
        """
        with self._lock:
            self._closed = True
            if not self._q:
                return []
        self.flush()
        return self.take_quarantine()

    def stats(self) -> dict[str, Any]:
        """Return counts and sizes: live, quarantined, reports by kind, pending errors.

        Returns
        -------
        dict
            ``unchecked_blocks`` counts blocks freed without the guard's checks (freed
            by the garbage collector, or quarantined when the pool was dropped without
            ``close()`` or closed during a graph capture: see :doc:`guard`).

        Examples
        --------
        >>> pool.guard.stats()["counts"]["use_after_free"]  # doctest: +SKIP
        0
        """
        with self._lock:
            return {
                "mode": self.options.mode,
                "live_blocks": len(self._live),
                "quarantined_blocks": len(self._q),
                "quarantined_bytes": self._q_bytes,
                "remembered_frees": len(self._history),
                "unchecked_blocks": self.n_unchecked,
                "counts": dict(self.counts),
                "pending": len(self._pending),
                "internal_errors": self.n_internal_errors,
            }

    def blocks(self) -> list[GuardedBlock]:
        """Return snapshots of the live blocks, then the quarantined ones (oldest first).

        Returns
        -------
        list of GuardedBlock
            One snapshot per block.

        Examples
        --------
        >>> pool = cupy_poolmem.DevicePool(guard=True)  # doctest: +SKIP
        >>> pool.guard.blocks()  # doctest: +SKIP
        []
        """
        with self._lock:
            recs = list(self._live.values()) + list(self._q)
        return [r.snapshot(self._device) for r in recs]

    # -- foreign frees (the Numba plugin) ----------------------------------------------
    def report_foreign_free(self, ptr: int, generation: int, via: str) -> None:
        """A front end freed ``ptr`` (of ``generation``) when it was no longer its to free.

        Called by the Numba plugin when a pointer's finalizer runs after its
        allocation was already freed (for example by the memory manager's ``reset()``):
        the free is not done.  Never raises.

        Parameters
        ----------
        ptr : int
            The address freed.
        generation : int
            The generation the front end held.
        via : str
            Who freed it, as the report says (``"a Numba pointer's finalizer"``).

        Examples
        --------
        >>> pool.guard.report_foreign_free(ptr, gen, "a Numba pointer's finalizer")  # doctest: +SKIP
        """
        try:
            self._bad_free(int(ptr), via, call_site(), generation or None)
        except BaseException as exc:
            self._internal(exc)

    def _bad_free(
        self, ptr: int, via: str, site: str | None, generation: int | None = None
    ) -> bool:
        """A free of a block not live here; True: it was ours already (do not free)."""
        dead = self._find_dead(ptr, generation)
        if dead is not None:
            snap = dead.snapshot(self._device)
            msg = (
                f"cupy_poolmem guard: double free of {snap.describe()}: freed at "
                f"{describe_site(dead.free_site)}, then again through {via} at {describe_site(site)} "
                f"(allocated at {describe_site(dead.alloc_site)}). The second free was not done. "
                "Two owners free the same memory: give each allocation one owner (for Numba, "
                "do not reset() the memory manager while device arrays are alive; do not "
                "free() a pointer something else frees)."
            )
            self._report(DoubleFreeError(msg, snap))
            return True
        msg = (
            f"cupy_poolmem guard: free of pointer 0x{ptr:x} through {via} at {describe_site(site)}, "
            "which this pool's guard never handed out (or freed longer ago than the last "
            f"{self.options.history} frees it remembers). Memory must go back to the "
            "allocator it came from."
        )
        self._report(DoubleFreeError(msg, None, unknown=True))
        return False

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"<Guard mode={s['mode']} live={s['live_blocks']} "
            f"quarantined={s['quarantined_blocks']} ({format_bytes(s['quarantined_bytes'])}) "
            f"reports={sum(s['counts'].values())}>"
        )


def attach(pool: Any, options: GuardOptions, ops: Any = None) -> Guard:
    """Put ``pool`` under a guard: its ``malloc``, ``release_hook`` and ``guard`` attributes.

    ``ops`` does the device work (``device_ops.DeviceOps`` by default; a fake in CPU
    tests).  The pool's reuse cache is turned off: freed blocks go to the quarantine.
    """
    if ops is None:
        # Late: device_ops imports cupy, which CPU tests and the base install
        # (GuardOptions, resolve) do without.
        from .device_ops import DeviceOps

        ops = DeviceOps(int(pool.device_id))
        ops.prepare()
    GUARDS.watch_gc()
    g = Guard(pool, options, ops)
    pool.cache_limit = 0
    pool.cache_max_block = 0
    pool.guard = g
    pool.release_hook = g.release
    pool.malloc = g.malloc
    return g
