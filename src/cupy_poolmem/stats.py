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

from ._observe.log_writer import LOG_COLUMNS, LOG_INTERVAL_S  # noqa: F401
from ._observe.observer import OBSERVER as _OBSERVER  # noqa: F401  (its warnings name it)
from ._observe.observer import reserved_bytes as _reserved  # noqa: F401
from ._observe.outstanding import Allocation, Outstanding, outstanding
from ._observe.startup import init_from_env as _init_from_env  # noqa: F401  (__init__ runs it)
from ._observe.statistics import Statistics, TagStatistics, get_statistics, statistics
from ._observe.switches import flush_log, is_tracking, log_path, start_log, stop_log, track
from ._observe.tags import current_tag, tag

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

# The examples of the names above are this module's (doctest reads ``__test__``).
__test__ = {name: globals()[name] for name in __all__ if name != "LOG_COLUMNS"}
