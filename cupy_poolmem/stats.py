"""Observability: scoped statistics, tags, an allocation log and call-site tracking.

Everything here works through one *observer* object that the hot path calls after each
allocation (``on_alloc``) and when each block is freed (``on_free``).  The observer is
installed on the pools only while something needs it: an active :func:`~cupy_poolmem.statistics`
scope, an open log (:func:`~cupy_poolmem.start_log`), or tracking (:func:`~cupy_poolmem.track`).  When all of those
are off, ``pool.observer`` is ``None`` and the hot path pays nothing.  :func:`~cupy_poolmem.tag` never
installs anything: it is a thread-local push/pop (about a microsecond per ``with``).

Concurrency design
------------------
Counters, live-allocation tables and log lines change under one lock, so the order of
log lines is the order in which the counters changed.  ``on_free`` runs inside
``Block.__dealloc__``, which the garbage collector may trigger at almost any point,
including while the same thread holds that lock inside ``on_alloc``.  A hook that finds
its own thread already holding the lock therefore only queues its event; the outer call
applies the queue before releasing the lock.  No re-entrant critical section, no
deadlock, and no hook ever raises (errors are counted in ``_OBSERVER.n_errors``, the
first one warned about).
"""

from __future__ import annotations

import atexit
import contextlib
import csv
import functools
import importlib.util
import itertools
import os
import sys
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
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

_KIND_NAMES = {0: "device", 1: "pinned", 2: "managed"}
_RESERVED_REFRESH_S = 1.0  # re-read a pool's reserved bytes at most this often when logging
_CALLSITE_CACHE_MAX = 8192
_ENV_LOG = "CUPY_POOLMEM_LOG"
_ENV_TRACK = "CUPY_POOLMEM_TRACK"

_time = time.time
_get_ident = threading.get_ident
_current_thread = threading.current_thread
# One serial number per observed allocation, never reset: a scope counts a free only
# when the block's serial is newer than the scope.
_serials = itertools.count(1)


# ----------------------------------------------------------------------------------------
# Tags
# ----------------------------------------------------------------------------------------
class _TagState(threading.local):
    tag = ""

    def __init__(self) -> None:
        self.stack: list[str] = []


_tls = _TagState()


