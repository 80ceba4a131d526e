"""Zero-copy sharing of CuPy arrays between processes: reducers and the lifetime protocol.

Invariants (every change to this module must keep them):

1. Ownership.  The process that allocated a block (the *exporter*) is the only one
   that frees it.  A block it has exported is freed only when (a) its own last local
   reference is gone, (b) it holds no *ticket* and (c) no *lease* for the block.
   Until then the block sits in *limbo* (``held_for_sharing_bytes``), never in the
   reuse cache.
2. Tickets cover messages.  Every pickled reference is one ticket, registered with
   the exporter *before* the message can reach anyone: at reduce time in the
   exporter, or by an ``inflight`` message on the forwarder's (ordered) connection.
   A receiver resolves its ticket as it unpickles: ``map`` turns it into a lease (the
   block is not mapped in that process yet), ``hit`` drops it (the process already
   holds a lease); a receiver that cannot take the message sends ``drop``.  A
   resolution that overtakes its ``inflight`` is remembered (``early``), so the two
   may arrive in either order.
3. Leases cover mappings.  A receiver holds one lease per mapping, from ``map`` to
   ``unmap``, while arrays use the mapping and while it idles in the receiver's
   cache.  Leases are counted per connection, so the map and unmap of successive
   mappings of one block commute; a mapping's ``unmap`` always follows its own
   ``map`` on the receiver's connection.  A connection that closes (the peer exited
   or was SIGKILLed) gives back every lease it held.
4. Eviction.  A receiver keeps the mapping of a block it received more than once
   after its arrays are gone (at most ``keep_mappings``, least recently used out
   first); it says so in ``map`` (received before) or by a ``hit``.  When a block in
   limbo is held by leases only, the exporter asks each holder that may keep it to
   ``evict`` (again after each ``unmap`` while leases remain): an idle mapping is
   unmapped at once, a used one when its last array goes.  Other holders unmap when
   their arrays go, unasked.  Receivers unmap the idle mappings of an exporter whose
   connection closed.
5. Driver rule.  An importer frees its mapping (stream-ordered, on the stream it
   received the array on, after its last use) and records an IPC event *before* it
   sends ``unmap``; the exporter's free, and its reuse of the block, wait on every
   such event, so importers always free before the exporter and their queued work
   is done before the exporter writes again.
6. Ordering.  Each message carries an IPC event recorded on the sender's current
   stream after the writes it enqueued; the receiver's current stream waits on it
   before the array is returned.  Nobody synchronises a whole device.
7. One import per allocation per process.  Receiving a block that is mapped (in use
   or idle) reuses the mapping (a second import of one pointer breaks the first);
   the pool itself is imported once per process, its file descriptor fetched over
   the connection the first time only, never re-sent with each message.
8. Same GPU.  Devices are matched by UUID, so CUDA_VISIBLE_DEVICES orders may differ.
9. Trust.  Connections are authenticated with the multiprocessing authkey of the
   process family; unpickling a message from an untrusted peer is unsafe (as for any
   pickle).  Pool handles only travel over these connections.
"""

from __future__ import annotations

import itertools
import os
import pickle
import queue
import random
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from multiprocessing import connection as _mpc
from multiprocessing import current_process
from multiprocessing import util as _mp_util
from multiprocessing.reduction import ForkingPickler, recv_handle, send_handle
from typing import Any

import cupy
import numpy as np
from cuda.bindings import driver as _drv

from ._device import device_count
from ._errors import InvalidOptionError, NoGPUError, PoolmemError, SharingError, check_driver
from ._pools import _OOM_CALLBACKS, DevicePool, Pool, _hp, all_pools

__all__ = ["settings", "collect", "sharing_stats", "register_reducers"]

_FALLBACKS = ("device-copy", "host", "error")
_lock = threading.RLock()
_ids = itertools.count(1)
_tickets = itertools.count(random.getrandbits(40) << 20)
_forked = False
_PROTOCOL = 2  # message format; also names the exporter <-> receiver messages used


def _messages(msg: tuple) -> tuple:
    """The messages in one received message (an outbox sends what piled up as a batch)."""
    return msg[1] if msg[0] == "batch" else (msg,)


def _warn_kept(what: str, exc: BaseException) -> None:
    """A protocol step failed in a background thread: say so; its lease or ticket stays
    held (leaking memory is safe, freeing it early is not)."""
    warnings.warn(
        f"cupy_poolmem: {what} failed ({type(exc).__name__}: {exc}); the block "
        "stays held until the process holding it exits",
        RuntimeWarning,
        stacklevel=3,
    )


