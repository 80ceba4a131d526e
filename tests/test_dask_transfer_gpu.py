"""GPU tests of same-host Dask transfers through pool IPC: data checked on the receiver.

* same GPU (two workers of a ``LocalCluster`` on one GPU): the received chunk is a
  zero-copy view of the sender's block; it survives the sender being restarted or
  killed; new transfers work afterwards;
* another GPU (``LocalCUDACluster``, two GPUs): one device copy into the receiver's
  pool; a received chunk spills to host and comes back;
* simulated other host (the receiver's boot id changed): Dask's own path.

Every check reads the transfer counters, so a test fails when the IPC path is not
taken (a test that passes without it would prove nothing).
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from support.gpus import visible

import cupy_poolmem as cpm

pytestmark = pytest.mark.gpu

if cpm.device_count() == 0:
    pytest.skip("needs a CUDA GPU: this machine has no GPU or driver", allow_module_level=True)

cupy = pytest.importorskip("cupy")
dask = pytest.importorskip("dask", reason="dask is not installed")
pytest.importorskip("distributed", reason="distributed is not installed")

from distributed import Client, LocalCluster, wait  # noqa: E402

from cupy_poolmem.dask import PoolmemPlugin, transfer_stats  # noqa: E402

MiB = 1 << 20
TIMEOUT = 120


def _needs_dask_cuda():
    try:
        import dask_cuda
    except ImportError:
        pytest.skip("needs dask-cuda (pip install dask-cuda)")
    return dask_cuda


def _needs_two_gpus():
    if cpm.device_count() < 2:
        pytest.skip(f"needs two CUDA GPUs; this machine has {cpm.device_count()}")


# -- tasks (run on the workers) ----------------------------------------------------------
def _make(nbytes: int, seed: int):
    import cupy

    n = nbytes // 8
    return cupy.arange(n, dtype="f8") % 1009 + seed


def _expected_sum(nbytes: int, seed: int) -> float:
    n = nbytes // 8
    return float((np.arange(n, dtype="f8") % 1009 + seed).sum())


def _keep(x):
    return x  # the received chunk, held in the receiver's data


def _inspect(x) -> dict:
    """What the receiving worker holds: data (sum), device, and whose memory it is."""
    import cupy

    from cupy_poolmem._sharing._mapping import Imported
    from cupy_poolmem._sharing._reducers import _owner

    owner = _owner(x.data.mem)
    return {
        "sum": float(x.sum()),
        "device": x.device.id,
        "pci": cupy.cuda.Device(x.device.id).pci_bus_id,
        "mapped": isinstance(owner, Imported),  # a view of another process's block
        "owner": type(owner).__name__,
    }


def _sharing_stats() -> dict:
    return cpm.sharing.stats()


def _set_boot(boot: str, dask_worker=None) -> None:
    from cupy_poolmem._dask_transfer import _process

    _process.state().identity["boot"] = boot  # the dict the handshake sends
    if dask_worker is not None:
        # Comms this worker opened before (idle in its pool) said the old boot in their
        # handshake: close them, so its next fetch opens a comm that says the new one.
        dask_worker.rpc.collect()


def _delta(after: dict, before: dict, key: str) -> int:
    return after[key] - before[key]


def _two_workers(client) -> tuple[str, str]:
    client.wait_for_workers(2, timeout=TIMEOUT)
    a, b = sorted(client.scheduler_info()["workers"])
    return a, b


def _move(client, a: str, b: str, nbytes: int, seed: int):
    """Make a chunk on ``a``, hold a copy of it on ``b``; the futures (chunk, held)."""
    x = client.submit(_make, nbytes, seed, workers=[a], pure=False)
    wait(x, timeout=TIMEOUT)
    y = client.submit(_keep, x, workers=[b], pure=False)
    wait(y, timeout=TIMEOUT)
    assert y.status == "finished", f"the transfer task failed: {y.exception()!r}"
    return x, y


def _inspect_on(client, fut, worker: str) -> dict:
    return client.submit(_inspect, fut, workers=[worker], pure=False).result(timeout=TIMEOUT)


def _same_gpu_cluster(meet: bool = True):
    env = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
    # No meeting at install: a worker's first connection to a peer is a fetch.  Through
    # this process's config, which the nannies hand their workers after the environment
    # (this process's default, warm: true, would override an environment variable).
    with dask.config.set({"distributed.comm.cupy-poolmem.warm": meet}):
        return LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            protocol="tcp",
            dashboard_address=None,
            env=env,
        )


# -- same GPU ----------------------------------------------------------------------------
def test_same_gpu_chunk_arrives_as_a_zero_copy_view():
    with _same_gpu_cluster() as cluster, Client(cluster) as client:
        client.register_plugin(PoolmemPlugin())
        a, b = _two_workers(client)
        s0 = transfer_stats(client)
        assert s0[a]["installed"] and s0[b]["installed"], s0
        x, y = _move(client, a, b, 64 * MiB, seed=3)
        got = _inspect_on(client, y, b)
        assert got["sum"] == _expected_sum(64 * MiB, 3), got
        s1 = transfer_stats(client)
        assert _delta(s1[a], s0[a], "sent_ipc") == 1, f"not sent through IPC: {s1[a]}"
        assert _delta(s1[b], s0[b], "received_view") == 1, f"not a view on the receiver: {s1[b]}"
        assert got["mapped"], f"the receiver's chunk is not a mapping of the sender's: {got}"
        # The sender lets its chunk go; the receiver's view keeps the block (limbo).
        del x
        time.sleep(0.5)
        assert _inspect_on(client, y, b)["sum"] == _expected_sum(64 * MiB, 3)
        # Small chunks take Dask's own path (min-bytes, 1 MiB by default).
        _, z = _move(client, a, b, 64 * 1024, seed=4)
        assert _inspect_on(client, z, b)["sum"] == _expected_sum(64 * 1024, 4)
        s2 = transfer_stats(client)
        assert s2[a]["fallback"].get("small", 0) >= 1, s2[a]
        assert s2[a]["sent_ipc"] == s1[a]["sent_ipc"]


@pytest.mark.parametrize("how", ["restart", "kill"])
def test_sender_restarted_or_killed_while_the_receiver_holds_its_block(how):
    with _same_gpu_cluster() as cluster, Client(cluster) as client:
        client.register_plugin(PoolmemPlugin())
        a, b = _two_workers(client)
        x, y = _move(client, a, b, 32 * MiB, seed=5)
        first = _inspect_on(client, y, b)
        assert first["mapped"] and first["sum"] == _expected_sum(32 * MiB, 5), first
        assert transfer_stats(client, workers=[b])[b]["received_view"] == 1
        del x
        if how == "restart":
            client.restart_workers([a], timeout=TIMEOUT)
        else:
            (pid,) = client.run(os.getpid, workers=[a]).values()
            os.kill(pid, signal.SIGKILL)  # no exit handler: the nanny starts a new one
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:  # the scheduler sees the old one go, a new one come
            workers = set(client.scheduler_info()["workers"])
            if len(workers) == 2 and (how == "restart" or a not in workers):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"after the {how}, workers are {sorted(workers)} (was {a}, {b})")
        # The receiver's mapping outlives its exporter.
        again = _inspect_on(client, y, b)
        assert again["sum"] == _expected_sum(32 * MiB, 5), (how, again)
        # New transfers from the new sender work, through IPC again.
        client.wait_for_workers(2, timeout=TIMEOUT)
        a2 = next(w for w in client.scheduler_info()["workers"] if w != b)
        s0 = transfer_stats(client)
        _, y2 = _move(client, a2, b, 32 * MiB, seed=6)
        assert _inspect_on(client, y2, b)["sum"] == _expected_sum(32 * MiB, 6)
        s1 = transfer_stats(client)
        assert _delta(s1[a2], s0[a2], "sent_ipc") == 1, s1[a2]
        assert _delta(s1[b], s0[b], "received_view") == 1, s1[b]


def test_simulated_other_host_falls_back_to_dasks_serialization():
    # Without meetings: a meeting at install would connect b to a before _set_boot, and
    # the fetch could reuse that connection's handshake (the boot before the change).
    with _same_gpu_cluster(meet=False) as cluster, Client(cluster) as client:
        client.register_plugin(PoolmemPlugin())
        a, b = _two_workers(client)
        # Before b's first connection to a: its handshake then says "another boot".
        client.run(_set_boot, "00000000-0000-0000-0000-000000000000", workers=[b])
        s0 = transfer_stats(client)
        _, y = _move(client, a, b, 8 * MiB, seed=7)
        got = _inspect_on(client, y, b)
        assert got["sum"] == _expected_sum(8 * MiB, 7) and not got["mapped"], got
        s1 = transfer_stats(client)
        assert s1[a]["fallback"].get("other-host", 0) >= 1, s1[a]
        assert s1[a]["sent_ipc"] == s0[a]["sent_ipc"]
        assert s1[b]["received_view"] == s1[b]["received_copy"] == 0, s1[b]


def test_client_gather_takes_dasks_path():
    with _same_gpu_cluster() as cluster, Client(cluster) as client:
        client.register_plugin(PoolmemPlugin())
        a, _ = _two_workers(client)
        x = client.submit(_make, 4 * MiB, 9, workers=[a], pure=False)
        arr = x.result(timeout=TIMEOUT)
        assert float(arr.sum()) == _expected_sum(4 * MiB, 9)
        assert transfer_stats(client)[a]["fallback"].get("peer-without-plugin", 0) >= 1


# -- another GPU (dask-cuda) --------------------------------------------------------------
def _cuda_cluster(**kw):
    dask_cuda = _needs_dask_cuda()
    _needs_two_gpus()
    return dask_cuda.LocalCUDACluster(
        CUDA_VISIBLE_DEVICES=",".join(visible(2)),  # this process's first two GPUs
        n_workers=2,
        threads_per_worker=1,
        protocol="tcp",
        dashboard_address=None,
        **kw,
    )


@pytest.mark.multigpu
def test_other_gpu_chunk_is_copied_once_into_the_receivers_pool():
    with _cuda_cluster() as cluster, Client(cluster) as client:
        client.register_plugin(PoolmemPlugin())
        a, b = _two_workers(client)
        for nbytes, seed in ((1 * MiB, 11), (64 * MiB, 12), (256 * MiB, 13)):
            s0 = transfer_stats(client)
            x, y = _move(client, a, b, nbytes, seed)
            here = _inspect_on(client, x, a)
            there = _inspect_on(client, y, b)
            assert there["sum"] == _expected_sum(nbytes, seed), (nbytes, there)
            assert here["pci"] != there["pci"], f"both workers on one GPU: {here} {there}"
            assert not there["mapped"] and there["owner"] == "Block", there  # its own pool
            s1 = transfer_stats(client)
            assert _delta(s1[a], s0[a], "sent_ipc") == 1, (nbytes, s1[a])
            assert _delta(s1[b], s0[b], "received_copy") == 1, (nbytes, s1[b])
        # The copy let the mapping go: the receiver maps nothing of the sender's now.
        (st,) = client.run(_sharing_stats, workers=[b]).values()
        assert st["imported_blocks"] == 0, st


@pytest.mark.multigpu
def test_received_chunk_spills_to_host_and_comes_back():
    with _cuda_cluster(device_memory_limit="96MiB") as cluster, Client(cluster) as client:
        client.register_plugin(PoolmemPlugin())
        a, b = _two_workers(client)
        _, y = _move(client, a, b, 64 * MiB, seed=21)
        assert transfer_stats(client, workers=[b])[b]["received_copy"] == 1
        # Two more chunks on b push the received one out of device memory (LRU).
        more = [client.submit(_make, 64 * MiB, s, workers=[b], pure=False) for s in (22, 23)]
        wait(more, timeout=TIMEOUT)
        st = transfer_stats(client, workers=[b])[b]
        assert st["fallback"].get("no-recipient", 0) >= 1, f"nothing spilled on {b}: {st}"
        back = _inspect_on(client, y, b)  # brought back to the device
        assert back["sum"] == _expected_sum(64 * MiB, 21), back
        for fut, s in zip(more, (22, 23)):
            assert _inspect_on(client, fut, b)["sum"] == _expected_sum(64 * MiB, s)


# -- a shared expandable or mapped pool on the workers ----------------------------------------
def _placement() -> tuple:
    return cpm.get_pool().large_blocks, cpm.get_pool().ipc


@pytest.mark.parametrize("mode", ["expandable", "mapped"])
def test_same_gpu_chunk_of_a_shared_placement_arrives_as_a_view(mode):
    """PoolmemPlugin(large_blocks=mode): the chunks are step blocks (64 MiB, above the
    mapped pool's 8 MiB); each arrives as a view of the sender's steps, a fresh one
    timed as a claim (no pool to import), and outlives the sender's reference."""
    with _same_gpu_cluster(meet=False) as cluster, Client(cluster) as client:
        client.register_plugin(PoolmemPlugin(large_blocks=mode, pinned=False))
        a, b = _two_workers(client)
        assert client.run(_placement) == {a: (mode, True), b: (mode, True)}
        s0 = transfer_stats(client)
        x1, y1 = _move(client, a, b, 64 * MiB, seed=5)  # the first contact
        x2, y2 = _move(client, a, b, 64 * MiB, seed=6)  # connected: one claim
        for y, seed in ((y1, 5), (y2, 6)):
            got = _inspect_on(client, y, b)
            assert got["sum"] == _expected_sum(64 * MiB, seed) and got["mapped"], got
        s1 = transfer_stats(client)
        assert _delta(s1[a], s0[a], "sent_ipc") == 2, f"not sent through IPC: {s1[a]}"
        assert _delta(s1[b], s0[b], "received_view") == 2, f"not views: {s1[b]}"
        timings = s1[b]["timings"]
        assert timings.get("receive.claim", {}).get("n", 0) >= 1, timings
        assert "receive.pool-import" not in timings, timings
        del x1, x2
        time.sleep(0.5)
        for y, seed in ((y1, 5), (y2, 6)):
            assert _inspect_on(client, y, b)["sum"] == _expected_sum(64 * MiB, seed)
