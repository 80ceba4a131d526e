"""CPU tests of the Dask integration: options, config, and the no-GPU error from a worker."""

from __future__ import annotations

import pickle

import pytest

pytest.importorskip("dask", reason="dask is not installed (pip install 'cupy_poolmem[dask]')")
pytest.importorskip(
    "distributed", reason="distributed is not installed (pip install 'cupy_poolmem[dask]')"
)

import dask  # noqa: E402
from distributed import Client, LocalCluster  # noqa: E402

import cupy_poolmem as cpm  # noqa: E402
from cupy_poolmem._gc_freeze import GcFreeze  # noqa: E402
from cupy_poolmem.dask import (  # noqa: E402
    CONFIG_DEFAULTS,
    PoolmemPlugin,
    dask_setup,
    gather_stats,
)

NO_GPU = cpm.device_count() == 0
GB = 10**9


# -- sizes: byte strings and fractions, like dask-cuda's rmm_pool_size ---------------------
@pytest.mark.parametrize(
    "kw,total,expected",
    [
        (dict(pool_size="20GB"), 80 * GB, dict(pool_size=20 * GB)),
        (dict(pool_size="0.5"), 80 * GB, dict(pool_size=40 * GB)),
        (
            dict(pool_size=0.25, maximum_pool_size="0.9"),
            80 * GB,
            dict(pool_size=20 * GB, maximum_pool_size=72 * GB),
        ),
        (dict(maximum_pool_size="30GiB"), 80 * GB, dict(maximum_pool_size=30 * 2**30)),
        (
            dict(pool_size=1 << 30, release_threshold="2GiB"),
            80 * GB,
            dict(pool_size=1 << 30, release_threshold=2 << 30),
        ),
        (dict(release_threshold=0), 80 * GB, dict(release_threshold=0)),
        (dict(), 80 * GB, dict()),
        # The package's percentage, dask-cuda's decimal strings, and whole numbers as bytes.
        (dict(pool_size="50%"), 80 * GB, dict(pool_size=40 * GB)),
        (
            dict(pool_size=".25", maximum_pool_size="1.0"),
            80 * GB,
            dict(pool_size=20 * GB, maximum_pool_size=80 * GB),
        ),  # fmt: skip
        (dict(pool_size="1"), 80 * GB, dict(pool_size=1)),
        (dict(pool_size=1), 80 * GB, dict(pool_size=1)),
    ],
)
def test_resolve_bytes_and_fractions(kw, total, expected):
    full = {"pool_size": None, "maximum_pool_size": None, "release_threshold": None}
    full.update(expected)
    assert PoolmemPlugin(**kw).resolve(total) == full


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(pool_size="lots"), cpm.InvalidOptionError, "pool_size='lots' is not a size"),
        (dict(maximum_pool_size=[1]), cpm.OptionTypeError, "maximum_pool_size must be"),
        (dict(pool_size=-1), cpm.InvalidOptionError, "pool_size must be >= 0"),
        (dict(pool_size=1.5), cpm.InvalidOptionError, "fraction in"),
        (dict(pool_size="1.5"), cpm.InvalidOptionError, "whole number of bytes"),
        (dict(pool_size="150%"), cpm.InvalidOptionError, "percentage"),
        (
            dict(pool_size="20GB", maximum_pool_size="10GB"),
            cpm.InvalidOptionError,
            "more than maximum_pool_size",
        ),
        (
            dict(pool_size=0.5, maximum_pool_size="0.4"),
            cpm.InvalidOptionError,
            "more than maximum_pool_size",
        ),
        (
            dict(pool_size="2GB", release_threshold=0),
            cpm.InvalidOptionError,
            "release_threshold=0 is less than pool_size",
        ),
        (dict(pinned="yes"), cpm.OptionTypeError, "pinned must be True or False"),
        (dict(ipc=1), cpm.OptionTypeError, "ipc must be True or False"),
    ],
)
def test_bad_values_fail_at_construction(kw, exc, match):
    with pytest.raises(exc, match=match):
        PoolmemPlugin(**kw)


