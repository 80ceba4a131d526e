"""The summary of allocation logs: peaks per process and device, tags, call sites, leaks."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .._cli import printable
from .._errors import InvalidOptionError, OptionTypeError
from .._sizes import format_bytes
from ..stats import LOG_COLUMNS  # noqa: F401  (the examples write logs with it)
from ._read import Loaded, load, tag_key

UNTAGGED = "(untagged)"
BEFORE_LOG = "(allocated before the log)"


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


def summarize_loaded(loaded: Loaded, top: int, tag_depth: int | None) -> Summary:
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
            tg = tag_key(e.tag, tag_depth)
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
    check_tag_depth(tag_depth)
    return summarize_loaded(load(paths), top, tag_depth)


def _check_top(top: Any) -> int:
    if isinstance(top, bool) or not isinstance(top, int):
        raise OptionTypeError(f"top must be an int >= 0; got {top!r}")
    if top < 0:
        raise InvalidOptionError(f"top must be >= 0; got {top}")
    return top


def check_tag_depth(depth: Any) -> int | None:
    if depth is None:
        return None
    if isinstance(depth, bool) or not isinstance(depth, int):
        raise OptionTypeError(f"tag_depth must be an int >= 1 or None; got {depth!r}")
    if depth < 1:
        raise InvalidOptionError(f"tag_depth must be >= 1 (or None: full tags); got {depth}")
    return depth
