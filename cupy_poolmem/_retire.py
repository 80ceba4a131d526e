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

Blocks that must not be freed on their own stream (a pool finalized inside a garbage
cycle: a cupy ``Stream``'s finalizer may have destroyed the stream first) are
*leftovers*: the retirer frees them after a sync, on the legacy stream, before it
closes their pool.  A closed pool whose last frees wait for a stream capture to end
is polled by the retirer (:meth:`Retirer.after_captures`) and retired once they are done.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

ALL_DEVICES = -1  # a host pool: its frees ran on streams of any device


class _Due(NamedTuple):
    """Work for the next drain: free ``leftovers`` after a sync, then maybe close."""

    resource: Any
    device: int  # the pool's device, or ALL_DEVICES (a host or managed pool)
    leftovers: tuple[int, ...]
    close: bool  # False: leftovers of a pool still held (closed by a later entry)
    everywhere: bool = False  # sync every active device (blocks used on other GPUs)


class Retirer:
    """Owner of the pools' cuda.core resources until they can be destroyed safely.

    ``sync(device)`` must return once every stream of ``device`` has finished what was
    queued on it; ``capture_underway()`` says whether synchronising now would break a
    stream capture; ``active_devices()`` lists the devices with a live context;
    ``free(ptr, device)`` frees a leftover block on ``device``'s legacy stream (a
    resource with a ``free_leftover(ptr)`` method frees its own instead).
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
        self._due: list[_Due] = []
        self._waiting: list[Callable[[], bool]] = []  # polled until True (after_captures)
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
            self._due.append(_Due(resource, device, tuple(leftovers), True))
        self._start()

    def add_leftovers(
        self, token: int, device: int, ptrs: Iterable[int], everywhere: bool = False
    ) -> None:
        """Blocks of the pool ``token`` (not retired yet) that must not be freed on their
        own stream: a finalized pool's reuse cache, or blocks freed after their pool was
        finalized inside a garbage cycle, whose streams may be destroyed already.

        They are freed at the next drain, after a sync of ``device`` (of every active
        device with ``everywhere``), on the legacy stream, and synchronised again;
        always before the pool itself is closed.
        """
        ptrs = tuple(ptrs)
        if not ptrs:
            return
        with self._lock:
            resource = self._held.get(token)
            if resource is None or self._forked:
                return  # retired already (it had no block left), or CUDA is unusable
            self._due.append(_Due(resource, device, ptrs, False, everywhere))
        self._start()

    def after_captures(self, poll: Callable[[], bool]) -> None:
        """Call ``poll()`` at every drain until it returns True.

        For a closed pool whose last frees wait for a stream capture to end: ``poll``
        does them once it has, then retires the pool.  One that raises is dropped.
        """
        with self._lock:
            if self._forked:
                self._kept.append(poll)
                return
            self._waiting.append(poll)
        self._start()

    def retire_resource(self, resource: Any, device: int) -> None:
        """Destroy a resource no pool owned (a probe's, a failed constructor's) safely."""
        self.retire(self.adopt(resource), device)

    @property
    def pending(self) -> int:
        """Resources retired but not destroyed yet."""
        with self._lock:
            return sum(1 for e in self._due if e.close)

    @property
    def waiting(self) -> int:
        """Closed pools whose last frees wait for a stream capture to end."""
        with self._lock:
            return len(self._waiting)

    @property
    def held(self) -> int:
        """Resources of pools not retired yet."""
        with self._lock:
            return len(self._held)

    def drain(self) -> bool:
        """Synchronise and destroy what is due now; False when held back (a capture, a
        failed sync, a pool waiting for a capture to end)."""
        if self._forked:  # CUDA is unusable in a fork child
            return True
        self._poll_waiting()
        with self._lock:
            if not self._due:
                return not self._waiting
        if self._capture_underway():
            return False
        with self._lock:
            due, self._due = self._due, []
        try:
            done = self._retire_batch(due)
        except BaseException:
            with self._lock:  # nothing is lost: the batch is tried again
                self._due[:0] = due
            raise
        with self._lock:
            return done and not self._waiting

    def _poll_waiting(self) -> None:
        with self._lock:
            waiting, self._waiting = self._waiting, []
        keep: list[Callable[[], bool]] = []
        try:
            while waiting:
                poll = waiting[0]
                try:
                    done = poll()
                except Exception:
                    done = True  # dropped: its frees leak, never a free in a bad state
                waiting.pop(0)
                if not done:
                    keep.append(poll)
        finally:
            if keep or waiting:
                with self._lock:
                    self._waiting[:0] = keep + waiting

    def _retire_batch(self, due: list[_Due]) -> bool:
        devices: set[int] = set()
        active: list[int] | None = None
        for e in due:
            if e.device == ALL_DEVICES or e.everywhere:
                if active is None:
                    active = list(self._active_devices())
                devices.update(active)
            if e.device != ALL_DEVICES:
                devices.add(e.device)
        if not self._sync_all(devices):
            # A sync refused (a capture the pools never saw, a broken context): try
            # again later; after many failures keep them (a leak, never an unsynced
            # destroy).
            self._failures += 1
            with self._lock:
                if self._failures >= self.max_failures:
                    self._kept.extend(e.resource for e in due if e.close)
                    self._failures = 0
                else:
                    self._due[:0] = due
            return False
        self._failures = 0
        freed: set[int] = set()
        for e in due:
            if not e.leftovers:
                continue
            on = e.device if e.device != ALL_DEVICES else min(devices, default=0)
            own = getattr(e.resource, "free_leftover", None)  # a backend's own blocks
            for ptr in e.leftovers:
                try:
                    if own is not None:
                        own(ptr)
                    else:
                        self._free(ptr, on)
                except Exception:
                    pass
            freed.add(on)
        if freed and not self._sync_all(freed):  # the leftovers' frees, seen done too
            with self._lock:
                self._kept.extend(e.resource for e in due if e.close)
            return False
        for e in due:
            if not e.close:
                continue
            try:
                e.resource.close()
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
                if not self._due and not self._waiting:
                    self._thread = None
                    return

    def _after_fork_in_child(self) -> None:
        """CUDA is unusable in a fork child: keep the parent's resources, never close them."""
        self._lock = threading.RLock()
        self._thread = None
        self._background = False  # no thread, no CUDA call here: nothing is ever closed
        self._forked = True
        self._kept = [
            *self._kept,
            *self._held.values(),
            *(e.resource for e in self._due),
            *self._waiting,  # their pools hold streams: dropping them would destroy those
        ]
        self._held = {}
        self._due = []
        self._waiting = []


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
