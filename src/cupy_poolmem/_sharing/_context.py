"""The sharing state of one process: its exporter, importer, driver and settings.

:func:`context` returns the one :class:`SharingContext` of the process.  After a
``fork`` the child gets a fresh context (the parent's connections are not its own);
if CUDA was already in use, that context refuses to share, with the reason.
"""

from __future__ import annotations

import os
import threading
from multiprocessing import current_process
from multiprocessing import util as _mp_util
from typing import Any

from .. import _runtime
from .._errors import PoolmemError, SharingError
from .._pools import DevicePool
from ._driver import Driver
from ._exporter import Exporter
from ._importer import Importer
from ._settings import SharingSettings

__all__ = ["SharingContext", "context", "settings"]


class SharingContext:
    """Owns this process's :class:`Exporter` and :class:`Importer` (created on first use).

    Tests build contexts of their own with a fake driver (``driver=``) to run the
    protocol without a GPU (``listener_options``: the exporter's listener's, see
    :class:`~cupy_poolmem._sharing._transport.Listener`).  ``authkey``: the key its
    sharing connections authenticate with, both ways (default: the multiprocessing
    authkey of the process family); :meth:`use_authkey` changes it before the first
    connection.
    """

    def __init__(
        self,
        settings: SharingSettings,
        driver: Any = None,
        forked: bool = False,
        listener_options: dict[str, Any] | None = None,
        authkey: bytes | None = None,
    ) -> None:
        self.settings = settings
        self._driver = driver
        self._listener_options = listener_options
        self._authkey = authkey
        self._exporter: Exporter | None = None
        self._importer: Importer | None = None
        self._lock = threading.Lock()
        self.forked = forked
        self._sharing_pools: dict[int, Any] = {}

    @property
    def driver(self) -> Any:
        if self._driver is None:
            with self._lock:
                if self._driver is None:
                    self._driver = Driver()
        return self._driver

    @property
    def exporter(self) -> Exporter:
        if self._exporter is None:
            drv = self.driver
            with self._lock:
                if self._exporter is None:
                    self._exporter = Exporter(
                        drv, self.settings, self.authkey, listener_options=self._listener_options
                    )
        return self._exporter

    @property
    def importer(self) -> Importer:
        if self._importer is None:
            drv = self.driver
            with self._lock:
                if self._importer is None:
                    self._importer = Importer(drv, self.settings, self.authkey)
        return self._importer

    @property
    def authkey(self) -> bytes:
        """The key this process's sharing connections authenticate with."""
        return self._authkey if self._authkey is not None else _authkey()

    def use_authkey(self, key: bytes | None) -> None:
        """Authenticate the sharing connections with ``key`` (None: the process family's).

        Only peers holding the same key can connect to, or be reached from, this
        process.  Raises :class:`SharingError` once the exporter or importer exists
        with another key (its listener and connections were made with it).
        """
        with self._lock:
            made = [x for x in (self._exporter, self._importer) if x is not None]
            new = key if key is not None else _authkey()
            if any(x.authkey != new for x in made):
                raise SharingError(
                    "this process already shares memory with a different authentication "
                    "key; set the key before the first array is shared or received"
                )
            self._authkey = key

    def exporter_address(self) -> str | None:
        """This process's listener address, if it has exported anything."""
        return self._exporter.own_address if self._exporter is not None else None

    def check_not_forked(self) -> None:
        if self.forked:
            raise PoolmemError(
                "this process was forked after CUDA was initialised in its parent; CUDA cannot "
                "be used here. Start workers with multiprocessing.get_context('spawn') or "
                "'forkserver'."
            )

    def sharing_pool(self, dev: int) -> Any:
        """An IPC pool for device copies: set_allocator's pool if IPC, else a private one."""
        alloc = _runtime.installed_allocator("device")
        if alloc is not None:
            p = alloc.pools().get(dev)
            if p is not None and getattr(p, "ipc", False) and not p.closed:
                return p
        p = self._sharing_pools.get(dev)
        if p is None or p.closed:
            p = self._sharing_pools[dev] = DevicePool(device=dev, ipc=True)
        return p

    def stats(self) -> dict[str, int]:
        out = {
            "exported_blocks": 0,
            "limbo_blocks": 0,
            "limbo_bytes": 0,
            "tickets_out": 0,
            "leases": 0,
            "peers": 0,
            "recycled_blocks": 0,
            "imported_blocks": 0,
            "idle_mappings": 0,
            "imported_pools": 0,
            "clients": 0,
            "opened_events": 0,
        }
        dropped = 0
        if self._exporter is not None:
            e = self._exporter.stats()
            dropped += e.pop("dropped_frames_out")
            out.update(e)
        if self._importer is not None:
            i = self._importer.stats()
            dropped += i.pop("dropped_frames_in")
            out.update(i)
        out["dropped_frames"] = dropped
        return out

    def collect(self) -> int:
        freed = self._exporter.collect() if self._exporter is not None else 0
        if self._importer is not None:
            self._importer.drain_deferred()
            self._importer.trim_idle(0)
        return freed

    def trim(self) -> None:
        if self._importer is not None:
            self._importer.trim_idle()

    def at_exit(self) -> None:
        """Wait (bounded) for this process's messages to be received; flush unmaps."""
        if self.forked:
            return
        if self._importer is not None:
            self._importer.flush(min(5.0, self.settings.exit_timeout))
        if self._exporter is not None:
            self._exporter.at_exit(self.settings.exit_timeout)

    def abandon(self) -> None:
        """In a forked child: let go of the parent's connections without using them.

        Arrays the child inherited still reach this state when they go: they then
        touch neither its locks (a parent thread may have held one at the fork) nor
        the driver.
        """
        if self._importer is not None:
            self._importer.abandoned = True
        if self._exporter is not None:
            self._exporter.abandoned = True
        for c in list(self._importer.clients.values()) if self._importer is not None else []:
            c.closed = True
            c.sender.dead = True
            c.conn.forget()
        if self._exporter is not None:
            self._exporter.closed = True
            for p in list(self._exporter.peers.values()):
                p.sender.dead = True
                p.conn.forget()
            listener = self._exporter._listener
            if listener is not None:
                listener.closed = True
                try:
                    listener._sock.close()  # the directory stays: it is the parent's
                except OSError:
                    pass


