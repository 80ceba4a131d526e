"""Observability: scoped statistics, tags, an allocation log and call-site tracking.

Everything here is fed by one *recorder* (``_hotpath.Recorder``, compiled with the hot
path; ``_hotpath_py.Recorder`` is its twin) that the pools call after each allocation
and when each block is freed.  It is installed on the pools (``pool.observer``) only
while something needs it: an active :func:`~cupy_poolmem.statistics` scope, an open log
(:func:`~cupy_poolmem.start_log`), or tracking (:func:`~cupy_poolmem.track`).  When all
of those are off, ``pool.observer`` is ``None`` and the hot path pays nothing.
:func:`~cupy_poolmem.tag` never installs anything: it is a thread-local push/pop.

Cost design
-----------
Per allocation the recorder bumps C counters (each open scope's totals and its
per-tag counts), keeps the allocation's :class:`Info` for :func:`outstanding`, and,
while a log is open, appends a fixed-size record (time, pointer, size, stream,
device, used/reserved, and references to the op, thread name, tag and call-site
strings) to a batch.  A call site is looked up by code object and line in a cache,
so a repeated site costs two dictionary look-ups.  The log writer, a thread of this
module, takes full batches (and every ``LOG_INTERVAL_S`` the partly filled one) and
formats their CSV lines in C without the GIL: the allocating thread never formats or
writes a line.

Concurrency design
------------------
The recorder does what may run Python code first (the time, the tag, the call site,
a new record object), then changes the counters and appends the log record in one
step with no Python code inside: the GIL makes that step atomic between threads (the
twin takes a lock), so the order of log lines is the order in which the counters
changed.  A free that the garbage collector triggers in the middle of an allocation
(``Block.__dealloc__`` may run at almost any point) lands before or after that step,
never inside it.  No hook ever raises: errors are counted in ``_OBSERVER.n_errors``,
the first one warned about.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import threading
import time
import warnings
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ._errors import InvalidOptionError, OptionTypeError
from ._sizes import format_bytes

__all__ = [
    "LOG_COLUMNS",
    "Allocation",
    "Outstanding",
    "Statistics",
    "TagStatistics",
    "current_tag",
    "flush_log",
    "get_statistics",
    "is_tracking",
    "log_path",
    "outstanding",
    "start_log",
    "statistics",
    "stop_log",
    "tag",
    "track",
]

#: Columns of the allocation log, in order (see :func:`~cupy_poolmem.start_log`).
LOG_COLUMNS: tuple[str, ...] = (
    "time",
    "pid",
    "thread",
    "device",
    "stream",
    "op",
    "pointer",
    "size",
    "tag",
    "callsite",
    "used",
    "reserved",
)

#: Seconds between two writes of the log's records by its writer thread (a full batch
#: of 4096 records, the hot path's ``LOG_BATCH``, is written at once).
LOG_INTERVAL_S = 0.1
_KIND_NAMES = {0: "device", 1: "pinned", 2: "managed"}
_KINDS = {v: k for k, v in _KIND_NAMES.items()}
# Beyond this many full batches not yet written (4096 records each: 64 is about 20 MB)
# the allocating thread waits for the writer and writes them itself (bounded memory);
# if the writer is stuck in a write for _MAX_WAIT_S, the records waiting are dropped
# (counted in the writer's n_dropped and as an observer error, with a warning) rather
# than the program hanging on a stalled disk.
_MAX_PENDING_BATCHES = 64
_MAX_WAIT_S = 30.0
_ENV_LOG = "CUPY_POOLMEM_LOG"
_ENV_TRACK = "CUPY_POOLMEM_TRACK"

_time = time.time
_current_thread = threading.current_thread


# ----------------------------------------------------------------------------------------
# Tags
# ----------------------------------------------------------------------------------------
class _TagState(threading.local):
    """Per thread: the tag path, the stack of outer ones, and the thread (for the log)."""

    tag = ""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.thread = _current_thread()


_tls = _TagState()
# tag() scopes open in all threads: while none is, the recorder does not read _tls.
_tag_scopes = array("q", [0])
_tag_lock = threading.Lock()


class _TagScope(contextlib.ContextDecorator):
    """Context manager (and decorator) returned by :func:`~cupy_poolmem.tag`."""

    def __init__(self, name: str) -> None:
        self.name = str(name)  # a plain str: the recorder looks tags up from C

    def _recreate_cm(self) -> _TagScope:  # a fresh scope per decorated call
        return _TagScope(self.name)

    def __enter__(self) -> str:
        with _tag_lock:  # counted before the tag is set: the recorder then reads it
            _tag_scopes[0] += 1
        tls = _tls
        prev = tls.tag
        tls.stack.append(prev)
        tls.tag = f"{prev}/{self.name}" if prev else self.name
        return tls.tag

    def __exit__(self, *exc: Any) -> None:
        tls = _tls
        if not tls.stack:
            tls.tag = ""
            return
        tls.tag = tls.stack.pop()
        with _tag_lock:
            _tag_scopes[0] -= 1


def _tags_after_fork() -> None:
    """In a forked child only this thread is left: its own open tag scopes count."""
    global _tag_lock
    _tag_lock = threading.Lock()
    _tag_scopes[0] = len(_tls.stack)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_tags_after_fork)


def tag(name: str) -> _TagScope:
    """Label every allocation made in this thread inside the ``with`` block.

    Tags nest: inside ``tag("model")`` and then ``tag("attention")`` allocations carry
    the full path ``"model/attention"``.  Statistics, the log and :func:`~cupy_poolmem.stats.outstanding`
    record that path; ``report --tag-depth 1`` groups by the outer component.  Tags are
    thread-local: a tag set in one thread does not apply to allocations made by other
    threads (a worker thread started inside the block starts untagged).  Allocations made
    through other front ends that use the same pools (the Numba plugin) carry the tag too.

    ``tag`` installs nothing: it only costs a thread-local push and pop.  Tags show up
    wherever allocations are observed (:func:`~cupy_poolmem.statistics`, :func:`~cupy_poolmem.start_log`,
    :func:`~cupy_poolmem.track`).  It can also be used as a function decorator.

    Parameters
    ----------
    name : str
        The label; must be a non-empty string.

    Returns
    -------
    context manager
        Use it in a ``with`` statement, or as a decorator.

    Examples
    --------
    >>> with cupy_poolmem.tag("model"):
    ...     with cupy_poolmem.tag("attention"):
    ...         cupy_poolmem.current_tag()
    'model/attention'
    >>> @cupy_poolmem.tag("loss")
    ... def loss():
    ...     return cupy_poolmem.current_tag()
    >>> loss()
    'loss'
    """
    if not isinstance(name, str) or not name:
        raise OptionTypeError(f"tag name must be a non-empty string; got {name!r}")
    return _TagScope(name)


def current_tag() -> str | None:
    """The tag path applied to allocations made now in this thread, or ``None``.

    Returns
    -------
    str or None
        The tags open in this thread, outermost first, joined by ``/``.

    Examples
    --------
    >>> with cupy_poolmem.tag("a"), cupy_poolmem.tag("b"):
    ...     cupy_poolmem.current_tag()
    'a/b'
    >>> cupy_poolmem.current_tag() is None
    True
    """
    return _tls.tag or None


# ----------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------
class _PlainCounts:
    """Counters without a recorder behind them (the recorder's ``Counts``' fields)."""

    def __init__(self) -> None:
        self.n_allocs = self.n_frees = self.total_bytes = 0
        self.current_bytes = self.peak_bytes = 0


class _PlainScope:
    """A scope's counters without a recorder behind them (the recorder's ``Scope``)."""

    def __init__(self) -> None:
        self.n_allocs = self.n_frees = self.total_bytes = 0
        self.current_bytes = self.peak_used_bytes = 0
        self.per_tag: dict[str, Any] = {}


def _field(name: str, doc: str, cls: str) -> Any:
    """A property reading and writing ``self._c.<name>`` (the live counters), documented
    by ``doc`` and an example that builds a ``cls`` with that field set."""

    def get(self: Any) -> int:
        return int(getattr(self._c, name))

    def set_(self: Any, value: int) -> None:
        setattr(self._c, name, value)

    example = f">>> {cls}({name}=3).{name}\n3\n"
    return property(get, set_, doc=f"{doc}\n\nExamples\n--------\n{example}")


class TagStatistics:
    """Counts for one tag inside a :func:`~cupy_poolmem.statistics` scope.

    Read live from the recorder's counters while the scope is open.

    Attributes
    ----------
    n_allocs, n_frees : int
        Allocations made with this tag in the scope, and frees of those allocations.
    total_bytes : int
        Bytes allocated with this tag in the scope.
    current_bytes, peak_bytes : int
        Bytes of this tag still live, now and at their high-water mark.

    Examples
    --------
    >>> t = cupy_poolmem.stats.TagStatistics(n_allocs=2, total_bytes=64)
    >>> t.n_allocs, t.peak_bytes
    (2, 0)
    """

    _FIELDS = ("n_allocs", "n_frees", "total_bytes", "current_bytes", "peak_bytes")
    __slots__ = ("_c",)

    n_allocs = _field("n_allocs", "Allocations with this tag.", "TagStatistics")
    n_frees = _field("n_frees", "Frees of those allocations.", "TagStatistics")
    total_bytes = _field("total_bytes", "Bytes allocated with this tag.", "TagStatistics")
    current_bytes = _field("current_bytes", "Bytes of this tag still live.", "TagStatistics")
    peak_bytes = _field("peak_bytes", "High-water mark of current_bytes.", "TagStatistics")

    def __init__(
        self,
        n_allocs: int = 0,
        n_frees: int = 0,
        total_bytes: int = 0,
        current_bytes: int = 0,
        peak_bytes: int = 0,
    ) -> None:
        c = _PlainCounts()
        c.n_allocs, c.n_frees, c.total_bytes = n_allocs, n_frees, total_bytes
        c.current_bytes, c.peak_bytes = current_bytes, peak_bytes
        self._c: Any = c

    @classmethod
    def _of(cls, counts: Any) -> TagStatistics:
        t = cls.__new__(cls)
        t._c = counts
        return t

    def _values(self) -> dict[str, int]:
        return {k: int(getattr(self._c, k)) for k in self._FIELDS}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TagStatistics):
            return NotImplemented
        return self._values() == other._values()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return "TagStatistics(" + ", ".join(f"{k}={v}" for k, v in self._values().items()) + ")"


class Statistics:
    """Counts and peaks of the allocations made inside one :func:`~cupy_poolmem.statistics` scope.

    The fields are updated live while the scope is active (they read the recorder's
    counters) and frozen when it ends.  Allocations from every thread and every pool of
    the process are counted (filtered by ``device`` / ``kind`` when the scope was
    opened with them).

    Attributes
    ----------
    n_allocs : int
        Allocations made inside the scope (size-0 allocations included, as in
        ``PoolStats.n_allocs``).
    n_frees : int
        Frees, made while the scope was active, of allocations made inside it.
    current_bytes : int
        Bytes allocated inside the scope and not yet freed.
    peak_used_bytes : int
        High-water mark of ``current_bytes``.
    total_bytes : int
        Sum of the sizes of all allocations made inside the scope.
    per_tag : dict of str to TagStatistics
        The same numbers per tag path (``""`` for untagged allocations).
    device, kind : int or str or None
        The filter the scope was opened with.
    start_time, end_time : float or None
        ``time.time()`` when the scope began and ended (``None`` while active).

    Examples
    --------
    >>> with cupy_poolmem.statistics() as st:
    ...     st.active, st.n_allocs
    (True, 0)
    >>> st.active
    False
    """

    n_allocs = _field("n_allocs", "Allocations made inside the scope.", "Statistics")
    n_frees = _field("n_frees", "Frees of allocations made inside the scope.", "Statistics")
    current_bytes = _field(
        "current_bytes", "Bytes allocated inside the scope, still live.", "Statistics"
    )
    peak_used_bytes = _field("peak_used_bytes", "High-water mark of current_bytes.", "Statistics")
    total_bytes = _field(
        "total_bytes", "Sum of the sizes allocated inside the scope.", "Statistics"
    )

    def __init__(
        self,
        n_allocs: int = 0,
        n_frees: int = 0,
        current_bytes: int = 0,
        peak_used_bytes: int = 0,
        total_bytes: int = 0,
        per_tag: dict[str, TagStatistics] | None = None,
        device: int | None = None,
        kind: str | None = None,
        start_time: float = 0.0,
        end_time: float | None = None,
    ) -> None:
        c = _PlainScope()
        c.n_allocs, c.n_frees, c.current_bytes = n_allocs, n_frees, current_bytes
        c.peak_used_bytes, c.total_bytes = peak_used_bytes, total_bytes
        c.per_tag = {k: v._c for k, v in (per_tag or {}).items()}
        self._c: Any = c  # the recorder's Scope while the scope is (or was) open
        self.device = device
        self.kind = kind
        self.start_time = start_time
        self.end_time = end_time

    @property
    def per_tag(self) -> dict[str, TagStatistics]:
        """The same numbers per tag path (``""`` for untagged allocations), live.

        Examples
        --------
        >>> with cupy_poolmem.statistics() as st:
        ...     pass
        >>> st.per_tag
        {}
        """
        return {k: TagStatistics._of(c) for k, c in dict(self._c.per_tag).items()}

    @property
    def active(self) -> bool:
        """``True`` while the scope is open.

        Examples
        --------
        >>> with cupy_poolmem.statistics() as st:
        ...     st.active
        True
        >>> st.active
        False
        """
        return self.end_time is None

    @property
    def elapsed(self) -> float:
        """Seconds from the start of the scope to its end (or to now while active).

        Examples
        --------
        >>> Statistics(start_time=10.0, end_time=12.5).elapsed
        2.5
        """
        return (self.end_time if self.end_time is not None else _time()) - self.start_time

    def to_dict(self) -> dict[str, Any]:
        """Plain ``dict`` (JSON-friendly) of the counters, ``per_tag`` included.

        Returns
        -------
        dict
            The counters, ``device``, ``kind`` and ``elapsed`` by name; ``per_tag``
            maps each tag path to its counters as a tuple.

        Examples
        --------
        >>> d = Statistics(n_allocs=2, total_bytes=4096).to_dict()
        >>> d["n_allocs"], d["total_bytes"], d["per_tag"]
        (2, 4096, {})
        """
        return {
            "n_allocs": self.n_allocs,
            "n_frees": self.n_frees,
            "current_bytes": self.current_bytes,
            "peak_used_bytes": self.peak_used_bytes,
            "total_bytes": self.total_bytes,
            "device": self.device,
            "kind": self.kind,
            "elapsed": self.elapsed,
            "per_tag": {k: v._values() for k, v in self.per_tag.items()},
        }

    def _values(self) -> tuple:
        return (
            self.n_allocs,
            self.n_frees,
            self.current_bytes,
            self.peak_used_bytes,
            self.total_bytes,
            self.per_tag,
            self.device,
            self.kind,
            self.start_time,
            self.end_time,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Statistics):
            return NotImplemented
        return self._values() == other._values()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"Statistics(n_allocs={self.n_allocs}, n_frees={self.n_frees}, "
            f"current_bytes={self.current_bytes}, peak_used_bytes={self.peak_used_bytes}, "
            f"total_bytes={self.total_bytes}, per_tag={self.per_tag!r}, "
            f"device={self.device!r}, kind={self.kind!r}, start_time={self.start_time!r}, "
            f"end_time={self.end_time!r})"
        )

    def __str__(self) -> str:
        lines = [
            f"{self.n_allocs} allocs, {self.n_frees} frees, "
            f"peak {format_bytes(self.peak_used_bytes)}, "
            f"current {format_bytes(self.current_bytes)}, "
            f"total {format_bytes(self.total_bytes)} in {self.elapsed:.3f} s"
        ]
        for name, t in sorted(self.per_tag.items(), key=lambda kv: -kv[1].peak_bytes):
            lines.append(
                f"  {name or '(untagged)'}: {t.n_allocs} allocs, peak "
                f"{format_bytes(t.peak_bytes)}, total {format_bytes(t.total_bytes)}"
            )
        return "\n".join(lines)


@contextlib.contextmanager
def statistics(*, device: int | None = None, kind: str | None = None) -> Iterator[Statistics]:
    """Count allocations, frees and the peak of live bytes inside a ``with`` block.

    Like ``rmm.statistics``: scopes nest, and each scope sees only the allocations
    made while it is open (an outer scope includes those of its inner scopes).  Counts
    are process-wide: allocations from all threads and all pools (device, pinned,
    managed) are included, unless ``device`` or ``kind`` narrow them.  A free is
    counted by a scope only for an allocation made inside that scope, so memory that
    was live before the scope began never makes ``current_bytes`` negative.

    While at least one scope is open the pools carry an observer, which counts in the
    hot path's own compiled code (about a hundred nanoseconds per allocation and free,
    see :doc:`observability`); once the last one closes, the hot path is back to zero
    cost.

    Parameters
    ----------
    device : int, optional
        Count only pools of this device ordinal (``-1``: pinned pools).
    kind : {"device", "pinned", "managed"}, optional
        Count only pools of this kind.

    Yields
    ------
    Statistics
        Live counters, frozen when the block exits.

    Examples
    --------
    >>> with cupy_poolmem.statistics() as st:  # doctest: +SKIP
    ...     with cupy_poolmem.tag("step"):
    ...         run_step()
    >>> print(st.peak_used_bytes, st.n_allocs, st.per_tag["step"].peak_bytes)  # doctest: +SKIP
    """
    if kind is not None and kind not in _KIND_NAMES.values():
        raise InvalidOptionError(
            f"kind must be 'device', 'pinned', 'managed' or None; got {kind!r}"
        )
    if device is not None and (isinstance(device, bool) or not isinstance(device, int)):
        raise OptionTypeError(f"device must be an int ordinal or None; got {device!r}")
    st = Statistics(device=device, kind=kind, start_time=_time())
    _OBSERVER._add_scope(st)
    try:
        yield st
    finally:
        _OBSERVER._remove_scope(st)


def get_statistics() -> Statistics | None:
    """The innermost (most recently opened, still active) :func:`~cupy_poolmem.statistics` scope.

    Scopes are process-wide, so this may be a scope opened by another thread.

    Returns
    -------
    Statistics or None
        The scope, or ``None`` when no scope is open.

    Examples
    --------
    >>> with cupy_poolmem.statistics():
    ...     cupy_poolmem.get_statistics().n_allocs
    0
    >>> cupy_poolmem.get_statistics() is None
    True
    """
    scopes = _OBSERVER._scopes
    return scopes[-1] if scopes else None


# ----------------------------------------------------------------------------------------
# Outstanding allocations
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Allocation:
    """One live allocation, as returned by :func:`~cupy_poolmem.stats.outstanding`.

    Attributes
    ----------
    ptr : int
        Address of the allocation.
    size : int
        Size in bytes.
    tag : str or None
        Tag path when it was allocated (``None``: untagged).
    callsite : str or None
        ``"file:line in function"`` of the first frame outside cupy_poolmem and CuPy,
        when tracking was on (``None`` otherwise).
    age : float
        Seconds since it was allocated.
    device : int
        Device ordinal of its pool (``-1``: pinned).
    stream : int
        Handle of the stream it was allocated on.

    Examples
    --------
    >>> _ = cupy_poolmem.track(True)  # doctest: +SKIP
    >>> x = cupy.zeros(1 << 20)  # doctest: +SKIP
    >>> a = cupy_poolmem.stats.outstanding()[0]  # doctest: +SKIP
    >>> a.size, a.tag, a.callsite  # doctest: +SKIP
    (8388608, None, 'train.py:12 in <module>')
    """

    ptr: int
    size: int
    tag: str | None
    callsite: str | None
    age: float
    device: int
    stream: int

    def __str__(self) -> str:
        where = self.callsite or "(call site not tracked)"
        return (
            f"{format_bytes(self.size):>12}  {self.tag or '(untagged)'}  {where}  "
            f"age {self.age:.1f} s  ptr 0x{self.ptr:x}"
        )


class Outstanding(list):
    """The list :func:`~cupy_poolmem.stats.outstanding` returns, plus whether allocations were observed.

    Parameters
    ----------
    iterable : iterable of Allocation, optional
        The allocations, biggest first.

    Attributes
    ----------
    observed : bool
        ``False`` when no observer was active (the list is then empty by necessity).
    note : str
        Explanation shown by ``print`` when nothing could be listed.

    Examples
    --------
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")  # "no allocations are being observed"
    ...     listed = cupy_poolmem.stats.outstanding()
    >>> listed.observed, len(listed)
    (False, 0)
    """

    observed: bool = True
    note: str = ""

    def __str__(self) -> str:
        if not self.observed:
            return self.note
        if not self:
            return "no live allocations observed"
        return "\n".join(str(a) for a in self)


_NOT_OBSERVED = (
    "no allocations are being observed, so none can be listed: call "
    "cupy_poolmem.track(True) (or open a statistics() scope or start_log()) "
    "before the allocations you want to see"
)


def outstanding(pool: Any = None, limit: int | None = 20) -> Outstanding:
    """Live allocations, biggest first, with their tags and (when tracked) call sites.

    Only allocations made while an observer was active are known: the observer is
    active while :func:`~cupy_poolmem.track` is on, a :func:`~cupy_poolmem.statistics` scope is open, or a log is
    being written.  Call sites are recorded only while tracking is on; other entries
    have ``callsite=None``.  When no observer is active at all, an empty list with
    ``observed=False`` is returned and a :class:`UserWarning` says why.

    Parameters
    ----------
    pool : Pool, optional
        Only this pool's allocations (``pool.outstanding()`` passes itself); default
        every pool.
    limit : int or None
        At most this many entries (``None``: all).

    Returns
    -------
    Outstanding
        A list of :class:`~cupy_poolmem.stats.Allocation`.

    Examples
    --------
    >>> cupy_poolmem.track(True)  # doctest: +SKIP
    >>> x = cupy.empty(1 << 30, dtype="u1")  # doctest: +SKIP
    >>> for a in pool.outstanding(limit=5):  # doctest: +SKIP
    ...     print(a.size, a.callsite)
    1073741824 train.py:42 in step
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
        raise OptionTypeError(f"limit must be a non-negative int or None; got {limit!r}")
    if limit is not None and limit < 0:
        raise InvalidOptionError(f"limit must be a non-negative int or None; got {limit!r}")
    out = Outstanding()
    if not _OBSERVER.active:
        out.observed = False
        out.note = _NOT_OBSERVED
        warnings.warn(_NOT_OBSERVED, UserWarning, stacklevel=2)
        return out
    now = _time()
    rec = _OBSERVER._rec
    for info in rec.live(pool) if rec is not None else ():
        out.append(
            Allocation(
                ptr=info.ptr,
                size=info.size,
                tag=info.tag or None,
                callsite=info.callsite,
                age=max(0.0, now - info.time),
                device=info.device,
                stream=info.stream,
            )
        )
    out.sort(key=lambda a: (-a.size, a.ptr))
    if limit is not None:
        del out[limit:]
    return out


