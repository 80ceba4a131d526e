"""The exporter's server: one thread per receiver connection handling its frames
(claims, hits, drops, unmaps, idles, forwards), and the reaping of gone receivers."""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import _wire
from ._records import Peer, Record
from ._transport import Conn
from ._warn import warn_kept

if TYPE_CHECKING:
    from ._settings import SharingSettings

# The exporter's logger (docs/observability.rst names it for these messages).
log = logging.getLogger("cupy_poolmem._sharing._exporter")

__all__ = ["Server"]


class Server:
    """The :class:`Exporter`'s methods that serve receivers (mixed into it); the
    attributes they use are the exporter's, made by its constructor."""

    driver: Any
    settings: SharingSettings
    lock: threading.RLock
    records: dict[int, Record]
    peers: dict[int, Peer]
    stranded: int
    ignored_hits: int
    steps: Any  # StepExports (mapped and expandable blocks' steps), or None
    claim_hook: Callable[[int], None] | None
    _cids: int
    _syncing: int
    _close_later: list[Any]
    _close_events: Callable[[list[Any]], None]
    _settle: Callable[[Record], None]
    _start_janitor: Callable[[], None]
    _claim_ticket: Callable[[Record, bytes], bool]
    _dev: Callable[[Record], int]
    _retire_events: Callable[[Peer], None]

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
                    warn_kept("a malformed frame from a receiver", exc)
                    continue
                for f in frames:
                    try:
                        self._handle(peer, f)
                    except Exception as exc:  # keep serving: leaking beats freeing early
                        warn_kept(f"sharing message {type(f).__name__}", exc)
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
        if self.steps is not None:  # the steps it mapped went with its process
            self.steps.drop_peer(peer.cid)
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
        if isinstance(f, (_wire.Claim, _wire.StepClaim)):
            hook = self.claim_hook
            if hook is not None:
                hook(cid)
            if isinstance(f, _wire.StepClaim):
                self._on_step_claim(peer, f)
            else:
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
                if rec.placement is not None and self.steps is not None:
                    self.steps.unmapped(cid, rec.placement, [st[0] for st in rec.steps])
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
            if rec is not None and rec.placement is not None and (not f.held or f.want_fd):
                # a step block is mapped through a StepClaim only, and has no CUDA pool
                # whose descriptor could go out: refused
                rec = None
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
                    if rec.placement is not None and self.steps is not None:  # (held)
                        self.steps.mapped(peer.cid, rec.placement, [s[0] for s in rec.steps])
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

    def _on_step_claim(self, peer: Peer, f: _wire.StepClaim) -> None:
        """A receiver wants to map a block of a mapped or expandable pool: as
        :meth:`_on_claim`, and the grant names the block's steps, checked against the
        steps mapped now, with a descriptor for each the receiver does not hold.

        The placement is asked (the steps now, the export) outside ``self.lock``: its
        lock may be held by a thread whose collection frees a shared block, which waits
        for ``self.lock``.
        """
        c = f.claim
        rec = self.records.get(c.export_id)
        now = None
        if rec is not None and rec.placement is not None:
            now = tuple(tuple(s) for s in rec.placement.steps_under(rec.ptr, rec.size))
        steps: tuple = ()
        fds: list[int] = []
        stale = failed = False
        with self.lock:
            if self.records.get(c.export_id) is not rec or (
                rec is not None and rec.placement is None
            ):
                rec = None  # gone meanwhile, or a CUDA pool's block (claimed with a Claim)
            other = rec is not None and c.block != rec.ident
            outside = rec is not None and (c.size != rec.size or c.end > rec.size)
            if rec is not None and not other and not outside and rec.core is not None:
                stale = now != rec.steps  # (before the ticket is spent)
            ok = (
                rec is not None
                and not other
                and not outside
                and not stale
                and rec.core is not None
                and c.life == rec.life
                and self._claim_ticket(rec, c.ticket)
            )
            if ok:  # the lease first: the block stays while its steps are exported
                assert rec is not None
                rec.leases[peer.cid] = rec.leases.get(peer.cid, 0) + 1
                rec.idle.pop(peer.cid, None)
                rec.released.pop(peer.cid, None)
                peer.mapping += 1  # the exit waits until the receiver has mapped it
        if ok:
            assert rec is not None
            try:
                # (the retain and export; relaxed: a capture in another thread stays valid)
                with self.driver.on_device(self._dev(rec)), self.driver.relaxed():
                    grants = self.steps.grant(
                        peer.cid, rec.placement, rec.ptr, rec.size, rec.steps, f.have
                    )
            except Exception as exc:  # the driver's export failed: nothing granted
                warn_kept("exporting the steps of a shared block", exc)
                ok, failed, grants = False, True, []
                with self.lock:  # the lease back (the ticket was spent: settled below)
                    n = rec.leases.get(peer.cid, 0) - 1
                    if n > 0:
                        rec.leases[peer.cid] = n
                    else:
                        rec.leases.pop(peer.cid, None)
                    peer.mapping = max(peer.mapping - 1, 0)
            steps = tuple((g.step.id, g.step.va, g.step.size, g.fd is not None) for g in grants)
            fds = [g.fd for g in grants if g.fd is not None]
        status = (
            _wire.OK
            if ok
            else _wire.OTHER_BLOCK
            if other
            else _wire.OUT_OF_SPAN
            if outside
            else _wire.STALE_STEPS
            if stale
            else _wire.NOT_EXPORTED
            if failed
            else _wire.REFUSED
        )
        try:
            peer.conn.send(_wire.encode(_wire.StepReply(c.seq, status, steps)), fds=fds)
        finally:
            for fd in fds:
                os.close(fd)
        if rec is not None and not ok and not stale and not other and not outside:
            self._settle(rec)


_FROM_RECEIVERS = (
    _wire.Claim,
    _wire.StepClaim,
    _wire.Hit,
    _wire.Drop,
    _wire.Unmap,
    _wire.Register,
    _wire.Mapped,
    _wire.Idle,
)
