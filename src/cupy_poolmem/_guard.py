"""Guard mode: catch use-after-free, double frees, out-of-bounds writes and unordered reuse.

A stream-ordered pool hands freed memory to the next allocation at once, so a raw
pointer kept after its array died, a kernel writing past its array, or a stream still
reading a block another stream reuses give wrong numbers far from their cause.  The
guard, opt-in per pool (``DevicePool(guard=True)``, ``set_allocator(guard=True)`` or
``CUPY_POOLMEM_GUARD=1``), makes those bugs loud:

- every block is allocated with a *red zone* of ``red_zone`` bytes after its end,
  filled with the ``canary`` byte on the allocation stream and checked when the block
  is freed (:class:`~cupy_poolmem.OutOfBoundsWriteError`);
- a freed block is *poisoned* (filled with the ``poison`` byte, on its stream) and
  kept in a FIFO *quarantine* bounded by bytes and by count; when it leaves, to be
  really freed, the pattern must be intact (:class:`~cupy_poolmem.UseAfterFreeError`);
- every allocation gets a *generation*, a number no other allocation of the process
  shares, and :func:`check` tells whether a pointer (and generation) still names a
  live allocation;
- frees of blocks already freed, or of pointers the guard never handed out, are
  reported (:class:`~cupy_poolmem.DoubleFreeError`) and not done;
- a block dropped while another stream is current that was not declared with
  :func:`~cupy_poolmem.record_stream` is reported
  (:class:`~cupy_poolmem.UnorderedReuseError`, a heuristic: see ``cross_stream``).

How it plugs in (the normal path pays nothing): :func:`attach` replaces the pool's
``malloc`` with :meth:`Guard.malloc` (an instance attribute, so ``pool.malloc`` and
everything that calls it go through the guard) and installs :meth:`Guard.release` as
the pool's ``release_hook``, which every free of a pool block reaches: a block's last
reference (``Block.__dealloc__``), the Numba plugin (through the same blocks) and the
sharing limbo (``Exporter._free``).  ``set_allocator(guard=...)`` installs a
dispatch object that calls ``pool.malloc`` instead of the hot path's C-level one.  The
device work (fills, checks, stream questions) is in ``_guard_device.py``; CPU tests
give the guard a fake of it.

Errors found inside a destructor cannot be raised there: in ``mode="raise"`` they
wait, and the next allocation from the pool, :meth:`Guard.verify` or :func:`check`
raises them (one per call); in ``mode="warn"`` a :class:`~cupy_poolmem.GuardWarning`
is issued at once.  Both count them and keep them in ``pool.guard.events``.

Quarantined blocks count as freed for the pool (``n_frees``), so the pool's retirement
(``_retire.py``: its CUDA pool destroyed only after a device synchronisation) must
never leave one behind.  ``Pool.close()`` marks the guard closed (later frees are
checked and freed at once) and frees the quarantine, checked, on the blocks' own
streams, which the records keep alive until then; if nothing may synchronise (a graph
capture under way) the rest goes to the retirer as leftovers.  A pool finalized
without ``close()`` (always inside a garbage collection: the pool and its guard
reference each other) hands its whole quarantine to the retirer unchecked, as it does
its reuse cache: a stream in the same garbage may be destroyed already.  Blocks freed
by the garbage collector are freed at once, unchecked, for the same reason.
``stats()["unchecked_blocks"]`` counts both.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import sys
import threading
import time
import warnings
import weakref
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ._errors import (
    DoubleFreeError,
    GuardError,
    GuardWarning,
    InvalidOptionError,
    OptionTypeError,
    OutOfBoundsWriteError,
    UnorderedReuseError,
    UsageError,
    UseAfterFreeError,
)
from ._sizes import format_bytes, parse_bytes

__all__ = [
    "GuardOptions",
    "GuardedBlock",
    "GuardEvent",
    "Guard",
    "check",
    "attach",
    "resolve",
    "ENV",
]

#: The environment variable read by pools created with ``guard=None`` (the default).
ENV = "CUPY_POOLMEM_GUARD"

_MODES = ("raise", "warn")
_CROSS = ("raise", "warn", "off")
_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")
_FLAG_CAPTURED = 2  # _hotpath FLAG_CAPTURED: graph-owned memory (never guarded)
_MAX_RED_ZONE = 1 << 20
_EVENTS_KEPT = 1000

LIVE = "live"
QUARANTINED = "quarantined"
FREED = "freed"

# One generation counter for the whole process: (pointer, generation) never repeats,
# and a generation alone names one allocation, whichever pool made it.
_generations = itertools.count(1)
_WEAKREF_FILE = weakref.__file__


# ----------------------------------------------------------------------------------------
# Options
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GuardOptions:
    """What the guard checks, and whether it raises or warns.

    Parameters
    ----------
    mode : {"raise", "warn"}
        ``"raise"`` (default): a bug raises its :class:`~cupy_poolmem.GuardError`
        subclass; found during a free (a destructor, where nothing can be raised) it
        is raised by the next allocation from the pool, :meth:`Guard.verify` or
        :func:`~cupy_poolmem.check`.  ``"warn"``: a
        :class:`~cupy_poolmem.GuardWarning` at once, and the program goes on.  Both
        count every report (:meth:`Guard.stats`) and keep it in ``pool.guard.events``.
    red_zone : int
        Bytes after each block filled with ``canary`` and checked when it is freed;
        writes further past the end than this are not seen.  ``0`` turns the check
        off.  Default 256 (32 ``float64`` elements).
    quarantine_bytes : int or str
        Most bytes of freed blocks held back (poisoned) before they are really freed;
        the oldest leave first.  Default ``"256MiB"``; ``0`` frees at once (after the
        check).
    quarantine_blocks : int
        Most blocks held back.  Default 1024.
    cross_stream : {"warn", "raise", "off"}
        What to do when a block is dropped while a stream other than its allocation
        stream is current and that stream was not given to
        :func:`~cupy_poolmem.record_stream`.  A heuristic (the guard cannot see which
        streams used an array), so it warns by default.
    poison : int
        Byte written over freed blocks (default ``0xFD``: ``float32``/``float64``
        values near ``-4e37``/``-1e295``, ``int32`` ``-33686019``).
    canary : int
        Byte written into red zones (default ``0xFA``).
    history : int
        Freed blocks remembered for reports (double frees, stale pointers).
        Default 16384.

    Examples
    --------
    >>> GuardOptions(mode="warn", red_zone=1024).quarantine_bytes
    268435456
    >>> GuardOptions.from_env("warn,quarantine_bytes=1GiB,cross_stream=off").cross_stream
    'off'
    >>> GuardOptions.from_env("0") is None
    True
    """

    mode: str = "raise"
    red_zone: int = 256
    quarantine_bytes: int | str = "256MiB"
    quarantine_blocks: int = 1024
    cross_stream: str = "warn"
    poison: int = 0xFD
    canary: int = 0xFA
    history: int = 16384

    def __post_init__(self) -> None:
        _choice(self.mode, "mode", _MODES)
        _choice(self.cross_stream, "cross_stream", _CROSS)
        _int(self.red_zone, "red_zone", 0, _MAX_RED_ZONE)
        _int(self.quarantine_blocks, "quarantine_blocks", 0, None)
        _int(self.poison, "poison", 0, 255)
        _int(self.canary, "canary", 0, 255)
        _int(self.history, "history", 0, None)
        q = parse_bytes(self.quarantine_bytes, name="quarantine_bytes")
        object.__setattr__(self, "quarantine_bytes", q)

    @classmethod
    def from_env(cls, value: str | None = None, *, name: str = ENV) -> GuardOptions | None:
        """Options from a ``CUPY_POOLMEM_GUARD``-style string (``None``: the variable).

        Parameters
        ----------
        value : str, optional
            Comma-separated: a switch (``1``/``on``/``true``/``yes``/``raise``,
            ``warn``, or ``0``/``off``/``false``/``no`` alone), then ``field=value``
            pairs for any field of this class, in any order.  Not given: the
            environment variable ``name``.
        name : str, default "CUPY_POOLMEM_GUARD"
            The variable read when ``value`` is not given, and named in errors.

        Returns
        -------
        GuardOptions or None
            ``None`` (no guard) when the text is empty or off.

        Raises
        ------
        InvalidOptionError
            For an unknown switch or field, or a value that does not parse.

        Examples
        --------
        >>> GuardOptions.from_env("1").mode
        'raise'
        >>> GuardOptions.from_env("red_zone=64").red_zone
        64
        """
        if value is None:
            value = os.environ.get(name, "")
        text = value.strip()
        if text.lower() in _OFF:
            return None
        kw: dict[str, Any] = {}
        valid = [f.name for f in fields(cls)]
        for raw in text.split(","):
            tok = raw.strip()
            if not tok:
                continue
            low = tok.lower()
            if "=" not in tok:
                if low in _ON or low == "raise":
                    kw.setdefault("mode", "raise")
                elif low == "warn":
                    kw["mode"] = "warn"
                else:
                    raise InvalidOptionError(
                        f"{name}={value!r}: {tok!r} is not a switch; use 1 (raise), warn or 0, "
                        f"then field=value pairs among {', '.join(valid)} "
                        f"(for example {name}=warn,quarantine_bytes=1GiB)"
                    )
                continue
            key, _, val = (s.strip() for s in tok.partition("="))
            if key not in valid:
                raise InvalidOptionError(
                    f"{name}={value!r}: unknown field {key!r}; valid fields: {', '.join(valid)}"
                )
            if key in ("mode", "cross_stream", "quarantine_bytes"):
                kw[key] = val
            else:
                try:
                    kw[key] = int(val, 0)
                except ValueError:
                    raise InvalidOptionError(
                        f"{name}={value!r}: {key} must be an integer (decimal or 0x..); got {val!r}"
                    ) from None
        return cls(**kw)


def _choice(value: Any, name: str, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str):
        raise OptionTypeError(
            f"guard option {name} must be one of {', '.join(map(repr, allowed))}; got {value!r}"
        )
    if value not in allowed:
        raise InvalidOptionError(
            f"guard option {name}={value!r} is not one of {', '.join(map(repr, allowed))}"
        )


def _int(value: Any, name: str, lo: int, hi: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionTypeError(f"guard option {name} must be an int; got {value!r}")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise InvalidOptionError(f"guard option {name}={value} must be {rng}")


def resolve(guard: Any) -> GuardOptions | None:
    """The options a pool's ``guard=`` argument asks for; ``None``: no guard.

    ``None`` (the default) reads ``CUPY_POOLMEM_GUARD``; ``False``/``True``; a mode
    string (``"raise"``, ``"warn"``, or a ``CUPY_POOLMEM_GUARD``-style string); a
    mapping of :class:`GuardOptions` fields; or a :class:`GuardOptions`.
    """
    if guard is None:
        return GuardOptions.from_env()
    if guard is False:
        return None
    if guard is True:
        return GuardOptions()
    if isinstance(guard, GuardOptions):
        return guard
    if isinstance(guard, str):
        return GuardOptions.from_env(guard, name="guard")
    if isinstance(guard, Mapping):
        valid = {f.name for f in fields(GuardOptions)}
        bad = sorted(set(guard) - valid)
        if bad:
            raise InvalidOptionError(
                f"guard={dict(guard)!r}: unknown field(s) {', '.join(map(str, bad))}; "
                f"valid fields: {', '.join(sorted(valid))}"
            )
        return GuardOptions(**guard)
    raise OptionTypeError(
        f"guard must be True, False, None (read {ENV}), 'raise', 'warn', a dict of "
        f"GuardOptions fields or a GuardOptions; got {guard!r} of type {type(guard).__name__}"
    )


# ----------------------------------------------------------------------------------------
# Blocks and events
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GuardedBlock:
    """A snapshot of one allocation the guard knows, as :func:`check` returns it.

    Attributes
    ----------
    ptr, size : int
        Address and size the program asked for (the red zone follows it).
    generation : int
        Unique to this allocation: an address handed out again gets a new one.
    state : {"live", "quarantined", "freed"}
    device : int
    stream : int
        Handle of the allocation stream.
    streams : tuple of int
        The allocation stream, then the streams given to ``record_stream``.
    tag : str
        Tag path at allocation (:func:`~cupy_poolmem.tag`), ``""`` if none.
    alloc_site, free_site : str or None
        ``file:line in function`` of the allocation and of the free.
    free_stream : int or None
        The stream current when it was freed.

    Examples
    --------
    >>> with cupy_poolmem.using(cupy_poolmem.DevicePool(guard=True)):  # doctest: +SKIP
    ...     x = cupy.zeros(1000)
    >>> block = cupy_poolmem.check(x)  # doctest: +SKIP
    >>> block.state, block.size  # doctest: +SKIP
    ('live', 8000)
    """

    ptr: int
    size: int
    generation: int
    state: str
    device: int
    stream: int
    streams: tuple[int, ...]
    tag: str
    alloc_site: str | None
    free_site: str | None
    free_stream: int | None

    def describe(self) -> str:
        """One line naming the block: address, size, generation and device.

        Returns
        -------
        str
            ``"block 0x7f... (4,096 bytes, generation 17, device 0)"``.

        Examples
        --------
        >>> b = GuardedBlock(0x7F00, 4096, 17, "live", 0, 0, (0,), "", None, None, None)
        >>> b.describe()
        'block 0x7f00 (4,096 bytes, generation 17, device 0)'
        """
        return (
            f"block 0x{self.ptr:x} ({self.size:,} bytes, generation {self.generation}, "
            f"device {self.device})"
        )


@dataclass(frozen=True)
class GuardEvent:
    """One report of the guard (kept in ``pool.guard.events``, written to the log).

    Attributes
    ----------
    kind : str
        As :attr:`GuardError.kind <cupy_poolmem.GuardError>`.
    time : float
        ``time.time()`` when it was found.
    error : GuardError
        The error raised (``mode="raise"``) or described by the warning.

    Examples
    --------
    >>> pool = cupy_poolmem.DevicePool(guard="warn")  # doctest: +SKIP
    >>> # ... a kernel writes into an array after it was freed ...
    >>> pool.guard.verify()  # doctest: +SKIP
    >>> event = pool.guard.events[-1]  # doctest: +SKIP
    >>> event.kind, type(event.error).__name__  # doctest: +SKIP
    ('use_after_free', 'UseAfterFreeError')
    """

    kind: str
    time: float
    error: GuardError = field(repr=False)

    @property
    def block(self) -> GuardedBlock | None:
        """The block concerned, when known.

        Examples
        --------
        >>> from cupy_poolmem import UseAfterFreeError
        >>> GuardEvent("use_after_free", 0.0, UseAfterFreeError("written after free")).block
        """
        return self.error.block

    @property
    def message(self) -> str:
        """The error's text.

        Examples
        --------
        >>> from cupy_poolmem import UseAfterFreeError
        >>> GuardEvent("use_after_free", 0.0, UseAfterFreeError("written after free")).message
        'written after free'
        """
        return str(self.error)


class _Rec:
    """The guard's mutable record of one allocation."""

    __slots__ = (
        "ptr",
        "size",
        "total",
        "generation",
        "state",
        "stream_ptr",
        "stream",
        "streams",
        "tag",
        "alloc_site",
        "free_site",
        "free_stream",
        "red_zone",
    )

    def __init__(
        self, ptr: int, size: int, total: int, gen: int, stream: Any, site: Any, tag: str
    ) -> None:
        self.ptr, self.size, self.total, self.generation = ptr, size, total, gen
        self.state = LIVE
        self.stream = stream
        self.stream_ptr = int(stream.ptr)
        self.streams: list[int] = [self.stream_ptr]
        self.tag = tag
        self.alloc_site: str | None = site
        self.free_site: str | None = None
        self.free_stream: int | None = None
        self.red_zone = total - size

    def contains(self, ptr: int) -> bool:
        return self.ptr <= ptr < self.ptr + max(self.size, 1)

    def snapshot(self, device: int) -> GuardedBlock:
        return GuardedBlock(
            ptr=self.ptr,
            size=self.size,
            generation=self.generation,
            state=self.state,
            device=device,
            stream=self.stream_ptr,
            streams=tuple(self.streams),
            tag=self.tag,
            alloc_site=self.alloc_site,
            free_site=self.free_site,
            free_stream=self.free_stream,
        )


