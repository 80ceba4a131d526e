"""The exporter: tickets, leases and limbo of this process's shared blocks, and its server.

One :class:`Exporter` per process (owned by the sharing context).  Its state is the
table of :class:`Record` s (one per exported block) and the connected receivers
(:class:`Peer`); every change to either happens under ``Exporter.lock``, and nothing
is sent while that lock is held (frames go through each peer's :class:`Sender`, or
are replies written by the peer's own server thread).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .._errors import SharingError
from . import _wire
from ._settings import SharingSettings
from ._transport import Conn, Listener, Sender

log = logging.getLogger(__name__)

__all__ = ["Exporter", "Record", "LocalHold"]

# Claimed tickets a record remembers (another copy of a message may claim again): the
# most recent ones only, so a block sent a million times stays small.
_CLAIMED_MAX = 4096


class Record:
    """One exported block, as its exporter sees it.

    ``tickets``: messages on their way (ticket -> time registered); ``claimed``:
    the last ``_CLAIMED_MAX`` tickets received (another copy of one of those messages
    may still claim while the block lives; a copy of an older one is refused); ``leases``:
    mappings per receiver connection (each holder is asked to evict when the block is
    freed); ``events``: receivers' unmap and idle events the final free (and a reuse) waits on.

    Recycling (P12): ``life`` numbers the block's lives in its pool's reuse
    cache (0: a block that is never recycled); ``idle``: per receiver connection, the
    life its last ``Idle`` said (its mapping unused, messages of that life or earlier
    claimed); ``released``: the life each receiver was asked to say ``Idle`` for;
    ``retiring``: the cache let the block go, it waits for its final free.  While the
    block is *dormant* (in the reuse cache, or reused by a new block not exported yet)
    ``core`` is None: the pool's cache holds the record, never the other way round, so
    a pool dropped without ``close()`` can still be collected (the hot path's hooks
    hand the pool back).  ``orphan``: its pool was finalized (a garbage cycle), so its
    stream may be destroyed: the receivers' events are waited for on the host and the
    final free goes to the pool's retirer (``_orphan``), which frees it after a device
    synchronise.
    """

    __slots__ = (
        "exporter",
        "export_id",
        "ptr",
        "size",
        "core",
        "stream",
        "stream_ptr",
        "dev",
        "dev_uuid",
        "data",
        "pool_uuid",
        "pool_mr",
        "ident",
        "tickets",
        "claimed",
        "leases",
        "asked",
        "events",
        "local",
        "in_limbo",
        "block_ref",
        "life",
        "idle",
        "released",
        "retiring",
        "orphan",
    )

    def __init__(
        self,
        exporter: Exporter,
        export_id: int,
        block: Any,
        data: bytes,
        dev: int,
        dev_uuid: str,
        pool: tuple[str, Any],
    ) -> None:
        self.exporter = exporter
        self.export_id = export_id
        self.ptr, self.size, self.core = block.ptr, block.size, block.core
        self.stream = block.stream
        self.stream_ptr = int(block.stream_ptr)
        self.dev, self.dev_uuid, self.data = dev, dev_uuid, data
        # The CUDA pool that holds the block (a DevicePool may have two): its uuid goes
        # in every message, its descriptor to a receiver that has not imported it.
        self.pool_uuid, self.pool_mr = pool
        # what a claim must name: this allocation, of this pool, of this kind
        self.ident = _wire.block_id(self.pool_uuid, block.core.kind, data)
        self.tickets: dict[bytes, float] = {}
        self.claimed: OrderedDict[bytes, None] = OrderedDict()
        self.leases: dict[int, int] = {}
        self.asked: set[int] = set()
        self.events: dict[tuple[int, bytes], Any] = {}
        self.local = 0  # round-tripped arrays alive in this process
        self.in_limbo = False
        self.block_ref: Any = weakref.ref(block)
        # Only a plain device pool's block that fits its reuse cache recycles (a pinned
        # pool defers its frees, a managed block may carry hints): see docs/sharing.rst,
        # "Recycled blocks", for the rule.
        core = self.core
        recycle = (
            core.kind == _wire.POOL_DEVICE
            and core.release_hook is None
            and getattr(core, "_cache_shared", None) is not None
            and 0 < self.size <= getattr(core, "cache_limit", 0)
        )
        self.life = 1 if recycle else 0
        self.idle: dict[int, int] = {}
        self.released: dict[int, int] = {}
        self.retiring = False
        self.orphan = False

    def busy(self, cid: int) -> bool:
        """Whether receiver ``cid``'s mapping may be in use in the block's current life
        (a block that is never recycled: whether it maps the block at all)."""
        return not self.life or self.idle.get(cid, 0) < self.life

    def held(self) -> bool:
        """Whether anything but the exporter's own arrays holds the block (a recycled
        block: anything but mappings whose receivers said they are idle)."""
        if self.tickets or self.local:
            return True
        if self.life and not self.retiring:
            return any(self.busy(c) for c in self.leases)
        return bool(self.leases)


class LocalHold:
    """An array that came back to its exporter: keeps the block (or its limbo entry)."""

    __slots__ = ("exporter", "rec", "block", "ptr", "size", "__weakref__")

    def __init__(self, exporter: Exporter, rec: Record) -> None:
        self.exporter, self.rec = exporter, rec
        self.block = rec.block_ref()
        self.ptr, self.size = rec.ptr, rec.size

    def __del__(self) -> None:
        try:
            self.exporter.let_go_local(self.rec)
        except Exception:  # interpreter shutdown
            pass


class Peer:
    """The exporter's end of one receiver's connection."""

    __slots__ = ("cid", "conn", "sender", "events", "mapping")

    def __init__(self, cid: int, conn: Conn) -> None:
        self.cid, self.conn = cid, conn
        self.mapping = 0  # claims granted that it has not said ``Mapped`` for yet
        self.sender = Sender(conn, f"cupy_poolmem-to-{conn.peer.pid}")
        self.events: dict[bytes, Any] = {}  # the receiver's IPC events, opened here


class Exporter:
    """Tickets, leases and limbo of this process's exported blocks; the listener.

    Parameters
    ----------
    driver
        The :class:`~cupy_poolmem._sharing._driver.Driver` (or a fake of it).
    settings
        The process's :class:`SharingSettings`.
    authkey
        The multiprocessing authkey of the process family.
    ticket_source
        ``n -> bytes``; ``os.urandom`` (unguessable tickets) unless a test says otherwise.
    listener_options
        Keyword arguments for its :class:`~cupy_poolmem._sharing._transport.Listener`
        (handshake deadline and cap, thread factory, peer credentials: tests).
    """

    def __init__(
        self,
        driver: Any,
        settings: SharingSettings,
        authkey: bytes,
        ticket_source: Callable[[int], bytes] = os.urandom,
        listener_options: dict[str, Any] | None = None,
    ) -> None:
        self.driver = driver
        self.settings = settings
        self.authkey = authkey
        self.lock = threading.RLock()
        self.records: dict[int, Record] = {}
        self.peers: dict[int, Peer] = {}
        self.limbo_bytes = 0
        self._ids = 0
        self._cids = 0
        self._listener: Listener | None = None
        self._listener_options = dict(listener_options or {})
        self._tickets = ticket_source
        self._warned = False
        self.recycled = 0  # blocks put back into a reuse cache with their records
        self.stranded = 0  # leases of gone receivers of unknown pid, held until exit
        self._syncing = 0  # host waits on receivers' events under way (lock not held)
        self.events_max = 64  # receivers' events kept open per receiver, oldest out first
        self._close_later: list[Any] = []  # events _reap closes once those are done
        self.ignored_hits = 0  # Hits of a dead ticket or another life (acknowledge nothing)
        self._janitor: threading.Thread | None = None
        self._wake = threading.Event()
        self.closed = False
        # In a fork child: the parent's state, whose locks a parent thread may hold for
        # ever; blocks it exported are left alone (they are the parent's to free).
        self.abandoned = False

    # -- the listener --------------------------------------------------------------------
    @property
    def address(self) -> str:
        """The listener's address, starting it on first use."""
        if self._listener is None:
            with self.lock:
                if self._listener is None:
                    self._listener = Listener(self.authkey, self._serve, **self._listener_options)
                    log.info("sharing: exporter listening at %s", self._listener.address)
        return self._listener.address

    @property
    def own_address(self) -> str | None:
        """The address if the listener runs, else None (no block exported yet)."""
        return self._listener.address if self._listener is not None else None

    # -- exporting -----------------------------------------------------------------------
    def export(self, block: Any) -> tuple[Record, bytes, bytes]:
        """Register a message for ``block``: ``(record, ticket, event handle)``.

        The ticket pins the block until a receiver claims it, or ``inflight_timeout``.
        The event covers the work enqueued on the block's allocation stream so far.
        """
        if self._listener is None:
            self.address  # noqa: B018  (the listener runs before any message can exist)
        with self.lock:
            rec = block.share
            if rec is None:
                dev = block.core.device_id
                pool = block.core._ipc_pool_of(block.ptr)
                self._ids += 1
                rec = Record(
                    self,
                    self._ids,
                    block,
                    self.driver.export_pointer(block.ptr),
                    dev,
                    self.driver.device_uuid(dev) if dev >= 0 else "",
                    pool,
                )
                self.records[rec.export_id] = rec
                block.share = rec
            elif rec.core is None:
                # A block recycled through the reuse cache, sent in a new life: receivers
                # that map it idle take its messages as hits (P12).
                rec.life += 1
                rec.core, rec.stream = block.core, block.stream
                rec.stream_ptr = int(block.stream_ptr)
                rec.block_ref = weakref.ref(block)
            ticket = self._new_ticket(rec)
        try:
            if getattr(block, "recorded_streams", ()):  # record_stream()ed streams write too
                with self.driver.on_device(self._dev(rec)):
                    block.wait_recorded(rec.stream)
            event = self._record_event(rec)
        except BaseException:
            self.drop_ticket(rec, ticket)
            raise
        return rec, ticket, event

    def export_record(self, rec: Record) -> tuple[bytes, bytes]:
        """A new message for a block known only by its record (a round-tripped array)."""
        with self.lock:
            if self.records.get(rec.export_id) is not rec:
                raise SharingError("this array's memory was freed by its exporter")
            ticket = self._new_ticket(rec)
        try:
            event = self._record_event(rec)
        except BaseException:
            self.drop_ticket(rec, ticket)
            raise
        return ticket, event

    def _new_ticket(self, rec: Record) -> bytes:
        """Register a fresh, unguessable ticket on ``rec`` (lock held)."""
        ticket = self._tickets(_wire.TICKET_BYTES)
        if ticket in rec.tickets or ticket in rec.claimed:
            raise SharingError("duplicate sharing ticket refused (the ticket source repeats)")
        rec.tickets[ticket] = time.monotonic()
        self._start_janitor()
        return ticket

    def _record_event(self, rec: Record) -> bytes:
        dev = self._dev(rec)
        with self.driver.on_device(dev):
            return self.driver.record_ipc_event(dev, rec.stream_ptr)[1]

    def drop_ticket(self, rec: Record, ticket: bytes) -> None:
        """Give back one unclaimed ticket (expired, or its message could not be made)."""
        with self.lock:
            rec.tickets.pop(ticket, None)
        self._settle(rec)

    # -- the hot path's hooks ------------------------------------------------------------
    def release(self, ptr: int, size: int, stream: Any, rec: Record, core: Any = None) -> bool:
        """The exporter's last local reference to a shared block is gone.

        Returns True when the block is kept (limbo, or back in its pool's reuse cache
        with its record); False lets the hot path free or cache it, ordered after every
        receiver's unmap.  ``core``: the block's pool (a dormant record has none).
        """
        if self.abandoned:
            return True
        host = None
        with self.lock:
            if rec.core is None:  # reused from the cache, and let go before any send
                rec.core = core
            if not rec.held():
                if rec.life and self._recycle(rec, stream, False):
                    return True
                if not rec.leases:
                    self.records.pop(rec.export_id, None)
                    # receivers unmapped it earlier: the next user waits for their work
                    host = self._wait_unmaps(rec, stream.ptr)
                else:
                    rec.retiring = True  # the cache refused it: receivers unmap, then free
            if host is None:
                self._to_limbo(rec)
                self._warn_limbo()
        if host is not None:
            self._sync_host(rec, host)  # outside the lock: a receiver's kernel may be long
            return False
        self._settle(rec)
        return True

    def retire(self, ptr: int, size: int, stream: Any, rec: Record, core: Any = None) -> bool:
        """The reuse cache lets a recycled block go (trim, close, out of memory), or its
        pool was finalized: its final free.  True when receivers still map it (they are
        asked to unmap; the exporter frees it after them); False: free it now (the
        caller's free on ``stream`` is ordered after their unmaps).

        ``stream`` None: the pool was finalized and its streams may be destroyed: the
        receivers' events are waited for on the host, and the caller (or, later, the
        exporter) gives the block to the pool's retirer, which frees it after a device
        synchronise.
        """
        if self.abandoned:
            return True
        with self.lock:
            if rec.core is None:
                rec.core = core
            rec.retiring = True
            if stream is None:
                rec.orphan = True
                rec.stream, rec.stream_ptr = None, 0
            if not rec.leases and not rec.tickets and not rec.local:
                self.records.pop(rec.export_id, None)
                if stream is None:  # done on the host: the retirer frees it on any stream
                    host = self._wait_unmaps(rec, 0, host=True)
                else:
                    host = self._wait_unmaps(rec, stream.ptr)
            else:
                host = None
                self._to_limbo(rec)
        if host is not None:
            self._sync_host(rec, host)
            return False
        self._settle(rec)
        return True

    def _to_limbo(self, rec: Record) -> None:
        rec.in_limbo = True
        rec.core._held_for_sharing += rec.size
        self.limbo_bytes += rec.size

    def _out_of_limbo(self, rec: Record) -> None:
        rec.in_limbo = False
        rec.core._held_for_sharing -= rec.size
        self.limbo_bytes -= rec.size

    def _recycle(self, rec: Record, stream: Any, in_limbo: bool) -> bool:
        """Put a block no receiver uses into its pool's reuse cache with its record
        (lock held); False when the cache does not take it (full, off, pool closed).

        Its next user on that stream is ordered after every receiver's last use, and
        the messages of this life are refused from now on (stale copies included).
        """
        core = rec.core
        if core.closed or rec.size > core.cache_limit:
            return False
        if self._host_pending(rec):  # a capture: not now, that wait would hold the lock
            return False
        # Enqueued before anyone can reuse it (on the host: done already, see above).
        self._sync_host(rec, self._wait_unmaps(rec, rec.stream_ptr))
        rec.claimed.clear()
        rec.released.clear()
        rec.asked.clear()
        if not core._cache_shared(rec.ptr, rec.size, rec.stream_ptr, stream, rec):
            return False
        if in_limbo:
            self._out_of_limbo(rec)
        rec.core, rec.stream = None, stream  # dormant (see Record)
        self.recycled += 1
        return True

    def _wait_unmaps(self, rec: Record, stream_ptr: int, host: bool = False) -> list[Any]:
        """Order ``stream_ptr`` after every receiver's unmap (and last use) of ``rec``
        (lock held); returns the events to wait for on the host instead.

        On the host (``host``, or when ``stream_ptr`` is being captured, which a recycle
        may meet at any time: the wait would become part of the graph) the caller waits,
        with :meth:`_sync_host` once it has let go of the lock (a receiver's kernel may
        run long: no export or claim waits for it), before anything uses the block.
        ``_reap`` closes a dead receiver's events only when no such wait is under way.
        """
        events = list(rec.events.values())
        rec.events.clear()
        if not events:
            return []
        with self.driver.on_device(self._dev(rec)):
            if host or self.driver.is_capturing(stream_ptr):
                self._syncing += 1
                return events
            for ev in events:
                self._wait(stream_ptr, ev)
        return []

    def _sync_host(self, rec: Record, events: list[Any]) -> None:
        """Wait on the host for what :meth:`_wait_unmaps` returned (lock not held)."""
        if not events:
            return
        try:
            with self.driver.on_device(self._dev(rec)), self.driver.relaxed():
                for ev in events:  # (relaxed: a global-mode capture elsewhere allows it)
                    try:
                        self.driver.sync_event(ev)
                    except Exception:  # the unmapping process died: its work too
                        pass
        finally:
            with self.lock:
                self._syncing -= 1
                late = self._close_later if not self._syncing else []
                if late:
                    self._close_later = []
                    self._close_events(late)

    def _host_pending(self, rec: Record) -> bool:
        """Whether reusing ``rec`` now would wait on the host for work not done yet (its
        stream is being captured and a receiver's event has not completed)."""
        if not rec.events:
            return False
        with self.driver.on_device(self._dev(rec)):
            if not self.driver.is_capturing(rec.stream_ptr):
                return False
            with self.driver.relaxed():
                for ev in rec.events.values():
                    try:
                        if not self.driver.event_done(ev):
                            return True
                    except Exception:  # the unmapping process died: its work too
                        pass
        return False

    def _retire_events(self, peer: Peer) -> None:
        """Close ``peer``'s oldest opened events beyond ``events_max`` (lock held; one
        per stream it unmapped on) that no block's free still waits for; under a host
        wait, its last one closes them."""
        extra = len(peer.events) - self.events_max
        if extra <= 0:
            return
        used = {id(ev) for rec in self.records.values() for ev in rec.events.values()}
        out: list[Any] = []
        for handle, ev in list(peer.events.items())[:-1]:  # never the one just opened
            if len(out) >= extra:
                break
            if id(ev) not in used:
                out.append(peer.events.pop(handle))
        if self._syncing:
            self._close_later.extend(out)
        else:
            self._close_events(out)

    def _close_events(self, events: list[Any]) -> None:
        for ev in events:
            try:
                self.driver.close_event(ev)
            except Exception:
                pass

    def _warn_limbo(self) -> None:
        if self.limbo_bytes > self.settings.warn_bytes and not self._warned:
            self._warned = True
            warnings.warn(
                f"cupy_poolmem: {self.limbo_bytes:,} bytes freed here are still held for "
                "other processes (limbo); receivers keep arrays alive too long?",
                ResourceWarning,
                stacklevel=3,
            )

    def _settle(self, rec: Record) -> None:
        """Free a limbo block nothing holds, recycle one whose receivers are all idle,
        or ask the receivers keeping it to say ``Idle`` (recycling) or to evict."""
        release = ask = host = None
        with self.lock:
            if not rec.in_limbo or rec.tickets or rec.local:
                return
            if rec.life and not rec.retiring:
                busy = [c for c in rec.leases if rec.busy(c)]
                if busy:  # ask them to say Idle (they keep their mappings)
                    release = [self.peers.get(c) for c in busy if rec.released.get(c, 0) < rec.life]
                    for c in busy:
                        rec.released[c] = rec.life
                elif self._recycle(rec, rec.stream, True):
                    return
                else:
                    rec.retiring = True  # the cache refused it: to its final free
            if release is not None:
                pass
            elif rec.leases:
                ask = [self.peers.get(c) for c in rec.leases if c not in rec.asked]
                rec.asked.update(rec.leases)
            else:
                self.records.pop(rec.export_id, None)
                host = self._wait_unmaps(rec, rec.stream_ptr, host=rec.orphan)
                if not rec.orphan:
                    self._out_of_limbo(rec)
                else:  # still counted until the retirer has it; settled by this call only
                    rec.in_limbo = False
        if host is not None:  # its final free: after the receivers' work, lock let go
            self._sync_host(rec, host)
            if rec.orphan:  # to the retirer while still counted: the pool waits for it
                with self.lock:
                    rec.core._orphan(rec.ptr, rec.size, 0)
                    self._out_of_limbo(rec)
        if release is not None:
            for peer in release:
                if peer is not None:
                    peer.sender.post(_wire.Release(rec.export_id, rec.life))
            return
        if ask is None:
            self._free(rec)
            return
        for peer in ask:
            if peer is not None:
                peer.sender.post(_wire.Evict(rec.export_id))

    def _free(self, rec: Record) -> None:
        core = rec.core
        if not rec.orphan:  # (an orphan went to the pool's retirer in _settle)
            with self.driver.on_device(self._dev(rec)):
                hook = core.release_hook  # pinned pools hold blocks until their stream is done
                if hook is None or not hook(rec.ptr, rec.size, rec.stream):
                    core._free_now(rec.ptr, rec.stream_ptr, rec.stream)
        if core.closed and core.n_allocs == core.n_frees and not core._held_for_sharing:
            core._drained()

    def _wait(self, stream_ptr: int, ev: Any) -> None:
        try:
            self.driver.wait_event(stream_ptr, ev)
        except Exception:  # the unmapping process died: its work died with it
            pass

    def _dev(self, rec: Record) -> int:
        """The device of a block's stream (a host pool's block: its stream's device)."""
        if rec.dev >= 0:
            return rec.dev
        dev = getattr(rec.stream, "device_id", -1)
        return dev if dev >= 0 else self.driver.current_device()

    # -- round trips (an array back in its exporter) ---------------------------------------
    def take_local(
        self, export_id: int, ticket: bytes, life: int | None = None, size: int | None = None
    ) -> LocalHold:
        """A message came back to this process: hold the block for the new array.

        ``life`` and ``size``: the message's (its descriptor's), checked against the
        block's before its ticket counts.
        """
        with self.lock:
            rec = self.records.get(export_id)
            if rec is not None and (
                (size is not None and size != rec.size)
                or (life is not None and (rec.core is None or life != rec.life))
            ):
                raise SharingError(
                    f"an array came back to the process that shared it naming {size} bytes "
                    f"in life {life} of a block of {rec.size} bytes in life {rec.life}: its "
                    "memory was freed or reused since (a stale or forged message)"
                )
            if rec is None or not self._claim_ticket(rec, ticket):
                raise SharingError(
                    "an array came back to the process that shared it after its memory was "
                    "freed (the message was older than sharing.inflight_timeout, or was "
                    "received already and every holder let go)"
                )
            rec.local += 1
        return LocalHold(self, rec)

    def hold_live(self, export_id: int, export_data: bytes, life: int) -> LocalHold | None:
        """Hold block ``export_id`` for a new local array while this process still
        uses it (its block object is alive) in life ``life``, whatever became of the
        message tickets; None when the block is gone, in limbo, or recycled since (its
        memory holds another array's data now).

        For a receiver that gave its message back (``Drop``) and asks the sender for
        the data by another route: the sender's own arrays keep the block, so no
        ticket is needed to read it here.
        """
        with self.lock:
            rec = self.records.get(export_id)
            if rec is None or rec.data != export_data or rec.in_limbo:
                return None
            if rec.core is None or rec.life != life:  # dormant, or another life's block
                return None
            if rec.block_ref() is None:
                return None
            rec.local += 1
        return LocalHold(self, rec)

    def let_go_local(self, rec: Record) -> None:
        if self.abandoned:
            return
        with self.lock:
            rec.local -= 1
        self._settle(rec)

    def _claim_ticket(self, rec: Record, ticket: bytes) -> bool:
        """Mark ``ticket`` received (lock held); False if it is not one of ``rec``'s."""
        if rec.tickets.pop(ticket, None) is not None:
            rec.claimed[ticket] = None
            if len(rec.claimed) > _CLAIMED_MAX:
                rec.claimed.popitem(last=False)
            return True
        if ticket in rec.claimed:
            rec.claimed.move_to_end(ticket)
            return True
        return False

    # -- the server ----------------------------------------------------------------------
    def _serve(self, conn: Conn) -> None:
        """One receiver's connection (its own thread): handle frames until it closes."""
        with self.lock:
            self._cids += 1
            peer = self.peers[self._cids] = Peer(self._cids, conn)
        try:
            while True:
                data = conn.recv()
                try:
                    frames = _wire.decode(data)
                    for f in frames:
                        if not isinstance(f, _FROM_RECEIVERS):
                            raise _wire.ProtocolError(f"{type(f).__name__} is not a receiver's")
                except _wire.ProtocolError as exc:
                    _warn_kept("a malformed frame from a receiver", exc)
                    continue
                for f in frames:
                    try:
                        self._handle(peer, f)
                    except Exception as exc:  # keep serving: leaking beats freeing early
                        _warn_kept(f"sharing message {type(f).__name__}", exc)
        except (EOFError, OSError):
            pass
        finally:
            with self.lock:
                peer.mapping = 0  # it can no longer say so
            conn.close()
            peer.sender.close()
            threading.Thread(
                target=self._reap, args=(peer,), name="cupy_poolmem-reap", daemon=True
            ).start()

    def _reap(self, peer: Peer) -> None:
        """A receiver's connection closed: once its process (and GPU context) is gone,
        give back its leases (P4)."""
        if peer.conn.peer.pid <= 0:
            self._strand(peer)
            return
        peer.conn.peer.wait_gone()
        log.info("sharing: receiver pid %s is gone; its leases are released", peer.conn.peer.pid)
        peer.conn.peer.close()
        with self.lock:
            self.peers.pop(peer.cid, None)
            held = []
            for rec in list(self.records.values()):
                if rec.leases.pop(peer.cid, None):
                    held.append(rec)
                rec.asked.discard(peer.cid)
                rec.idle.pop(peer.cid, None)
                rec.released.pop(peer.cid, None)
                for key in [k for k in rec.events if k[0] == peer.cid]:
                    del rec.events[key]  # its work is gone with its context
            events, peer.events = list(peer.events.values()), {}
            # Under the lock, and only when no host wait is under way (it may be waiting
            # on one of these): then by the last of those waits.
            if self._syncing:
                self._close_later.extend(events)
            else:
                self._close_events(events)
        for rec in held:
            self._settle(rec)

    def _strand(self, peer: Peer) -> None:
        """A receiver whose process this one cannot see (another pid namespace: the
        kernel said pid 0) closed its connection: nothing tells when its process, and
        the work it queued on its mappings, is gone.  Its leases (and the events its
        blocks' frees wait on) stay until this process exits: memory held, never freed
        under it."""
        with self.lock:
            self.peers.pop(peer.cid, None)
            held = sum(rec.leases.get(peer.cid, 0) for rec in self.records.values())
            self.stranded += held
        if held:
            warnings.warn(
                f"cupy_poolmem: a receiver in another pid namespace closed its sharing "
                f"connection holding {held} mapping(s); the blocks stay held until this "
                "process exits (its exit cannot be seen from here)",
                ResourceWarning,
                stacklevel=2,
            )

    def _handle(self, peer: Peer, f: Any) -> None:
        cid = peer.cid
        if isinstance(f, _wire.Claim):
            self._on_claim(peer, f)
            return
        if isinstance(f, _wire.Mapped):
            with self.lock:
                peer.mapping = max(peer.mapping - 1, 0)
                rec = self.records.get(f.export_id)
                if rec is not None:
                    # A Release sent between the grant and now reached a receiver that
                    # did not know the mapping yet (ignored): it is asked again.
                    rec.released.pop(cid, None)
            # A claim may have taken a limbo block's last ticket: ask its holders now
            # that the receiver knows the mapping (an Evict before it would be lost).
            if rec is not None:
                self._settle(rec)
            return
        if isinstance(f, _wire.Register):
            with self.lock:
                rec = self.records.get(f.export_id)
                # Only a receiver whose arrays may use the block (in this life) forwards it.
                ok = rec is not None and rec.leases.get(cid, 0) > 0 and rec.busy(cid)
                if ok:
                    assert rec is not None
                    if f.ticket in rec.tickets or f.ticket in rec.claimed:
                        ok = False  # a duplicate registration is refused
                    else:
                        rec.tickets[f.ticket] = time.monotonic()
                        self._start_janitor()
            peer.conn.send(
                _wire.encode(_wire.Reply(f.seq, _wire.OK if ok else _wire.NOT_HELD, False))
            )
            return
        with self.lock:
            rec = self.records.get(f.export_id)
            if rec is None:
                return
            if isinstance(f, _wire.Hit):
                # An acknowledgement only: a ticket of this life is received.  A dead
                # ticket, or another life's, is ignored (it keeps nothing alive) and
                # counted; the receiver refused such messages itself (I1).
                if f.life != rec.life or not self._claim_ticket(rec, f.ticket):
                    self.ignored_hits += 1
            elif isinstance(f, _wire.Drop):
                rec.tickets.pop(f.ticket, None)
            elif isinstance(f, _wire.Unmap):
                n = rec.leases.get(cid, 0) - 1
                if n < 0:
                    return  # not a lease of this peer: ignored
                if f.event is not None:  # opened first: if that fails the lease stays
                    ev = peer.events.get(f.event)
                    if ev is None:
                        with self.driver.on_device(self._dev(rec)):
                            ev = peer.events[f.event] = self.driver.open_event(f.event)
                        self._retire_events(peer)
                    rec.events[(cid, f.event)] = ev
                if n > 0:
                    rec.leases[cid] = n
                else:
                    rec.leases.pop(cid, None)
                    rec.idle.pop(cid, None)
                    rec.released.pop(cid, None)
                rec.asked.discard(cid)
            elif isinstance(f, _wire.Idle):
                if rec.leases.get(cid, 0) <= 0:
                    return  # not a lease of this peer: ignored
                ev = peer.events.get(f.event)  # opened first: if that fails it stays busy
                if ev is None:
                    with self.driver.on_device(self._dev(rec)):
                        ev = peer.events[f.event] = self.driver.open_event(f.event)
                    self._retire_events(peer)
                rec.events[(cid, f.event)] = ev
                # Never beyond the block's current life: a later life starts busy.
                life = min(f.life, rec.life)
                if life > rec.idle.get(cid, 0):
                    rec.idle[cid] = life
        self._settle(rec)

    def _on_claim(self, peer: Peer, f: _wire.Claim) -> None:
        """A receiver wants to map a block: grant a lease for a live ticket, else refuse."""
        fd = None
        with self.lock:
            rec = self.records.get(f.export_id)
            # The message's life and span are the block's (checked before its ticket is
            # spent): nothing outside the block, nor another life of it, is granted.
            # The allocation the receiver will map is this block's (its pool and export
            # data): a live ticket of one block never maps another.
            other = rec is not None and f.block != rec.ident
            outside = rec is not None and (f.size != rec.size or f.end > rec.size)
            ok = (
                rec is not None
                and not other
                and not outside
                and rec.core is not None
                and f.life == rec.life
                and self._claim_ticket(rec, f.ticket)
            )
            if ok:
                assert rec is not None
                if not f.held or rec.leases.get(peer.cid, 0) <= 0:
                    rec.leases[peer.cid] = rec.leases.get(peer.cid, 0) + 1
                # The receiver will use the block: busy until its next Idle.
                rec.idle.pop(peer.cid, None)
                rec.released.pop(peer.cid, None)
                peer.mapping += 1  # the exit waits until the receiver has mapped it
                if f.want_fd:  # the pool travels only to a peer with a live ticket for it
                    fd = int(rec.pool_mr.allocation_handle)
        status = (
            _wire.OK
            if ok
            else _wire.OTHER_BLOCK
            if other
            else _wire.OUT_OF_SPAN
            if outside
            else _wire.REFUSED
        )
        reply = _wire.Reply(f.seq, status, fd is not None)
        peer.conn.send(_wire.encode(reply), fd)

    # -- tickets nobody claims -------------------------------------------------------------
    def _start_janitor(self) -> None:
        """Expire unclaimed tickets after ``inflight_timeout`` (lock held)."""
        if self._janitor is None and self.settings.inflight_timeout is not None:
            self._janitor = threading.Thread(
                target=self._sweep_forever, name="cupy_poolmem-tickets", daemon=True
            )
            self._janitor.start()

    def _sweep_forever(self) -> None:
        while not self.closed:
            timeout = self.settings.inflight_timeout
            self._wake.wait(0.5 if timeout is None else min(max(timeout / 4, 0.01), 1.0))
            self._wake.clear()
            try:
                self.expire()
            except Exception as exc:  # keep sweeping: later tickets must still expire
                _warn_kept("freeing a block whose message expired", exc)

    def expire(self, now: float | None = None) -> int:
        """Give back tickets older than ``inflight_timeout``; return how many."""
        timeout = self.settings.inflight_timeout
        if timeout is None:
            return 0
        now = time.monotonic() if now is None else now
        with self.lock:
            # Snapshots: a finalizer a garbage collection runs in this thread mid-scan
            # (a block or round-tripped array let go) may change these dicts.
            stale = [
                (rec, t)
                for rec in list(self.records.values())
                for t, born in list(rec.tickets.items())
                if now - born > timeout
            ]
        for rec, t in stale:
            self.drop_ticket(rec, t)
        return len(stale)

    # -- collection, statistics, exit --------------------------------------------------------
    def collect(self) -> int:
        """Expire stale tickets and free limbo blocks nothing holds; bytes freed."""
        self.expire()
        with self.lock:
            recs = [r for r in self.records.values() if r.in_limbo]
        freed = 0
        for rec in recs:
            self._settle(rec)
            if not rec.in_limbo:
                freed += rec.size
        return freed

    def unclaimed(self) -> int:
        """Messages not received yet: unclaimed tickets, and granted claims whose
        receiver has not mapped the block yet."""
        with self.lock:
            return sum(len(r.tickets) for r in self.records.values()) + sum(
                p.mapping for p in self.peers.values()
            )

    def stats(self) -> dict[str, int]:
        with self.lock:
            recs = list(self.records.values())
            return {
                "exported_blocks": len(recs),
                "limbo_blocks": sum(1 for r in recs if r.in_limbo),
                "limbo_bytes": self.limbo_bytes,
                "tickets_out": sum(len(r.tickets) for r in recs),
                "leases": sum(sum(r.leases.values()) for r in recs),
                "peers": len(self.peers),
                "recycled_blocks": self.recycled,
                "ignored_hits": self.ignored_hits,
                "dropped_frames_out": sum(p.sender.dropped for p in self.peers.values()),
            }

    def at_exit(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until every message sent was received and mapped;
        then make sure the work the messages' events cover is done.  True if none was
        left."""
        deadline = time.monotonic() + timeout
        while self.unclaimed() and time.monotonic() < deadline:
            time.sleep(0.005)
        done = not self.unclaimed()
        with self.lock:
            peers = list(self.peers.values())
        flush_until = max(deadline, time.monotonic() + 0.1)  # for all peers together
        for p in peers:
            p.sender.flush(max(flush_until - time.monotonic(), 0.0))
        if self.records:
            try:
                self.driver.sync_own_events()
            except Exception:
                pass
        self.closed = True
        self._wake.set()
        return done

    def close(self) -> None:
        """Stop listening (after fork in a child, and in tests)."""
        self.closed = True
        self._wake.set()
        if self._listener is not None:
            self._listener.close()


_FROM_RECEIVERS = (
    _wire.Claim,
    _wire.Hit,
    _wire.Drop,
    _wire.Unmap,
    _wire.Register,
    _wire.Mapped,
    _wire.Idle,
)


def _warn_kept(what: str, exc: BaseException) -> None:
    """A protocol step failed in a background thread: say so; what it held stays held."""
    warnings.warn(
        f"cupy_poolmem: {what} failed ({type(exc).__name__}: {exc}); the block stays held "
        "until the process holding it exits",
        RuntimeWarning,
        stacklevel=3,
    )