def _dumps(msg: tuple) -> bytes:
    """Protocol messages hold only ints, strings and bytes: plain pickle is enough (and
    cheaper than ForkingPickler, which copies its reducer table per message)."""
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


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
    keep_mappings : int
        How many mappings of blocks received more than once a receiver keeps after
        their arrays are dropped (default 64), so re-sending a block costs no new
        mapping; ``0`` unmaps at once.  The exporter can still reuse such a block: it
        asks the receiver to unmap it as soon as it frees the block itself.

    Examples
    --------
    >>> cupy_poolmem.sharing.fallback = "error"  # doctest: +SKIP
    >>> cupy_poolmem.sharing.keep_mappings = 16   # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._fallback = "device-copy"
        self.warn_bytes = 8 << 30
        self.exit_timeout = float(os.environ.get("CUPY_POOLMEM_EXIT_TIMEOUT", "0"))
        self.inflight_timeout: float | None = None
        self._keep = 64

    @property
    def fallback(self) -> str:
        return self._fallback

    @fallback.setter
    def fallback(self, value: str) -> None:
        if value not in _FALLBACKS:
            raise InvalidOptionError(f"sharing.fallback={value!r}; choose one of {_FALLBACKS}")
        self._fallback = value

    @property
    def keep_mappings(self) -> int:
        return self._keep

    @keep_mappings.setter
    def keep_mappings(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidOptionError(
                f"sharing.keep_mappings={value!r}; give an int >= 0 "
                "(0 unmaps received blocks as soon as they are dropped)"
            )
        self._keep = value
        _trim_idle()

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
            "'forkserver'."
        )


# ---------------------------------------------------------------- exporter side
class _Export:
    """One exported block, as its exporter sees it."""

    __slots__ = (
        "export_id",
        "ptr",
        "size",
        "data",
        "core",
        "stream",
        "refs",
        "early",
        "leases",
        "keepers",
        "asked",
        "events",
        "in_limbo",
        "block_ref",
        "born",
        "dev_uuid",
    )

    def __init__(self, block: Any) -> None:
        self.export_id = next(_ids)
        self.ptr, self.size, self.core, self.stream = (
            block.ptr,
            block.size,
            block.core,
            block.stream,
        )
        self.data = bytes(
            check_driver(_drv.cuMemPoolExportPointer(block.ptr), "cuMemPoolExportPointer").reserved
        )
        self.refs: dict[int, str] = {}  # ticket -> "inflight" | "local" (a round trip)
        self.early: set[int] = set()  # tickets resolved before their inflight arrived
        self.leases: dict[int, int] = {}  # connection id -> mappings it holds (invariant 3)
        self.keepers: set[int] = set()  # connections that may keep a mapping idle
        self.asked: set[int] = set()  # connections asked to evict since their last unmap
        self.events: dict[bytes, None] = {}  # unmap events the final free waits on
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
        if not share.refs and not share.leases:
            _exports.pop(share.export_id, None)
            if share.events:  # receivers unmapped it earlier: reuse waits for their work
                _wait_unmaps(share, stream.ptr)
            return False  # nobody else holds it: the normal free path
        share.in_limbo = True
        share.core._held_for_sharing += size
        _limbo_bytes[0] += size
        if _limbo_bytes[0] > settings.warn_bytes and not _warned[0]:
            _warned[0] = True
            warnings.warn(
                f"cupy_poolmem: {_limbo_bytes[0]:,} bytes freed here are still held "
                "for other processes (limbo); receivers keep arrays alive too long?",
                ResourceWarning,
                stacklevel=2,
            )
    _settle(share)  # held by idle mappings only: ask their receivers to unmap
    return True


_hp.set_shared_release(_shared_release)


def _settle(exp: _Export) -> None:
    """Act on a changed block: free it once nothing holds it, or ask lease holders to evict."""
    with _lock:
        if not exp.in_limbo or exp.refs:
            return
        if exp.leases:  # receivers that unmap when their arrays go need no asking
            ask = [_peers.get(c) for c in exp.keepers if c not in exp.asked]
            exp.asked.update(exp.keepers)
        else:
            ask = None
            _exports.pop(exp.export_id, None)
            exp.in_limbo = False
            exp.core._held_for_sharing -= exp.size
            _limbo_bytes[0] -= exp.size
    if ask is None:
        _free_exported(exp)
        return
    for peer in ask:
        if peer is not None:
            _post(peer, ("evict", exp.export_id))


