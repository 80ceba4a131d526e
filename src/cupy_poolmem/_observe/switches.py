"""The public switches of observation: :func:`track`, :func:`is_tracking` and the
allocation log's :func:`start_log`, :func:`stop_log`, :func:`flush_log` and
:func:`log_path`; they check their arguments and hand the work to the observer."""

from __future__ import annotations

import os
from collections.abc import Sequence

from .._errors import InvalidOptionError, OptionTypeError
from .observer import OBSERVER


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
    if not isinstance(enabled, bool):
        raise OptionTypeError(f"enabled must be True or False; got {enabled!r}")
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int)):
        raise OptionTypeError(f"depth must be a positive int; got {depth!r}")
    if depth is not None and depth < 1:
        raise InvalidOptionError(f"depth must be a positive int; got {depth!r}")
    if isinstance(skip, str):
        skip = (skip,)
    return OBSERVER.set_tracking(enabled, depth, None if skip is None else tuple(skip))


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
    return OBSERVER.tracking


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
    if not isinstance(track, bool):
        raise OptionTypeError(f"track must be True or False; got {track!r}")
    template = os.fspath(path)
    if not isinstance(template, str) or not template:
        raise InvalidOptionError(f"path must be a non-empty file name; got {path!r}")
    return OBSERVER.open_log(template, append, track)


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
    return OBSERVER.close_log()


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
    return OBSERVER.flush_log()


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
    w = OBSERVER.writer
    return None if w is None else w.path
