"""Allocation speed: cupy.empty(n)+free and a temporaries-heavy chain, pools side by side.

One table per run, the goal lines after it (paired medians), then what observability
and peer access cost.  What each row and goal measures: docs/cli.rst, "bench alloc".
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import cupy

import cupy_poolmem

from ._common import child_env, header, median_time, require_gpu, table
from ._paired import Burst, PairedRatio, paired_ratio, timed_burst
from ._step_ipc import EXPANDABLE_IPC_LABEL, churn_pools


def peers() -> list[tuple[Any, ...]]:
    """(name, malloc, cleanup) for every allocator measured."""
    out: list[tuple[Any, ...]] = []
    mp = cupy.cuda.MemoryPool()
    out.append((BASELINE_ROW, mp.malloc, mp.free_all_blocks))
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
    n_gpus = cupy_poolmem.device_count()
    if n_gpus > 1:
        # Same pools, granted to the peers or not (GPU 0's pool; the rows above are 'all').
        for pa in ("all", None):
            p = cupy_poolmem.DevicePool(peer_access=pa)
            label = f"'all' ({len(p.peer_access)} peers)" if pa else "None"
            out.append((f"DevicePool peer_access={label}", p.malloc, p.close))
    for label, options in churn_pools():  # the shared expandable and mapped pools
        sp = cupy_poolmem.DevicePool(**options)
        out.append((label, sp.malloc, sp.close))
    gpool = cupy_poolmem.DevicePool(guard=True)
    out.append((GUARD_ROW, gpool.malloc, gpool.close, contextlib.nullcontext))
    return out


GUARD_ROW = "DevicePool guard=True (debug mode)"


class _Logging:
    """Context manager: an allocation log (with call sites if ``track``) in a temporary
    file.  Its writer thread runs while the cases are timed; stop_log() writes what is
    left when the context exits, between two timings."""

    def __init__(self, track: bool) -> None:
        self.track = track

    def __enter__(self):
        import tempfile

        self._dir = tempfile.TemporaryDirectory()
        cupy_poolmem.start_log(os.path.join(self._dir.name, "alloc.csv"), track=self.track)

    def __exit__(self, *exc):
        cupy_poolmem.stop_log()
        self._dir.cleanup()


# -- observability: the second table ------------------------------------------------------
OBS_BASE = "cupy MemoryPool"
OBS_PLAIN = "DevicePool, nothing observed"
OBS_STATS = "DevicePool inside statistics()"
OBS_LOG = "DevicePool with start_log()"
OBS_TRACK = "DevicePool with start_log(track=True)"
#: Issue 15's goals: row -> most it may cost, as a ratio to the plain pool, per
#: ``cupy.empty(n)`` + free (the first ``len(CASES)`` columns).
GOALS = {OBS_STATS: 1.3, OBS_LOG: 2.0, OBS_TRACK: 4.0}


def observed_entries() -> list[tuple[Any, ...]]:
    """(name, malloc, cleanup, context) of the observability table: one DevicePool for
    every DevicePool row, so they differ only in what observes it."""
    mp = cupy.cuda.MemoryPool()
    pool = cupy_poolmem.DevicePool()
    nothing = contextlib.nullcontext
    return [
        (OBS_BASE, mp.malloc, mp.free_all_blocks, nothing),
        (OBS_PLAIN, pool.malloc, None, nothing),
        (OBS_STATS, pool.malloc, None, cupy_poolmem.statistics),
        (OBS_LOG, pool.malloc, None, functools.partial(_Logging, False)),
        (OBS_TRACK, pool.malloc, pool.close, functools.partial(_Logging, True)),
    ]


def observability_report(
    measured: list[tuple[str, list[float]]],
    paired: dict[str, list[PairedRatio]] | None = None,
) -> tuple[list[list[str]], list[str]]:
    """Rows of the observability table from seconds per op, and one line per goal from
    paired ratios.

    Each cell: microseconds, the ratio to the plain DevicePool and the ratio to
    MemoryPool (each row's best of its rounds, as measured).  The goals come from
    ``paired`` (:func:`_paired_observability`): for ``OBS_PLAIN`` and each row of
    ``GOALS``, one :class:`PairedRatio` per ``cupy.empty`` case of the pool, as observed,
    against MemoryPool.  A row's ratio to the plain pool is then
    ``median(observed / MemoryPool) / median(plain / MemoryPool)`` (see
    :func:`ratio_to_plain`), and a goal is met when every case is within its ratio, to
    two decimals.  Without ``paired``, no goal lines.
    """
    by_name = dict(measured)
    base, plain = by_name[OBS_BASE], by_name[OBS_PLAIN]
    rows = [
        [name]
        + [f"{v * 1e6:7.2f} us ({v / p:.2f}x, {v / b:.2f}x)" for v, p, b in zip(vals, plain, base)]
        for name, vals in measured
    ]
    return rows, observability_goals(paired or {})


def ratio_to_plain(observed: PairedRatio, plain: PairedRatio) -> float:
    """An observed pool's cost over the plain pool's, both anchored on MemoryPool.

    ``median(observed / MemoryPool) / median(plain / MemoryPool)``: the observed pool
    is paired against MemoryPool inside the observing context (which MemoryPool does not
    see), the plain pool against MemoryPool outside it, so each median holds still when
    the CPU changes speed, and so does their quotient.

    Examples
    --------
    >>> ratio_to_plain(PairedRatio(1.25, 1.2, 1.3, 25), PairedRatio(1.0, 0.98, 1.02, 25))
    1.25
    """
    return observed.median / plain.median


def observability_goals(paired: dict[str, list[PairedRatio]]) -> list[str]:
    """One line per goal of ``GOALS`` with a row in ``paired`` (and the plain pool's):
    the worst ``cupy.empty`` case's ratio to the plain pool, the two paired medians it
    is the quotient of, and the verdict."""
    plain = paired.get(OBS_PLAIN)
    if not plain:
        return []
    goals = []
    for name, limit in GOALS.items():
        if name not in paired:
            continue
        ratios = [ratio_to_plain(o, p) for o, p in zip(paired[name][: len(CASES)], plain)]
        worst = max(range(len(ratios)), key=lambda i: ratios[i])
        goals.append(
            f"goal: {name} at most {limit:g}x the plain DevicePool per cupy.empty + free: "
            f"worst {ratios[worst]:.2f}x ({CASES[worst][0]}: observed/MemoryPool "
            f"{paired[name][worst]} over plain/MemoryPool {plain[worst]}, paired medians) "
            f"-> {_verdict(ratios[worst], limit)}"
        )
    return goals


def _plain_pool(by_name: dict[str, list[float]]) -> list[float] | None:
    """The in-process DevicePool row's values (the first such row: not the child's)."""
    return next((v for k, v in by_name.items() if k.startswith("cupy_poolmem DevicePool [")), None)


def guard_overhead(measured: list[tuple[str, list[float], Any]]) -> str | None:
    """One line: what the guard adds per allocation + free, against the plain DevicePool."""
    by_name = {name: vals for name, vals, _ in measured}
    plain = _plain_pool(by_name)
    guarded = by_name.get(GUARD_ROW)
    if plain is None or guarded is None:
        return None
    parts = [
        f"{label} +{(g - p) * 1e6:.1f} us" for (label, _size), g, p in zip(CASES, guarded, plain)
    ]
    return "guard overhead per allocation + free (vs DevicePool): " + ", ".join(parts)


BASELINE_ROW = "cupy MemoryPool (baseline)"
#: Issue 15's goal for the pool itself: DevicePool at most this ratio to CuPy's
#: MemoryPool per ``cupy.empty(n)`` + free, at every size of ``CASES`` (to two decimals,
#: the precision the tables print).
POOL_GOAL = 1.0


def _verdict(ratio: float, limit: float) -> str:
    return "met" if round(ratio, 2) <= limit else "NOT met"


def pool_goals(paired: Sequence[PairedRatio], pool: str = "DevicePool") -> list[str]:
    """One line per size of ``CASES``: DevicePool's paired ratio to MemoryPool (from
    :func:`_paired_pool`: the median of per-pair ratios, both pools timed back to back),
    and the verdict on ``POOL_GOAL``.  No ratios, no lines.  ``pool`` names the pool
    measured (the shared expandable pool's lines judge issue 35's default).

    Examples
    --------
    >>> line = pool_goals([PairedRatio(0.97, 0.95, 0.99, 25)])[0]
    >>> line.startswith("goal: DevicePool at most 1.00x MemoryPool per cupy.empty(1KiB) + free")
    True
    >>> line.split("free: ")[1]
    '0.97x (paired median, IQR 0.95-0.99, 25 pairs) -> met'
    """
    lines = []
    for (label, _size), r in zip(CASES, paired):
        case = f"cupy.empty({label.removeprefix('empty ')}) + free"
        lines.append(
            f"goal: {pool} at most {POOL_GOAL:.2f}x MemoryPool per {case}: "
            f"{r.format('paired median, ')} -> {_verdict(r.median, POOL_GOAL)}"
        )
    return lines


#: Pairs of bursts per paired ratio (``--quick``, otherwise), and calls per burst.
PAIRS_QUICK, PAIRS = 25, 60
BURST_CALLS = 400


def _empty_burst(malloc: Callable[[int], Any], size: int) -> Burst:
    """A burst of ``cupy.empty(size)`` + free with ``malloc`` as CuPy's allocator (set
    outside the timed calls)."""
    timed = timed_burst(functools.partial(cupy.empty, size, dtype=cupy.uint8))

    def burst(n: int) -> float:
        with cupy.cuda.using_allocator(malloc):
            return timed(n)

    return burst


def paired_cases(
    malloc: Callable[[int], Any], base: Callable[[int], Any], pairs: int
) -> list[PairedRatio]:
    """Per size of ``CASES``: ``malloc``'s paired ratio to ``base`` per ``cupy.empty`` +
    free (``BURST_CALLS`` calls per burst, ``pairs`` pairs, ABBA)."""
    out = []
    for _label, size in CASES:
        out.append(
            paired_ratio(
                _empty_burst(base, size), _empty_burst(malloc, size), pairs=pairs, calls=BURST_CALLS
            )
        )
        cupy.cuda.get_current_stream().synchronize()
    return out


def _paired_pool(quick: bool, **options: Any) -> list[PairedRatio]:
    """Issue 15's pool goal, measured: a fresh ``DevicePool(**options)`` against a fresh
    ``MemoryPool``, paired (see :func:`paired_cases`)."""
    mempool = cupy.cuda.MemoryPool()
    pool = cupy_poolmem.DevicePool(**options)
    try:
        return paired_cases(pool.malloc, mempool.malloc, PAIRS_QUICK if quick else PAIRS)
    finally:
        pool.close()
        mempool.free_all_blocks()


def _paired_shared_expandable(quick: bool) -> list[PairedRatio]:
    """Issue 35's default, measured: the shared expandable pool against MemoryPool,
    paired."""
    return _paired_pool(quick, **dict(churn_pools())[EXPANDABLE_IPC_LABEL])


def _paired_observability(
    entries: list[tuple[Any, ...]], quick: bool
) -> dict[str, list[PairedRatio]]:
    """The observability goals, measured: the table's one DevicePool against its
    MemoryPool, paired, outside any context (``OBS_PLAIN``) and inside each observing
    context of ``GOALS``, entered once for all the pairs of its row (entering it per
    burst would time the entering).  MemoryPool is the anchor: no observer sees it, so
    :func:`ratio_to_plain` divides the observed pool's median by the plain pool's.

    A log's writer thread runs on while the MemoryPool bursts are timed too: what it
    costs the allocating thread there counts against MemoryPool, not the log.
    """
    by_name = {e[0]: e for e in entries}
    base = by_name[OBS_BASE][1]
    pairs = PAIRS_QUICK if quick else PAIRS
    out: dict[str, list[PairedRatio]] = {}
    for name in (OBS_PLAIN, *GOALS):
        if name not in by_name:
            continue
        _name, malloc, _cleanup, context = by_name[name]
        with context():
            out[name] = paired_cases(malloc, base, pairs)
    return out


BARE_ROWS = ("cupy MemoryPool.malloc", "cupy_poolmem DevicePool.malloc")


def bare_report(best: dict[str, list[float]]) -> list[list[str]]:
    """Rows of the bare table: microseconds per ``malloc(n)`` + free, ratio to MemoryPool."""
    base = best[BARE_ROWS[0]]
    return [
        [name] + [f"{v * 1e6:7.3f} us ({v / b:.2f}x)" for v, b in zip(best[name], base)]
        for name in BARE_ROWS
    ]


def _bare_costs(quick: bool) -> str:
    """The bare table: ``malloc(n)`` + free without ``cupy.empty``, MemoryPool's and
    DevicePool's, each size its best of four interleaved rounds."""
    reps = 4000 if quick else 12000
    mempool = cupy.cuda.MemoryPool()
    pool = cupy_poolmem.DevicePool()
    best = {name: [float("inf")] * len(CASES) for name in BARE_ROWS}
    try:
        for _ in range(4):
            for name, malloc in zip(BARE_ROWS, (mempool.malloc, pool.malloc)):
                for i, (_label, size) in enumerate(CASES):
                    t = median_time(functools.partial(malloc, size), reps, repeats=3)
                    best[name][i] = min(best[name][i], t)
        cupy.cuda.get_current_stream().synchronize()
    finally:
        pool.close()
        mempool.free_all_blocks()
    return table(
        ["bare malloc(n) + free"] + [c[0].removeprefix("empty ") for c in CASES], bare_report(best)
    )