# ----------------------------------------------------------------------------------------
# Log writer
# ----------------------------------------------------------------------------------------
class _LogWriter:
    """The log file and its writer thread, which writes the recorder's batches.

    Lines are formatted from the recorder's records in batches (``Batch.format``, in C
    without the GIL in the compiled hot path) and each batch goes to the file in one
    ``write``: whole lines, so processes appending to one file never cut each other's.
    """

    def __init__(self, template: str, append: bool) -> None:
        self.template = template
        self.append = append
        self.n_lines = 0
        self._tail = b""  # the rest of a line a failed write left unfinished
        self.n_dropped = 0  # records dropped while the writer was stuck (see batch_full)
        self._pending = 0  # batches filled since the last write
        self._closing = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._locks()
        self._open(os.getpid())

    def _locks(self) -> None:
        self._lock = threading.Lock()  # one write at a time, in order
        self._owner: int | None = None  # the thread that holds it
        self._wake = threading.Event()

    def _open(self, pid: int) -> None:
        path = os.path.abspath(os.path.expanduser(self.template.replace("{pid}", str(pid))))
        d = os.path.dirname(path)
        if d:
            os.makedirs(d, exist_ok=True)
        self.path = path
        self.pid = pid
        self.file = open(path, "ab" if self.append else "wb", buffering=0)  # noqa: SIM115
        if os.fstat(self.file.fileno()).st_size == 0:
            self._write((",".join(LOG_COLUMNS) + "\n").encode())

    def start(self) -> None:
        """Start the writer thread."""
        self._closing = False
        t = threading.Thread(target=self._run, name="cupy_poolmem-log-writer", daemon=True)
        self._thread = t
        t.start()

    def _run(self) -> None:
        while not self._closing:
            self._wake.wait(LOG_INTERVAL_S)
            self._wake.clear()
            self.flush()

    def batch_full(self) -> None:
        """A batch is full (called by the recorder in the allocating thread)."""
        self._pending += 1
        if self._pending <= _MAX_PENDING_BATCHES or self._owner == threading.get_ident():
            # A write on this very thread (a garbage collection inside it freed
            # blocks) writes these records next.
            self._wake.set()
            return
        # The writer falls behind: this thread waits for the write under way, then
        # writes what is left, so memory stays bounded (spdlog's "block" policy).
        if self._lock.acquire(timeout=_MAX_WAIT_S):
            try:
                self._flush_owned()
            finally:
                self._lock.release()
            return
        self._drop()

    def _drop(self) -> None:
        """The writer is stuck in a write: drop the records waiting (counted)."""
        rec = _OBSERVER._rec
        if rec is None or self._closed:
            return
        try:
            n = sum(len(b) for b in rec.take_batches())
        except Exception as exc:
            _OBSERVER._error(exc)
            return
        self._pending = 0
        first = not self.n_dropped
        self.n_dropped += n
        _OBSERVER._errors += 1
        if first:
            with contextlib.suppress(BaseException):
                warnings.warn(
                    f"cupy_poolmem: the allocation log {self.path} has been stuck in a "
                    f"write for over {_MAX_WAIT_S:g} s: {n} records dropped (later drops "
                    "are counted in cupy_poolmem.stats._OBSERVER.n_errors)",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def flush(self) -> None:
        """Write every record taken so far.  Never raises (errors are counted)."""
        with self._lock:
            self._flush_owned()

    def _flush_owned(self) -> None:
        """Under the lock: flush, marking this thread as the lock's owner meanwhile (a
        batch filled by a collection inside the write must not wait for the lock)."""
        self._owner = threading.get_ident()
        try:
            self._flush_locked()
        finally:
            self._owner = None

    def _flush_locked(self) -> None:
        rec = _OBSERVER._rec
        if rec is None or self._closed:
            return
        self._pending = 0
        try:
            batches = rec.take_batches()
        except Exception as exc:
            _OBSERVER._error(exc)
            return
        for batch in batches:  # each on its own: one that fails loses no other
            try:
                self._write(batch.format(self.pid))
                self.n_lines += len(batch)
            except Exception as exc:
                _OBSERVER._error(exc)

    def _write(self, data: bytes) -> None:
        """Write whole lines.  A write that fails after part of a line (a disk that
        fills up: part of the data, then ENOSPC) keeps the rest of that line, which the
        next write puts first: no torn line swallows the next good one."""
        midline = bool(self._tail)
        if midline:
            data, self._tail = self._tail + data, b""
        view = memoryview(data)
        try:
            while view:
                n = self.file.write(view)
                if not n:
                    raise OSError(f"cannot write the allocation log {self.path}")
                view = view[n:]
        except BaseException:
            done = len(data) - len(view)
            if (data[done - 1 : done] != b"\n") if done else midline:
                end = data.find(b"\n", done)
                self._tail = bytes(data[done : end + 1 if end >= 0 else len(data)])
            raise

    def close(self) -> None:
        """Stop the thread, write what is left and close the file."""
        self._closing = True
        self._wake.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=10)
        self._thread = None
        with self._lock:
            self._flush_owned()
            if self._tail:  # a torn line, not finished since: finish it if the disk allows
                try:
                    self._write(b"")
                except Exception as exc:
                    _OBSERVER._error(exc)
            # A flush of this writer from now on (flush_log() or batch_full() on a
            # thread that fetched it before start_log replaced it) must not take the
            # recorder's records: they belong to the next log.
            self._closed = True
        with contextlib.suppress(Exception):
            self.file.close()

    def after_fork(self, pid: int) -> None:
        """In a forked child: new locks and a new thread; a ``{pid}`` template gets a
        file of its own (the parent's records were dropped: they are the parent's)."""
        self._locks()
        self._pending = 0
        self.n_lines = 0
        self._tail = b""
        if "{pid}" in self.template:
            with contextlib.suppress(Exception):
                self.file.close()
            self.append = True
            self._open(pid)
        else:
            self.pid = pid
        self.start()


