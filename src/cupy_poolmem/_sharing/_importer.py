"""The importer: connections to exporters, and receiving their messages into mappings.

One :class:`Importer` per process (owned by the sharing context).  It keeps the only
table of mappings and the only cache of imported pools in the process: the CuPy
reducers and the Numba plugin both map through it, so one driver allocation is
imported once however it arrives (P8).  State changes happen under
``Importer.lock``; the lock is never held while waiting for an exporter's reply.
Letting go of mappings is in ``_unmapping``, the connection in ``_client``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

from .._errors import SharingError
from . import _wire
from ._client import Client
from ._mapping import GONE, LEGACY_STREAM, Imported, ImportedPool, Mapping
from ._settings import SharingSettings
from ._steps import StaleStepsError, Step, StepGrant, StepMappings
from ._transport import connect
from ._unmapping import Unmapping

__all__ = ["Importer", "Mapping", "Imported", "Client"]

_T = TypeVar("_T")


_STALE = (
    "this message is stale: the process that shared the array no longer holds its memory "
    "for it (it was received already and every holder let go, or it waited longer than "
    "cupy_poolmem.sharing.inflight_timeout); nothing was mapped"
)


def _span_error(d: _wire.Descriptor, size: int) -> str:
    return (
        f"a message names a block of {d.size} bytes (an array of shape {d.shape}, strides "
        f"{d.strides} at offset {d.offset}) where its exporter's block has {size}; it was "
        "not mapped (a forged or corrupted message)"
    )


def _raw_span_error(view: tuple[int, int], size: int) -> str:
    return (
        f"a Numba IPC handle names {view[1]} bytes at offset {view[0]} of an allocation "
        f"of {size} bytes; it was not mapped (a forged or corrupted handle)"
    )


def _hit_life(m: Mapping) -> int:
    """The one life whose messages ``m`` serves without a claim (I1): the life its
    arrays came from while it is in use there; once we said Idle at ``fence`` (at or
    after that), the next life only: the exporter recycles the block at most once
    more before asking us again.  A block that is never recycled has life 0 only."""
    if not m.life:
        return 0
    return m.fence + 1 if m.fence >= m.life else m.life


def _refused(reply: _wire.Reply, d: _wire.Descriptor) -> None:
    """Raise for a claim the exporter refused."""
    if reply.status == _wire.OTHER_BLOCK:
        raise _wire.ProtocolError(
            f"the exporter refused a message whose pool and allocation (pool "
            f"{d.pool_uuid}) are not those of the block it names (export {d.export_id}); "
            "nothing was mapped (a forged or corrupted message)"
        )
    if reply.status == _wire.OUT_OF_SPAN:
        raise _wire.ProtocolError(
            f"the exporter refused a message naming {d.size} bytes up to byte "
            f"{_wire.span(d)[1]} of a block that is not that large; nothing was mapped "
            "(a forged or corrupted message)"
        )
    raise SharingError(_STALE)


def _span_end(d: _wire.Descriptor, m: Mapping | None) -> int:
    """The end of the bytes ``d`` names, for its claim; :class:`ProtocolError` when they
    are outside its block (``d.size``) or outside ``m``, a mapping made already."""
    lo, end = _wire.span(d)
    if lo < 0 or end > d.size or (m is not None and d.size != m.size):
        raise _wire.ProtocolError(_span_error(d, m.size if m is not None else d.size))
    return end


class Importer(Unmapping):
    """Mappings of other processes' blocks in this process, and the connections to them.

    ``seen_max``: exports remembered as received once (their next message is kept
    mapped); ``closing_max``: frees of unmapped blocks a re-import waits for (an older
    one is synchronised when it falls out); ``frees_max``: free events kept per
    imported pool before the done ones are let go.
    """

    def __init__(
        self,
        driver: Any,
        settings: SharingSettings,
        authkey: bytes,
        seen_max: int = 4096,
        closing_max: int = 1024,
        frees_max: int = 8,
    ) -> None:
        self.driver, self.settings, self.authkey = driver, settings, authkey
        self.seen_max, self.closing_max, self.frees_max = seen_max, closing_max, frees_max
        self.lock = threading.RLock()
        self.clients: dict[str, Client] = {}
        self.pools: dict[str, ImportedPool] = {}
        self.maps: dict[tuple[str, bytes], Mapping] = {}
        self.idle: OrderedDict[tuple[str, bytes], Mapping] = OrderedDict()
        self.seen: OrderedDict[tuple[str, int], None] = OrderedDict()
        self.closing: OrderedDict[tuple[str, bytes], Any] = OrderedDict()
        self._pending: dict[tuple[str, bytes], threading.Event] = {}
        self._deferred: list[tuple[Mapping, Any]] = []
        self._deferred_thread: threading.Thread | None = None
        self._step_maps: dict[int, StepMappings] = {}  # GPU -> mappings of others' steps
        self._step_pools: dict[tuple[str, int], ImportedPool] = {}  # their placements
        self._step_unmaps: list[tuple[Mapping, Any]] = []  # unmaps waiting for last uses
        self._closing_pools: list[ImportedPool] = []  # gone exporters' pools, frees pending
        self._kept_pools: list[ImportedPool] = []  # their close failed: never destroyed
        self._connecting: set[str] = set()  # addresses a thread is connecting to
        self._importing: set[str] = set()  # pools a thread is importing
        self._changed = threading.Condition(self.lock)  # either set shrank
        self.abandoned = False  # in a fork child: the parent's mappings are left alone
        # Events opened per exporter (one per stream it sends from), oldest closed first.
        self.events_max = 64

    # -- connections -------------------------------------------------------------------------
    def client(self, address: str) -> Client:
        """The connection to the exporter at ``address``, made on first use.

        Connecting (up to the handshake's timeout with an unresponsive exporter) is
        done outside ``self.lock``: unmaps and evictions of other exporters' blocks
        go on meanwhile; other threads asking for the same address wait for it.
        """
        c = self.clients.get(address)
        if c is None:
            with self.lock:
                c = self._entry_or_turn(self.clients, self._connecting, address)
            if c is None:
                try:
                    try:
                        conn = connect(address, self.authkey)
                    except Exception as exc:  # gone, refused, or not of this family
                        raise SharingError(f"{GONE} ({type(exc).__name__}: {exc})") from None
                    c = Client(self, address, conn)
                finally:
                    self._turn_done(self.clients, self._connecting, address, c)
                if c.closed:  # it closed before it was listed: forget it now
                    self._tidy(c)
        if c.closed:
            raise SharingError(GONE)
        return c

    def _entry_or_turn(self, table: dict[str, Any], busy: set[str], key: str) -> Any:
        """``table[key]``, or None once it is this thread's turn to make it (lock held).

        While another thread makes the entry (``key`` in ``busy``), wait for it; when
        none does, mark ``key`` busy for this thread, which ends its turn with
        :meth:`_turn_done`.
        """
        while True:
            entry = table.get(key)
            if entry is not None:
                return entry
            if key not in busy:
                busy.add(key)
                return None
            self._changed.wait(1.0)

    def _turn_done(self, table: dict[str, Any], busy: set[str], key: str, entry: Any) -> None:
        """End this thread's turn at ``key``: list ``entry`` (if made) and wake waiters."""
        with self.lock:
            busy.discard(key)
            if entry is not None:
                table[key] = entry
            self._changed.notify_all()

    def _mapping_or_turn(
        self, key: tuple[str, bytes], take: Callable[[Mapping | None], _T | None]
    ) -> tuple[_T | None, Mapping | None, Any]:
        """What ``take`` makes of the mapping of ``key``, or this thread's turn to map it.

        ``take(self.maps.get(key))`` runs with the lock held.  While it gives None and
        another thread maps ``key`` (a claim or a Numba handle under way), wait for that
        thread (up to ``claim_timeout`` between looks), then look again.  Returns
        ``(taken, m, None)``, or ``(None, m, closing)`` once it is this thread's turn:
        ``m`` the mapping ``take`` turned down (or None), ``closing`` the free of an
        earlier mapping of ``key``, to synchronise before mapping it anew (one import at
        a time).  The turn ends with :meth:`_mapping_turn_done`.

        Not :meth:`_entry_or_turn`: a mapping's turn is an event of its own key, and
        carries the previous mapping's free.
        """
        while True:
            with self.lock:
                m = self.maps.get(key)
                taken = take(m)
                if taken is not None:
                    return taken, m, None
                wait = self._pending.get(key)
                if wait is None:
                    self._pending[key] = threading.Event()
                    return None, m, self.closing.pop(key, None)
            wait.wait(self.settings.claim_timeout)

    def _mapping_turn_done(self, key: tuple[str, bytes]) -> None:
        """End this thread's turn at ``key`` (mapped or not) and wake its waiters."""
        with self.lock:
            self._pending.pop(key).set()

    # -- receiving -----------------------------------------------------------------------------
    def give_back(self, d: _wire.Descriptor) -> None:
        """This process cannot take message ``d`` (no GPU, ...): return its ticket now."""
        try:
            self.client(d.address).sender.post(_wire.Drop(d.export_id, d.ticket))
        except Exception:
            pass  # the exporter is gone: nothing to return

    def receive(
        self, d: _wire.Descriptor, dev: int, stream: Any, host_order: bool = False
    ) -> Imported:
        """Map the block ``d`` describes (``dev`` current) and order ``stream`` after the
        sender's writes; the owner the received array keeps."""
        if self._deferred:
            self.drain_deferred()
        hit = self._hit(d, stream, host_order)
        if hit is not None:
            return hit
        c = self.client(d.address)
        with self.lock:  # its events stay open while this receive uses them
            if c.closed:
                raise SharingError(GONE)
            c.busy += 1
        told = False  # the exporter has heard of this ticket from us
        try:
            if d.event is not None:
                ev = c.events.get(d.event)
                if ev is None:
                    with self.lock:
                        ev = c.events.get(d.event)
                        if ev is None:
                            ev = c.events[d.event] = self.driver.open_event(d.event)
                            if len(c.events) > self.events_max:
                                self._retire_events(c)
                if host_order or self.settings.receive_order == "sync":
                    self.driver.sync_event(ev)
                else:
                    self.driver.wait_event(stream.ptr, ev)
            key = (d.pool_uuid, d.export_data)

            def leased(m: Mapping | None) -> Imported | Mapping | None:
                """(lock held) For a block mapped under a lease: the hit, or the mapping
                to claim again; None when it is not."""
                nonlocal told
                if m is None or not m.leased:
                    return None
                if m.client is not c or m.export_id != d.export_id:
                    raise _wire.ProtocolError(
                        "a message names memory this process maps for another export"
                    )
                if d.size != m.size:
                    raise _wire.ProtocolError(_span_error(d, m.size))
                if d.pool_kind != m.pool.kind:
                    raise _wire.ProtocolError(
                        f"a message names pool kind {d.pool_kind} for memory this process "
                        f"maps from a pool of kind {m.pool.kind}; it was not mapped (a forged "
                        "or corrupted message)"
                    )
                # Count the user before anything allocates: a garbage collection here
                # may run dropped(), which must not unmap (or say Idle for) this mapping.
                m.users += 1
                self._wake(m)
                m.keep = True
                if d.life != _hit_life(m):
                    # Not the one life our mapping may serve without asking: we said
                    # Idle at it (it may be recycled since), or it is older than our
                    # arrays', or newer than the block can be: ask (no new lease).
                    if m.eager and d.life == m.life:
                        m.eager = False  # a block re-sent within one life
                    return m
                if d.life > m.life:
                    m.life = d.life
                told = True
                return Imported(self, m, stream)

            taken, m, closing = self._mapping_or_turn(key, leased)
            if isinstance(taken, Imported):
                # Nobody waits for it: the sender thread takes it within a few ms, with
                # the others posted meanwhile (the ticket pins the block until then).
                c.sender.post(_wire.Hit(d.export_id, d.ticket, d.life), lazy=True)
                return taken
            if isinstance(taken, Mapping):
                told = True
                return self._claim_held(c, d, taken, stream)
            try:
                told = True
                blk = _wire.step_block(d.export_data)
                if blk is not None:
                    m = self._claim_and_map_steps(c, d, dev, key, blk)
                else:
                    m = self._claim_and_map(c, d, dev, key, m, closing)
            finally:
                self._mapping_turn_done(key)
            return Imported(self, m, stream)
        except BaseException:
            if not told and not c.closed:
                c.sender.post(_wire.Drop(d.export_id, d.ticket))
            raise
        finally:
            self._leave(c)

    def _leave(self, c: Client) -> None:
        """A receive (or hit) that used ``c``'s events is done."""
        with self.lock:
            c.busy -= 1
            gone = c.closed and not c.busy
            late: list[Any] = []
            if c.retired and not c.busy:
                late, c.retired = c.retired, []
        for ev in late:
            with contextlib.suppress(Exception):
                self.driver.close_event(ev)
        if gone:  # the exporter went while this receive ran
            self._tidy(c)

    def _retire_events(self, c: Client) -> None:
        """Take ``c``'s oldest opened events out (lock held): closed as soon as no
        receive or hit of ``c`` is under way (one may be waiting on them now)."""
        extra = len(c.events) - self.events_max
        for handle in list(c.events)[:extra]:
            c.retired.append(c.events.pop(handle))

    def _hit(self, d: _wire.Descriptor, stream: Any, host_order: bool) -> Imported | None:
        """A block this process maps under a lease already, with the sender's event open
        here: take the message in one step (the common re-send), else None (full path).

        The new user keeps the mapping, so the client keeps its keys, and with them its
        events (see :meth:`_tidy`), while the event is waited on outside the lock.
        """
        key = (d.pool_uuid, d.export_data)
        with self.lock:
            m = self.maps.get(key)
            if m is None or not m.leased:
                return None
            c = m.client
            if (
                c is None
                or c.closed
                or c.address != d.address
                or m.export_id != d.export_id
                or d.size != m.size
                or d.pool_kind != m.pool.kind
            ):
                return None  # the full path tells these apart (gone, or a protocol error)
            if d.life != _hit_life(m):
                return None  # claimed on the full path (see receive)
            ev = None
            if d.event is not None:
                ev = c.events.get(d.event)
                if ev is None:
                    return None  # opened on the full path
            m.users += 1  # before anything allocates (see receive)
            self._wake(m)
            m.keep = True
            if d.life > m.life:
                m.life = d.life
            hit = Imported(self, m, stream)
            c.busy += 1  # its event stays open while it is waited on
        try:
            if ev is not None:
                if host_order or self.settings.receive_order == "sync":
                    self.driver.sync_event(ev)
                else:
                    self.driver.wait_event(stream.ptr, ev)
        except BaseException:
            c.sender.post(_wire.Drop(d.export_id, d.ticket))
            raise  # the user taken goes with ``hit``
        finally:
            self._leave(c)
        # Nobody waits for it: the sender thread takes it within a few ms, with the
        # others posted meanwhile (the ticket pins the block until then).
        c.sender.post(_wire.Hit(d.export_id, d.ticket, d.life), lazy=True)
        return hit

    def _claim_and_map(
        self,
        c: Client,
        d: _wire.Descriptor,
        dev: int,
        key: tuple[str, bytes],
        raw: Mapping | None,
        closing: Any,
    ) -> Mapping:
        """Claim the ticket (the exporter answers before anything is mapped), then map."""
        if closing is not None:  # the previous mapping's free must run before a re-import
            self.driver.sync_event(closing)
        want_fd = raw is None and d.pool_uuid not in self.pools
        # A block its exporter recycles (life > 0) is kept: it comes back to be sent again.
        keep = d.life > 0 or (d.address, d.export_id) in self.seen
        end = _span_end(d, None)  # (a Numba mapping's size is its handle's: not checked)
        reply, fd = c.request(
            lambda seq: _wire.claim_for(d, seq, want_fd, keep, False, end),
            self.settings.claim_timeout,
            give_back=(_wire.Mapped(d.export_id), _wire.Unmap(d.export_id, None)),
        )
        if reply.status != _wire.OK:
            if fd is not None:
                os.close(fd)
            _refused(reply, d)
        try:
            return self._map_granted(c, d, dev, key, raw, fd, keep)
        finally:  # mapped, or the lease given back: the exporter may exit now
            c.send_now(_wire.Mapped(d.export_id))

    # -- blocks of mapped and expandable pools ------------------------------------------------
    def step_maps(self, dev: int) -> StepMappings:
        """This process's mappings of other processes' steps on GPU ``dev``."""
        with self.lock:
            maps = self._step_maps.get(dev)
            if maps is None:
                maps = self._step_maps[dev] = StepMappings(
                    self.driver.vmm(), dev, self.driver.step_peers(dev)
                )
            return maps

    def _claim_and_map_steps(
        self,
        c: Client,
        d: _wire.Descriptor,
        dev: int,
        key: tuple[str, bytes],
        blk: tuple[int, int, int, bytes],
    ) -> Mapping:
        """Claim a block of a mapped or expandable pool naming the steps held here, then
        map its steps from the descriptors the reply carries."""
        maps = self.step_maps(dev)
        owner = d.pool_uuid
        keep = d.life > 0 or (d.address, d.export_id) in self.seen
        end = _span_end(d, None)
        have = maps.hold(owner)  # kept imported until the reply is handled
        try:
            reply, fds = c.request(
                lambda seq: _wire.StepClaim(_wire.claim_for(d, seq, False, keep, False, end), have),
                self.settings.claim_timeout,
                give_back=(_wire.Mapped(d.export_id), _wire.Unmap(d.export_id, None)),
            )
            fds = list(fds or [])
            if reply.status != _wire.OK:
                for fd in fds:
                    os.close(fd)
                if reply.status == _wire.STALE_STEPS:
                    raise StaleStepsError(
                        f"the steps under block {blk[0]:#x} ({blk[1]} bytes) are not those "
                        "the message names any more (its exporter's range shrank, or the "
                        "memory was mapped again since it was sent); nothing was mapped"
                    )
                if reply.status == _wire.NOT_EXPORTED:
                    raise SharingError(
                        f"the process that shared this array could not export the {blk[2]} "
                        "step(s) of memory under it (its RuntimeWarning names the driver's "
                        "error; out of file descriptors there? raise its limit, ulimit -n); "
                        "nothing was mapped"
                    )
                _refused(reply, d)
            try:
                return self._map_steps(c, d, dev, key, maps, blk, reply.steps, fds, keep)
            finally:  # mapped, or the lease given back: the exporter may exit now
                c.send_now(_wire.Mapped(d.export_id))
        finally:
            maps.let_go(owner, have)

    def _map_steps(
        self,
        c: Client,
        d: _wire.Descriptor,
        dev: int,
        key: tuple[str, bytes],
        maps: StepMappings,
        blk: tuple[int, int, int, bytes],
        steps: tuple[tuple[int, int, int, bool], ...],
        fds: list[int],
        keep: bool,
    ) -> Mapping:
        """Map the steps of a granted step claim (its lease given back if that fails)."""
        ptr, size = blk[0], blk[1]
        try:
            it = iter(fds)
            grants = [
                StepGrant(Step(i, va, n), next(it) if has else None) for i, va, n, has in steps
            ]
            if _wire.step_export_data(ptr, size, [g.step for g in grants]) != d.export_data:
                for g in grants:
                    if g.fd is not None:
                        os.close(g.fd)
                raise StaleStepsError(
                    f"the exporter granted steps {[s[0] for s in steps]} that are not the "
                    f"ones the message names under block {ptr:#x}; nothing was mapped"
                )
            with self.driver.on_device(dev):
                here, window = maps.map(d.pool_uuid, ptr, size, grants)
        except BaseException:
            c.sender.post(_wire.Unmap(d.export_id, None))  # give the lease back
            raise
        with self.lock:
            pool = self._step_pools.get((d.pool_uuid, dev))
            if pool is None:
                pool = self._step_pools[(d.pool_uuid, dev)] = ImportedPool(
                    d.pool_uuid, 0, None, dev, d.pool_kind
                )
                pool.client = c
            m = self.maps[key] = Mapping(key, here, d.size, pool)
            m.window = window
            pool.users += 1
            m.client, m.export_id, m.leased, m.keep = c, d.export_id, True, keep
            m.life = d.life
            m.fence = max(d.life - 1, 0)
            m.told = m.ask = 0
            c.keys.add(key)
            c.by_export[d.export_id] = key
        return m

    def _claim_held(self, c: Client, d: _wire.Descriptor, m: Mapping, stream: Any) -> Imported:
        """Claim a message for a mapping we hold (its user counted already): the exporter
        grants it only while the message's life is the block's (else: stale, and the
        block may hold a later life's data)."""
        ok = False
        try:
            end = _span_end(d, m)
            reply, _ = c.request(
                lambda seq: _wire.claim_for(d, seq, False, True, True, end),
                self.settings.claim_timeout,
                give_back=(_wire.Mapped(d.export_id),),
            )
            if reply.status in (_wire.OUT_OF_SPAN, _wire.OTHER_BLOCK):
                _refused(reply, d)
            if reply.status == _wire.OK:
                try:
                    with self.lock:
                        # The exporter counts us busy again (our Idle is void): its
                        # messages of this life are hits again, earlier ones claimed.
                        m.told = m.ask = 0
                        m.fence = d.life - 1
                        m.life = d.life  # the block's life: the exporter checked it
                    ok = True
                finally:
                    c.send_now(_wire.Mapped(d.export_id))
        finally:
            if not ok:
                self.dropped(m, stream)  # the user counted for this message
        if not ok:
            raise SharingError(_STALE)
        return Imported(self, m, stream)

    def _map_granted(
        self,
        c: Client,
        d: _wire.Descriptor,
        dev: int,
        key: tuple[str, bytes],
        raw: Mapping | None,
        fd: int | None,
        keep: bool,
    ) -> Mapping:
        """Map the block of a granted claim (its lease given back if that fails)."""
        try:
            pool = raw.pool if raw is not None else self._pool(d.pool_uuid, d.pool_kind, dev, fd, c)
        except BaseException:
            c.sender.post(_wire.Unmap(d.export_id, None))  # give the lease back
            raise
        finally:
            if fd is not None:
                os.close(fd)
        with self.lock:
            m = self.maps.get(key)
            if m is None:
                try:
                    ptr = self.driver.import_pointer(pool.handle, d.export_data)
                except BaseException:
                    c.sender.post(_wire.Unmap(d.export_id, None))
                    raise
                m = self.maps[key] = Mapping(key, ptr, d.size, pool)
                pool.users += 1
            else:  # mapped already through the Numba plugin: the lease now covers it too
                m.users += 1
                self._wake(m)
                m.size = d.size  # the block's, as the exporter checked
            m.client, m.export_id, m.leased, m.keep = c, d.export_id, True, keep
            # The life it was claimed for: a message of an earlier one is claimed (and
            # refused), never a hit on this life's data (I1).
            m.life = d.life
            m.fence = max(d.life - 1, 0)
            m.told = m.ask = 0
            c.keys.add(key)
            c.by_export[d.export_id] = key
        return m

    def _pool(
        self, uuid: str, kind: int, dev: int, fd: int | None, c: Client | None
    ) -> ImportedPool:
        """The pool ``uuid``, imported from ``fd`` the first time (lock not held).

        One thread imports a pool; others that got its descriptor meanwhile wait for
        that import instead of importing (and then closing) a second copy.
        """
        with self.lock:
            pool = self._entry_or_turn(self.pools, self._importing, uuid)
            if pool is not None:
                return pool
            if fd is None:
                self._turn_done(self.pools, self._importing, uuid, None)
                raise SharingError(
                    "the exporting pool's file descriptor did not arrive with this message; "
                    "send it again from the exporting process"
                )
        keepalive = None
        try:
            handle, keepalive = self.driver.import_pool(fd, kind, dev)
            self.driver.grant_peers(handle, dev if kind != _wire.POOL_PINNED else -1)
            pool = ImportedPool(uuid, handle, keepalive, dev, kind)
            pool.client = c
        except BaseException:
            if keepalive is not None:
                self.driver.close_pool(keepalive)
            raise
        finally:
            self._turn_done(self.pools, self._importing, uuid, pool)
        return pool

    # -- forwarding ----------------------------------------------------------------------------------
    def forward(self, imp: Imported) -> bytes:
        """Register a new ticket with the exporter for sending ``imp``'s block on.

        The third process does not wait on this process's events (they vanish when it
        exits): the writes this process enqueued are waited for here.
        """
        m = imp.m
        c = m.client
        if not m.leased or c is None:
            raise SharingError(
                "memory mapped from a Numba IPC handle cannot be sent on; send the array "
                "from the process that allocated it"
            )
        ticket = os.urandom(_wire.TICKET_BYTES)
        reply, _ = c.request(
            lambda seq: _wire.Register(seq, m.export_id, ticket),
            self.settings.claim_timeout,
            give_back=(_wire.Drop(m.export_id, ticket),),
        )
        if reply.status != _wire.OK:
            raise SharingError("the exporter refused to register a forwarded message")
        with self.driver.on_device(m.dev):
            self.driver.sync_stream(imp.stream.ptr)
            cur = self.driver.current_stream().ptr
            if cur != imp.stream.ptr:
                self.driver.sync_stream(cur)
        return ticket

    # -- the Numba plugin's handles --------------------------------------------------------------------
    def open_raw(
        self,
        pool_uuid: str,
        dev: int,
        data: bytes,
        size: int,
        fd: int | None,
        view: tuple[int, int] | None = None,
    ) -> Mapping:
        """Map an allocation described by a Numba IPC handle (no lease protocol).

        Like a received message, it waits for a claim of the same allocation under way
        and for the free of an earlier mapping of it (one import at a time).  ``view``:
        the ``(offset, nbytes)`` the handle's array covers, refused with
        :class:`ProtocolError` unless it lies within ``size`` and within the mapping
        made already (whose size a lease checked), before anything is mapped (I5).
        """
        key = (pool_uuid, data)
        end = None
        if view is not None:
            offset, nbytes = view
            end = offset + nbytes
            if offset < 0 or nbytes < 0 or end > size:
                raise _wire.ProtocolError(_raw_span_error(view, size))

        def mapped(m: Mapping | None) -> Mapping | None:
            """(lock held) A mapping of the allocation, whoever made it: one more user."""
            if m is not None:
                if end is not None and end > m.size:
                    assert view is not None
                    raise _wire.ProtocolError(_raw_span_error(view, m.size))
                m.users += 1
                self._wake(m)
            return m

        taken, _, closing = self._mapping_or_turn(key, mapped)
        if taken is not None:
            return taken
        try:
            if closing is not None:  # the previous mapping's free runs before a re-import
                self.driver.sync_event(closing)
            pool = self._pool(pool_uuid, _wire.POOL_DEVICE, dev, fd, None)
            with self.lock:
                with self.driver.on_device(dev):
                    ptr = self.driver.import_pointer(pool.handle, data)
                m = self.maps[key] = Mapping(key, ptr, size, pool)
                pool.users += 1
                return m
        finally:
            self._mapping_turn_done(key)

    def close_raw(self, m: Mapping) -> None:
        """A Numba handle let go; when nothing else uses the mapping it is freed, and
        the free has run when this returns (the exporter may then free the memory)."""
        if self.abandoned:  # a fork child: the parent's mapping, not this process's
            return
        self.dropped(m, LEGACY_STREAM)
        with self.driver.on_device(m.dev):
            self.driver.sync_stream(0)

    # -- statistics --------------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        with self.lock:
            clients = list(self.clients.values())
            return {
                "imported_blocks": len(self.maps) - len(self.idle),
                "idle_mappings": len(self.idle),
                "imported_pools": len(self.pools)
                + len(self._closing_pools)
                + len(self._kept_pools),
                "clients": len(clients),
                "opened_events": sum(len(c.events) + len(c.retired) for c in clients),
                "dropped_frames_in": sum(c.sender.dropped for c in clients),
            }

    def flush(self, timeout: float = 5.0) -> None:
        """Wait (at most ``timeout`` s in all, however many exporters) for queued frames."""
        deadline = time.monotonic() + timeout
        for c in list(self.clients.values()):
            c.sender.flush(max(deadline - time.monotonic(), 0.0))
