"""Allocation speed: cupy.empty(n)+free and a temporaries-heavy chain, pools side by side.

Prints one table: microseconds per operation and the ratio to CuPy's MemoryPool,
all measured in this process and run.  ``python benchmarks/alloc.py [--quick]``
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cupy  # noqa: E402
from _common import header, median_time, table  # noqa: E402

import cupy_poolmem  # noqa: E402


def peers() -> list[tuple[str, object, object]]:
    """(name, malloc, cleanup) for every allocator measured."""
    out = []
    mp = cupy.cuda.MemoryPool()
    out.append(("cupy MemoryPool (baseline)", mp.malloc, mp.free_all_blocks))
    ap = cupy.cuda.MemoryAsyncPool()
    out.append(("cupy MemoryAsyncPool", ap.malloc, None))
    try:
        import rmm
        from rmm.allocators.cupy import rmm_cupy_allocator

        rmm.reinitialize(pool_allocator=True)
        out.append(("rmm pool (rmm_cupy_allocator)", rmm_cupy_allocator, None))
    except Exception as exc:
        print(f"(rmm not measured: {type(exc).__name__}: {exc})")
    pool = cupy_poolmem.DevicePool()
    out.append((f"cupy_poolmem DevicePool [{cupy_poolmem.hotpath_implementation()}]",
                pool.malloc, pool.close))
    alloc = cupy_poolmem.set_allocator(ipc=False)
    cupy.cuda.set_allocator(mp.malloc)
    out.append(("cupy_poolmem set_allocator() dispatch", alloc, alloc.close))
    from cupy_poolmem import _hotpath_py
    from cupy_poolmem._pools import DevicePool

    class PyPool(_hotpath_py.PoolCore, DevicePool):  # the pure-Python twin, same pool code
        pass

    try:
        py = PyPool()
        out.append(("cupy_poolmem DevicePool [pure python]", py.malloc, py.close))
    except Exception as exc:
        print(f"(pure-python twin not measured: {exc})")
    return out


def main() -> None:
    quick = "--quick" in sys.argv
    n = 3000 if quick else 20000
    print(header("allocation benchmark: microseconds per op (ratio to cupy MemoryPool)"))
    cases = [("empty 1KiB", 1 << 10), ("empty 1MiB", 1 << 20), ("empty 64MiB", 64 << 20)]
    x = cupy.arange(10000, dtype=cupy.float32)

    def chain():
        return ((x * 2 + 1) ** 2 - x).sum()

    rows, base = [], {}
    for name, malloc, cleanup in peers():
        vals = []
        with cupy.cuda.using_allocator(malloc):
            for _label, size in cases:
                vals.append(median_time(lambda size=size: cupy.empty(size, dtype=cupy.uint8), n))
            vals.append(median_time(chain, n // 4))
            cupy.cuda.get_current_stream().synchronize()
        if not base:
            base = dict(enumerate(vals))
        rows.append([name] + [f"{v * 1e6:7.2f} us ({v / base[i]:.2f}x)" for i, v in enumerate(vals)])
        if cleanup:
            cleanup()
    print(table(["allocator"] + [c[0] for c in cases] + ["chain 10k f32"], rows))


if __name__ == "__main__":
    main()
