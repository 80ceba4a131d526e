"""GPU tests of zero-copy sharing: data checked in the other process, lifetimes, ordering."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest

import cupy_poolmem as cpm

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("ipc_allocator")]

cupy = pytest.importorskip("cupy")

from support import mp_workers as W  # noqa: E402
from support.waits import ipc_allocator  # noqa: E402, F401 - the module fixture
from support.waits import join as _join  # noqa: E402
from support.waits import wait_for as _wait_for  # noqa: E402

TIMEOUT = 120


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_queue_zero_copy_both_directions(method):
    ctx = mp.get_context(method)
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=W.echo_check, args=(q_in, q_out))
    p.start()
    try:
        x = cupy.arange(1 << 20, dtype=cupy.float32)
        view = x[3::2]  # offset and stride
        q_in.put(("check", view))
        tag, ok, ptr, res = q_out.get(timeout=TIMEOUT)
        assert tag == "checked" and ok
        cupy.cuda.get_current_stream().synchronize()
        # the consumer's writes are visible here: same memory
        assert bool((x[3::2] == -cupy.arange(3, 3 + 2 * view.size, 2, dtype=cupy.float32)).all())
        assert bool((x[::2] == cupy.arange(0, 1 << 20, 2, dtype=cupy.float32)).all())
        # a result allocated by the worker arrives here zero-copy too
        assert isinstance(res, cupy.ndarray)
        assert bool((res == cupy.arange(view.size, dtype=cupy.float32) + 0.5).all())
    finally:
        q_in.put(None)
        _join(p)


def test_pipe_every_dtype_and_shape():
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=W.pipe_worker, args=(b,))
    p.start()
    try:
        cases = {}
        for dt in [
            "b1",
            "i1",
            "u1",
            "i2",
            "u2",
            "i4",
            "u4",
            "i8",
            "u8",
            "f2",
            "f4",
            "f8",
            "c8",
            "c16",
        ]:
            base = (np.arange(60) % 7).astype(dt)
            cases[f"dtype-{dt}"] = cupy.asarray(base).reshape(3, 4, 5)
        m = cupy.arange(1000, dtype=cupy.int64).reshape(20, 50)
        cases["transposed"] = m.T
        cases["strided"] = m[1::3, ::-2]
        cases["0-d"] = cupy.asarray(np.float64(3.25))
        cases["size-0"] = cupy.empty((0, 3), dtype=cupy.float32)
        cases["fortran"] = cupy.asfortranarray(m)
        for name, arr in cases.items():
            a.send((name, arr))
            r = a.recv()
            assert r[0] == name, r
            _, kind, shape, strides, dtype, host = r
            assert kind == "ndarray" and shape == arr.shape and dtype == str(arr.dtype)
            np.testing.assert_array_equal(host, cupy.asnumpy(arr), err_msg=name)
            if arr.size:
                assert strides == arr.strides, name
    finally:
        a.send(None)
        _join(p)


def test_blocks_of_both_cuda_pools_of_an_ipc_pool_are_shared_with_their_data():
    """set_allocator()'s pools have a small-block pool: blocks on either side of its
    limit come from different CUDA pools, and each arrives with its data in another
    process (which imports each CUDA pool from its own descriptor)."""
    from cuda.bindings import driver

    pool = cpm.get_pool()
    limit = pool.small_pool
    assert limit == 8 << 20 and pool.ipc and len(pool._ipc_pools) == 2

    def owner(arr):
        attr = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE
        err, h = driver.cuPointerGetAttribute(attr, arr.data.ptr)
        assert int(err) == 0
        return int(h)

    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=W.pipe_worker, args=(b,))
    p.start()
    try:
        sizes = {"tiny": 512, "at-limit": limit, "above": limit + 4096, "large": 96 << 20}
        seen = set()
        for k, (name, n) in enumerate(sizes.items()):
            arr = (cupy.arange(n, dtype=cupy.uint8) + k).astype(cupy.uint8)
            assert arr.nbytes == n
            seen.add(owner(arr))
            a.send((name, arr))
            r = a.recv()
            assert r[0] == name, r
            np.testing.assert_array_equal(r[-1], cupy.asnumpy(arr), err_msg=name)
        assert seen == {h for h, _, _ in pool._ipc_pools}  # both CUDA pools were shared
    finally:
        a.send(None)
        _join(p)


def test_pool_map_arguments_and_results():
    ctx = mp.get_context("spawn")
    arrays = [cupy.full(1000, i, dtype=cupy.float32) for i in range(6)]
    with ctx.Pool(2) as pool:
        out = pool.map(W.pool_square, arrays)
        for i, (s, sq) in enumerate(out):  # checked while the workers (exporters) live
            assert s == 1000.0 * i
            assert isinstance(sq, cupy.ndarray) and bool((sq == i * i).all())
        del out, sq


def test_process_pool_executor():
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as ex:
        x = cupy.arange(5000, dtype=cupy.float64)
        s, sq = ex.submit(W.pool_square, x).result(timeout=TIMEOUT)
        assert s == float(np.arange(5000).sum())
        assert bool((sq == x * x).all())
        del sq


def test_early_drop_under_allocation_pressure_1000_in_flight():
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    n = 1000
    p = ctx.Process(target=W.pressure_consumer, args=(q_in, q_out, n))
    p.start()
    try:
        for i in range(n):
            a = cupy.full(16384, i, dtype=cupy.int32)  # 64 KiB
            q_in.put((i, a))
            del a  # dropped at once: the memory must not be reused while in flight
            junk = cupy.full(16384, -7, dtype=cupy.int32)  # same size, same stream
            del junk
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # keep allocating and writing patterns
            g = [cupy.full(16384, -9, dtype=cupy.int32) for _ in range(50)]
            del g
        tag, bad = q_out.get(timeout=300)
        assert tag == "done" and bad == [], bad[:10]
    finally:
        _join(p)
    assert _wait_for(lambda: cpm.sharing.stats()["limbo_bytes"] == 0)


def test_consumer_sigkill_reclaims_memory():
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    pool = cpm.get_pool()
    base_held = pool.stats().held_for_sharing_bytes
    p = ctx.Process(target=W.hold_and_wait, args=(q_in, q_out))
    p.start()
    try:
        for i in range(5):
            a = cupy.full(4 << 20, i, dtype=cupy.int32)
            q_in.put(a)
            assert q_out.get(timeout=TIMEOUT)[0] == "got"
            del a
        q_in.put(None)
        held = pool.stats().held_for_sharing_bytes
        assert held - base_held == 5 * (16 << 20)  # kept alive for the consumer
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        assert _wait_for(lambda: pool.stats().held_for_sharing_bytes == base_held, 10.0)
        assert cpm.sharing.stats()["limbo_bytes"] == 0
    finally:
        if p.is_alive():
            p.kill()


def test_consumer_sees_writes_enqueued_before_put_without_sync():
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=W.ordered_reader, args=(q_in, q_out))
    p.start()
    time.sleep(3)  # let the child start CUDA first
    try:
        from support.waits import spin

        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            x = cupy.zeros(1 << 22, dtype=cupy.int32)
            spin(500, s)  # long-running kernel, then the write
            x.fill(7)
            q_in.put(x)  # no synchronisation
        assert q_out.get(timeout=TIMEOUT) is True
    finally:
        _join(p)


def test_round_trip_resolves_to_own_memory():
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=W.echo_check, args=(q_in, q_out))
    p.start()
    try:
        x = cupy.arange(100000, dtype=cupy.float64)
        q_in.put(("back", x[10:]))
        tag, y = q_out.get(timeout=TIMEOUT)
        assert tag == "back"
        assert y.data.ptr == x[10:].data.ptr
        assert bool((y == x[10:]).all())
        del x  # the round-tripped view keeps the memory valid
        assert float(y[0]) == 10.0
    finally:
        q_in.put(None)
        _join(p)


def test_forward_to_a_third_process():
    ctx = mp.get_context("spawn")
    q1, q2, q_out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    mid = ctx.Process(target=W.forwarder, args=(q1, q2, q_out))
    last = ctx.Process(target=W.last_reader, args=(q2, q_out))
    mid.start()
    last.start()
    try:
        x = cupy.full(1 << 20, 5, dtype=cupy.int16)
        q1.put(x)
        got = {}
        for _ in range(2):
            tag, val = q_out.get(timeout=TIMEOUT)
            assert tag != "error", val
            got[tag] = val
        assert got == {"mid": True, "last": True}
        cupy.cuda.get_current_stream().synchronize()
        assert bool((x == 6).all())  # the third process wrote into the producer's memory
        q1.put("bye")
        assert q_out.get(timeout=TIMEOUT) == ("mid-done", "bye")
    finally:
        _join(mid, last)


def test_same_allocation_twice_is_deduplicated():
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=W.echo_check, args=(q_in, q_out))
    p.start()
    try:
        x = cupy.arange(3, 3 + 2 * 1000, 2, dtype=cupy.float32)
        q_in.put(("check", x))
        q_in.put(("check", x))
        r1 = q_out.get(timeout=TIMEOUT)
        r2 = q_out.get(timeout=TIMEOUT)
        assert r1[1] and r2[1] is False  # second check sees the first one's negation
        assert r1[2] == r2[2]  # one mapping, same pointer in the consumer
    finally:
        q_in.put(None)
        _join(p)


def test_fallback_device_copy_host_and_error():
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=W.pipe_worker, args=(b,))
    p.start()
    mp_pool = cupy.cuda.MemoryPool()
    try:
        with cupy.cuda.using_allocator(mp_pool.malloc):
            x = cupy.arange(1000, dtype=cupy.int32)
        for mode in ("device-copy", "host"):
            cpm.sharing.fallback = mode
            a.send((mode, x))
            r = a.recv()
            np.testing.assert_array_equal(r[-1], np.arange(1000, dtype=np.int32))
        cpm.sharing.fallback = "error"
        with pytest.raises(cpm.SharingError, match="set_allocator"):
            a.send(("error", x))
        with pytest.raises(cpm.InvalidOptionError):
            cpm.sharing.fallback = "teleport"
    finally:
        cpm.sharing.fallback = "device-copy"
        a.send(None)
        _join(p)


def test_plain_pickle_keeps_cupy_behaviour():
    x = cupy.arange(10, dtype=cupy.float32)
    y = pickle.loads(pickle.dumps(x))
    assert isinstance(y, cupy.ndarray) and y.data.ptr != x.data.ptr
    assert bool((y == x).all())


def test_receiver_without_gpu_gets_clear_error():
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        p = ctx.Process(target=W.no_gpu_receiver, args=(b,))
        p.start()
    finally:
        if old is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old
    try:
        x = cupy.arange(10)
        a.send(x)
        name, text = a.recv()
        assert name == "NoGPUError" and "no GPU" in text
        rec = x.data.mem._owner.share
        assert _wait_for(lambda: not rec.tickets)  # the failed receiver gave its ticket back
    finally:
        _join(p)


def test_fork_after_cuda_init_raises_clear_error():
    ctx = mp.get_context("fork")
    a, b = ctx.Pipe()
    pool = cpm.get_pool()
    p = ctx.Process(target=W.fork_child, args=(pool, b))
    p.start()
    try:
        name, text = a.recv()
        assert name == "PoolClosedError" and "forked" in text and "spawn" in text
    finally:
        _join(p)


def test_producer_exits_first():
    """What a receiver sees when the exporter exits while it still holds an array."""
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=W.exiting_producer, args=(q, done))
    p.start()
    x = q.get(timeout=TIMEOUT)
    assert int(x[:100].sum()) == 900
    done.set()
    p.join(TIMEOUT)
    assert p.exitcode == 0
    try:
        host = cupy.asnumpy(x)
        outcome = "valid" if (host == 9).all() else "garbage"
    except Exception as exc:
        outcome = f"error: {type(exc).__name__}"
    print(f"\nproducer-exits-first outcome: {outcome}")
    assert outcome == "valid", outcome
    del x


def test_pinned_numpy_zero_copy():
    import cupyx

    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=W.pinned_numpy_worker, args=(b,))
    p.start()
    try:
        with cpm.PinnedPool(ipc=True) as pool, cpm.using(pool):
            h = cupyx.empty_pinned((4096,), dtype=np.int32)
            h[:] = np.arange(4096, dtype=np.int32)
            a.send(h)
            ok, kind = a.recv()
            assert ok and kind == "ndarray"
            assert (h == -1).all()  # the receiver wrote into the same host memory
            a.send("bye")
        plain = np.arange(10)
        assert pickle.loads(pickle.dumps(plain)).tolist() == list(range(10))
    finally:
        _join(p)


@pytest.mark.multigpu
def test_different_visible_device_order_matches_by_uuid():
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    # This process's GPUs 1 and 0, in that order, whichever GPUs it sees.
    seen = old.split(",") if old else ["0", "1"]
    os.environ["CUDA_VISIBLE_DEVICES"] = f"{seen[1]},{seen[0]}"
    try:
        p = ctx.Process(target=W.visible_devices_reader, args=(q_in, q_out))
        p.start()
    finally:
        if old is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old
    try:
        with cupy.cuda.Device(1):
            x = cupy.full(1000, 3, dtype=cupy.int8)
            q_in.put(x)
        dev, ok, n = q_out.get(timeout=TIMEOUT)
        assert ok and n == 2 and dev == 0  # physical GPU 1 is ordinal 0 over there
    finally:
        _join(p)


def _reply(q_out):
    tag, val, stats = q_out.get(timeout=TIMEOUT)
    assert tag != "error", val
    return tag, val, stats


@contextlib.contextmanager
def _resend_reader(keep=None):
    """A spawned ``W.resend_reader``: yields (process, q_in, q_out), stops it at the end."""
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=W.resend_reader, args=(q_in, q_out, keep))
    p.start()
    try:
        yield p, q_in, q_out
    finally:
        if p.is_alive():
            q_in.put(None)
        _join(p)


@contextlib.contextmanager
def _producer_pool(recycle):
    """The pool this test's arrays come from: the allocator's (``recycle``: its reuse
    cache takes exported blocks back with their records) or one without a reuse cache
    (an exported block is freed when every holder let go, as before recycling)."""
    if recycle:
        yield cpm.get_pool()
        return
    pool = cpm.DevicePool(ipc=True, reuse_cache=0)
    try:
        with cpm.using(pool):
            yield pool
    finally:
        pool.close()


@pytest.mark.parametrize("recycle", [False, True])
def test_resent_block_stays_mapped_then_exporter_takes_it_back(recycle):
    """A block received twice stays mapped after its arrays go (a recycled one from the
    first message on); freeing it evicts it, recycling keeps it mapped until a trim."""
    with _producer_pool(recycle) as pool, _resend_reader() as (p, q_in, q_out):
        base_held = pool.stats().held_for_sharing_bytes
        recycled = cpm.sharing.stats()["recycled_blocks"]
        x = cupy.empty(1 << 20, dtype=cupy.int32)
        ptrs = []
        for i in range(1, 6):
            x.fill(i)  # new data in the same block, no synchronisation before put
            q_in.put(("drop", i, x))
            _, (j, ok, ptr), stats = _reply(q_out)
            assert (j, ok) == (i, True)
            assert int(x[0]) == -i  # the receiver's write, through its mapping
            ptrs.append(ptr)
            # first receipt: unmapped when dropped (kept if the block recycles); from
            # the second on: kept idle
            assert stats["idle_mappings"] == (0 if i == 1 and not recycle else 1), (i, stats)
        assert len(set(ptrs[1:])) == 1  # one mapping reused for every re-send
        assert _wait_for(lambda: cpm.sharing.stats()["leases"] == 1)
        # The exporter lets go: the idle mapping is asked back and the block freed, or
        # (recycle) the receiver says Idle and the block goes back to the reuse cache.
        del x
        assert _wait_for(lambda: pool.stats().held_for_sharing_bytes == base_held, 10.0)
        if recycle:
            assert _wait_for(lambda: cpm.sharing.stats()["recycled_blocks"] > recycled)
            assert _wait_for(lambda: cpm.sharing.stats()["leases"] == 1)  # mapped, idle
            pool.trim()  # its final free: asked back first
            assert _wait_for(lambda: cpm.sharing.stats()["leases"] == 0, 10.0)
        assert cpm.sharing.stats()["leases"] == 0
        q_in.put(("check", 0, None))
        _, bad, stats = _reply(q_out)
        assert stats["idle_mappings"] == 0 and stats["imported_blocks"] == 0


@pytest.mark.parametrize("recycle", [False, True])
def test_eviction_waits_for_arrays_in_use_under_pressure(recycle):
    """Asked back (or to say Idle) while the receiver still uses it, a block stays intact
    until let go: never reused, never freed."""
    with _producer_pool(recycle) as pool, _resend_reader() as (p, q_in, q_out):
        base_held = pool.stats().held_for_sharing_bytes
        xs = [cupy.full(1 << 18, i, dtype=cupy.int32) for i in range(1, 4)]
        for i, x in enumerate(xs, 1):  # each sent twice: kept mapped, then held
            q_in.put(("drop", i, x))
            _reply(q_out)
            q_in.put(("hold", i, x))
            _reply(q_out)
        del x, xs  # freed here; receivers still use them: limbo, eviction pending
        assert pool.stats().held_for_sharing_bytes - base_held == 3 * (1 << 20)
        for _ in range(200):  # same sizes, patterns written: nothing may land on them
            g = [cupy.full(1 << 18, -9, dtype=cupy.int32) for _ in range(8)]
            del g
        q_in.put(("check", 0, None))
        _, bad, stats = _reply(q_out)
        assert bad == [] and stats["imported_blocks"] == 3
        q_in.put(("release", 0, None))
        _reply(q_out)
        assert _wait_for(lambda: pool.stats().held_for_sharing_bytes == base_held, 10.0)
        if recycle:  # back in the reuse cache, still mapped (idle) until a trim
            assert _wait_for(lambda: cpm.sharing.stats()["leases"] == 3)
            pool.trim()
            assert _wait_for(lambda: cpm.sharing.stats()["leases"] == 0, 10.0)
        assert cpm.sharing.stats()["leases"] == 0
        q_in.put(("check", 0, None))
        _, _, stats = _reply(q_out)
        assert stats["idle_mappings"] == 0 and stats["imported_blocks"] == 0


def test_keep_mappings_bounds_the_cache_and_zero_disables_it():
    for keep, want in ((2, 2), (0, 0)):
        with _resend_reader(keep) as (_, q_in, q_out):
            xs = [cupy.full(4096, i, dtype=cupy.int32) for i in range(1, 5)]
            for _round in range(2):
                for i, x in enumerate(xs, 1):
                    q_in.put(("drop", i, x))
                    _, (_, ok, _), stats = _reply(q_out)
                    assert ok
            assert stats["idle_mappings"] == want, (keep, stats)
            # leases held in this exporter match the receiver's cache
            assert _wait_for(lambda n=want: cpm.sharing.stats()["leases"] == n), keep
        assert _wait_for(lambda: cpm.sharing.stats()["leases"] == 0)  # receiver exited
    with pytest.raises(cpm.InvalidOptionError, match="keep_mappings=-1"):
        cpm.sharing.keep_mappings = -1


def test_sigkill_gives_back_idle_mappings():
    pool = cpm.get_pool()
    base_held = pool.stats().held_for_sharing_bytes
    with _resend_reader() as (p, q_in, q_out):
        x = cupy.full(1 << 20, 3, dtype=cupy.int32)
        for _ in range(2):
            q_in.put(("drop", 3, x))
            _reply(q_out)
        assert _wait_for(lambda: cpm.sharing.stats()["leases"] == 1)
        # The second message is a hit the receiver acknowledges a few ms later (no
        # lease changes): killed before that, its ticket would pin the block until
        # inflight_timeout (test_message_never_read_lets_go_after_inflight_timeout).
        assert _wait_for(lambda: cpm.sharing.stats()["tickets_out"] == 0)
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        assert _wait_for(lambda: cpm.sharing.stats()["leases"] == 0, 10.0)
        del x
        assert pool.stats().held_for_sharing_bytes == base_held  # freed at once


def test_message_after_exporter_exit_raises_sharing_error():
    """Deterministic: a message unpickled after its exporter exited raises, mapped or not."""
    from cupy_poolmem._sharing import context

    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=W.exiting_producer_twice, args=(q, done))
    p.start()
    x = q.get(timeout=TIMEOUT)
    assert int(x[:10].sum()) == 40
    client = x.data.mem._owner.m.client
    done.set()
    p.join(TIMEOUT)
    assert _wait_for(lambda: client.closed, 10.0)
    with pytest.raises(cpm.SharingError, match="exited"):
        q.get(timeout=TIMEOUT)  # the same block, still mapped here
    assert int(x[:10].sum()) == 40  # what was received stays valid
    del x
    assert not any(m.client is client for m in context().importer.maps.values())
    assert _wait_for(lambda: client.address not in context().importer.clients)


@pytest.mark.parametrize("keep", [0, None])
def test_block_reused_after_unmap_waits_for_the_receivers_last_work(keep):
    """A receiver lets go while its kernel still reads: it unmaps (``keep=0``), or keeps
    the mapping and says Idle when the exporter asks (a recycled block); either way the
    exporter's reuse of the block must wait for that kernel."""
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=W.slow_reader, args=(q_in, q_out, keep))
    p.start()
    try:
        assert q_out.get(timeout=TIMEOUT) == "ready"
        n = 1 << 20
        x = cupy.ones(n, dtype=cupy.float32)
        q_in.put(x)
        assert q_out.get(timeout=TIMEOUT) == "dropped"  # its sum is still queued
        rec = x.data.mem._owner.share
        if keep == 0:
            assert _wait_for(lambda: not rec.tickets and not rec.leases and rec.events)
        else:
            assert _wait_for(lambda: not rec.tickets and rec.leases)  # mapped, idle
        recycled = cpm.sharing.stats()["recycled_blocks"]
        ptr = x.data.ptr
        del x  # back to this pool's reuse cache (at once, or once the receiver said Idle)
        assert _wait_for(lambda: cpm.sharing.stats()["recycled_blocks"] > recycled)
        z = cupy.empty(n, dtype=cupy.float32)
        assert z.data.ptr == ptr  # the same block, same stream
        z.fill(7)  # must run after the receiver's sum
        assert q_out.get(timeout=TIMEOUT) == float(n)
        del z
    finally:
        _join(p)


