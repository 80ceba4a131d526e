"""First-fit placement in one growing address range: the twin of ``_arena.pyx``.

An :class:`Arena` hands out pieces of an address range mapped by its owner
(:mod:`._expandable`) and takes them back; it knows nothing of CUDA.  The pure-Python
hot path uses it; ``tests/test_arena_cpu.py`` checks both on the same traces.  See
docs/device_pool.rst, "How it works".
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

__all__ = ["Arena", "UNIT"]

UNIT = 512  # every span's size and address are multiples of this
_ADDR = (1 << 64) - 1


class Arena:
    """Free and live spans of one address range, placed first fit by address.

    Parameters
    ----------
    base : int
        The range's first address (a multiple of :data:`UNIT`).
    limit : int
        The most bytes it may grow to (its reserved address range).
    stream_ptr : int
        The stream whose blocks it holds (the owner's key).
    stream : object, optional
        That stream's object, kept alive while the arena is (so its handle names no
        other stream meanwhile).

    Examples
    --------
    >>> a = Arena(0x10000, limit=1 << 20, stream_ptr=0)
    >>> a.take(100)  # nothing mapped yet
    0
    >>> a.extend(4096)
    >>> p, q = a.take(100), a.take(1000)
    >>> hex(p), hex(q), a.free_bytes
    ('0x10000', '0x10200', 2560)
    >>> a.give(p), a.give(q), a.free_bytes, a.spans()
    (512, 1024, 4096, [(65536, 4096, True)])
    """

    def __init__(self, base: int, limit: int, stream_ptr: int, stream: Any = None) -> None:
        self.base = self.top = int(base)
        self.limit = int(limit)
        self.stream_ptr = int(stream_ptr)
        self.stream = stream
        self.free_bytes = 0
        self.n_live = 0
        self._addrs: list[int] = []  # span starts, ascending
        self._sizes: list[int] = []
        self._free: list[bool] = []
        self._holes: list[int] = []  # size << 64 | addr of the free spans, ascending
        self._lock = threading.RLock()
        self._busy = False  # a call is changing the spans (its thread holds the lock)
        self._queued: list[int] = []  # gives from a collection inside that call

    def _call(self, fn: Any, arg: int) -> Any:
        """``fn(arg)`` under the lock, then the gives queued meanwhile; the lock held."""
        self._busy = True
        try:
            out = fn(arg)
            while self._queued:
                self._give(self._queued.pop())
        finally:
            self._busy = False
        return out

    def _nested(self, what: str) -> None:
        raise RuntimeError(f"Arena.{what} inside a garbage collection inside another call")

    @property
    def mapped(self) -> int:
        """Bytes from ``base`` to ``top``: what the owner has mapped."""
        return self.top - self.base

    def _at(self, addr: int) -> int:
        i = bisect.bisect_left(self._addrs, addr)
        return i if i < len(self._addrs) and self._addrs[i] == addr else -1

    def _unhole(self, i: int) -> None:
        self._holes.pop(bisect.bisect_left(self._holes, self._sizes[i] << 64 | self._addrs[i]))

    def _hole(self, i: int) -> None:
        bisect.insort(self._holes, self._sizes[i] << 64 | self._addrs[i])

    def take(self, size: int) -> int:
        """The address of a new live span of ``size`` bytes (rounded up to
        :data:`UNIT`, at least one unit) at the start of the lowest free span that
        fits; 0 when no free span is that large."""
        if size > self.limit:
            return 0
        r = max(UNIT, (size + UNIT - 1) // UNIT * UNIT)
        with self._lock:
            return 0 if self._busy else self._call(self._take, r)

    def _take(self, r: int) -> int:
        h = bisect.bisect_left(self._holes, r << 64)
        if h == len(self._holes):
            return 0
        for k in range(h + 1, len(self._holes)):  # the lowest address among them
            if self._holes[k] & _ADDR < self._holes[h] & _ADDR:
                h = k
        key = self._holes.pop(h)
        hs, ha = key >> 64, key & _ADDR
        i = self._at(ha)
        self._sizes[i], self._free[i] = r, False
        if hs > r:
            self._addrs.insert(i + 1, ha + r)
            self._sizes.insert(i + 1, hs - r)
            self._free.insert(i + 1, True)
            self._hole(i + 1)
        self.free_bytes -= r
        self.n_live += 1
        return ha

    def give(self, addr: int) -> int:
        """Free the live span at ``addr``, merged with its free neighbours; returns its
        size, or 0 when no live span starts there (nothing changes); 1 when it is
        queued behind a call of this thread under way (a collection inside it)."""
        with self._lock:
            if self._busy:
                self._queued.append(addr)
                return 1
            return self._call(self._give, addr)

    def _give(self, addr: int) -> int:
        i = self._at(addr)
        if i < 0 or self._free[i]:
            return 0
        size = self._sizes[i]
        self.free_bytes += size
        self.n_live -= 1
        self._free[i] = True
        if i + 1 < len(self._addrs) and self._free[i + 1]:
            self._unhole(i + 1)
            self._sizes[i] += self._sizes[i + 1]
            self._drop(i + 1)
        if i > 0 and self._free[i - 1]:
            self._unhole(i - 1)
            self._sizes[i - 1] += self._sizes[i]
            self._drop(i)
            i -= 1
        self._hole(i)
        return size

    def _drop(self, i: int) -> None:
        del self._addrs[i], self._sizes[i], self._free[i]

    def extend(self, n: int) -> None:
        """Add the ``n`` bytes above ``top`` (mapped by the owner) as free room."""
        if n <= 0 or n % UNIT or self.mapped + n > self.limit:
            raise ValueError(f"cannot extend the arena at {self.base:#x} by {n} bytes")
        with self._lock:
            if self._busy:
                self._nested("extend")
            self._call(self._extend, n)

    def _extend(self, n: int) -> None:
        if self._free and self._free[-1]:
            last = len(self._addrs) - 1
            self._unhole(last)
            self._sizes[last] += n
            self._hole(last)
        else:
            self._addrs.append(self.top)
            self._sizes.append(n)
            self._free.append(True)
            self._hole(len(self._addrs) - 1)
        self.top += n
        self.free_bytes += n

    @property
    def tail_free(self) -> int:
        """Bytes of the free span that ends at ``top`` (0 when the last span is live)."""
        return self._sizes[-1] if self._free and self._free[-1] else 0

    def cut_tail(self, n: int) -> bool:
        """Take the top ``n`` bytes out of the arena if they are free (before the owner
        unmaps them), in one step: False, and nothing changes, when they are not."""
        if n <= 0 or n % UNIT:
            raise ValueError(f"cannot cut {n} bytes from the arena at {self.base:#x}")
        with self._lock:
            if self._busy:
                self._nested("cut_tail")
            return bool(self._call(self._cut, n))

    def retire(self) -> None:
        """Take nothing more (the owner unmaps the range): every ``take`` answers 0."""
        self.limit = 0

    def _cut(self, n: int) -> bool:
        if n > self.tail_free:
            return False
        last = len(self._addrs) - 1
        self._unhole(last)
        self._sizes[last] -= n
        if self._sizes[last]:
            self._hole(last)
        else:
            self._drop(last)
        self.top -= n
        self.free_bytes -= n
        return True

    def spans(self) -> list[tuple[int, int, bool]]:
        """``[(address, bytes, free), ...]`` in address order."""
        return list(zip(self._addrs, self._sizes, self._free))

    def holes(self) -> list[tuple[int, int]]:
        """``[(bytes, address), ...]`` of the free spans, smallest first."""
        return [(k >> 64, k & _ADDR) for k in self._holes]