def _site() -> str | None:
    """The call site of the guard's caller: the first frame outside the packages that
    tracking skips (:func:`cupy_poolmem.track`'s list) and outside ``weakref``."""
    from ._observe.observer import _OBSERVER

    skip = _OBSERVER._skip if _OBSERVER._skip is not None else _OBSERVER._skip_prefixes()
    f: Any = sys._getframe(1)
    for _ in range(_OBSERVER.depth + 8):
        if f is None:
            return None
        fn = f.f_code.co_filename
        if not fn.startswith(skip) and fn != _WEAKREF_FILE:
            return f"{fn}:{f.f_lineno} in {f.f_code.co_name}"
        f = f.f_back
    return None


def _where(site: str | None) -> str:
    return site or "(unknown: no Python frame outside cupy_poolmem, CuPy and Numba)"


# ----------------------------------------------------------------------------------------
# The guard
# ----------------------------------------------------------------------------------------
class Guard:
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
        self._live: dict[int, _Rec] = {}
        self._sorted: list[int] | None = None
        self._passthrough: set[int] = set()  # graph-owned blocks (a capture): not guarded
        self._q: deque[_Rec] = deque()
        self._q_index: dict[int, _Rec] = {}
        self._q_bytes = 0
        self._history: OrderedDict[int, _Rec] = OrderedDict()  # generation -> freed record
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
        _GUARDS.add(self)

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
        rec = _Rec(ptr, size, size + self._rz, next(_generations), stream, _site(), _current_tag())
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
            return self._bad_free(ptr, "the pool's free", _site())
        rec.free_site = _site()
        if _IN_GC[0]:
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

    def _ordered(self, cur: int, rec: _Rec) -> bool:
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

    def _leave_quarantine(self, rec: _Rec) -> None:
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

    def _remember(self, rec: _Rec) -> None:
        """``rec`` is freed (or about to be, by the pool): keep it in the history."""
        rec.state = FREED
        rec.stream = None  # the stream object is needed only until the real free
        if self.options.history:
            with self._lock:
                self._history[rec.generation] = rec
                while len(self._history) > self.options.history:
                    self._history.popitem(last=False)

    # -- lookups -----------------------------------------------------------------------
    def _find_live(self, ptr: int) -> _Rec | None:
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

    def _find_dead(self, ptr: int, generation: int | None = None) -> _Rec | None:
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
                f"{_where(rec.alloc_site)}, but you hold generation {generation}, which this "
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
            f"{_where(rec.alloc_site)}"
            if rec is not None
            else (
                f"it is still in the quarantine, poisoned with 0x{self.options.poison:02X} bytes"
                if dead.state == QUARANTINED
                else "this pool has not handed the address out again"
            )
        )
        msg = (
            f"cupy_poolmem guard: use after free: {where} points into {snap.describe()}, "
            f"which was freed at {_where(dead.free_site)} (allocated at "
            f"{_where(dead.alloc_site)}); {now}. Something kept a raw pointer (arr.data.ptr, "
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
            self._bad_free(int(ptr), via, _site(), generation or None)
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
                f"{_where(dead.free_site)}, then again through {via} at {_where(site)} "
                f"(allocated at {_where(dead.alloc_site)}). The second free was not done. "
                "Two owners free the same memory: give each allocation one owner (for Numba, "
                "do not reset() the memory manager while device arrays are alive; do not "
                "free() a pointer something else frees)."
            )
            self._report(DoubleFreeError(msg, snap))
            return True
        msg = (
            f"cupy_poolmem guard: free of pointer 0x{ptr:x} through {via} at {_where(site)}, "
            "which this pool's guard never handed out (or freed longer ago than the last "
            f"{self.options.history} frees it remembers). Memory must go back to the "
            "allocator it came from."
        )
        self._report(DoubleFreeError(msg, None, unknown=True))
        return False

    # -- reports -----------------------------------------------------------------------
    def _report_oob(self, rec: _Rec, first: int, n: int, when: str) -> None:
        snap = rec.snapshot(self._device)
        past = first  # offset into the red zone
        msg = (
            f"cupy_poolmem guard: out-of-bounds write past the end of {snap.describe()}: "
            f"{n} byte(s) of the {rec.red_zone}-byte red zone after it were changed, the "
            f"first at offset {rec.size + past:,} ({past} byte(s) past the end), found "
            f"{when}. Allocated at {_where(rec.alloc_site)}"
            + (f"; freed at {_where(rec.free_site)}" if rec.free_site else "")
            + ". A kernel or library wrote beyond the array: check its bounds test "
            "(i < n), its grid size and the sizes given to raw kernels or C libraries."
        )
        self._report(OutOfBoundsWriteError(msg, snap, rec.size + past, n))

    def _report_uaf(
        self, rec: _Rec, first: int, n: int, when: str = "when it left the quarantine"
    ) -> None:
        snap = rec.snapshot(self._device)
        part = "its red zone" if first >= rec.size else "the block"
        msg = (
            f"cupy_poolmem guard: write after free into {snap.describe()}: {n} byte(s) "
            f"changed after it was freed, the first at offset {first:,} (in {part}), found "
            f"{when}. Allocated at {_where(rec.alloc_site)}; freed at "
            f"{_where(rec.free_site)} (stream 0x{rec.stream_ptr:x}). Something kept a raw "
            "pointer (arr.data.ptr, DLPack, a Numba or C-library view) or work on another "
            "stream still wrote after the last array went: keep the array alive while its "
            "memory is used, and call cupy_poolmem.record_stream(array, stream) for other "
            "streams (or synchronize) before dropping it."
        )
        self._report(UseAfterFreeError(msg, snap, first, n))

    def _report_unordered(self, rec: _Rec, cur: int) -> None:
        snap = rec.snapshot(self._device)
        msg = (
            f"cupy_poolmem guard: {snap.describe()} allocated on stream 0x{rec.stream_ptr:x} "
            f"was freed at {_where(rec.free_site)} while stream 0x{cur:x} was current, which "
            "is neither its allocation stream nor recorded with record_stream: the pool "
            f"reuses the memory in the order of stream 0x{rec.stream_ptr:x} only, possibly "
            f"while 0x{cur:x} still uses it. Allocated at {_where(rec.alloc_site)}. Call "
            "cupy_poolmem.record_stream(array, stream) for every other stream that uses the "
            "array before dropping it (or synchronize that stream first). If that stream "
            "never used it, this is a false alarm: drop the array outside its `with "
            "stream:` block, or pass GuardOptions(cross_stream='off')."
        )
        self._report(UnorderedReuseError(msg, snap))

    def _report(self, err: GuardError, direct: bool = False) -> None:
        """Count, remember and log ``err``; raise, queue or warn it as the options say."""
        kind = err.kind
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.events.append(GuardEvent(kind, time.time(), err))
        _log(self._pool, err)
        policy = self.options.cross_stream if kind == "unordered_stream" else self.options.mode
        if policy == "warn":
            with contextlib.suppress(Exception):
                warnings.warn(str(err), GuardWarning, stacklevel=3)
        elif policy == "raise":
            if direct:
                raise err
            self._pending.append(err)

    def _raise_pending(self) -> None:
        try:
            err = self._pending.popleft()
        except IndexError:
            return
        raise err

    def raise_pending(self) -> None:
        """Raise the oldest error found in a destructor and not raised yet (if any).

        Raises
        ------
        GuardError
            That error.

        Examples
        --------
        >>> pool = cupy_poolmem.DevicePool(guard=True)  # doctest: +SKIP
        >>> pool.guard.raise_pending()  # doctest: +SKIP
        """
        self._raise_pending()

    def _internal(self, exc: BaseException) -> None:
        self.n_internal_errors += 1
        if not self._warned_internal:
            self._warned_internal = True
            with contextlib.suppress(BaseException):
                warnings.warn(
                    f"cupy_poolmem guard: a check could not run ({exc!r}); later failures are "
                    "only counted (pool.guard.stats()['internal_errors'])",
                    RuntimeWarning,
                    stacklevel=3,
                )

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"<Guard mode={s['mode']} live={s['live_blocks']} "
            f"quarantined={s['quarantined_blocks']} ({format_bytes(s['quarantined_bytes'])}) "
            f"reports={sum(s['counts'].values())}>"
        )


