"""Reading allocation logs, one row at a time: which files a command line names, the
checks of a file before its rows are read, and the rows parsed and checked (a bad row
is skipped and counted in a :class:`BadRows`); :func:`load` merges several by time.
"""

from __future__ import annotations

import csv
import glob
import heapq
import math
import operator
import os
import shlex
import shutil
import stat
import sys
import tempfile
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, NamedTuple

from .._cli import printable
from .._errors import InvalidOptionError, LogFormatError
from ..stats import LOG_COLUMNS

__all__ = ["LogEvent", "BadRows", "LogSource", "expand", "iter_events"]

_BOM = b"\xef\xbb\xbf"
_MAX_U64 = 2**64 - 1
_MAX_TIME = 1e11  # seconds since 1970: the year 5138; beyond it a time is damage
_GLOB_CHARS = frozenset("*?[")
_HEAD = 8192
_COMPRESSED = {  # magic bytes: (format, the command that decompresses it to stdout)
    b"\x1f\x8b": ("gzip", "zcat"),
    b"BZh": ("bzip2", "bzcat"),
    b"\xfd7zXZ\x00": ("xz", "xzcat"),
    b"\x28\xb5\x2f\xfd": ("zstd", "zstdcat"),
}
_MAX_DIGITS = 40  # a number longer than this is damage, whatever its value


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


@dataclass
class BadRows:
    """Rows skipped because a value in them is invalid: how many, and the first reason."""

    n: int = 0
    first: str | None = None

    def add(self, where: str, reason: str) -> None:
        self.n += 1
        if self.first is None:
            self.first = f"{where}: {printable(reason)}"


@dataclass
class LogSource:
    """A log to read: ``name`` as the user wrote it, ``path`` where its bytes are."""

    name: str
    path: str
    _keep: Any = field(default=None, repr=False)  # the spooled copy of stdin


def tag_key(tag: str, depth: int | None) -> str:
    """``tag`` cut to its first ``depth`` components (``None``: whole)."""
    if depth is not None and tag:
        tag = "/".join(tag.split("/")[:depth])
    return tag


def _has_glob(name: str) -> bool:
    return not _GLOB_CHARS.isdisjoint(name)


def check_header(path: str, name: str) -> list[str]:
    """The header of the log at ``path``; :class:`LogFormatError` when it is not one."""
    if os.path.isdir(path):
        raise LogFormatError(name, "is a directory (give the directory itself to load())")
    with open(path, "rb") as fb:
        head = fb.read(_HEAD)
    if head.startswith(_BOM):
        head = head[len(_BOM) :]
    if not head:
        raise LogFormatError(
            name, "empty file: an allocation log starts with a header line (see start_log)"
        )
    for magic, (kind, tool) in _COMPRESSED.items():
        if head.startswith(magic):
            cmd = f"{tool} {shlex.quote(name)}"
            raise LogFormatError(
                name,
                f"{kind}-compressed: decompress it first (python -m cupy_poolmem report "
                f"<({cmd}), or {cmd} | python -m cupy_poolmem report -)",
            )
    if b"\x00" in head:
        raise LogFormatError(name, "binary file, not an allocation log (CSV text)")
    bad: UnicodeDecodeError | None = None
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if not (len(head) == _HEAD and exc.reason == "unexpected end of data"):  # not a cut char
            bad = exc
    line = head.split(b"\n", 1)[0]
    first = line.decode("utf-8", "replace").rstrip("\r")
    try:
        header = next(csv.reader([first]), [])
    except csv.Error:
        header = []
    missing = [c for c in LOG_COLUMNS if c not in header]
    if bad is not None and (missing or bad.start <= len(line)):
        # A bad byte in a row of a log is that row's fault (it is skipped); elsewhere
        # the file is not text.
        raise LogFormatError(
            name,
            f"not a text file (byte 0x{head[bad.start]:02x} at offset {bad.start} is "
            "not UTF-8): an allocation log is the CSV file start_log() writes",
        )
    if missing:
        raise LogFormatError(
            name,
            f"not a cupy_poolmem allocation log: its first line "
            f"{printable(first[:120])!r} lacks column(s) {', '.join(missing)} "
            f"(expected {','.join(LOG_COLUMNS)})",
        )
    return header


def _spool(name: str, stream: IO[bytes]) -> LogSource:
    """``stream`` (standard input, a pipe) copied to a temporary file, which is removed
    when the source is dropped: the reader reads a log more than once."""
    tmp = tempfile.NamedTemporaryFile(prefix="cupy_poolmem-log-", suffix=".csv", delete=False)
    with tmp:
        shutil.copyfileobj(stream, tmp, 1 << 20)
    src = LogSource(name, tmp.name)
    src._keep = weakref.finalize(src, os.unlink, tmp.name)
    return src


