"""Destroying the package's CUDA pools, only once a synchronising call saw their frees.

:class:`Retirer` (one per process, :func:`retirer`) holds every pool's CUDA resource
from creation, parks drained plain pools for reuse, destroys the others after a
device sync in a thread of its own, and frees leftover blocks of finalized pools.
See docs/device_pool.rst, "How it works" (why: a driver bug, measured there).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Hashable, Iterable
from typing import Any, NamedTuple

from . import _device, _driver, _streams
from ._streams import CAPTURE_ERRORS

log = logging.getLogger(__name__)
_FATES = {None: "to be destroyed", True: "parked for reuse", False: "retired already"}

ALL_DEVICES = -1  # a host pool: its frees ran on streams of any device
_OK, _CAPTURE, _ERROR = 0, 1, 2  # what a sync of the devices gave


def _is_capture_error(exc: BaseException) -> bool:
    """A sync refused because of a stream capture (``CUDA_ERROR_STREAM_CAPTURE_*``,
    ``CUDA_ERROR_CAPTURED_EVENT``): it works once the capture has ended."""
    code = getattr(exc, "code", None)
    if isinstance(code, int):
        return code in CAPTURE_ERRORS
    text = f"{getattr(exc, 'name', '')} {exc}"
    return "CUDA_ERROR_STREAM_CAPTURE" in text or "CUDA_ERROR_CAPTURED_EVENT" in text


class _Due(NamedTuple):
    """Work for the next drain: free ``leftovers`` after a sync, then maybe close."""

    resource: Any
    device: int  # the pool's device, or ALL_DEVICES (a host or managed pool)
    leftovers: tuple[int, ...]
    close: bool  # False: leftovers of a pool still held (closed by a later entry)
    everywhere: bool = False  # sync every active device (blocks used on other GPUs)
    token: int = 0  # the pool's (adopt)


class _Poll:
    """A poll given to :meth:`Retirer.after_captures`, with its errors in a row."""

    __slots__ = ("fn", "errors")

    def __init__(self, fn: Callable[[], bool]) -> None:
        self.fn, self.errors = fn, 0


class Retirer:
    """Owner of the pools' cuda.core resources until they can be destroyed safely.

    ``sync(device)`` must return once every stream of ``device`` has finished what was
    queued on it; ``capture_underway()`` says whether synchronising now would break a
    stream capture; ``active_devices()`` lists the devices with a live context;
    ``free(ptr, device)`` frees a leftover block on ``device``'s legacy stream (a
    resource with a ``free_leftover(ptr)`` method frees its own instead);
    ``relaxed()`` is a context manager under which this thread may make driver calls
    while another thread captures in global mode (parking runs under it).
    With ``background=False`` nothing happens until :meth:`drain` is called.

    A resource adopted with a ``recycle_key`` is parked when retired without
    leftovers (``park(resource)`` at the next drain, no sync, captures or not), for
    :meth:`take_recycled` to hand to the next pool of that key.

    A sync the driver refuses because of a capture the pools never saw waits for its
    end, however long it lasts.  Other sync errors count: after ``max_failures`` in a
    row, the resources due are kept for good (a leak, never an unsynchronised
    destroy); leftovers of pools still held stay due.  The thread backs off (up to
    ``max_delay`` seconds between drains) while drains fail.

    Examples
    --------
    >>> closed = []
    >>> class Resource:
    ...     def close(self):
    ...         closed.append(self)
    >>> r = Retirer(sync=print, capture_underway=lambda: False,
    ...             active_devices=lambda: [0], background=False)
    >>> r.retire(r.adopt(Resource()), 1)  # destroyed after a sync, not parked
    False
    >>> len(closed), r.pending
    (0, 1)
    >>> r.drain()
    1
    True
    >>> len(closed), r.pending
    (1, 0)
    >>> parked = []
    >>> r.retire(r.adopt(Resource(), recycle_key="k", park=parked.append), 0)
    True
    >>> r.drain(), len(closed), len(parked)  # no sync, not closed: kept for reuse
    (True, 1, 1)
    >>> r.take_recycled("k") is parked[0], r.take_recycled("k")
    (True, None)
    """

    def __init__(
        self,
        sync: Callable[[int], None],
        capture_underway: Callable[[], bool],
        active_devices: Callable[[], Iterable[int]],
        free: Callable[[int, int], None] | None = None,
        delay: float = 0.05,
        background: bool = True,
        relaxed: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        self._sync, self._capture_underway = sync, capture_underway
        self._relaxed = relaxed
        self._free = free or free_on_legacy_stream
        self._active_devices = active_devices
        self._delay, self._background = delay, background
        # Reentrant: retire() runs from pools' finalizers, and a garbage collection can
        # start while this thread holds the lock (any allocation under it).
        self._lock = threading.RLock()
        self._held: dict[int, Any] = {}  # token -> resource of a live pool
        # token -> (recycle key, park) of a live pool whose resource may be reused
        self._recycle: dict[int, tuple[Hashable, Callable[[Any], None]]] = {}
        self._parking: list[tuple[Hashable, Any, Callable[[Any], None], int, int]] = []
        self._bins: dict[Hashable, list[Any]] = {}  # key -> parked resources
        self.max_recycled = 4  # parked resources per key; one more is destroyed
        self.max_recycled_total = 16  # over every key
        self._parking_now: list[Hashable] = []  # keys of the parks a drain is doing
        self._draining_leftovers: set[int] = set()  # tokens whose leftovers a drain frees
        self._deciding: dict[int, Any] = {}  # token -> resource whose before_destroy runs
        self.n_parked = 0
        self.n_park_errors = 0
        self._kept: list[Any] = []  # never closed: a fork child's, or ones no sync reached
        self._due: list[_Due] = []
        # Pools a drain is retiring now (token -> resource), and leftovers of theirs
        # that came meanwhile: freed before the close if it has not happened yet.
        self._inflight: dict[int, Any] = {}
        self._late: dict[int, list[_Due]] = {}
        self.n_leftovers_lost = 0  # leftovers never freed: their pool was destroyed or kept
        self._waiting: list[_Poll] = []  # polled until True (after_captures)
        self._polling = 0  # polls taken out of _waiting by a drain under way
        self._next = 1
        self._thread: threading.Thread | None = None
        self.n_retired = 0
        self.n_sync_errors = 0
        self._forked = False
        self._failures = 0  # drains in a row whose sync failed (not for a capture)
        self.max_failures = 100  # then the resources are kept, never destroyed unsynced
        self._trouble = False  # the last drain failed somewhere: the thread backs off
        self._backoff = 0  # drains in a row that failed
        self.max_delay = 2.0  # seconds: the longest wait between drains
        self.n_errors = 0  # exceptions out of drain() in the thread
        self.n_poll_errors = 0  # exceptions out of polls (after_captures)
        self._warned: set[str] = set()

    def adopt(
        self,
        resource: Any,
        recycle_key: Hashable = None,
        park: Callable[[Any], None] | None = None,
    ) -> int:
        """Hold ``resource`` for a new pool; the token names it in :meth:`retire`.

        With a ``recycle_key``, the resource is parked instead of destroyed once the
        pool is drained: ``park(resource)`` readies it for an owner to come (no sync),
        and :meth:`take_recycled` hands it to the next pool asking with that key.
        """
        with self._lock:
            token, self._next = self._next, self._next + 1
            self._held[token] = resource
            if recycle_key is not None:
                self._recycle[token] = (recycle_key, park or (lambda r: None))
        return token

    def take_recycled(self, key: Hashable) -> Any:
        """A parked resource of ``key`` for a new pool (to :meth:`adopt` again), or None."""
        with self._lock:
            parked = self._bins.get(key)
            return parked.pop() if parked else None

    @property
    def recycled(self) -> int:
        """Resources parked for reuse."""
        with self._lock:
            return sum(len(v) for v in self._bins.values())

    def retire(
        self,
        token: int,
        device: int,
        leftovers: Iterable[int] = (),
        before_destroy: Callable[[], None] | None = None,
    ) -> bool:
        """The pool ``token`` is drained (its frees are queued): destroy it once done.

        ``leftovers``: blocks of it nobody freed (a finalized pool's reuse cache); they
        are freed after the sync, on the legacy stream, and synchronised again.
        Retiring a pool twice retires it once (the leftovers of the second call are
        handled as :meth:`add_leftovers` does).  True when the resource is to be
        parked for reuse (adopted with a ``recycle_key``): it may be another pool's
        soon, so the pool must not touch it any more.  ``before_destroy`` runs, in
        this thread, when the resource is to be destroyed instead, before the retirer
        may destroy it (a pool revokes its peer grants there); errors are ignored.
        """
        leftovers = tuple(leftovers)
        with self._lock:
            parked = self._decide(token, device, leftovers)
        log.info("pool %#x on device %d retired: %s", token, device, _FATES[parked])
        if parked is None:  # to destroy: held, so that no drain destroys it meanwhile
            try:
                if before_destroy is not None:
                    with contextlib.suppress(Exception):
                        before_destroy()
            finally:
                with self._lock:
                    resource = self._deciding.pop(token)
                    self._due.append(_Due(resource, device, leftovers, True, token=token))
            parked = False
        self._start()
        return parked

    def _decide(self, token: int, device: int, leftovers: tuple[int, ...]) -> bool | None:
        """Under the lock: the pool ``token`` parked (True), or to be destroyed (None:
        held in ``_deciding`` for :meth:`retire` to queue); False when it was retired
        already, or in a fork child."""
        resource = self._held.pop(token, None)
        recycle = self._recycle.pop(token, None)
        if resource is None:  # retired already
            if leftovers and not self._forked:
                self._add_late(token, device, leftovers, False)
            return False
        if self._forked:  # the parent's or the child's: CUDA is unusable here
            self._kept.append(resource)
            return False
        # Not with leftovers (given now, or due already): they go after a sync.
        if recycle is not None and not leftovers and self._room_to_park(recycle[0], token):
            key, park = recycle
            self._parking.append((key, resource, park, device, token))
            return True
        self._deciding[token] = resource
        return None

    def _room_to_park(self, key: Hashable, token: int) -> bool:
        """Under the lock: whether the pool ``token`` (of ``key``) may be parked: none
        of its leftovers waits for a drain or is being freed by one, and fewer than
        ``max_recycled`` of its key (``max_recycled_total`` in all) are parked, being
        parked or waiting to be."""
        if token in self._late or token in self._draining_leftovers:
            return False
        if any(e.token == token and e.leftovers for e in self._due):
            return False
        keys = [
            *(k for k, v in self._bins.items() for _ in v),
            *(e[0] for e in self._parking),
            *self._parking_now,
        ]
        return keys.count(key) < self.max_recycled and len(keys) < self.max_recycled_total

    def will_park(self, token: int) -> bool:
        """Whether retiring the pool ``token`` now (without leftovers) would park it."""
        with self._lock:
            recycle = self._recycle.get(token)
            return (
                recycle is not None and not self._forked and self._room_to_park(recycle[0], token)
            )

    def add_leftovers(
        self, token: int, device: int, ptrs: Iterable[int], everywhere: bool = False
    ) -> None:
        """Blocks of the pool ``token`` (not retired yet) that must not be freed on their
        own stream: a finalized pool's reuse cache, or blocks freed after their pool was
        finalized inside a garbage cycle, whose streams may be destroyed already.

        They are freed at the next drain, after a sync of ``device`` (of every active
        device with ``everywhere``), on the legacy stream, and synchronised again;
        always before the pool itself is closed.  A pool retired already but not
        closed yet gets them before its close; one whose resource is closed (its
        memory went with it) or kept for good does not: they are counted in
        ``n_leftovers_lost``, never freed.
        """
        ptrs = tuple(ptrs)
        if not ptrs:
            return
        with self._lock:
            if self._forked:
                return  # CUDA is unusable here
            resource = self._held.get(token)
            if resource is None:
                self._add_late(token, device, ptrs, everywhere)
            else:
                self._due.append(_Due(resource, device, ptrs, False, everywhere, token))
        self._start()

    def _add_late(self, token: int, device: int, ptrs: tuple[int, ...], everywhere: bool) -> None:
        """Under the lock: leftovers of a pool retired already."""
        for i, e in enumerate(self._due):
            if e.close and e.token == token:  # not closed yet: freed before it
                self._due.insert(i, _Due(e.resource, device, ptrs, False, everywhere, token))
                return
        resource = self._inflight.get(token)
        if resource is not None:  # a drain retires it now: see _settle
            late = _Due(resource, device, ptrs, False, everywhere, token)
            self._late.setdefault(token, []).append(late)
            return
        # Closed (or kept): freeing now would be wrong.  Or parked for reuse (leftovers
        # are handed over before a pool is drained, so only a race gets here): the
        # blocks stay allocated in the reused CUDA pool, a leak, never a wrong free.
        self.n_leftovers_lost += len(ptrs)

    def _settle(self, tokens: list[int]) -> None:
        """Under the lock, after a drain's batch: leftovers that came for its pools
        while it ran go before their close if it was put back, else are lost."""
        for token in tokens:
            self._inflight.pop(token, None)
            late = self._late.pop(token, None)
            if not late:
                continue
            for i, e in enumerate(self._due):
                if e.close and e.token == token:
                    self._due[i:i] = late
                    break
            else:
                self.n_leftovers_lost += sum(len(e.leftovers) for e in late)

    def after_captures(self, poll: Callable[[], bool]) -> None:
        """Call ``poll()`` at every drain until it returns True.

        For a closed pool whose last frees wait for a stream capture to end: ``poll``
        does them once it has, then retires the pool.  One that raises is called again
        at the next drains (the first error is warned about), and dropped after
        ``max_failures`` errors in a row (its pool's finalizer then retires the pool).
        """
        with self._lock:
            if self._forked:
                self._kept.append(poll)
                return
            self._waiting.append(_Poll(poll))
        self._start()

    def retire_resource(self, resource: Any, device: int) -> None:
        """Destroy a resource no pool owned (a probe's, a failed constructor's) safely."""
        self.retire(self.adopt(resource), device)

    @property
    def pending(self) -> int:
        """Resources retired but not destroyed or parked yet (due, or in a drain under way)."""
        with self._lock:
            return (
                sum(1 for e in self._due if e.close)
                + len(self._inflight)
                + len(self._parking)
                + len(self._parking_now)
                + len(self._deciding)
            )

    @property
    def waiting(self) -> int:
        """Closed pools whose last frees wait for a stream capture to end (polls being
        called now included)."""
        with self._lock:
            return len(self._waiting) + self._polling

    @property
    def held(self) -> int:
        """Resources of pools not retired yet."""
        with self._lock:
            return len(self._held)

    def is_held(self, token: int) -> bool:
        """Whether the pool ``token`` is not retired yet."""
        with self._lock:
            return token in self._held

    def drain(self) -> bool:
        """Synchronise and destroy what is due now; False when held back (a capture, a
        failed sync, a pool waiting for a capture to end)."""
        if self._forked:  # CUDA is unusable in a fork child
            return True
        self._trouble = False
        self._poll_waiting()
        self._park_retired()  # no sync: a capture under way is no obstacle
        with self._lock:
            if not self._due:
                return not self._waiting
        if self._capture_underway():
            return False
        with self._lock:
            due, self._due = self._due, []
            tokens = [e.token for e in due if e.close]
            for e in due:
                if e.close:
                    self._inflight[e.token] = e.resource
            # A pool whose leftovers this drain frees is not parked meanwhile (another
            # thread's drain may run too: each adds and takes back its own).
            mine = {e.token for e in due if e.leftovers}
            self._draining_leftovers |= mine
        try:
            done = self._retire_batch(due)
        except BaseException:
            # Nothing is lost and nothing is done twice: what is left of the batch
            # (_retire_batch strips the leftovers it freed and the resources it
            # closed) is tried again.
            with self._lock:
                self._due[:0] = [e for e in due if e.close or e.leftovers]
            raise
        finally:
            with self._lock:
                self._settle(tokens)
                self._draining_leftovers -= mine
        with self._lock:
            return done and not self._waiting

    def _park_retired(self) -> None:
        """Ready the resources retired for reuse; one whose park raises is destroyed
        the usual way (after a sync) instead."""
        with self._lock:
            parking, self._parking = self._parking, []
            # Still counted (pending, caps) while parked; another thread's drain may be
            # parking too: each adds its own keys and takes back only those.
            left = [e[0] for e in parking]
            self._parking_now.extend(left)

        def done(key: Hashable) -> None:  # under the lock
            self._parking_now.remove(key)
            left.remove(key)

        try:
            for i, (key, resource, park, device, token) in enumerate(parking):
                try:
                    with self._relaxed():
                        park(resource)
                except Exception:
                    self.n_park_errors += 1
                    self._trouble = True
                    with self._lock:
                        self._due.append(_Due(resource, device, (), True, token=token))
                        done(key)
                    continue
                except BaseException:  # nothing lost: this one destroyed, the rest parked later
                    with self._lock:
                        self._due.append(_Due(resource, device, (), True, token=token))
                        self._parking[:0] = parking[i + 1 :]
                    raise
                with self._lock:
                    self._bins.setdefault(key, []).append(resource)
                    done(key)
                    self.n_parked += 1
        finally:
            with self._lock:
                for key in list(left):
                    done(key)

    def _poll_waiting(self) -> None:
        with self._lock:
            waiting, self._waiting = self._waiting, []
            self._polling += len(waiting)
        n = len(waiting)
        keep: list[_Poll] = []
        try:
            while waiting:
                poll = waiting[0]
                try:
                    done = poll.fn()
                    poll.errors = 0
                except Exception as exc:
                    done = self._poll_failed(poll, exc)
                waiting.pop(0)
                if not done:
                    keep.append(poll)
        finally:
            with self._lock:
                self._polling -= n
                if keep or waiting:
                    self._waiting[:0] = keep + waiting

    def _poll_failed(self, poll: _Poll, exc: Exception) -> bool:
        """A poll raised: True to drop it (``max_failures`` in a row), else retry."""
        self._trouble = True
        self.n_poll_errors += 1
        poll.errors += 1
        if poll.errors < self.max_failures:
            self._warn_once(
                "poll", f"a closed pool's frees held for a capture failed ({exc!r}); retrying"
            )
            return False
        # Given up: its frees leak (never one done in a bad state); the pool's
        # finalizer retires the pool itself.
        self._warn_once("poll-dropped", f"gave up on a closed pool's held frees ({exc!r})")
        return True

    def _retire_batch(self, due: list[_Due]) -> bool:
        """Sync, free the leftovers, sync, close.  ``due`` is updated as it goes (freed
        leftovers and closed resources taken out) for a caller that puts it back."""
        devices: set[int] = set()
        active: list[int] | None = None
        for e in due:
            if e.device == ALL_DEVICES or e.everywhere:
                if active is None:
                    active = list(self._active_devices())
                devices.update(active)
            if e.device != ALL_DEVICES:
                devices.add(e.device)
        status = self._sync_all(devices)
        if status != _OK:
            self._held_back(status, due)
            return False
        freed: set[int] = set()
        for i, e in enumerate(due):
            if not e.leftovers:
                continue
            on = e.device if e.device != ALL_DEVICES else min(devices, default=0)
            own = getattr(e.resource, "free_leftover", None)  # a backend's own blocks
            freed.add(on)
            n = 0
            try:
                for ptr in e.leftovers:
                    n += 1  # (one that raised counts as freed: a leak, never freed twice)
                    try:
                        if own is not None:
                            own(ptr)
                        else:
                            self._free(ptr, on)
                    except Exception:
                        pass
            finally:
                due[i] = e._replace(leftovers=e.leftovers[n:])
        if freed:  # the leftovers' frees, seen done too
            status = self._sync_all(freed)
            if status != _OK:  # (what is left of the batch: the resources to close)
                self._held_back(status, due)
                return False
        self._failures = 0
        for i, e in enumerate(due):
            if not e.close:
                continue
            with self._lock:
                if e.token in self._late:
                    # Leftovers came after the sync: they are freed (after another
                    # sync) at the next drain, then the pool is closed.
                    self._due.append(e)
                    due[i] = e._replace(close=False)
                    continue
            try:
                e.resource.close()
            except Exception:
                pass
            # Closed: never again if a later close() raises out of here (one that
            # raised a BaseException itself stays, to be tried again).
            due[i] = e._replace(close=False)
            self.n_retired += 1
        return True

    def _held_back(self, status: int, due: list[_Due]) -> None:
        """A sync of ``due``'s devices failed: put it back, or keep its resources."""
        self._trouble = True
        due = [e for e in due if e.close or e.leftovers]
        with self._lock:
            if status == _CAPTURE:
                # A capture the pools never saw: nothing is wrong with the context, the
                # batch waits for the capture's end (never counted as a failure).
                self._due[:0] = due
                return
            self._failures += 1
            if self._failures < self.max_failures:
                self._due[:0] = due
                return
            # The context looks broken: the resources due are kept (never destroyed
            # unsynchronised), with their leftovers (their memory stays with them).
            # Leftovers of pools still held stay due: freed once a sync works.
            self._failures = 0
            kept = [e for e in due if e.close]
            self._kept.extend(e.resource for e in kept)
            gone = {id(e.resource) for e in kept}
            self.n_leftovers_lost += sum(len(e.leftovers) for e in due if id(e.resource) in gone)
            self._due[:0] = [e for e in due if id(e.resource) not in gone]

    def _sync_all(self, devices: Iterable[int]) -> int:
        status = _OK
        for dev in sorted(devices):
            try:
                self._sync(dev)
            except Exception as exc:
                self.n_sync_errors += 1
                status = max(status, _CAPTURE if _is_capture_error(exc) else _ERROR)
        return status

    def _start(self) -> None:
        if not self._background:  # the owner calls drain()
            return
        if sys.is_finalizing():  # a new thread would never run (3.11 waits for it forever)
            return  # the process exit frees all
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
        me = threading.current_thread()
        try:
            while True:
                time.sleep(min(self._delay * 2**self._backoff, max(self._delay, self.max_delay)))
                try:
                    self.drain()
                    failed = self._trouble
                except Exception as exc:  # (the batch was put back: tried again)
                    self.n_errors += 1
                    self._warn_once("drain", f"retiring pools failed ({exc!r}); retrying")
                    failed = True
                self._backoff = min(self._backoff + 1, 16) if failed else 0
                with self._lock:
                    if not self._due and not self._waiting and not self._parking:
                        self._thread = None
                        return
        finally:
            # Out on an error that is not an Exception: another thread takes over if
            # work remains (with _thread left set, none would ever start again).
            with self._lock:
                died = self._thread is me
                if died:
                    self._thread = None
                again = died and bool(self._due or self._waiting or self._parking)
            if again:
                self._start()

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"cupy_poolmem: {message}", RuntimeWarning, stacklevel=2)

    def _after_fork_in_child(self) -> None:
        """CUDA is unusable in a fork child: keep the parent's resources, never close them."""
        self._lock = threading.RLock()
        self._thread = None
        self._background = False  # no thread, no CUDA call here: nothing is ever closed
        self._forked = True
        self._kept = [
            *self._kept,
            *self._held.values(),
            *(e[1] for e in self._parking),
            *(r for parked in self._bins.values() for r in parked),
            *(e.resource for e in self._due),
            *(w.fn for w in self._waiting),  # their pools hold streams: kept alive
            *self._inflight.values(),  # the parent's drain was retiring them
            *self._deciding.values(),
        ]
        self._held = {}
        self._recycle = {}
        self._parking = []
        self._parking_now = []
        self._draining_leftovers = set()
        self._deciding = {}
        self._bins = {}
        self._due = []
        self._waiting = []
        self._inflight = {}
        self._late = {}
        self._polling = 0


def free_on_legacy_stream(ptr: int, dev: int) -> None:
    with _device.on_device(dev):
        _driver.get().cuMemFreeAsync(ptr, 0)


def _active_devices() -> list[int]:
    """Devices whose primary context is alive (syncing others would create one)."""
    out = []
    for dev in range(_device.device_count()):
        err, _flags, active = _driver.get().cuDevicePrimaryCtxGetState(dev)
        if not int(err) and active:
            out.append(dev)
    return out


def _capture_underway() -> bool:
    return _streams.any_capture_underway()


def _relaxed_capture_mode() -> contextlib.AbstractContextManager[None]:
    return _streams.relaxed_capture_mode()


class ProcessRetirer:
    """Owns the process's one :class:`Retirer` (made on first use), with its fork hook."""

    def __init__(self) -> None:
        self.current: Retirer | None = None
        self._lock = threading.Lock()

    def get(self) -> Retirer:
        r = self.current
        if r is None:
            with self._lock:
                r = self.current
                if r is None:
                    r = self.current = Retirer(
                        _streams.sync_device,
                        _capture_underway,
                        _active_devices,
                        relaxed=_relaxed_capture_mode,
                    )
        return r

    def install(self, r: Retirer | None) -> Retirer | None:
        """Make ``r`` the process's retirer (None: a new one on next use); the old one."""
        with self._lock:
            old, self.current = self.current, r
        return old

    def after_fork_in_child(self) -> None:
        r = self.current
        if r is not None:
            r._after_fork_in_child()


PROCESS = ProcessRetirer()


def retirer() -> Retirer:
    """The process's :class:`Retirer` (created on first use)."""
    return PROCESS.get()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=PROCESS.after_fork_in_child)
