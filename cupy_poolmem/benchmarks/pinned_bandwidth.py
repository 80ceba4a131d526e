"""Pinned host <-> device bandwidth: PinnedPool vs cudaHostAlloc (CuPy) vs a default cuda.core pool.

``python benchmarks/pinned_bandwidth.py``: one table, GB/s and ratio to cudaHostAlloc.
"""

from __future__ import annotations

from collections.abc import Sequence

import cupy

import cupy_poolmem

from ._common import header, require_gpu, table


def bandwidth(host_ptr: int, dev_ptr: int, n: int, kind: int, reps: int = 10) -> float:
    s = cupy.cuda.Stream(non_blocking=True)
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(2):
        cupy.cuda.runtime.memcpyAsync(
            dev_ptr if kind == 1 else host_ptr, host_ptr if kind == 1 else dev_ptr, n, kind, s.ptr
        )
    e0.record(s)
    for _ in range(reps):
        cupy.cuda.runtime.memcpyAsync(
            dev_ptr if kind == 1 else host_ptr, host_ptr if kind == 1 else dev_ptr, n, kind, s.ptr
        )
    e1.record(s)
    e1.synchronize()
    return reps * n / (cupy.cuda.get_elapsed_time(e0, e1) / 1e3) / 1e9


def main(argv: Sequence[str] | None = None) -> None:
    import cuda.core as cc

    require_gpu("pinned_bandwidth")

    print(header("pinned bandwidth: GB/s (ratio to cudaHostAlloc)"))
    rows = []
    for n in (16 << 20, 256 << 20):
        d = cupy.empty(n, dtype=cupy.uint8)
        ref_mem = cupy.cuda.alloc_pinned_memory(n)  # CuPy's PinnedMemoryPool: cudaHostAlloc
        pool = cupy_poolmem.PinnedPool()
        ours = pool.malloc(n)
        plain = cc.PinnedMemoryResource(cc.PinnedMemoryResourceOptions())
        buf = plain.allocate(n, stream=cc.Device().default_stream)
        cupy.cuda.runtime.deviceSynchronize()
        peers = [
            ("cudaHostAlloc (cupy PinnedMemoryPool)", ref_mem.ptr),
            ("cupy_poolmem PinnedPool", ours.ptr),
            ("cuda.core PinnedMemoryResource default", int(buf.handle)),
        ]
        ref: dict[str, float] = {}
        for name, ptr in peers:
            h2d = bandwidth(ptr, d.data.ptr, n, 1)
            d2h = bandwidth(ptr, d.data.ptr, n, 2)
            if not ref:
                ref = {"h2d": h2d, "d2h": d2h}
            rows.append(
                [
                    f"{n >> 20} MiB",
                    name,
                    f"{h2d:6.1f} ({h2d / ref['h2d']:.2f}x)",
                    f"{d2h:6.1f} ({d2h / ref['d2h']:.2f}x)",
                ]
            )
        buf.close()
        del ours
        pool.close()
    print(table(["size", "host memory", "H2D GB/s", "D2H GB/s"], rows))


if __name__ == "__main__":
    main()