class _TagScope(contextlib.ContextDecorator):
    """Context manager (and decorator) returned by :func:`~cupy_poolmem.tag`."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _recreate_cm(self) -> _TagScope:  # a fresh scope per decorated call
        return _TagScope(self.name)

    def __enter__(self) -> str:
        tls = _tls
        prev = tls.tag
        tls.stack.append(prev)
        tls.tag = f"{prev}/{self.name}" if prev else self.name
        return tls.tag

    def __exit__(self, *exc: Any) -> None:
        tls = _tls
        tls.tag = tls.stack.pop() if tls.stack else ""


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
@dataclass
class TagStatistics:
    """Counts for one tag inside a :func:`~cupy_poolmem.statistics` scope.

    Attributes
    ----------
    n_allocs, n_frees : int
        Allocations made with this tag in the scope, and frees of those allocations.
    total_bytes : int
        Bytes allocated with this tag in the scope.
    current_bytes, peak_bytes : int
        Bytes of this tag still live, now and at their high-water mark.
    """

    n_allocs: int = 0
    n_frees: int = 0
    total_bytes: int = 0
    current_bytes: int = 0
    peak_bytes: int = 0


@dataclass
class Statistics:
    """Counts and peaks of the allocations made inside one :func:`~cupy_poolmem.statistics` scope.

    The fields are updated live while the scope is active and frozen when it ends.
    Allocations from every thread and every pool of the process are counted (filtered
    by ``device`` / ``kind`` when the scope was opened with them).

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
    """

    n_allocs: int = 0
    n_frees: int = 0
    current_bytes: int = 0
    peak_used_bytes: int = 0
    total_bytes: int = 0
    per_tag: dict[str, TagStatistics] = field(default_factory=dict)
    device: int | None = None
    kind: str | None = None
    start_time: float = 0.0
    end_time: float | None = None
    _start_serial: int = field(default=0, init=False, repr=False, compare=False)
    _all: bool = field(default=True, init=False, repr=False, compare=False)

    @property
    def active(self) -> bool:
        """``True`` while the scope is open."""
        return self.end_time is None

    @property
    def elapsed(self) -> float:
        """Seconds from the start of the scope to its end (or to now while active)."""
        return (self.end_time if self.end_time is not None else _time()) - self.start_time

    def to_dict(self) -> dict[str, Any]:
        """Plain ``dict`` (JSON-friendly) of the counters, ``per_tag`` included."""
        return {
            "n_allocs": self.n_allocs,
            "n_frees": self.n_frees,
            "current_bytes": self.current_bytes,
            "peak_used_bytes": self.peak_used_bytes,
            "total_bytes": self.total_bytes,
            "device": self.device,
            "kind": self.kind,
            "elapsed": self.elapsed,
            "per_tag": {k: vars(v).copy() for k, v in dict(self.per_tag).items()},
        }

    def __str__(self) -> str:
        lines = [
            f"{self.n_allocs} allocs, {self.n_frees} frees, "
            f"peak {format_bytes(self.peak_used_bytes)}, "
            f"current {format_bytes(self.current_bytes)}, "
            f"total {format_bytes(self.total_bytes)} in {self.elapsed:.3f} s"
        ]
        for name, t in sorted(dict(self.per_tag).items(), key=lambda kv: -kv[1].peak_bytes):
            lines.append(
                f"  {name or '(untagged)'}: {t.n_allocs} allocs, peak "
                f"{format_bytes(t.peak_bytes)}, total {format_bytes(t.total_bytes)}"
            )
        return "\n".join(lines)

    # Called by the observer with its lock held.
    def _matches(self, device: int, kind: int) -> bool:
        return (self.device is None or self.device == device) and (
            self.kind is None or self.kind == _KIND_NAMES.get(kind)
        )

    def _alloc(self, size: int, tag_: str) -> None:
        self.n_allocs += 1
        self.total_bytes += size
        cur = self.current_bytes = self.current_bytes + size
        if cur > self.peak_used_bytes:
            self.peak_used_bytes = cur
        t = self.per_tag.get(tag_)
        if t is None:
            t = self.per_tag[tag_] = TagStatistics()
        t.n_allocs += 1
        t.total_bytes += size
        t.current_bytes += size
        if t.current_bytes > t.peak_bytes:
            t.peak_bytes = t.current_bytes

    def _free(self, size: int, tag_: str) -> None:
        self.n_frees += 1
        self.current_bytes -= size
        t = self.per_tag.get(tag_)
        if t is not None:
            t.n_frees += 1
            t.current_bytes -= size


@contextlib.contextmanager
def statistics(*, device: int | None = None, kind: str | None = None) -> Iterator[Statistics]:
    """Count allocations, frees and the peak of live bytes inside a ``with`` block.

    Like ``rmm.statistics``: scopes nest, and each scope sees only the allocations
    made while it is open (an outer scope includes those of its inner scopes).  Counts
    are process-wide: allocations from all threads and all pools (device, pinned,
    managed) are included, unless ``device`` or ``kind`` narrow them.  A free is
    counted by a scope only for an allocation made inside that scope, so memory that
    was live before the scope began never makes ``current_bytes`` negative.

    While at least one scope is open the pools carry an observer (a microsecond or two
    per allocation and per free); once the last one closes, the hot path is back to
    zero cost.

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
    st._all = device is None and kind is None
    st._start_serial = next(_serials)
    _OBSERVER._add_scope(st)
    try:
        yield st
    finally:
        _OBSERVER._remove_scope(st)


