"""Pure-Python twin of ``_recorder.pyx``, the allocation recorder, used with the
pure-Python hot path (``_hotpath_py.py``); ``tests/test_hotpath_cpu.py`` compares the two."""

from __future__ import annotations

import operator
import os
import sys
import threading
import time
import weakref
from collections import deque
from typing import Any

from ._log_batch_py import LOG_BATCH, Batch

# It serialises its updates with a lock (its Python code can be interrupted anywhere)
# and queues an event re-entered from the garbage collector on the thread holding it.
SITE_CACHE_MAX = 8192  # code objects whose call sites are cached
_OP_ALLOC = "alloc"
_OP_FREE = "free"
_now = time.time
_now_ns = time.time_ns
_get_ident = threading.get_ident
_SIZE_MAX = 2**64 - 1
# The files of the twin hot path's frames (this recorder's and its pool core's): a call
# site walk starts above them, as the compiled one starts above code that has no frames.
_OWN_FILES = (__file__, os.path.join(os.path.dirname(__file__), "_hotpath_py.py"))


def as_size(size: Any) -> int:
    """What Cython's ``size_t`` conversion does: ``__index__``, then the range check."""
    n = operator.index(size)  # TypeError for floats, strings, None ...
    if n < 0:
        raise OverflowError("can't convert negative value to size_t")
    if n > _SIZE_MAX:
        raise OverflowError("int too big to convert")
    return n


class Counts:
    """Counters of one tag inside one ``statistics()`` scope."""

    __slots__ = ("n_allocs", "n_frees", "total_bytes", "current_bytes", "peak_bytes")

    def __init__(self) -> None:
        self.n_allocs = self.n_frees = self.total_bytes = 0
        self.current_bytes = self.peak_bytes = 0


class Scope:
    """Counters of one ``statistics()`` scope; ``per_tag`` maps a tag to its Counts."""

    __slots__ = (
        "n_allocs",
        "n_frees",
        "current_bytes",
        "peak_used_bytes",
        "total_bytes",
        "per_tag",
        "start_serial",
        "_device",
        "_kind",
    )

    def __init__(self) -> None:
        self.n_allocs = self.n_frees = self.total_bytes = 0
        self.current_bytes = self.peak_used_bytes = 0
        self.per_tag: dict[str, Counts] = {}
        self.start_serial = 0
        self._device: int | None = None
        self._kind: int | None = None

    def _matches(self, device: int, kind: int) -> bool:
        return (self._device is None or self._device == device) and (
            self._kind is None or self._kind == kind
        )


class PoolObs:
    """What the recorder keeps of one pool (found by ``id(core)``)."""

    __slots__ = ("ref", "core_id", "device", "kind", "used", "reserved", "reserved_t", "dev")
    ref: Any
    core_id: int
    device: int
    kind: int
    used: int
    reserved: int
    reserved_t: float
    dev: DevObs

    def _is(self, core: Any) -> bool:
        return self.ref() is core


class DevObs:
    """Bytes used and last known reserved (-1: unknown) in the pools of one device."""

    __slots__ = ("used", "reserved")

    def __init__(self) -> None:
        self.used = 0
        self.reserved = -1


class Info:
    """What the recorder knows of one observed allocation (``Block.info``)."""

    __slots__ = (
        "serial",
        "time",
        "tag",
        "callsite",
        "ptr",
        "size",
        "stream",
        "device",
        "_ns",
        "_pool",
    )
    serial: int
    time: float
    tag: str
    callsite: str | None
    ptr: int
    size: int
    stream: int
    device: int
    _ns: int
    _pool: PoolObs

    @property
    def core_id(self) -> int:
        return self._pool.core_id


class _Serial:
    """The twin's critical section: a lock, and a queue for re-entry on its thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.owner: int | None = None
        self.q: deque = deque()

    def run(self, fn: Any, *args: Any) -> Any:
        ident = _get_ident()
        if self.owner == ident:  # a free from a garbage collection inside fn: after it
            self.q.append((fn, args))
            return None
        with self.lock:
            self.owner = ident
            try:
                out = fn(*args)
                while self.q:
                    f, a = self.q.popleft()
                    f(*a)
                return out
            finally:
                self.owner = None

    def call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` under the lock, at once even when this thread holds it."""
        if self.owner == _get_ident():
            return fn(*args)
        with self.lock:
            return fn(*args)


class Observer:
    """What the hot path calls for each allocation and free (``Recorder``)."""

    __slots__ = ()


class Observed:
    """A pool as its observer keeps it: ``_observe`` makes an observer its own (the hot
    path's ``PoolCore``)."""

    __slots__ = ()

    def _observe(self, observer: Any) -> int:
        """Install ``observer``; the bytes live at that instant."""
        raise NotImplementedError


