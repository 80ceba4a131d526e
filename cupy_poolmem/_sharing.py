"""Zero-copy sharing of CuPy arrays between processes: reducers and the lifetime protocol.

Invariants (every change to this module must keep them):

1. Ownership.  The process that allocated a block (the *exporter*) is the only one
   that frees it.  A block it has exported is freed only when (a) its own last local
   reference is gone and (b) it holds no *ticket* for the block.  Until then the block
   sits in *limbo* (``held_for_sharing_bytes``), never in the reuse cache.
2. Tickets.  Every pickled reference is one ticket, registered with the exporter
   *before* the message can reach anyone: at reduce time in the exporter, or by an
   ``inflight`` message on the forwarder's (ordered) connection.  A receiver claims
   its ticket (``acquire``) and gives it back (``release``) over its connection to the
   exporter; an ``acquire`` that overtakes its ``inflight`` is remembered, so the two
   may arrive in either order.  A connection that closes (the peer exited or was
   SIGKILLed) gives back every ticket it claimed.
3. Driver rule.  An importer frees its mapping (stream-ordered) and records an IPC
   event *before* it sends ``release``; the exporter's free waits on that event, so
   importers always free before the exporter.
4. Ordering.  Each message carries an IPC event recorded on the sender's current
   stream after the writes it enqueued; the receiver's current stream waits on it
   before the array is returned.  Nobody synchronises a whole device.
5. One import per allocation per process.  Receiving the same block again reuses the
   live mapping (a second import of one pointer breaks the first); the pool itself
   is imported once per process, its file descriptor fetched over the connection
   the first time only, never re-sent with each message.
6. Same GPU.  Devices are matched by UUID, so CUDA_VISIBLE_DEVICES orders may differ.
7. Trust.  Connections are authenticated with the multiprocessing authkey of the
   process family; unpickling a message from an untrusted peer is unsafe (as for any
   pickle).  Pool handles only travel over these connections.
"""

from __future__ import annotations

import itertools
import os
import queue
import random
import threading
import time
import warnings
import weakref
from multiprocessing import connection as _mpc
from multiprocessing import current_process
from multiprocessing import util as _mp_util
from multiprocessing.reduction import ForkingPickler, recv_handle, send_handle
from typing import Any

import cupy
import numpy as np
from cuda.bindings import driver as _drv

from ._errors import InvalidOptionError, NoGPUError, PoolmemError, SharingError, check_driver
from ._pools import _OOM_CALLBACKS, DevicePool, Pool, _hp, all_pools, device_count

__all__ = ["settings", "collect", "sharing_stats", "register_reducers"]

_FALLBACKS = ("device-copy", "host", "error")
_lock = threading.RLock()
_ids = itertools.count(1)
_tickets = itertools.count(random.getrandbits(40) << 20)
_forked = False


