"""The exporter: tickets, leases and limbo of this process's shared blocks, and its server.

One :class:`Exporter` per process (owned by the sharing context).  Its state is the
table of :class:`Record` s (one per exported block) and the connected receivers
(:class:`Peer`); every change to either happens under ``Exporter.lock``, and nothing
is sent while that lock is held (frames go through each peer's :class:`Sender`, or
are replies written by the peer's own server thread).  The records are in
``_records``, the server's frame handling in ``_server``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from .._errors import SharingError
from . import _wire
from ._records import LocalHold, Peer, Record
from ._server import Server
from ._settings import SharingSettings
from ._steps import StepExports
from ._transport import Listener
from ._warn import warn_kept

log = logging.getLogger(__name__)

__all__ = ["Exporter", "Record", "LocalHold"]


class Exporter(Server):
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
    claimed_max
        Claimed tickets a record remembers (another copy of a message may claim
        again): the most recent ones only, so a block sent a million times stays small.
    steps
        The :class:`~cupy_poolmem._sharing._steps.StepExports` of mapped and
        expandable blocks (which receivers map which steps), or None.

    Attributes
    ----------
    claim_hook
        None, or ``cid -> None`` run in the server thread before each claim of the
        receiver connection ``cid`` is answered (tests delay or count claims with it).
    """

    def __init__(
        self,
        driver: Any,
        settings: SharingSettings,
        authkey: bytes,
        ticket_source: Callable[[int], bytes] = os.urandom,
        listener_options: dict[str, Any] | None = None,
        claimed_max: int = 4096,
        steps: Any = None,
    ) -> None:
        self.driver = driver
        self.steps = steps
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
        self.claimed_max = claimed_max
        self._close_later: list[Any] = []  # events _reap closes once those are done
        self.ignored_hits = 0  # Hits of a dead ticket or another life (acknowledge nothing)
        self.claim_hook: Callable[[int], None] | None = None
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
        # A mapped or expandable block's steps are asked before the lock is taken: the
        # placement's lock may be held by a thread whose collection frees a shared block
        # (and so waits for this lock).
        placement = steps = None
        if block.share is None:
            placement = self._placement_of(block)
            if placement is not None:
                steps = placement.steps_under(block.ptr, block.size)
        with self.lock:
            rec = block.share
            if rec is None:
                dev = block.core.device_id
                self._ids += 1
                if placement is None:
                    rec = Record(
                        self,
                        self._ids,
                        block,
                        self.driver.export_pointer(block.ptr),
                        dev,
                        self.driver.device_uuid(dev) if dev >= 0 else "",
                        block.core._ipc_pool_of(block.ptr),
                    )
                else:
                    rec = self._step_record(block, placement, steps or [], dev)
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

    def _placement_of(self, block: Any) -> Any:
        """The mapped or expandable placement holding ``block`` (its memory travels as
        steps), or None for a CUDA pool's block."""
        of = getattr(block.core, "_steps_of", None)
        return of(block.ptr) if of is not None else None

    def _step_record(self, block: Any, placement: Any, under: list, dev: int) -> Record:
        """The record of a block of ``placement`` (lock held) on the steps ``under`` it,
        the placement asking the book before it unmaps one of them."""
        book = self.steps
        if book is None:
            book = self.steps = StepExports(self.driver.vmm(), self.lock)  # one lock
        steps = tuple(tuple(s) for s in under)
        if not steps:
            raise SharingError(
                f"the block at {block.ptr:#x} ({block.size} bytes) lies on no mapped step "
                "of its pool; it cannot be sent"
            )
        book.watch(placement)
        data = _wire.step_export_data(block.ptr, block.size, steps)
        uuid = book.uuid_of(placement)
        return Record(
            self,
            self._ids,
            block,
            data,
            dev,
            self.driver.device_uuid(dev) if dev >= 0 else "",
            (uuid, None),
            placement,
            steps,
        )

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
            if len(rec.claimed) > self.claimed_max:
                rec.claimed.popitem(last=False)
            return True
        if ticket in rec.claimed:
            rec.claimed.move_to_end(ticket)
            return True
        return False

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
                warn_kept("freeing a block whose message expired", exc)

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
