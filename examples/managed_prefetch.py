"""Managed (unified) memory from a ManagedPool, prefetched to the host and back.

Shows a :class:`cupy_poolmem.ManagedPool`: a CuPy array on managed memory is written
on the GPU, migrated to host memory with :func:`cupy_poolmem.prefetch` (and read there
through its host address when the GPU supports concurrent managed access), migrated
back to the GPU, and used again.  It also shows :func:`cupy_poolmem.advise`, which the
CUDA 13.0 driver rejects on pool memory (``UnsupportedError``) but accepts on
``cudaMallocManaged`` memory.

The example allocates 64 MiB at most, and never more than a sixteenth of the GPU's
free memory: managed pools must stay well within the GPU's free memory.

    python examples/managed_prefetch.py

Needs: an NVIDIA GPU, a CUDA 13 driver and ``pip install -e ".[cu13]"``.
"""

from __future__ import annotations

import ctypes
import sys

MAX_BYTES = 64 << 20


def main() -> int:
    try:
        import cupy
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

    dev = 0
    cupy.cuda.Device(dev).use()
    free, total = cupy.cuda.Device(dev).mem_info
    nbytes = min(MAX_BYTES, free // 16) // 4 * 4
    if nbytes < (1 << 20):
        print(
            f"GPU {dev} has only {cupy_poolmem.format_bytes(free)} free; this example "
            "wants at least 16 MiB free",
            file=sys.stderr,
        )
        return 1
    n = nbytes // 4
    print(
        f"GPU {dev}: {cupy_poolmem.format_bytes(free)} free of "
        f"{cupy_poolmem.format_bytes(total)}; using {cupy_poolmem.format_bytes(nbytes)}"
    )

    try:
        pool = cupy_poolmem.ManagedPool(device=dev, max_size=4 * nbytes)
    except cupy_poolmem.UnsupportedError as exc:
        print(f"managed pools are not available here: {exc}", file=sys.stderr)
        return 1

    ok = True
    with pool, cupy_poolmem.using(pool):
        x = cupy.arange(n, dtype=cupy.float32)  # written on the GPU
        cupy_poolmem.prefetch(x, device="cpu")  # migrate the pages to host memory
        cupy.cuda.get_current_stream().synchronize()
        props = cupy.cuda.runtime.getDeviceProperties(dev)
        if props.get("concurrentManagedAccess"):
            host = np.ctypeslib.as_array((ctypes.c_float * n).from_address(x.data.ptr))
            good = bool(host[n - 1] == n - 1 and host[12345 % n] == 12345 % n)
            print(f"read on the host after prefetch to cpu: ok={good}")
            ok &= good
            del host
        cupy_poolmem.prefetch(x, device=dev)  # back to the GPU before using it
        cupy_poolmem.prefetch(x[: n // 2], device=dev)  # a view: only the range it spans
        y = x * 2 + 1  # no page faults: pages are on the GPU
        k = 12345 % n
        good = float(y[k]) == 2.0 * k + 1 and float(y[n - 1]) > 0
        print(f"computed on the GPU after prefetch back: ok={good}")
        ok &= good

        try:
            cupy_poolmem.advise(x, read_mostly=True)
            print("advise on managed-pool memory: accepted by this driver")
        except cupy_poolmem.UnsupportedError:
            print(
                "advise on managed-pool memory: not supported by this driver "
                "(CUDA 13.0 / driver 580); prefetch works"
            )
        print("managed pool:", pool.stats())
        del x, y

    # Advice works on cudaMallocManaged memory.
    with cupy.cuda.using_allocator(cupy.cuda.malloc_managed):
        z = cupy.ones(1 << 18, dtype=cupy.float32)
    cupy_poolmem.advise(z, preferred_location=dev, accessed_by=[dev], read_mostly=False)
    good = float(z.sum()) == float(1 << 18)
    print(f"advise on cudaMallocManaged memory: applied, data ok={good}")
    ok &= good
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
