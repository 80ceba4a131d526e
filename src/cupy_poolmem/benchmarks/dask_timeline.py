"""Where a dask-cuda ``transpose_sum`` run spends its time, run by run.

The same graph as ``dask_cuda.benchmarks.local_cupy -o transpose_sum`` (a fresh random
array per run, ``(x + x.T).sum()`` persisted, then every worker's GPU synchronised),
on a ``LocalCUDACluster`` per variant, with Dask's task stream, the workers' event-loop
lag, their garbage collections and cupy_poolmem's transfer counters taken per run.
``bench dask-cuda`` measures the peers; this says where a slow run lost its time.
The variants: docs/cli.rst, "bench dask-timeline".
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from ._common import header, table
from .dask_cuda_local import CONFIGURED_ENV

try:  # the dask extra; without it the workers report no transfer counters
    from .. import _dask_transfer
except ImportError:
    _dask_transfer = None  # type: ignore[assignment]

__all__ = ["VARIANTS", "analyse_run", "fit", "main"]

#: name -> (protocol, environment of the workers, switch interval in the workers or None).
#: cupy_poolmem is switched on as ``bench dask-cuda`` does it (:data:`CONFIGURED_ENV`).
VARIANTS: dict[str, tuple[str, dict[str, str], float | None]] = {
    "tcp+cupy_poolmem": ("tcp", dict(CONFIGURED_ENV), None),
    "tcp+cupy_poolmem+switch": ("tcp", dict(CONFIGURED_ENV), 0.0005),
    "tcp+cupy_poolmem+offload": (
        "tcp",
        dict(CONFIGURED_ENV, DASK_DISTRIBUTED__COMM__OFFLOAD="1"),
        None,
    ),
    "tcp+cupy_poolmem+nofreeze": (
        "tcp",
        dict(CONFIGURED_ENV, DASK_CUPY_POOLMEM__GC_FREEZE="false"),
        None,
    ),
    "tcp": ("tcp", {}, None),
    "ucxx": ("ucxx", {}, None),
}


class _Probe:
    """A worker's own measurements between two :func:`_take` calls: garbage
    collections (seconds each) and the event loop's lateness (a 1 ms sleep's overshoot)."""

    def __init__(self) -> None:
        self.gc: list[float] = []
        self.lag: list[float] = []
        self.events: list[tuple] = []  # (what, wall start, seconds, detail)
        self._t0: float | None = None
        self.task: Any = None

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            took = time.perf_counter() - self._t0
            self._t0 = None
            if took > 0.001:  # the ones that matter, with their wall time and generation
                self.gc.append(took)
                self.events.append(("gc", time.time() - took, took, info.get("generation")))

    async def watch_loop(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            late = time.perf_counter() - t0 - 0.001
            if late > 0.002:
                self.lag.append(late)
                self.events.append(("lag", time.time() - late, late, None))


_PROBE = _Probe()


async def _install_probe(switch: float | None = None) -> int:
    if _PROBE.on_gc not in gc.callbacks:
        gc.callbacks.append(_PROBE.on_gc)
    if _PROBE.task is None:
        _PROBE.task = asyncio.ensure_future(_PROBE.watch_loop())
    if switch:
        sys.setswitchinterval(switch)
    return id(_PROBE)


def _take() -> dict[str, Any]:
    out: dict[str, Any] = {
        "gc": list(_PROBE.gc),
        "lag": list(_PROBE.lag),
        "events": list(_PROBE.events),
        "probe": id(_PROBE),
    }
    _PROBE.gc.clear()
    _PROBE.lag.clear()
    _PROBE.events.clear()
    try:
        out["counters"] = _dask_transfer.counters()
    except Exception:  # noqa: BLE001 - no dask extra on this worker: no counters
        out["counters"] = {}
    return out


def _sync() -> None:
    import cupy

    cupy.cuda.Device().synchronize()


def _diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What a worker's transfer counters gained in one run (counts, and per step n/total)."""
    out: dict[str, Any] = {}
    for k, v in after.items():
        if isinstance(v, int) and not isinstance(v, bool):
            d = v - int(before.get(k, 0) or 0)
            if d:
                out[k] = d
    fb = {
        k: n - (before.get("fallback") or {}).get(k, 0)
        for k, n in (after.get("fallback") or {}).items()
    }
    if any(fb.values()):
        out["fallback"] = {k: n for k, n in fb.items() if n}
    steps = {}
    old = before.get("timings") or {}
    for step, t in (after.get("timings") or {}).items():
        o = old.get(step, {"n": 0, "total_s": 0.0})
        n = int(t["n"]) - int(o["n"])
        if n:
            steps[step] = {"n": n, "total_s": float(t["total_s"]) - float(o["total_s"])}
    if steps:
        out["timings"] = steps
    return out