class SharingSettings:
    """Options for sharing arrays between processes (``cupy_poolmem.sharing``).

    Attributes
    ----------
    fallback : str
        What to do with an array whose memory cannot be exported (CuPy's default
        pool, another allocator, a pool without ``ipc=True``): ``"device-copy"``
        (default: copy on the GPU into an IPC pool, then share), ``"host"`` (CuPy's
        own pickling through host memory) or ``"error"``.
    warn_bytes : int
        Warn once when more than this many bytes wait in limbo for other processes.
    exit_timeout : float
        Seconds an exporting process waits at exit for receivers to let go (default
        ``0``: no wait; arrays a receiver already holds stay valid after the exporter
        exits, as the driver keeps imported memory alive, while messages not yet
        received raise :class:`SharingError`).
    inflight_timeout : float or None
        Give back tickets nobody claimed after this many seconds (a message lost in a
        queue nobody reads); ``None`` keeps them until the process exits.

    Examples
    --------
    >>> cupy_poolmem.sharing.fallback = "error"  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._fallback = "device-copy"
        self.warn_bytes = 8 << 30
        self.exit_timeout = float(os.environ.get("CUPY_POOLMEM_EXIT_TIMEOUT", "0"))
        self.inflight_timeout: float | None = None

    @property
    def fallback(self) -> str:
        return self._fallback

    @fallback.setter
    def fallback(self, value: str) -> None:
        if value not in _FALLBACKS:
            raise InvalidOptionError(f"sharing.fallback={value!r}; choose one of {_FALLBACKS}")
        self._fallback = value

    def collect(self) -> int:
        """See :func:`collect`."""
        return collect()

    def stats(self) -> dict:
        """See :func:`sharing_stats`."""
        return sharing_stats()


settings = SharingSettings()


def _check_not_forked() -> None:
    if _forked:
        raise PoolmemError(
            "this process was forked after CUDA was initialised in its parent; CUDA cannot "
            "be used here. Start workers with multiprocessing.get_context('spawn') or "
            "'forkserver'.")


# ---------------------------------------------------------------- exporter side
class _Export:
    """One exported block, as its exporter sees it."""

    __slots__ = ("export_id", "ptr", "size", "data", "core", "stream", "refs", "early",
                 "in_limbo", "block_ref", "born", "dev_uuid")

    def __init__(self, block: Any) -> None:
        self.export_id = next(_ids)
        self.ptr, self.size, self.core, self.stream = block.ptr, block.size, block.core, block.stream
        self.data = bytes(check_driver(_drv.cuMemPoolExportPointer(block.ptr),
                                       "cuMemPoolExportPointer").reserved)
        self.refs: dict[int, Any] = {}   # ticket -> "inflight" | connection id | "local"
        self.early: set[int] = set()     # tickets claimed before their inflight arrived
        self.in_limbo = False
        self.block_ref = weakref.ref(block)
        self.born: dict[int, float] = {}
        self.dev_uuid = _device_uuid(block.core.device_id) if block.core.device_id >= 0 else ""


_exports: dict[int, _Export] = {}
_limbo_bytes = [0]
_warned = [False]


def _shared_release(ptr: int, size: int, stream: Any, share: _Export) -> bool:
    """Hot-path hook: the exporter's last local reference to a shared block is gone."""
    with _lock:
        if not share.refs:
            _exports.pop(share.export_id, None)
            return False  # nobody else holds it: the normal free path
        share.in_limbo = True
        share.core._held_for_sharing += size
        _limbo_bytes[0] += size
        if _limbo_bytes[0] > settings.warn_bytes and not _warned[0]:
            _warned[0] = True
            warnings.warn(f"cupy_poolmem: {_limbo_bytes[0]:,} bytes freed here are still held "
                          "for other processes (limbo); receivers keep arrays alive too long?",
                          ResourceWarning, stacklevel=2)
        return True


_hp.set_shared_release(_shared_release)


def _drop_ticket(exp: _Export, ticket: int, event: Any = None) -> None:
    """Give back one ticket; free the block if it was the last and the owner is gone."""
    with _lock:
        exp.refs.pop(ticket, None)
        exp.born.pop(ticket, None)
        if exp.refs or not exp.in_limbo:
            return
        _exports.pop(exp.export_id, None)
        exp.in_limbo = False
        exp.core._held_for_sharing -= exp.size
        _limbo_bytes[0] -= exp.size
    _free_exported(exp, event)


def _free_exported(exp: _Export, event: bytes | None) -> None:
    dev = max(exp.core.device_id, exp.stream.device_id, 0)
    with _on_device(dev):
        if event is not None:
            try:
                _wait_event_bound(event, exp.stream.ptr)
            except Exception:  # the releasing process died: its work died with it
                pass
        hook = exp.core.release_hook  # pinned pools hold blocks until their stream is done
        if hook is None or not hook(exp.ptr, exp.size, exp.stream):
            exp.core._free_now(exp.ptr, exp.stream.ptr)


def _register(exp: _Export, ticket: int, owner: Any) -> None:
    with _lock:
        if owner == "inflight":
            if ticket in exp.early:
                exp.early.discard(ticket)
                return
            exp.born[ticket] = time.monotonic()
        elif ticket not in exp.refs:
            exp.early.add(ticket)
        exp.refs[ticket] = owner


