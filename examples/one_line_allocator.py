"""CuPy on stream-ordered pools with one line each: device memory and pinned host memory.

Shows :func:`cupy_poolmem.set_allocator` (one :class:`~cupy_poolmem.DevicePool` per
GPU, created the first time each GPU allocates) and
:func:`cupy_poolmem.set_pinned_memory_allocator` (one :class:`~cupy_poolmem.PinnedPool`
per NUMA node), runs a small computation on every visible GPU, copies the result to
pinned host memory, and prints each pool's statistics before and after the arrays
are freed.

    python examples/one_line_allocator.py

Needs: an NVIDIA GPU and ``pip install -e ".[cu13]"``.
"""

from __future__ import annotations

import sys


def main() -> int:
    try:
        import cupy
        import cupyx
        import numpy as np

        import cupy_poolmem
    except ImportError as exc:
        print(f"this example needs CuPy and cupy_poolmem: {exc}", file=sys.stderr)
        return 1
    if cupy_poolmem.device_count() == 0:
        print(
            "this example needs an NVIDIA GPU and its driver, and this machine has none "
            "(cupy_poolmem.device_count() == 0)",
            file=sys.stderr,
        )
        return 1

    alloc = cupy_poolmem.set_allocator()  # the one line for device memory
    cupy_poolmem.set_pinned_memory_allocator()  # the one line for pinned memory
    print(f"hot path: {cupy_poolmem.hotpath_implementation()}")

    ok = True
    results = []
    for dev in range(cupy_poolmem.device_count()):
        with cupy.cuda.Device(dev):
            x = cupy.random.default_rng(dev).random((1024, 1024), dtype=cupy.float32)
            y = (x @ x.T + 1).sum(axis=0)  # temporaries come from the pool
            h = cupyx.empty_pinned(y.shape, dtype=y.dtype)
            y.get(out=h)  # device -> pinned host
            ref = (
                cupy.asnumpy(x).astype(np.float64) @ cupy.asnumpy(x).T.astype(np.float64) + 1
            ).sum(axis=0)
            good = bool(np.allclose(h, ref, rtol=1e-3))
            ok &= good
            print(f"GPU {dev}: result ok={good}; {alloc.pool(dev).stats()}")
            results.append((x, y, h))

    del x, y, h
    results.clear()  # frees, stream-ordered
    cupy.cuda.get_current_stream().synchronize()
    for dev, pool in sorted(alloc.pools().items()):
        s = pool.stats()
        print(
            f"GPU {dev} after del: used {cupy_poolmem.format_bytes(s.used_bytes)}, "
            f"peak {cupy_poolmem.format_bytes(s.peak_used_bytes)}, reserved "
            f"{cupy_poolmem.format_bytes(s.reserved_bytes)} (kept for reuse)"
        )
    print("pinned pool:", cupy_poolmem.get_pinned_pool(0).stats())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
