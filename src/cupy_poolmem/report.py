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

import argparse
import errno
import heapq
import json
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ._errors import InvalidOptionError, LogFormatError, MissingDependencyError, OptionTypeError
from ._report_read import (
    BadRows,
    LogEvent,
    LogSource,
    _tag_key,
    expand,
    iter_events,
    printable,
)
from ._report_series import sample_series
from ._sizes import format_bytes
from .stats import LOG_COLUMNS  # noqa: F401  (the examples write logs with it)

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

#: File suffixes :func:`plot` writes, and the format each one gets.
PLOT_FORMATS: dict[str, str] = {
    ".png": "png",
    ".pdf": "pdf",
    ".svg": "svg",
    ".svgz": "svgz",
    ".eps": "eps",
    ".ps": "ps",
    ".jpg": "jpeg",
    ".jpeg": "jpeg",
    ".webp": "webp",
}

UNTAGGED = "(untagged)"
BEFORE_LOG = "(allocated before the log)"
OTHER_TAGS = "(other tags)"


# ----------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------
def read_log(path: str | os.PathLike) -> tuple[list[LogEvent], int]:
    """Parse one log file.

    Rows with an invalid value (a line cut short by a crash, a negative size, a time
    that is not finite...) are skipped and counted; repeated header lines (several
    processes appending to one file) are ignored.  A UTF-8 byte order mark is allowed.

    Parameters
    ----------
    path : str or path-like
        A CSV file written by :func:`cupy_poolmem.start_log`.

    Returns
    -------
    events : list of LogEvent
        In file order.
    n_bad : int
        Rows skipped because a value in them is invalid.

    Raises
    ------
    LogFormatError
        The file is empty, binary, not UTF-8 text, or does not start with the log's
        header (a :class:`ValueError` too).
    OSError
        The file cannot be opened.

    Examples
    --------
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "alloc.csv")
    >>> with open(path, "w") as f:
    ...     _ = f.write(",".join(LOG_COLUMNS) + "\\n")
    ...     _ = f.write("1.5,42,MainThread,0,0,alloc,0x7f00,4096,step,,4096,\\n")
    >>> events, n_bad = read_log(path)
    >>> events[0].op, events[0].size, events[0].tag, n_bad
    ('alloc', 4096, 'step', 0)
    """
    name = str(os.fspath(path))
    bad = BadRows()
    events = list(iter_events(LogSource(name, name), bad))
    return events, bad.n


_MAX_OPEN = 64
_MERGE_ROWS = 1 << 16


