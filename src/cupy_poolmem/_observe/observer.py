"""The observer: the process's one object configuring the recorder, installing it on
the pools only while a statistics scope, a log or tracking needs it, owning the log
writer and the errors counted, with its fork and exit hooks beside it."""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .events import EVENTS
from .log_writer import LogSettings, LogWriter
from .sites import SITES, CallSites
from .tags import TAGS

if TYPE_CHECKING:
    from .statistics import Statistics

KIND_NAMES = {0: "device", 1: "pinned", 2: "managed"}
KINDS = {v: k for k, v in KIND_NAMES.items()}

_time = time.time


def live_bytes(core: Any) -> int | None:
    """Bytes live in ``core`` now: the pool's own counter (no driver call)."""
    try:
        v = getattr(core, "live_bytes", None)
        return int(v) if v is not None else int(core.stats().used_bytes)
    except Exception:
        return None


def reserved_bytes(core: Any) -> int | None:
    """What the recorder calls to re-read a pool's reserved bytes: the pool's own count
    (its CUDA pools and backend, see ``Pool._reserved``), else ``core.stats()``."""
    try:
        own = getattr(core, "_reserved", None)
        return int(own()[0]) if own is not None else int(core.stats().reserved_bytes)
    except Exception:
        return None


def runtime_module() -> Any:
    """``cupy_poolmem._runtime`` (the pools' registry and hooks), or ``None`` on a base
    install without CuPy / cuda.core: then no pool can exist, so there is nothing to
    observe, and scopes and logs simply see no allocations."""
    try:
        # Late: _runtime loads the hot path, which needs cuda; stats (and report, which
        # reads LOG_COLUMNS) must import on the base install.
        from .. import _runtime
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] in ("cupy", "cupyx", "cupy_backends", "cuda"):
            return None
        raise
    return _runtime