def expand(
    paths: Iterable[str | os.PathLike],
) -> tuple[list[LogSource], list[tuple[str, str]]]:
    """The logs ``paths`` name, and the files skipped in directories and globs.

    A file named explicitly must be a log (:class:`LogFormatError` otherwise; an
    :class:`OSError` when it cannot be opened).  In a directory (its ``*.csv``) or a
    glob's matches, a file that cannot be opened or is not a log is skipped: it comes
    back as ``(name, reason)`` in the second list, as does a file named again (by
    another path, a link, a directory or a glob).  ``-`` is standard input.
    """
    out: list[LogSource] = []
    skipped: list[tuple[str, str]] = []
    stdin_used = False
    seen: dict[tuple[int, int], str] = {}  # (device, inode) -> the name read

    def add(src: LogSource) -> None:
        st = os.stat(src.path)
        key = (st.st_dev, st.st_ino)
        if key in seen:
            skipped.append((src.name, f"same file as {seen[key]} (read once)"))
        else:
            seen[key] = src.name
            out.append(src)

    for p in paths:
        name = str(os.fspath(p))
        if name == "-":
            if stdin_used:
                raise InvalidOptionError("'-' (standard input) is named twice; name it once")
            stdin_used = True
            src = _spool("<stdin>", sys.stdin.buffer)
            check_header(src.path, src.name)
            out.append(src)
            continue
        if os.path.isdir(name):
            members = sorted(os.path.join(name, n) for n in os.listdir(name) if n.endswith(".csv"))
            what = "directory holds no *.csv allocation logs"
        elif not os.path.exists(name) and _has_glob(name):
            members = sorted(m for m in glob.glob(name) if not os.path.isdir(m))
            what = "no file matches this pattern"
        elif os.path.exists(name) and not stat.S_ISREG(os.stat(name).st_mode):
            with open(name, "rb") as pipe:  # a pipe (<(zcat log.gz), /dev/stdin): read once
                src = _spool(name, pipe)
            check_header(src.path, name)
            out.append(src)
            continue
        else:
            check_header(name, name)  # an OSError or LogFormatError goes to the caller
            add(LogSource(name, name))
            continue
        found = 0
        for m in members:
            try:
                if not stat.S_ISREG(os.stat(m).st_mode):
                    skipped.append((m, "not a regular file"))
                    continue
                check_header(m, m)
            except LogFormatError as exc:
                skipped.append((m, str(exc)[len(m) + 2 :]))
                continue
            except OSError as exc:
                skipped.append((m, exc.strerror or str(exc)))
                continue
            add(LogSource(m, m))
            found += 1
        if not found:
            if members:
                what = f"none of its {len(members)} file(s) is a readable allocation log"
            raise LogFormatError(name, what)
    if not out:
        raise InvalidOptionError("no log files given")
    return out, skipped


def _uint(text: str, column: str, base: int = 10) -> int:
    s = text.strip()
    if len(s) > _MAX_DIGITS:  # far more digits than any 64-bit value: damage (slow to int())
        raise ValueError(f"{column} {s[:20]!r}... is too long for a 64-bit value")
    try:
        v = int(s, base)
    except ValueError:
        raise ValueError(f"{column} {s!r} is not an integer") from None
    if v < 0:
        raise ValueError(f"{column} {s!r} is negative")
    if v > _MAX_U64:
        raise ValueError(f"{column} {s!r} is above 2**64 - 1")
    return v


def _opt_uint(text: str, column: str) -> int | None:
    return _uint(text, column) if text.strip() else None


def _event(row: list[str], pick: Callable[[list[str]], tuple[str, ...]]) -> LogEvent:
    """The event of one row, or ``ValueError`` naming the first invalid value."""
    fields = pick(row)
    (t, pid, thread, dev, stream, op, ptr, size, tag, site, used, res) = fields
    # The rows a writer wrote, quickly; anything else is decided by _checked_event.
    if max(len(pid), len(stream), len(ptr), len(size), len(used), len(res)) > _MAX_DIGITS:
        return _checked_event(fields)
    try:
        time = float(t)
        ev = LogEvent(time, int(pid), thread, int(dev), int(stream, 0), op, int(ptr, 0),
                      int(size), tag, site, int(used) if used else None,
                      int(res) if res else None)  # fmt: skip
    except ValueError:
        return _checked_event(fields)
    if (
        0 <= time < _MAX_TIME  # False for nan
        and (op == "alloc" or op == "free" or op.startswith("guard:"))
        and -1 <= ev.device < 2**31
        and 0 <= ev.pid <= _MAX_U64
        and 0 <= ev.stream <= _MAX_U64
        and 0 <= ev.ptr <= _MAX_U64
        and 0 <= ev.size <= _MAX_U64
        and (ev.used is None or 0 <= ev.used <= _MAX_U64)
        and (ev.reserved is None or 0 <= ev.reserved <= _MAX_U64)
    ):
        return ev
    return _checked_event(fields)


