"""Moving a CuPy chunk between two GPU workers: Dask over TCP vs cupy_poolmem's pool IPC.

Seconds per cross-worker task for each chunk size and path, beside the same-worker
floor and a peer copy.  The rows: docs/cli.rst, "bench transfer".
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

from .._sizes import format_bytes, parse_bytes
from ._common import header, table

try:  # the dask extra; without it main() says what to install, in one line
    from .. import _dask_transfer
    from .._dask_transfer import _process
    from ..dask import PoolmemPlugin
except ImportError:
    _dask_transfer = _process = PoolmemPlugin = None  # type: ignore[assignment, misc]

SIZES = ("1MiB", "64MiB", "256MiB", "1GiB")


# -- tasks ---------------------------------------------------------------------------------
def _make(nbytes: int, seed: int):
    import cupy

    return cupy.full(nbytes // 8, float(seed), dtype="f8")


def _consume(x) -> float:
    return float(x.sum())


def _set_ipc(flag: bool) -> bool:
    cfg = _process._state.config
    if cfg is None:
        return False
    cfg.ipc = flag
    return True


def _counters() -> dict:
    return _dask_transfer.counters()


# -- measurements ----------------------------------------------------------------------------
def _time_task(client, a: str, b: str, nbytes: int, seed: int) -> float:
    from distributed import wait

    x = client.submit(_make, nbytes, seed, workers=[a], pure=False)
    wait(x)
    t0 = time.perf_counter()
    got = client.submit(_consume, x, workers=[b], pure=False).result()
    dt = time.perf_counter() - t0
    want = float(seed) * (nbytes // 8)
    if got != want:
        raise SystemExit(f"wrong data on {b}: sum {got} != {want} ({nbytes} bytes)")
    del x
    return dt


def _median_task(client, a: str, b: str, nbytes: int, repeats: int) -> float:
    _time_task(client, a, b, nbytes, 1)  # warm-up: connections, first mapping
    return statistics.median(_time_task(client, a, b, nbytes, s + 2) for s in range(repeats))


def peer_copy(nbytes: int, repeats: int) -> tuple[float, bool]:
    """Median seconds of one ``nbytes`` copy GPU 0 -> GPU 1; whether peer access exists."""
    import cupy

    can = bool(cupy.cuda.runtime.deviceCanAccessPeer(1, 0))
    with cupy.cuda.Device(0):
        src = cupy.ones(nbytes // 8, dtype="f8")
        cupy.cuda.Device(0).synchronize()
    with cupy.cuda.Device(1):
        dst = cupy.empty_like(src)  # allocated on device 1
        stream = cupy.cuda.Stream(non_blocking=True)
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            dst.data.copy_from_device_async(src.data, nbytes, stream)
            stream.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
        ok = float(dst[: 1 << 10].sum()) == 1024.0
    del src, dst
    cupy.get_default_memory_pool().free_all_blocks()
    if not ok:
        raise SystemExit("peer copy produced wrong data")
    return statistics.median(times), can


def run_cluster(plugin: bool, sizes: list[int], repeats: int) -> dict[tuple[str, Any], Any]:
    """Times per mode and size on one fresh two-worker cluster."""
    import dask_cuda
    from distributed import Client

    out: dict[tuple[str, Any], Any] = {}
    with (
        dask_cuda.LocalCUDACluster(
            CUDA_VISIBLE_DEVICES="0,1",
            n_workers=2,
            threads_per_worker=1,
            protocol="tcp",
            dashboard_address=None,
        ) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(2, timeout=120)
        if plugin:
            client.register_plugin(PoolmemPlugin())
        a, b = sorted(client.scheduler_info()["workers"])
        modes = ["floor", "tcp", "ipc"] if plugin else ["default"]
        for mode in modes:
            before: dict = {}
            if plugin:
                ok = client.run(_set_ipc, mode == "ipc")
                if not all(ok.values()):
                    raise SystemExit(f"the transfer path is not installed on every worker: {ok}")
                before = client.run(_counters)
            for n in sizes:
                print(f"... {mode} {n / 2**20:.0f} MiB", file=sys.stderr, flush=True)
                dst = a if mode == "floor" else b
                out[(mode, n)] = _median_task(client, a, dst, n, repeats)
            if plugin:
                after = client.run(_counters)
                out[(mode, "sent_ipc")] = after[a]["sent_ipc"] - before[a]["sent_ipc"]
                out[(mode, "received")] = sum(
                    after[b][k] - before[b][k] for k in ("received_copy", "received_view")
                )
                out[(mode, "fallback")] = {
                    k: v - before[a]["fallback"].get(k, 0) for k, v in after[a]["fallback"].items()
                }
        if plugin:
            client.run(_set_ipc, True)
    return out


def _versions() -> str:
    parts = []
    for mod in ("dask", "distributed", "dask_cuda"):
        try:
            parts.append(f"{mod} {__import__(mod).__version__}")
        except Exception:
            parts.append(f"{mod} not installed")
    return " | ".join(parts)


def _device_names() -> str:
    import cupy

    names = []
    for d in (0, 1):
        name = cupy.cuda.runtime.getDeviceProperties(d)["name"]
        names.append(name.decode() if isinstance(name, bytes) else name)
    return " + ".join(names)


def _fmt_ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m cupy_poolmem.benchmarks.dask_transfer",
        description=(__doc__ or "").splitlines()[0],
    )
    ap.add_argument("--sizes", default=",".join(SIZES), help="comma-separated chunk sizes")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--quick", action="store_true", help="3 repeats, no second (plugin-less) cluster"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats = min(args.repeats, 3)
    sizes = [parse_bytes(s.strip(), name="--sizes") for s in args.sizes.split(",") if s.strip()]

    for mod in ("dask", "distributed", "dask_cuda"):
        if importlib.util.find_spec(mod) is None:
            sys.exit(f"{mod} is not installed: pip install dask distributed dask-cuda")
    if cupy_poolmem.device_count() < 2:
        sys.exit(f"needs two CUDA GPUs; CUDA sees {cupy_poolmem.device_count()}")

    t_start = time.perf_counter()
    peer = {n: peer_copy(n, max(args.repeats, 5)) for n in sizes}
    res = run_cluster(True, sizes, args.repeats)
    if not args.quick:
        res.update(run_cluster(False, sizes, args.repeats))

    print(
        header(f"Dask chunk transfer between two GPU workers (TCP comm), median of {args.repeats}")
    )
    print(f"GPUs: {_device_names()} | {_versions()}")
    print(
        "seconds from submit to result of float(x.sum()) on worker B with x made on worker A; "
        "ratios: tcp / pool IPC (speed-up) and pool IPC / same-worker floor"
    )
    cols = ["chunk", "floor ms", "tcp (dask) ms", "pool IPC ms", "speed-up", "IPC/floor"]
    if not args.quick:
        cols.append("dask-cuda default ms")
    cols += ["peer copy ms", "peer GB/s", "IPC extra GB/s"]
    rows = []
    for n in sizes:
        floor, tcp, ipc = res[("floor", n)], res[("tcp", n)], res[("ipc", n)]
        row = [
            format_bytes(n),
            _fmt_ms(floor),
            _fmt_ms(tcp),
            _fmt_ms(ipc),
            f"{tcp / ipc:.1f}x",
            f"{ipc / floor:.2f}",
        ]
        if not args.quick:
            row.append(_fmt_ms(res[("default", n)]))
        pc, _ = peer[n]
        extra = ipc - floor
        row += [
            _fmt_ms(pc),
            f"{n / pc / 1e9:.0f}",
            f"{n / extra / 1e9:.1f}" if extra > 0 else "-",
        ]
        rows.append(row)
    print(table(cols, rows))
    can = all(c for _, c in peer.values())
    print(f"peer access GPU 1 -> GPU 0: {'yes' if can else 'no (copies staged by the driver)'}")
    for mode in ("floor", "tcp", "ipc"):
        print(
            f"{mode}: chunks sent through IPC {res[(mode, 'sent_ipc')]}, received "
            f"{res[(mode, 'received')]}, Dask's path {res[(mode, 'fallback')]}"
        )
    if res[("ipc", "sent_ipc")] < len(sizes) * args.repeats:
        print("WARNING: the pool IPC row did not send every chunk through IPC (see counters)")
    one_gib = 1 << 30
    if one_gib in sizes:
        ms = res[("ipc", one_gib)] * 1e3
        print(f"goal 1 GiB <= 20 ms: {ms:.1f} ms -> {'met' if ms <= 20 else 'MISSED'}")
    mib64 = 64 << 20
    if mib64 in sizes:
        r = res[("ipc", mib64)] / res[("floor", mib64)]
        print(f"goal 64 MiB within 2x floor: {r:.2f}x -> {'met' if r <= 2 else 'MISSED'}")
    print(f"(run took {time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    from cupy_poolmem.benchmarks._common import run

    run(main, "transfer")  # --save DIR: also write DIR/transfer-<device>.json