def analyse_run(records: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """One run's task stream (``get_task_stream().data``) summed up.

    Returns ``{"wall", "span", "transfers", "transfer_total", "transfer_max",
    "computes", "compute_max", "compute_by_prefix"}`` (seconds; ``span``: first
    start to last stop of anything the workers did).

    Examples
    --------
    >>> recs = [{"key": "('add-1', 0, 0)", "worker": "w1", "startstops": [
    ...     {"action": "transfer", "start": 1.0, "stop": 1.004, "source": "w2"},
    ...     {"action": "compute", "start": 1.005, "stop": 1.006}]}]
    >>> r = analyse_run(recs, 0.01)
    >>> r["transfers"], round(r["transfer_max"], 3), round(r["span"], 3)
    (1, 0.004, 0.006)
    """
    transfers: dict[tuple, float] = {}
    computes: list[float] = []
    by_prefix: dict[str, float] = {}
    starts, stops = [], []
    slowest: tuple[float, str, str, float] = (0.0, "", "", 0.0)
    for rec in records:
        key = str(rec.get("key"))
        prefix = key.strip("('\"").split("-")[0]
        for ss in rec.get("startstops", ()):
            a, s, e = ss.get("action"), float(ss["start"]), float(ss["stop"])
            starts.append(s)
            stops.append(e)
            if a == "transfer":
                transfers[(rec.get("worker"), ss.get("source"), round(s, 6))] = e - s
            elif a == "compute":
                computes.append(e - s)
                by_prefix[prefix] = max(by_prefix.get(prefix, 0.0), e - s)
                if e - s > slowest[0]:
                    slowest = (e - s, key, str(rec.get("worker")), s)
    tr = list(transfers.values())
    return {
        "wall": wall,
        "span": (max(stops) - min(starts)) if starts else 0.0,
        "transfers": len(tr),
        "transfer_total": sum(tr),
        "transfer_max": max(tr, default=0.0),
        "computes": len(computes),
        "compute_max": max(computes, default=0.0),
        "compute_by_prefix": by_prefix,
        "slowest_compute": list(slowest),
    }


def fit(runs: list[dict[str, Any]]) -> tuple[float, float, float]:
    """Least squares ``wall = a + b * transfers`` over ``runs``: ``(a, b, r)``.

    Examples
    --------
    >>> fit([{"wall": 0.04, "transfers": 5}, {"wall": 0.05, "transfers": 10}])
    (0.03, 0.002, 1.0)
    """
    xs = [float(r["transfers"]) for r in runs]
    ys = [float(r["wall"]) for r in runs]
    if len(xs) < 2 or len(set(xs)) < 2:
        return (statistics.fmean(ys) if ys else 0.0), 0.0, 0.0
    b, a = statistics.linear_regression(xs, ys)
    r = statistics.correlation(xs, ys) if len(set(ys)) > 1 else 0.0
    return round(a, 9), round(b, 9), round(r, 9)


def run_variant(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Start a cluster for ``name``, run the graph ``args.runs`` times; per-run results."""
    import importlib

    import dask.array as da
    import dask.config
    from distributed import Client, LocalCluster, get_task_stream, wait

    # By name: run as ``python -m``, this file is ``__main__``, whose functions are sent
    # by value (each with its own copy of the probe); the module's are found on the worker.
    me = importlib.import_module("cupy_poolmem.benchmarks.dask_timeline")
    proto, env, switch = VARIANTS[name]
    if proto == "ucxx":
        import importlib.util

        if importlib.util.find_spec("distributed_ucxx") is None:
            return {"skipped": "distributed_ucxx is not installed"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    dask.config.refresh()  # the nannies run here: they read the preload from the config
    n = len(args.devices.split(","))
    t_start = time.perf_counter()
    try:
        if args.cpu:  # the plumbing without a GPU: numpy chunks on a LocalCluster
            import numpy

            xp: Any = numpy
            cluster = LocalCluster(
                n_workers=n, threads_per_worker=1, dashboard_address=None, protocol=proto
            )
        else:
            import cupy
            from dask_cuda import LocalCUDACluster

            xp = cupy

            cluster = LocalCUDACluster(
                protocol=proto,
                n_workers=n,
                threads_per_worker=1,
                CUDA_VISIBLE_DEVICES=args.devices,
                dashboard_address=None,
            )
        with cluster, Client(cluster) as client:
            started = time.perf_counter() - t_start
            probes = client.run(me._install_probe, switch)
            # Walks the frozen objects (about 20 ms): read once, outside the runs.
            frozen = client.run(gc.get_freeze_count)
            rs = da.random.RandomState(RandomState=xp.random.RandomState)
            runs = []
            for _ in range(args.runs):
                x = rs.random((args.size, args.size), chunks=args.chunk).persist()
                wait(x)
                before = client.run(me._take)
                with get_task_stream(client) as ts:
                    result = (x + x.T).sum()
                    t1 = time.perf_counter()
                    t1_wall = time.time()
                    wait(client.persist(result))
                    if not args.cpu:
                        client.run(me._sync)
                    took = time.perf_counter() - t1
                after = client.run(me._take)
                r = analyse_run(list(ts.data), took)
                r["t0_wall"] = t1_wall  # lags and collections before it are not the run's
                r["workers"] = {
                    w: {
                        "gc": after[w]["gc"],
                        "lag": after[w]["lag"],
                        "events": after[w].get("events", []),
                        # the probe that took them is the one installed (not a copy)
                        "probe_installed": after[w].get("probe") == probes.get(w),
                        "counters": _diff(before[w]["counters"], after[w]["counters"]),
                    }
                    for w in after
                }
                runs.append(r)
                del x, result
            return {"started_s": started, "runs": runs, "frozen": frozen}
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return {"skipped": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        dask.config.refresh()


def in_run(r: dict[str, Any], what: str) -> list[float]:
    """The seconds of the workers' ``what`` ("lag" or "gc") events of run ``r`` that began
    once its graph was submitted (``t0_wall``): a worker's loop blocked by what came
    before (the previous run's clean-up, the probe's own call) is not the run's.  Runs
    saved without ``t0_wall`` count every event taken with them.

    Examples
    --------
    >>> w = {"lag": [0.018, 0.003], "events": [("lag", 9.0, 0.018, None), ("lag", 10.5, 0.003, None)]}
    >>> in_run({"t0_wall": 10.0, "workers": {"a": w}}, "lag")
    [0.003]
    >>> in_run({"workers": {"a": w}}, "lag")
    [0.018, 0.003]
    """
    ws = r["workers"].values()
    t0 = r.get("t0_wall")
    if t0 is None:
        return [x for w in ws for x in w[what]]
    return [e[2] for w in ws for e in w.get("events", []) if e[0] == what and e[1] >= t0]


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def render(name: str, res: dict[str, Any]) -> str:
    """One row per run: wall, span, transfers, compute, and the workers' lag/GC/claims."""
    if "runs" not in res:
        return f"{name}: skipped ({res.get('skipped')})"
    rows = []
    for i, r in enumerate(res["runs"]):
        ws = r["workers"].values()
        lag = in_run(r, "lag")
        gcs = in_run(r, "gc")
        steps: dict[str, list[float]] = {}
        for w in ws:
            for step, t in (w["counters"].get("timings") or {}).items():
                s = steps.setdefault(step, [0, 0.0])
                s[0] += t["n"]
                s[1] += t["total_s"]
        top = sorted(steps.items(), key=lambda kv: -kv[1][1])[:3]
        rows.append(
            [
                str(i),
                _ms(r["wall"]),
                _ms(r["span"]),
                str(r["transfers"]),
                _ms(r["transfer_total"]),
                _ms(r["transfer_max"]),
                _ms(r["compute_max"]),
                f"{len(lag)}/{_ms(sum(lag))}/{_ms(max(lag, default=0.0))}",
                f"{len(gcs)}/{_ms(sum(gcs))}/{_ms(max(gcs, default=0.0))}",
                " ".join(f"{k}={int(n)}:{_ms(t)}" for k, (n, t) in top) or "-",
            ]
        )
    cols = ["run", "wall ms", "span ms", "transfers", "xfer sum ms", "xfer max ms",
            "compute max ms", "loop lag n/sum/max", "gc n/sum/max", "top steps n:ms"]  # fmt: skip
    walls = [r["wall"] for r in res["runs"]]
    later = walls[1:] or walls
    a, b, rr = fit(res["runs"][1:])
    tail = (
        f"  first {_ms(walls[0])} ms, best {_ms(min(walls))} ms, later median "
        f"{_ms(statistics.median(later))} ms, worst later/best {max(later) / min(walls):.2f}; "
        f"cluster start {res.get('started_s', 0):.1f} s\n"
        f"  later runs: wall = {_ms(a)} ms + {_ms(b)} ms per transfer (r = {rr:.2f})"
    )
    return f"-- {name}\n{table(cols, rows)}\n{tail}"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cupy_poolmem bench dask-timeline")
    p.add_argument("--devices", default="0,1")
    p.add_argument("--size", type=int, default=20000)
    p.add_argument("--chunk", type=int, default=5000)
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--variants", default="tcp+cupy_poolmem,ucxx")
    p.add_argument("--json", default=None, help="write every run's figures here")
    p.add_argument("--cpu", action="store_true", help="numpy chunks, no GPU (a dry run)")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error(f"--runs must be at least 1 (got {args.runs})")
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    print(header(f"dask-cuda transpose_sum run by run on GPUs {args.devices}"))
    print(f"size {args.size}, chunk {args.chunk}, {args.runs} runs per variant")
    results = {}
    for n in names:
        results[n] = run_variant(n, args)
        print(render(n, results[n]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"argv": list(argv or sys.argv[1:]), "devices": args.devices, "results": results}, f
            )
    return 0


if __name__ == "__main__":
    from cupy_poolmem.benchmarks._common import run

    run(main, "dask-timeline")