def get_statistics() -> Statistics | None:
    """The innermost (most recently opened, still active) :func:`~cupy_poolmem.statistics` scope.

    Scopes are process-wide, so this may be a scope opened by another thread.
    Returns ``None`` when no scope is open.

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

    Attributes
    ----------
    observed : bool
        ``False`` when no observer was active (the list is then empty by necessity).
    note : str
        Explanation shown by ``print`` when nothing could be listed.
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
    for device, live in _OBSERVER._live_snapshot(pool):
        for ptr, (size, sptr, info) in live:
            _serial, tag_, callsite, t = info
            out.append(
                Allocation(
                    ptr=ptr,
                    size=size,
                    tag=tag_ or None,
                    callsite=callsite,
                    age=max(0.0, now - t),
                    device=device,
                    stream=sptr,
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
    """CSV writer: one line per event, written and flushed under the observer lock."""

    def __init__(self, template: str, append: bool) -> None:
        self.template = template
        self.append = append
        self._open(os.getpid())

    def _open(self, pid: int) -> None:
        path = os.path.abspath(os.path.expanduser(self.template.replace("{pid}", str(pid))))
        d = os.path.dirname(path)
        if d:
            os.makedirs(d, exist_ok=True)
        self.path = path
        self.file = open(path, "a" if self.append else "w", newline="", encoding="utf-8")
        self.csv = csv.writer(self.file, lineterminator="\n")
        if os.fstat(self.file.fileno()).st_size == 0:
            self.csv.writerow(LOG_COLUMNS)
            self.file.flush()

    def row(self, fields: list[Any]) -> None:
        self.csv.writerow(fields)
        self.file.flush()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.file.flush()
        with contextlib.suppress(Exception):
            self.file.close()

    def after_fork(self, pid: int) -> None:
        """In a forked child: a ``{pid}`` template gets a file of its own."""
        if "{pid}" in self.template:
            with contextlib.suppress(Exception):
                self.file.close()  # the parent flushed every line: nothing is buffered
            self.append = True
            self._open(pid)


# ----------------------------------------------------------------------------------------
# The observer
# ----------------------------------------------------------------------------------------
class _PoolState:
    __slots__ = (
        "ref",
        "device",
        "kind",
        "used",
        "reserved",
        "reserved_t",
        "live",
        "core",
        "__weakref__",
    )

    def __init__(self, core: Any) -> None:
        self.device = int(core.device_id)
        self.kind = int(core.kind)
        self.used = 0
        self.reserved: int | None = None
        self.reserved_t = 0.0
        self.live: dict[int, tuple[int, int, tuple]] = {}
        self.core = None
        self.ref: Callable[[], Any]
        try:
            self.ref = weakref.ref(core)
        except TypeError:  # an object without weak references: hold it
            self.core = core
            self.ref = functools.partial(_identity, core)


def _identity(obj: Any) -> Any:
    return obj


def _live_bytes(core: Any) -> int | None:
    """Bytes live in ``core`` now: the pool's own counter (no driver call)."""
    try:
        v = getattr(core, "live_bytes", None)
        return int(v) if v is not None else int(core.stats().used_bytes)
    except Exception:
        return None


def _query(core: Any, attr: str, stats_field: str) -> int | None:
    """A memory-pool attribute from the driver (through cuda.core), else ``core.stats()``."""
    try:
        mr = getattr(core, "_mr", None)
        if mr is not None:
            return int(getattr(mr.attributes, attr))
        return int(getattr(core.stats(), stats_field))
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
    """``cupy_poolmem._pools``, or ``None`` on a base install without CuPy / cuda.core.

    Imported on first use, so that ``stats`` (and ``report``, which reads its
    ``LOG_COLUMNS``) import without CUDA packages.  Without them no pool can exist,
    so there is nothing to observe: scopes and logs then simply see no allocations.
    """
    try:
        from . import _pools
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] in ("cupy", "cupyx", "cupy_backends", "cuda"):
            return None
        raise
    return _pools


_DEFAULT_SKIP = ("cupy_poolmem", "cupy", "cupyx", "cupy_backends", "numba", "numba_cuda")


