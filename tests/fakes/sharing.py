"""A fake GPU and driver that run the sharing protocol on a CPU, with real sockets.

Every simulated process of a test is a :class:`SimProc`: its own
``SharingContext(settings, driver=FakeDriver(gpu, name))``, all of them in this one
Python process (so they share its pid, its fd table and its multiprocessing authkey).
They talk through the package's real transport (Unix sockets, SCM_RIGHTS for pool
descriptors); only the CUDA calls are fake.

:class:`FakeGPU` is the device all simulated processes share.  It models:

- pools (each with a real file descriptor, a pipe, that travels like the real one) and
  their allocations; an allocation carries a *generation* (bumped each time its address
  is reused) and a *payload* (an int the exporter "writes");
- export records that encode ``(pool, ptr)`` only, so a stale record names a reused
  address exactly like the real driver's would;
- streams and events as vector clocks: operations execute at once, but each stream
  knows which work of every other stream is ordered before its next operation (through
  ``wait_event``), and each process's host knows what it waited for (``sync_event``,
  ``sync_stream``).  That is how the fake checks the driver rules;
- processes whose GPU context ends (exit or kill): their imports end with it, and an
  exporter's allocations nobody imports are released.

Rule violations are appended to ``FakeGPU.violations`` (tests assert it stays empty):
an exporter freeing an allocation some live process still imports, or freeing it
without being ordered after an importer's free; importing one allocation twice in a
process while the first import is live (its free not yet waited for); using an event
or an imported pool after closing it; reading a mapping that is gone, or before the
sender's writes are ordered before the read.

``FakeDriver`` has exactly the public methods of
``cupy_poolmem._sharing._driver.Driver`` (a CPU test compares them by introspection).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from cupy_poolmem._errors import CUDADriverError, SharingError
from cupy_poolmem._sharing import _transport, _wire
from cupy_poolmem._sharing._context import SharingContext
from cupy_poolmem._sharing._mapping import Imported
from cupy_poolmem._sharing._records import LocalHold
from cupy_poolmem._sharing._reducers import describe, receive
from cupy_poolmem._sharing._settings import SharingSettings

Clock = dict  # lane -> count, a lane being (process name, stream ptr)
_RECORD = struct.Struct(
    "<8sQQQ"
)  # magic, pool id, ptr, (unused: the real record has no generation)
_EVENT = struct.Struct("<8sQ")


def _merge(into: Clock, other: Clock | None) -> None:
    if other:
        for lane, n in other.items():
            if into.get(lane, 0) < n:
                into[lane] = n


def _covered(stamp: tuple[Any, int] | None, clock: Clock) -> bool:
    return stamp is None or clock.get(stamp[0], 0) >= stamp[1]


def _cuda_error(call: str, name: str, code: int = 1) -> CUDADriverError:
    return CUDADriverError(call, code, name, "(fake driver)")


class FakeStream:
    """What a CuPy stream looks like to the sharing code: ``ptr`` and ``device_id``."""

    def __init__(self, ptr: int = 0, device_id: int = 0) -> None:
        self.ptr, self.device_id = ptr, device_id

    def __repr__(self) -> str:
        return f"FakeStream({self.ptr:#x})"


# -- the device --------------------------------------------------------------------------------
class _Alloc:
    __slots__ = ("pool", "ptr", "size", "gen", "payload", "write", "live", "owner_gone", "imports")

    def __init__(self, pool: _Pool, ptr: int, size: int, gen: int) -> None:
        self.pool, self.ptr, self.size, self.gen = pool, ptr, size, gen
        self.payload: Any = None
        self.write: tuple[Any, int] | None = None  # stamp of the last write
        self.live = True
        self.owner_gone = False  # exporter's context gone; kept while imported
        self.imports: list[_Import] = []


class _Import:
    __slots__ = ("proc", "alloc", "gen", "local", "freed", "dead", "uses")

    def __init__(self, proc: _Proc, alloc: _Alloc, local: int) -> None:
        self.proc, self.alloc, self.gen, self.local = proc, alloc, alloc.gen, local
        self.freed: tuple[Any, int] | None = None  # stamp of the importer's free
        self.dead = False  # the importing process's context is gone
        self.uses: dict[int, tuple[Any, int]] = {}  # stream -> stamp of its last read

    def live_for(self, clock: Clock) -> bool:
        """Still mapped, as seen by a stream or host that knows ``clock``."""
        if self.dead:
            return False
        return self.freed is None or not _covered(self.freed, clock)


class _Pool:
    def __init__(self, gpu: FakeGPU, pid: int, owner: _Proc, device: int, kind: int) -> None:
        self.gpu, self.id, self.owner, self.device, self.kind = gpu, pid, owner, device, kind
        self.base = pid << 40
        self.top = self.base
        self.free: dict[int, list[int]] = {}  # size -> addresses, most recently freed last
        self.allocs: dict[int, _Alloc] = {}  # ptr -> current allocation at that address
        self.gens: dict[int, int] = {}  # ptr -> generation counter


class _Event:
    """A CUDA event (one per record site); ``snap`` is what its last record covers."""

    _ids = itertools.count(1)

    def __init__(self, owner: _Proc, ipc: bool) -> None:
        self.id = next(self._ids)
        self.owner, self.ipc = owner, ipc
        self.snap: Clock | None = None
        self.handle = _EVENT.pack(b"FAKEEVNT", self.id).ljust(_wire.HANDLE_BYTES, b"\0")


class FakeEventHandle:
    """A process's handle of an event (its own, or a peer's opened by IPC handle)."""

    __slots__ = ("event", "proc", "closed", "__weakref__")

    def __init__(self, event: _Event, proc: _Proc) -> None:
        self.event, self.proc, self.closed = event, proc, False

    def __repr__(self) -> str:
        return f"<event {self.event.id} of {self.event.owner.name} in {self.proc.name}>"


class FakePoolImport:
    """The keepalive of an imported pool (what cuda.core's resource is for the real one)."""

    __slots__ = ("pool", "proc", "handle", "closed", "granted")

    def __init__(self, pool: _Pool, proc: _Proc, handle: int) -> None:
        self.pool, self.proc, self.handle, self.closed = pool, proc, handle, False
        self.granted = 0


class _Proc:
    def __init__(self, name: str) -> None:
        self.name = name
        self.alive = True
        self.host: Clock = {}
        # what a synchronising call (not a query) saw complete: the driver settles the
        # frees of an imported pool only there (see close_pool)
        self.synced: Clock = {}
        self.lanes: dict[int, Clock] = {}
        self.imports: dict[int, _Import] = {}  # local ptr -> import (live or freed)
        self.pool_imports: dict[int, FakePoolImport] = {}
        self.ipc_events: dict[tuple[int, int], FakeEventHandle] = {}


class FakeGPU:
    """The device every simulated process of one test shares (thread-safe)."""

    def __init__(self, n_devices: int = 1) -> None:
        self.lock = threading.RLock()
        self.uuids = [f"GPU-{uuid.UUID(int=0xFA4E0000 + i)}" for i in range(n_devices)]
        self.procs: dict[str, _Proc] = {}
        self.pools: dict[int, _Pool] = {}
        self._pool_by_file: dict[tuple[int, int], _Pool] = {}
        self._pool_ids = itertools.count(1)
        self._locals = itertools.count(1)
        self.events: dict[int, _Event] = {}
        self.violations: list[str] = []
        self.log: list[tuple] = []  # (process, op, details...)
        # Work some host waited for is complete, for every process: what happens after
        # in real time (a message passed on, say) is ordered after it.
        self.done: Clock = {}
        self.vmm: Any = None  # the VMM fake of step-backed pools (tests/fakes/step_sharing.py)

    # -- bookkeeping ------------------------------------------------------------------
    def proc(self, name: str) -> _Proc:
        with self.lock:
            p = self.procs.get(name)
            if p is None:
                p = self.procs[name] = _Proc(name)
            return p

    def violate(self, msg: str) -> None:
        with self.lock:
            self.violations.append(msg)

    def _lane(self, p: _Proc, stream: int) -> Clock:
        lane = p.lanes.get(stream)
        if lane is None:
            lane = p.lanes[stream] = {}
        return lane

    def op(self, p: _Proc, stream: int) -> tuple[Any, int]:
        """Enqueue one operation on ``p``'s ``stream``; its stamp.  The host's knowledge
        comes first: work the host waited for is ordered before what it enqueues next."""
        lane = self._lane(p, stream)
        _merge(lane, p.host)
        _merge(lane, self.done)
        key = (p.name, stream)
        lane[key] = lane.get(key, 0) + 1
        return key, lane[key]

    def knows(self, p: _Proc, stream: int | None) -> Clock:
        """What is ordered before the next operation of ``p`` on ``stream`` (None: host)."""
        c = dict(p.host)
        _merge(c, self.done)
        if stream is not None:
            _merge(c, self._lane(p, stream))
        return c

    def host_waited(self, p: _Proc, clock: Clock | None) -> None:
        """``p``'s host waited for the work ``clock`` covers: it is complete."""
        _merge(p.host, clock)
        _merge(self.done, clock)

    def host_synced(self, p: _Proc, clock: Clock | None) -> None:
        """Like :meth:`host_waited`, through a synchronising call (not a query)."""
        self.host_waited(p, clock)
        _merge(p.synced, clock)

    # -- pools and allocations (the exporter's side) ------------------------------------
    def new_pool(self, owner: _Proc, device: int, kind: int, fd: int) -> _Pool:
        st = os.fstat(fd)
        with self.lock:
            pool = _Pool(self, next(self._pool_ids), owner, device, kind)
            self.pools[pool.id] = pool
            self._pool_by_file[(st.st_dev, st.st_ino)] = pool
            return pool

    def alloc(self, pool: _Pool, size: int, stream: int) -> _Alloc:
        with self.lock:
            size = max(size, 1)
            free = pool.free.get(size)
            if free:
                ptr = free.pop()  # the address just freed: reuse is immediate, as in a pool
            else:
                ptr = pool.top
                pool.top += (size + 0xFFF) & ~0xFFF
            gen = pool.gens[ptr] = pool.gens.get(ptr, 0) + 1
            a = pool.allocs[ptr] = _Alloc(pool, ptr, size, gen)
            a.write = self.op(pool.owner, stream)
            self.log.append((pool.owner.name, "alloc", ptr, gen))
            return a

    def write(self, pool: _Pool, ptr: int, stream: int, payload: Any) -> None:
        """The exporter writes ``payload``; every importer's reads on its streams must be
        ordered before (a recycled block rewritten while a receiver reads it is a
        violation)."""
        with self.lock:
            a = pool.allocs.get(ptr)
            if a is None or not a.live:
                self.violate(f"{pool.owner.name} wrote {ptr:#x}, which is not allocated")
                return
            knows = self.knows(pool.owner, stream)
            for imp in a.imports:
                if imp.dead:
                    continue
                for stamp in imp.uses.values():
                    if not _covered(stamp, knows):
                        self.violate(
                            f"{pool.owner.name} rewrote {ptr:#x} before {imp.proc.name}'s "
                            "read of it was ordered before (reuse while another reads)"
                        )
            a.payload = payload
            a.write = self.op(pool.owner, stream)

    def free(self, pool: _Pool, ptr: int, stream: int) -> None:
        """The exporter frees ``ptr`` in order on ``stream``: every importer must have
        freed it first, and this free must be ordered after theirs."""
        with self.lock:
            p = pool.owner
            if not p.alive:
                return  # its context is gone: the allocations went with it
            a = pool.allocs.get(ptr)
            if a is None or not a.live:
                self.violate(f"{p.name} freed {ptr:#x} twice (or never allocated it)")
                return
            knows = self.knows(p, stream)
            for imp in a.imports:
                if imp.dead:
                    continue
                if imp.freed is None:
                    self.violate(
                        f"{p.name} freed {ptr:#x} (gen {a.gen}) while {imp.proc.name} still "
                        "imports it (importers must free first)"
                    )
                elif not _covered(imp.freed, knows):
                    self.violate(
                        f"{p.name} freed {ptr:#x} (gen {a.gen}) without waiting for "
                        f"{imp.proc.name}'s unmap event"
                    )
            self.op(p, stream)
            self._release(a)
            self.log.append((p.name, "free", ptr, a.gen))

    def _release(self, a: _Alloc) -> None:
        a.live = False
        pool = a.pool
        if pool.allocs.get(a.ptr) is a:
            del pool.allocs[a.ptr]
        pool.free.setdefault(a.size, []).append(a.ptr)

    def alloc_at(self, pool_id: int, ptr: int) -> _Alloc | None:
        pool = self.pools.get(pool_id)
        return pool.allocs.get(ptr) if pool is not None else None

    def export_record(self, p: _Proc, ptr: int) -> bytes:
        with self.lock:
            for pool in self.pools.values():
                a = pool.allocs.get(ptr)
                if a is not None and pool.owner is p and a.live:
                    return _RECORD.pack(b"FAKEXPRT", pool.id, ptr, 0).ljust(
                        _wire.HANDLE_BYTES, b"\0"
                    )
        raise _cuda_error("cuMemPoolExportPointer", "CUDA_ERROR_INVALID_VALUE")

    # -- processes ----------------------------------------------------------------------------
    def context_gone(self, name: str) -> None:
        """The process's GPU context is destroyed (it exited or was killed): its imports
        end, and its own allocations that nobody imports are released."""
        with self.lock:
            p = self.proc(name)
            if not p.alive:
                return
            p.alive = False
            for imp in p.imports.values():
                if not imp.dead:
                    imp.dead = True
                    self._maybe_release_orphan(imp.alloc)
            for pool in self.pools.values():
                if pool.owner is not p:
                    continue
                for a in list(pool.allocs.values()):
                    if any(not i.dead and i.freed is None for i in a.imports):
                        a.owner_gone = True  # importers keep the memory alive
                    else:
                        self._release(a)
            self.log.append((name, "context-gone"))

    def _maybe_release_orphan(self, a: _Alloc) -> None:
        if a.owner_gone and a.live and all(i.dead or i.freed is not None for i in a.imports):
            self._release(a)

    # -- reads (what a kernel of the receiver would see) ------------------------------------
    def read(self, p: _Proc, local: int, stream: int | None = None) -> tuple[int, Any]:
        """``(generation, payload)`` of what ``p`` maps at ``local``, read on ``stream``
        (None: the host, after the waits ``p`` made)."""
        with self.lock:
            imp = p.imports.get(local)
            if imp is None or imp.dead or imp.freed is not None:
                self.violate(f"{p.name} read {local:#x}, which it does not map")
                return -1, None
            a = imp.alloc
            if not a.live or a.gen != imp.gen:
                self.violate(f"{p.name} read {local:#x} after its exporter freed it")
            elif not _covered(a.write, self.knows(p, stream)):
                self.violate(f"{p.name} read {local:#x} before the sender's writes were ordered")
            if stream is not None:  # a kernel: it runs later, ordered on its stream
                imp.uses[stream] = self.op(p, stream)
            return imp.gen, a.payload

    def read_own(self, pool: _Pool, ptr: int, stream: int | None = None) -> tuple[int, Any]:
        with self.lock:
            a = pool.allocs.get(ptr)
            if a is None or not a.live:
                self.violate(f"{pool.owner.name} read its {ptr:#x} after freeing it")
                return -1, None
            return a.gen, a.payload

    def live_imports(self, name: str) -> list[_Import]:
        with self.lock:
            p = self.proc(name)
            return [i for i in p.imports.values() if not i.dead and i.freed is None]


# -- the driver of one simulated process ------------------------------------------------------
class _OnDevice:
    __slots__ = ("drv", "dev", "prev")

    def __init__(self, drv: FakeDriver, dev: int) -> None:
        self.drv, self.dev, self.prev = drv, dev, 0

    def __enter__(self) -> None:
        self.prev = self.drv._current_device()
        self.drv._tls.dev = self.dev

    def __exit__(self, *exc: Any) -> None:
        self.drv._tls.dev = self.prev


class FakeDriver:
    """The driver of one simulated process (same public methods as ``Driver``)."""

    def __init__(self, gpu: FakeGPU, name: str, visible: list[int] | None = None) -> None:
        self._gpu = gpu
        # this process's ordinals -> the GPU's devices (CUDA_VISIBLE_DEVICES)
        self._visible = list(range(len(gpu.uuids))) if visible is None else list(visible)
        self._p = gpu.proc(name)
        self._name = name
        self._tls = threading.local()
        self._capturing: set[int] = set()
        self._hooks: dict[str, Callable[..., None]] = {}  # method -> called first (tests)
        self._handles = itertools.count(1)
        self.unfinished = 0  # event queries still to answer "not done" (tests)

    # helpers (private: the public surface is Driver's) -----------------------------------
    def _current_device(self) -> int:
        return getattr(self._tls, "dev", 0)

    def _hook(self, name: str, *args: Any) -> None:
        h = self._hooks.get(name)
        if h is not None:
            h(*args)

    def _use(self, ev: Any, what: str) -> _Event | None:
        if not isinstance(ev, FakeEventHandle):
            self._gpu.violate(f"{self._name}: {what} of {ev!r}, which is not an event")
            return None
        if ev.closed:
            self._gpu.violate(f"{self._name}: {what} of {ev!r} after closing it")
            return None
        if ev.proc is not self._p:
            self._gpu.violate(f"{self._name}: {what} of {ev!r}, another process's handle")
        return ev.event

    def _set_stream(self, stream: FakeStream) -> None:
        self._tls.stream = stream

    # -- devices --------------------------------------------------------------------------
    def on_device(self, dev: int) -> _OnDevice:
        return _OnDevice(self, dev)

    def device_uuid(self, dev: int) -> str:
        return self._gpu.uuids[self._visible[dev]]

    def local_device(self, uuid: str) -> int:
        try:
            return self._visible.index(self._gpu.uuids.index(uuid))
        except ValueError:
            raise SharingError(
                f"received memory of GPU {uuid}, which this process cannot see"
            ) from None

    def current_device(self) -> int:
        return self._current_device()

    def current_stream(self) -> Any:
        s = getattr(self._tls, "stream", None)
        if s is None:
            s = self._tls.stream = FakeStream(0, self._current_device())
        return s

    # -- steps of mapped and expandable pools (the VMM fake a test put on the GPU) --------
    def vmm(self) -> Any:
        if self._gpu.vmm is None:
            raise AssertionError("this test's FakeGPU has no VMM fake (gpu.vmm)")
        return self._gpu.vmm

    def step_peers(self, dev: int) -> tuple[int, ...]:
        return tuple(i for i in range(len(self._visible)) if i != dev)

    # -- allocations ----------------------------------------------------------------------
    def export_pointer(self, ptr: int) -> bytes:
        self._hook("export_pointer", ptr)
        return self._gpu.export_record(self._p, ptr)

    def import_pool(self, fd: int, kind: int, dev: int) -> tuple[int, Any]:
        self._hook("import_pool", fd, kind, dev)
        st = os.fstat(fd)  # the descriptor really arrived: it names the exporter's pipe
        g = self._gpu
        with g.lock:
            pool = g._pool_by_file.get((st.st_dev, st.st_ino))
            if pool is None:
                raise _cuda_error("cuMemPoolImportFromShareableHandle", "CUDA_ERROR_INVALID_VALUE")
            if pool.kind != kind:
                g.violate(f"{self._name} imported pool {pool.id} as kind {kind}, not {pool.kind}")
            if kind != _wire.POOL_PINNED and self._visible[dev] != pool.device:
                g.violate(
                    f"{self._name} imported pool {pool.id} of GPU {pool.device} on its device "
                    f"{dev} (GPU {self._visible[dev]})"
                )
            h = next(self._handles) | 0xF0000000
            keep = self._p.pool_imports[h] = FakePoolImport(pool, self._p, h)
            g.log.append((self._name, "import_pool", pool.id))
            return h, keep

    def grant_peers(self, pool_handle: int, owner: int) -> None:
        g = self._gpu
        with g.lock:
            keep = self._p.pool_imports.get(pool_handle)
            if keep is None or keep.closed:
                g.violate(f"{self._name} granted access to a closed or unknown pool")
                return
            keep.granted += 1
            if keep.granted > 1:
                g.violate(f"{self._name} granted access to imported pool {keep.pool.id} twice")

    def forget_pool(self, pool_handle: int) -> None:
        g = self._gpu
        with g.lock:
            keep = self._p.pool_imports.get(pool_handle)
            if keep is None or keep.closed:
                g.violate(f"{self._name} forgot a closed or unknown pool")

    def close_pool(self, keepalive: Any) -> None:
        g = self._gpu
        with g.lock:
            if not isinstance(keepalive, FakePoolImport) or keepalive.proc is not self._p:
                g.violate(f"{self._name} closed {keepalive!r}, not a pool it imported")
                return
            if keepalive.closed:
                g.violate(f"{self._name} closed imported pool {keepalive.pool.id} twice")
            keepalive.closed = True
            synced = self._p.synced
            for imp in self._p.imports.values():
                if imp.alloc.pool is not keepalive.pool or imp.dead:
                    continue
                if imp.freed is None:
                    g.violate(
                        f"{self._name} closed imported pool {keepalive.pool.id} while it maps "
                        f"{imp.alloc.ptr:#x}"
                    )
                elif not _covered(imp.freed, synced):
                    # legal for the driver, but on driver 580 it leaks a descriptor unless
                    # a synchronising call saw the free done (a query is not enough)
                    g.violate(
                        f"{self._name} closed imported pool {keepalive.pool.id} before a "
                        f"synchronising call saw its free of {imp.alloc.ptr:#x} done"
                    )
            g.log.append((self._name, "close_pool", keepalive.pool.id))

    def import_pointer(self, pool_handle: int, data: bytes) -> int:
        self._hook("import_pointer", pool_handle, data)
        g = self._gpu
        with g.lock:
            keep = self._p.pool_imports.get(pool_handle)
            if keep is None or keep.closed:
                g.violate(f"{self._name} imported a pointer through a closed or unknown pool")
                raise _cuda_error("cuMemPoolImportPointer", "CUDA_ERROR_INVALID_HANDLE")
            magic, pool_id, ptr, _ = _RECORD.unpack_from(data)
            if magic != b"FAKEXPRT" or pool_id != keep.pool.id:
                raise _cuda_error("cuMemPoolImportPointer", "CUDA_ERROR_INVALID_VALUE")
            a = g.alloc_at(pool_id, ptr)
            if a is None or not a.live:
                raise _cuda_error("cuMemPoolImportPointer", "CUDA_ERROR_INVALID_VALUE")
            host = g.knows(self._p, None)
            for old in a.imports:
                if old.proc is self._p and old.live_for(host):
                    g.violate(
                        f"{self._name} imported {ptr:#x} (gen {a.gen}) again while its "
                        "earlier import is live (the previous free was not waited for)"
                    )
            local = (0x7F << 40) | (next(g._locals) << 20)
            imp = _Import(self._p, a, local)
            a.imports.append(imp)
            self._p.imports[local] = imp
            g.log.append((self._name, "import", ptr, a.gen, local))
            return local

    def free_async(self, ptr: int, stream: int) -> None:
        self._hook("free_async", ptr, stream)
        g = self._gpu
        with g.lock:
            if not self._p.alive:
                return
            imp = self._p.imports.get(ptr)
            if imp is None or imp.freed is not None:
                g.violate(f"{self._name} freed mapping {ptr:#x} it does not hold")
                raise _cuda_error("cuMemFreeAsync", "CUDA_ERROR_INVALID_VALUE")
            imp.freed = g.op(self._p, stream)
            g._maybe_release_orphan(imp.alloc)
            g.log.append((self._name, "unmap", imp.alloc.ptr, imp.gen, stream))

    # -- streams and events ---------------------------------------------------------------
    def record_ipc_event(self, dev: int, stream: int) -> tuple[Any, bytes]:
        g = self._gpu
        with g.lock:
            h = self._p.ipc_events.get((dev, stream))
            if h is None:
                ev = _Event(self._p, True)
                g.events[ev.id] = ev
                h = self._p.ipc_events[(dev, stream)] = FakeEventHandle(ev, self._p)
            h.event.snap = g.knows(self._p, stream)
            g.log.append((self._name, "record_ipc", h.event.id, stream))
            return h, h.event.handle

    def sync_own_events(self) -> None:
        g = self._gpu
        with g.lock:
            for h in self._p.ipc_events.values():
                g.host_synced(self._p, h.event.snap)

    def open_event(self, handle: bytes) -> Any:
        self._hook("open_event", handle)
        g = self._gpu
        with g.lock:
            magic, eid = _EVENT.unpack_from(handle)
            ev = g.events.get(eid) if magic == b"FAKEEVNT" else None
            if ev is None or not ev.ipc:
                raise _cuda_error("cuIpcOpenEventHandle", "CUDA_ERROR_INVALID_VALUE")
            g.log.append((self._name, "open_event", eid))
            return FakeEventHandle(ev, self._p)

    def close_event(self, ev: Any) -> None:
        g = self._gpu
        with g.lock:
            if self._use(ev, "close") is not None:
                ev.closed = True
                g.log.append(
                    (self._name, "close_event", ev.event.id, ev.event.owner is not self._p)
                )

    def wait_event(self, stream: int, ev: Any) -> None:
        self._hook("wait_event", stream, ev)
        g = self._gpu
        if stream in self._capturing:
            g.violate(f"{self._name}: a wait on stream {stream:#x} while it is captured")
        with g.lock:
            e = self._use(ev, "wait")
            if e is not None and self._p.alive:
                _merge(g._lane(self._p, stream), e.snap)
                g.log.append((self._name, "wait_event", stream, e.id, e.owner.name))

    def sync_event(self, ev: Any) -> None:
        self._hook("sync_event", ev)
        g = self._gpu
        with g.lock:
            e = self._use(ev, "sync")
            if e is not None:
                g.host_synced(self._p, e.snap)
                g.log.append((self._name, "sync_event", e.id, e.owner.name))

    def plain_event(self, stream: int, ev: Any = None) -> Any:
        g = self._gpu
        with g.lock:
            if ev is None:
                e = _Event(self._p, False)
                ev = FakeEventHandle(e, self._p)
            elif self._use(ev, "record") is None:
                return ev
            ev.event.snap = g.knows(self._p, stream)
            return ev

    @contextlib.contextmanager
    def relaxed(self) -> Iterator[None]:
        prev = getattr(self._tls, "relaxed", False)
        self._tls.relaxed = True
        try:
            yield
        finally:
            self._tls.relaxed = prev

    def event_done(self, ev: Any) -> bool:
        """Always done (the fake runs work at once); seeing it done orders what the host
        does next after that work, as a real query that returned True does.  A query
        while a stream of this process captures (global mode) from a thread not in
        relaxed mode would fail and invalidate that capture on a real GPU."""
        self._hook("event_done", ev)
        if self.unfinished > 0:  # a test's kernel still runs: the next queries say so
            self.unfinished -= 1
            return False
        g = self._gpu
        if self._capturing and not getattr(self._tls, "relaxed", False):
            g.violate(f"{self._name}: event query during a graph capture (not relaxed)")
        with g.lock:
            e = self._use(ev, "query")
            if e is not None:
                g.host_waited(self._p, e.snap)
        return True

    def sync_stream(self, stream: int) -> None:
        g = self._gpu
        with g.lock:
            g.host_synced(self._p, g.knows(self._p, stream))

    def is_capturing(self, stream: int) -> bool:
        return stream in self._capturing


# -- what the exporter reads from the hot path's Block and pool ------------------------------
class FakeCore:
    """A pool as the exporter sees it (``block.core``); its allocation handle is a pipe.

    ``small``: blocks up to this size come from a second CUDA pool with a uuid and a
    pipe of its own (a DevicePool's small-block pool)."""

    def __init__(
        self,
        proc: SimProc,
        device_id: int = 0,
        kind: int = _wire.POOL_DEVICE,
        recycle: bool = False,
        small: int = 0,
    ) -> None:
        self.proc = proc
        self.device_id = device_id if kind != _wire.POOL_PINNED else -1
        self.kind = kind
        self.ipc = True
        self._pool_uuid = str(uuid.uuid4())
        self._rfd, self._wfd = os.pipe()
        self.memory_resource = type("MR", (), {"allocation_handle": self._rfd})()
        self.release_hook: Any = None
        self._held_for_sharing = 0
        self.closed = False
        self.n_allocs = 0
        self.n_frees = 0
        self.released = 0  # times the CUDA pool was really released (_drained, nothing held)
        self.drain_calls = 0
        # The hot path's reuse cache, as far as sharing uses it: exported blocks kept
        # with their records ((stream, size) -> [(ptr, stream, record)]).
        self.cache_limit = 1 << 30
        self.cached_bytes = 0
        self._cache: dict[tuple[int, int], list[tuple[int, Any, Any]]] = {}
        self.n_free_errors = 0
        self.finalized = False  # Pool.__del__ ran: nothing of this pool touches a stream
        self.leftovers: list[int] = []  # blocks the retirer frees after a sync
        if not recycle:  # a pool without a reuse cache for exported blocks (as pinned ones)
            self._cache_shared = None  # type: ignore[assignment]
        gpu_dev = proc.driver._visible[max(device_id, 0)]  # the physical device
        self._pool = proc.gpu.new_pool(proc.gpu.proc(proc.name), gpu_dev, kind, self._rfd)
        self.small_max = small
        self._small: Any = None  # (uuid, resource, fake GPU pool, write end of its pipe)
        self._small_ptrs: set[int] = set()
        self.misreport_small = False  # name the main pool for small blocks too (a test's lie)
        if small:
            rfd, wfd = os.pipe()
            mr = type("MR", (), {"allocation_handle": rfd})()
            gpool = proc.gpu.new_pool(proc.gpu.proc(proc.name), gpu_dev, kind, rfd)
            self._small = (str(uuid.uuid4()), mr, gpool, wfd)

    def _gpu_pool(self, ptr: int) -> Any:
        return self._small[2] if ptr in self._small_ptrs else self._pool

    def _ipc_pool_of(self, ptr: int) -> tuple[str, Any]:
        """(uuid, resource) of the CUDA pool holding ``ptr`` (as the driver says; the
        main pool's for every block when ``misreport_small`` is set)."""
        if ptr in self._small_ptrs and not self.misreport_small:
            return self._small[0], self._small[1]
        return self._pool_uuid, self.memory_resource

    def alloc(self, size: int, payload: Any = None, stream: FakeStream | None = None) -> FakeBlock:
        """A new block (what ``PoolCore.malloc`` returns), its payload written on its stream."""
        if self.closed:
            raise RuntimeError("pool is closed")
        stream = stream or FakeStream(0x51, max(self.device_id, 0))
        hit = self._cache.get((stream.ptr, size))
        if hit:  # a recycled block: same address, same generation, its record kept
            ptr, _, share = hit.pop()
            self.cached_bytes -= size
            self.n_allocs += 1
            b = FakeBlock(self, ptr, size, stream)
            b.share = share
            if payload is not None:
                self.proc.gpu.write(self._gpu_pool(ptr), ptr, stream.ptr, payload)
            return b
        small = self._small is not None and size <= self.small_max
        a = self.proc.gpu.alloc(self._small[2] if small else self._pool, size, stream.ptr)
        if small:
            self._small_ptrs.add(a.ptr)
        self.n_allocs += 1
        b = FakeBlock(self, a.ptr, size, stream)
        if payload is not None:
            self.proc.gpu.write(self._gpu_pool(a.ptr), a.ptr, stream.ptr, payload)
        return b

    def _free_now(self, ptr: int, stream_ptr: int, stream: Any = None) -> None:
        self.proc.gpu.free(self._gpu_pool(ptr), ptr, stream_ptr)

    def _cache_shared(self, ptr: int, size: int, stream_ptr: int, stream: Any, share: Any) -> bool:
        if self.closed or self.cached_bytes + size > self.cache_limit:
            return False
        self._cache.setdefault((stream_ptr, size), []).append((ptr, stream, share))
        self.cached_bytes += size
        return True

    def flush_cache(self) -> int:
        """What the hot path's flush does: a recycled block's final free is its
        exporter's."""
        freed, cache = self.cached_bytes, self._cache
        self._cache, self.cached_bytes = {}, 0
        for (sptr, size), entries in cache.items():
            for ptr, stream, share in entries:
                if share.exporter.retire(ptr, size, stream, share, self):
                    continue
                self._free_now(ptr, sptr, stream)
        return freed

    def finalize(self) -> None:
        """What ``Pool.__del__`` does (a pool dropped without close(), maybe in a garbage
        cycle with its streams): from now on nothing of it touches a stream.  The hot
        path's ``_take_cache`` gives each exported block to its exporter without its
        stream, and the rest to the retirer (:meth:`retirer_frees`); then close()."""
        self.finalized = True
        cache, self._cache = self._cache, {}
        self.cached_bytes = 0
        for (_sptr, size), entries in cache.items():
            for ptr, _stream, share in entries:
                if not share.exporter.retire(ptr, size, None, share, self):
                    self.leftovers.append(ptr)
        self.close()

    def _orphan(self, ptr: int, size: int, flags: int) -> bool:
        """``Pool._orphan``: a finalized pool's block goes to the retirer."""
        self.leftovers.append(ptr)
        return True

    def retirer_frees(self) -> None:
        """The retirer's sync of the device, then its frees of the leftovers on the
        legacy stream (what :meth:`finalize` and :meth:`_orphan` gave it)."""
        gpu, p = self.proc.gpu, self._pool.owner
        with gpu.lock:
            everything: Clock = {}
            for lane in list(p.lanes):
                _merge(everything, gpu.knows(p, lane))
            gpu.host_synced(p, everything)
        for ptr in self.leftovers:
            self._free_now(ptr, 0)
        self.leftovers = []

    def cached_blocks(self) -> int:
        return sum(len(v) for v in self._cache.values())

    def _drained(self) -> None:
        self.drain_calls += 1
        if self._held_for_sharing:
            return
        self.released += 1

    def close(self) -> None:
        """``Pool.close()``: released at once unless blocks are alive or in limbo."""
        if self.closed:
            return
        self.closed = True
        self.flush_cache()
        if self.n_allocs == self.n_frees and not self._held_for_sharing:
            self._drained()

    def dispose(self) -> None:
        fds = [self._rfd, self._wfd]
        if self._small is not None:
            fds += [self._small[1].allocation_handle, self._small[3]]
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._rfd = self._wfd = -1


class FakeBlock:
    """A live pool allocation (the hot path's ``Block``); dropping the last reference
    frees it the way ``Block.__del__`` does."""

    def __init__(self, core: FakeCore, ptr: int, size: int, stream: FakeStream) -> None:
        self.core, self.ptr, self.size = core, ptr, size
        self.stream, self.stream_ptr = stream, stream.ptr
        self.share: Any = None
        self._recorded: list[FakeStream] = []  # record_stream()

    @property
    def recorded_streams(self) -> tuple:
        return tuple(self._recorded)

    def record_stream(self, stream: FakeStream) -> None:
        if all(s.ptr != stream.ptr for s in self._recorded):
            self._recorded.append(stream)

    def wait_recorded(self, stream: Any) -> None:
        """``stream`` waits (on the device) for the work now on the recorded streams."""
        gpu = self.core.proc.gpu
        with gpu.lock:
            p = self.core._pool.owner
            for s in self._recorded:
                _merge(gpu._lane(p, stream.ptr), gpu.knows(p, s.ptr))

    def __del__(self) -> None:
        try:
            hot_path_free(self)
        except BaseException as exc:  # a test must see it, not a printed warning
            self.core.proc.gpu.violate(f"the hot path's free raised {exc!r}")

    def write(self, payload: Any, stream: FakeStream | None = None) -> None:
        """Write ``payload`` on ``stream`` (default: the allocation stream)."""
        sptr = self.stream_ptr if stream is None else stream.ptr
        self.core.proc.gpu.write(self.core._gpu_pool(self.ptr), self.ptr, sptr, payload)

    def read(self) -> tuple[int, Any]:
        return self.core.proc.gpu.read_own(self.core._gpu_pool(self.ptr), self.ptr)


def hot_path_free(block: FakeBlock) -> None:
    """What ``Block.__del__`` does: the sharing hook first, then the pool's free."""
    core = block.core
    if block.ptr == 0:
        return
    core.n_frees += 1
    rec = block.share
    if core.finalized:  # its stream may be gone: the exporter first, else the retirer
        if rec is None or not rec.exporter.retire(block.ptr, block.size, None, rec, core):
            core._orphan(block.ptr, block.size, 0)
        if core.closed and core.n_frees == core.n_allocs:
            core._drained()
        return
    if block._recorded:
        block.wait_recorded(block.stream)
    if rec is not None and rec.exporter.release(block.ptr, block.size, block.stream, rec, core):
        return  # in limbo (or recycled): the exporter frees it later
    if core.release_hook is not None and core.release_hook(block.ptr, block.size, block.stream):
        return
    core._free_now(block.ptr, block.stream_ptr)
    if core.closed and core.n_frees == core.n_allocs:
        core._drained()


# -- simulated processes ----------------------------------------------------------------------
class SimProc:
    """One simulated process: a sharing context with its own settings and fake driver."""

    def __init__(
        self,
        world: World,
        name: str,
        visible: list[int] | None = None,
        listener_options: dict[str, Any] | None = None,
        **settings: Any,
    ) -> None:
        self.world, self.gpu, self.name = world, world.gpu, name
        self.settings = SharingSettings()
        self.settings.inflight_timeout = 30.0
        self.settings.exit_timeout = 5.0
        self.settings.claim_timeout = 10.0
        for k, v in settings.items():
            setattr(self.settings, k, v)
        self.driver = FakeDriver(self.gpu, name, visible)
        self.ctx = SharingContext(
            self.settings, driver=self.driver, listener_options=listener_options
        )
        self.cores: list[FakeCore] = []
        self.gone = False

    def __repr__(self) -> str:
        return f"SimProc({self.name})"

    @property
    def exporter(self) -> Any:
        return self.ctx.exporter

    @property
    def importer(self) -> Any:
        return self.ctx.importer

    def stats(self) -> dict[str, int]:
        return self.ctx.stats()

    def pool(
        self,
        device: int = 0,
        kind: int = _wire.POOL_DEVICE,
        recycle: bool = False,
        small: int = 0,
    ) -> FakeCore:
        """A pool; ``recycle=True``: exported blocks go back to its reuse cache with
        their records (as a DevicePool's with its default reuse cache); ``small``: blocks
        up to that size come from a second CUDA pool (see FakeCore)."""
        core = FakeCore(self, device, kind, recycle, small)
        self.cores.append(core)
        return core

    # -- messages -------------------------------------------------------------------------
    def send(self, owner: Any, offset: int = 0, nbytes: int | None = None) -> bytes:
        """Pickle a message for ``owner`` (a block, a received owner, a round trip) the
        way multiprocessing would: the reducer's descriptor, through plain pickle."""
        size = owner.size
        n = size - offset if nbytes is None else nbytes
        d = describe(self.ctx, owner, "cupy", offset, (n,), (1,), "|u1")
        return pickle.dumps(d)

    def recv(self, msg: bytes) -> Any:
        """Unpickle a message here: the owner the received array would keep."""
        d = _wire.check_descriptor(pickle.loads(msg))
        owner, _dev = receive(self.ctx, d)
        return owner

    def read(self, owner: Any, stream: int | None = None) -> tuple[int, Any]:
        """``(generation, payload)`` a kernel of this process sees through ``owner``."""
        if isinstance(owner, Imported):
            return self.gpu.read(self.gpu.proc(self.name), owner.ptr, stream)
        if isinstance(owner, LocalHold):
            pool = owner.rec.core._gpu_pool(owner.ptr)
            return self.gpu.read_own(pool, owner.ptr, stream)
        if isinstance(owner, FakeBlock):
            return owner.read()
        raise TypeError(owner)

    # -- ends -----------------------------------------------------------------------------
    def exit(self) -> None:
        """A normal exit: the sharing finalizer (bounded wait), then the process is gone."""
        self.ctx.at_exit()
        self.close()

    def kill(self, context_gone: bool = True) -> None:
        """SIGKILL: no finalizer.  With ``context_gone=False`` only the sockets close
        (the kernel still runs); call ``gpu.context_gone(name)`` later."""
        self.close(context_gone=context_gone)

    def close(self, context_gone: bool = True) -> None:
        """The process is gone: its GPU context first, then its sockets close."""
        if self.gone:
            return
        self.gone = True
        if context_gone:
            self.gpu.context_gone(self.name)
        ctx = self.ctx
        exp = ctx._exporter
        if exp is not None:
            exp.closed = True
            exp._wake.set()
            if exp._listener is not None:
                exp._listener.close()
            for peer in list(exp.peers.values()):
                peer.conn.shutdown()  # its reader wakes (and closes it); the peer sees EOF
        imp = ctx._importer
        if imp is not None:
            for c in list(imp.clients.values()):
                c.conn.shutdown()


class World:
    """The simulated processes of one test, torn down (and checked) at its end."""

    def __init__(self) -> None:
        self.gpu = FakeGPU(n_devices=2)
        self.procs: list[SimProc] = []

    def proc(
        self,
        name: str | None = None,
        visible: list[int] | None = None,
        listener_options: dict[str, Any] | None = None,
        **settings: Any,
    ) -> SimProc:
        """A simulated process (``listener_options``: its exporter's listener's)."""
        p = SimProc(self, name or f"p{len(self.procs)}", visible, listener_options, **settings)
        self.procs.append(p)
        return p

    def teardown(self) -> None:
        for p in self.procs:
            p.close()
        for p in self.procs:
            for core in p.cores:
                core.dispose()


def sharing_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("cupy_poolmem")]


def wait_for(cond: Callable[[], Any], timeout: float = 5.0, step: float = 0.002) -> bool:
    """Poll ``cond`` until true or ``timeout`` seconds passed; its last value as bool."""
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return True
        if time.monotonic() > deadline:
            return bool(cond())
        time.sleep(step)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@contextlib.contextmanager
def gated_wait_gone(monkeypatch: Any) -> Iterator[threading.Event]:
    """``PeerProcess.wait_gone`` returns only once the yielded event is set (all the
    simulated processes share one pid, so it would return at once)."""
    gate = threading.Event()
    waiting = threading.Event()

    def wait_gone(self: Any, timeout: float | None = None) -> bool:
        waiting.set()
        return gate.wait(10.0 if timeout is None else timeout)

    monkeypatch.setattr(_transport.PeerProcess, "wait_gone", wait_gone)
    gate.waiting = waiting  # type: ignore[attr-defined]
    try:
        yield gate
    finally:
        gate.set()