def _checked_event(fields: tuple[str, ...]) -> LogEvent:
    """:func:`_event`, one value at a time: the event, or the first invalid value."""
    (t, pid, thread, dev, stream, op, ptr, size, tag, site, used, res) = fields
    try:
        time = float(t)
    except ValueError:
        raise ValueError(f"time {t[:40]!r} is not a number") from None
    if not (math.isfinite(time) and 0 <= time < _MAX_TIME):
        raise ValueError(f"time {t[:40]!r} is not a timestamp in [0, 1e11)")
    if op not in ("alloc", "free") and not op.startswith("guard:"):
        raise ValueError(f"op {op[:40]!r} is not alloc, free or guard:<kind>")
    try:
        device = int(dev)
    except ValueError:
        raise ValueError(f"device {dev[:40]!r} is not an integer") from None
    if not -1 <= device < 2**31:
        raise ValueError(f"device {dev!r} is not a device ordinal (or -1)")
    return LogEvent(
        time,
        _uint(pid, "pid"),
        thread,
        device,
        _uint(stream, "stream", 0),
        op,
        _uint(ptr, "pointer", 0),
        _uint(size, "size"),
        tag,
        site,
        _opt_uint(used, "used"),
        _opt_uint(res, "reserved"),
    )


def iter_events(src: LogSource, bad: BadRows, chunk: int | None = None) -> Iterator[LogEvent]:
    """The events of one log in file order; invalid rows are counted in ``bad``.

    Repeated header lines (several processes appending to one file) are not events.
    A row is invalid when its number of fields differs from the header's, a value
    does not parse or is out of range (negative sizes, times that are not finite,
    numbers above ``2**64 - 1``), it holds bytes that are not UTF-8, or the CSV
    module cannot split it (a field over its size limit).  With ``chunk``, the file
    is open only while ``chunk`` rows are read (merging more logs than a process may
    open at once).
    """
    header = check_header(src.path, src.name)
    pick = operator.itemgetter(*(header.index(c) for c in LOG_COLUMNS))
    pos: int | None = None  # where the next chunk starts; None: at the header
    lines = 0  # lines read before this chunk
    while True:
        buf: list[LogEvent] = []
        done = True
        f: IO[str]
        with open(src.path, newline="", encoding="utf-8-sig", errors="surrogateescape") as f:
            if pos is not None:
                f.seek(pos)
            reader = csv.reader(iter(f.readline, ""))  # readline: tell() stays usable
            if pos is None:
                try:
                    next(reader, None)
                except csv.Error:
                    pass
            for ev in _rows(reader, header, pick, src.name, lines, bad):
                if chunk is None:
                    yield ev
                    continue
                buf.append(ev)
                if len(buf) >= chunk:
                    pos, lines, done = f.tell(), lines + reader.line_num, False
                    break
        yield from buf
        if done:
            return


def _rows(
    reader: Any,
    header: list[str],
    pick: Callable[[list[str]], tuple[str, ...]],
    name: str,
    lines: int,
    bad: BadRows,
) -> Iterator[LogEvent]:
    """The valid events of ``reader``'s rows (line numbers counted from ``lines``)."""
    ncol = len(header)
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            bad.add(f"{name} line {lines + reader.line_num}", str(exc))
            continue
        if len(row) != ncol:
            if row:
                bad.add(
                    f"{name} line {lines + reader.line_num}",
                    f"{len(row)} fields, the header has {ncol}",
                )
            continue
        if row == header:
            continue
        try:
            ev = _event(row, pick)
            if not (ev.thread + ev.tag + ev.callsite + ev.op).isascii():
                (ev.thread + ev.tag + ev.callsite).encode("utf-8")
        except UnicodeEncodeError:
            bad.add(f"{name} line {lines + reader.line_num}", "bytes that are not UTF-8")
            continue
        except ValueError as exc:
            bad.add(f"{name} line {lines + reader.line_num}", str(exc))
            continue
        yield ev


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
class Loaded:
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


def load(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> Loaded:
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
    return Loaded([s.name for s in sources], sources, skipped)