@dataclass
class _Loaded:
    """The logs to read, and what reading them found wrong.  :meth:`events` reads them
    again at each call, one row at a time."""

    files: list[str]
    sources: list[LogSource]
    skipped: list[tuple[str, str]]
    bad: BadRows = field(default_factory=BadRows)

    @property
    def n_bad(self) -> int:
        return self.bad.n

    def events(self) -> Iterator[LogEvent]:
        """All events, merged by time (each file's own order kept)."""
        self.bad = BadRows()
        n = len(self.sources)
        # Beyond _MAX_OPEN logs, each is opened only to read a chunk of rows (a process
        # may open about 1024 files at once); the chunks together hold _MERGE_ROWS rows.
        chunk = None if n <= _MAX_OPEN else max(16, _MERGE_ROWS // n)
        its = [iter_events(s, self.bad, chunk) for s in self.sources]
        return heapq.merge(*its, key=lambda e: e.time) if len(its) > 1 else its[0]


def load(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> _Loaded:
    """The logs ``paths`` name (files, directories of ``*.csv``, globs, ``-``), checked.

    Each file's header is checked now; its rows are read, merged by time, each time
    ``events()`` of the result is iterated.  Each file's own order is kept (a k-way merge
    on ``time``), so events of one process never swap places even when their
    timestamps are equal.  In a directory or a glob's matches, files that are not
    logs are skipped and listed in ``skipped``.

    Parameters
    ----------
    paths : path or sequence of paths
        Log files, directories of ``*.csv`` logs, globs, or ``-`` (standard input).

    Returns
    -------
    object
        The files read, their events in time order (:class:`LogEvent`) and the
        number of lines that could not be parsed.

    Raises
    ------
    LogFormatError
        A file named explicitly is not an allocation log, or a directory holds none.
    OSError
        A file named explicitly cannot be read.

    Examples
    --------
    >>> loaded = load(["alloc-101.csv", "alloc-102.csv"])  # doctest: +SKIP
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    sources, skipped = expand(paths)
    return _Loaded([s.name for s in sources], sources, skipped)


# ----------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------
@dataclass
class SeriesSummary:
    """Usage of one (process, device): ``device == -1`` is pinned host memory.

    ``peak_used_bytes`` comes from the log's ``used`` column (which includes memory
    allocated before the log started) or, when that column is blank, from the matched
    allocations.  ``at_peak`` is the live bytes per tag at that moment.

    Attributes
    ----------
    pid : int
        The process.
    device : int
        Device ordinal (``-1``: pinned host memory).
    n_allocs, n_frees : int
        Allocations and frees logged.
    peak_used_bytes : int
        Most bytes in use at once.
    peak_time : float
        When the peak was reached, in seconds after the first event of all logs.
    peak_reserved_bytes : int or None
        Most bytes the pool reserved (``None``: the log has no ``reserved`` column).
    final_used_bytes : int
        Bytes in use at the end of the log.
    at_peak : dict of str to int
        Live bytes per tag at the peak.

    Examples
    --------
    >>> s = SeriesSummary(pid=101, device=0, n_allocs=2, peak_used_bytes=2560)
    >>> s.peak_used_bytes - s.final_used_bytes
    2560
    """

    pid: int
    device: int
    n_allocs: int = 0
    n_frees: int = 0
    peak_used_bytes: int = 0
    peak_time: float = 0.0
    peak_reserved_bytes: int | None = None
    final_used_bytes: int = 0
    at_peak: dict[str, int] = field(default_factory=dict)


@dataclass
class TagSummary:
    """Bytes per tag, over all processes and devices.

    Attributes
    ----------
    tag : str
        The tag path (cut to ``tag_depth`` components when asked).
    n_allocs : int
        Allocations made under it.
    total_bytes : int
        Bytes allocated under it in all.
    peak_live_bytes : int
        Most of its bytes live at once.
    leaked_bytes, n_leaks : int
        Its allocations never freed by the end of the log.
    live_bytes : int
        Its bytes live at the end of the log.

    Examples
    --------
    >>> t = TagSummary("model", n_allocs=2, total_bytes=4096, peak_live_bytes=4096)
    >>> t.total_bytes // t.n_allocs
    2048
    """

    tag: str
    n_allocs: int = 0
    total_bytes: int = 0
    peak_live_bytes: int = 0
    leaked_bytes: int = 0
    n_leaks: int = 0
    live_bytes: int = 0


@dataclass
class CallsiteSummary:
    """Allocations made from one call site (logs written with tracking on).

    Attributes
    ----------
    callsite : str
        ``file:line in function``.
    n_allocs : int
        Allocations made there.
    total_bytes : int
        Bytes allocated there in all.

    Examples
    --------
    >>> CallsiteSummary("train.py:12 in step", n_allocs=3, total_bytes=3072).total_bytes
    3072
    """

    callsite: str
    n_allocs: int = 0
    total_bytes: int = 0


@dataclass
class Leak:
    """An allocation with no matching free by the end of the log.

    Attributes
    ----------
    pid : int
        The process.
    device : int
        Device ordinal (``-1``: pinned host memory).
    ptr : int
        Address.
    size : int
        Bytes.
    tag : str
        Tag path (``""``: untagged).
    callsite : str
        Where it was allocated, when tracking was on.
    time : float
        When it was allocated, in seconds after the first event of all logs.

    Examples
    --------
    >>> leak = Leak(101, 0, 0x900, 512, "loss", "", 0.5)
    >>> leak.size, leak.tag
    (512, 'loss')
    """

    pid: int
    device: int
    ptr: int
    size: int
    tag: str
    callsite: str
    time: float  # seconds after the first event of all logs


@dataclass
class GuardReport:
    """A ``guard:<kind>`` line of a log: a bug the guard found (see :doc:`guard`).

    Attributes
    ----------
    pid : int
        The process.
    device : int
        Device ordinal.
    kind : str
        ``"use_after_free"``, ``"out_of_bounds"``, ``"double_free"``, ...
    ptr : int
        Address of the block.
    size : int
        Bytes.
    tag : str
        Tag path at allocation.
    callsite : str
        ``"alloc <site> | free <site>"``.
    time : float
        When it was found, in seconds after the first event of all logs.

    Examples
    --------
    >>> g = GuardReport(101, 0, "use_after_free", 0x100, 2048, "model", "", 1.0)
    >>> g.kind
    'use_after_free'
    """

    pid: int
    device: int
    kind: str  # "use_after_free", "out_of_bounds", "double_free", ...
    ptr: int
    size: int
    tag: str
    callsite: str  # "alloc <site> | free <site>"
    time: float  # seconds after the first event of all logs


@dataclass
class Summary:
    """What :func:`summarize` finds in a set of logs.

    Attributes
    ----------
    files : list of str
    n_events, n_allocs, n_frees : int
    n_unmatched_frees, unmatched_free_bytes : int
        Frees of memory allocated before the log started.
    n_bad_lines : int
        Rows skipped because a value in them is invalid (see :doc:`observability`).
    first_bad_line : str or None
        Where the first of them is and what is wrong with it
        (``"alloc.csv line 17: size '-5' is negative"``).
    skipped_files : list of str
        Files in directories (or matching globs) that were skipped: ``"FILE: reason"``.
    start_time, end_time : float
        ``time.time()`` of the first and last events.
    pids : list of int
    series : list of SeriesSummary
        One per (pid, device), biggest peak first.
    tags : list of TagSummary
        Biggest total first.
    top_callsites : list of CallsiteSummary
        Biggest total first, at most ``top``.
    leaks : list of Leak
        Biggest first (all of them).
    guard_reports : list of GuardReport
        What guarded pools found (use after free, out-of-bounds writes, double
        frees...), in time order.

    Examples
    --------
    >>> s = summarize(["alloc-101.csv", "alloc-102.csv"])  # doctest: +SKIP
    >>> s.n_allocs, [(x.pid, x.peak_used_bytes) for x in s.series]  # doctest: +SKIP
    (2, [(101, 2560), (102, 1024)])
    >>> Summary(files=["alloc-101.csv"]).leaks
    []
    """

    files: list[str]
    n_events: int = 0
    n_allocs: int = 0
    n_frees: int = 0
    n_unmatched_frees: int = 0
    unmatched_free_bytes: int = 0
    n_bad_lines: int = 0
    first_bad_line: str | None = None
    skipped_files: list[str] = field(default_factory=list)
    start_time: float = 0.0
    end_time: float = 0.0
    pids: list[int] = field(default_factory=list)
    series: list[SeriesSummary] = field(default_factory=list)
    tags: list[TagSummary] = field(default_factory=list)
    top_callsites: list[CallsiteSummary] = field(default_factory=list)
    leaks: list[Leak] = field(default_factory=list)
    guard_reports: list[GuardReport] = field(default_factory=list)

    @property
    def duration(self) -> float:
        """Seconds from the first to the last event.

        Examples
        --------
        >>> Summary(files=[], start_time=100.0, end_time=102.5).duration
        2.5
        """
        return self.end_time - self.start_time

    @property
    def peaks(self) -> dict[tuple[int, int], int]:
        """Peak used bytes per ``(pid, device)``.

        Examples
        --------
        >>> s = Summary(files=[], series=[SeriesSummary(pid=101, device=0, peak_used_bytes=2560)])
        >>> s.peaks
        {(101, 0): 2560}
        """
        return {(s.pid, s.device): s.peak_used_bytes for s in self.series}

    @property
    def per_tag(self) -> dict[str, TagSummary]:
        """:class:`TagSummary` by tag (``""``: untagged).

        Examples
        --------
        >>> s = Summary(files=[], tags=[TagSummary("model", n_allocs=2, total_bytes=4096)])
        >>> s.per_tag["model"].total_bytes
        4096
        """
        return {t.tag: t for t in self.tags}

    @property
    def leaked_bytes(self) -> int:
        """Bytes allocated and never freed by the end of the log.

        Examples
        --------
        >>> Summary(files=[], leaks=[Leak(101, 0, 0x900, 512, "loss", "", 0.5)]).leaked_bytes
        512
        """
        return sum(lk.size for lk in self.leaks)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly ``dict``: every number in it is an int or a finite float.

        Returns
        -------
        dict
            Every field by name (records as dicts), ``duration`` and ``leaked_bytes``.

        Examples
        --------
        >>> d = Summary(files=["alloc.csv"], n_allocs=2).to_dict()
        >>> d["files"], d["n_allocs"], d["leaked_bytes"]
        (['alloc.csv'], 2, 0)
        """
        d = asdict(self)
        d["duration"] = self.duration
        d["leaked_bytes"] = self.leaked_bytes
        return d

    def format(self, top: int = 10) -> str:
        """The text report that ``python -m cupy_poolmem report`` prints.

        Parameters
        ----------
        top : int, default 10
            The most call sites, leaks and guard reports listed (every tag is).

        Returns
        -------
        str
            The report, several lines, without a final newline.

        Examples
        --------
        >>> print(Summary(files=["alloc.csv"]).format().splitlines()[0])
        cupy_poolmem allocation log: 1 file(s), 0 events, 0 process(es), 0.000 s
        """
        p = printable
        out = [
            f"cupy_poolmem allocation log: {len(self.files)} file(s), {self.n_events} "
            f"events, {len(self.pids)} process(es), {self.duration:.3f} s",
            f"  allocations {self.n_allocs}, frees {self.n_frees}",
        ]
        if self.skipped_files:
            out.append(
                f"  {len(self.skipped_files)} file(s) skipped: "
                + "; ".join(p(f) for f in self.skipped_files[:3])
                + (" ..." if len(self.skipped_files) > 3 else "")
            )
        if self.n_unmatched_frees:
            out.append(
                f"  {self.n_unmatched_frees} frees ({format_bytes(self.unmatched_free_bytes)})"
                " of memory allocated before the log started"
            )
        if self.n_bad_lines:
            out.append(
                f"  skipped {self.n_bad_lines} invalid row(s) (first: {p(self.first_bad_line or '')})"
            )
        if self.guard_reports:
            kinds: dict[str, int] = {}
            for g in self.guard_reports:
                kinds[g.kind] = kinds.get(g.kind, 0) + 1
            out += [
                "",
                f"Guard reports: {len(self.guard_reports)} ("
                + ", ".join(f"{p(k)} {v}" for k, v in sorted(kinds.items()))
                + ")",
            ]
            for g in self.guard_reports[:top]:
                dev = "pinned" if g.device < 0 else f"device {g.device}"
                out.append(
                    f"  {p(g.kind):<17} at {g.time:.3f} s  pid {g.pid} {dev}  0x{g.ptr:x} "
                    f"({format_bytes(g.size)})  {p(g.tag or UNTAGGED)}  {p(g.callsite or '-')}"
                )
            if len(self.guard_reports) > top:
                out.append(f"  ... {len(self.guard_reports) - top} more")
        if not self.n_events:
            out.append("  (no events)")
            return "\n".join(out)
        out += [
            "",
            "Peak used memory per process and device",
            f"  {'pid':>8} {'device':>8} {'peak used':>12} {'at (s)':>9} "
            f"{'peak reserved':>14} {'allocs':>9} {'frees':>9}",
        ]
        for s in self.series:
            res = format_bytes(s.peak_reserved_bytes) if s.peak_reserved_bytes is not None else "-"
            dev = "pinned" if s.device < 0 else str(s.device)
            out.append(
                f"  {s.pid:>8} {dev:>8} {format_bytes(s.peak_used_bytes):>12} "
                f"{s.peak_time:>9.3f} {res:>14} {s.n_allocs:>9} {s.n_frees:>9}"
            )
            if s.at_peak:
                parts = sorted(s.at_peak.items(), key=lambda kv: -kv[1])
                out.append(
                    "           at the peak: "
                    + ", ".join(f"{p(k or UNTAGGED)} {format_bytes(v)}" for k, v in parts[:6])
                )
        out += [
            "",
            "Bytes by tag",
            f"  {'allocs':>9} {'total':>12} {'peak live':>12} {'leaked':>12}  tag",
        ]
        for t in self.tags:  # the tag last and whole: long tags never print alike
            out.append(
                f"  {t.n_allocs:>9} {format_bytes(t.total_bytes):>12} "
                f"{format_bytes(t.peak_live_bytes):>12} {format_bytes(t.leaked_bytes):>12}  "
                f"{p(t.tag or UNTAGGED)}"
            )
        out += ["", "Top call sites by bytes allocated"]
        if self.top_callsites:
            for c in self.top_callsites[:top]:
                out.append(
                    f"  {format_bytes(c.total_bytes):>12} {c.n_allocs:>8} x  {p(c.callsite)}"
                )
        else:
            out.append(
                "  (no call sites: log written without tracking; use "
                "start_log(path, track=True) or CUPY_POOLMEM_TRACK=1)"
            )
        out += [
            "",
            f"Leaks at end of log (allocated, never freed): {len(self.leaks)} "
            f"allocation(s), {format_bytes(self.leaked_bytes)}",
        ]
        for lk in self.leaks[:top]:
            dev = "pinned" if lk.device < 0 else f"device {lk.device}"
            out.append(
                f"  {format_bytes(lk.size):>12}  pid {lk.pid} {dev}  "
                f"{p(lk.tag or UNTAGGED)}  {p(lk.callsite or '-')}  at {lk.time:.3f} s  "
                f"0x{lk.ptr:x}"
            )
        if len(self.leaks) > top:
            out.append(f"  ... {len(self.leaks) - top} more")
        return "\n".join(out)


def _summarize(loaded: _Loaded, top: int, tag_depth: int | None) -> Summary:
    summ = Summary(files=list(loaded.files))
    summ.skipped_files = [f"{name}: {why}" for name, why in loaded.skipped]
    t0: float | None = None
    live: dict[tuple[int, int, int], tuple[int, str, str, float]] = {}
    series: dict[tuple[int, int], SeriesSummary] = {}
    s_matched: dict[tuple[int, int], int] = {}  # live bytes of matched allocs
    s_tags: dict[tuple[int, int], dict[str, int]] = {}
    tags: dict[str, TagSummary] = {}
    sites: dict[str, CallsiteSummary] = {}
    pids = set()
    for e in loaded.events():
        if t0 is None:
            t0 = summ.start_time = e.time
        summ.end_time = e.time
        summ.n_events += 1
        if e.op.startswith("guard:"):
            summ.guard_reports.append(
                GuardReport(
                    e.pid, e.device, e.op[6:], e.ptr, e.size, e.tag, e.callsite, e.time - t0
                )
            )
            continue
        key = (e.pid, e.device)
        s = series.get(key)
        if s is None:
            s = series[key] = SeriesSummary(e.pid, e.device)
            s_matched[key] = 0
            s_tags[key] = {}
            pids.add(e.pid)
        tl = s_tags[key]
        if e.op == "alloc":
            summ.n_allocs += 1
            s.n_allocs += 1
            tg = _tag_key(e.tag, tag_depth)
            ts = tags.get(tg)
            if ts is None:
                ts = tags[tg] = TagSummary(tg)
            ts.n_allocs += 1
            ts.total_bytes += e.size
            if e.callsite:
                cs = sites.get(e.callsite)
                if cs is None:
                    cs = sites[e.callsite] = CallsiteSummary(e.callsite)
                cs.n_allocs += 1
                cs.total_bytes += e.size
            if e.ptr and e.size:
                lkey = (e.pid, e.device, e.ptr)
                prev = live.pop(lkey, None)
                if prev is not None:  # its free was not logged: stop counting it
                    _drop(prev, s_matched, key, tl, tags)
                live[lkey] = (e.size, tg, e.callsite, e.time)
                s_matched[key] += e.size
                tl[tg] = tl.get(tg, 0) + e.size
                ts.live_bytes += e.size
                if ts.live_bytes > ts.peak_live_bytes:
                    ts.peak_live_bytes = ts.live_bytes
        else:
            summ.n_frees += 1
            s.n_frees += 1
            prev = live.pop((e.pid, e.device, e.ptr), None)
            if prev is None:
                summ.n_unmatched_frees += 1
                summ.unmatched_free_bytes += e.size
            else:
                _drop(prev, s_matched, key, tl, tags)
        used = e.used if e.used is not None else s_matched[key]
        s.final_used_bytes = used
        if used > s.peak_used_bytes or (s.n_allocs + s.n_frees == 1):
            s.peak_used_bytes = used
            s.peak_time = e.time - t0
            at = {k: v for k, v in tl.items() if v > 0}
            rest = used - sum(at.values())
            if rest > 0:
                at[BEFORE_LOG] = rest
            s.at_peak = at
        if e.reserved is not None and (
            s.peak_reserved_bytes is None or e.reserved > s.peak_reserved_bytes
        ):
            s.peak_reserved_bytes = e.reserved
    summ.n_bad_lines, summ.first_bad_line = loaded.bad.n, loaded.bad.first
    for (pid, dev, ptr), (size, tg, site, t) in live.items():
        summ.leaks.append(Leak(pid, dev, ptr, size, tg, site, t - (t0 or 0.0)))
        ts = tags[tg]
        ts.leaked_bytes += size
        ts.n_leaks += 1
    summ.leaks.sort(key=lambda lk: (-lk.size, lk.time))
    summ.pids = sorted(pids)
    summ.series = sorted(series.values(), key=lambda s: (-s.peak_used_bytes, s.pid, s.device))
    summ.tags = sorted(tags.values(), key=lambda t: (-t.total_bytes, t.tag))
    summ.top_callsites = sorted(sites.values(), key=lambda c: (-c.total_bytes, c.callsite))[:top]
    return summ


def _drop(prev: tuple, s_matched: dict, key: tuple, tl: dict, tags: dict) -> None:
    size, tg = prev[0], prev[1]
    s_matched[key] -= size
    tl[tg] = tl.get(tg, 0) - size
    tags[tg].live_bytes -= size


def summarize(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    top: int = 10,
    tag_depth: int | None = None,
) -> Summary:
    """Summarise one or more allocation logs.

    Parameters
    ----------
    paths : path or sequence of paths
        Log files (or directories of ``*.csv`` logs), from one or several processes.
    top : int
        How many call sites to keep in ``top_callsites``.
    tag_depth : int, optional
        Group nested tags by their first ``tag_depth`` components
        (``"model/attention"`` counts as ``"model"`` with ``tag_depth=1``).

    Returns
    -------
    Summary
        Per (process, device) peaks, tags, call sites, leaks and guard reports.

    Raises
    ------
    LogFormatError
        A file is not an allocation log.
    OptionTypeError, InvalidOptionError
        ``top`` or ``tag_depth`` is not a non-negative (positive) int.

    Examples
    --------
    Two allocations in one process, one of them freed:

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "alloc-101.csv")
    >>> with open(path, "w") as f:
    ...     _ = f.write(",".join(LOG_COLUMNS) + "\\n")
    ...     _ = f.write("1.0,101,MainThread,0,0,alloc,0x100,2048,model/attn,,2048,\\n")
    ...     _ = f.write("1.5,101,MainThread,0,0,alloc,0x900,512,loss,,2560,\\n")
    ...     _ = f.write("2.0,101,MainThread,0,0,free,0x100,2048,model/attn,,512,\\n")
    >>> s = summarize(path, tag_depth=1)
    >>> s.peaks[(101, 0)], s.leaked_bytes, sorted(s.per_tag)
    (2560, 512, ['loss', 'model'])
    >>> print(s.format().splitlines()[0])
    cupy_poolmem allocation log: 1 file(s), 3 events, 1 process(es), 1.000 s
    """
    _check_top(top)
    _check_tag_depth(tag_depth)
    return _summarize(load(paths), top, tag_depth)


def _check_top(top: Any) -> int:
    if isinstance(top, bool) or not isinstance(top, int):
        raise OptionTypeError(f"top must be an int >= 0; got {top!r}")
    if top < 0:
        raise InvalidOptionError(f"top must be >= 0; got {top}")
    return top


def _check_tag_depth(depth: Any) -> int | None:
    if depth is None:
        return None
    if isinstance(depth, bool) or not isinstance(depth, int):
        raise OptionTypeError(f"tag_depth must be an int >= 1 or None; got {depth!r}")
    if depth < 1:
        raise InvalidOptionError(f"tag_depth must be >= 1 (or None: full tags); got {depth}")
    return depth


def plot_format(out: str | os.PathLike) -> str:
    """The format :func:`plot` writes ``out`` in, from its suffix (``.png``, ``.pdf``...).

    Parameters
    ----------
    out : str or os.PathLike
        The file the plot is to be written to.

    Returns
    -------
    str
        The format's name, lower case (``"png"``, ``"pdf"``, ``"svg"`` ...).

    Raises
    ------
    InvalidOptionError
        The suffix is missing or not one of :data:`PLOT_FORMATS`.

    Examples
    --------
    >>> plot_format("usage.PDF"), plot_format("usage.png")
    ('pdf', 'png')
    """
    suffix = os.path.splitext(os.fspath(out))[1].lower()
    fmt = PLOT_FORMATS.get(str(suffix))
    if fmt is None:
        raise InvalidOptionError(
            f"{os.fspath(out)!s}: cannot tell the picture format from the suffix "
            f"{suffix or '(none)'!s}; use one of {', '.join(PLOT_FORMATS)}"
        )
    return fmt


# ----------------------------------------------------------------------------------------
# Plot
# ----------------------------------------------------------------------------------------
def _need_matplotlib() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise MissingDependencyError(
            "plotting an allocation log",
            str(exc),
            needs="matplotlib",
            install='pip install matplotlib (or "cupy_poolmem[plot]")',
        ) from None
    return Figure


def plot(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    tag_depth: int | None = None,
    max_tags: int = 8,
    max_panels: int = 8,
    max_points: int = 20000,
    title: str | None = None,
) -> str:
    """Draw used memory over time, stacked by tag, with reserved memory as a line.

    One panel per (process, device), biggest peak first; time is in seconds since the
    first event of all logs.  The stacked areas are the live bytes per tag (the
    ``max_tags`` biggest; the rest as "other tags"); memory that was already allocated
    when the log started shows as its own grey band, so the top of the stack follows the
    ``used`` column.  Needs matplotlib (the Agg renderer, no display); no GPU.

    Parameters
    ----------
    paths : path or sequence of paths
        Log files or directories, as for :func:`summarize`.
    out : path
        Picture to write; its suffix picks the format (``.png``, ``.pdf``, ``.svg``,
        see :data:`PLOT_FORMATS`).  Its directory must exist (none is created).
    tag_depth : int, optional
        Group nested tags by their first components, as in :func:`summarize`.
    max_tags, max_panels, max_points : int
        Limits that keep the picture readable and quick to draw; long logs are thinned
        to ``max_points`` points per panel (time buckets, keeping each one's highest
        and last moments), so memory does not grow with the log.
    title : str, optional
        Figure title.

    Returns
    -------
    str
        ``out``.

    Raises
    ------
    MissingDependencyError
        matplotlib is not installed (an :class:`ImportError` too).
    InvalidOptionError
        ``out`` has no suffix of a known picture format.
    LogFormatError
        A file is not an allocation log, or the logs hold no events.
    FileNotFoundError
        ``out``'s directory does not exist (none is created).

    Examples
    --------
    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> with open(os.path.join(d, "alloc-7.csv"), "w") as f:
    ...     _ = f.write(",".join(LOG_COLUMNS) + "\\n")
    ...     _ = f.write("1.0,7,MainThread,0,0,alloc,0x100,4096,step,,4096,8192\\n")
    ...     _ = f.write("2.0,7,MainThread,0,0,free,0x100,4096,step,,0,8192\\n")
    >>> out = plot(d, os.path.join(d, "usage.svg"))
    >>> with open(out) as f:
    ...     f.read(5)
    '<?xml'
    """
    plot_format(out)
    _check_tag_depth(tag_depth)
    return _plot(
        load(paths),
        out,
        tag_depth=tag_depth,
        max_tags=max_tags,
        max_panels=max_panels,
        max_points=max_points,
        title=title,
    )


def _plot(
    loaded: _Loaded,
    out_path: str | os.PathLike,
    *,
    tag_depth: int | None = None,
    max_tags: int = 8,
    max_panels: int = 8,
    max_points: int = 20000,
    title: str | None = None,
    summ: Summary | None = None,
) -> str:
    fmt = plot_format(out_path)
    Figure = _need_matplotlib()
    path = str(os.fspath(out_path))
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):  # never create directories the user did not ask for
        raise FileNotFoundError(
            errno.ENOENT, "no such directory (create it first, or pick another file)", folder
        )
    import numpy as np

    summ = summ if summ is not None else _summarize(loaded, 0, tag_depth)
    if not summ.n_events or not summ.series:
        raise LogFormatError(", ".join(loaded.files), "no events to plot")
    t0, t_end = summ.start_time, summ.end_time
    by_peak = sorted(summ.tags, key=lambda t: (-t.peak_live_bytes, t.tag))
    shown = [t.tag for t in by_peak if t.peak_live_bytes > 0][:max_tags]
    has_other = sum(1 for t in summ.tags if t.peak_live_bytes > 0) > len(shown)
    hidden = max(0, len(summ.series) - max_panels)
    order = sorted((s.pid, s.device) for s in summ.series[:max_panels])
    panels = sample_series(
        loaded.events(),
        order,
        shown,
        t0,
        t_end,
        n_buckets=max(1, max_points // 2),
        tag_depth=tag_depth,
    )
    peak_all = 0.0
    for ps in panels:
        for _, used, reserved, _bands in ps.moments:
            peak_all = max(peak_all, float(used), float(reserved or 0))
    unit, scale = next(
        ((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if peak_all >= s),
        ("B", 1),
    )

    from matplotlib import colormaps

    # The qualitative palettes without their greys: grey means "other tags" here.
    small = len(shown) <= 9
    cmap = colormaps["tab10" if small else "tab20"]
    palette = [cmap(i) for i in range(cmap.N) if i not in ((7,) if small else (14, 15))]
    colors = [palette[i % len(palette)] for i in range(len(shown))]
    labels_all = [_label(tg or UNTAGGED) for tg in shown] + [OTHER_TAGS, BEFORE_LOG]
    colors += [(0.55, 0.55, 0.55, 1.0), (0.82, 0.82, 0.82, 1.0)]

    fig = Figure(figsize=(11, 1.2 + 2.8 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, ps in zip(axes, panels):
        m = ps.moments
        # Hold each series' last state until the end of all logs (step plots draw
        # nothing after their last point).
        m = [*m, (t_end, *m[-1][1:])]
        x = np.array([mo[0] for mo in m], dtype=float) - t0
        used_a = np.array([mo[1] for mo in m], dtype=float)
        res = np.array([np.nan if mo[2] is None else mo[2] for mo in m], dtype=float)
        bands = np.array([mo[3] for mo in m], dtype=float).reshape(len(m), len(shown) + 2)
        keep = [i for i in range(len(shown) + 2) if bands[:, i].any()]
        if not has_other and len(shown) in keep:
            keep.remove(len(shown))
        if keep:
            ax.stackplot(
                x,
                *[np.clip(bands[:, i], 0, None) / scale for i in keep],
                labels=[labels_all[i] for i in keep],
                colors=[colors[i] for i in keep],
                step="post",
                linewidth=0,
            )
        ax.step(x, used_a / scale, where="post", color="black", linewidth=0.8, label="used")
        if not np.isnan(res).all():
            ax.step(
                x,
                res / scale,
                where="post",
                color="black",
                linewidth=1.2,
                linestyle="--",
                label="reserved",
            )
        pid, dev = ps.key
        where = "pinned host memory" if dev < 0 else f"device {dev}"
        ax.set_title(f"pid {pid}, {where}", fontsize=10, loc="left")
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        # Outside the axes, so no line runs through it.
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)
    axes[-1].set_xlabel("time since the first event (s)")
    head = _label(title) if title else "cupy_poolmem: used memory by tag"
    if hidden:
        head += f" ({hidden} more process/device panel(s) not shown)"
    fig.suptitle(head)
    fig.savefig(path, format=fmt, dpi=100)
    return path


def _label(text: str) -> str:
    """A tag as matplotlib should draw it: printable, and ``$`` not read as math."""
    return printable(text).replace("$", r"\$")


# ----------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------
PROG = "python -m cupy_poolmem report"
DESCRIPTION = """\
Summarise cupy_poolmem allocation logs: peak use per process and device, bytes per
tag, top call sites, and allocations never freed by the end of the log; optionally
plot memory over time.  Needs no GPU and no CUDA package (plots need matplotlib).
Write logs with cupy_poolmem.start_log("alloc-{pid}.csv") or CUPY_POOLMEM_LOG=...
"""
EPILOG = """\
examples:
  python -m cupy_poolmem report alloc-*.csv
  python -m cupy_poolmem report logs/ --plot usage.png --tag-depth 1
  python -m cupy_poolmem report alloc.csv --json | jq .leaked_bytes
  python -m cupy_poolmem report alloc.csv --to torch-snapshot alloc.pickle
  python -m cupy_poolmem report alloc.csv --to rmm-log rmm_log.csv
  cat alloc.csv | python -m cupy_poolmem report -

Rows with an invalid value are skipped and counted; files in a directory (or a
quoted glob) that are not logs are skipped with a warning on stderr.

exit status: 0 done, 1 the plot could not be drawn (matplotlib missing) or the output
was closed early (| head) or could not be written (a full disk), 2 bad input
"""


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The ``report`` options, added to ``ap`` (the CLI's subcommand parser uses it)."""
    from ._cli import int_at_least

    ap.add_argument(
        "logs",
        nargs="+",
        metavar="LOG",
        help="log files (CSV), directories of them, quoted globs ('alloc-*.csv'), "
        "or - for standard input",
    )
    ap.add_argument(
        "--plot",
        metavar="FILE",
        help="draw used/reserved memory by tag; the suffix picks the format "
        f"({', '.join(PLOT_FORMATS)})",
    )
    ap.add_argument(
        "--top",
        type=int_at_least(0),
        default=10,
        metavar="N",
        help="call sites and leaks listed (default: 10)",
    )
    ap.add_argument(
        "--tag-depth",
        type=int_at_least(1),
        default=None,
        metavar="N",
        help="group nested tags by their first N components",
    )
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument(
        "--to",
        nargs=2,
        metavar=("FORMAT", "FILE"),
        help="also write the log for another viewer: torch-snapshot (a .pickle that "
        "PyTorch's memory_viz opens) or rmm-log (RMM's logging adaptor CSV, which its "
        "replay benchmark reads)",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``report`` with parsed arguments; return the exit status.

    The plot and the export are written before the summary is printed, so a reader
    that stops early (``| head``) does not stop them.
    """
    from ._cli import describe_os_error, fail
    from ._report_export import check_export, export

    to = getattr(args, "to", None)
    try:
        if args.plot:
            plot_format(args.plot)  # a bad suffix is an error before any work
        if to:
            check_export(*to)
        loaded = load(args.logs)
        for option, out in (("--plot", args.plot), ("--to", to[1] if to else None)):
            if out and any(_same_file(out, s.path) for s in loaded.sources):
                raise InvalidOptionError(
                    f"{option} {out}: that file is a log being read; write to another file"
                )
        summ = _summarize(loaded, args.top, args.tag_depth)
    except OSError as exc:
        return fail(PROG, describe_os_error(exc))
    except (LogFormatError, InvalidOptionError) as exc:
        return fail(PROG, str(exc))
    for name, why in loaded.skipped:
        print(f"{PROG}: warning: skipped {printable(name)}: {printable(why)}", file=sys.stderr)
    if args.json and summ.n_bad_lines:
        print(
            f"{PROG}: warning: skipped {summ.n_bad_lines} invalid row(s) "
            f"(first: {printable(summ.first_bad_line or '')})",
            file=sys.stderr,
        )
    errors: list[tuple[str, int]] = []
    done: list[str] = []
    if args.plot:
        try:
            out = _plot(loaded, args.plot, tag_depth=args.tag_depth, summ=summ)
            done.append(f"plot written to {printable(out)}")
        except MissingDependencyError as exc:
            errors.append((f"cannot plot: {exc}", 1))
        except OSError as exc:
            errors.append((f"cannot write the plot: {describe_os_error(exc)}", 2))
        except LogFormatError as exc:
            errors.append((f"cannot plot: {exc}", 2))
    if to:
        try:
            n, files = export(loaded, to[0], to[1], tag_depth=args.tag_depth)
            done.append(f"{to[0]} written to {printable(', '.join(files))} ({n} events)")
        except OSError as exc:
            errors.append((f"cannot write {to[0]}: {describe_os_error(exc)}", 2))
    if args.json:
        print(json.dumps(summ.to_dict(), indent=1, allow_nan=False))
    else:
        print(summ.format(top=args.top))
        if done:
            print("\n" + "\n".join(done))
    for message, code in errors:
        fail(PROG, message, code=code)
    return max((code for _, code in errors), default=0)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # ``a`` does not exist yet
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cupy_poolmem report LOG [LOG ...] [--plot FILE]``; returns the exit code.

    Bad arguments exit (``SystemExit(2)``) with a one-line message, as argparse does.

    Parameters
    ----------
    argv : sequence of str, optional
        The arguments after ``report``; default ``sys.argv[1:]``.

    Returns
    -------
    int
        The exit code: 0 on success.

    Examples
    --------
    >>> main(["alloc-101.csv", "alloc-102.csv", "--plot", "usage.png"])  # doctest: +SKIP
    0
    """
    from ._cli import Parser, guard_pipe

    ap = Parser(prog=PROG, description=DESCRIPTION, epilog=EPILOG)
    add_arguments(ap)
    args = ap.parse_args(list(argv) if argv is not None else None)
    return guard_pipe(run, args, prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