class Observer:
    """The recorder's configuration and the log writer (see :doc:`observability`).

    ``runtime`` returns the pools' registry and the recorder (``_runtime``; ``None`` on
    a base install).  ``ctl`` serialises configuration changes; ``track_user``
    (``track(True)``) and ``track_log`` (``start_log(..., track=True)``) together decide
    ``tracking``.
    Errors in the hooks and the writer are counted, never raised (``n_errors``).
    """

    def __init__(
        self,
        sites: CallSites = SITES,
        log_settings: LogSettings | None = None,
        runtime: Callable[[], Any] = runtime_module,
    ) -> None:
        self.active = False
        self.tracking = False
        self.track_user = False
        self.track_log = False
        self.sites = sites
        self.log_settings = log_settings or LogSettings()
        self.ctl = threading.RLock()
        self.rec: Any = None  # the hot path's Recorder, configured on first need
        self.scopes: tuple[Statistics, ...] = ()
        self.writer: LogWriter | None = None
        self.warned = False
        self._runtime_of = runtime  # the pools' registry and recorder, or None
        self._runtime: Any = None  # cupy_poolmem._runtime, once observing
        self._pid = os.getpid()
        self._errors = 0
        self._exit_hooks = False

    @property
    def recorder(self) -> Any:
        """The process's Recorder (``None`` on a base install without CUDA packages)."""
        if self.rec is None:
            runtime = self._runtime_of()
            if runtime is None:
                return None
            rec = runtime.RECORDER
            rec.configure(TAGS.tls, TAGS.scopes, self._batch_full, self._warn, reserved_bytes)
            rec.set_sites(self.sites.prefixes(), self.sites.depth)
            self.rec = rec
        return self.rec

    @property
    def n_errors(self) -> int:
        """Errors in the hooks and the writer (counted, never raised)."""
        return self._errors + (int(self.rec.n_errors) if self.rec is not None else 0)

    @n_errors.setter
    def n_errors(self, value: int) -> None:
        self._errors = value
        if self.rec is not None:
            self.rec.n_errors = 0

    def _batch_full(self) -> None:
        w = self.writer
        if w is not None:
            w.batch_full()

    def error(self, exc: BaseException) -> None:
        """Count an error (the writer's); warn about the first.  Never raises."""
        self._errors += 1
        self._warn(exc)

    def count_error(self) -> None:
        """Count an error already warned about (records the writer dropped)."""
        self._errors += 1

    def _warn(self, exc: BaseException) -> None:
        if not self.warned:
            self.warned = True
            with contextlib.suppress(BaseException):
                warnings.warn(
                    f"cupy_poolmem observer error (later ones are only counted, in "
                    f"cupy_poolmem.stats._OBSERVER.n_errors): {exc!r}",
                    RuntimeWarning,
                    stacklevel=3,
                )

    # -- configuration (under ctl) -----------------------------------------------------
    def update(self) -> None:
        """Install the observer when something needs it, remove it when nothing does."""
        was, self.tracking = self.tracking, self.track_user or self.track_log
        if self.rec is not None:
            self.rec.tracking = self.tracking
            if was and not self.tracking:
                self.set_sites()  # empties the call-site cache: no code object is kept alive
        need = bool(self.scopes) or self.writer is not None or self.tracking
        if need and not self.active:
            self._activate()
        elif not need and self.active:
            self._deactivate()

    def _activate(self) -> None:
        self.active = True
        rec = self.recorder
        if rec is None:  # no CUDA packages: no pool can exist to observe
            return
        rec.tracking = self.tracking
        rec.start()
        runtime = self._runtime = self._runtime_of()
        runtime.HOOKS.observer = rec  # pools made from now on: observed from birth
        all_pools = runtime.all_pools()
        for p in all_pools:
            # The observer set and the pool's live bytes read in one step: no
            # allocation by another thread is counted twice (or missed).
            rec.install(p, live_bytes)
        for p in all_pools:
            rec.baseline(p, 0, reserved_bytes(p))  # Python code, a driver query: after

    def _deactivate(self) -> None:
        rec = self.rec
        if rec is not None:
            self._runtime.set_global_observer(None)  # no import: this may run at exit
            rec.stop()
        self.active = False

    def add_scope(self, st: Statistics) -> None:
        """Count for ``st`` from now on (a :func:`~cupy_poolmem.statistics` scope opens)."""
        with self.ctl:
            rec = self.recorder
            if rec is not None:
                st._c = rec.add_scope(st.device, KINDS.get(st.kind) if st.kind else None)
            self.scopes = (*self.scopes, st)
            self.update()

    def remove_scope(self, st: Statistics) -> None:
        """Stop counting for ``st`` and freeze it (its scope ends)."""
        with self.ctl:
            if self.rec is not None:
                self.rec.remove_scope(st._c)
            st.end_time = _time()
            self.scopes = tuple(s for s in self.scopes if s is not st)
            self.update()

    def set_sites(self) -> None:
        """Hand the call-site settings to the recorder (emptying its cache)."""
        if self.rec is not None:
            self.rec.set_sites(self.sites.prefixes(), self.sites.depth)

    def set_tracking(self, enabled: bool, depth: int | None, skip: tuple[str, ...] | None) -> bool:
        """:func:`~cupy_poolmem.track`'s work, its arguments checked; returns the old state."""
        with self.ctl:
            before = self.track_user
            if depth is not None:
                self.sites.depth = depth
                self.set_sites()
            if skip is not None:
                self.sites.set_skip(skip)
                self.set_sites()
            self.track_user = enabled
            self.update()
            return before

    # -- the log -----------------------------------------------------------------------
    def open_log(self, template: str, append: bool, track: bool) -> str:
        """:func:`~cupy_poolmem.start_log`'s work, its arguments checked."""
        with self.ctl:
            rec = self.recorder
            writer = LogWriter(template, append, rec, self, self.log_settings)
            old, self.writer = self.writer, None
            if old is not None:
                old.close()  # the records so far go to the old file
            if old is None and rec is not None:
                rec.take_batches()  # nothing logged belongs to this file
            self.writer = writer
            if rec is not None:
                rec.set_logging(True)
            writer.start()
            self.track_log = track
            self.update()
            if rec is not None:
                rec.refresh_all()  # the first lines get a known reserved size
            self._install_exit_hooks()
            return writer.path

    def close_log(self) -> str | None:
        """:func:`~cupy_poolmem.stop_log`'s work: every line written, the file closed."""
        with self.ctl:
            old, self.writer = self.writer, None
            if self.rec is not None:
                self.rec.set_logging(False)
            self.track_log = False
            self.update()
            if old is None:
                return None
            old.close()
        return old.path

    def flush_log(self) -> str | None:
        """Write every line logged so far; the log's path (``None``: no log open)."""
        w = self.writer
        if w is None:
            return None
        w.flush()
        return w.path

    def note_event(
        self, core: Any, op: str, ptr: int, size: int, stream_ptr: int, tag: str, callsite: str
    ) -> None:
        """One event line (a guard report) in the log when one is open.  Never raises."""
        rec = self.rec
        if self.writer is None or rec is None:
            return
        rec.note(core, op, ptr, size, stream_ptr, tag, callsite)

    # -- exit and fork -----------------------------------------------------------------
    def _install_exit_hooks(self) -> None:
        """With the first log: stop it at exit; a multiprocessing child flushes it
        before it ``os._exit``s."""
        if self._exit_hooks:
            return
        atexit.register(self._close_log_at_exit)
        with contextlib.suppress(Exception):
            import multiprocessing.util as mpu

            mpu.register_after_fork(self, _flush_at_mp_exit)
        self._exit_hooks = True

    def _close_log_at_exit(self) -> None:
        with contextlib.suppress(Exception):
            self.close_log()

    def after_fork_child(self) -> None:
        """In a forked child: a new ``ctl`` (the parent's may have been held by a thread
        that does not exist here, inside ``start_log``, ``stop_log`` or ``statistics()``),
        a writer of its own, then repair what such a thread may have left half done."""
        self.ctl = threading.RLock()
        self._pid = os.getpid()
        rec = self.rec
        if rec is not None:
            rec.after_fork()
        w = self.writer
        if w is not None:
            try:
                w.after_fork(self._pid)
            except Exception as exc:
                self.writer = None
                if rec is not None:
                    rec.set_logging(False)
                self.error(exc)
        if rec is None:
            return
        try:
            # A fork inside start_log's switch: logging on, no writer to take the records.
            rec.set_logging(self.writer is not None)
            # A fork between the recorder's add_scope/remove_scope and scopes' update.
            mine = {id(st._c) for st in self.scopes if st._c is not None}
            for c in rec.scopes:
                if id(c) not in mine:
                    rec.remove_scope(c)
            # A fork inside _activate/_deactivate: observe again from a known state.
            if self.active != bool(rec.active):
                self.active = bool(rec.active)
                self.update()
        except Exception as exc:
            self.error(exc)


def _flush_at_mp_exit(obs: Observer) -> None:
    """In a multiprocessing child: write the log's last records before it ``os._exit``s."""
    import multiprocessing.util as mpu

    mpu.Finalize(None, obs.flush_log, exitpriority=0)


OBSERVER = Observer()
EVENTS.sink = OBSERVER.note_event
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=OBSERVER.after_fork_child)