def _current_tag() -> str:
    from ._observe.tags import current_tag

    return current_tag() or ""


def _log(pool: Any, err: GuardError) -> None:
    """Write a ``guard:<kind>`` line to the allocation log (when one is open)."""
    from ._observe.observer import _log_guard_event

    b = err.block
    sites = ""
    if b is not None:
        sites = f"alloc {b.alloc_site or '?'}" + (f" | free {b.free_site}" if b.free_site else "")
    _log_guard_event(
        pool,
        f"guard:{err.kind}",
        b.ptr if b is not None else 0,
        b.size if b is not None else 0,
        b.stream if b is not None else 0,
        b.tag if b is not None else "",
        sites,
    )


# Guards alive, for check() on raw pointers and the exit report of unraised errors.
_GUARDS: weakref.WeakSet[Guard] = weakref.WeakSet()
# Whether a garbage collection is under way (its finalizers free blocks): set by a
# gc callback installed with the first guard.
_IN_GC = [False]


def _gc_phase(phase: str, info: Any) -> None:
    _IN_GC[0] = phase == "start"


def _watch_gc() -> None:
    import gc

    if _gc_phase not in gc.callbacks:
        gc.callbacks.append(_gc_phase)


@atexit.register
def _unraised_at_exit() -> None:
    for g in list(_GUARDS):
        for err in list(g._pending):
            with contextlib.suppress(Exception):
                sys.stderr.write(f"cupy_poolmem guard (found, never raised): {err}\n")