class _Observer:
    """The object installed as ``pool.observer``; see the module docstring."""

    def __init__(self) -> None:
        self.active = False
        self.tracking = False
        self.depth = 32
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._q: deque[tuple[Any, tuple]] = deque()
        self._scopes: tuple[Statistics, ...] = ()
        self._writer: _LogWriter | None = None
        self._pid = os.getpid()
        self._states: dict[int, _PoolState] = {}
        self._dev_used: dict[int, int] = {}
        self._dev_reserved: dict[int, int] = {}
        self._skip: tuple[str, ...] | None = None  # computed on first use
        self._skip_extra: tuple[str, ...] = ()
        self._skip_cache: dict[Any, bool] = {}
        self._site_cache: dict[tuple[Any, int], str] = {}
        self.n_errors = 0
        self._warned = False
        self.set_skip(())

    # -- hooks called by the hot path --------------------------------------------------
    def on_alloc(self, block: Any) -> None:
        try:
            if not self.active:
                return
            t = _time()
            info = (next(_serials), _tls.tag, self._callsite() if self.tracking else None, t)
            block.info = info
            thread = _current_thread().name if self._writer is not None else None
            self._run(
                self._apply_alloc,
                (block.core, block.ptr, block.size, block.stream_ptr, info, t, thread),
            )
        except Exception as exc:
            self._error(exc)

    def on_free(self, core: Any, ptr: int, size: int, stream_ptr: int, info: Any) -> None:
        # Called from Block.__dealloc__: must never raise.
        try:
            if not self.active:
                return
            thread = _current_thread().name if self._writer is not None else None
            self._run(self._apply_free, (core, ptr, size, stream_ptr, info, _time(), thread))
        except BaseException as exc:
            with contextlib.suppress(BaseException):
                self._error(exc)

    # -- serialisation -----------------------------------------------------------------
    def _run(self, fn: Any, args: tuple) -> None:
        """Apply ``fn(*args)`` under the lock; queue it if this thread is already applying.

        A hook re-entered from the garbage collector while this thread holds the lock
        leaves its event in the queue; the outer call applies it before releasing.
        """
        ident = _get_ident()
        if self._owner == ident:
            self._q.append((fn, args))
            return
        with self._lock:
            self._owner = ident
            try:
                try:
                    fn(*args)
                except Exception as exc:
                    self._error(exc)
                q = self._q
                while q:
                    f, a = q.popleft()
                    try:
                        f(*a)
                    except Exception as exc:
                        self._error(exc)
            finally:
                self._owner = None

    def _locked(self, fn: Any) -> None:
        """Run ``fn()`` with the lock held, in order with the events."""
        self._run(fn, ())

    def _error(self, exc: BaseException) -> None:
        """Count an error in a hook; warn about the first one.  Never raises."""
        self.n_errors += 1
        if not self._warned:
            self._warned = True
            with contextlib.suppress(BaseException):
                warnings.warn(
                    f"cupy_poolmem observer error (later ones are only counted, in "
                    f"cupy_poolmem.stats._OBSERVER.n_errors): {exc!r}",
                    RuntimeWarning,
                    stacklevel=3,
                )

    # -- state (lock held) -------------------------------------------------------------
    def _state(self, core: Any) -> _PoolState:
        st = self._states.get(id(core))
        if st is None or st.ref() is not core:
            st = self._states[id(core)] = _PoolState(core)
        return st

    def _apply_alloc(
        self, core: Any, ptr: int, size: int, sptr: int, info: tuple, t: float, thread: str | None
    ) -> None:
        st = self._state(core)
        st.used += size
        dev = st.device
        du = self._dev_used[dev] = self._dev_used.get(dev, 0) + size
        if ptr:
            st.live[ptr] = (size, sptr, info)
        tag_ = info[1]
        for s in self._scopes:
            if info[0] > s._start_serial and (s._all or s._matches(dev, st.kind)):
                s._alloc(size, tag_)
        w = self._writer
        if w is not None:
            if (
                st.reserved is None
                or st.used > st.reserved
                or t - st.reserved_t > _RESERVED_REFRESH_S
            ):
                self._refresh_reserved(st, core, t)
            w.row(
                [
                    f"{t:.6f}",
                    self._pid,
                    thread,
                    dev,
                    sptr,
                    "alloc",
                    f"0x{ptr:x}",
                    size,
                    tag_,
                    info[2] or "",
                    du,
                    self._dev_reserved.get(dev, ""),
                ]
            )

    def _apply_free(
        self,
        core: Any,
        ptr: int,
        size: int,
        sptr: int,
        info: tuple | None,
        t: float,
        thread: str | None,
    ) -> None:
        st = self._state(core)
        st.used = max(0, st.used - size)
        dev = st.device
        du = self._dev_used[dev] = max(0, self._dev_used.get(dev, 0) - size)
        st.live.pop(ptr, None)
        tag_ = callsite = ""
        if info is not None:
            serial, tag_, callsite = info[0], info[1], info[2] or ""
            for s in self._scopes:
                if serial > s._start_serial and (s._all or s._matches(dev, st.kind)):
                    s._free(size, tag_)
        w = self._writer
        if w is not None:
            w.row(
                [
                    f"{t:.6f}",
                    self._pid,
                    thread,
                    dev,
                    sptr,
                    "free",
                    f"0x{ptr:x}",
                    size,
                    tag_,
                    callsite,
                    du,
                    self._dev_reserved.get(dev, ""),
                ]
            )

    def _refresh_reserved(self, st: _PoolState, core: Any, t: float) -> None:
        st.reserved_t = t
        r = _query(core, "reserved_mem_current", "reserved_bytes")
        if r is None:
            return
        old = st.reserved or 0
        st.reserved = r
        self._dev_reserved[st.device] = self._dev_reserved.get(st.device, 0) + r - old

    def _baseline(self, core: Any, used: int | None, reserved: int | None) -> None:
        st = self._state(core)
        if used:
            st.used += used
            self._dev_used[st.device] = self._dev_used.get(st.device, 0) + used
        if reserved is not None:
            st.reserved = reserved
            st.reserved_t = _time()
            self._dev_reserved[st.device] = self._dev_reserved.get(st.device, 0) + reserved

    def _live_snapshot(self, pool: Any) -> list[tuple[int, list]]:
        result: list[tuple[int, list]] = []

        def snap() -> None:
            for st in self._states.values():
                if pool is None or st.ref() is pool:
                    result.append((st.device, list(st.live.items())))

        self._locked(snap)
        return result

    # -- configuration (called under _CTL) ---------------------------------------------
    def _activate(self) -> None:
        pools = _pools_module()

        def reset() -> None:
            self._states = {}
            self._dev_used = {}
            self._dev_reserved = {}

        self._locked(reset)
        self.active = True
        if pools is None:  # no CUDA packages: no pool can exist to observe
            return
        pools._set_global_observer(self)
        for p in pools.all_pools():
            used = _live_bytes(p)
            reserved = _query(p, "reserved_mem_current", "reserved_bytes")
            self._locked(lambda p=p, u=used, r=reserved: self._baseline(p, u, r))

    def _deactivate(self) -> None:
        pools = _pools_module()
        if pools is not None:
            pools._set_global_observer(None)
        self.active = False

        def clear() -> None:
            self._states = {}
            self._dev_used = {}
            self._dev_reserved = {}

        self._locked(clear)

    def _add_scope(self, st: Statistics) -> None:
        with _CTL:

            def add() -> None:
                self._scopes = (*self._scopes, st)

            self._locked(add)
            _update()

    def _remove_scope(self, st: Statistics) -> None:
        with _CTL:

            def remove() -> None:
                self._scopes = tuple(s for s in self._scopes if s is not st)
                st.end_time = _time()

            self._locked(remove)
            _update()

    def _set_writer(self, w: _LogWriter | None) -> _LogWriter | None:
        old: list[_LogWriter | None] = [None]

        def swap() -> None:
            old[0], self._writer = self._writer, w
            if w is not None:  # give the first lines a known reserved size
                now = _time()
                for st in list(self._states.values()):
                    core = st.ref()
                    if core is not None:
                        self._refresh_reserved(st, core, now)

        self._locked(swap)
        return old[0]

    def set_skip(self, extra: tuple[str, ...]) -> None:
        self._skip_extra = tuple(extra)
        self._skip = None
        self._skip_cache = {}
        self._site_cache = {}

    def _skip_prefixes(self) -> tuple[str, ...]:
        """Path prefixes of the packages whose frames are not call sites (cached)."""
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

    # -- call sites --------------------------------------------------------------------
    def _callsite(self) -> str | None:
        f: Any = sys._getframe(1)
        skip_cache = self._skip_cache
        skip = self._skip if self._skip is not None else self._skip_prefixes()
        for _ in range(self.depth):
            if f is None:
                return None
            code = f.f_code
            skipped = skip_cache.get(code)
            if skipped is None:
                if len(skip_cache) > _CALLSITE_CACHE_MAX:
                    skip_cache.clear()
                skipped = skip_cache[code] = code.co_filename.startswith(skip)
            if not skipped:
                key = (code, f.f_lineno)
                site = self._site_cache.get(key)
                if site is None:
                    if len(self._site_cache) > _CALLSITE_CACHE_MAX:
                        self._site_cache.clear()
                    site = self._site_cache[key] = (
                        f"{code.co_filename}:{f.f_lineno} in {code.co_name}"
                    )
                return site
            f = f.f_back
        return None

    # -- fork --------------------------------------------------------------------------
    def _after_fork_child(self) -> None:
        self._lock = threading.Lock()
        self._owner = None
        self._q.clear()
        self._pid = os.getpid()
        w = self._writer
        if w is not None:
            try:
                w.after_fork(self._pid)
            except Exception as exc:
                self._writer = None
                self._error(exc)


