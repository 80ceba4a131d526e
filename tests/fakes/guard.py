"""A fake of the guard's device work (``_guard.device_ops.DeviceOps``) and a recycling heap.

``FakeOps`` keeps device memory as a sparse ``{address: byte}`` map: ``fill`` writes a
pattern, ``find`` compares, ``write`` plays a kernel that writes where it should not.
``Heap`` replaces the hot path's driver allocation so that freed addresses come back
(last freed, first reused), as a CUDA pool's do.  Both record their calls in order in
``world.log``, next to ``tests/fakes/hotpath.World``'s own entries.
"""

from __future__ import annotations

import itertools
from typing import Any

from cupy_poolmem import _hotpath_py as twin


class FakeOps:
    def __init__(self, world: Any) -> None:
        self.world = world
        self.mem: dict[int, int] = {}
        self.non_blocking_streams: set[int] = set()
        self.capturing_streams: set[int] = set()
        self.underway = False
        self.fail_find = False
        self.n_find = 0

    # -- the interface the guard calls -------------------------------------------------
    def fill(self, ptr: int, n: int, byte: int, stream: Any) -> None:
        for a in range(ptr, ptr + n):
            self.mem[a] = byte
        self.world.log.append(("fill", ptr, n, byte, int(stream.ptr)))

    def find(self, ptr: int, n: int, byte: int, stream: Any) -> tuple[int, int]:
        if self.fail_find:
            raise RuntimeError("fake find failed")
        self.n_find += 1
        self.world.log.append(("find", ptr, n, byte, int(stream.ptr)))
        diff = [i for i in range(n) if self.mem.get(ptr + i) != byte]
        return (diff[0] if diff else -1), len(diff)

    def current_stream(self) -> int:
        return int(self.world.current.ptr)

    def non_blocking(self, stream_ptr: int) -> bool:
        return stream_ptr in self.non_blocking_streams

    def capturing(self, stream_ptr: int) -> bool:
        return stream_ptr in self.capturing_streams

    def capture_underway(self) -> bool:
        return self.underway

    # -- what a buggy kernel does ------------------------------------------------------
    def write(self, addr: int, data: bytes) -> None:
        for i, b in enumerate(data):
            self.mem[addr + i] = b

    def read(self, addr: int, n: int) -> bytes:
        return bytes(self.mem.get(addr + i, 0) for i in range(n))


class Heap:
    """Driver allocations that reuse freed addresses (LIFO), as a pool does."""

    def __init__(self, world: Any, monkeypatch: Any) -> None:
        self.world = world
        self.free: list[int] = []
        self.fresh = itertools.count(0x100000, 0x10000)
        monkeypatch.setattr(twin.driver, "alloc", self._alloc)
        monkeypatch.setattr(twin.driver, "free", self._free)

    def _alloc(self, size: int, pool: Any, sptr: int) -> tuple[int, int]:
        p = self.free.pop() if self.free else next(self.fresh)
        self.world.log.append(("alloc", p, size, int(sptr)))
        return 0, p

    def _free(self, ptr: int, sptr: int) -> tuple[int]:
        self.free.append(int(ptr))
        self.world.log.append(("free", int(ptr), int(sptr)))
        return (0,)