def attach(pool: Any, options: GuardOptions, ops: Any = None) -> Guard:
    """Put ``pool`` under a guard: its ``malloc``, ``release_hook`` and ``guard`` attributes.

    ``ops`` does the device work (``_guard_device.DeviceOps`` by default; a fake in CPU
    tests).  The pool's reuse cache is turned off: freed blocks go to the quarantine.
    """
    if ops is None:
        from ._guard_device import DeviceOps

        ops = DeviceOps(int(pool.device_id))
        ops.prepare()
    _watch_gc()
    g = Guard(pool, options, ops)
    pool.cache_limit = 0
    pool.cache_max_block = 0
    pool.guard = g
    pool.release_hook = g.release
    pool.malloc = g.malloc
    return g


# ----------------------------------------------------------------------------------------
# check()
# ----------------------------------------------------------------------------------------
def check(obj: Any, generation: int | None = None) -> GuardedBlock:
    """Assert that a pointer (or array) still names a live allocation of a guarded pool.

    Code that keeps raw pointers (``arr.data.ptr`` given to a C library, a DLPack or
    Numba consumer) records the generation once, then checks before each use: an
    address freed since, or handed out again to another allocation, raises
    :class:`~cupy_poolmem.UseAfterFreeError` naming both allocations and where the
    first was freed.  In ``mode="warn"`` it warns and returns the snapshot of the
    freed block instead.  Errors found earlier in destructors are raised first.

    Parameters
    ----------
    obj : cupy.ndarray, int, cupy.cuda.MemoryPointer or object with ``__cuda_array_interface__``
        The memory; an address may point inside a block.
    generation : int, optional
        The generation the pointer was taken from (``check(arr).generation``); without
        it, any live allocation at the address passes.

    Returns
    -------
    GuardedBlock
        The block the pointer is in.

    Raises
    ------
    UseAfterFreeError
        The allocation is gone (freed or quarantined), or the address now belongs
        to another generation.
    UsageError
        No guarded pool exists in this process.
    InvalidOptionError
        No guarded pool knows the address.

    Examples
    --------
    >>> pool = cupy_poolmem.DevicePool(guard=True)  # doctest: +SKIP
    >>> with cupy_poolmem.using(pool):  # doctest: +SKIP
    ...     x = cupy.zeros(1000)
    >>> ptr, gen = x.data.ptr, cupy_poolmem.check(x).generation  # doctest: +SKIP
    >>> cupy_poolmem.check(ptr, gen).state  # doctest: +SKIP
    'live'
    >>> del x  # doctest: +SKIP
    >>> cupy_poolmem.check(ptr, gen)  # doctest: +SKIP
    Traceback (most recent call last):
    cupy_poolmem.UseAfterFreeError: cupy_poolmem guard: use after free: check(0x7f..., ...
    """
    if generation is not None and (isinstance(generation, bool) or not isinstance(generation, int)):
        raise OptionTypeError(f"generation must be an int or None; got {generation!r}")
    guard, ptr = _locate(obj, generation)
    return guard.check(ptr, generation)