# ----------------------------------------------------------------------------------------
# The observer
# ----------------------------------------------------------------------------------------
def _live_bytes(core: Any) -> int | None:
    """Bytes live in ``core`` now: the pool's own counter (no driver call)."""
    try:
        v = getattr(core, "live_bytes", None)
        return int(v) if v is not None else int(core.stats().used_bytes)
    except Exception:
        return None


def _reserved(core: Any) -> int | None:
    """What the recorder calls to re-read a pool's reserved bytes: the pool's own count
    (its CUDA pools and backend, see ``Pool._reserved``), else ``core.stats()``."""
    try:
        own = getattr(core, "_reserved", None)
        return int(own()[0]) if own is not None else int(core.stats().reserved_bytes)
    except Exception:
        return None


def _package_dir(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except Exception:
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        loc = list(spec.submodule_search_locations)
        return os.path.join(loc[0], "") if loc else None
    if spec.origin:
        return spec.origin
    return None


def _pools_module() -> Any:
    """``cupy_poolmem._runtime`` (the pools' registry and hooks), or ``None`` on a base
    install without CuPy / cuda.core.

    Imported on first use, so that ``stats`` (and ``report``, which reads its
    ``LOG_COLUMNS``) import without CUDA packages.  Without them no pool can exist,
    so there is nothing to observe: scopes and logs then simply see no allocations.
    """
    try:
        from . import _runtime
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] in ("cupy", "cupyx", "cupy_backends", "cuda"):
            return None
        raise
    return _runtime