def _authkey() -> bytes:
    return bytes(current_process().authkey)


settings = SharingSettings()


class ProcessSharing:
    """Owns this process's :class:`SharingContext`, with its fork and exit hooks.

    A fork child gets a fresh context (refusing to share when CUDA was in use); the
    exit wait is registered once per process (again in a child, whose inherited
    finalizers multiprocessing clears).
    """

    def __init__(self) -> None:
        self.current = SharingContext(settings)
        self._exit_pid = 0

    def reset_after_fork(self, cuda_in_use: bool) -> None:
        old = self.current
        self.current = SharingContext(settings, forked=cuda_in_use, authkey=old._authkey)
        try:
            old.abandon()
        except Exception:
            pass

    def after_fork_in_child(self) -> None:
        pools = _runtime.all_pools()
        for p in pools:
            p._forked = True
            p._poison()
        self.reset_after_fork(bool(pools) or self.current._driver is not None)

    def register_exit_wait(self) -> None:
        """Run the exit wait when this process exits (once per process).

        It must be registered before the process starts exiting (multiprocessing runs
        the finalizers registered at that moment), and again in a child started by fork
        or forkserver, which clears the finalizers it inherited.  It runs after
        multiprocessing's own exit finalizers: queue feeders flush and join at priority
        -5, so the messages they wrote are out when the wait begins.
        """
        pid = os.getpid()
        if self._exit_pid != pid:
            self._exit_pid = pid
            _mp_util.Finalize(None, _at_exit, exitpriority=-100)


PROCESS = ProcessSharing()


def context() -> SharingContext:
    """This process's sharing context."""
    return PROCESS.current


def _at_exit() -> None:
    context().at_exit()


def register_exit_wait() -> None:
    """Run the exit wait when this process exits (once per process)."""
    PROCESS.register_exit_wait()


def _trim() -> None:
    context().trim()


settings._on_keep_change = _trim
settings._stats = lambda: context().stats()
settings._collect = lambda: context().collect()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=PROCESS.after_fork_in_child)

# A child that multiprocessing started by fork or forkserver clears the finalizers it
# inherited, then runs these: the exit wait is registered again there.
_mp_util.register_after_fork(settings, lambda _s: register_exit_wait())
