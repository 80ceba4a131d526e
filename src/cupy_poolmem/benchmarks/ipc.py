"""Sharing arrays between processes: cupy_poolmem vs CuPy pickling vs torch.multiprocessing.

Milliseconds per message against the queue's own floor, same and fresh arrays.  The
method and goals: docs/cli.rst, "bench ipc".
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Sequence

import cupy_poolmem
from cupy_poolmem._sharing._context import context

from ._common import header, require_gpu, table
from ._step_ipc import STEP_KIND, reserved_line


def consumer(kind: str, q_in, q_out) -> None:
    t0 = time.perf_counter()
    if kind == "torch":
        import torch

        torch.zeros(1, device="cuda")
    else:
        import cupy

        cupy.zeros(1)
    q_out.put(("ready", time.perf_counter() - t0))
    reserved = None  # arrays of a shared expandable pool: the most address space reserved
    if kind == STEP_KIND:
        reserved = 0
    while True:
        obj = q_in.get()
        if obj is None:
            break
        q_out.put(1)
        if reserved is not None:
            reserved = max(reserved, context().importer.step_maps(0).reserved)
        del obj
    if reserved is not None:
        q_out.put(("reserved", reserved))


def run_method(
    kind: str, sizes: list[int], n_steady: dict[int, int], fresh: bool = False
) -> list[tuple]:
    import cupy

    if kind == "torch":
        import torch
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
    else:
        ctx = mp.get_context("spawn")
    rows = []
    for size in sizes:
        q_in, q_out = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=consumer, args=(kind, q_in, q_out))
        p.start()
        tag, cuda_start = q_out.get(timeout=300)

        def make(size: int = size):
            if kind == "torch":
                return torch.ones(size // 4, device="cuda")
            if kind == "cupy_poolmem":
                cupy_poolmem.sharing.fallback = "device-copy"
                with cupy_poolmem.using(cupy_poolmem.get_pool()):
                    return cupy.ones(size // 4, dtype=cupy.float32)
            if kind == STEP_KIND:  # a shared expandable pool's
                cupy_poolmem.sharing.fallback = "error"
                with cupy_poolmem.using(_expandable_pool()):
                    return cupy.ones(size // 4, dtype=cupy.float32)
            # CuPy's own pickling: an array from CuPy's default pool, host fallback
            cupy_poolmem.sharing.fallback = "host"
            with cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):
                return cupy.ones(size // 4, dtype=cupy.float32)

        def sync() -> None:
            if kind == "torch":
                torch.cuda.synchronize()
            else:
                cupy.cuda.runtime.deviceSynchronize()

        obj = make()
        sync()
        t0 = time.perf_counter()
        q_in.put(obj)
        q_out.get(timeout=300)
        first = time.perf_counter() - t0
        import numpy as np

        tiny = np.zeros(4, dtype=np.float32)

        def floor_block(q_in=q_in, q_out=q_out, tiny=tiny, n: int = 50) -> list[float]:
            out = []
            for _ in range(n):
                t0 = time.perf_counter()
                q_in.put(tiny)
                q_out.get(timeout=60)
                out.append(time.perf_counter() - t0)
            return out

        floor_block(n=10)  # warm the tiny message's path
        # Interleaved: a tiny numpy message before each measured one, on the same queues,
        # so the floor and the message see the same machine state (the floor alone varies
        # 2-3x between runs); "over floor" is the median of the per-pair differences.
        times, floor, over, ratio = [], [], [], []
        for _ in range(n_steady[size]):
            if fresh:
                obj = make()
                # The fill kernel is done before the clock starts: the receiver's wait
                # for it would time the fill (0.1 ms at 256 MiB), not the sharing.
                sync()
            f = floor_block(n=1)[0]
            t0 = time.perf_counter()
            q_in.put(obj)
            q_out.get(timeout=300)
            t = time.perf_counter() - t0
            times.append(t)
            floor.append(f)
            over.append(t - f)
            ratio.append(t / f)
        q_in.put(None)
        if kind == STEP_KIND:
            tag, most = q_out.get(timeout=60)
            RESERVED.append(int(most))
        p.join(60)
        label = f"{kind} (fresh arrays)" if fresh else kind
        rows.append(
            (
                label,
                size,
                statistics.median(times),
                first,
                cuda_start,
                statistics.median(floor),
                statistics.median(over),
                statistics.median(ratio),
            )
        )
        cupy_poolmem.sharing.fallback = "device-copy"
    return rows


#: the most address space each receiver of a shared expandable pool's arrays reserved
RESERVED: list[int] = []
_POOLS: list = []


def _expandable_pool() -> cupy_poolmem.DevicePool:
    """This process's shared expandable pool (made on first use)."""
    if not _POOLS:
        _POOLS.append(cupy_poolmem.DevicePool(large_blocks="expandable", ipc=True))
    return _POOLS[0]