_DEFAULT_SKIP = ("cupy_poolmem", "cupy", "cupyx", "cupy_backends", "numba", "numba_cuda")


class _Observer:
    """Configuration of the recorder, and the log writer; see the module docstring."""

    def __init__(self) -> None:
        self.active = False
        self.tracking = False
        self.depth = 32
        self._rec: Any = None  # the hot path's Recorder, configured on first need
        self._pools: Any = None  # cupy_poolmem._runtime, once observing
        self._scopes: tuple[Statistics, ...] = ()
        self._writer: _LogWriter | None = None
        self._pid = os.getpid()
        self._skip: tuple[str, ...] | None = None  # computed on first use
        self._skip_extra: tuple[str, ...] = ()
        self._errors = 0
        self._warned = False

    @property
    def recorder(self) -> Any:
        """The process's Recorder (``None`` on a base install without CUDA packages)."""
        if self._rec is None:
            pools = _pools_module()
            if pools is None:
                return None
            rec = pools.RECORDER
            rec.configure(_tls, _tag_scopes, self._batch_full, self._warn, _reserved)
            rec.set_sites(self._skip_prefixes(), self.depth)
            self._rec = rec
        return self._rec

    @property
    def n_errors(self) -> int:
        """Errors in the hooks and the writer (counted, never raised)."""
        return self._errors + (int(self._rec.n_errors) if self._rec is not None else 0)

    @n_errors.setter
    def n_errors(self, value: int) -> None:
        self._errors = value
        if self._rec is not None:
            self._rec.n_errors = 0

    def _batch_full(self) -> None:
        w = self._writer
        if w is not None:
            w.batch_full()

    def _error(self, exc: BaseException) -> None:
        """Count an error (the writer's); warn about the first.  Never raises."""
        self._errors += 1
        self._warn(exc)

    def _warn(self, exc: BaseException) -> None:
        if not self._warned:
            self._warned = True
            with contextlib.suppress(BaseException):
                warnings.warn(
                    f"cupy_poolmem observer error (later ones are only counted, in "
                    f"cupy_poolmem.stats._OBSERVER.n_errors): {exc!r}",
                    RuntimeWarning,
                    stacklevel=3,
                )

    # -- configuration (called under _CTL) ---------------------------------------------
    def _activate(self) -> None:
        self.active = True
        rec = self.recorder
        if rec is None:  # no CUDA packages: no pool can exist to observe
            return
        rec.tracking = self.tracking
        rec.start()
        pools = self._pools = _pools_module()
        pools.GLOBAL_OBSERVER[0] = rec  # pools made from now on: observed from birth
        all_pools = pools.all_pools()
        for p in all_pools:
            # The observer set and the pool's live bytes read in one step: no
            # allocation by another thread is counted twice (or missed).
            rec.install(p, _live_bytes)
        for p in all_pools:
            rec.baseline(p, 0, _reserved(p))  # Python code, a driver query: after

    def _deactivate(self) -> None:
        rec = self._rec
        if rec is not None:
            self._pools.set_global_observer(None)  # no import: this may run at exit
            rec.stop()
        self.active = False

    def _add_scope(self, st: Statistics) -> None:
        with _CTL:
            rec = self.recorder
            if rec is not None:
                st._c = rec.add_scope(st.device, _KINDS.get(st.kind) if st.kind else None)
            self._scopes = (*self._scopes, st)
            _update()

    def _remove_scope(self, st: Statistics) -> None:
        with _CTL:
            if self._rec is not None:
                self._rec.remove_scope(st._c)
            st.end_time = _time()
            self._scopes = tuple(s for s in self._scopes if s is not st)
            _update()

    def set_skip(self, extra: tuple[str, ...]) -> None:
        self._skip_extra = tuple(extra)
        self._skip = None
        self._sites()

    def _sites(self) -> None:
        if self._rec is not None:
            self._rec.set_sites(self._skip_prefixes(), self.depth)

    def _skip_prefixes(self) -> tuple[str, ...]:
        """Path prefixes of the packages whose frames are not call sites (cached)."""
        if self._skip is not None:
            return self._skip
        prefixes = []
        for name in (*_DEFAULT_SKIP, *self._skip_extra):
            if os.sep in name or name.endswith(".py"):
                prefixes.append(name)
                continue
            d = _package_dir(name)
            if d:
                prefixes.append(d)
        self._skip = tuple(prefixes)
        return self._skip

    # -- fork --------------------------------------------------------------------------
    def _after_fork_child(self) -> None:
        self._pid = os.getpid()
        rec = self._rec
        if rec is not None:
            rec.after_fork()
        w = self._writer
        if w is not None:
            try:
                w.after_fork(self._pid)
            except Exception as exc:
                self._writer = None
                if rec is not None:
                    rec.set_logging(False)
                self._error(exc)