def _drop_ticket(exp: _Export, ticket: int) -> None:
    """Give back one ticket (a round trip let go, or an unclaimed message expired)."""
    with _lock:
        exp.refs.pop(ticket, None)
        exp.born.pop(ticket, None)
    _settle(exp)


def _wait_unmaps(exp: _Export, stream_ptr: int) -> None:
    """Make ``stream_ptr`` wait for every receiver's unmap event (invariant 5)."""
    with _on_device(max(exp.core.device_id, exp.stream.device_id, 0)):
        for event in exp.events:
            try:
                _wait_event_bound(event, stream_ptr)
            except Exception:  # the unmapping process died: its work died with it
                pass


def _free_exported(exp: _Export) -> None:
    dev = max(exp.core.device_id, exp.stream.device_id, 0)
    with _on_device(dev):
        _wait_unmaps(exp, exp.stream.ptr)
        hook = exp.core.release_hook  # pinned pools hold blocks until their stream is done
        if hook is None or not hook(exp.ptr, exp.size, exp.stream):
            exp.core._free_now(exp.ptr, exp.stream.ptr)


def _register(exp: _Export, ticket: int, owner: str) -> None:
    """Record a ticket as ``"inflight"`` (a message is on its way) or ``"local"``."""
    with _lock:
        if owner == "inflight":
            if ticket in exp.early:
                exp.early.discard(ticket)
                return
            exp.born[ticket] = time.monotonic()
        elif ticket not in exp.refs:
            exp.early.add(ticket)
        exp.refs[ticket] = owner


def _resolve(exp: _Export, ticket: int) -> None:
    """A receiver got the message of ``ticket`` (``_lock`` held): the ticket is done."""
    if exp.refs.get(ticket) == "inflight":
        del exp.refs[ticket]
        exp.born.pop(ticket, None)
    else:
        exp.early.add(ticket)  # its inflight (from a forwarder) is still on the way


class _Peer:
    """The exporter's end of one receiver's connection (the server thread receives)."""

    __slots__ = ("conn", "lock")

    def __init__(self, conn: Any) -> None:
        self.conn, self.lock = conn, threading.Lock()

    def send(self, msg: tuple) -> None:
        with self.lock:
            self.conn.send_bytes(_dumps(msg))


_peers: dict[int, _Peer] = {}
_cids = itertools.count(1)


class _Server:
    """The exporter's listener: receivers resolve tickets, hold leases, fetch pool fds."""

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
            threading.Thread(
                target=self._serve, args=(conn,), daemon=True, name="cupy_poolmem-sharing-conn"
            ).start()

    def _serve(self, conn: Any) -> None:
        cid = next(_cids)
        peer = _peers[cid] = _Peer(conn)
        try:
            while True:
                msg = conn.recv()
                for m in _messages(msg):
                    try:
                        self._handle(peer, cid, m)
                    except Exception as exc:  # keep serving: leaking beats freeing early
                        _warn_kept(f"sharing message {m[0]!r}", exc)
        except (EOFError, OSError):
            pass
        finally:
            # The peer is gone (exit, crash, SIGKILL): give back every lease it held.
            with _lock:
                _peers.pop(cid, None)
                held = [e for e in _exports.values() if e.leases.pop(cid, None)]
                for e in _exports.values():
                    e.asked.discard(cid)
                    e.keepers.discard(cid)
            for exp in held:
                _settle(exp)
            conn.close()

    def _handle(self, peer: _Peer, cid: int, msg: tuple) -> None:
        op = msg[0]
        if op == "pool":  # (pool uuid, pid): the pool's fd follows the reply
            with peer.lock:
                try:
                    pool = self.pools[msg[1]]
                    fd = int(pool.memory_resource.allocation_handle)
                except Exception as exc:
                    peer.conn.send(("error", msg[1], f"no exported pool {msg[1]} ({exc!r})"))
                    return
                peer.conn.send(("ok", msg[1]))
                send_handle(peer.conn, fd, msg[2])
            return
        exp = _exports.get(msg[1])
        if exp is None:
            return
        with _lock:
            if op == "hit":  # (export_id, ticket): this receiver holds a lease already
                _resolve(exp, msg[2])
                exp.keepers.add(cid)  # a block received again is kept when let go
            elif op == "map":  # (export_id, ticket, keep): the ticket becomes a lease
                _resolve(exp, msg[2])
                exp.leases[cid] = exp.leases.get(cid, 0) + 1
                if msg[3]:
                    exp.keepers.add(cid)
            elif op == "unmap":  # (export_id, event): one mapping gone, freed before event
                n = exp.leases.get(cid, 0) - 1
                if n > 0:
                    exp.leases[cid] = n
                else:
                    exp.leases.pop(cid, None)
                    exp.keepers.discard(cid)
                exp.asked.discard(cid)
                exp.events[msg[2]] = None
            elif op == "inflight":  # (export_id, ticket): a forwarder sent a message on
                _register(exp, msg[2], "inflight")
                return
            elif op == "drop":  # (export_id, ticket): received, but unpickling failed
                _resolve(exp, msg[2])
        _settle(exp)


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
_events: dict[tuple[int, int], Any] = {}  # (device, stream) -> (CUevent, handle bytes)
_opened_events: dict[bytes, Any] = {}  # peer handle -> opened CUevent


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
        raise NoGPUError(
            "received a CuPy array from another process, but this process has "
            "no GPU (check CUDA_VISIBLE_DEVICES in the receiver)"
        )
    for d in range(n):
        _ordinal_by_uuid[_device_uuid(d)] = d
    if uuid in _ordinal_by_uuid:
        return _ordinal_by_uuid[uuid]
    raise SharingError(
        f"received an array on GPU {uuid}, which this process cannot see; "
        "CUDA_VISIBLE_DEVICES of the receiver must include that GPU"
    )


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