class Recorder(Observer):
    """The pools' observer (``PoolCore.observer``): see ``_recorder.pyx``."""

    active = False
    tracking = False
    logging = False
    scopes: tuple[Scope, ...] = ()
    n_errors = 0

    def __init__(self) -> None:
        self.active = False
        self.tracking = False
        self.logging = False
        self.scopes: tuple[Scope, ...] = ()
        self.n_errors = 0
        self._serial = 0
        self._live: set[Info] = set()
        self._pools: dict[int, PoolObs] = {}
        self._devs: dict[int, DevObs] = {}
        self._batch = Batch()
        self._sealed: list[Batch] = []
        self._tls: Any = None
        self._tags: Any = [1]  # stats' count of open tag() scopes: 0 skips the thread-local
        self._on_batch: Any = None
        self._on_error: Any = None
        self._refresh: Any = None
        self._depth = 32
        self._skip: tuple[str, ...] = ()
        self._codes: dict[int, tuple] = {}
        self._cs = _Serial()

    # -- configuration (stats.py) ------------------------------------------------------
    def configure(self, tls: Any, tags: Any, on_batch: Any, on_error: Any, refresh: Any) -> None:
        """The tag thread-local and the count of open tag scopes (``array('q', [n])``),
        then fn() for a full batch, fn(exc), fn(core) -> reserved bytes."""
        self._tls, self._tags = tls, tags
        self._on_batch, self._on_error, self._refresh = on_batch, on_error, refresh

    def set_sites(self, skip: tuple, depth: int) -> None:
        """Path prefixes whose frames are not call sites, and the most frames walked."""
        self._skip, self._depth, self._codes = tuple(skip), depth, {}

    def start(self) -> None:
        def start() -> None:
            self._live, self._pools, self._devs = set(), {}, {}
            self.active = True

        self._cs.run(start)

    def stop(self) -> None:
        def stop() -> None:
            self.active = False
            self._live, self._pools, self._devs = set(), {}, {}
            self._codes = {}  # the code objects met while tracking: not kept alive

        self._cs.run(stop)

    def install(self, core: Any, live_bytes: Any) -> None:
        """Become ``core``'s observer and count the bytes live in it at that instant
        (see ``_recorder.pyx``; here the two are consecutive statements)."""
        p = self._pool_of(core)
        if core.observer is self:
            return
        if isinstance(core, Observed):
            n = core._observe(self)
        else:
            v = live_bytes(core)
            core.observer = self
            n = v if v is not None else 0

        def add() -> None:
            if n > 0:
                p.used += n
                p.dev.used += n

        self._cs.run(add)

    def baseline(self, core: Any, used: int | None, reserved: int | None) -> None:
        """Count ``used`` bytes already live in ``core`` (and its reserved bytes)."""
        p = self._pool_of(core)

        def add() -> None:
            if used:
                p.used += used
                p.dev.used += used
            if reserved is not None:
                self._set_reserved(p, reserved, _now())

        self._cs.run(add)

    def add_scope(self, device: int | None, kind: int | None) -> Scope:
        s = Scope()
        s._device, s._kind = device, kind

        def add() -> None:
            s.start_serial = self._serial
            self.scopes = (*self.scopes, s)

        self._cs.run(add)
        return s

    def remove_scope(self, scope: Scope) -> None:
        def remove() -> None:
            self.scopes = tuple(s for s in self.scopes if s is not scope)

        self._cs.run(remove)

    def set_logging(self, on: bool) -> None:
        self.logging = bool(on)

    def refresh_all(self) -> None:
        """Re-read the reserved bytes of every pool seen (a log starts)."""
        for p in list(self._pools.values()):
            core = p.ref()
            if core is not None:
                self._refresh_pool(p, core, _now())

    def after_fork(self) -> None:
        """In a forked child: the parent's records are the parent's to write."""
        self._cs = _Serial()
        self._batch, self._sealed = Batch(), []

    # -- hooks called by the hot path ----------------------------------------------------
    def on_alloc(self, block: Any) -> None:
        try:  # the conversions of the compiled version's C arguments
            ptr, size, sptr = as_size(block.ptr), as_size(block.size), as_size(block.stream_ptr)
            core = block.core
        except Exception as exc:
            self._error(exc)
            return
        self._alloc(core, ptr, size, sptr, block)

    def on_free(self, core: Any, ptr: int, size: int, stream_ptr: int, info: Any) -> None:
        try:
            ptr, size, stream_ptr = as_size(ptr), as_size(size), as_size(stream_ptr)
        except Exception as exc:
            self._error(exc)
            return
        self._free(core, ptr, size, stream_ptr, info)

    def note(
        self, core: Any, op: str, ptr: int, size: int, stream_ptr: int, tag: str, callsite: str
    ) -> None:
        """A log line for another event (a guard report).  Never raises."""
        try:
            if not self.logging:
                return
            ns, thread, dev = _now_ns(), self._thread_name(), int(core.device_id)
            ptr, size, stream_ptr = as_size(ptr), as_size(size), as_size(stream_ptr)

            def append() -> bool:
                d = self._devs.get(dev)
                used, reserved = (d.used, d.reserved) if d is not None else (-1, -1)
                return self._append(
                    ns, ptr, size, stream_ptr, used, reserved, dev, op, thread, tag, callsite
                )

            sealed = self._cs.run(append)
            if sealed:
                self._on_batch()
        except Exception as exc:  # a KeyboardInterrupt, a SystemExit: the caller's
            self._error(exc)

    # -- reading (stats.py) --------------------------------------------------------------
    def live(self, core: Any) -> list[Info]:
        """Live observed allocations, of ``core`` only unless it is None."""
        infos = self._cs.call(lambda: list(self._live))
        return infos if core is None else [i for i in infos if i._pool.core_id == id(core)]

    def take_batches(self) -> list[Batch]:
        """The records so far, the partly filled batch included, for the writer."""

        def take() -> list[Batch]:
            out, self._sealed = self._sealed, []
            if self._batch.recs:
                out.append(self._batch)
                self._batch = Batch()
            return out

        return self._cs.call(take)

    # -- the work ------------------------------------------------------------------------
    def _alloc(self, core: Any, ptr: int, size: int, sptr: int, block: Any) -> None:
        """Count an allocation, log it and set ``block.info`` (see ``_recorder.pyx``: an
        ``Exception`` is counted, any other ``BaseException`` raised once it is done)."""
        if not self.active:
            return
        thread = None
        stop: BaseException | None = None
        info = Info()
        info.serial = 0  # until _apply_alloc numbers it
        info._ns = _now_ns()
        t = info.time = info._ns * 1e-9
        info.tag, info.ptr, info.size, info.stream = "", ptr, size, sptr
        info.callsite = None
        try:
            # Everything that may run Python code first; the counters change in one go.
            if self._tags[0]:
                info.tag = self._tls.tag
            if self.tracking:
                info.callsite = self._site()
            p = info._pool = self._pool_of(core)
            info.device = p.device
            if self.logging:
                thread = self._thread_name()
                if p.reserved >= 0 and p.used + size > p.reserved or t - p.reserved_t > 1.0:
                    self._refresh_pool(p, core, t)
            self._prepare_tags(info.tag, p.device, p.kind)
        except Exception as exc:
            self._error(exc)
            return
        except BaseException as exc:
            stop = exc
        if stop is not None:
            if type(info.tag) is not str:
                info.tag = ""
            try:
                if getattr(info, "_pool", None) is None:
                    info._pool = self._pool_of(core)
                info.device = info._pool.device
            except BaseException:
                raise stop from None
            if thread is None and self.logging:
                thread = ""
        try:
            if self._cs.run(self._apply_alloc, info, thread):
                self._on_batch()
        except Exception as exc:
            self._error(exc)
        block.info = info
        if stop is not None:
            raise stop

    def _apply_alloc(self, info: Info, thread: Any) -> bool:
        self._serial += 1
        info.serial = self._serial
        p, size = info._pool, info.size
        p.used += size
        d = p.dev
        d.used += size
        if info.ptr:
            self._live.add(info)
        for s in self.scopes:
            if s._matches(p.device, p.kind):
                s.n_allocs += 1
                s.total_bytes += size
                s.current_bytes += size
                if s.current_bytes > s.peak_used_bytes:
                    s.peak_used_bytes = s.current_bytes
                c = s.per_tag.get(info.tag)
                if c is not None:
                    c.n_allocs += 1
                    c.total_bytes += size
                    c.current_bytes += size
                    if c.current_bytes > c.peak_bytes:
                        c.peak_bytes = c.current_bytes
        if thread is None or not self.logging:
            return False
        return self._append(
            info._ns,
            info.ptr,
            size,
            info.stream,
            d.used,
            d.reserved,
            p.device,
            _OP_ALLOC,
            thread,
            info.tag,
            info.callsite,
        )

    def _free(self, core: Any, ptr: int, size: int, sptr: int, info: Any) -> None:
        # From Block.__dealloc__: never raises.
        try:
            if not self.active:
                return
            ns = _now_ns()
            thread = self._thread_name() if self.logging else None
            p = info._pool if info is not None else None
            if p is None or self._pools.get(p.core_id) is not p:  # observed before a restart
                p = self._pool_of(core)
            if self._cs.run(self._apply_free, p, ptr, size, sptr, info, ns, thread):
                self._on_batch()
        except BaseException as exc:
            self._error(exc)

    def _apply_free(
        self, p: PoolObs, ptr: int, size: int, sptr: int, info: Any, ns: int, thread: Any
    ) -> bool:
        p.used = max(0, p.used - size)
        d = p.dev
        d.used = max(0, d.used - size)
        tag = site = ""
        if info is not None:
            self._live.discard(info)
            tag, site = info.tag, info.callsite
            for s in self.scopes:
                if info.serial > s.start_serial and s._matches(p.device, p.kind):
                    s.n_frees += 1
                    s.current_bytes -= size
                    c = s.per_tag.get(tag)
                    if c is not None:
                        c.n_frees += 1
                        c.current_bytes -= size
        if thread is None or not self.logging:
            return False
        return self._append(
            ns, ptr, size, sptr, d.used, d.reserved, p.device, _OP_FREE, thread, tag, site
        )

    def _append(
        self,
        ns: int,
        ptr: int,
        size: int,
        sptr: int,
        used: int,
        reserved: int,
        dev: int,
        op: str,
        thread: str,
        tag: str,
        site: Any,
    ) -> bool:
        """Add a record; True when it filled the batch (the writer is to be woken)."""
        b = self._batch
        b.recs.append((ns, ptr, size, sptr, used, reserved, dev, op, thread, tag, site))
        if len(b.recs) < LOG_BATCH:
            return False
        self._sealed.append(b)
        self._batch = Batch()
        return True

    def _prepare_tags(self, tag: str, device: int, kind: int) -> None:
        for s in self.scopes:
            if tag not in s.per_tag and s._matches(device, kind):
                s.per_tag[tag] = Counts()

    def _pool_of(self, core: Any) -> PoolObs:
        key = id(core)
        p = self._pools.get(key)
        if p is not None and p._is(core):
            return p
        p = PoolObs()
        try:
            p.ref = weakref.ref(core)
        except TypeError:  # an object without weak references: held
            p.ref = Held(core)
        p.core_id, p.device, p.kind = key, int(core.device_id), int(core.kind)
        p.used, p.reserved, p.reserved_t = 0, -1, 0.0
        d = self._devs.get(p.device)
        if d is None:
            d = self._devs.setdefault(p.device, DevObs())
        p.dev = d
        return self._cs.call(self._add_pool, core, p)

    def _add_pool(self, core: Any, p: PoolObs) -> PoolObs:
        cur = self._pools.get(p.core_id)
        if cur is not None and cur._is(core):
            return cur  # another thread was first
        self._pools[p.core_id] = p
        return p

    def _refresh_pool(self, p: PoolObs, core: Any, t: float) -> None:
        r = self._refresh(core)
        self._cs.call(self._set_reserved, p, r, t)

    def _set_reserved(self, p: PoolObs, r: int | None, t: float) -> None:
        p.reserved_t = t
        if r is None:
            return
        d = p.dev
        d.reserved = max(d.reserved, 0) + r - max(p.reserved, 0)
        p.reserved = r

    def _thread_name(self) -> str:
        return self._tls.thread.name

    def _site(self) -> str | None:
        """The first frame above the recorder outside the skipped packages."""
        f: Any = sys._getframe(1)
        while f is not None and f.f_code.co_filename in _OWN_FILES:
            f = f.f_back  # the twin's own frames (none in the compiled version)
        codes = self._codes
        for _ in range(self._depth):
            if f is None:
                return None
            code = f.f_code
            entry = codes.get(id(code))
            if entry is None or entry[0] is not code:
                entry = code_entry(codes, code, self._skip)
            lines = entry[1]
            if lines is not None:
                lineno = f.f_lineno
                site = lines.get(lineno)
                if site is None:
                    site = lines[lineno] = f"{code.co_filename}:{lineno} in {code.co_name}"
                return site
            f = f.f_back
        return None

    def _error(self, exc: BaseException) -> None:
        """Count an error in a hook (stats warns about the first).  Never raises."""
        self.n_errors += 1
        try:
            if self._on_error is not None:
                self._on_error(exc)
        except BaseException:
            pass


class Held:
    """A strong reference that answers like a weak one (both recorders use it)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __call__(self) -> Any:
        return self.obj


def code_entry(codes: dict, code: Any, skip: tuple) -> tuple:
    """The call-site cache's entry for ``code``, made and kept in ``codes`` (id(code) ->
    entry; both recorders use it): ``(code, None)`` for the code of a skipped path,
    else ``(code, {line: call site})``."""
    if len(codes) >= SITE_CACHE_MAX:
        codes.clear()
    entry: tuple = (code, None if code.co_filename.startswith(skip) else {})
    codes[id(code)] = entry
    return entry
