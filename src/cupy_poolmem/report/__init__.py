"""Read allocation logs written by :func:`cupy_poolmem.start_log`: summary and plot.

Works without a GPU and without CUDA packages (it only reads CSV files; plots need
matplotlib)::

    python -m cupy_poolmem report alloc-*.csv --plot usage.png

Logs of several processes (one file each, or appended to one file) are merged in time
order.  Allocations and frees are matched by (pid, device, pointer) in time order,
since the pools reuse addresses: an allocation with no later free is a *leak at the
end of the log*; a free with no earlier allocation belongs to memory allocated before
the log started.
"""

from __future__ import annotations

from ._cli import main
from ._plot import PLOT_FORMATS, plot, plot_format
from ._read import LogEvent, load, read_log
from ._summary import (
    BEFORE_LOG,  # noqa: F401  (a label the summary's records use)
    UNTAGGED,  # noqa: F401  (a label the summary's records use)
    CallsiteSummary,
    GuardReport,
    Leak,
    SeriesSummary,
    Summary,
    TagSummary,
    summarize,
)

__all__ = [
    "LogEvent",
    "Summary",
    "SeriesSummary",
    "TagSummary",
    "CallsiteSummary",
    "Leak",
    "GuardReport",
    "read_log",
    "load",
    "summarize",
    "plot",
    "main",
    "PLOT_FORMATS",
    "plot_format",
]