def _pure_python_row(n: int) -> list[float] | None:
    """Measure the pure-Python hot path in a child process (the twin is chosen at import)."""
    import json
    import subprocess

    env = child_env(CUPY_POOLMEM_PURE_PYTHON="1")
    r = subprocess.run(
        [sys.executable, "-m", "cupy_poolmem.benchmarks.alloc", "--child", str(n)],
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


def _peer_costs(quick: bool) -> str | None:
    """Microseconds for what a peer grant touches, GPU 0's pool without and with grants."""
    if cupy_poolmem.device_count() < 2:
        return None
    peers = cupy_poolmem.DevicePool(0, peer_access="all")
    n_peers = len(peers.peer_access)
    peers.close()
    if n_peers == 0:
        return "(peer access costs not measured: no GPU can access GPU 0's memory)"
    reps = 8 if quick else 24
    sync = cupy.cuda.runtime.deviceSynchronize

    def create(pa: object) -> float:
        t0 = time.perf_counter()
        p = cupy_poolmem.DevicePool(0, peer_access=pa)
        dt = time.perf_counter() - t0
        p.close()
        return dt

    def grow(pa: object, size: int = 256 << 20) -> float:
        p = cupy_poolmem.DevicePool(0, peer_access=pa, reuse_cache=0)
        runs = []
        for _ in range(reps):
            p.trim()  # nothing reserved: the next malloc maps new memory
            t0 = time.perf_counter()
            m = p.malloc(size)
            sync()
            runs.append(time.perf_counter() - t0)
            del m
            sync()
        p.close()
        return statistics.median(runs)

    def steady(pa: object, size: int) -> float:
        p = cupy_poolmem.DevicePool(0, peer_access=pa)
        with cupy.cuda.using_allocator(p.malloc):
            dt = median_time(lambda: cupy.empty(size, dtype=cupy.uint8), 2000 if quick else 6000)
        sync()
        p.close()
        return dt

    def grant_later(size: int = 1 << 30) -> float:
        p = cupy_poolmem.DevicePool(0, peer_access=None)
        m = p.malloc(size)
        sync()
        runs = []
        for _ in range(max(3, reps // 4)):
            t0 = time.perf_counter()
            p.peer_access = "all"
            runs.append(time.perf_counter() - t0)
            p.peer_access = None
        del m
        sync()
        p.close()
        return statistics.median(runs)

    with cupy.cuda.Device(0):
        rows = []
        measures = [
            (
                "create DevicePool (then close)",
                lambda pa: statistics.median(create(pa) for _ in range(reps)),
            ),
            ("grow by 256 MiB (malloc after trim, synced)", grow),
            ("cupy.empty(1 MiB) + free, steady", lambda pa: steady(pa, 1 << 20)),
            ("cupy.empty(64 MiB) + free, steady", lambda pa: steady(pa, 64 << 20)),
        ]
        for name, fn in measures:
            best: dict[Any, float] = {}
            for _ in range(2):  # alternate, keep each one's best
                for pa in (None, "all"):
                    best[pa] = min(best.get(pa, float("inf")), fn(pa))
            none, every = best[None], best["all"]
            rows.append(
                [name, f"{none * 1e6:9.2f} us", f"{every * 1e6:9.2f} us", f"{every / none:.2f}x"]
            )
        later = grant_later()
        rows.append(
            ["set peer_access='all' on a pool holding 1 GiB", "-", f"{later * 1e6:9.2f} us", "-"]
        )
    return table(
        ["GPU 0 pool", "peer_access=None", f"peer_access='all' ({n_peers} peers)", "ratio"], rows
    )


def _stream_costs(quick: bool) -> str:
    """``cupy.empty(1 MiB)`` + free on CuPy's default stream and on a non-blocking one.

    On any stream but the legacy one a pool allocation asks the driver whether the
    stream captures a graph (one ``cuStreamIsCapturing`` call); this table shows what
    that costs next to CuPy's pool, which asks nothing.
    """
    reps = 2000 if quick else 6000
    mempool = cupy.cuda.MemoryPool()
    pool = cupy_poolmem.DevicePool()
    measured: list[tuple[str, list[float]]] = []
    try:
        for name, malloc in (("cupy MemoryPool", mempool.malloc), ("DevicePool", pool.malloc)):
            vals = []
            for stream in (cupy.cuda.Stream.null, cupy.cuda.Stream(non_blocking=True)):
                with stream, cupy.cuda.using_allocator(malloc):
                    vals.append(
                        min(
                            median_time(lambda: cupy.empty(1 << 20, dtype=cupy.uint8), reps)
                            for _ in range(3)
                        )
                    )
                stream.synchronize()
            measured.append((name, vals))
    finally:
        pool.close()
        mempool.free_all_blocks()
    base = measured[0][1][1] / measured[0][1][0]
    rows = [
        [name, f"{v[0] * 1e6:7.2f} us", f"{v[1] * 1e6:7.2f} us"]
        + [f"{v[1] / v[0]:.2f}x ({v[1] / v[0] / base:.2f}x MemoryPool's)"]
        for name, v in measured
    ]
    return table(
        ["cupy.empty(1 MiB) + free", "default stream", "non-blocking stream", "ratio"], rows
    )


@dataclasses.dataclass(frozen=True)
class Measurements:
    """The measurements :func:`main` runs besides its interleaved tables.

    Each one runs on the GPU; a test hands in its own.

    Examples
    --------
    >>> Measurements(peer_costs=lambda quick: None).peer_costs(True) is None
    True
    """

    pure_python_row: Callable[[int], list[float] | None] = _pure_python_row
    paired_pool: Callable[[bool], list[PairedRatio]] = _paired_pool
    paired_shared_expandable: Callable[[bool], list[PairedRatio]] = _paired_shared_expandable
    paired_observability: Callable[[list[tuple[Any, ...]], bool], dict[str, list[PairedRatio]]] = (
        _paired_observability
    )
    bare_costs: Callable[[bool], str] = _bare_costs
    stream_costs: Callable[[bool], str] = _stream_costs
    peer_costs: Callable[[bool], str | None] = _peer_costs


def main(argv: Sequence[str] | None = None, measurements: Measurements | None = None) -> None:
    m = measurements or Measurements()
    argv = sys.argv[1:] if argv is None else list(argv)
    require_gpu("alloc")
    if "--child" in argv:
        return _child(int(argv[argv.index("--child") + 1]))
    quick = "--quick" in argv
    n = 2000 if quick else 6000
    print(header("allocation benchmark: microseconds per op (ratio to cupy MemoryPool)"))
    rows, base = [], None
    entries = peers()
    # The guard's row goes last, in its own phase: what it leaves behind (its
    # quarantine) must not weigh on the rows measured with everything off.
    plain = [e for e in entries if len(e) == 3]
    observed = [e for e in entries if len(e) > 3]
    results = measure_interleaved(plain, n) + measure_interleaved(observed, n, rounds=2)
    measured: list[tuple[str, list[float], Any]] = [
        (e[0], vals, e[2]) for e, vals in zip(plain + observed, results)
    ]
    py = m.pure_python_row(n)
    if py:
        measured.append(("cupy_poolmem DevicePool [pure python, child process]", py, None))
    for name, vals, cleanup in measured:
        base = base or vals
        rows.append([name] + [f"{v * 1e6:7.2f} us ({v / b:.2f}x)" for v, b in zip(vals, base)])
        if cleanup:
            cleanup()
    print(table(["allocator"] + [c[0] for c in CASES] + ["chain 10k f32"], rows))
    overhead = guard_overhead(measured)
    if overhead:
        print(overhead)
    for line in pool_goals(m.paired_pool(quick)):
        print(line)
    shared = m.paired_shared_expandable(quick)
    for line in pool_goals(shared, "DevicePool large_blocks='expandable' ipc=True"):
        print(line)
    print()
    print("the pool alone: microseconds per malloc(n) + free, no cupy.empty (ratio to MemoryPool)")
    print(m.bare_costs(quick))
    print()
    print(
        "observability: microseconds per op (ratio to the plain DevicePool, ratio to cupy "
        "MemoryPool), measured together"
    )
    obs = observed_entries()
    obs_vals = measure_interleaved(obs, n)
    paired = m.paired_observability(obs, quick)
    obs_rows, goals = observability_report([(e[0], v) for e, v in zip(obs, obs_vals)], paired)
    print(table(["allocator"] + [c[0] for c in CASES] + ["chain 10k f32"], obs_rows))
    for line in goals:
        print(line)
    for e in obs:
        if e[2]:
            e[2]()
    print()
    print("allocation on a non-blocking stream (the graph-capture query): microseconds")
    print(m.stream_costs(quick))
    costs = m.peer_costs(quick)
    if costs:
        print()
        print("peer access costs: microseconds (ratio of 'all' to None)")
        print(costs)


if __name__ == "__main__":
    from cupy_poolmem.benchmarks._common import run

    run(main, "alloc")  # --save DIR: also write DIR/alloc-<device>.json