def _flush_at_mp_exit(obs: _Observer) -> None:
    """In a multiprocessing child: write the log's last records before it ``os._exit``s."""
    import multiprocessing.util as mpu

    mpu.Finalize(None, flush_log, exitpriority=0)


_OBSERVER = _Observer()
_CTL = threading.RLock()  # serialises configuration changes
_track_user = False  # track(True)
_track_log = False  # start_log(..., track=True)
_atexit_registered = False


def _update() -> None:
    """Install the observer when something needs it, remove it when nothing does (_CTL held)."""
    obs = _OBSERVER
    was, obs.tracking = obs.tracking, _track_user or _track_log
    if obs._rec is not None:
        obs._rec.tracking = obs.tracking
        if was and not obs.tracking:
            obs._sites()  # empties the call-site cache: no code object is kept alive
    need = bool(obs._scopes) or obs._writer is not None or obs.tracking
    if need and not obs.active:
        obs._activate()
    elif not need and obs.active:
        obs._deactivate()


def _after_fork_child() -> None:
    """In a forked child: a new ``_CTL`` (the parent's may have been held by a thread
    that does not exist here, inside ``start_log``, ``stop_log`` or ``statistics()``),
    then repair what such a thread may have left half done."""
    global _CTL
    _CTL = threading.RLock()
    obs = _OBSERVER
    obs._after_fork_child()
    rec = obs._rec
    if rec is None:
        return
    try:
        # A fork inside start_log's switch: logging on, no writer to take the records.
        rec.set_logging(obs._writer is not None)
        # A fork between the recorder's add_scope/remove_scope and _scopes' update.
        mine = {id(st._c) for st in obs._scopes if st._c is not None}
        for c in rec.scopes:
            if id(c) not in mine:
                rec.remove_scope(c)
        # A fork inside _activate/_deactivate: observe again from a known state.
        if obs.active != bool(rec.active):
            obs.active = bool(rec.active)
            _update()
    except Exception as exc:
        obs._error(exc)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_child)


