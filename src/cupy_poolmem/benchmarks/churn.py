"""A churn trace: many sizes, frees out of order; the memory each allocator reserves.

One seeded trace replayed on every allocator in this process and run: time per step
and reserved peak, against CuPy's MemoryPool.  The method: docs/cli.rst, "bench churn".
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import cupy

import cupy_poolmem
from cupy_poolmem import _retire

from ._churn_variants import measure_variants
from ._common import header, require_gpu, table
from ._paired import Burst, PairedRatio, paired_ratio
from ._step_ipc import EXPANDABLE_IPC_LABEL, churn_pools

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
GOAL_RESERVED, GOAL_SPEED = 0.8, 1.05
BASE_LABEL = "cupy MemoryPool (baseline)"
DEFAULT_LABEL = "cupy_poolmem DevicePool (default)"
MAPPED_LABEL = "cupy_poolmem DevicePool large_blocks='mapped'"
EXPANDABLE_LABEL = "cupy_poolmem DevicePool large_blocks='expandable'"
TORCH_EXPANDABLE_LABEL = "torch caching allocator, expandable_segments"


def trace(steps: int, live: int, seed: int = 7) -> list[tuple[int, list[int]]]:
    """``[(size, [slots to free before it]), ...]``: the same trace for every allocator.

    Slots index the list of live arrays at that moment (a free swaps the last array
    into the freed slot), so replaying the trace frees the same arrays everywhere.

    Examples
    --------
    >>> t = trace(200, live=64 << 20)
    >>> len(t), all(1 << 10 <= size <= 64 << 20 for size, _ in t)
    (200, True)
    >>> t == trace(200, live=64 << 20)  # seeded: every allocator replays the same
    True
    """
    rng = random.Random(seed)
    common = [4 * KiB, 256 * KiB, 4 * MiB, 32 * MiB]
    sizes: list[int] = []
    out: list[tuple[int, list[int]]] = []
    held = 0
    for _ in range(steps):
        if rng.random() < 0.1:
            size = rng.choice(common)
        else:
            size = int(2 ** rng.uniform(10, 26))
        frees = []
        while sizes and held + size > live:
            i = rng.randrange(len(sizes))
            frees.append(i)
            held -= sizes[i]
            sizes[i] = sizes[-1]
            sizes.pop()
        sizes.append(size)
        held += size
        out.append((size, frees))
    return out


def replay(steps: list[tuple[int, list[int]]], make: Callable[[int], Any], sample=None) -> float:
    """Run the trace with ``make(size)``; seconds per step.  ``sample()`` after each step."""
    arrays: list[Any] = []
    t0 = time.perf_counter()
    for size, frees in steps:
        for i in frees:
            arrays[i] = arrays[-1]
            arrays.pop()
        arrays.append(make(size))
        if sample is not None:
            sample()
    dt = (time.perf_counter() - t0) / len(steps)
    arrays.clear()
    return dt


def _cupy_make(size: int) -> Any:
    return cupy.empty(size, dtype=cupy.uint8)


def _sync() -> None:
    cupy.cuda.runtime.deviceSynchronize()


def _default_mempool_high(reset: bool = False) -> int:
    """The device's default CUDA pool (CuPy's MemoryAsyncPool): its reserved high-water."""
    from cuda.bindings import driver as drv

    err, dev = drv.cuCtxGetDevice()
    err, pool = drv.cuDeviceGetDefaultMemPool(dev)
    attr = drv.CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH
    if reset:
        drv.cuMemPoolSetAttribute(pool, attr, drv.cuuint64_t(0))
        return 0
    err, value = drv.cuMemPoolGetAttribute(pool, attr)
    return int(value)


#: ``run() -> (seconds per step, reserved peak or 0)``: one replay of the trace on a
#: fresh allocator, which is given back after.
Run = Callable[[], tuple[float, int]]


def on_cupy_allocator(
    steps: list[tuple[int, list[int]]],
    make_pool: Callable[[], Any],
    peak: Callable[[Any], int] | None = None,
    close: Callable[[Any], None] | None = None,
) -> Run:
    """A :data:`Run` of the trace on a fresh ``make_pool()`` set as CuPy's allocator;
    ``peak(pool)`` after the replay gives its reserved peak (0 without it), ``close``
    gives it back (default: ``free_all_blocks``)."""

    def run() -> tuple[float, int]:
        pool = make_pool()
        try:
            with cupy.cuda.using_allocator(pool.malloc):
                dt = replay(steps, _cupy_make)
            _sync()
            return dt, peak(pool) if peak is not None else 0
        finally:
            (close or (lambda p: p.free_all_blocks()))(pool)

    return run


def close_device_pool(pool: Any) -> None:
    """Close a DevicePool and finish its retirement now, outside the timer.

    ``close`` hands the pool to the retirer, whose thread would sync, park or destroy
    it (and unmap every cached mapped block) during the next allocator's timed replay;
    the other allocators give their memory back before their replay's ``run`` returns.
    """
    pool.close()
    r = _retire.retirer()
    deadline = time.monotonic() + 10.0
    while r.pending and time.monotonic() < deadline:
        if not r.drain():
            time.sleep(0.001)


def sampled_peak(
    steps: list[tuple[int, list[int]]], make_pool: Callable[[], Any], held: Callable[[Any], int]
) -> int:
    """The most ``held(pool)`` ever says over an untimed replay on a fresh ``make_pool()``
    (for allocators that keep no high-water mark of their own)."""
    pool = make_pool()
    peak = [0]

    def sample() -> None:
        peak[0] = max(peak[0], held(pool))

    with cupy.cuda.using_allocator(pool.malloc):
        replay(steps, _cupy_make, sample)
    _sync()
    getattr(pool, "free_all_blocks", lambda: None)()
    return peak[0]


def timed_rounds(runs: dict[str, Run], rounds: int) -> dict[str, tuple[float, int]]:
    """``{label: (median seconds per step, peak)}`` over ``rounds`` timed rounds.

    A first round warms every allocator up untimed: the process's first device
    allocations pay the driver's first-use costs (about ten times a later replay's on
    an H100), and whoever went first would be charged them.  Each round then replays
    the trace once on each allocator, in turn, each on a fresh instance, starting one
    further along the list every round, so a host whose speed drifts slows every
    allocator alike.  The peak is the last replay's.

    Examples
    --------
    >>> calls = []
    >>> def fake(label, t):
    ...     def run():
    ...         calls.append(label)
    ...         return t, 7
    ...     return run
    >>> timed_rounds({"a": fake("a", 2e-6), "b": fake("b", 1e-6)}, rounds=2)
    {'a': (2e-06, 7), 'b': (1e-06, 7)}
    >>> calls  # the warm-up round, then a-b, then b-a
    ['a', 'b', 'a', 'b', 'b', 'a']
    """
    labels = list(runs)
    for label in labels:  # warm-up, untimed
        runs[label]()
    times: dict[str, list[float]] = {label: [] for label in labels}
    peaks: dict[str, int] = {}
    for k in range(rounds):
        for j in range(len(labels)):
            label = labels[(j + k) % len(labels)]
            dt, peaks[label] = runs[label]()
            times[label].append(dt)
    return {label: (statistics.median(times[label]), peaks[label]) for label in labels}


def paired_speed(base: Run, ours: Run, pairs: int) -> PairedRatio:
    """``ours``' time per step over ``base``'s: the median of per-pair ratios, each pair
    one replay of each on fresh instances, back to back, ABBA (:mod:`._paired`)."""

    def burst(run: Run) -> Burst:
        return lambda n: statistics.fmean(run()[0] for _ in range(n))

    return paired_ratio(burst(base), burst(ours), pairs=pairs, calls=1, warmup=0)


def contenders(steps: list[tuple[int, list[int]]]) -> tuple[dict[str, Run], dict[str, int]]:
    """The allocators replayed: ``({label: Run}, {label: peak from a sampled replay}``
    for those that keep no high-water mark)."""
    runs: dict[str, Run] = {}
    sampled: dict[str, int] = {}
    runs[BASE_LABEL] = on_cupy_allocator(steps, cupy.cuda.MemoryPool)
    sampled[BASE_LABEL] = sampled_peak(steps, cupy.cuda.MemoryPool, lambda p: p.total_bytes())

    def async_pool() -> Any:
        _sync()
        _default_mempool_high(reset=True)
        return cupy.cuda.MemoryAsyncPool()

    runs["cupy MemoryAsyncPool"] = on_cupy_allocator(
        steps, async_pool, peak=lambda p: _default_mempool_high()
    )
    try:
        import rmm
        import rmm.mr

        class _Rmm:
            def __init__(self) -> None:
                self.mr = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), 256 * MiB)

            def malloc(self, size: int) -> Any:
                buf = rmm.DeviceBuffer(size=size, mr=self.mr)
                mem = cupy.cuda.UnownedMemory(buf.ptr, size, buf)
                return cupy.cuda.MemoryPointer(mem, 0)

            def free_all_blocks(self) -> None:
                self.mr = None

        runs["rmm PoolMemoryResource"] = on_cupy_allocator(steps, _Rmm)
        sampled["rmm PoolMemoryResource"] = sampled_peak(steps, _Rmm, lambda p: p.mr.pool_size())
    except Exception as exc:
        print(f"(rmm not measured: {type(exc).__name__}: {exc})")

    def device_pool(opts: dict[str, Any]) -> Callable[[], Any]:
        return lambda: cupy_poolmem.DevicePool(**opts)

    pools: tuple[tuple[str, dict[str, Any]], ...] = (
        (DEFAULT_LABEL, {}),
        ("cupy_poolmem DevicePool ipc=True (set_allocator's)", {"ipc": True}),
        ("cupy_poolmem DevicePool small_pool=None", {"small_pool": None}),
        ("cupy_poolmem DevicePool reuse_cache=0", {"reuse_cache": 0}),
        (MAPPED_LABEL, {"large_blocks": "mapped"}),
        (EXPANDABLE_LABEL, {"large_blocks": "expandable"}),
        *churn_pools(),  # the shared (ipc=True) expandable and mapped pools
    )
    for label, opts in pools:
        runs[label] = on_cupy_allocator(
            steps,
            device_pool(opts),
            peak=lambda p: p.stats().peak_reserved_bytes,
            close=close_device_pool,
        )
    try:
        import torch

        runs["torch caching allocator"] = torch_run(steps, torch, expandable=False)
        if hasattr(torch._C, "_accelerator_setAllocatorSettings") or hasattr(
            torch.cuda.memory, "_set_allocator_settings"
        ):
            runs[TORCH_EXPANDABLE_LABEL] = torch_run(steps, torch, expandable=True)
    except Exception as exc:
        print(f"(torch not measured: {type(exc).__name__}: {exc})")
    return runs, sampled


def torch_run(steps: list[tuple[int, list[int]]], torch: Any, expandable: bool) -> Run:
    """A :data:`Run` of the trace on torch's caching allocator, emptied before and after;
    ``expandable``: with ``expandable_segments`` (segments that grow by mapping 2 MiB
    pages, torch's virtual memory management), switched on for this replay only."""

    # torch 2.11 moved the setter (the old one warns that it is deprecated).
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or (
        torch.cuda.memory._set_allocator_settings
    )

    def settings(on: bool) -> None:
        if expandable:
            setter(f"expandable_segments:{on}")

    def run() -> tuple[float, int]:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        settings(True)
        try:
            torch.cuda.reset_peak_memory_stats()
            dt = replay(steps, lambda n: torch.empty(n, dtype=torch.uint8, device="cuda"))
            torch.cuda.synchronize()
            peak = int(torch.cuda.max_memory_reserved())
            torch.cuda.empty_cache()
        finally:
            settings(False)
        return dt, peak

    return run


def measure(
    steps: list[tuple[int, list[int]]], rounds: int = 3, pairs: int = 8
) -> tuple[list[tuple[str, float, int]], dict[str, PairedRatio]]:
    """``(rows, paired)``: (allocator, median seconds per step, peak reserved bytes) for
    each allocator (:func:`timed_rounds`), and the goal's pools' time over MemoryPool's
    as paired ratios (:func:`paired_speed`)."""
    runs, sampled = contenders(steps)
    timed = timed_rounds(runs, rounds)
    rows = [(label, dt, sampled.get(label, peak)) for label, (dt, peak) in timed.items()]
    paired = {
        label: paired_speed(runs[BASE_LABEL], runs[label], pairs)
        for label in GOAL_POOLS
        if label in runs
    }
    return rows, paired


#: The pools the goal line judges, and their names there.
GOAL_POOLS = {
    EXPANDABLE_LABEL: "large_blocks='expandable'",
    EXPANDABLE_IPC_LABEL: "large_blocks='expandable' ipc=True",
    MAPPED_LABEL: "large_blocks='mapped'",
    DEFAULT_LABEL: "default",
}


def goal_line(
    rows: list[tuple[str, float, int]], paired: dict[str, PairedRatio] | None = None
) -> str:
    """Whether each of :data:`GOAL_POOLS` (the expandable pool is the goal's) met the
    goal against MemoryPool in ``rows``; the time ratio is the paired one where
    ``paired`` has it, else the ratio of the rows' times.

    Examples
    --------
    >>> rows = [(BASE_LABEL, 2e-6, 1000),
    ...         ("cupy_poolmem DevicePool (default)", 1e-6, 980),
    ...         (MAPPED_LABEL, 2e-6, 700)]
    >>> print(goal_line(rows))
    goal (reserved <= 0.8x MemoryPool, time <= 1.05x): large_blocks='mapped' met (0.70x, 1.00x); default missed (0.98x, 0.50x)
    >>> paired = {MAPPED_LABEL: PairedRatio(1.30, 1.2, 1.4, 8)}
    >>> print(goal_line(rows, paired).split("; ")[0])
    goal (reserved <= 0.8x MemoryPool, time <= 1.05x): large_blocks='mapped' missed (0.70x, 1.30x paired)
    """
    base = next(r for r in rows if r[0] == BASE_LABEL)
    paired = paired or {}
    parts = []
    for label, short in GOAL_POOLS.items():
        ours = next((r for r in rows if r[0] == label), None)
        if ours is None:
            continue
        res = ours[2] / base[2]
        speed = paired[label].median if label in paired else ours[1] / base[1]
        met = res <= GOAL_RESERVED and speed <= GOAL_SPEED
        how = " paired" if label in paired else ""
        parts.append(f"{short} {'met' if met else 'missed'} ({res:.2f}x, {speed:.2f}x{how})")
    return f"goal (reserved <= {GOAL_RESERVED}x MemoryPool, time <= {GOAL_SPEED}x): " + "; ".join(
        parts
    )


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    require_gpu("churn")
    quick = "--quick" in argv
    n_steps, live = (5_000, 1 * GiB) if quick else (40_000, 2 * GiB)
    print(header("churn trace: microseconds per step and reserved peak (ratio to MemoryPool)"))
    steps = trace(n_steps, live)
    print(f"trace: {n_steps} steps, sizes 1 KiB-64 MiB, at most {live >> 20} MiB live")
    # A full run's replays are eight times longer: fewer pairs take about as long.
    rows, paired = measure(steps, rounds=3, pairs=8 if quick else 6)
    base = rows[0]
    out = [
        [
            name,
            f"{dt * 1e6:8.2f} us ({dt / base[1]:.2f}x)",
            f"{peak / MiB:9.1f} MiB ({peak / base[2]:.2f}x)",
        ]
        for name, dt, peak in rows
    ]
    print(table(["allocator", "time per step (median)", "reserved peak"], out))
    for label, ratio in paired.items():
        print(f"time over MemoryPool's, paired replays: {label}: {ratio}")
    print(goal_line(rows, paired))
    print()
    print("the same trace straight on CUDA pools (no CuPy arrays; times include the binding calls)")
    print(variants_table(measure_variants(steps), base[2]))


def variants_table(results: list[Any], base_peak: int) -> str:
    """The CUDA-pool variants' table: time per step, trims, peak and its ratio to
    MemoryPool's (``base_peak``).

    Examples
    --------
    >>> from cupy_poolmem.benchmarks._churn_variants import VariantResult
    >>> lines = variants_table([VariantResult("one CUDA pool", 1e-5, 2 << 30, 0)], 1 << 30)
    >>> [cell.strip() for cell in lines.splitlines()[2].split("|")]
    ['one CUDA pool', '10.00 us', '0', '2048.0 MiB (2.00x)']
    """
    out = [
        [
            r.label,
            f"{r.seconds_per_step * 1e6:8.2f} us",
            f"{r.trims:5d}",
            f"{r.peak_reserved / MiB:9.1f} MiB ({r.peak_reserved / base_peak:.2f}x)",
        ]
        for r in results
    ]
    return table(["variant", "time per step", "trims", "reserved peak"], out)


if __name__ == "__main__":
    from cupy_poolmem.benchmarks._common import run

    run(main, "churn")  # --save DIR: also write DIR/churn-<device>.json