_EVENT_FLAGS = _drv.CUevent_flags.CU_EVENT_INTERPROCESS | _drv.CUevent_flags.CU_EVENT_DISABLE_TIMING


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
        ev = _opened_events[handle] = check_driver(
            _drv.cuIpcOpenEventHandle(h), "cuIpcOpenEventHandle"
        )
    check_driver(_drv.cuStreamWaitEvent(stream_ptr, ev, 0), "cuStreamWaitEvent")


# ---------------------------------------------------------------- importer side
class _Client:
    """This process's connection to one exporter; a reader thread takes its requests."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.conn = _mpc.Client(address, family="AF_UNIX", authkey=bytes(current_process().authkey))
        self.lock = threading.RLock()
        self.replies: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = False
        threading.Thread(target=self._read, name="cupy_poolmem-sharing-client", daemon=True).start()

    def send(self, msg: tuple) -> None:
        with self.lock:
            self.conn.send_bytes(_dumps(msg))

    def _read(self) -> None:
        try:
            while True:
                msg = self.conn.recv()
                for m in _messages(msg):
                    if m[0] == "ok":  # the pool's fd follows at once (one locked send)
                        self.replies.put((m[1], recv_handle(self.conn), None))
                    elif m[0] == "error":
                        self.replies.put((m[1], None, m[2]))
                    elif m[0] == "evict":
                        try:
                            _evict(self.address, m[1])
                        except Exception as exc:  # keep reading
                            _warn_kept("unmapping a shared block", exc)
        except (EOFError, OSError):
            pass
        finally:
            self.closed = True
            self.replies.put((None, None, "the exporting process closed its connection"))
            _exporter_gone(self.address)

    def fetch_pool_fd(self, pool_uuid: str) -> int:
        self.send(("pool", pool_uuid, os.getpid()))
        deadline = time.monotonic() + 60.0
        while True:
            try:
                uuid, fd, error = self.replies.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                raise SharingError(
                    "the exporting process did not share its pool within 60 s"
                ) from None
            if uuid == pool_uuid or uuid is None:
                break
            if fd is not None:  # a late reply to an earlier request that timed out
                os.close(fd)
        if fd is None:
            raise SharingError(f"the exporter could not share its pool: {error}")
        return fd


_clients: dict[str, _Client] = {}
_outbox: queue.SimpleQueue = queue.SimpleQueue()
_outbox_thread: list[threading.Thread | None] = [None]


def _post(to: str | _Peer, msg: tuple) -> None:
    """Queue a message for an exporter's address or a receiver's peer (safe from ``__del__``)."""
    _outbox.put((to, msg))
    if _outbox_thread[0] is None:
        with _lock:
            if _outbox_thread[0] is None:
                t = threading.Thread(target=_drain_outbox, name="cupy_poolmem-outbox", daemon=True)
                _outbox_thread[0] = t
                t.start()


def _drain_outbox() -> None:
    while True:
        to, msg = _outbox.get()
        batch = {to: [msg]}
        while True:  # send what piled up meanwhile in one message per destination
            try:
                to, msg = _outbox.get_nowait()
            except queue.Empty:
                break
            batch.setdefault(to, []).append(msg)
        for to, msgs in batch.items():
            try:
                dest = to if isinstance(to, _Peer) else _client(to)
                dest.send(msgs[0] if len(msgs) == 1 else ("batch", msgs))
            except Exception:
                pass  # the other process exited: its memory (or its mappings) are gone


def _claim(c: _Client, msg: tuple) -> None:
    """Send ``map`` or ``hit`` for a ticket just received (invariant 2).

    Sent at once when the connection is free (no thread hand-off on the receive
    path), else through the outbox; either way before this mapping's ``unmap``.
    """
    if c.lock.acquire(blocking=False):
        try:
            c.conn.send_bytes(_dumps(msg))
            return
        except Exception:
            pass
        finally:
            c.lock.release()
    _post(c.address, msg)


def _flush_outbox(timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not _outbox.empty() and time.monotonic() < deadline:
        time.sleep(0.001)


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
                        f"memory shared by an exited process is gone ({exc})"
                    ) from None
    return c


_imported_pools: dict[str, Any] = {}
_pool_import_lock = threading.Lock()
_pool_handles: dict[str, Any] = {}  # pool uuid -> CUmemoryPool of the imported pool


def _imported_pool(c: _Client, pool_uuid: str, kind: int, dev: int) -> Any:
    """The exporter's pool as a ``CUmemoryPool``, imported once per process.

    ``_imported_pools`` (shared with the Numba plugin) keeps the cuda.core resource.
    """
    h = _pool_handles.get(pool_uuid)
    if h is None:
        with _pool_import_lock:
            mr = _imported_pools.get(pool_uuid)
            if mr is None:
                import cuda.core as cc

                fd = c.fetch_pool_fd(pool_uuid)
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


class _Mapping:
    """One exported block mapped into this process (one per block: invariant 7)."""

    __slots__ = (
        "ptr",
        "size",
        "key",
        "client",
        "export_id",
        "dev",
        "kind",
        "pool_uuid",
        "dev_uuid",
        "data",
        "users",
        "keep",
        "evict",
        "last_use",
        "waits",
    )

    def __init__(
        self,
        ptr: int,
        size: int,
        key: tuple,
        client: _Client,
        export_id: int,
        dev: int,
        kind: int,
        pool_uuid: str,
        dev_uuid: str,
        data: bytes,
    ) -> None:
        self.ptr, self.size, self.key, self.client = ptr, size, key, client
        self.export_id, self.dev, self.kind = export_id, dev, kind
        self.pool_uuid, self.dev_uuid, self.data = pool_uuid, dev_uuid, data
        self.users = 1  # live _Imported owners (one per message received)
        self.keep = key in _seen  # received before: likely to come again (invariant 4)
        self.evict = False  # the exporter asked for it back
        self.last_use: Any = None  # CUevent recorded when the last array went (idle)
        self.waits: list[Any] = []  # CUevents: other streams' last uses, while in use


_maps: dict[tuple[str, int], _Mapping] = {}  # (exporter address, export id) -> mapping
_idle: OrderedDict[tuple[str, int], _Mapping] = OrderedDict()  # unused, oldest first
_seen: OrderedDict[tuple[str, int], None] = OrderedDict()  # recent mapping keys
_SEEN_MAX = 4096
_PLAIN_EVENT = _drv.CUevent_flags.CU_EVENT_DISABLE_TIMING


class _Imported:
    """What the arrays of one received message hold on a mapping.

    ``stream`` is the stream that was current when the message was unpickled (it
    waited on the sender's event); the mapping is let go in order on it, the way the
    pools free a block on its allocation stream.
    """

    __slots__ = ("m", "ptr", "size", "stream", "__weakref__")

    def __init__(self, m: _Mapping, stream: Any) -> None:
        self.m, self.ptr, self.size, self.stream = m, m.ptr, m.size, stream

    def __del__(self) -> None:
        _dropped(self.m, self.stream)


def _forget(m: _Mapping) -> None:
    """Take ``m`` out of the maps (``_lock`` held); remember its key as seen."""
    _maps.pop(m.key, None)
    _idle.pop(m.key, None)
    _seen[m.key] = None
    if len(_seen) > _SEEN_MAX:
        _seen.popitem(last=False)


def _send_unmap(m: _Mapping, event: bytes | None) -> None:
    if event is not None and not m.client.closed:
        # Never send from __del__ (it may run inside another send): the outbox thread
        # does, in order, after the sends already made by this process.
        _post(m.client.address, ("unmap", m.export_id, event))


def _event_on(sptr: int) -> Any:
    ev = check_driver(_drv.cuEventCreate(_PLAIN_EVENT), "cuEventCreate")
    check_driver(_drv.cuEventRecord(ev, sptr), "cuEventRecord")
    return ev


def _free_mapping(m: _Mapping, sptr: int) -> bytes | None:
    """Unmap ``m`` in order on ``sptr`` (``_lock`` held, its device current); the event
    for ``unmap``, or None when the driver refused (the lease then stays: safe)."""
    if m.last_use is not None:
        _drv.cuEventDestroy(m.last_use)
        m.last_use = None
    try:  # importers free first (driver rule)
        check_driver(_drv.cuMemFreeAsync(m.ptr, sptr), "cuMemFreeAsync")
    except Exception as exc:
        _warn_kept("unmapping a shared block", exc)
        return None
    return _record_event_bound(max(m.dev, 0), sptr)


def _free_idle(m: _Mapping) -> bytes | None:
    """Unmap an idle mapping, already out of the maps (``_lock`` held), after its last use.

    Runs on the legacy default stream.  A stream of our own would add an IPC event
    per process; on driver 580 that made every later event record and wait of both
    processes take milliseconds.
    """
    with _on_device(max(m.dev, 0)):
        check_driver(_drv.cuStreamWaitEvent(0, m.last_use, 0), "cuStreamWaitEvent")
        return _free_mapping(m, 0)


def _dropped(m: _Mapping, stream: Any) -> None:
    """The arrays of one message are gone: keep the mapping idle, or unmap it."""
    over: list[tuple[_Mapping, bytes | None]] = []
    event = None
    try:
        with _on_device(max(m.dev, 0)), _lock:
            sptr = stream.ptr
            m.users -= 1
            if m.users:  # other messages' arrays still use it: the final free waits
                m.waits.append(_event_on(sptr))
                return
            for ev in m.waits:
                check_driver(_drv.cuStreamWaitEvent(sptr, ev, 0), "cuStreamWaitEvent")
                _drv.cuEventDestroy(ev)
            m.waits.clear()
            keep = m.keep and not m.evict and not m.client.closed and settings._keep > 0
            if keep:
                if m.last_use is None:
                    m.last_use = check_driver(_drv.cuEventCreate(_PLAIN_EVENT), "cuEventCreate")
                check_driver(_drv.cuEventRecord(m.last_use, sptr), "cuEventRecord")
                _idle[m.key] = m
                over = _over_cap()
            else:
                _forget(m)
                event = _free_mapping(m, sptr)
    except Exception:
        return  # interpreter shutdown: the process's mappings go with it
    _send_unmap(m, event)
    for o, ev in over:
        _send_unmap(o, ev)


def _take_idle(ms: list[_Mapping]) -> list[tuple[_Mapping, bytes | None]]:
    """Forget and unmap idle mappings (``_lock`` held): the unmap is enqueued before
    anyone can import the block again (invariant 7); returns what to send."""
    out = []
    for m in ms:
        _forget(m)
        try:
            out.append((m, _free_idle(m)))
        except Exception as exc:
            _warn_kept("unmapping a shared block", exc)
    return out


def _over_cap() -> list[tuple[_Mapping, bytes | None]]:
    """Unmap the idle mappings beyond ``keep_mappings`` (``_lock`` held)."""
    n = len(_idle) - settings._keep
    return _take_idle(list(_idle.values())[:n]) if n > 0 else []


def _evict(address: str, export_id: int) -> None:
    """The exporter wants block ``export_id`` back (it freed it): unmap when unused."""
    with _lock:
        m = _maps.get((address, export_id))
        if m is None:
            return  # unmapped already; the exporter gets that unmap
        m.evict = True
        if m.users:
            return  # unmapped when its last array goes
        done = _take_idle([m])
    for o, ev in done:
        _send_unmap(o, ev)


def _exporter_gone(address: str) -> None:
    """An exporter's connection closed: unmap its idle mappings (the driver kept them alive)."""
    with _lock:
        _take_idle([m for m in _idle.values() if m.client.address == address])


def _trim_idle(limit: int | None = None) -> int:
    """Unmap idle mappings beyond ``limit`` (``keep_mappings`` by default); return how many."""
    with _lock:
        if limit is None:
            done = _over_cap()
        else:
            done = _take_idle(list(_idle.values())[: max(len(_idle) - limit, 0)])
    for m, ev in done:
        _send_unmap(m, ev)
    return len(done)


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


def _export_message(
    owner: Any, kind_tag: str, offset: int, shape: tuple, strides: tuple, dtype: str
) -> tuple:
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
        head = (
            server.address,
            pool_uuid,
            exp.dev_uuid,
            core.kind,
            exp.export_id,
            exp.data,
            exp.size,
            ticket,
        )
    elif isinstance(owner, _LocalHolder):
        return (
            _export_message(owner.block, kind_tag, offset, shape, strides, dtype)
            if owner.block is not None
            else _forward_local(owner, kind_tag, offset, shape, strides, dtype)
        )
    else:  # _Imported: forward to a third process; the exporter learns the ticket first
        m = owner.m
        ticket = next(_tickets)
        m.client.send(("inflight", m.export_id, ticket))
        dev = m.dev
        head = (
            m.client.address,
            m.pool_uuid,
            m.dev_uuid,
            m.kind,
            m.export_id,
            m.data,
            m.size,
            ticket,
        )
    ev = _record_event(dev if dev >= 0 else cupy.cuda.runtime.getDevice())
    return (_PROTOCOL, kind_tag) + head + (ev, offset, shape, strides, dtype)


def _forward_local(holder: _LocalHolder, *rest: Any) -> tuple:
    exp = holder.exp
    with _lock:
        ticket = next(_tickets)
        _register(exp, ticket, "inflight")
    server = _get_server()
    dev = exp.core.device_id
    ev = _record_event(dev if dev >= 0 else cupy.cuda.runtime.getDevice())
    kind_tag, offset, shape, strides, dtype = rest
    return (
        _PROTOCOL,
        kind_tag,
        server.address,
        exp.core._pool_uuid,
        exp.dev_uuid,
        exp.core.kind,
        exp.export_id,
        exp.data,
        exp.size,
        ticket,
        ev,
        offset,
        shape,
        strides,
        dtype,
    )


def _rebuild(
    version: int,
    kind_tag: str,
    address: str,
    pool_uuid: str,
    dev_uuid: str,
    pool_kind: int,
    export_id: int,
    data: bytes,
    size: int,
    ticket: int,
    event_desc: Any,
    offset: int,
    shape: tuple,
    strides: tuple,
    dtype: str,
) -> Any:
    """Receiver side of a shared array (also the round trip back to its exporter)."""
    _check_not_forked()
    if version != _PROTOCOL:
        raise SharingError(
            f"message format {version} from a different cupy_poolmem version "
            f"(this one reads format {_PROTOCOL}); install one version in "
            "every process"
        )
    srv = _server[0]
    local = srv is not None and srv.address == address
    try:
        dev = _local_device(dev_uuid) if dev_uuid else _runtime.getDevice()
    except BaseException:
        if not local:
            _give_back(address, export_id, ticket)
        raise
    with _on_device(dev):
        stream = cupy.cuda.get_current_stream()
        if local:
            owner = _local_owner(export_id, ticket)
        else:
            owner = _import(
                address, pool_uuid, pool_kind, dev, dev_uuid, export_id, data, size, ticket, stream
            )
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


def _give_back(address: str, export_id: int, ticket: int) -> None:
    """A message could not be received here: settle its ticket so the block can go."""
    try:
        c = _client(address)
        if not c.closed:
            _post(address, ("drop", export_id, ticket))
    except Exception:
        pass  # the exporter is gone


def _local_owner(export_id: int, ticket: int) -> _LocalHolder:
    exp = _exports.get(export_id)
    if exp is None:
        raise SharingError("an array came back to its exporter after its memory was freed")
    h = _LocalHolder()
    h.exp, h.ticket, h.block = exp, ticket, exp.block_ref()
    h.ptr, h.size = exp.ptr, exp.size
    _register(exp, ticket, "local")
    return h


def _import(
    address: str,
    pool_uuid: str,
    pool_kind: int,
    dev: int,
    dev_uuid: str,
    export_id: int,
    data: bytes,
    size: int,
    ticket: int,
    stream: Any,
) -> _Imported:
    """Map one exported block in this process (``dev`` current), or reuse its mapping."""
    key = (address, export_id)
    c = _client(address)
    if c.closed:
        raise SharingError(
            "the process that owns this array has exited; memory shared by "
            "an exited process is gone (keep it alive, or set "
            "cupy_poolmem.sharing.exit_timeout in it)"
        )
    try:
        # Outside _lock: the pool's fd comes through the client's reader thread, which
        # takes _lock for evictions.
        handle = _imported_pool(c, pool_uuid, pool_kind, dev)
        with _lock:  # look-up and import together: one thread imports a block, once
            m = _maps.get(key)
            if m is not None:  # mapped here already (in use or idle): a lease covers it
                # Count the user before anything allocates: a garbage collection here
                # may run _dropped, which must not unmap or evict this mapping.
                m.users += 1
                _idle.pop(key, None)
                m.keep = True
                msg: tuple = ("hit", export_id, ticket)
            else:
                share = _drv.CUmemPoolPtrExportData()
                share.reserved = data
                ptr = int(
                    check_driver(
                        _drv.cuMemPoolImportPointer(handle, share), "cuMemPoolImportPointer"
                    )
                )
                m = _maps[key] = _Mapping(
                    ptr, size, key, c, export_id, dev, pool_kind, pool_uuid, dev_uuid, data
                )  # one user
                msg = ("map", export_id, ticket, m.keep)
    except BaseException:
        _give_back(address, export_id, ticket)
        raise
    imp = _Imported(m, stream)
    _claim(c, msg)
    return imp


def _shareable(owner: Any) -> bool:
    if isinstance(owner, (_Imported, _LocalHolder)):
        return True
    return (
        isinstance(owner, _hp.Block) and getattr(owner.core, "ipc", False) and not owner.core.closed
    )


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
                "set cupy_poolmem.sharing.fallback to 'device-copy' or 'host'"
            )
        with _on_device(arr.device.id):
            pool = _sharing_pool(arr.device.id)
            with cupy.cuda.using_allocator(pool.malloc):
                arr = cupy.array(arr, copy=True, order="K")
        mem = arr.data.mem
        owner = _block_of(mem)
    offset = arr.data.ptr - mem.ptr
    return _rebuild, _export_message(owner, "cupy", offset, arr.shape, arr.strides, arr.dtype.str)


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
    return _rebuild, _export_message(owner, "numpy", offset, arr.shape, arr.strides, arr.dtype.str)


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
    """Free limbo blocks nobody holds, expire unclaimed tickets, unmap idle mappings.

    Returns the bytes of this process's pools freed.  Blocks are normally freed as
    soon as the last receiver lets go; this is the safety net (also run before an
    out-of-memory retry).  Idle mappings of blocks received from other processes
    (see ``sharing.keep_mappings``) are unmapped too, so their exporters need not ask.

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
        was = exp.in_limbo
        if timeout is not None:
            for t, born in list(exp.born.items()):
                if exp.refs.get(t) == "inflight" and now - born > timeout:
                    _drop_ticket(exp, t)
        _settle(exp)
        if was and not exp.in_limbo:
            freed += exp.size
    _trim_idle(0)
    return freed


def sharing_stats() -> dict:
    """Counts of the sharing protocol in this process.

    Returns
    -------
    dict
        ``exported_blocks``, ``limbo_blocks`` and ``limbo_bytes`` (blocks freed here
        but held for other processes), ``tickets_out`` (messages not yet received),
        ``leases`` (mappings other processes hold of this process's blocks),
        ``imported_blocks`` (blocks of other processes mapped here and in use),
        ``idle_mappings`` (mapped here, unused, kept for a re-send) and
        ``imported_pools``.

    Examples
    --------
    >>> cupy_poolmem.sharing_stats()["limbo_bytes"]  # doctest: +SKIP
    0
    """
    with _lock:
        return {
            "exported_blocks": len(_exports),
            "limbo_blocks": sum(1 for e in _exports.values() if e.in_limbo),
            "limbo_bytes": _limbo_bytes[0],
            "tickets_out": sum(len(e.refs) for e in _exports.values()),
            "leases": sum(sum(e.leases.values()) for e in _exports.values()),
            "imported_blocks": len(_maps) - len(_idle),
            "idle_mappings": len(_idle),
            "imported_pools": len(_imported_pools),
        }


def _at_exit() -> None:
    """Optionally wait (``settings.exit_timeout``) for receivers to unmap, then stop serving."""
    deadline = time.monotonic() + settings.exit_timeout
    asked = False
    while time.monotonic() < deadline:
        with _lock:
            held = [(e, list(e.leases)) for e in _exports.values() if e.leases]
        if not held:
            break
        if not asked:  # this process's memory goes with it: idle mappings are useless
            asked = True
            for e, cids in held:
                for cid in cids:
                    peer = _peers.get(cid)
                    if peer is not None:
                        _post(peer, ("evict", e.export_id))
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
