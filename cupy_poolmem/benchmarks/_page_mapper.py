"""Sketches of the backend the churn goal asks for: large blocks mapped at 2 MiB.

A CUDA pool maps its memory in 32 MiB chunks and can give back only whole empty
chunks, so on the churn trace (``churn.py``) no CUDA-pool arrangement gets its
reserved peak below about 0.85x CuPy's ``MemoryPool``.  Virtual memory management
(``cuMemCreate`` / ``cuMemMap``) maps at the device's granularity, 2 MiB: here each
large block gets an address range of its own, backed by pages taken from a free list
(created only when the list is empty), and a freed block's pages are unmapped and
kept for the next one.  The memory reserved is then the pages ever created.
:class:`BlockMapper` instead creates each block's memory at alloc and releases it at
free: what is reserved is what is live.

This is a measurement, not a backend: it replays a trace on one stream with no
kernels.  A backend would record an event at each free and reuse or unmap the pages
only once it is done (other streams), share pages through
``cuMemExportToShareableHandle`` rather than pool IPC, and route allocations made
during a graph capture to a CUDA pool.
"""

from __future__ import annotations

from typing import Any


class PageMapper:
    """Blocks on ``page``-byte physical pages, each block in an address range of its own.

    ``drv`` does the driver work: ``create(n)`` physical memory (a handle),
    ``reserve(n)`` an address range, ``map(va, n, handle)``, ``access(va, n)`` (read
    and write for the device), ``unmap(va, n)``, ``unreserve(va, n)``,
    ``release(handle)``.

    Examples
    --------
    >>> class Log:
    ...     def __init__(self): self.n, self.calls = 0, []
    ...     def create(self, n): self.n += 1; return f"h{self.n}"
    ...     def reserve(self, n): return 1 << 30
    ...     def __getattr__(self, name): return lambda *a: self.calls.append((name, *a))
    >>> m = PageMapper(Log(), page=2 << 20)
    >>> va = m.alloc(3 << 20)  # 2 pages
    >>> m.free(va)
    >>> _ = m.alloc(4 << 20)  # the same 2 pages again: none created
    >>> m.pages, m.peak_bytes
    (2, 4194304)
    """

    def __init__(self, drv: Any, page: int) -> None:
        self.drv, self.page = drv, page
        self.free_pages: list[Any] = []
        self.blocks: dict[int, list[Any]] = {}  # address -> its pages, in order
        self.pages = 0  # pages created (the memory reserved, in pages)

    @property
    def peak_bytes(self) -> int:
        """Bytes reserved at most: pages are created, never released before close()."""
        return self.pages * self.page

    def alloc(self, size: int) -> int:
        """A block of at least ``size`` bytes (a multiple of the page); its address."""
        n = max(1, -(-size // self.page))
        va = self.drv.reserve(n * self.page)
        handles: list[Any] = []
        mapped = 0
        try:
            for i in range(n):
                if self.free_pages:
                    h = self.free_pages.pop()
                else:
                    h = self.drv.create(self.page)
                    self.pages += 1
                handles.append(h)
                self.drv.map(va + i * self.page, self.page, h)
                mapped += 1
            self.drv.access(va, n * self.page)
        except BaseException:
            # Nothing lost: the pages go back to the list, the range to the driver.
            if mapped:
                self.drv.unmap(va, mapped * self.page)
            self.free_pages.extend(handles)
            self.drv.unreserve(va, n * self.page)
            raise
        self.blocks[va] = handles
        return va

    def free(self, va: int) -> None:
        """Unmap the block at ``va``; its pages go to the free list."""
        handles = self.blocks.pop(va)
        self.drv.unmap(va, len(handles) * self.page)
        self.drv.unreserve(va, len(handles) * self.page)
        self.free_pages.extend(handles)

    def close(self) -> None:
        """Free every block and release every page."""
        for va in list(self.blocks):
            self.free(va)
        for h in self.free_pages:
            self.drv.release(h)
        self.free_pages = []


class BlockMapper:
    """Each block on physical memory of its own, created at alloc and released at free
    (no page kept): the memory reserved is what is live, rounded up to the page.  Fewer
    driver calls per block than :class:`PageMapper` (one ``cuMemCreate`` and one
    ``cuMemMap`` whatever its size), but every block pays the creation.

    Examples
    --------
    >>> class Drv:
    ...     def reserve(self, n): return 1 << 30
    ...     def create(self, n): return "h"
    ...     def __getattr__(self, name): return lambda *a: None
    >>> m = BlockMapper(Drv(), page=2 << 20)
    >>> va = m.alloc(3 << 20); m.free(va); _ = m.alloc(1 << 20)
    >>> m.peak_bytes >> 20, m.live >> 20
    (4, 2)
    """

    def __init__(self, drv: Any, page: int) -> None:
        self.drv, self.page = drv, page
        self.blocks: dict[int, tuple[Any, int]] = {}  # address -> (handle, bytes)
        self.live = 0
        self.peak_bytes = 0

    def alloc(self, size: int) -> int:
        n = max(1, -(-size // self.page)) * self.page
        h = self.drv.create(n)
        try:
            va = self.drv.reserve(n)
            try:
                self.drv.map(va, n, h)
                try:
                    self.drv.access(va, n)
                except BaseException:
                    self.drv.unmap(va, n)
                    raise
            except BaseException:
                self.drv.unreserve(va, n)
                raise
        except BaseException:
            self.drv.release(h)
            raise
        self.blocks[va] = (h, n)
        self.live += n
        self.peak_bytes = max(self.peak_bytes, self.live)
        return va

    def free(self, va: int) -> None:
        h, n = self.blocks.pop(va)
        self.drv.unmap(va, n)
        self.drv.unreserve(va, n)
        self.drv.release(h)
        self.live -= n

    def close(self) -> None:
        for va in list(self.blocks):
            self.free(va)


class DriverPages:
    """:class:`PageMapper`'s driver work on the current device, through cuda.bindings."""

    def __init__(self, device: int) -> None:
        from cuda.bindings import driver as drv

        from .._mapped import device_allocation

        self._d = drv
        self._prop, self.page = device_allocation(drv, device)
        desc = drv.CUmemAccessDesc()
        desc.location = self._prop.location
        desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._desc = [desc]

    def _check(self, result: Any, what: str) -> Any:
        err = result[0] if isinstance(result, tuple) else result
        if int(err):
            raise RuntimeError(f"{what} failed: {getattr(err, 'name', err)}")
        return result[1] if isinstance(result, tuple) and len(result) > 1 else None

    def create(self, n: int) -> Any:
        return self._check(self._d.cuMemCreate(n, self._prop, 0), "cuMemCreate")

    def reserve(self, n: int) -> int:
        return int(self._check(self._d.cuMemAddressReserve(n, self.page, 0, 0), "reserve"))

    def map(self, va: int, n: int, handle: Any) -> None:
        self._check(self._d.cuMemMap(va, n, 0, handle, 0), "cuMemMap")

    def access(self, va: int, n: int) -> None:
        self._check(self._d.cuMemSetAccess(va, n, self._desc, 1), "cuMemSetAccess")

    def unmap(self, va: int, n: int) -> None:
        self._check(self._d.cuMemUnmap(va, n), "cuMemUnmap")

    def unreserve(self, va: int, n: int) -> None:
        self._check(self._d.cuMemAddressFree(va, n), "cuMemAddressFree")

    def release(self, handle: Any) -> None:
        self._check(self._d.cuMemRelease(handle), "cuMemRelease")
