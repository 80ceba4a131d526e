"""Blocks of mapped and expandable pools across processes: their *steps* (the physical
allocations under a block) exported as file descriptors, and mapped by receivers.

:class:`StepExports` is the exporter's side: it checks a message's step list against
the steps mapped now, exports each step a receiver lacks (a POSIX file descriptor,
once per receiving process) and keeps the book of which receivers map which steps
(the placements ask it before they unmap a step).  :class:`StepMappings` is the
receiver's: it reserves address space for exactly the steps under a block, imports
each step once and maps it, and lets go of it all again.  Both take the driver
(``cuda.bindings.driver`` or a fake) in their constructor.  See docs/sharing.rst,
"Mapped and expandable blocks".
"""

from __future__ import annotations

import os
import threading
import uuid
import weakref
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, NamedTuple

from .._errors import SharingError, check_driver
from .._mapped import access_descriptors

__all__ = ["Step", "StepGrant", "StepExports", "StepMappings", "StaleStepsError", "check_steps"]

#: the most steps one block may name: a block of the largest GPU's memory in 2 MiB
#: steps is under this (a longer list is forged)
STEPS_MAX = 1 << 17


class StaleStepsError(SharingError):
    """A message names steps that are not (or no longer) the ones under its block: the
    range shrank, or a step was unmapped and mapped again, since it was made (or it
    was forged).  Nothing was mapped."""


class Step(NamedTuple):
    """One physical allocation under a block, as a message names it."""

    id: int  # the exporter's id, never reused for another allocation
    va: int  # its address in the exporter
    size: int  # bytes


class StepGrant(NamedTuple):
    """A step granted to a receiver: its file descriptor when the receiver lacks it."""

    step: Step
    fd: int | None


def check_steps(steps: Sequence[Any], ptr: int, size: int) -> list[Step]:
    """The steps of a message for block ``[ptr, ptr + size)``, checked: contiguous, in
    address order, each holding a byte of the block, together holding all of it.

    Raises
    ------
    StaleStepsError
        Naming what is wrong, before anything is mapped.

    Examples
    --------
    >>> check_steps([(1, 0x1000, 0x1000), (2, 0x2000, 0x1000)], 0x1800, 0x1000)[1].id
    2
    """
    if not 0 < len(steps) <= STEPS_MAX:
        raise StaleStepsError(
            f"a message names {len(steps)} step(s) for a block of {size} bytes; a block "
            f"lies on 1 to {STEPS_MAX} steps (a forged message)"
        )
    out = []
    ids: set[int] = set()
    for s in steps:
        if len(s) != 3 or not all(isinstance(v, int) and v >= 0 for v in s) or s[2] <= 0:
            raise StaleStepsError(f"a message names the malformed step {s!r} (a forged message)")
        if s[0] in ids:
            raise StaleStepsError(
                f"a message names step {s[0]} twice; a block's steps are distinct physical "
                "allocations (a forged message)"
            )
        ids.add(s[0])
        out.append(Step(*s))
    end = ptr + max(int(size), 1)
    for a, b in zip(out, out[1:], strict=False):
        if b.va != a.va + a.size:
            raise StaleStepsError(
                f"a message names steps at {a.va:#x} (+{a.size}) and {b.va:#x} that are not "
                "contiguous; a block's steps are (a forged message)"
            )
    first, last = out[0], out[-1]
    if not (first.va <= ptr < first.va + first.size and last.va < end <= last.va + last.size):
        raise StaleStepsError(
            f"a message names steps {first.va:#x}..{last.va + last.size:#x} that do not "
            f"hold exactly its block {ptr:#x}..{end:#x} (a forged message)"
        )
    return out