class _Server:
    """The exporter's listener: receivers claim and give back tickets, fetch pool fds."""

    def __init__(self) -> None:
        self.listener = _mpc.Listener(family="AF_UNIX", authkey=bytes(current_process().authkey))
        self.address = self.listener.address
        self.pools: dict[str, Pool] = {}
        t = threading.Thread(target=self._accept, name="cupy_poolmem-sharing", daemon=True)
        t.start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except Exception:
                if _server_closed[0]:
                    return
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="cupy_poolmem-sharing-conn").start()

    def _serve(self, conn: Any) -> None:
        cid = id(conn)
        try:
            while True:
                msg = conn.recv()
                if msg[0] == "batch":  # the importer's outbox sends what piled up at once
                    for m in msg[1]:
                        self._handle(conn, cid, m)
                else:
                    self._handle(conn, cid, msg)
        except (EOFError, OSError):
            pass
        finally:
            # The peer is gone (exit, crash, SIGKILL): give back every ticket it claimed.
            with _lock:
                dead = [(e, t) for e in list(_exports.values())
                        for t, o in list(e.refs.items()) if o == cid]
            for exp, t in dead:
                _drop_ticket(exp, t)
            conn.close()

    def _handle(self, conn: Any, cid: int, msg: tuple) -> None:
        op = msg[0]
        if op == "acquire":
            exp = _exports.get(msg[1])
            if exp is not None:
                _register(exp, msg[2], cid)
        elif op == "inflight":
            exp = _exports.get(msg[1])
            if exp is not None:
                _register(exp, msg[2], "inflight")
        elif op == "release":
            exp = _exports.get(msg[1])
            if exp is not None:
                for t in msg[2]:
                    _drop_ticket(exp, t, msg[3])
        elif op == "pool":
            pool = self.pools.get(msg[1])
            if pool is None:
                conn.send(("error", f"no exported pool {msg[1]}"))
                return
            conn.send(("ok",))
            send_handle(conn, int(pool.memory_resource.allocation_handle), msg[2])


_server: list[_Server | None] = [None]
_server_closed = [False]


def _get_server() -> _Server:
    if _server[0] is None:
        with _lock:
            if _server[0] is None:
                _server[0] = _Server()
    return _server[0]


# ---------------------------------------------------------------- events and devices
_uuid_cache: dict[int, str] = {}
_events: dict[tuple[int, int], Any] = {}   # (device, stream) -> (CUevent, handle bytes)
_opened_events: dict[bytes, Any] = {}      # peer handle -> opened CUevent


def _device_uuid(dev: int) -> str:
    u = _uuid_cache.get(dev)
    if u is None:
        import uuid

        handle = check_driver(_drv.cuDeviceGet(dev), "cuDeviceGet")
        raw = check_driver(_drv.cuDeviceGetUuid(handle), "cuDeviceGetUuid")
        u = _uuid_cache[dev] = str(uuid.UUID(bytes=bytes(raw.bytes)))
    return u


_ordinal_by_uuid: dict[str, int] = {}


def _local_device(uuid: str) -> int:
    d = _ordinal_by_uuid.get(uuid)
    if d is not None:
        return d
    n = device_count()
    if n == 0:
        raise NoGPUError("received a CuPy array from another process, but this process has "
                         "no GPU (check CUDA_VISIBLE_DEVICES in the receiver)")
    for d in range(n):
        _ordinal_by_uuid[_device_uuid(d)] = d
    if uuid in _ordinal_by_uuid:
        return _ordinal_by_uuid[uuid]
    raise SharingError(f"received an array on GPU {uuid}, which this process cannot see; "
                       "CUDA_VISIBLE_DEVICES of the receiver must include that GPU")


_runtime = cupy.cuda.runtime


class _on_device:
    """Make ``dev`` current, with its primary context bound to this thread, for a block.

    Threads the user never touched CUDA in (multiprocessing's feeder, our server and
    outbox threads) have no current context until a runtime call makes one.  When
    ``dev`` is already current (the common case) this costs one runtime and one driver
    query; each sharing operation enters it once.
    """

    __slots__ = ("dev", "prev")

    def __init__(self, dev: int) -> None:
        self.dev = dev

    def __enter__(self) -> None:
        self.prev = _runtime.getDevice()
        if self.prev != self.dev:
            _runtime.setDevice(self.dev)  # binds the device's primary context
            return
        err, ctx = _drv.cuCtxGetCurrent()
        if int(err) or not int(ctx):
            _runtime.setDevice(self.dev)
            _runtime.free(0)  # makes the primary context current

    def __exit__(self, *exc: Any) -> None:
        if self.prev != self.dev:
            _runtime.setDevice(self.prev)


_EVENT_FLAGS = (_drv.CUevent_flags.CU_EVENT_INTERPROCESS
                | _drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)


def _record_event(dev: int) -> bytes:
    """Record this process's IPC event on ``dev``'s current stream; return its handle.

    One event per (device, stream), re-recorded for every message: a receiver that
    waits after a later re-record waits for more work, never for less.
    """
    with _on_device(dev):
        return _record_event_bound(dev, cupy.cuda.get_current_stream().ptr)