# -- recycled blocks (P12): fresh arrays through the reuse cache ------------------------
@pytest.mark.parametrize("nbytes,n", [(1 << 20, 40), (256 << 20, 12)])
def test_fresh_arrays_recycle_through_the_cache_with_their_data_checked(nbytes, n):
    """A fresh array per message, a different pattern each: the receiver checks every
    value and writes -i at [0]; after the first lives the blocks come back from the
    reuse cache as hits on mappings the receiver keeps (a few blocks, a few mappings)."""
    before = cpm.sharing.stats()["recycled_blocks"]
    ptrs = []
    with _resend_reader() as (p, q_in, q_out):
        for i in range(1, n + 1):
            x = cupy.full(nbytes // 4, i, dtype=cupy.float32)
            q_in.put(("drop", i, x))
            _, (j, ok, ptr), stats = _reply(q_out)
            assert (j, ok) == (i, True), f"message {i}: the receiver saw other data"
            assert float(x[0]) == -i  # the receiver's write, in the same memory
            ptrs.append(ptr)
            del x  # the producer lets go: recycled once the receiver said Idle
        assert stats["imported_pools"] == 1
        assert stats["idle_mappings"] <= 4, stats
    assert cpm.sharing.stats()["recycled_blocks"] - before >= n // 2
    assert len(set(ptrs[n // 2 :])) <= 4, ptrs  # the receiver's mappings, reused


def test_a_held_array_never_shows_a_later_lifes_data():
    """The receiver holds the first fresh array while later fresh arrays of the same size
    are sent and recycled: its block is never handed out meanwhile (the held array keeps
    its own values); once let go, the block serves later messages with their data."""
    nbytes = 1 << 20
    with _resend_reader() as (p, q_in, q_out):
        x = cupy.full(nbytes // 4, 1, dtype=cupy.float32)
        q_in.put(("hold", 1, x))
        _, (_, ok, held_ptr), _ = _reply(q_out)
        assert ok
        del x
        seen = []
        for i in range(2, 30):
            y = cupy.full(nbytes // 4, i, dtype=cupy.float32)
            q_in.put(("drop", i, y))
            _, (j, ok, ptr), _ = _reply(q_out)
            assert (j, ok) == (i, True)
            seen.append(ptr)
            del y
        assert held_ptr not in seen  # never handed out while the receiver holds it
        q_in.put(("check", 0, None))
        tag, bad, _ = _reply(q_out)
        assert tag == "checked" and bad == []  # the held array still reads its own data
        recycled = cpm.sharing.stats()["recycled_blocks"]
        q_in.put(("release", 0, None))
        assert _reply(q_out)[0] == "released"
        assert _wait_for(lambda: cpm.sharing.stats()["recycled_blocks"] > recycled)
        for i in range(30, 60):
            y = cupy.full(nbytes // 4, i, dtype=cupy.float32)
            q_in.put(("drop", i, y))
            _, (j, ok, _), _ = _reply(q_out)
            assert (j, ok) == (i, True), i
            del y


def test_trim_unmaps_receivers_of_recycled_blocks_before_freeing_them():
    """trim() gives recycled blocks their final free: receivers are asked to unmap their
    idle mappings first; later fresh arrays are claimed and mapped anew, data checked."""
    pool = cpm.get_pool()
    with _resend_reader() as (p, q_in, q_out):
        for i in range(1, 7):
            x = cupy.full(1 << 18, i, dtype=cupy.int32)
            q_in.put(("drop", i, x))
            _, (_, ok, _), _ = _reply(q_out)
            assert ok
            del x
        assert _wait_for(lambda: cpm.sharing.stats()["limbo_bytes"] == 0)
        assert cpm.sharing.stats()["leases"] >= 1  # idle mappings of recycled blocks
        pool.trim()
        assert _wait_for(lambda: cpm.sharing.stats()["leases"] == 0, 10.0)
        q_in.put(("check", 0, None))
        _, _, stats = _reply(q_out)
        assert stats["idle_mappings"] == 0 and stats["imported_blocks"] == 0
        for i in range(7, 10):
            x = cupy.full(1 << 18, i, dtype=cupy.int32)
            q_in.put(("drop", i, x))
            _, (j, ok, _), _ = _reply(q_out)
            assert (j, ok) == (i, True)
            del x


def test_a_pool_dropped_with_recycled_blocks_is_retired_after_its_receivers_unmap():
    """A DevicePool dropped without close() while its reuse cache holds exported blocks a
    receiver maps (idle): the pool is still collected (a cached block does not keep it),
    the receiver is asked to unmap, and the retirer frees the blocks and destroys the
    CUDA pool after that; the receiver's later messages (another pool) are fine."""
    import gc

    from cupy_poolmem import _retire

    r = _retire.retirer()
    with _resend_reader() as (p, q_in, q_out):
        pool = cpm.DevicePool(ipc=True)
        token, mr = pool._retire_token, pool._mr
        with cpm.using(pool):
            for i in range(1, 6):
                x = cupy.full(1 << 18, i, dtype=cupy.int32)
                q_in.put(("drop", i, x))
                _, (_, ok, _), _ = _reply(q_out)
                assert ok
                del x
        assert _wait_for(lambda pool=pool: pool.stats().held_for_sharing_bytes == 0)
        assert pool.stats().cached_bytes >= 1 << 20  # recycled, the receiver maps them
        q_in.put(("check", 0, None))
        assert _reply(q_out)[2]["idle_mappings"] >= 1
        assert token in r._held
        del pool
        gc.collect()

        def retired():
            with r._lock:
                return token not in r._held and all(e.resource is not mr for e in r._due)

        assert _wait_for(retired, 10.0)
        q_in.put(("check", 0, None))
        _, _, stats = _reply(q_out)
        assert stats["idle_mappings"] == 0 and stats["imported_blocks"] == 0
        x = cupy.full(1 << 18, 42, dtype=cupy.int32)  # the allocator's pool
        q_in.put(("drop", 42, x))
        _, (j, ok, _), _ = _reply(q_out)
        assert (j, ok) == (42, True)
        del x