class StepExports:
    """The exporter's steps: export on a claim, and the book of who maps what.

    Parameters
    ----------
    driver
        ``cuda.bindings.driver`` (tests give a fake): ``cuMemRetainAllocationHandle``,
        ``cuMemExportToShareableHandle``, ``cuMemRelease``.
    lock
        The lock of the book (an ``RLock``; a new one by default).  The exporter gives
        its own: with two locks, a garbage collection inside the book that frees a
        shared block (and so waits for the exporter's lock) would deadlock against a
        thread that holds the exporter's lock and waits for the book's.

    Examples
    --------
    >>> book = StepExports(driver)  # doctest: +SKIP
    >>> grants = book.grant(7, blocks, ptr, size, msg_steps, have=set())  # doctest: +SKIP
    >>> book.pinned(blocks, grants[0].step.id)  # doctest: +SKIP
    True
    """

    def __init__(self, driver: Any, lock: Any = None) -> None:
        self._d = driver
        self.lock = lock if lock is not None else threading.RLock()
        #: placement -> step id -> receiver id -> its mappings of the step (a placement
        #: collected takes its entries with it)
        self._maps: weakref.WeakKeyDictionary[Any, dict[int, Counter[int]]] = (
            weakref.WeakKeyDictionary()
        )
        self.exported = 0  # file descriptors made
        #: placement -> the uuid its blocks' messages name (the receivers' owner key)
        self._uuids: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()

    def watch(self, placement: Any) -> None:
        """From now on ``placement`` asks this book before it unmaps a step (its
        ``set_pins``); once per placement."""
        with self.lock:
            if placement in self._uuids:
                return
            self._uuids[placement] = str(uuid.uuid4())
        placement.set_pins(self.pins_for(placement))

    def uuid_of(self, placement: Any) -> str:
        """The uuid the messages of ``placement``'s blocks name (see :meth:`watch`)."""
        self.watch(placement)
        return self._uuids[placement]

    def grant(
        self,
        cid: int,
        blocks: Any,
        ptr: int,
        size: int,
        steps: Sequence[Any],
        have: Iterable[int] = (),
    ) -> list[StepGrant]:
        """The steps of block ``[ptr, ptr + size)`` of placement ``blocks`` for receiver
        ``cid``, each with a new file descriptor unless its id is in ``have`` (steps the
        receiver holds already).  ``steps``: the message's, refused
        (:class:`StaleStepsError`) unless they are exactly the steps mapped there now.
        The caller sends the descriptors and closes them.

        The grant counts as the receiver's mapping of each step from now on (as a
        lease starts at the grant): a receiver that then fails to map says so, and
        the caller gives it back with :meth:`unmapped`.
        """
        named = check_steps(steps, ptr, size)
        now = [Step(*s) for s in blocks.steps_under(ptr, size)]
        if named != now:
            raise StaleStepsError(
                f"a message names steps {[s.id for s in named]} under block {ptr:#x} "
                f"({size} bytes) where steps {[s.id for s in now]} are mapped now: the "
                "range shrank or was mapped again since the message was made"
            )
        have = set(have)
        out: list[StepGrant] = []
        self.mapped(cid, blocks, [s.id for s in now])  # pinned before anything goes out
        try:
            for s in now:
                out.append(StepGrant(s, None if s.id in have else self._export(s.va)))
        except BaseException:
            self.unmapped(cid, blocks, [s.id for s in now])
            for g in out:
                if g.fd is not None:
                    os.close(g.fd)
            raise
        return out

    def _export(self, va: int) -> int:
        d = self._d
        handle = check_driver(d.cuMemRetainAllocationHandle(va), "cuMemRetainAllocationHandle")
        try:
            fd = check_driver(
                d.cuMemExportToShareableHandle(
                    handle,
                    d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0,
                ),
                "cuMemExportToShareableHandle",
            )
        finally:
            d.cuMemRelease(handle)
        self.exported += 1
        return int(fd)

    def mapped(self, cid: int, blocks: Any, step_ids: Iterable[int]) -> None:
        """Receiver ``cid`` mapped these steps of ``blocks`` (once more each)."""
        with self.lock:
            steps = self._maps.setdefault(blocks, {})
            for sid in step_ids:
                steps.setdefault(sid, Counter())[cid] += 1

    def unmapped(self, cid: int, blocks: Any, step_ids: Iterable[int]) -> None:
        """Receiver ``cid`` unmapped one mapping of each of these steps."""
        with self.lock:
            steps = self._maps.get(blocks, {})
            for sid in step_ids:
                who = steps.get(sid)
                if who is None or who[cid] <= 0:
                    continue  # (a duplicate, or a receiver reaped already)
                who[cid] -= 1
                if who[cid] <= 0:
                    del who[cid]
                if not who:
                    del steps[sid]

    def drop_peer(self, cid: int) -> int:
        """Receiver ``cid`` is gone (its process and mappings with it): every step it
        mapped is free of it; returns how many steps it held."""
        n = 0
        with self.lock:
            for steps in list(self._maps.values()):
                for sid in list(steps):
                    who = steps[sid]
                    if who.pop(cid, 0):
                        n += 1
                    if not who:
                        del steps[sid]
        return n

    def pinned(self, blocks: Any, step_id: int) -> bool:
        """Whether any receiver maps step ``step_id`` of ``blocks``."""
        return step_id in self._maps.get(blocks, ())

    def pins_for(self, blocks: Any) -> Any:
        """``step_id -> bool`` for ``blocks.set_pins`` (holds ``blocks`` weakly)."""
        ref = weakref.ref(blocks)
        return lambda sid: (b := ref()) is not None and self.pinned(b, sid)

    def receivers(self, blocks: Any, step_id: int) -> set[int]:
        """The receivers that map step ``step_id`` of ``blocks`` now."""
        with self.lock:
            return set(self._maps.get(blocks, {}).get(step_id, ()))


