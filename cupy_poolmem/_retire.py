"""Destroying the package's CUDA pools: only once a synchronising call saw their frees.

The CUDA documentation lets a pool be destroyed while frees of its memory are still
pending (the driver finishes the job when they complete).  Driver 580 does not cope:

- a pool whose last free waited on another process's IPC event, destroyed right after
  that free, corrupted the driver's heap: the next pool created in the process crashed
  in ``cuMemAllocFromPoolAsync`` (SIGFPE, then SIGSEGV at a small address) on an H100;
- an imported pool destroyed before a synchronising call saw its frees keeps a
  descriptor of ``/dev/nvidiactl`` open for good (the importer keeps its own events for
  those, see ``_sharing/_importer.py``).

So a pool never destroys its CUDA pool itself.  :class:`Retirer` holds the cuda.core
resource of every pool from creation (a pool dropped inside a garbage cycle cannot
destroy it either), and when the pool is drained it synchronises the devices its frees
ran on (``cuCtxSynchronize``, in a thread of its own, never while a capture the pools
know of is under way) and only then closes the resource.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

ALL_DEVICES = -1  # a host pool: its frees ran on streams of any device


class Retirer:
    """Owner of the pools' cuda.core resources until they can be destroyed safely.

    ``sync(device)`` must return once every stream of ``device`` has finished what was
    queued on it; ``capture_underway()`` says whether synchronising now would break a
    stream capture; ``active_devices()`` lists the devices with a live context.
    With ``background=False`` nothing happens until :meth:`drain` is called.

    Examples
    --------
    >>> closed = []
    >>> class Resource:
    ...     def close(self):
    ...         closed.append(self)
    >>> r = Retirer(sync=print, capture_underway=lambda: False,
    ...             active_devices=lambda: [0], background=False)
    >>> r.retire(r.adopt(Resource()), 1)
    >>> len(closed), r.pending
    (0, 1)
    >>> r.drain()
    1
    True
    >>> len(closed), r.pending
    (1, 0)
    """

    def __init__(
        self,
        sync: Callable[[int], None],
        capture_underway: Callable[[], bool],
        active_devices: Callable[[], Iterable[int]],
        free: Callable[[int, int], None] | None = None,
        delay: float = 0.05,
        background: bool = True,
    ) -> None:
        self._sync, self._capture_underway = sync, capture_underway
        self._free = free or _free_on_legacy_stream
        self._active_devices = active_devices
        self._delay, self._background = delay, background
        # Reentrant: retire() runs from pools' finalizers, and a garbage collection can
        # start while this thread holds the lock (any allocation under it).
        self._lock = threading.RLock()
        self._held: dict[int, Any] = {}  # token -> resource of a live pool
        self._kept: list[Any] = []  # never closed: a fork child's, or ones no sync reached
        # (resource, device or ALL_DEVICES, blocks still to free after the sync)
        self._due: list[tuple[Any, int, tuple[int, ...]]] = []
        self._next = 1
        self._thread: threading.Thread | None = None
        self.n_retired = 0
        self.n_sync_errors = 0
        self._forked = False
        self._failures = 0  # drains in a row whose sync failed
        self.max_failures = 100  # then the resources are kept, never destroyed unsynced

    def adopt(self, resource: Any) -> int:
        """Hold ``resource`` for a new pool; the token names it in :meth:`retire`."""
        with self._lock:
            token, self._next = self._next, self._next + 1
            self._held[token] = resource
        return token

    def retire(self, token: int, device: int, leftovers: Iterable[int] = ()) -> None:
        """The pool ``token`` is drained (its frees are queued): destroy it once done.

        ``leftovers``: blocks of it nobody freed (a finalized pool's reuse cache); they
        are freed after the sync, on the legacy stream, and synchronised again.
        """
        with self._lock:
            resource = self._held.pop(token, None)
            if resource is None:
                return  # retired already
            if self._forked:  # the parent's or the child's: CUDA is unusable here
                self._kept.append(resource)
                return
            self._due.append((resource, device, tuple(leftovers)))
        self._start()

    def retire_resource(self, resource: Any, device: int) -> None:
        """Destroy a resource no pool owned (a probe's, a failed constructor's) safely."""
        self.retire(self.adopt(resource), device)

    @property
    def pending(self) -> int:
        """Resources retired but not destroyed yet."""
        with self._lock:
            return len(self._due)

    @property
    def held(self) -> int:
        """Resources of pools not retired yet."""
        with self._lock:
            return len(self._held)

    def drain(self) -> bool:
        """Synchronise and destroy what is due now; False when held back (a capture, a
        failed sync)."""
        if self._forked:  # CUDA is unusable in a fork child
            return True
        with self._lock:
            if not self._due:
                return True
        if self._capture_underway():
            return False
        with self._lock:
            due, self._due = self._due, []
        try:
            return self._retire_batch(due)
        except BaseException:
            with self._lock:  # nothing is lost: the batch is tried again
                self._due[:0] = due
            raise

    def _retire_batch(self, due: list[tuple[Any, int, tuple[int, ...]]]) -> bool:
        devices: set[int] = set()
        for _, dev, _left in due:
            if dev == ALL_DEVICES:
                devices.update(self._active_devices())
            else:
                devices.add(dev)
        if not self._sync_all(devices):
            # A sync refused (a capture the pools never saw, a broken context): try
            # again later; after many failures keep them (a leak, never an unsynced
            # destroy).
            self._failures += 1
            with self._lock:
                if self._failures >= self.max_failures:
                    self._kept.extend(r for r, _, _ in due)
                    self._failures = 0
                else:
                    self._due[:0] = due
            return False
        self._failures = 0
        freed: set[int] = set()
        for _, dev, left in due:
            if not left:
                continue
            on = dev if dev != ALL_DEVICES else min(devices, default=0)
            for ptr in left:
                try:
                    self._free(ptr, on)
                except Exception:
                    pass
            freed.add(on)
        if freed and not self._sync_all(freed):  # the leftovers' frees, seen done too
            with self._lock:
                self._kept.extend(r for r, _, _ in due)
            return False
        for resource, _, _left in due:
            try:
                resource.close()
            except Exception:
                pass
            self.n_retired += 1
        return True

    def _sync_all(self, devices: Iterable[int]) -> bool:
        ok = True
        for dev in sorted(devices):
            try:
                self._sync(dev)
            except Exception:
                self.n_sync_errors += 1
                ok = False
        return ok

    def _start(self) -> None:
        if not self._background:  # the owner calls drain()
            return
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(
                target=self._run, name="cupy_poolmem-retire", daemon=True
            )
        try:
            self._thread.start()
        except RuntimeError:  # interpreter shutting down: the process exit frees all
            with self._lock:
                self._thread = None

    def _run(self) -> None:
        while True:
            time.sleep(self._delay)
            self.drain()
            with self._lock:
                if not self._due:
                    self._thread = None
                    return

    def _after_fork_in_child(self) -> None:
        """CUDA is unusable in a fork child: keep the parent's resources, never close them."""
        self._lock = threading.RLock()
        self._thread = None
        self._background = False  # no thread, no CUDA call here: nothing is ever closed
        self._forked = True
        self._kept = [*self._kept, *self._held.values(), *(r for r, _, _ in self._due)]
        self._held = {}
        self._due = []


def _sync_device(dev: int) -> None:
    from ._device import _drv, on_device
    from ._errors import check_driver
    from ._streams import relaxed_capture_mode

    with on_device(dev), relaxed_capture_mode():
        check_driver(_drv().cuCtxSynchronize(), "cuCtxSynchronize")


def _free_on_legacy_stream(ptr: int, dev: int) -> None:
    from ._device import _drv, on_device

    with on_device(dev):
        _drv().cuMemFreeAsync(ptr, 0)


def _active_devices() -> list[int]:
    """Devices whose primary context is alive (syncing others would create one)."""
    from ._device import _drv, device_count

    out = []
    for dev in range(device_count()):
        err, _flags, active = _drv().cuDevicePrimaryCtxGetState(dev)
        if not int(err) and active:
            out.append(dev)
    return out


def _capture_underway() -> bool:
    from ._streams import any_capture_underway

    return any_capture_underway()


_OWNER: list[Retirer | None] = [None]
_OWNER_LOCK = threading.Lock()


def retirer() -> Retirer:
    """The process's :class:`Retirer` (created on first use)."""
    r = _OWNER[0]
    if r is None:
        with _OWNER_LOCK:
            r = _OWNER[0]
            if r is None:
                r = _OWNER[0] = Retirer(_sync_device, _capture_underway, _active_devices)
    return r


def _after_fork_in_child() -> None:
    r = _OWNER[0]
    if r is not None:
        r._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
