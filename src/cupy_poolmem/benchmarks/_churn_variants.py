"""What CUDA pools themselves allow on the churn trace: splits by size and trims.

The trace replayed straight on CUDA pools, with a second pool for small blocks and
trims after frees; the method: docs/cli.rst, "bench churn".
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

#: (label, split bytes or 0, trim before an allocation that follows frees)
VARIANTS: list[tuple[str, int, bool]] = [
    ("one CUDA pool", 0, False),
    ("one CUDA pool, trim after frees", 0, True),
    ("two CUDA pools split at 1 MiB", 1 << 20, False),
    ("two CUDA pools split at 1 MiB, trim after frees", 1 << 20, True),
    ("two CUDA pools split at 8 MiB, trim after frees", 8 << 20, True),
]


@dataclass
class VariantResult:
    """One variant's replay: seconds per step, reserved high-water (bytes), trims."""

    label: str
    seconds_per_step: float
    peak_reserved: int
    trims: int


def pool_for(size: int, split: int) -> int:
    """Index of the pool a ``size``-byte block comes from: 0 (small, or the only pool)
    or 1 (above ``split``).

    Examples
    --------
    >>> pool_for(4096, 0), pool_for(4096, 1 << 20), pool_for(2 << 20, 1 << 20)
    (0, 0, 1)
    >>> pool_for(1 << 20, 1 << 20)  # the split size itself is small
    0
    """
    return 1 if split and size > split else 0


def replay_on(
    steps: list[tuple[int, list[int]]], ops: Any, split: int, trim: bool
) -> tuple[int, int]:
    """Replay ``steps`` with ``ops`` (``alloc(i, size)``, ``free(ptr)``, ``trim(i)``);
    ``(trims, blocks left live)``.  Every live block is freed at the end.

    Examples
    --------
    >>> class Ops:
    ...     def __init__(self): self.log, self.n = [], 0
    ...     def alloc(self, i, size): self.n += 1; self.log.append(("a", i)); return self.n
    ...     def free(self, ptr): self.log.append(("f", ptr))
    ...     def trim(self, i): self.log.append(("t", i))
    >>> ops = Ops()
    >>> replay_on([(10, []), (2 << 20, [0])], ops, split=1 << 20, trim=True)
    (1, 1)
    >>> ops.log
    [('a', 0), ('f', 1), ('t', 0), ('t', 1), ('a', 1), ('f', 2)]
    """
    live: list[int] = []
    trims = 0
    n_pools = 2 if split else 1
    for size, frees in steps:
        for i in frees:
            ops.free(live[i])
            live[i] = live[-1]
            live.pop()
        if trim and frees:
            for i in range(n_pools):
                ops.trim(i)
            trims += 1
        live.append(ops.alloc(pool_for(size, split), size))
    left = len(live)
    for ptr in live:
        ops.free(ptr)
    return trims, left


class _DriverOps:
    """CUDA pools of the current device, driven through cuda.bindings."""

    def __init__(self, n_pools: int) -> None:
        import cupy
        from cuda.bindings import driver as drv
        from cuda.core import DeviceMemoryResource, DeviceMemoryResourceOptions

        self._drv = drv
        dev = cupy.cuda.runtime.getDevice()
        opts = DeviceMemoryResourceOptions(ipc_enabled=False)
        self._mrs = [DeviceMemoryResource(dev, opts) for _ in range(n_pools)]
        self.pools = [drv.CUmemoryPool(int(mr.handle)) for mr in self._mrs]
        keep_all = drv.cuuint64_t((1 << 64) - 1)  # as a DevicePool: nothing released at syncs
        for p in self.pools:
            drv.cuMemPoolSetAttribute(
                p, drv.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, keep_all
            )
        self._stream = drv.CUstream(0)

    def alloc(self, i: int, size: int) -> Any:
        err, p = self._drv.cuMemAllocFromPoolAsync(size, self.pools[i], self._stream)
        if int(err):
            raise RuntimeError(f"cuMemAllocFromPoolAsync({size}) failed: {err.name}")
        return p

    def free(self, ptr: Any) -> None:
        self._drv.cuMemFreeAsync(ptr, self._stream)

    def trim(self, i: int) -> None:
        self._drv.cuMemPoolTrimTo(self.pools[i], 0)

    def peak_reserved(self) -> int:
        attr = self._drv.CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH
        return sum(int(self._drv.cuMemPoolGetAttribute(p, attr)[1]) for p in self.pools)

    def close(self) -> None:
        for mr in self._mrs:
            mr.close()


def measure_variants(steps: list[tuple[int, list[int]]]) -> list[VariantResult]:
    """Replay ``steps`` on each of :data:`VARIANTS` (needs a GPU)."""
    import cupy

    out = []
    for label, split, trim in VARIANTS:
        ops = _DriverOps(2 if split else 1)
        t0 = time.perf_counter()
        trims, _ = replay_on(steps, ops, split, trim)
        cupy.cuda.runtime.deviceSynchronize()
        dt = (time.perf_counter() - t0) / len(steps)
        out.append(VariantResult(label, dt, ops.peak_reserved(), trims))
        ops.close()
    return out