# ----------------------------------------------------------------------------------------
# Public switches
# ----------------------------------------------------------------------------------------
def track(
    enabled: bool = True, *, depth: int | None = None, skip: Sequence[str] | None = None
) -> bool:
    """Record the call site of every allocation (for :func:`~cupy_poolmem.stats.outstanding` and the log).

    The call site is the first Python frame outside cupy_poolmem, CuPy (``cupy``,
    ``cupyx``, ``cupy_backends``) and Numba, found by walking at most ``depth`` frames
    of the interpreter's stack from C (no ``traceback``/``inspect``).  Whether a frame's
    code is skipped is cached per code object, and each formatted ``file:line in
    function`` string per code object and line, so a call site seen before costs a
    dictionary look-up per frame walked: a few hundred nanoseconds more than observing
    without tracking.  Tracking keeps the observer installed while it is on.

    Parameters
    ----------
    enabled : bool
        Turn tracking on (default) or off.
    depth : int, optional
        Most frames to walk (32 unless changed); beyond that the call site is left blank.
    skip : sequence of str, optional
        More packages (module names) or path prefixes (directories ending with a
        separator, or ``.py`` files) whose frames are skipped, for example your own
        allocation helpers.  Replaces the list given before; ``None`` keeps it.

    Returns
    -------
    bool
        Whether tracking was on before the call.

    Examples
    --------
    >>> was_on = cupy_poolmem.track(True)
    >>> cupy_poolmem.is_tracking()
    True
    >>> x = cupy.empty(1 << 20)  # doctest: +SKIP
    >>> cupy_poolmem.get_pool().outstanding(limit=1)[0].callsite  # doctest: +SKIP
    '/home/me/train.py:12 in <module>'
    >>> _ = cupy_poolmem.track(was_on)
    """
    global _track_user
    if not isinstance(enabled, bool):
        raise OptionTypeError(f"enabled must be True or False; got {enabled!r}")
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int)):
        raise OptionTypeError(f"depth must be a positive int; got {depth!r}")
    if depth is not None and depth < 1:
        raise InvalidOptionError(f"depth must be a positive int; got {depth!r}")
    if isinstance(skip, str):
        skip = (skip,)
    with _CTL:
        before = _track_user
        if depth is not None:
            _OBSERVER.depth = depth
            _OBSERVER._sites()
        if skip is not None:
            _OBSERVER.set_skip(tuple(skip))
        _track_user = enabled
        _update()
        return before


