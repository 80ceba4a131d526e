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
import csv
import heapq
import json
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from ._errors import InvalidOptionError, LogFormatError, MissingDependencyError, OptionTypeError
from ._sizes import format_bytes
from .stats import LOG_COLUMNS

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


class LogEvent(NamedTuple):
    """One line of an allocation log (see :data:`cupy_poolmem.stats.LOG_COLUMNS`).

    Attributes
    ----------
    time : float
        ``time.time()`` of the event.
    pid : int
        The process that logged it.
    thread : str
        The thread's name.
    device : int
        Device ordinal of the pool (``-1``: pinned host memory).
    stream : int
        Handle of the stream.
    op : str
        ``"alloc"``, ``"free"``, or ``"guard:<kind>"`` for a guard's report.
    ptr : int
        Address of the block.
    size : int
        Bytes.
    tag : str
        Tag path (``""``: untagged).
    callsite : str
        ``file:line in function`` when tracking was on, else ``""``.
    used, reserved : int or None
        The pool's used and reserved bytes after the event, when logged.

    Examples
    --------
    >>> e = LogEvent(1.5, 101, "MainThread", 0, 0, "alloc", 0x100, 2048, "model", "", 2048, None)
    >>> e.op, e.size, e.reserved
    ('alloc', 2048, None)
    """

    time: float
    pid: int
    thread: str
    device: int
    stream: int
    op: str
    ptr: int
    size: int
    tag: str
    callsite: str
    used: int | None
    reserved: int | None


# ----------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------
def _opt_int(s: str) -> int | None:
    s = s.strip()
    return int(s) if s else None


def read_log(path: str | os.PathLike) -> tuple[list[LogEvent], int]:
    """Parse one log file.

    Lines that cannot be parsed (a line cut short by a crash, for example) are skipped
    and counted; repeated header lines (several processes appending to one file) are
    ignored.

    Parameters
    ----------
    path : str or path-like
        A CSV file written by :func:`cupy_poolmem.start_log`.

    Returns
    -------
    events : list of LogEvent
        In file order.
    n_bad : int
        Lines skipped because they could not be parsed.

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
    name = os.fspath(path)
    try:
        return _read_log(path)
    except UnicodeDecodeError as exc:
        raise LogFormatError(
            str(name),
            f"not a text file (byte 0x{exc.object[exc.start]:02x} at offset {exc.start} is "
            "not UTF-8): an allocation log is the CSV file start_log() writes",
        ) from None
    except csv.Error as exc:
        raise LogFormatError(str(name), f"not a CSV allocation log ({exc})") from None


def _read_log(path: str | os.PathLike) -> tuple[list[LogEvent], int]:
    events: list[LogEvent] = []
    n_bad = 0
    name = str(os.fspath(path))
    if os.path.isdir(path):
        raise LogFormatError(name, "is a directory (give the directory itself to load())")
    with open(path, "rb") as fb:
        head = fb.read(8192)
    if not head:
        raise LogFormatError(
            name, "empty file: an allocation log starts with a header line (see start_log)"
        )
    if b"\x00" in head:
        raise LogFormatError(name, "binary file, not an allocation log (CSV text)")
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None) or []
        missing = [c for c in LOG_COLUMNS if c not in header]
        if missing:
            raise LogFormatError(
                name,
                f"not a cupy_poolmem allocation log: its first line "
                f"{','.join(header)[:120]!r} lacks column(s) {', '.join(missing)} "
                f"(expected {','.join(LOG_COLUMNS)})",
            )
        idx = [header.index(c) for c in LOG_COLUMNS]
        ncol = len(header)
        for row in reader:
            if len(row) != ncol:
                if row:
                    n_bad += 1
                continue
            if row == header:
                continue
            try:
                (t, pid, thread, dev, stream, op, ptr, size, tag, site, used, res) = (
                    row[i] for i in idx
                )
                if op not in ("alloc", "free") and not op.startswith("guard:"):
                    raise ValueError(op)
                events.append(
                    LogEvent(
                        float(t),
                        int(pid),
                        thread,
                        int(dev),
                        int(stream, 0),
                        op,
                        int(ptr, 0),
                        int(size),
                        tag,
                        site,
                        _opt_int(used),
                        _opt_int(res),
                    )
                )
            except ValueError:
                n_bad += 1
    return events, n_bad


def _expand(paths: Iterable[str | os.PathLike]) -> list[str]:
    out: list[str] = []
    for p in paths:
        name = str(os.fspath(p))
        if os.path.isdir(name):
            found = sorted(os.path.join(name, n) for n in os.listdir(name) if n.endswith(".csv"))
            if not found:
                raise LogFormatError(name, "directory holds no *.csv allocation logs")
            out.extend(found)
        else:
            out.append(name)
    if not out:
        raise InvalidOptionError("no log files given")
    return out


@dataclass
class _Loaded:
    files: list[str]
    events: list[LogEvent]
    n_bad: int


def load(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> _Loaded:
    """Read several logs (files or directories of ``*.csv``) and merge them by time.

    Each file's own order is kept (a k-way merge on ``time``), so events of one process
    never swap places even when their timestamps are equal.

    Parameters
    ----------
    paths : path or sequence of paths
        Log files, or directories of ``*.csv`` logs.

    Returns
    -------
    object
        The files read, their events in time order (:class:`LogEvent`) and the
        number of lines that could not be parsed.

    Raises
    ------
    LogFormatError
        A file is not an allocation log, or a directory holds none.
    OSError
        A file cannot be read.

    Examples
    --------
    >>> loaded = load(["alloc-101.csv", "alloc-102.csv"])  # doctest: +SKIP
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files = _expand(paths)
    per_file = []
    n_bad = 0
    for p in files:
        ev, bad = read_log(p)
        per_file.append(ev)
        n_bad += bad
    events = list(heapq.merge(*per_file, key=lambda e: e.time))
    return _Loaded(files, events, n_bad)


