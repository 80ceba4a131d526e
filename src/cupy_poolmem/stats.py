"""Observability: scoped statistics, tags, outstanding allocations, call-site tracking
and the allocation log.

The public module: it re-exports the names of the private package ``_observe``, which
owns the code (see "How it works" in :doc:`observability`).
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