def test_mixed_forms_are_checked_against_the_gpu_size():
    plugin = PoolmemPlugin(pool_size="0.5", maximum_pool_size="10GB")  # unknowable yet
    assert plugin.resolve(16 * GB)["pool_size"] == 8 * GB
    with pytest.raises(cpm.InvalidOptionError, match="more than maximum_pool_size"):
        plugin.resolve(80 * GB)
    with pytest.raises(cpm.InvalidOptionError, match="more than the GPU has"):
        PoolmemPlugin(pool_size="100GB").resolve(80 * GB)


def test_plugin_pickles_without_runtime_state():
    plugin = PoolmemPlugin(pool_size="1GB", pinned=False)
    plugin._device_alloc = object()  # what setup leaves behind on a worker
    plugin._gc = GcFreeze(preload=())
    plugin._gc.frozen = True  # this process's freeze: another process must not undo it
    clone = pickle.loads(pickle.dumps(plugin))
    assert clone._device_alloc is None and clone._gc is None
    assert plugin._gc.frozen  # the original keeps its own
    assert (clone.pool_size, clone.pinned, clone.ipc) == ("1GB", False, True)
    assert clone.name == "cupy-poolmem"
    assert "pool_size='1GB'" in repr(clone)


# -- dask config -------------------------------------------------------------------------
def test_config_defaults_are_shipped():
    for key, value in CONFIG_DEFAULTS.items():
        assert dask.config.get(f"cupy-poolmem.{key}") == value
    plugin = PoolmemPlugin.from_config()
    assert plugin.pool_size is None and plugin.pinned is True and plugin.ipc is True


def test_config_keys_configure_the_plugin():
    with dask.config.set(
        {
            "cupy-poolmem.pool-size": "0.5",
            "cupy-poolmem.maximum-pool-size": "20GB",
            "cupy-poolmem.release-threshold": None,
            "cupy-poolmem.pinned": "false",
            "cupy-poolmem.ipc": False,
        }
    ):
        plugin = PoolmemPlugin.from_config()
    assert plugin.pool_size == "0.5" and plugin.maximum_pool_size == "20GB"
    assert plugin.pinned is False and plugin.ipc is False
    assert plugin.resolve(32 * GB)["pool_size"] == 16 * GB


def test_config_errors_name_the_key():
    with (
        dask.config.set({"cupy-poolmem.pinned": "maybe"}),
        pytest.raises(cpm.OptionTypeError, match="cupy-poolmem.pinned"),
    ):
        PoolmemPlugin.from_config()
    with (
        dask.config.set({"cupy-poolmem.pool-size": "huge"}),
        pytest.raises(cpm.InvalidOptionError, match="pool_size='huge'"),
    ):
        PoolmemPlugin.from_config()


def test_environment_variables_reach_the_config(monkeypatch):
    monkeypatch.setenv("DASK_CUPY_POOLMEM__POOL_SIZE", "0.25")
    monkeypatch.setenv("DASK_CUPY_POOLMEM__MAXIMUM_POOL_SIZE", "40GB")
    monkeypatch.setenv("DASK_CUPY_POOLMEM__PINNED", "False")
    cfg = dask.config.collect_env()
    with dask.config.set(cfg):
        plugin = PoolmemPlugin.from_config()
    assert plugin.pool_size == 0.25 and plugin.maximum_pool_size == "40GB"
    assert plugin.pinned is False
    assert plugin.resolve(80 * GB)["pool_size"] == 20 * GB


# -- on a worker without a GPU -------------------------------------------------------------
@pytest.mark.skipif(not NO_GPU, reason="checks the error raised on a machine without a GPU")
@pytest.mark.parametrize("processes", [False, True])
def test_worker_without_gpu_raises_no_gpu_error_in_client(processes):
    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, processes=processes, dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        with pytest.raises(cpm.NoGPUError) as ei:
            client.register_plugin(PoolmemPlugin(pool_size="1GB"))
        msg = str(ei.value)
        assert "PoolmemPlugin on worker tcp://" in msg or "PoolmemPlugin on worker inproc://" in msg
        assert "CUDA_VISIBLE_DEVICES" in msg
        # The failed setup changed nothing on the worker: CuPy keeps its own allocator.
        assert client.run(_cupy_allocator_is_default) == {
            w: True for w in client.scheduler_info()["workers"]
        }
        with pytest.raises(cpm.PoolClosedError, match="no cupy_poolmem device pool"):
            gather_stats(client)