def _rank(g: Guard, ptr: int, generation: int | None) -> tuple[int, int]:
    """How well guard ``g`` knows ``ptr``: (live 3 / quarantined 2 / remembered 1 / not 0,
    the generation found), so that the newest knowledge of an address wins."""
    rec = g._find_live(ptr)
    if rec is not None and (generation is None or rec.generation == generation):
        return 3, rec.generation
    dead = g._find_dead(ptr, generation)
    if dead is not None and generation is not None and dead.generation == generation:
        return 4, dead.generation  # the generation asked for: only one guard can have it
    if rec is not None:
        return 3, rec.generation
    if dead is not None:
        return (2 if dead.state == QUARANTINED else 1), dead.generation
    return 0, 0


def _locate(obj: Any, generation: int | None = None) -> tuple[Guard, int]:
    owner = None
    if isinstance(obj, bool):
        raise OptionTypeError(f"check() takes an array, a MemoryPointer or an int; got {obj!r}")
    if isinstance(obj, int):
        ptr = obj
    else:
        data = getattr(obj, "data", None)
        mem = getattr(data, "mem", None) if data is not None else getattr(obj, "mem", None)
        if mem is not None and hasattr(data if data is not None else obj, "ptr"):
            ptr = int((data if data is not None else obj).ptr)
            owner = getattr(mem, "_owner", None)
        elif hasattr(obj, "__cuda_array_interface__"):
            ptr = int(obj.__cuda_array_interface__["data"][0])
        else:
            raise OptionTypeError(
                "check() takes a cupy.ndarray, a cupy.cuda.MemoryPointer, an object with "
                f"__cuda_array_interface__ or an int address; got {type(obj).__name__}"
            )
    core = getattr(owner, "core", None)
    if core is not None:
        g = getattr(core, "guard", None)
        if g is None:
            raise UsageError(
                f"check(): this memory comes from {core!r}, which has no guard; create the "
                f"pool with guard=True (or set {ENV}=1) to check pointers"
            )
        return g, ptr
    guards = list(_GUARDS)
    if not guards:
        raise UsageError(
            "check(): no pool in this process has a guard; use DevicePool(guard=True), "
            f"cupy_poolmem.set_allocator(guard=True) or {ENV}=1"
        )
    # Several pools may have used an address over time: the guard that knows it best
    # (the generation asked for, live, quarantined, then the newest freed) answers.
    best = max(((_rank(g, ptr, generation), i) for i, g in enumerate(guards)), default=None)
    if best is not None and best[0][0] > 0:
        return guards[best[1]], ptr
    raise InvalidOptionError(
        f"check(0x{ptr:x}): no guarded pool has allocated this address (or freed it "
        "recently enough to remember); it is not memory from a guarded cupy_poolmem pool"
    )