_OBSERVER = _Observer()
_CTL = threading.RLock()  # serialises configuration changes
_track_user = False  # track(True)
_track_log = False  # start_log(..., track=True)
_atexit_registered = False


def _update() -> None:
    """Install the observer when something needs it, remove it when nothing does (_CTL held)."""
    obs = _OBSERVER
    obs.tracking = _track_user or _track_log
    need = bool(obs._scopes) or obs._writer is not None or obs.tracking
    if need and not obs.active:
        obs._activate()
    elif not need and obs.active:
        obs._deactivate()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_OBSERVER._after_fork_child)


# ----------------------------------------------------------------------------------------
# Public switches
# ----------------------------------------------------------------------------------------
def track(
    enabled: bool = True, *, depth: int | None = None, skip: Sequence[str] | None = None
) -> bool:
    """Record the call site of every allocation (for :func:`~cupy_poolmem.stats.outstanding` and the log).

    The call site is the first Python frame outside cupy_poolmem, CuPy (``cupy``,
    ``cupyx``, ``cupy_backends``) and Numba, found by walking at most ``depth`` frames
    with ``sys._getframe`` (no ``traceback``/``inspect``; formatted strings are cached
    per code line), so the cost per allocation is bounded: well under a microsecond
    more than observing without tracking.  Tracking keeps the observer installed while
    it is on.

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
        if skip is not None:
            _OBSERVER.set_skip(tuple(skip))
        _track_user = enabled
        _update()
        return before


def is_tracking() -> bool:
    """Whether call sites are being recorded (by :func:`~cupy_poolmem.track` or :func:`~cupy_poolmem.start_log`)."""
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

    Each line is written under a lock and flushed at once, so no line is lost when the
    process crashes or calls ``os._exit``; an ``atexit`` handler closes the file.  Lines
    from several threads and devices go to the same file.  With ``{pid}`` in ``path``
    each process (forked children included) writes its own file; without it several
    processes may append to one file (``append=True``), one whole line at a time.  The
    environment variable ``CUPY_POOLMEM_LOG=path`` starts a log (in append mode) when
    cupy_poolmem is imported, and ``CUPY_POOLMEM_TRACK=1`` turns tracking on.

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
        old = _OBSERVER._set_writer(writer)
        if old is not None:
            old.close()
        _track_log = track
        if not _atexit_registered:
            atexit.register(_atexit_close)
            _atexit_registered = True
        _update()
        return writer.path


def stop_log() -> str | None:
    """Stop the log started by :func:`~cupy_poolmem.start_log`; return its path (``None`` if none).

    Examples
    --------
    >>> cupy_poolmem.stop_log()  # doctest: +SKIP
    '/home/me/alloc-4242.csv'
    """
    global _track_log
    with _CTL:
        old = _OBSERVER._set_writer(None)
        _track_log = False
        _update()
    if old is None:
        return None
    old.close()
    return old.path


def log_path() -> str | None:
    """The file the log is being written to, or ``None`` when no log is open."""
    w = _OBSERVER._writer
    return None if w is None else w.path


def _log_guard_event(
    core: Any, op: str, ptr: int, size: int, stream_ptr: int, tag_: str, callsite: str
) -> None:
    """One ``guard:<kind>`` line in the allocation log when one is open.  Never raises."""
    obs = _OBSERVER
    if obs._writer is None:
        return
    try:
        t = _time()
        thread = _current_thread().name
        dev = int(core.device_id)

        def write() -> None:
            w = obs._writer
            if w is not None:
                w.row(
                    [
                        f"{t:.6f}",
                        obs._pid,
                        thread,
                        dev,
                        stream_ptr,
                        op,
                        f"0x{ptr:x}",
                        size,
                        tag_,
                        callsite,
                        obs._dev_used.get(dev, ""),
                        obs._dev_reserved.get(dev, ""),
                    ]
                )

        obs._locked(write)
    except Exception as exc:
        obs._error(exc)


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
