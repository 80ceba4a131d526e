"""Dask workloads on one GPU worker: the cupy_poolmem plugin against dask-cuda's allocators.

Seconds per ``compute()`` of a compute-bound and an allocation-heavy graph, for each
configuration.  The configurations and workloads: docs/cli.rst, "bench dask".
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import cupy_poolmem

from ._common import header, table

try:  # the dask extra; without it main() says what to install, in one line
    from ..dask import PoolmemPlugin, gather_stats
except ImportError:
    PoolmemPlugin = gather_stats = None  # type: ignore[assignment, misc]


def _gpu_random(seed: int, block_info=None):
    import cupy

    info = block_info[None]
    loc = info["chunk-location"]
    rng = cupy.random.default_rng((seed * 1_000_003 + loc[0] * 7919 + loc[1]) & 0xFFFFFFFF)
    return rng.random(info["chunk-shape"])


def _random(n: int, chunk: int, seed: int):
    import cupy
    import dask.array as da

    blocks = (chunk,) * (n // chunk) + ((n % chunk,) if n % chunk else ())
    return da.map_blocks(
        _gpu_random, seed, chunks=(blocks, blocks), dtype="f8", meta=cupy.empty((0, 0), dtype="f8")
    )


def compute_bound(x):
    return ((x + x.T) * 2 - 1).mean(0).sum()


def allocation_heavy(y):
    z = y
    for i in range(8):
        z = z * 1.0001 + 0.5 * (i + 1)
    return (z - y.T).sum()


def _configs(pool_size: str, have_rmm: bool) -> list[tuple[str, dict, Any, str]]:
    out: list[tuple[str, dict, Any, str]] = [
        ("cupy_poolmem plugin", {}, PoolmemPlugin(), "plugin"),
        (
            f"cupy_poolmem plugin pool_size={pool_size}",
            {},
            PoolmemPlugin(pool_size=pool_size),
            "plugin_pool",
        ),
        ("dask-cuda default (CuPy MemoryPool)", {}, None, "default"),
    ]
    if have_rmm:
        out += [
            (
                f"dask-cuda rmm_pool_size={pool_size}",
                {"rmm_pool_size": pool_size, "rmm_allocator_external_lib_list": ["cupy"]},
                None,
                "rmm_pool",
            ),
            (
                "dask-cuda rmm_async",
                {"rmm_async": True, "rmm_allocator_external_lib_list": ["cupy"]},
                None,
                "rmm_async",
            ),
        ]
    return out


def _worker_allocator() -> str:
    import cupy

    alloc = cupy.cuda.get_allocator()
    owner = getattr(alloc, "__self__", None)
    if owner is not None:  # a bound method: MemoryPool.malloc
        return f"{type(owner).__module__}.{type(owner).__name__}"
    if hasattr(alloc, "__qualname__"):  # a function: rmm_cupy_allocator
        return f"{alloc.__module__}.{alloc.__qualname__}"
    return f"{type(alloc).__module__}.{type(alloc).__name__}"  # cupy_poolmem's PoolAllocator


def _run_workloads(client, args) -> dict:
    from distributed import wait

    out = {}
    (out["allocator"],) = client.run(_worker_allocator).values()
    for name, build, n, chunk in (
        ("compute", compute_bound, args.n, args.chunk),
        ("alloc", allocation_heavy, args.small_n, args.small_chunk),
    ):
        x = client.persist(_random(n, chunk, seed=1))
        wait(x)
        expr = build(x)
        value = float(expr.compute())  # warm-up (and the value, checked across rows)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            float(expr.compute())
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
        out[name + "_value"] = value
        del x, expr
        client.run(_collect)
    return out


def run_cluster(cluster_kw: dict, phases: list[tuple[str, Any]], args) -> dict[str, dict]:
    """One cluster; each phase ``(key, plugin or None)`` measured in turn on it."""
    import dask_cuda
    from distributed import Client

    out = {}
    with (
        dask_cuda.LocalCUDACluster(
            n_workers=1,
            threads_per_worker=args.threads,
            CUDA_VISIBLE_DEVICES=args.device,
            protocol="tcp",
            dashboard_address=None,
            **cluster_kw,
        ) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(1, timeout=120)
        registered = False
        for key, plugin in phases:
            print(f"... {key}", file=sys.stderr, flush=True)
            if plugin is not None:
                client.register_plugin(plugin)  # replaces the previous one (teardown first)
                registered = True
            elif registered:
                client.unregister_worker_plugin("cupy-poolmem")
                registered = False
            r = _run_workloads(client, args)
            if plugin is not None:
                (st,) = gather_stats(client).values()
                r["pool"] = (
                    f"{st['n_allocs']:,} allocs, peak used "
                    f"{st['peak_used_bytes'] / 2**30:.2f} GiB, reserved "
                    f"{st['reserved_bytes'] / 2**30:.2f} GiB"
                )
            out[key] = r
    return out


def _collect() -> None:
    import gc

    import cupy

    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()  # the next phase starts clean


def _versions() -> str:
    parts = []
    for mod in ("dask", "distributed", "dask_cuda", "rmm"):
        try:
            parts.append(f"{mod} {__import__(mod).__version__}")
        except Exception:
            parts.append(f"{mod} not installed")
    return " | ".join(parts)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m cupy_poolmem.benchmarks.dask_workload",
        description=(__doc__ or "").splitlines()[0],
    )
    ap.add_argument("--n", type=int, default=16000)
    ap.add_argument("--chunk", type=int, default=2000)
    ap.add_argument("--small-n", type=int, default=4000)
    ap.add_argument("--small-chunk", type=int, default=250)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--device", default="0", help="CUDA_VISIBLE_DEVICES for the worker")
    ap.add_argument(
        "--pool-size",
        default="0.5",
        help="pool_size of the plugin and rmm_pool_size (bytes, or a fraction such as 0.5)",
    )
    ap.add_argument(
        "--configs",
        default="",
        help="comma-separated subset: plugin,plugin_pool,default,rmm_pool,rmm_async",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smaller arrays, 2 repeats, configs plugin, default and rmm_pool",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.n, args.chunk, args.small_n, args.repeats = 8000, 2000, 2000, 2
        if not args.configs:
            args.configs = "plugin,default,rmm_pool"

    for mod in ("dask", "distributed", "dask_cuda"):
        if importlib.util.find_spec(mod) is None:
            sys.exit(f"{mod} is not installed: pip install dask distributed dask-cuda")
    if cupy_poolmem.device_count() == 0:
        sys.exit("needs a CUDA GPU")
    have_rmm = importlib.util.find_spec("rmm") is not None
    wanted = {c for c in args.configs.split(",") if c}
    configs = [c for c in _configs(args.pool_size, have_rmm) if not wanted or c[3] in wanted]

    t_start = time.perf_counter()
    labels = {key: label for label, _, _, key in configs}
    # Configurations without cluster options share one cluster: dask-cuda's default
    # first (CuPy's pool, emptied after), then the plugin phases.
    shared = [(key, plugin) for _, kw, plugin, key in configs if not kw]
    shared.sort(key=lambda p: p[1] is not None)
    measured: dict[str, dict] = {}
    if shared:
        measured.update(run_cluster({}, shared, args))
    for _label, kw, plugin, key in configs:
        if kw:
            measured.update(run_cluster(kw, [(key, plugin)], args))
    results = {key: (labels[key], measured[key]) for _, _, _, key in configs}

    base_key = "rmm_pool" if "rmm_pool" in results else "default"
    if base_key not in results:
        base_key = next(iter(results))
    base_label, base = results[base_key]
    rows = []
    for _key, (label, r) in results.items():
        rows.append(
            [
                label,
                f"{r['compute']:.3f}",
                f"{r['compute'] / base['compute']:.2f}",
                f"{r['alloc']:.3f}",
                f"{r['alloc'] / base['alloc']:.2f}",
                r["allocator"],
            ]
        )

    print(
        header(
            "Dask workloads, 1 LocalCUDACluster worker (TCP) x "
            f"{args.threads} threads (median of {args.repeats})"
        )
    )
    print(_versions())
    if not have_rmm:
        print("(rmm not installed: rmm_pool_size and rmm_async rows skipped)")
    print(
        f"compute-bound: ((x + x.T) * 2 - 1).mean(0).sum(), {args.n}^2 f8 in {args.chunk}^2 "
        f"chunks | allocation-heavy: 8 fused elementwise ops + transpose + sum, "
        f"{args.small_n}^2 f8 in {args.small_chunk}^2 chunks"
    )
    print(f"ratio: time / time of '{base_label}' (lower is better)")
    print(
        table(
            [
                "configuration",
                "compute s",
                "ratio",
                "alloc-heavy s",
                "ratio",
                "worker CuPy allocator",
            ],
            rows,
        )
    )
    for _key, (label, r) in results.items():
        if "pool" in r:
            print(f"{label}: pool stats after the runs: {r['pool']}")
    values = {round(r["compute_value"], 3) for _, r in results.values()}
    if len(values) > 1:
        print(f"note: compute-bound results differ across rows: {sorted(values)}")
    print(f"(run took {time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    from cupy_poolmem.benchmarks._common import run

    run(main, "dask")  # --save DIR: also write DIR/dask-<device>.json
