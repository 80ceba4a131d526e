"""Pinned staging buffers from a NUMA-local PinnedPool, overlapped with asynchronous copies.

Shows a :class:`cupy_poolmem.PinnedPool` serving ``cupyx.empty_pinned``: a stream of
host data goes to the GPU through two pairs of pinned staging buffers, so the copies of
one chunk overlap the computation on the other (two non-blocking streams,
``ndarray.set`` and ``ndarray.get(blocking=False)``).  Then it times one large
host-to-device copy from the pool, from CuPy's ``cudaHostAlloc`` memory and from
ordinary (pageable) memory: the pool's copies run at ``cudaHostAlloc`` speed because
the GPUs are granted access to it (see docs/pinned_pool.rst).

    python examples/pinned_staging.py

Needs: an NVIDIA GPU and ``pip install -e ".[cu13]"``.
"""

from __future__ import annotations

import sys

CHUNK = 1 << 22  # float32 elements per chunk (16 MiB)
N_CHUNKS = 8
BENCH_BYTES = 64 << 20


def h2d_gbps(cupy, host, dev) -> float:
    """GB/s of one host-to-device copy of ``host`` into ``dev`` (after a warm-up)."""
    s = cupy.cuda.Stream(non_blocking=True)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    dev.set(host, stream=s)
    start.record(s)
    for _ in range(5):
        dev.set(host, stream=s)
    stop.record(s)
    stop.synchronize()
    return 5 * host.nbytes / (cupy.cuda.get_elapsed_time(start, stop) / 1e3) / 1e9


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

    cupy_poolmem.set_allocator()  # device memory, stream-ordered
    pinned = cupy_poolmem.PinnedPool()  # NUMA node of the current GPU
    print(
        f"PinnedPool on NUMA node {pinned.numa_node} (GPU 0 is nearest node "
        f"{cupy_poolmem.nearest_numa_node(0)}), GPUs with access: {pinned.devices}"
    )

    data = np.random.default_rng(0).random(N_CHUNKS * CHUNK, dtype=np.float32)
    result = np.empty_like(data)
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    with cupy_poolmem.using(pinned):  # cupyx.empty_pinned -> the pool
        stage_in = [cupyx.empty_pinned((CHUNK,), dtype=np.float32) for _ in range(2)]
        stage_out = [cupyx.empty_pinned((CHUNK,), dtype=np.float32) for _ in range(2)]

    pending: list[int | None] = [None, None]  # chunk waiting in stage_out[k]

    def collect(k: int) -> None:
        streams[k].synchronize()  # buffers k are free again
        i = pending[k]
        if i is not None:
            result[i * CHUNK : (i + 1) * CHUNK] = stage_out[k]
            pending[k] = None

    for i in range(N_CHUNKS):
        k = i % 2
        collect(k)
        stage_in[k][:] = data[i * CHUNK : (i + 1) * CHUNK]
        with streams[k]:
            d = cupy.empty(CHUNK, dtype=np.float32)
            d.set(stage_in[k])  # host -> device, asynchronous
            r = cupy.sqrt(d) * 2 + 1  # overlaps the other stream's copies
            r.get(out=stage_out[k], blocking=False)  # device -> host, asynchronous
            del d, r  # freed on this stream, in order
        pending[k] = i
    collect(0)
    collect(1)
    ok = bool(np.allclose(result, np.sqrt(data) * 2 + 1, rtol=1e-6))
    print(f"{N_CHUNKS} chunks of {CHUNK * 4 >> 20} MiB through 2 streams: result ok={ok}")

    # A freed pinned block waits for its stream's work before it is reused, so dropping
    # a staging buffer right after queueing a copy from it is safe.
    stage_in.clear()
    stage_out.clear()
    print("pinned pool:", pinned.stats())

    dev = cupy.empty(BENCH_BYTES, dtype=cupy.uint8)
    with cupy_poolmem.using(pinned):
        ours = cupyx.empty_pinned((BENCH_BYTES,), dtype=np.uint8)
    host_alloc = cupyx.empty_pinned((BENCH_BYTES,), dtype=np.uint8)  # CuPy's own pool
    pageable = np.ones(BENCH_BYTES, dtype=np.uint8)
    for name, buf in [
        ("PinnedPool", ours),
        ("cudaHostAlloc (CuPy)", host_alloc),
        ("pageable numpy", pageable),
    ]:
        buf[:] = 1
        print(
            f"  host -> device, {BENCH_BYTES >> 20} MiB from {name:22s} "
            f"{h2d_gbps(cupy, buf, dev):6.1f} GB/s"
        )
    del ours
    pinned.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
