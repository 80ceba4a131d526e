"""Numba and CuPy on one memory pool, and a Numba array shared with another process.

1. Numba allocates from cupy_poolmem's pool (the EMM plugin); a Numba kernel fills
   an array, CuPy reads the same memory without a copy, and the pool's statistics
   count both libraries' allocations.
2. The array's IPC handle goes to a second process through a multiprocessing queue;
   that process reads the data, writes new values into the same memory, and closes
   its handle; the first process sees the new values.

    python examples/numba_shared_pool.py
    NUMBA_CUDA_MEMORY_MANAGER=cupy_poolmem.numba python examples/numba_shared_pool.py

Needs: a GPU and ``pip install numba-cuda[cu13]``.
"""

from __future__ import annotations

import multiprocessing as mp
import sys

N = 1 << 20


def consumer(inbox, outbox) -> None:
    """Second process: open the handle, check the data, write back, close."""
    import numpy as np
    from numba import cuda

    handle = inbox.get(timeout=120)
    with handle as arr:  # opens the IPC handle; closes it (and frees the import) on exit
        ok = np.array_equal(arr.copy_to_host(), np.arange(N, dtype=np.float32) * 3 + 1)
        arr.copy_to_device(np.full(N, 7, dtype=np.float32))
        cuda.synchronize()  # the write must be done before the producer is told
    outbox.put(ok)


def main() -> int:
    try:
        import numpy as np

        if not hasattr(np, "row_stack"):  # numba-cuda <= 0.30 still names it; NumPy 2.5 dropped it
            np.row_stack = np.vstack
        from numba import cuda
    except ImportError as exc:
        print(f"this example needs numba-cuda: {exc}", file=sys.stderr)
        return 1
    import cupy

    import cupy_poolmem
    import cupy_poolmem.numba

    if cupy_poolmem.device_count() == 0:
        print("this example needs an NVIDIA GPU", file=sys.stderr)
        return 1

    # Before Numba creates its context (or set NUMBA_CUDA_MEMORY_MANAGER instead).
    cuda.set_memory_manager(cupy_poolmem.numba.PoolmemNumbaManager)
    cupy_poolmem.set_allocator(ipc=True)  # CuPy's pool, now Numba's too
    pool = cupy_poolmem.get_pool()

    @cuda.jit
    def fill(a):
        i = cuda.grid(1)
        if i < a.size:
            a[i] = 3 * i + 1

    d = cuda.device_array(N, dtype=np.float32)  # from the pool
    fill[(N + 255) // 256, 256](d)
    c = cupy.asarray(d)  # zero-copy: same memory
    print(
        "CuPy reads the Numba array:",
        c[:4],
        "| all values ok:",
        bool((c == 3 * cupy.arange(N, dtype=cupy.float32) + 1).all()),
    )
    print("pool after Numba + CuPy:", pool.stats())

    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=consumer, args=(inbox, outbox))
    proc.start()
    inbox.put(d.get_ipc_handle())  # pool IPC: the pool's fd travels with the handle
    ok = outbox.get(timeout=120)
    proc.join(timeout=60)
    if proc.is_alive():
        proc.kill()
    print("consumer read the data:", ok, "| consumer's write visible here:", bool((c == 7).all()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