def _record_event_bound(dev: int, sptr: int) -> bytes:
    """:func:`_record_event` on stream ``sptr``, with ``dev`` already current."""
    key = (dev, sptr)
    ent = _events.get(key)
    if ent is None:
        ev = check_driver(_drv.cuEventCreate(_EVENT_FLAGS), "cuEventCreate")
        h = check_driver(_drv.cuIpcGetEventHandle(ev), "cuIpcGetEventHandle")
        ent = _events[key] = (ev, bytes(h.reserved))
    check_driver(_drv.cuEventRecord(ent[0], sptr), "cuEventRecord")
    return ent[1]


def _wait_event_bound(handle: bytes, stream_ptr: int) -> None:
    """Make stream ``stream_ptr`` wait for a peer's IPC event (its device is current)."""
    ev = _opened_events.get(handle)
    if ev is None:
        h = _drv.CUipcEventHandle()
        h.reserved = handle
        ev = _opened_events[handle] = check_driver(_drv.cuIpcOpenEventHandle(h),
                                                   "cuIpcOpenEventHandle")
    check_driver(_drv.cuStreamWaitEvent(stream_ptr, ev, 0), "cuStreamWaitEvent")


# ---------------------------------------------------------------- importer side
class _Client:
    """This process's connection to one exporter."""

    def __init__(self, address: str) -> None:
        self.conn = _mpc.Client(address, family="AF_UNIX",
                                authkey=bytes(current_process().authkey))
        self.lock = threading.RLock()

    def send(self, msg: tuple) -> None:
        with self.lock:
            self.conn.send(msg)

    def fetch_pool_fd(self, pool_uuid: str) -> int:
        with self.lock:
            self.conn.send(("pool", pool_uuid, os.getpid()))
            reply = self.conn.recv()
            if reply[0] != "ok":
                raise SharingError(f"the exporter could not share its pool: {reply[1]}")
            return recv_handle(self.conn)


_clients: dict[str, _Client] = {}
_outbox: queue.SimpleQueue = queue.SimpleQueue()
_outbox_thread: list[threading.Thread | None] = [None]


def _post(address: str, msg: tuple) -> None:
    """Queue a message for the exporter at ``address`` (safe from ``__del__``)."""
    _outbox.put((address, msg))
    if _outbox_thread[0] is None:
        with _lock:
            if _outbox_thread[0] is None:
                t = threading.Thread(target=_drain_outbox, name="cupy_poolmem-outbox",
                                     daemon=True)
                _outbox_thread[0] = t
                t.start()


def _drain_outbox() -> None:
    while True:
        address, msg = _outbox.get()
        batch = {address: [msg]}
        while True:  # send what piled up meanwhile in one message per exporter
            try:
                address, msg = _outbox.get_nowait()
            except queue.Empty:
                break
            batch.setdefault(address, []).append(msg)
        for address, msgs in batch.items():
            try:
                _client(address).send(msgs[0] if len(msgs) == 1 else ("batch", msgs))
            except Exception:
                pass  # the exporter exited: its memory is gone anyway


def _claim(address: str, export_id: int, ticket: int) -> None:
    """Tell the exporter this process holds ``ticket`` (invariant 2).

    Sent at once when the connection is free (no thread hand-off on the receive
    path), else through the outbox; either way before this ticket's ``release``.
    """
    c = _client(address)
    if c.lock.acquire(blocking=False):
        try:
            c.conn.send(("acquire", export_id, ticket))
            return
        except Exception:
            pass
        finally:
            c.lock.release()
    _post(address, ("acquire", export_id, ticket))