def _cupy_allocator_is_default() -> bool:
    from cupy_poolmem import _runtime

    return _runtime.installed_allocator("device") is None


@pytest.mark.skipif(not NO_GPU, reason="checks the error raised on a machine without a GPU")
def test_bad_plugin_value_never_reaches_a_worker():
    with pytest.raises(cpm.InvalidOptionError):
        PoolmemPlugin(maximum_pool_size="12 parsecs")


@pytest.mark.skipif(not NO_GPU, reason="checks the error raised on a machine without a GPU")
def test_preload_hook_logs_no_gpu_and_worker_stays_up(caplog):
    with (
        LocalCluster(
            n_workers=1,
            threads_per_worker=1,
            processes=False,
            dashboard_address=None,
            preload=["cupy_poolmem.dask"],
        ) as cluster,
        Client(cluster) as client,
    ):
        # The worker runs (a failed preload is logged, not fatal) but has no pool.
        assert client.submit(lambda: 1 + 1).result(timeout=30) == 2
        with pytest.raises(cpm.PoolClosedError):
            gather_stats(client)
    assert any(
        "NoGPUError" in r.getMessage()
        or "NoGPUError" in (r.exc_text or "")
        or (r.exc_info and r.exc_info[0] is cpm.NoGPUError)
        for r in caplog.records
    )


def test_preload_hook_leaves_non_workers_alone():
    import asyncio

    asyncio.run(dask_setup(object()))  # a nanny or scheduler: nothing happens


def test_gather_stats_rejects_unknown_kind():
    with pytest.raises(cpm.InvalidOptionError, match="kind"):
        gather_stats(None, kind="managed")


# -- large_blocks: the shared expandable or mapped pool on the workers ------------------------
def test_large_blocks_is_checked_at_construction_and_kept():
    for mode in ("pool", "mapped", "expandable"):
        plugin = PoolmemPlugin(large_blocks=mode)
        assert plugin.large_blocks == mode and f"large_blocks={mode!r}" in repr(plugin)
        assert pickle.loads(pickle.dumps(plugin)).large_blocks == mode
    assert PoolmemPlugin().large_blocks == "pool"  # set_allocator's default
    assert PoolmemPlugin(large_blocks="mapped", release_threshold="1GB").large_blocks == "mapped"
    with pytest.raises(cpm.InvalidOptionError, match="large_blocks='vmm' is not one of"):
        PoolmemPlugin(large_blocks="vmm")
    with pytest.raises(cpm.OptionTypeError, match="large_blocks must be"):
        PoolmemPlugin(large_blocks=None)


@pytest.mark.parametrize(
    ("mode", "kw"),
    [
        ("expandable", {"pool_size": "1GB"}),
        ("expandable", {"maximum_pool_size": 0.5}),
        ("expandable", {"release_threshold": 0}),
        ("mapped", {"pool_size": "1GB"}),
        ("mapped", {"maximum_pool_size": "40GB"}),
    ],
)
def test_large_blocks_refuses_the_sizes_its_pool_has_no_use_for(mode, kw):
    ((name, value),) = kw.items()
    with pytest.raises(
        cpm.InvalidOptionError, match=rf"{name}={value!r} cannot be used with large_blocks='{mode}'"
    ) as ei:
        PoolmemPlugin(large_blocks=mode, **kw)
    assert "large_blocks='pool'" in str(ei.value)  # the way out


def test_the_large_blocks_config_key_configures_the_plugin(monkeypatch):
    assert dask.config.get("cupy-poolmem.large-blocks") == "pool"
    monkeypatch.setenv("DASK_CUPY_POOLMEM__LARGE_BLOCKS", "expandable")
    with dask.config.set(dask.config.collect_env()):
        assert PoolmemPlugin.from_config().large_blocks == "expandable"
    with (
        dask.config.set({"cupy-poolmem.large-blocks": "vmm"}),
        pytest.raises(cpm.InvalidOptionError, match="large_blocks='vmm'"),
    ):
        PoolmemPlugin.from_config()