def _goal(kind: str, over: float, ratio: float) -> str:
    """cupy_poolmem's goals: a re-sent array within 0.06 ms of the floor, a fresh one
    at most 2x the floor; '-' for the others."""
    if not kind.startswith("cupy_poolmem"):
        return "-"
    if kind.endswith("(fresh arrays)"):
        return ("met" if ratio <= 2.0 else "missed") + " (<= 2x floor)"
    return ("met" if over <= 60e-6 else "missed") + " (<= floor + 0.06 ms)"


def main(argv: Sequence[str] | None = None) -> None:
    import cupy

    argv = sys.argv[1:] if argv is None else list(argv)
    require_gpu("ipc")
    quick = "--quick" in argv
    print(header("IPC benchmark: ms per message (steady put+ack) and first send"))
    cupy_poolmem.set_allocator()
    sizes = [1 << 20, 256 << 20]
    rows = []
    runs = [
        ("cupy_poolmem", False),
        ("torch", False),
        ("cupy pickling", False),
        ("cupy_poolmem", True),
        ("torch", True),
    ]
    runs += [(STEP_KIND, False), (STEP_KIND, True)]  # a shared expandable pool's arrays
    for kind, fresh in runs:
        n = {1 << 20: 200 if quick else 1000, 256 << 20: 100 if quick else 300}
        if kind == "cupy pickling":
            n = {1 << 20: 20 if quick else 50, 256 << 20: 3 if quick else 5}
        try:
            rows += run_method(kind, sizes, n, fresh)
        except Exception as exc:
            print(f"({kind} not measured: {type(exc).__name__}: {exc})")
    ref = {(r[0].endswith("(fresh arrays)"), r[1]): r[2] for r in rows if r[0].startswith("torch")}
    out = []
    for kind, size, steady, first, cuda_start, floor, over, vs_floor in rows:
        key = (kind.endswith("(fresh arrays)"), size)
        ratio = f"{steady / ref[key]:.2f}x" if key in ref else "-"
        out.append(
            [
                kind,
                f"{size >> 20} MiB",
                f"{steady * 1e3:8.3f}",
                ratio,
                f"{first * 1e3:8.1f}",
                f"{cuda_start * 1e3:7.0f}",
                f"{floor * 1e3:6.3f}",
                f"{over * 1e3:6.3f}",
                f"{vs_floor:5.2f}x",
                _goal(kind, over, vs_floor),
            ]
        )
    print(
        table(
            [
                "method",
                "size",
                "steady ms/msg",
                "vs torch",
                "first send ms",
                "worker CUDA start ms",
                "floor ms (tiny numpy)",
                "over floor ms",
                "vs floor",
                "goal",
            ],
            out,
        )
    )
    recycled = cupy_poolmem.sharing.stats()["recycled_blocks"]
    print(f"exported blocks recycled through the reuse cache in this run: {recycled}")
    print(reserved_line(RESERVED, cupy.cuda.Device().mem_info[1]))
    del cupy


if __name__ == "__main__":
    # The importable module's main, not __main__'s: the spawned consumers then find
    # ``consumer`` by the module's name.
    from cupy_poolmem.benchmarks._common import run
    from cupy_poolmem.benchmarks.ipc import main as _main

    run(_main, "ipc")  # --save DIR: also write DIR/ipc-<device>.json