class _Window(NamedTuple):
    base: int  # this process's reservation
    size: int
    steps: tuple[Step, ...]


class StepMappings:
    """The receiver's mappings of other processes' steps.

    A block maps as one *window*: an address reservation of exactly the total size of
    the steps under it, each step's imported handle mapped at its offset.  Handles are
    imported once per (exporter, step) and kept while a window maps them; a window is
    shared by every block on the same steps.

    Parameters
    ----------
    driver
        ``cuda.bindings.driver`` (tests give a fake).
    device
        The GPU the steps' memory is on, in this process's numbering.
    peers
        Other GPUs given read-write access (the sender's grants, as for pool memory).

    Examples
    --------
    >>> maps = StepMappings(driver, 0)  # doctest: +SKIP
    >>> ptr, key = maps.map("exporter-a", block_ptr, 4096, grants)  # doctest: +SKIP
    >>> maps.unmap(key)  # doctest: +SKIP
    [1]
    """

    def __init__(self, driver: Any, device: int, peers: Iterable[int] = ()) -> None:
        self._d = driver
        self.device = device
        self._access = access_descriptors(driver, (device, *peers), ())
        self._lock = threading.RLock()
        self._handles: dict[tuple[Hashable, int], Any] = {}  # (owner, step id) -> handle
        self._windows: dict[tuple[Hashable, tuple[int, ...]], _Window] = {}
        self._users: Counter[tuple[Hashable, tuple[int, ...]]] = Counter()
        self._holds: Counter[tuple[Hashable, int]] = Counter()  # handles a claim counts on
        self.reserved = 0  # bytes of address space reserved now

    def have(self, owner: Hashable) -> set[int]:
        """Ids of the steps of ``owner`` this process holds imported."""
        with self._lock:
            return {sid for (o, sid) in self._handles if o == owner}

    def hold(self, owner: Hashable) -> tuple[int, ...]:
        """:meth:`have`, each of those handles kept imported until :meth:`let_go` of the
        same tuple (a claim naming them is under way: its reply sends no descriptor for
        them)."""
        with self._lock:
            ids = tuple(sorted(sid for (o, sid) in self._handles if o == owner))
            for sid in ids:
                self._holds[(owner, sid)] += 1
            return ids

    def let_go(self, owner: Hashable, ids: Iterable[int]) -> None:
        """The claim that :meth:`hold` ``ids`` is answered (and mapped, or not)."""
        with self._lock:
            for sid in ids:
                hk = (owner, sid)
                self._holds[hk] -= 1
                if self._holds[hk] <= 0:
                    del self._holds[hk]
                    if hk in self._handles and not self._in_window(owner, sid):
                        self._d.cuMemRelease(self._handles.pop(hk))

    def _in_window(self, owner: Hashable, sid: int) -> bool:
        return any(o == owner and sid in ids for (o, ids) in self._windows)

    def map(
        self, owner: Hashable, ptr: int, size: int, grants: Sequence[StepGrant]
    ) -> tuple[int, tuple[Hashable, tuple[int, ...]]]:
        """Map block ``[ptr, ptr + size)`` of ``owner`` (the exporter's addresses) from
        ``grants``: ``(address here, key for unmap)``.  Every descriptor in ``grants``
        is closed, whatever happens; nothing stays mapped or reserved on an error.
        """
        try:
            steps = check_steps([g.step for g in grants], ptr, size)
            with self._lock:
                key = (owner, tuple(s.id for s in steps))
                win = self._windows.get(key)
                fresh: list[tuple[Hashable, int]] = []
                if win is None:
                    try:  # (a step that fails lets go of those imported before it)
                        for step, g in zip(steps, grants, strict=True):
                            hk = (owner, step.id)
                            if hk in self._handles:
                                continue
                            if g.fd is None:
                                raise StaleStepsError(
                                    f"step {step.id} came without a file descriptor and is "
                                    "not imported in this process (claim it again)"
                                )
                            self._handles[hk] = self._import(g.fd)
                            fresh.append(hk)
                        win = self._map_window(owner, steps)
                    except BaseException:
                        for hk in fresh:
                            self._d.cuMemRelease(self._handles.pop(hk))
                        raise
                    self._windows[key] = win
                self._users[key] += 1
                return win.base + (ptr - steps[0].va), key
        finally:
            for g in grants:
                if g.fd is not None:
                    os.close(g.fd)

    def _import(self, fd: int) -> Any:
        d = self._d
        return check_driver(
            d.cuMemImportFromShareableHandle(
                fd, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            ),
            "cuMemImportFromShareableHandle",
        )

    def _map_window(self, owner: Hashable, steps: list[Step]) -> _Window:
        d = self._d
        total = sum(s.size for s in steps)
        base = int(check_driver(d.cuMemAddressReserve(total, 0, 0, 0), "cuMemAddressReserve"))
        done: list[tuple[int, int]] = []
        try:
            at = base
            for s in steps:
                check_driver(d.cuMemMap(at, s.size, 0, self._handles[(owner, s.id)], 0), "cuMemMap")
                done.append((at, s.size))
                check_driver(
                    d.cuMemSetAccess(at, s.size, self._access, len(self._access)),
                    "cuMemSetAccess",
                )
                at += s.size
        except BaseException:
            for va, n in reversed(done):
                d.cuMemUnmap(va, n)
            d.cuMemAddressFree(base, total)
            raise
        self.reserved += total
        return _Window(base, total, tuple(steps))

    def unmap(self, key: tuple[Hashable, tuple[int, ...]]) -> list[int]:
        """One user of window ``key`` let go; when it was the last, the window is
        unmapped and its reservation freed.  Returns the step ids whose imported
        handle went too (no window maps them any more): the exporter's book is told
        about those."""
        d = self._d
        with self._lock:
            if self._users[key] <= 0:
                return []
            self._users[key] -= 1
            if self._users[key]:
                return []
            del self._users[key]
            win = self._windows.pop(key)
            # Everything is undone even when a call fails; the first failure is raised.
            results = []
            at = win.base
            for s in win.steps:
                results.append((d.cuMemUnmap(at, s.size), "cuMemUnmap"))
                at += s.size
            results.append((d.cuMemAddressFree(win.base, win.size), "cuMemAddressFree"))
            self.reserved -= win.size
            owner = key[0]
            still = {sid for (o, ids) in self._windows if o == owner for sid in ids}
            # (a step a claim under way counts on stays: released by let_go)
            gone = [
                s.id for s in win.steps if s.id not in still and self._holds[(owner, s.id)] <= 0
            ]
            for sid in gone:
                results.append((d.cuMemRelease(self._handles.pop((owner, sid))), "cuMemRelease"))
        for res, call in results:
            check_driver(res, call)
        return gone

    def forget(self, owner: Hashable) -> None:
        """Unmap every window of ``owner`` (its exporter is gone or this process exits)."""
        with self._lock:
            for key in [k for k in self._windows if k[0] == owner]:
                self._users[key] = 1
                self.unmap(key)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "step_windows": len(self._windows),
                "step_handles": len(self._handles),
                "step_reserved_bytes": self.reserved,
            }