def _tag_key(tag: str, depth: int | None) -> str:
    if depth is not None and tag:
        tag = "/".join(tag.split("/")[:depth])
    return tag


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
        Lines that could not be parsed (skipped).
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
        """Seconds from the first to the last event."""
        return self.end_time - self.start_time

    @property
    def peaks(self) -> dict[tuple[int, int], int]:
        """Peak used bytes per ``(pid, device)``."""
        return {(s.pid, s.device): s.peak_used_bytes for s in self.series}

    @property
    def per_tag(self) -> dict[str, TagSummary]:
        """:class:`TagSummary` by tag (``""``: untagged)."""
        return {t.tag: t for t in self.tags}

    @property
    def leaked_bytes(self) -> int:
        """Bytes allocated and never freed by the end of the log."""
        return sum(lk.size for lk in self.leaks)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly ``dict``."""
        d = asdict(self)
        d["duration"] = self.duration
        d["leaked_bytes"] = self.leaked_bytes
        return d

    def format(self, top: int = 10) -> str:
        """The text report that ``python -m cupy_poolmem report`` prints."""
        out = [
            f"cupy_poolmem allocation log: {len(self.files)} file(s), {self.n_events} "
            f"events, {len(self.pids)} process(es), {self.duration:.3f} s",
            f"  allocations {self.n_allocs}, frees {self.n_frees}",
        ]
        if self.n_unmatched_frees:
            out.append(
                f"  {self.n_unmatched_frees} frees ({format_bytes(self.unmatched_free_bytes)})"
                " of memory allocated before the log started"
            )
        if self.n_bad_lines:
            out.append(f"  {self.n_bad_lines} unreadable line(s) skipped")
        if self.guard_reports:
            kinds: dict[str, int] = {}
            for g in self.guard_reports:
                kinds[g.kind] = kinds.get(g.kind, 0) + 1
            out += [
                "",
                f"Guard reports: {len(self.guard_reports)} ("
                + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
                + ")",
            ]
            for g in self.guard_reports[:top]:
                dev = "pinned" if g.device < 0 else f"device {g.device}"
                out.append(
                    f"  {g.kind:<17} at {g.time:.3f} s  pid {g.pid} {dev}  0x{g.ptr:x} "
                    f"({format_bytes(g.size)})  {g.tag or UNTAGGED}  {g.callsite or '-'}"
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
                    + ", ".join(f"{k or UNTAGGED} {format_bytes(v)}" for k, v in parts[:6])
                )
        out += [
            "",
            "Bytes by tag",
            f"  {'tag':<32} {'allocs':>9} {'total':>12} {'peak live':>12} {'leaked':>12}",
        ]
        for t in self.tags:
            out.append(
                f"  {(t.tag or UNTAGGED)[:32]:<32} {t.n_allocs:>9} "
                f"{format_bytes(t.total_bytes):>12} {format_bytes(t.peak_live_bytes):>12} "
                f"{format_bytes(t.leaked_bytes):>12}"
            )
        out += ["", "Top call sites by bytes allocated"]
        if self.top_callsites:
            for c in self.top_callsites[:top]:
                out.append(f"  {format_bytes(c.total_bytes):>12} {c.n_allocs:>8} x  {c.callsite}")
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
                f"{lk.tag or UNTAGGED}  {lk.callsite or '-'}  at {lk.time:.3f} s  "
                f"0x{lk.ptr:x}"
            )
        if len(self.leaks) > top:
            out.append(f"  ... {len(self.leaks) - top} more")
        return "\n".join(out)


def _summarize(loaded: _Loaded, top: int, tag_depth: int | None) -> Summary:
    events = loaded.events
    summ = Summary(files=list(loaded.files), n_events=len(events), n_bad_lines=loaded.n_bad)
    if not events:
        return summ
    t0 = summ.start_time = events[0].time
    summ.end_time = events[-1].time
    live: dict[tuple[int, int, int], tuple[int, str, str, float]] = {}
    series: dict[tuple[int, int], SeriesSummary] = {}
    s_matched: dict[tuple[int, int], int] = {}  # live bytes of matched allocs
    s_tags: dict[tuple[int, int], dict[str, int]] = {}
    tags: dict[str, TagSummary] = {}
    sites: dict[str, CallsiteSummary] = {}
    pids = set()
    for e in events:
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
    for (pid, dev, ptr), (size, tg, site, t) in live.items():
        summ.leaks.append(Leak(pid, dev, ptr, size, tg, site, t - t0))
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


def _series_arrays(events: list[LogEvent], tag_depth: int | None) -> dict[tuple[int, int], dict]:
    """Per (pid, device): times, used, reserved and per-tag deltas of matched allocations."""
    import numpy as np

    raw: dict[tuple[int, int], dict[str, list]] = {}
    live: dict[tuple[int, int, int], tuple[int, str]] = {}
    for e in events:
        if e.op.startswith("guard:"):
            continue  # reports, not memory events
        key = (e.pid, e.device)
        r = raw.get(key)
        if r is None:
            r = raw[key] = {"t": [], "used": [], "res": [], "delta": [], "tag": []}
        lkey = (e.pid, e.device, e.ptr)
        if e.op == "alloc":
            tg = _tag_key(e.tag, tag_depth)
            if e.ptr and e.size:
                prev = live.pop(lkey, None)
                if prev is not None:  # an unlogged free: take it out of its tag now
                    r["t"].append(e.time)
                    r["used"].append(np.nan)
                    r["res"].append(np.nan)
                    r["delta"].append(-prev[0])
                    r["tag"].append(prev[1])
                live[lkey] = (e.size, tg)
            delta = e.size
        else:
            prev = live.pop(lkey, None)
            tg, delta = (prev[1], -prev[0]) if prev is not None else ("", 0)
        r["t"].append(e.time)
        r["used"].append(np.nan if e.used is None else e.used)
        r["res"].append(np.nan if e.reserved is None else e.reserved)
        r["delta"].append(delta)
        r["tag"].append(tg)
    out = {}
    for key, r in raw.items():
        out[key] = {
            "t": np.asarray(r["t"], dtype=float),
            "used": np.asarray(r["used"], float),
            "res": np.asarray(r["res"], float),
            "delta": np.asarray(r["delta"], float),
            "tag": r["tag"],
        }
    return out


def _ffill(a: Any) -> Any:
    import numpy as np

    ok = ~np.isnan(a)
    if not ok.any():
        return a
    idx = np.where(ok, np.arange(len(a)), 0)
    np.maximum.accumulate(idx, out=idx)
    filled = a[idx]
    filled[: int(np.argmax(ok))] = np.nan
    return filled


def _pick(used: Any, max_points: int) -> Any:
    """Indices to draw: everything, or per bin the point of highest use (peaks survive)."""
    import numpy as np

    n = len(used)
    if n <= max_points:
        return np.arange(n)
    edges = np.linspace(0, n, max_points // 2 + 1).astype(int)
    keep = [a + int(np.argmax(used[a:b])) for a, b in zip(edges[:-1], edges[1:]) if b > a]
    keep += list(edges[:-1])
    keep.append(n - 1)
    return np.unique(np.asarray(keep))


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
        see :data:`PLOT_FORMATS`).  Missing directories are created.
    tag_depth : int, optional
        Group nested tags by their first components, as in :func:`summarize`.
    max_tags, max_panels, max_points : int
        Limits that keep the picture readable and quick to draw; long logs are thinned
        to ``max_points`` points per panel, keeping each stretch's highest point.
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
) -> str:
    fmt = plot_format(out_path)
    Figure = _need_matplotlib()
    import numpy as np

    if not loaded.events:
        raise LogFormatError(", ".join(loaded.files), "no events to plot")
    t0 = loaded.events[0].time
    arrays = _series_arrays(loaded.events, tag_depth)

    # Live bytes per tag per series, and each tag's biggest peak anywhere.
    tag_peak: dict[str, float] = {}
    for a in arrays.values():
        tags = np.asarray(a["tag"], dtype=object)
        a["by_tag"] = {}
        for tg in set(a["tag"]):
            d = np.where(tags == tg, a["delta"], 0.0)
            if not d.any():
                continue
            cum = np.cumsum(d)
            a["by_tag"][tg] = cum
            tag_peak[tg] = max(tag_peak.get(tg, 0.0), float(cum.max()))
        matched = sum(a["by_tag"].values()) if a["by_tag"] else np.zeros(len(a["t"]))
        a["matched"] = matched
        used = _ffill(a["used"])  # blank used column: the matched allocations
        a["used_f"] = np.where(np.isnan(used), matched, used)
        a["res_f"] = _ffill(a["res"])
    shown = [tg for tg, _ in sorted(tag_peak.items(), key=lambda kv: -kv[1])][:max_tags]
    has_other = len(tag_peak) > len(shown)

    order = sorted(arrays, key=lambda k: -float(np.max(arrays[k]["used_f"])))
    hidden = max(0, len(order) - max_panels)
    order = sorted(order[:max_panels])  # the biggest peaks, shown by (pid, device)
    t_end = loaded.events[-1].time
    peak_all = max(
        float(np.nanmax(np.concatenate([arrays[k]["used_f"], arrays[k]["res_f"]]))) for k in order
    )
    unit, scale = next(
        ((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if peak_all >= s),
        ("B", 1),
    )

    from matplotlib import colormaps

    # The qualitative palettes without their greys: grey means "other tags" here.
    small = len(shown) <= 9
    cmap = colormaps["tab10" if small else "tab20"]
    palette = [cmap(i) for i in range(cmap.N) if i not in ((7,) if small else (14, 15))]
    colors = {tg: palette[i % len(palette)] for i, tg in enumerate(shown)}
    colors[OTHER_TAGS] = (0.55, 0.55, 0.55, 1.0)
    colors[BEFORE_LOG] = (0.82, 0.82, 0.82, 1.0)

    fig = Figure(figsize=(11, 1.2 + 2.8 * len(order)), layout="constrained")
    axes = fig.subplots(len(order), 1, sharex=True, squeeze=False)[:, 0]
    for ax, key in zip(axes, order):
        a = arrays[key]
        idx = _pick(a["used_f"], max_points)
        # Hold each series' last state until the end of all logs (step plots draw
        # nothing after their last point).
        idx = np.append(idx, idx[-1])
        x = np.append(a["t"][idx[:-1]], t_end) - t0
        layers, labels = [], []
        for tg in shown:
            if tg in a["by_tag"]:
                layers.append(a["by_tag"][tg][idx])
                labels.append(tg or UNTAGGED)
        if has_other:
            other = sum(
                (c for tg, c in a["by_tag"].items() if tg not in shown), np.zeros(len(a["t"]))
            )
            if other.any():
                layers.append(other[idx])
                labels.append(OTHER_TAGS)
        before = np.clip(a["used_f"] - a["matched"], 0, None)
        if before.any():
            layers.append(before[idx])
            labels.append(BEFORE_LOG)
        if layers:
            ax.stackplot(
                x,
                *[np.clip(y, 0, None) / scale for y in layers],
                labels=labels,
                colors=[
                    colors.get(lb if lb != UNTAGGED else "", colors[OTHER_TAGS]) for lb in labels
                ],
                step="post",
                linewidth=0,
            )
        ax.step(
            x, a["used_f"][idx] / scale, where="post", color="black", linewidth=0.8, label="used"
        )
        if not np.isnan(a["res_f"]).all():
            ax.step(
                x,
                a["res_f"][idx] / scale,
                where="post",
                color="black",
                linewidth=1.2,
                linestyle="--",
                label="reserved",
            )
        pid, dev = key
        where = "pinned host memory" if dev < 0 else f"device {dev}"
        ax.set_title(f"pid {pid}, {where}", fontsize=10, loc="left")
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        # Outside the axes, so no line runs through it.
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)
    axes[-1].set_xlabel("time since the first event (s)")
    head = title or "cupy_poolmem: used memory by tag"
    if hidden:
        head += f" ({hidden} more process/device panel(s) not shown)"
    fig.suptitle(head)
    path = str(os.fspath(out_path))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format=fmt, dpi=100)
    return path


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

exit status: 0 done, 1 the plot could not be drawn (matplotlib missing), 2 bad input
"""


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The ``report`` options, added to ``ap`` (the CLI's subcommand parser uses it)."""
    from ._cli import int_at_least

    ap.add_argument("logs", nargs="+", metavar="LOG", help="log files (CSV) or directories of them")
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


def run(args: argparse.Namespace) -> int:
    """Run ``report`` with parsed arguments; return the exit status."""
    from ._cli import describe_os_error, fail

    try:
        if args.plot:
            plot_format(args.plot)  # a bad suffix is an error before any work
        loaded = load(args.logs)
        summ = _summarize(loaded, args.top, args.tag_depth)
    except OSError as exc:
        return fail(PROG, describe_os_error(exc))
    except (LogFormatError, InvalidOptionError) as exc:
        return fail(PROG, str(exc))
    if args.json:
        print(json.dumps(summ.to_dict(), indent=1))
    else:
        print(summ.format(top=args.top))
    if args.plot:
        try:
            out = _plot(loaded, args.plot, tag_depth=args.tag_depth)
        except MissingDependencyError as exc:
            return fail(PROG, f"cannot plot: {exc}", code=1)
        except OSError as exc:
            return fail(PROG, f"cannot write the plot: {describe_os_error(exc)}")
        except LogFormatError as exc:
            return fail(PROG, f"cannot plot: {exc}")
        if not args.json:
            print(f"\nplot written to {out}")
    return 0


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
    return guard_pipe(run, args)


if __name__ == "__main__":
    sys.exit(main())
