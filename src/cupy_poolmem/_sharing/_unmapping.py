"""The importer's letting go: dropped users, idle mappings, evictions, gone exporters.

:class:`Unmapping` holds the :class:`~cupy_poolmem._sharing._importer.Importer`'s
methods that unmap: a mapping is freed once its last user is gone (or kept idle for
the next message), evicted when its exporter asks, and the pools of exporters that are
gone are destroyed once their frees have run.  Frees met during a graph capture are
deferred to a thread of their own.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from . import _wire
from ._mapping import ImportedPool, Mapping
from ._warn import warn_kept

if TYPE_CHECKING:
    from collections import OrderedDict

    from ._client import Client
    from ._settings import SharingSettings

__all__ = ["Unmapping"]

_KEEP = object()  # an unmap the driver refused: the lease stays (leaking is the safe side)


class _StepUnmap(NamedTuple):
    """A step mapping to unmap once ``event`` (its last use) is done."""

    event: Any


class Unmapping:
    """The :class:`Importer`'s methods that let go of mappings (mixed into it); the
    attributes they use are the importer's, made by its constructor."""

    driver: Any
    settings: SharingSettings
    lock: threading.RLock
    clients: dict[str, Client]
    pools: dict[str, ImportedPool]
    maps: dict[tuple[str, bytes], Mapping]
    idle: OrderedDict[tuple[str, bytes], Mapping]
    seen: OrderedDict[tuple[str, int], None]
    closing: OrderedDict[tuple[str, bytes], Any]
    abandoned: bool
    seen_max: int
    closing_max: int
    frees_max: int
    _deferred: list[tuple[Mapping, Any]]
    _deferred_thread: threading.Thread | None
    _closing_pools: list[ImportedPool]
    _kept_pools: list[ImportedPool]
    _step_maps: dict[int, Any]
    _step_pools: dict[tuple[str, int], ImportedPool]
    _step_unmaps: list[tuple[Mapping, Any]]

    # -- letting go ------------------------------------------------------------------------------
    def dropped(self, m: Mapping, stream: Any) -> None:
        """One user of ``m`` is gone (its arrays, or a Numba handle) on ``stream``."""
        if self.abandoned:
            return
        sptr = stream.ptr
        if self.driver.is_capturing(sptr):  # a free now would become part of the graph
            with self.lock:
                self._deferred.append((m, stream))
            self._schedule_deferred()
            return
        out: list[tuple[Mapping, Any]] = []
        with self.driver.on_device(m.dev), self.lock:
            m.users -= 1
            if m.users:  # other users remain: the final free waits for this stream too
                m.waits[sptr] = self.driver.plain_event(sptr, m.waits.get(sptr))
                return
            reuse = m.waits.pop(sptr, None)  # this stream's: ordered already
            for ev in m.waits.values():
                self.driver.wait_event(sptr, ev)
                self.driver.close_event(ev)
            m.waits.clear()
            keep = (
                m.leased
                and m.keep
                and not m.evict
                and m.client is not None
                and not m.client.closed
                and self.settings.keep_mappings > 0
            )
            if keep:
                m.last_use = self.driver.plain_event(sptr, reuse)
                m.last_stream = sptr
                self.idle[m.key] = m
                self._say_idle(m, sptr)
                out = self._over_cap()
            else:
                if reuse is not None:
                    self.driver.close_event(reuse)
                self._forget(m)
                out = [(m, self._unmap(m, sptr))]
        self._tell(out)

    def _wake(self, m: Mapping) -> None:
        """``m`` gets a user (lock held): if it was idle, its last use becomes a wait of
        the next final drop (work of another stream before it stays ordered)."""
        self.idle.pop(m.key, None)
        if m.last_use is not None:
            old = m.waits.pop(m.last_stream, None)
            if old is not None:
                self.driver.close_event(old)
            m.waits[m.last_stream] = m.last_use
            m.last_use = None

    def _unmap(self, m: Mapping, sptr: int) -> Any:
        """Free ``m`` in order on ``sptr`` (lock held, device current): the event handle
        for the exporter, or ``_KEEP`` when the driver refused (the lease then stays)."""
        if m.last_use is not None:
            self.driver.close_event(m.last_use)
            m.last_use = None
        if m.window is not None:  # steps: unmapped once the last use is done (_tell)
            m.pool.users -= 1
            pk = (m.pool.uuid, m.dev)  # (an exporter's pool per task: no entry per pool)
            if not m.pool.users and self._step_pools.get(pk) is m.pool:
                del self._step_pools[pk]
            return _StepUnmap(self.driver.plain_event(sptr))
        try:  # importers free first (driver rule)
            self.driver.free_async(m.ptr, sptr)
        except Exception as exc:
            warn_kept("unmapping a shared block", exc)
            return _KEEP
        ev, handle = self.driver.record_ipc_event(m.dev, sptr)
        frees = m.pool.frees
        if sptr not in frees and len(frees) >= self.frees_max:
            self._prune_frees(frees)
        frees[sptr] = self.driver.plain_event(sptr, frees.get(sptr))
        self.closing[m.key] = ev
        if len(self.closing) > self.closing_max:
            # Forgetting it, a re-import would not wait for that free: make sure it ran.
            _, old = self.closing.popitem(last=False)
            if not self.driver.event_done(old):
                self.driver.sync_event(old)
        m.pool.users -= 1
        return handle if m.leased else None

    def _prune_frees(self, frees: dict[int, Any]) -> None:
        """Let go of the free events that are done (lock held, device current): a worker
        that makes a new stream per task would otherwise keep one event per stream for
        as long as the exporter lives.  Each is synchronised first (returns at once),
        which is what the driver needs to settle those frees (see close_done_pools)."""
        for s, ev in list(frees.items()):
            if self.driver.event_done(ev):
                self.driver.sync_event(ev)
                self.driver.close_event(ev)
                del frees[s]

    def _forget(self, m: Mapping) -> None:
        """Take ``m`` out of the tables (lock held); remember it was received."""
        self.maps.pop(m.key, None)
        self.idle.pop(m.key, None)
        c = m.client
        if c is not None:
            c.keys.discard(m.key)
            c.by_export.pop(m.export_id, None)
            self.seen[(c.address, m.export_id)] = None
            if len(self.seen) > self.seen_max:
                self.seen.popitem(last=False)

    def _tell(self, out: list[tuple[Mapping, Any]]) -> None:
        """Send ``unmap`` for mappings just freed; tidy up after exporters that are gone."""
        if not out:
            return
        gone = set()
        for m, handle in out:
            if isinstance(handle, _StepUnmap):
                handle = self._unmap_steps(m, handle)
            c = m.client
            if c is None or handle is _KEEP:
                continue
            if m.leased and not c.closed:
                c.sender.post(_wire.Unmap(m.export_id, handle))
            if c.closed:
                gone.add(c)
        for c in gone:
            self._tidy(c)

    def _unmap_steps(self, m: Mapping, u: _StepUnmap) -> Any:
        """Unmap the steps of ``m`` (lock not held) once its last use is done: now when
        it is (then None: the exporter waits for nothing), else ``_KEEP`` and later, by
        the deferred thread (whose unmap then says so to the exporter).  ``cuMemUnmap``
        is not stream-ordered: it must not run under work still queued on the mapping.
        Relaxed capture mode: another thread's graph capture is left alone."""
        with self.driver.on_device(m.dev), self.driver.relaxed():
            if not self.driver.event_done(u.event):
                with self.lock:
                    self._step_unmaps.append((m, u.event))
                self._schedule_deferred()
                return _KEEP
            self.driver.sync_event(u.event)  # (returns at once; reports a sticky error)
            self.driver.close_event(u.event)
            try:
                self._step_maps[m.dev].unmap(m.window)
            except Exception as exc:
                warn_kept("unmapping the steps of a shared block", exc)
                return _KEEP  # the lease stays: leaking beats freeing under a mapping
        return None

    def _drain_step_unmaps(self) -> None:
        """Unmap the steps whose last use is done now (the deferred thread)."""
        with self.lock:
            todo, self._step_unmaps = self._step_unmaps, []
        self._tell([(m, _StepUnmap(ev)) for m, ev in todo])

    def _take_idle(self, ms: list[Mapping]) -> list[tuple[Mapping, Any]]:
        """Unmap idle mappings (lock held) after their last use, on the legacy stream.

        A stream of our own would add an IPC event per process; on driver 580 that
        made every later event record and wait of both processes take milliseconds.
        """
        out = []
        for m in ms:
            self._forget(m)
            with self.driver.on_device(m.dev):
                if m.last_use is not None:
                    self.driver.wait_event(0, m.last_use)
                out.append((m, self._unmap(m, 0)))
        return out

    def _over_cap(self) -> list[tuple[Mapping, Any]]:
        n = len(self.idle) - self.settings.keep_mappings
        return self._take_idle(list(self.idle.values())[:n]) if n > 0 else []

    def trim_idle(self, limit: int | None = None) -> int:
        """Unmap idle mappings beyond ``limit`` (``keep_mappings`` by default)."""
        with self.lock:
            if limit is None:
                out = self._over_cap()
            else:
                out = self._take_idle(list(self.idle.values())[: max(len(self.idle) - limit, 0)])
        self._tell(out)
        return len(out)

    def _say_idle(self, m: Mapping, sptr: int) -> None:
        """Tell the exporter that no array uses idle mapping ``m`` (lock held, device
        current), when it asked or recycles the block between messages."""
        life = m.ask
        if m.eager and m.life > life:
            life = m.life
        if life <= m.told or m.client is None or m.client.closed:
            return
        if life > m.fence:
            m.fence = life  # from now on, messages of this life or earlier are claimed
        m.told = m.fence
        _, handle = self.driver.record_ipc_event(m.dev, sptr)
        # Posted under the lock: in order with any claim of this mapping made after it;
        # urgent (the exporter reuses the block once every receiver has said it).
        m.client.sender.post(_wire.Idle(m.export_id, m.fence, handle))

    def release(self, c: Client, export_id: int, life: int) -> None:
        """The exporter wants to recycle block ``export_id`` after ``life``: say Idle
        once no array uses our mapping (now, if it is idle); keep the mapping."""
        with self.lock:
            key = c.by_export.get(export_id)
            m = self.maps.get(key) if key is not None else None
            if m is None or not m.leased or m.client is not c:
                return  # unmapped already: the exporter gets that unmap
            m.keep = m.eager = True
            if life > m.ask:
                m.ask = life
            m.told = 0  # it asks only while it counts us busy: always answer
            if m.users:
                return  # the last array's drop says it
            with self.driver.on_device(m.dev):
                if m.last_use is not None:
                    self.driver.wait_event(0, m.last_use)
                self._say_idle(m, 0)

    def evict(self, c: Client, export_id: int) -> None:
        """The exporter freed block ``export_id``: unmap it once no array uses it."""
        with self.lock:
            key = c.by_export.get(export_id)
            m = self.maps.get(key) if key is not None else None
            if m is None:
                return  # unmapped already; the exporter gets that unmap
            m.evict = True
            if m.users:
                return
            out = self._take_idle([m])
        self._tell(out)

    def exporter_gone(self, c: Client) -> None:
        """An exporter's connection closed: unmap its idle mappings; tidy when unused."""
        with self.lock:
            out = self._take_idle([m for m in self.idle.values() if m.client is c])
        self._tell(out)
        self._tidy(c)

    def _tidy(self, c: Client) -> None:
        """Release what this process keeps for a gone exporter once nothing maps its
        blocks: its connection entry, opened events, imported pools, remembered keys."""
        with self.lock:
            if c.keys or c.busy or self.clients.get(c.address) is not c:
                return
            del self.clients[c.address]
            events, c.events = [*c.events.values(), *c.retired], {}
            c.retired = []
            for k in [k for k, p in self._step_pools.items() if p.client is c and not p.users]:
                del self._step_pools[k]
            pools = [p for p in self.pools.values() if p.client is c and p.users == 0]
            for p in pools:
                del self.pools[p.uuid]
                for key in [key for key in self.closing if key[0] == p.uuid]:
                    del self.closing[key]
            for seen in [seen for seen in self.seen if seen[0] == c.address]:
                del self.seen[seen]
        for ev in events:
            try:
                self.driver.close_event(ev)
            except Exception:
                pass
        with self.lock:
            self._closing_pools.extend(pools)
        if not self.close_done_pools():
            self._schedule_deferred()

    def close_done_pools(self) -> bool:
        """Destroy the gone exporters' pools whose frees have run; True when none is left.

        Destroying an imported pool while a free of its memory is pending is legal, but
        the driver (580) then keeps a descriptor of ``/dev/nvidiactl`` open for good, and
        so it does when the frees are done but no call has synchronised with them (seen
        on an H100: one descriptor per pool, a long-lived receiver of short-lived
        producers runs out).  A pool goes once its free events are done (a query, never a
        wait), after a synchronise on each (returns at once) lets the driver settle them.
        Run in relaxed capture mode: another thread's graph capture is left alone.  A
        pool whose close fails is kept (never destroyed unsynchronised) and counted.
        """
        with self.driver.relaxed():
            with self.lock:
                ready = [p for p in self._closing_pools if self._frees_done(p)]
                for p in ready:
                    self._closing_pools.remove(p)
                left = not self._closing_pools
            for p in ready:
                try:
                    with self.driver.on_device(p.dev):
                        for ev in list(p.frees.values()):
                            self.driver.sync_event(ev)
                            self.driver.close_event(ev)
                    p.frees.clear()
                    self.driver.forget_pool(p.handle)
                    self.driver.close_pool(p.keepalive)
                except Exception as exc:
                    with self.lock:
                        self._kept_pools.append(p)  # leaking beats an unsynchronised destroy
                    warn_kept("closing the pool of an exporter that is gone", exc)
        return left

    def _frees_done(self, p: ImportedPool) -> bool:
        """Whether every free queued on ``p``'s memory here has run (lock held)."""
        try:
            with self.driver.on_device(p.dev):
                return all(self.driver.event_done(ev) for ev in p.frees.values())
        except Exception:
            return False  # asked again later (the retry backs off)

    # -- later: frees during graph capture, pools of gone exporters ------------------------------
    def _schedule_deferred(self) -> None:
        if sys.is_finalizing():  # a new thread would never run (3.11 waits for it forever)
            return  # nothing runs later: the process exit frees all
        with self.lock:
            if self._deferred_thread is not None:
                return
            t = threading.Thread(
                target=self._retry_deferred, name="cupy_poolmem-deferred", daemon=True
            )
            self._deferred_thread = t
        try:
            t.start()
        except RuntimeError:  # interpreter shutdown: nothing runs later
            with self.lock:
                self._deferred_thread = None

    def _retry_deferred(self) -> None:
        """Retry deferred frees and pool closes: every 50 ms while work gets done, backing
        off to once a second while nothing changes (a capture that lasts, frees that
        wait on a stalled stream)."""
        delay = 0.05
        try:
            while True:
                time.sleep(delay)
                before = (len(self._deferred), len(self._closing_pools), len(self._step_unmaps))
                try:
                    self.drain_deferred()
                    self.close_done_pools()
                    if self._step_unmaps:
                        self._drain_step_unmaps()
                except Exception as exc:
                    warn_kept("a deferred unmap or pool close", exc)
                with self.lock:
                    now = (len(self._deferred), len(self._closing_pools), len(self._step_unmaps))
                    if now == (0, 0, 0):  # checked and cleared under one lock: no lost work
                        self._deferred_thread = None
                        return
                delay = 0.05 if now != before else min(delay * 2, 1.0)
        except BaseException:  # the thread dies (shutdown): a later call starts another
            with self.lock:
                if self._deferred_thread is threading.current_thread():
                    self._deferred_thread = None
            raise

    def drain_deferred(self) -> None:
        """Let go, now, of mappings dropped while their stream was being captured."""
        with self.lock:
            todo, self._deferred = self._deferred, []
        for m, stream in todo:
            self.dropped(m, stream)  # re-deferred if still capturing