def _flush_outbox(timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not _outbox.empty() and time.monotonic() < deadline:
        time.sleep(0.001)


_imported_pools: dict[str, Any] = {}
_imports: dict[tuple[str, int], weakref.ref] = {}


def _client(address: str) -> _Client:
    c = _clients.get(address)
    if c is None:
        with _lock:
            c = _clients.get(address)
            if c is None:
                try:
                    c = _clients[address] = _Client(address)
                except (OSError, EOFError) as exc:
                    raise SharingError(
                        "cannot reach the process that owns this array (it has exited?); "
                        f"memory shared by an exited process is gone ({exc})") from None
    return c


_pool_import_lock = threading.Lock()
_pool_handles: dict[str, Any] = {}  # pool uuid -> CUmemoryPool of the imported pool


def _imported_pool(address: str, pool_uuid: str, kind: int, dev: int) -> Any:
    """The exporter's pool as a ``CUmemoryPool``, imported once per process.

    ``_imported_pools`` (shared with the Numba plugin) keeps the cuda.core resource.
    """
    h = _pool_handles.get(pool_uuid)
    if h is None:
        with _pool_import_lock:
            mr = _imported_pools.get(pool_uuid)
            if mr is None:
                import cuda.core as cc

                fd = _client(address).fetch_pool_fd(pool_uuid)
                try:
                    if kind == _hp.KIND_PINNED:
                        mr = cc.PinnedMemoryResource.from_allocation_handle(fd)
                    else:
                        mr = cc.DeviceMemoryResource.from_allocation_handle(dev, fd)
                finally:
                    os.close(fd)
                _imported_pools[pool_uuid] = mr
            h = _pool_handles[pool_uuid] = _drv.CUmemoryPool(int(mr.handle))
    return h


class _Imported:
    """Owner of one imported mapping in this process; gives its tickets back when collected."""

    __slots__ = ("ptr", "size", "key", "tickets", "address", "export_id", "dev", "kind",
                 "pool_uuid", "dev_uuid", "data", "__weakref__")

    def __del__(self) -> None:
        try:
            dev = max(self.dev, 0)
            with _on_device(dev):
                sptr = cupy.cuda.get_current_stream().ptr
                _drv.cuMemFreeAsync(self.ptr, sptr)  # importers free first (driver rule)
                ev = _record_event_bound(dev, sptr)
            # Never send from __del__ (it may run inside another send): the outbox
            # thread does, in order, after the sends already made by this process.
            _post(self.address, ("release", self.export_id, self.tickets, ev))
        except Exception:
            pass  # exporter gone: nothing to give back
        with _lock:
            r = _imports.get(self.key)
            if r is not None and r() is None:
                _imports.pop(self.key, None)


class _LocalHolder:
    """A round-tripped array in its exporter: keeps the block (or its limbo entry) alive."""

    __slots__ = ("exp", "ticket", "block", "ptr", "size", "__weakref__")

    def __del__(self) -> None:
        _drop_ticket(self.exp, self.ticket)


# ---------------------------------------------------------------- reducers
def _block_of(mem: Any) -> Any:
    """The Block or _Imported behind CuPy memory (or pinned memory), else None."""
    owner = getattr(mem, "_owner", None)
    if owner is None and isinstance(mem, (_hp.Block, _Imported, _LocalHolder)):
        owner = mem
    return owner


def _export_message(owner: Any, kind_tag: str, offset: int, shape: tuple, strides: tuple,
                    dtype: str) -> tuple:
    _check_not_forked()
    if isinstance(owner, _hp.Block):
        core = owner.core
        with _lock:
            exp = owner.share
            if exp is None:
                exp = owner.share = _Export(owner)
                _exports[exp.export_id] = exp
            ticket = next(_tickets)
            _register(exp, ticket, "inflight")
        server = _get_server()
        pool_uuid = core._pool_uuid
        server.pools[pool_uuid] = core
        dev = core.device_id
        head = (server.address, pool_uuid, exp.dev_uuid, core.kind, exp.export_id, exp.data,
                exp.size, ticket)
    elif isinstance(owner, _LocalHolder):
        return _export_message(owner.block, kind_tag, offset, shape, strides, dtype) \
            if owner.block is not None else _forward_local(owner, kind_tag, offset, shape,
                                                            strides, dtype)
    else:  # _Imported: forward to a third process; the exporter learns the ticket first
        ticket = next(_tickets)
        _client(owner.address).send(("inflight", owner.export_id, ticket))
        dev = owner.dev
        head = (owner.address, owner.pool_uuid, owner.dev_uuid, owner.kind, owner.export_id,
                owner.data, owner.size, ticket)
    ev = _record_event(dev if dev >= 0 else cupy.cuda.runtime.getDevice())
    return (1, kind_tag) + head + (ev, offset, shape, strides, dtype)


def _forward_local(holder: _LocalHolder, *rest: Any) -> tuple:
    exp = holder.exp
    with _lock:
        ticket = next(_tickets)
        _register(exp, ticket, "inflight")
    server = _get_server()
    dev = exp.core.device_id
    ev = _record_event(dev if dev >= 0 else cupy.cuda.runtime.getDevice())
    kind_tag, offset, shape, strides, dtype = rest
    return (1, kind_tag, server.address, exp.core._pool_uuid, exp.dev_uuid,
            exp.core.kind, exp.export_id, exp.data, exp.size, ticket, ev,
            offset, shape, strides, dtype)


def _rebuild(version: int, kind_tag: str, address: str, pool_uuid: str, dev_uuid: str,
             pool_kind: int, export_id: int, data: bytes, size: int, ticket: int,
             event_desc: Any, offset: int, shape: tuple, strides: tuple, dtype: str) -> Any:
    """Receiver side of a shared array (also the round trip back to its exporter)."""
    _check_not_forked()
    if version != 1:
        raise SharingError(f"message format {version} from a different cupy_poolmem version")
    dev = _local_device(dev_uuid) if dev_uuid else _runtime.getDevice()
    srv = _server[0]
    with _on_device(dev):
        if srv is not None and srv.address == address:
            owner = _local_owner(export_id, ticket)
        else:
            owner = _import(address, pool_uuid, pool_kind, dev, dev_uuid, export_id, data,
                            size, ticket)
        stream = cupy.cuda.get_current_stream()
        if event_desc is not None:
            _wait_event_bound(event_desc, stream.ptr)
        dt = np.dtype(dtype)
        if kind_tag == "numpy":
            if event_desc is not None:
                stream.synchronize()  # the host reads at once
            pmem = cupy.cuda.PinnedMemoryPointer(owner, 0)
            return np.ndarray(shape, dt, buffer=pmem, offset=offset, strides=strides)
        mem = cupy.cuda.UnownedMemory(owner.ptr, size, owner, dev)
        return cupy.ndarray(shape, dt, cupy.cuda.MemoryPointer(mem, offset), strides)


def _local_owner(export_id: int, ticket: int) -> _LocalHolder:
    exp = _exports.get(export_id)
    if exp is None:
        raise SharingError("an array came back to its exporter after its memory was freed")
    h = _LocalHolder()
    h.exp, h.ticket, h.block = exp, ticket, exp.block_ref()
    h.ptr, h.size = exp.ptr, exp.size
    _register(exp, ticket, "local")
    return h


def _import(address: str, pool_uuid: str, pool_kind: int, dev: int, dev_uuid: str,
            export_id: int, data: bytes, size: int, ticket: int) -> _Imported:
    """Map one exported block in this process (``dev`` current), or reuse the live mapping."""
    key = (address, export_id)
    handle = _imported_pool(address, pool_uuid, pool_kind, dev)
    with _lock:  # look-up and import together: two threads never import one block twice
        r = _imports.get(key)
        imp = r() if r is not None else None
        if imp is not None:  # de-duplicate: one mapping per allocation per process
            imp.tickets.append(ticket)
        else:
            share = _drv.CUmemPoolPtrExportData()
            share.reserved = data
            ptr = int(check_driver(_drv.cuMemPoolImportPointer(handle, share),
                                   "cuMemPoolImportPointer"))
            imp = _Imported()
            imp.ptr, imp.size, imp.key, imp.tickets = ptr, size, key, [ticket]
            imp.address, imp.export_id, imp.dev, imp.kind = address, export_id, dev, pool_kind
            imp.pool_uuid, imp.dev_uuid, imp.data = pool_uuid, dev_uuid, data
            _imports[key] = weakref.ref(imp)
    _claim(address, export_id, ticket)
    return imp


def _shareable(owner: Any) -> bool:
    if isinstance(owner, (_Imported, _LocalHolder)):
        return True
    return isinstance(owner, _hp.Block) and getattr(owner.core, "ipc", False) \
        and not owner.core.closed


def reduce_cupy(arr: cupy.ndarray) -> tuple:
    """Reduce a ``cupy.ndarray`` for multiprocessing: zero-copy when its pool allows it."""
    mem = arr.data.mem
    owner = _block_of(mem)
    if arr.size == 0 or owner is None or not _shareable(owner):
        fb = settings.fallback
        if fb == "host" or (arr.size == 0):
            return arr.__reduce__()
        if fb == "error":
            raise SharingError(
                "this array's memory cannot be shared zero-copy (it is not from an IPC-enabled "
                "cupy_poolmem pool); call cupy_poolmem.set_allocator() before creating it, or "
                "set cupy_poolmem.sharing.fallback to 'device-copy' or 'host'")
        with _on_device(arr.device.id):
            pool = _sharing_pool(arr.device.id)
            with cupy.cuda.using_allocator(pool.malloc):
                arr = cupy.array(arr, copy=True, order="K")
        mem = arr.data.mem
        owner = _block_of(mem)
    offset = arr.data.ptr - mem.ptr
    return _rebuild, _export_message(owner, "cupy", offset, arr.shape, arr.strides,
                                     arr.dtype.str)


def reduce_numpy(arr: np.ndarray) -> tuple:
    """Reduce a numpy array: zero-copy when it lives on an IPC-enabled PinnedPool."""
    base = arr
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    owner = getattr(base, "mem", None)
    owner = _block_of(owner) if owner is not None else None
    if owner is None or not _shareable(owner) or arr.size == 0:
        return arr.__reduce_ex__(4)
    offset = arr.__array_interface__["data"][0] - owner.ptr
    return _rebuild, _export_message(owner, "numpy", offset, arr.shape, arr.strides,
                                     arr.dtype.str)


_sharing_pools: dict[int, Pool] = {}


def _sharing_pool(dev: int) -> Pool:
    """An IPC pool for device copies: set_allocator's pool if IPC, else a private one."""
    from ._allocator import _current

    alloc = _current["device"]
    if alloc is not None:
        p = alloc.pools().get(dev)
        if p is not None and getattr(p, "ipc", False) and not p.closed:
            return p
    p = _sharing_pools.get(dev)
    if p is None or p.closed:
        p = _sharing_pools[dev] = DevicePool(device=dev, ipc=True)
    return p


def register_reducers() -> None:
    """Register the reducers with multiprocessing's pickler (done on import)."""
    ForkingPickler.register(cupy.ndarray, reduce_cupy)
    ForkingPickler.register(np.ndarray, reduce_numpy)


def collect() -> int:
    """Free limbo blocks nobody holds and expire unclaimed tickets; return bytes freed.

    Blocks are normally freed as soon as the last receiver lets go; this is the
    safety net (also run before an out-of-memory retry).

    Examples
    --------
    >>> cupy_poolmem.sharing.collect()  # doctest: +SKIP
    0
    """
    freed = 0
    now = time.monotonic()
    timeout = settings.inflight_timeout
    with _lock:
        exps = list(_exports.values())
    for exp in exps:
        if timeout is not None:
            for t, born in list(exp.born.items()):
                if exp.refs.get(t) == "inflight" and now - born > timeout:
                    was = exp.in_limbo
                    _drop_ticket(exp, t)
                    if was and not exp.in_limbo:
                        freed += exp.size
        if exp.in_limbo and not exp.refs:
            with _lock:
                exp.refs[-1] = "collect"
            _drop_ticket(exp, -1)
            freed += exp.size
    return freed


def sharing_stats() -> dict:
    """Counts of the sharing protocol in this process (exports, limbo, imports)."""
    with _lock:
        return {
            "exported_blocks": len(_exports),
            "limbo_blocks": sum(1 for e in _exports.values() if e.in_limbo),
            "limbo_bytes": _limbo_bytes[0],
            "tickets_out": sum(len(e.refs) for e in _exports.values()),
            "imported_blocks": sum(1 for r in _imports.values() if r() is not None),
            "imported_pools": len(_imported_pools),
        }


def _at_exit() -> None:
    """Optionally wait (``settings.exit_timeout``) for receivers, then stop serving."""
    deadline = time.monotonic() + settings.exit_timeout
    while time.monotonic() < deadline:
        with _lock:
            held = sum(len(e.refs) for e in _exports.values()
                       if any(o != "inflight" for o in e.refs.values()))
        if not held:
            break
        time.sleep(0.01)
    _flush_outbox()
    _server_closed[0] = True


def _after_fork_in_child() -> None:
    """A child forked after CUDA started cannot use CUDA: make every pool say so."""
    global _forked
    if all_pools():
        _forked = True
        for p in all_pools():
            p._forked = True
            p._poison()


# multiprocessing's Finalize runs at exit in the main process and in its children alike.
_mp_util.Finalize(None, _at_exit, exitpriority=100)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
_OOM_CALLBACKS.append(collect)
register_reducers()
