"""GPU tests of sharing lifecycles: each checks data in the other process (issue 11).

The CPU suite (tests/test_sharing_cpu.py) drives the same protocol code with a fake
driver; these tests confirm each lifecycle on a real GPU.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

import cupy_poolmem as cpm

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("ipc_allocator")]

cupy = pytest.importorskip("cupy")

from support import mp_lifecycle as L  # noqa: E402
from support.waits import (  # noqa: E402
    fd_kinds,
    grown,
    ipc_allocator,  # noqa: E402, F401 - the module fixture
)
from support.waits import join as _join  # noqa: E402
from support.waits import wait_for as _wait_for  # noqa: E402

TIMEOUT = 120
SPAWN = mp.get_context("spawn")


def _settled(leases=True):
    """Nothing in flight or in limbo; with ``leases``, no receiver maps anything either
    (``leases=False``: receivers that live on may keep idle mappings of recycled blocks)."""
    s = cpm.sharing.stats()
    return s["tickets_out"] == 0 and s["limbo_bytes"] == 0 and (not leases or s["leases"] == 0)


def _why():
    """What the exporter still holds, for an assertion message."""
    from cupy_poolmem._sharing import context

    exp = context().exporter
    with exp.lock:
        recs = [
            (r.export_id, len(r.tickets), len(r.claimed), dict(r.leases), r.local, r.in_limbo)
            for r in exp.records.values()
        ]
    return f"{dict(cpm.sharing.stats())} records={recs}"


@contextlib.contextmanager
def _setting(name, value):
    old = getattr(cpm.sharing, name)
    setattr(cpm.sharing, name, value)
    try:
        yield
    finally:
        setattr(cpm.sharing, name, old)


# -- producers that put and go ---------------------------------------------------------------
@pytest.mark.parametrize("how", ["return", "exit"])
def test_worker_that_puts_and_returns_delivers_its_array(how):
    q = SPAWN.Queue()
    p = SPAWN.Process(target=L.put_and_return, args=(q, 3.0, how))
    p.start()
    try:
        x = q.get(timeout=TIMEOUT)  # the producer is exiting meanwhile, waiting for this
        _join(p)
        assert p.exitcode == 0
        # the late fill (behind a 200 ms kernel) is seen, and stays valid after exit
        assert bool((x == 3.0).all()) and x.size == 1 << 20
        del x
    finally:
        _join(p)


def test_pool_maxtasksperchild_results_read_at_once_on_a_non_blocking_stream():
    arrays = [cupy.full(1 << 16, i, dtype=cupy.float32) for i in range(4)]
    with SPAWN.Pool(2, maxtasksperchild=1) as pool:
        out = pool.map(L.square_late, arrays)
        s = cupy.cuda.Stream(non_blocking=True)
        with s:  # read at once, on a stream the result handler thread never saw
            for i, (total, sq, _) in enumerate(out):
                assert total == float(i * (1 << 16))
                assert bool((sq == i * i).all())
        s.synchronize()
        del out, sq
    del arrays


def test_process_pool_executor_both_ways_with_per_thread_default_streams():
    old = os.environ.get("CUPY_CUDA_PER_THREAD_DEFAULT_STREAM")
    os.environ["CUPY_CUDA_PER_THREAD_DEFAULT_STREAM"] = "1"
    try:
        with ProcessPoolExecutor(max_workers=2, mp_context=SPAWN) as ex:
            xs = [cupy.arange(5000, dtype=cupy.float64) + i for i in range(4)]
            futs = [ex.submit(L.square_late, x) for x in xs]
            for x, f in zip(xs, futs, strict=True):
                total, sq, env = f.result(timeout=TIMEOUT)
                assert env == "1"  # the worker ran with per-thread default streams
                assert total == float(cupy.asnumpy(x).sum())
                assert bool((sq == x * x).all())
            del sq
    finally:
        if old is None:
            del os.environ["CUPY_CUDA_PER_THREAD_DEFAULT_STREAM"]
        else:
            os.environ["CUPY_CUDA_PER_THREAD_DEFAULT_STREAM"] = old


def test_forkserver_with_preload_draws_unique_tickets():
    q = SPAWN.Queue()  # a fresh process, so that its forkserver starts with the preload
    p = SPAWN.Process(target=L.forkserver_orchestrator, args=(q, 6))
    p.start()
    try:
        tag, ok, ok_after, n_tickets, codes = q.get(timeout=300)
        assert tag == "ok", ok
        assert ok and ok_after and n_tickets == 6 and codes == [0] * 6
    finally:
        _join(p, timeout=300)


# -- one message, many receivers; one array, many messages --------------------------------------
def test_one_pickled_message_delivered_to_several_receivers():
    x = cupy.full(1 << 18, 2, dtype=cupy.int32)
    data = bytes(ForkingPickler.dumps(x))  # one message, one ticket
    qs = [(SPAWN.Queue(), SPAWN.Queue()) for _ in range(3)]
    procs = [SPAWN.Process(target=L.load_and_hold, args=qq) for qq in qs]
    for p in procs:
        p.start()
    try:
        for q_in, q_out in qs:  # each copy is claimed while the block lives
            q_in.put(data)
            assert q_out.get(timeout=TIMEOUT) == ("got", 2 * (1 << 18))
        del x
        recycled = cpm.sharing.stats()["recycled_blocks"]
        for q_in, q_out in qs:
            q_in.put("drop")
            assert q_out.get(timeout=TIMEOUT)[0] == "dropped"
        # every receiver let go: back in the reuse cache (they keep idle mappings)
        assert _wait_for(lambda: _settled(leases=False)), _why()
        assert cpm.sharing.stats()["recycled_blocks"] > recycled
        y = cupy.full(1 << 18, 5, dtype=cupy.int32)  # the same block again, a new life
        q_in, q_out = qs[0]
        q_in.put(data)  # a late copy of the old message
        tag, text = q_out.get(timeout=TIMEOUT)
        assert tag == "SharingError" and "stale" in text, (tag, text)
        assert bool((y == 5).all())  # nothing wrote into the new array
    finally:
        for q_in, _ in qs:
            q_in.put(None)
        _join(*procs)


def test_one_array_put_many_times():
    q_in, q_out = SPAWN.Queue(), SPAWN.Queue()
    n = 200
    p = SPAWN.Process(target=L.count_receiver, args=(q_in, q_out, n))
    p.start()
    try:
        x = cupy.full(1 << 16, 7, dtype=cupy.int32)
        for _ in range(n):
            q_in.put((7, x))
        tag, bad, stats = q_out.get(timeout=TIMEOUT)
        assert tag == "done" and bad == [], bad
        assert stats["imported_blocks"] == 0 and stats["idle_mappings"] <= 1
    finally:
        _join(p)
    assert _wait_for(_settled), _why()


def test_64_receivers_of_one_exporter():
    n = 64
    q_out = SPAWN.Queue()
    ins = [SPAWN.Queue() for _ in range(n)]
    procs = [SPAWN.Process(target=L.one_shot_reader, args=(ins[i], q_out, i)) for i in range(n)]
    for p in procs:
        p.start()
    try:
        xs = [cupy.full(4096, i, dtype=cupy.int64) for i in range(n)]
        for i in range(n):
            ins[i].put(xs[i])
        got = dict(q_out.get(timeout=300) for _ in range(n))
        assert got == {i: 4096 * i for i in range(n)}
        assert cpm.sharing.stats()["peers"] == n
        for q in ins:
            q.put(None)
    finally:
        _join(*procs, timeout=300)
    del xs
    assert _wait_for(_settled, 30.0), _why()


def test_10000_messages_in_flight():
    n = 10_000
    q_in, q_out = SPAWN.Queue(), SPAWN.Queue()
    xs = [cupy.full(64, i, dtype=cupy.int32) for i in range(n)]
    for i, x in enumerate(xs):
        q_in.put((i, x))  # all in flight before the receiver even starts
    del x
    xs.clear()  # freed here while in flight: each block is held until received
    p = SPAWN.Process(target=L.count_receiver, args=(q_in, q_out, n))
    p.start()
    try:
        g = [cupy.full(64, -1, dtype=cupy.int32) for _ in range(2000)]  # pressure on reuse
        tag, bad, _ = q_out.get(timeout=300)
        assert tag == "done" and bad == [], bad[:10]
        del g
    finally:
        _join(p, timeout=300)
    assert _wait_for(_settled, 30.0), _why()


# -- forwarding and round trips ---------------------------------------------------------------
def test_forwarder_that_exits_before_the_third_process_unpickles():
    q1, q2, q_out = SPAWN.Queue(), SPAWN.Queue(), SPAWN.Queue()
    go = SPAWN.Event()
    mid = SPAWN.Process(target=L.forward_and_exit, args=(q1, q2, q_out))
    last = SPAWN.Process(target=L.late_reader, args=(q2, go, q_out))
    mid.start()
    last.start()
    try:
        x = cupy.full(1 << 20, 5, dtype=cupy.int16)
        q1.put(x)
        _join(mid)
        assert mid.exitcode == 0
        go.set()  # the forwarder is gone before the third process unpickles
        tag, first, uniform = q_out.get(timeout=TIMEOUT)
        assert tag == "late", first
        assert first == 6 and uniform  # the forwarder's write (+1) was waited for
    finally:
        go.set()
        _join(mid, last)
    del x
    assert _wait_for(_settled), _why()


def test_put_and_get_in_the_same_process_is_its_own_memory():
    q = SPAWN.Queue()
    x = cupy.arange(1 << 16, dtype=cupy.float32)
    q.put(x[8:])
    y = q.get(timeout=TIMEOUT)
    assert y.data.ptr == x[8:].data.ptr and bool((y == x[8:]).all())
    del x
    cupy.cuda.get_current_stream().synchronize()
    assert float(y[0]) == 8.0  # the round-tripped view keeps the memory
    del y
    assert _wait_for(_settled), _why()


# -- receivers that die, exporters that come and go ------------------------------------------------
def test_receiver_killed_while_its_kernel_writes_cannot_touch_reused_memory():
    q_in, q_out = SPAWN.Queue(), SPAWN.Queue()
    p = SPAWN.Process(target=L.kernel_then_killed, args=(q_in, q_out))
    p.start()
    try:
        x = cupy.full(1 << 20, 1, dtype=cupy.int32)
        q_in.put(x)
        assert q_out.get(timeout=TIMEOUT) == "queued"  # its kernel now spins, then writes -1
        os.kill(p.pid, signal.SIGKILL)
        del x
        _join(p)
        assert _wait_for(_settled, 30.0)  # the lease came back only once it was gone
        ys = [cupy.full(1 << 20, 5, dtype=cupy.int32) for _ in range(4)]  # reuse its memory
        time.sleep(2.0)  # longer than the killed kernel's spin
        assert all(bool((y == 5).all()) for y in ys)
    finally:
        if p.is_alive():
            p.kill()


def test_24_short_lived_exporters_leave_nothing_behind():
    """A long-lived receiver fed by short-lived producers: nothing grows per producer.

    Seen before the fixes: one pidfd per producer (the receiver's connection watched its
    exporter and never closed the pidfd), and 2-4 ``/dev/nvidiactl`` descriptors per
    batch of 8 (imported pools destroyed before a synchronising call saw their frees
    done; the driver keeps one descriptor for each).  The growth is taken per batch of 8: a leak
    per producer grows in every batch; a file the driver opens once stays put.
    """
    q = SPAWN.Queue()

    def batch(first, n):
        procs = [
            SPAWN.Process(target=L.short_lived_producer, args=(q, first + k)) for k in range(n)
        ]
        for p in procs:
            p.start()
        for _ in procs:
            i, a = q.get(timeout=TIMEOUT)
            assert bool((a == i).all())
            del a
        _join(*procs)
        for p in procs:
            p.close()  # the test's own process handles (pipes) go too
        cupy.cuda.get_current_stream().synchronize()

    def clean():
        s = cpm.sharing.stats()
        return (
            s["clients"] == 0
            and s["opened_events"] == 0
            and s["imported_pools"] == 0
            and s["imported_blocks"] == 0
            and s["idle_mappings"] == 0
        )

    batch(0, 8)  # first imports start what the driver keeps per process
    assert _wait_for(clean, 30.0), dict(cpm.sharing.stats())
    kinds = [fd_kinds()]
    for b in range(1, 4):
        batch(8 * b, 8)
        assert _wait_for(clean, 30.0), dict(cpm.sharing.stats())
        _wait_for(lambda: sum(fd_kinds().values()) <= sum(kinds[0].values()), 3.0)
        kinds.append(fd_kinds())
    per_batch = [grown(a, b) for a, b in zip(kinds, kinds[1:])]
    total = grown(kinds[0], kinds[-1])
    ours = {k: n for k, n in total.items() if k.startswith(("anon_inode", "socket", "pipe"))}
    # 24 producers came and went: a leak per producer adds 24 descriptors, 8 a batch.
    assert not ours and sum(total.values()) < 4, (
        f"descriptors grown over 24 producers: {total}; per batch of 8: {per_batch}"
    )


# -- messages that go wrong ----------------------------------------------------------------------
def test_message_never_read_lets_go_after_inflight_timeout():
    q = SPAWN.Queue()
    with _setting("inflight_timeout", 0.5):
        x = cupy.full(1 << 18, 4, dtype=cupy.int32)
        q.put(x)  # nobody reads it yet
        time.sleep(0.3)  # the feeder has pickled it: one ticket out
        assert cpm.sharing.stats()["tickets_out"] == 1
        del x
        assert _wait_for(_settled, 10.0)  # expired: the block is not pinned forever
        y = cupy.full(1 << 18, 9, dtype=cupy.int32)
        q_out = SPAWN.Queue()
        p = SPAWN.Process(target=L.get_expecting_stale, args=(q, q_out))
        p.start()
        try:
            tag, text = q_out.get(timeout=TIMEOUT)
            assert tag == "SharingError" and "stale" in text, (tag, text)
            assert bool((y == 9).all())
        finally:
            _join(p)


def test_message_written_to_disk_and_loaded_later_is_refused(tmp_path):
    x = cupy.full(1 << 18, 4, dtype=cupy.int32)
    path = tmp_path / "msg.pkl"
    path.write_bytes(bytes(ForkingPickler.dumps(x)))
    with _setting("inflight_timeout", 0.2):
        del x
        assert _wait_for(_settled, 10.0), _why()
    y = cupy.full(1 << 18, 8, dtype=cupy.int32)  # the same block, other data
    q_out = SPAWN.Queue()
    p = SPAWN.Process(target=L.load_file_expecting_stale, args=(str(path), q_out))
    p.start()
    try:
        tag, text = q_out.get(timeout=TIMEOUT)
        assert tag == "SharingError" and "stale" in text, (tag, text)
        assert bool((y == 8).all())
    finally:
        _join(p)


def test_message_that_fails_to_pickle_halfway_does_not_pin_memory():
    x = cupy.full(1 << 18, 4, dtype=cupy.int32)
    with _setting("inflight_timeout", 0.3):
        with pytest.raises(Exception, match="pickle"):
            ForkingPickler.dumps((x, lambda: 0))  # x's ticket is registered, then it fails
        assert cpm.sharing.stats()["tickets_out"] == 1
        del x
        assert _wait_for(_settled, 10.0), _why()


def test_reimport_while_the_previous_unmap_is_queued():
    # A pool without a reuse cache: its blocks do not recycle, so the receiver unmaps a
    # block received once when its array goes (a recycled one would stay mapped).
    pool = cpm.DevicePool(ipc=True, reuse_cache=0)
    q_in, q_out = SPAWN.Queue(), SPAWN.Queue()
    p = SPAWN.Process(target=L.reimport_while_unmap_queued, args=(q_in, q_out))
    p.start()
    try:
        with cpm.using(pool):
            x = cupy.full(1 << 20, 2, dtype=cupy.float32)
        q_in.put(x)
        q_in.put(x)
        tag, s, ok = q_out.get(timeout=TIMEOUT)
        assert tag == "ok", s
        assert s == 2.0 * (1 << 20) and ok
    finally:
        _join(p)
    del x
    assert _wait_for(_settled), _why()
    pool.close()


def test_received_array_collected_during_stream_capture():
    q_in, q_out = SPAWN.Queue(), SPAWN.Queue()
    p = SPAWN.Process(target=L.drop_during_capture, args=(q_in, q_out))
    p.start()
    try:
        x = cupy.full(1000, 3, dtype=cupy.float32)
        q_in.put(x)
        tag, total, ysum, during, after = q_out.get(timeout=TIMEOUT)
        assert tag == "ok", total
        assert total == 3000.0 and ysum == 4.0  # the graph ran: y += 1 once
        assert during == 1 and after == 0  # unmapped after the capture ended
    finally:
        _join(p)
    del x
    assert _wait_for(_settled), _why()


def test_close_of_a_pool_with_blocks_in_limbo_keeps_them_mapped():
    q_in, q_out = SPAWN.Queue(), SPAWN.Queue()
    p = SPAWN.Process(target=L.hold_until_told, args=(q_in, q_out))
    p.start()
    try:
        pool = cpm.DevicePool(ipc=True)
        with cpm.using(pool):
            x = cupy.full(1 << 20, 6, dtype=cupy.int32)
        q_in.put(x)
        assert q_out.get(timeout=TIMEOUT) == ("got", 6 << 20)
        del x  # limbo: the receiver still maps it
        assert pool.stats().held_for_sharing_bytes == 4 << 20
        pool.close()  # must not release the CUDA pool under the receiver
        q_in.put("again")
        assert q_out.get(timeout=TIMEOUT) == ("again", 6 << 20)
        assert q_out.get(timeout=TIMEOUT)[0] == "dropped"
        assert _wait_for(lambda: pool._held_for_sharing == 0, 10.0)
        q_in.put(None)
    finally:
        _join(p)


@pytest.mark.skipif(sys.platform != "linux", reason="needs Linux (pidfds, SO_PEERCRED)")
def test_sharing_socket_is_private():
    from cupy_poolmem._sharing import context

    x = cupy.arange(10)
    ForkingPickler.dumps(x)  # starts the listener
    addr = context().exporter.address
    assert not addr.startswith("\0") and os.path.exists(addr)
    assert os.stat(os.path.dirname(addr)).st_mode & 0o777 == 0o700
    with _setting("inflight_timeout", 0.1):
        del x
        assert _wait_for(_settled, 10.0), _why()
    np.testing.assert_equal(os.stat(addr).st_mode & 0o077, 0)
