"""Dask on GPUs with every worker allocating from cupy_poolmem pools.

Starts a ``LocalCUDACluster`` (one worker per visible GPU), registers
:class:`cupy_poolmem.dask.PoolmemPlugin`, runs a CuPy-backed Dask array computation
and prints each worker's pool statistics.

    python examples/dask_cuda_plugin.py [--pool-size 0.5] [--maximum-pool-size 0.9]

Needs: a GPU, ``pip install dask distributed dask-cuda``.
"""

from __future__ import annotations

import argparse
import sys


def gpu_random(seed, block_info=None):
    """One chunk of uniform random numbers, made on the worker's GPU."""
    import cupy

    info = block_info[None]
    row, col = info["chunk-location"]
    return cupy.random.default_rng(seed * 100_003 + row * 1009 + col).random(info["chunk-shape"])


def main() -> int:
    ap = argparse.ArgumentParser(description="Dask + cupy_poolmem on LocalCUDACluster")
    ap.add_argument("--pool-size", default="0.25", help="reserved up front (bytes or fraction)")
    ap.add_argument("--maximum-pool-size", default=None, help="cap (bytes or fraction)")
    ap.add_argument("--n", type=int, default=10000, help="array side")
    ap.add_argument("--chunk", type=int, default=1000, help="chunk side")
    ap.add_argument("--n-workers", type=int, default=None, help="default: one per GPU")
    args = ap.parse_args()

    import cupy_poolmem

    if cupy_poolmem.device_count() == 0:
        print("this example needs an NVIDIA GPU (CUDA sees none here)", file=sys.stderr)
        return 1
    try:
        import cupy
        import dask.array as da
        from dask_cuda import LocalCUDACluster
        from distributed import Client
    except ImportError as exc:
        print(f"this example needs dask, distributed and dask-cuda: {exc}", file=sys.stderr)
        return 1
    from cupy_poolmem.dask import PoolmemPlugin, gather_stats

    plugin = PoolmemPlugin(pool_size=args.pool_size, maximum_pool_size=args.maximum_pool_size)
    with (
        LocalCUDACluster(n_workers=args.n_workers, threads_per_worker=4) as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(plugin)  # also re-applied to workers that restart
        print(f"{plugin} on {len(client.scheduler_info()['workers'])} worker(s)")

        n, c = args.n, args.chunk
        blocks = (c,) * (n // c) + ((n % c,) if n % c else ())
        x = da.map_blocks(
            gpu_random, 0, chunks=(blocks, blocks), dtype="f8", meta=cupy.empty((0, 0), dtype="f8")
        )
        result = ((x + x.T) * 2 - 1).mean(0).sum().compute()
        print(f"((x + x.T) * 2 - 1).mean(0).sum() = {float(result):.3f}  (expected about {n})")

        for worker, st in gather_stats(client).items():
            print(
                f"{worker}: {st['n_allocs']:,} allocations, peak used "
                f"{cupy_poolmem.format_bytes(st['peak_used_bytes'])}, reserved "
                f"{cupy_poolmem.format_bytes(st['reserved_bytes'])}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
