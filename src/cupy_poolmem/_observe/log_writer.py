"""The allocation log's file and its writer thread: the log's columns, and the writing
of the recorder's batches of records as whole CSV lines."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Protocol

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

#: Seconds between two writes of the log's records by its writer thread (a full batch
#: of 4096 records, the hot path's ``LOG_BATCH``, is written at once).
LOG_INTERVAL_S = 0.1


def log_interval() -> float:
    """``LOG_INTERVAL_S`` as the user set it: on :mod:`cupy_poolmem.stats`, where the
    API reference documents it (looked up, not imported: stats imports this module)."""
    stats = sys.modules.get("cupy_poolmem.stats")
    return float(getattr(stats, "LOG_INTERVAL_S", LOG_INTERVAL_S))


@dataclass(frozen=True)
class LogSettings:
    """How a log writer paces itself.

    Beyond ``max_pending`` full batches not yet written (4096 records each: 64 is about
    20 MB) the allocating thread waits for the writer and writes them itself (bounded
    memory); if the writer is stuck in a write for ``max_wait`` seconds, the records
    waiting are dropped (counted in the writer's ``n_dropped`` and as an observer error,
    with a warning) rather than the program hanging on a stalled disk.
    """

    interval: float | None = None  # None: LOG_INTERVAL_S as set now (see log_interval)
    max_pending: int = 64
    max_wait: float = 30.0


class ErrorSink(Protocol):
    """Where a writer counts its errors (the observer)."""

    def error(self, exc: BaseException) -> None: ...

    def count_error(self) -> None: ...


class LogWriter:
    """The log file and its writer thread, which writes the recorder's batches.

    Lines are formatted from the recorder's records in batches (``Batch.format``, in C
    without the GIL in the compiled hot path) and each batch goes to the file in one
    ``write``: whole lines, so processes appending to one file never cut each other's.
    ``rec`` is the recorder whose batches it takes (``None``: nothing to write), and
    ``errors`` counts what fails (nothing here raises into the allocating thread).
    """

    def __init__(
        self,
        template: str,
        append: bool,
        rec: Any,
        errors: ErrorSink,
        settings: LogSettings | None = None,
    ) -> None:
        self.template = template
        self.append = append
        self.rec = rec
        self.errors = errors
        self.settings = settings or LogSettings()
        self.n_lines = 0
        self._tail = b""  # the rest of a line a failed write left unfinished
        self.n_dropped = 0  # records dropped while the writer was stuck (see batch_full)
        self._pending = 0  # batches filled since the last write
        self._closing = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._locks()
        self._open(os.getpid())

    def _locks(self) -> None:
        self._lock = threading.Lock()  # one write at a time, in order
        self._owner: int | None = None  # the thread that holds it
        self._wake = threading.Event()

    def _open(self, pid: int) -> None:
        path = os.path.abspath(os.path.expanduser(self.template.replace("{pid}", str(pid))))
        d = os.path.dirname(path)
        if d:
            os.makedirs(d, exist_ok=True)
        self.path = path
        self.pid = pid
        self.file = open(path, "ab" if self.append else "wb", buffering=0)  # noqa: SIM115
        if os.fstat(self.file.fileno()).st_size == 0:
            self._write((",".join(LOG_COLUMNS) + "\n").encode())

    def start(self) -> None:
        """Start the writer thread."""
        self._closing = False
        t = threading.Thread(target=self._run, name="cupy_poolmem-log-writer", daemon=True)
        self._thread = t
        t.start()

    def _run(self) -> None:
        while not self._closing:
            interval = self.settings.interval
            self._wake.wait(log_interval() if interval is None else interval)
            self._wake.clear()
            self.flush()

    def batch_full(self) -> None:
        """A batch is full (called by the recorder in the allocating thread)."""
        self._pending += 1
        if self._pending <= self.settings.max_pending or self._owner == threading.get_ident():
            # A write on this very thread (a garbage collection inside it freed
            # blocks) writes these records next.
            self._wake.set()
            return
        # The writer falls behind: this thread waits for the write under way, then
        # writes what is left, so memory stays bounded (spdlog's "block" policy).
        if self._lock.acquire(timeout=self.settings.max_wait):
            try:
                self._flush_owned()
            finally:
                self._lock.release()
            return
        self._drop()

    def _drop(self) -> None:
        """The writer is stuck in a write: drop the records waiting (counted)."""
        rec = self.rec
        if rec is None or self._closed:
            return
        try:
            n = sum(len(b) for b in rec.take_batches())
        except Exception as exc:
            self.errors.error(exc)
            return
        self._pending = 0
        first = not self.n_dropped
        self.n_dropped += n
        self.errors.count_error()
        if first:
            with contextlib.suppress(BaseException):
                warnings.warn(
                    f"cupy_poolmem: the allocation log {self.path} has been stuck in a "
                    f"write for over {self.settings.max_wait:g} s: {n} records dropped (later drops "
                    "are counted in cupy_poolmem.stats._OBSERVER.n_errors)",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def flush(self) -> None:
        """Write every record taken so far.  Never raises (errors are counted)."""
        with self._lock:
            self._flush_owned()

    def _flush_owned(self) -> None:
        """Under the lock: flush, marking this thread as the lock's owner meanwhile (a
        batch filled by a collection inside the write must not wait for the lock)."""
        self._owner = threading.get_ident()
        try:
            self._flush_locked()
        finally:
            self._owner = None

    def _flush_locked(self) -> None:
        rec = self.rec
        if rec is None or self._closed:
            return
        self._pending = 0
        try:
            batches = rec.take_batches()
        except Exception as exc:
            self.errors.error(exc)
            return
        for batch in batches:  # each on its own: one that fails loses no other
            try:
                self._write(batch.format(self.pid))
                self.n_lines += len(batch)
            except Exception as exc:
                self.errors.error(exc)

    def _write(self, data: bytes) -> None:
        """Write whole lines.  A write that fails after part of a line (a disk that
        fills up: part of the data, then ENOSPC) keeps the rest of that line, which the
        next write puts first: no torn line swallows the next good one."""
        midline = bool(self._tail)
        if midline:
            data, self._tail = self._tail + data, b""
        view = memoryview(data)
        try:
            while view:
                n = self.file.write(view)
                if not n:
                    raise OSError(f"cannot write the allocation log {self.path}")
                view = view[n:]
        except BaseException:
            done = len(data) - len(view)
            if (data[done - 1 : done] != b"\n") if done else midline:
                end = data.find(b"\n", done)
                self._tail = bytes(data[done : end + 1 if end >= 0 else len(data)])
            raise

    def close(self) -> None:
        """Stop the thread, write what is left and close the file."""
        self._closing = True
        self._wake.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=10)
        self._thread = None
        with self._lock:
            self._flush_owned()
            if self._tail:  # a torn line, not finished since: finish it if the disk allows
                try:
                    self._write(b"")
                except Exception as exc:
                    self.errors.error(exc)
            # A flush of this writer from now on (flush_log() or batch_full() on a
            # thread that fetched it before start_log replaced it) must not take the
            # recorder's records: they belong to the next log.
            self._closed = True
        with contextlib.suppress(Exception):
            self.file.close()

    def after_fork(self, pid: int) -> None:
        """In a forked child: new locks and a new thread; a ``{pid}`` template gets a
        file of its own (the parent's records were dropped: they are the parent's)."""
        self._locks()
        self._pending = 0
        self.n_lines = 0
        self._tail = b""
        if "{pid}" in self.template:
            with contextlib.suppress(Exception):
                self.file.close()
            self.append = True
            self._open(pid)
        else:
            self.pid = pid
        self.start()
