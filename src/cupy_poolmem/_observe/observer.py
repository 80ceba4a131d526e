"""The observer: the recorder's configuration (installed on the pools only while a
scope, a log or tracking needs it), the public switches (track, start_log, stop_log,
flush_log), and its fork and exit hooks."""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import threading
import time
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._errors import InvalidOptionError, OptionTypeError
from .log_writer import _LogWriter
from .tags import _tag_scopes, _tls

if TYPE_CHECKING:
    from .statistics import Statistics

_KIND_NAMES = {0: "device", 1: "pinned", 2: "managed"}
_KINDS = {v: k for k, v in _KIND_NAMES.items()}

_time = time.time


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
        from .. import _runtime
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