def is_tracking() -> bool:
    """Whether call sites are being recorded (by :func:`~cupy_poolmem.track` or :func:`~cupy_poolmem.start_log`).

    Returns
    -------
    bool
        ``True`` inside :func:`~cupy_poolmem.track` or while a tracking log is open.

    Examples
    --------
    >>> was = cupy_poolmem.track(True)
    >>> cupy_poolmem.is_tracking()
    True
    >>> _ = cupy_poolmem.track(was)
    """
    return _OBSERVER.tracking


def start_log(path: str | os.PathLike, track: bool = False, *, append: bool = False) -> str:
    """Write one CSV line per allocation and per free to ``path``.

    Columns (:data:`~cupy_poolmem.stats.LOG_COLUMNS`), one header line first:

    ``time``
        ``time.time()`` of the event, seconds, 6 decimals.
    ``pid``, ``thread``
        Process id and the name of the Python thread that allocated or freed.
    ``device``
        Device ordinal of the pool (``-1``: pinned host pools).
    ``stream``
        Handle of the CUDA stream the block was allocated on (``0``: legacy default).
    ``op``
        ``alloc`` or ``free``; ``guard:<kind>`` for a report of a guarded pool
        (``guard:use_after_free``, ``guard:out_of_bounds``, ``guard:double_free``,
        ``guard:unknown_free``, ``guard:unordered_stream``): its ``pointer``, ``size``,
        ``stream`` and ``tag`` are the block's, its ``callsite`` reads
        ``alloc <site> | free <site>`` (see :doc:`guard`).
    ``pointer``
        Address, hexadecimal (``0x7f...``).  Pointers are reused after frees.
    ``size``
        Bytes.
    ``tag``
        Tag path of the allocation (:func:`~cupy_poolmem.tag`); on ``free`` lines, the allocation's.
    ``callsite``
        ``file:line in function`` of the allocation, only when tracking is on.
    ``used``
        Bytes in use, after this event, in this process's pools of that device: a
        counter kept by the observer (no driver call), seeded from the pools' own
        counters when observation starts.
    ``reserved``
        Last known bytes the pools of that device hold from the system (re-read when
        a pool grows and at most once a second on allocation); blank if unknown.

    The allocating thread only appends a fixed-size record to a batch; a writer thread
    formats the lines and writes them, a full batch (4096 records) at once and
    whatever is there every ``LOG_INTERVAL_S`` (0.1 s).  **The file is complete after**
    :func:`~cupy_poolmem.stop_log` **or** :func:`~cupy_poolmem.flush_log`, and at a normal
    exit (an ``atexit`` handler stops the log; a ``multiprocessing`` child flushes it
    before it exits).  A crash, a ``SIGKILL`` or ``os._exit`` loses the lines of the
    last fraction of a second: call :func:`~cupy_poolmem.flush_log` first where that
    matters.  Lines from several threads and devices go to the same file, in the order
    the events happened.  With ``{pid}`` in ``path`` each process (forked children
    included) writes its own file; without it several processes may append to one file
    (``append=True``): each batch of whole lines is one write.  The environment variable
    ``CUPY_POOLMEM_LOG=path`` starts a log (in append mode) when cupy_poolmem is
    imported, and ``CUPY_POOLMEM_TRACK=1`` turns tracking on.

    Starting a new log stops the previous one.  Read logs with
    ``python -m cupy_poolmem report alloc.csv --plot usage.png``.

    Parameters
    ----------
    path : str or path-like
        File to write; ``{pid}`` is replaced by the process id.
    track : bool
        Also record call sites (as :func:`~cupy_poolmem.track`) until :func:`~cupy_poolmem.stop_log`.
    append : bool
        Append to an existing file instead of truncating it.

    Returns
    -------
    str
        The absolute path written to.

    Examples
    --------
    >>> import os
    >>> path = cupy_poolmem.start_log("alloc-{pid}.csv", track=True)
    >>> os.path.basename(path) == f"alloc-{os.getpid()}.csv"
    True
    >>> train()  # doctest: +SKIP
    >>> cupy_poolmem.stop_log() == path
    True
    >>> with open(path) as f:
    ...     f.readline().startswith("time,pid,thread,device")
    True
    """
    global _track_log, _atexit_registered
    if not isinstance(track, bool):
        raise OptionTypeError(f"track must be True or False; got {track!r}")
    template = os.fspath(path)
    if not isinstance(template, str) or not template:
        raise InvalidOptionError(f"path must be a non-empty file name; got {path!r}")
    with _CTL:
        writer = _LogWriter(template, append)
        old, _OBSERVER._writer = _OBSERVER._writer, None
        if old is not None:
            old.close()  # the records so far go to the old file
        rec = _OBSERVER.recorder
        if old is None and rec is not None:
            rec.take_batches()  # nothing logged belongs to this file
        _OBSERVER._writer = writer
        if rec is not None:
            rec.set_logging(True)
        writer.start()
        _track_log = track
        _update()
        if rec is not None:
            rec.refresh_all()  # the first lines get a known reserved size
        if not _atexit_registered:
            atexit.register(_atexit_close)
            with contextlib.suppress(Exception):
                import multiprocessing.util as mpu

                mpu.register_after_fork(_OBSERVER, _flush_at_mp_exit)
            _atexit_registered = True
        return writer.path


