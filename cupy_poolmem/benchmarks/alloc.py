"""Allocation speed: cupy.empty(n)+free and a temporaries-heavy chain, pools side by side.

Prints one table: microseconds per operation and the ratio to CuPy's MemoryPool,
all measured in this process and run, round-robin (each allocator's best of four
rounds, so drift hits every row alike).  The DevicePool rows run with observability
off (the default: no cost); the last rows switch statistics and a tracked log on.

``python -m cupy_poolmem bench alloc [--quick]``
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import cupy

import cupy_poolmem

from ._common import child_env, header, median_time, require_gpu, table


def peers() -> list[tuple[Any, ...]]:
    """(name, malloc, cleanup) for every allocator measured."""
    out: list[tuple[Any, ...]] = []
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
    out.append(
        (
            f"cupy_poolmem DevicePool [{cupy_poolmem.hotpath_implementation()}]",
            pool.malloc,
            pool.close,
        )
    )
    alloc = cupy_poolmem.set_allocator(ipc=False)
    cupy.cuda.set_allocator(mp.malloc)
    out.append(("cupy_poolmem set_allocator() dispatch", alloc, alloc.close))
    nocache = cupy_poolmem.DevicePool(reuse_cache=0)
    out.append(("cupy_poolmem DevicePool reuse_cache=0", nocache.malloc, nocache.close))
    # Observability switched on: what statistics() and a tracked log cost per allocation.
    spool = cupy_poolmem.DevicePool()
    out.append(
        ("DevicePool inside statistics()", spool.malloc, spool.close, cupy_poolmem.statistics)
    )
    lpool = cupy_poolmem.DevicePool()
    out.append(("DevicePool with start_log(track=True)", lpool.malloc, lpool.close, _logging))
    return out


class _logging:
    """Context manager: an allocation log with call sites, in a temporary file."""

    def __enter__(self):
        import tempfile

        self._dir = tempfile.TemporaryDirectory()
        cupy_poolmem.start_log(os.path.join(self._dir.name, "alloc.csv"), track=True)

    def __exit__(self, *exc):
        cupy_poolmem.stop_log()
        self._dir.cleanup()


def _pure_python_row(n: int) -> list[float] | None:
    """Measure the pure-Python hot path in a child process (the twin is chosen at import)."""
    import json
    import subprocess

    env = child_env(CUPY_POOLMEM_PURE_PYTHON="1")
    r = subprocess.run(
        [sys.executable, "-m", __name__, "--child", str(n)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode:
        print(f"(pure-Python hot path not measured: {r.stderr.strip()[-300:]})")
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def _child(n: int) -> None:
    import json

    pool = cupy_poolmem.DevicePool()
    assert cupy_poolmem.hotpath_implementation() == "python"
    print(json.dumps(measure(pool.malloc, n, rounds=4)))


CASES = [("empty 1KiB", 1 << 10), ("empty 1MiB", 1 << 20), ("empty 64MiB", 64 << 20)]


def _cases(n: int) -> list[tuple[Callable[[], object], int]]:
    x = cupy.arange(10000, dtype=cupy.float32)

    def chain():
        return ((x * 2 + 1) ** 2 - x).sum()

    fns: list[tuple[Callable[[], object], int]] = [
        (functools.partial(cupy.empty, size, dtype=cupy.uint8), n) for _l, size in CASES
    ]
    return fns + [(chain, n // 4)]


def measure(malloc, n: int, rounds: int = 1) -> list[float]:
    """Seconds per operation for each case with ``malloc`` as CuPy's allocator."""
    vals = []
    with cupy.cuda.using_allocator(malloc):
        for fn, reps in _cases(n):
            vals.append(min(median_time(fn, reps, repeats=3) for _ in range(rounds)))
        cupy.cuda.get_current_stream().synchronize()
    return vals


def measure_interleaved(entries: list, n: int, rounds: int = 4) -> list[list[float]]:
    """Round-robin over the allocators, keeping each one's best round.

    Interleaving spreads clock and load drift over every allocator alike, so the
    ratios stay stable from run to run.
    """
    best = [[float("inf")] * (len(CASES) + 1) for _ in entries]
    for _ in range(rounds):
        for i, (_name, malloc, _cleanup, *ctx) in enumerate(entries):
            if ctx:
                with ctx[0]():
                    vals = measure(malloc, n)
            else:
                vals = measure(malloc, n)
            best[i] = [min(a, b) for a, b in zip(best[i], vals)]
    return best


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    require_gpu("alloc")
    if "--child" in argv:
        return _child(int(argv[argv.index("--child") + 1]))
    quick = "--quick" in argv
    n = 2000 if quick else 6000
    print(header("allocation benchmark: microseconds per op (ratio to cupy MemoryPool)"))
    rows, base = [], None
    entries = peers()
    # Observability rows go last, in their own phase: what they leave behind (objects,
    # caches) must not weigh on the rows measured with everything off.
    plain = [e for e in entries if len(e) == 3]
    observed = [e for e in entries if len(e) > 3]
    results = measure_interleaved(plain, n) + measure_interleaved(observed, n, rounds=2)
    measured: list[tuple[str, list[float], Any]] = [
        (e[0], vals, e[2]) for e, vals in zip(plain + observed, results)
    ]
    py = _pure_python_row(n)
    if py:
        measured.append(("cupy_poolmem DevicePool [pure python, child process]", py, None))
    for name, vals, cleanup in measured:
        base = base or vals
        rows.append([name] + [f"{v * 1e6:7.2f} us ({v / b:.2f}x)" for v, b in zip(vals, base)])
        if cleanup:
            cleanup()
    print(table(["allocator"] + [c[0] for c in CASES] + ["chain 10k f32"], rows))


if __name__ == "__main__":
    main()
