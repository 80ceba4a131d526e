"""GPU tests of the Dask integration: LocalCUDACluster workers allocate from the plugin's pools."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from support.gpus import visible

import cupy_poolmem as cpm

pytestmark = pytest.mark.gpu

if cpm.device_count() == 0:
    pytest.skip("needs a CUDA GPU: this machine has no GPU or driver", allow_module_level=True)

cupy = pytest.importorskip("cupy")
dask = pytest.importorskip("dask", reason="dask is not installed")
da = pytest.importorskip("dask.array", reason="dask.array is not installed")
pytest.importorskip("distributed", reason="distributed is not installed")
dask_cuda = pytest.importorskip("dask_cuda", reason="dask-cuda is not installed")

from distributed import Client  # noqa: E402

from cupy_poolmem.dask import PoolmemPlugin, gather_stats  # noqa: E402

MiB = 1 << 20
N = 2000


def _workload(client, n=N, chunk=500) -> float:
    x = da.arange(n * n, chunks=chunk * chunk, dtype="f8").reshape(n, n)
    x = x.rechunk((chunk, chunk)).map_blocks(cupy.asarray, dtype="f8")
    return float(((x + x.T) * 2 - 1).mean(0).sum().compute())


def _expected(n=N) -> float:
    x = np.arange(n * n, dtype="f8").reshape(n, n)
    return float(((x + x.T) * 2 - 1).mean(0).sum())


def _worker_allocator_state() -> dict:
    import os

    import cupy

    from cupy_poolmem import _runtime

    alloc = _runtime.installed_allocator("device")
    dev = cupy.cuda.runtime.getDevice()
    return {
        "plugin_allocator": alloc is not None,
        "default_pool_bytes": int(cupy.get_default_memory_pool().total_bytes()),
        "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "device": dev,
        "pci": cupy.cuda.Device(dev).pci_bus_id,
        "pool_ipc": bool(alloc.pool(dev).ipc) if alloc is not None else None,
        "small_pool": int(alloc.pool(dev).small_pool) if alloc is not None else None,
    }


def _small_block_in_the_reservation() -> dict:
    """A 1 MiB array on the worker: does the pool reserve more than it had?"""
    import cupy

    from cupy_poolmem import _runtime

    pool = _runtime.installed_allocator("device").pool()
    before = pool.stats().reserved_bytes
    x = cupy.full(1 << 20, 7, dtype=cupy.uint8)
    ok = int(x.sum()) == 7 << 20
    return {"before": before, "after": pool.stats().reserved_bytes, "ok": ok}


def _cluster(**kw):
    kw.setdefault("n_workers", 1)
    kw.setdefault("threads_per_worker", 4)
    kw.setdefault("CUDA_VISIBLE_DEVICES", visible(1)[0])  # this process's first GPU
    kw.setdefault("dashboard_address", None)
    return dask_cuda.LocalCUDACluster(**kw)


def test_dask_array_workload_allocates_from_the_plugin_pool():
    with _cluster() as cluster, Client(cluster) as client:
        client.register_plugin(PoolmemPlugin(pool_size=256 * MiB, maximum_pool_size="0.5"))
        ((addr, s0),) = gather_stats(client).items()
        assert s0["kind"] == "device" and s0["device"] == 0
        assert s0["reserved_bytes"] >= 256 * MiB  # pool_size was reserved up front
        assert s0["max_size"] > 0

        assert _workload(client) == pytest.approx(_expected(), rel=1e-9)

        s1 = gather_stats(client)[addr]
        assert s1["n_allocs"] > s0["n_allocs"] + 16  # every chunk came from the pool
        assert s1["peak_used_bytes"] >= 500 * 500 * 8
        state = client.run(_worker_allocator_state)[addr]
        assert state["plugin_allocator"] and state["pool_ipc"]
        assert state["default_pool_bytes"] == 0  # CuPy's own pool never used
        # The worker's start-up objects were frozen at setup (gc_freeze's default).
        assert client.run(gc.get_freeze_count)[addr] > 10_000
        assert state["cvd"].split(",")[0] == visible(1)[0]
        pinned = gather_stats(client, kind="pinned")[addr]
        assert pinned["kind"] == "pinned"

        # Restarted workers get their pools again (the scheduler re-sends the plugin).
        client.restart()
        ((addr2, s2),) = gather_stats(client).items()
        assert s2["reserved_bytes"] >= 256 * MiB
        assert _workload(client) == pytest.approx(_expected(), rel=1e-9)
        assert gather_stats(client)[addr2]["n_allocs"] > s2["n_allocs"]

        # Removing the plugin tears it down: CuPy's default allocator is back.
        client.unregister_worker_plugin("cupy-poolmem")
        state = client.run(_worker_allocator_state)[addr2]
        assert not state["plugin_allocator"]
        assert client.run(gc.get_freeze_count)[addr2] == 0  # given back at teardown
        with pytest.raises(cpm.PoolClosedError, match="no cupy_poolmem device pool"):
            gather_stats(client)


def test_a_pre_reserved_pool_serves_small_blocks_from_its_reservation():
    """pool_size without a cap: the pool is one CUDA pool (no small-block pool), so a
    small array is carved out of the reservation instead of reserving a new chunk."""
    with _cluster() as cluster, Client(cluster) as client:
        client.register_plugin(PoolmemPlugin(pool_size=64 * MiB, pinned=False))
        ((addr, state),) = client.run(_worker_allocator_state).items()
        assert state["plugin_allocator"] and state["small_pool"] == 0
        r = client.run(_small_block_in_the_reservation)[addr]
        assert r["ok"] and r["before"] >= 64 * MiB and r["after"] == r["before"]


def test_bad_fraction_against_the_real_gpu_is_reported_by_the_worker():
    with _cluster() as cluster, Client(cluster) as client:
        with pytest.raises(cpm.InvalidOptionError, match="more than maximum_pool_size"):
            client.register_plugin(PoolmemPlugin(pool_size="0.9", maximum_pool_size="1MiB"))
        # The failed setup left CuPy's allocator alone.
        (state,) = client.run(_worker_allocator_state).values()
        assert not state["plugin_allocator"]


def test_setup_in_a_plain_process_freezes_nothing():
    # PoolmemPlugin().setup() without a worker (a client, a notebook): the pools are
    # this process's, its objects stay the application's (no collection, no freeze).
    before = gc.get_freeze_count()
    assert len(gc.get_objects()) > 50_000  # what a freeze here would have frozen
    plugin = PoolmemPlugin(pool_size=16 * MiB)
    plugin.setup()
    try:
        # (a library may freeze a few hundred objects of its own on first use)
        assert gc.get_freeze_count() - before < 10_000
        x = cupy.full(1 << 20, 3, dtype=cupy.uint8)
        assert int(x.sum()) == 3 << 20
        del x
    finally:
        plugin.teardown()


def test_preload_module_configured_through_dask_config():
    with (
        dask.config.set(
            {
                "cupy-poolmem.pool-size": "128MiB",
                "cupy-poolmem.maximum-pool-size": "0.5",
                "cupy-poolmem.pinned": False,
                "cupy-poolmem.gc-freeze": False,
            }
        ),
        _cluster(preload=["cupy_poolmem.dask"]) as cluster,
        Client(cluster) as client,
    ):
        ((addr, s0),) = gather_stats(client).items()
        assert s0["reserved_bytes"] >= 128 * MiB
        assert _workload(client) == pytest.approx(_expected(), rel=1e-9)
        assert gather_stats(client)[addr]["n_allocs"] > s0["n_allocs"]
        with pytest.raises(cpm.PoolClosedError, match="pinned pool"):
            gather_stats(client, kind="pinned")
        # gc-freeze: false (the worker's libraries freeze a few hundred objects themselves)
        assert client.run(gc.get_freeze_count)[addr] < 10_000


@pytest.mark.multigpu
def test_two_workers_each_on_their_own_gpu():
    if cpm.device_count() < 2:
        pytest.skip(f"needs 2 GPUs; this machine has {cpm.device_count()}")
    with (
        _cluster(
            n_workers=2, threads_per_worker=2, CUDA_VISIBLE_DEVICES=",".join(visible(2))
        ) as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(PoolmemPlugin(pool_size=64 * MiB))
        states = client.run(_worker_allocator_state)
        assert len(states) == 2
        assert len({s["pci"] for s in states.values()}) == 2  # two different GPUs
        assert {s["cvd"].split(",")[0] for s in states.values()} == set(visible(2))
        assert all(s["device"] == 0 and s["plugin_allocator"] for s in states.values())
        s0 = gather_stats(client)
        assert _workload(client) == pytest.approx(_expected(), rel=1e-9)
        s1 = gather_stats(client)
        assert set(s1) == set(states)
        assert sum(s1[w]["n_allocs"] - s0[w]["n_allocs"] for w in s1) > 16