def stop_log() -> str | None:
    """Stop the log started by :func:`~cupy_poolmem.start_log`; return its path (``None`` if none).

    Every line is in the file when it returns.

    Returns
    -------
    str or None
        The log's path, or ``None`` if no log was open.

    Examples
    --------
    >>> cupy_poolmem.stop_log()  # doctest: +SKIP
    '/home/me/alloc-4242.csv'
    """
    global _track_log
    with _CTL:
        old, _OBSERVER._writer = _OBSERVER._writer, None
        if _OBSERVER._rec is not None:
            _OBSERVER._rec.set_logging(False)
        _track_log = False
        _update()
        if old is None:
            return None
        old.close()
    return old.path


def flush_log() -> str | None:
    """Write every line logged so far to the log file; return its path (``None``: no log).

    The writer thread writes lines within ``LOG_INTERVAL_S`` (0.1 s) anyway; call this
    before reading the file while the log is open, or before ``os._exit``.

    Returns
    -------
    str or None
        The log's path, or ``None`` when no log is open.

    Examples
    --------
    >>> path = cupy_poolmem.start_log("alloc-{pid}.csv")
    >>> cupy_poolmem.flush_log() == path
    True
    >>> _ = cupy_poolmem.stop_log()
    >>> import os; os.remove(path)
    """
    w = _OBSERVER._writer
    if w is None:
        return None
    w.flush()
    return w.path


def log_path() -> str | None:
    """The file the log is being written to, or ``None`` when no log is open.

    Returns
    -------
    str or None
        The path, with ``{pid}`` and the like filled in.

    Examples
    --------
    >>> from cupy_poolmem import stats
    >>> stats.log_path() is None
    True
    >>> path = cupy_poolmem.start_log("alloc-{pid}.csv")
    >>> stats.log_path() == path
    True
    >>> _ = cupy_poolmem.stop_log()
    >>> import os; os.remove(path)
    """
    w = _OBSERVER._writer
    return None if w is None else w.path


def _log_guard_event(
    core: Any, op: str, ptr: int, size: int, stream_ptr: int, tag_: str, callsite: str
) -> None:
    """One ``guard:<kind>`` line in the allocation log when one is open.  Never raises."""
    rec = _OBSERVER._rec
    if _OBSERVER._writer is None or rec is None:
        return
    rec.note(core, op, ptr, size, stream_ptr, tag_, callsite)


def _atexit_close() -> None:
    with contextlib.suppress(Exception):
        stop_log()


def _init_from_env() -> None:
    """Start a log / tracking from ``CUPY_POOLMEM_LOG`` and ``CUPY_POOLMEM_TRACK``.

    Called once by ``cupy_poolmem/__init__.py``.  A log that cannot be opened gives a
    :class:`RuntimeWarning`, never an import error.
    """
    want_track = os.environ.get(_ENV_TRACK, "").strip().lower() in ("1", "true", "yes", "on")
    path = os.environ.get(_ENV_LOG, "").strip()
    if path:
        try:
            start_log(path, track=want_track, append=True)
        except (OSError, ValueError) as exc:
            warnings.warn(
                f"{_ENV_LOG}={path!r}: cannot write the allocation log ({exc}); "
                "continuing without it",
                RuntimeWarning,
                stacklevel=2,
            )
    elif want_track:
        track(True)
