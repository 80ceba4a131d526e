"""GPU tests of sharing's operational limits: a receiver out of descriptors recovers,
opened events stay bounded with many streams, socket directories go with their process.
Data is checked in the other process."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("ipc_allocator")]

cupy = pytest.importorskip("cupy")

from support import ops_workers as W  # noqa: E402
from support.waits import ipc_allocator  # noqa: E402, F401 - the module fixture
from support.waits import join as _join  # noqa: E402
from support.waits import wait_for as _wait_for  # noqa: E402

import cupy_poolmem as cpm  # noqa: E402

TIMEOUT = 120


def test_a_receiver_out_of_descriptors_is_told_and_takes_the_next_message():
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=W.fd_starved_receiver, args=(q_in, q_out))
    p.start()
    other = cpm.DevicePool(ipc=True)  # a pool the receiver has not imported yet
    try:
        first = cupy.ones(1000, dtype=cupy.float32)
        q_in.put(first)
        assert q_out.get(timeout=TIMEOUT) == ("first", 1000.0)
        with cpm.using(other):
            lost = cupy.full(1000, 2, dtype=cupy.float32)
            again = cupy.arange(1000, dtype=cupy.float32)
        cupy.cuda.get_current_stream().synchronize()
        q_in.put(lost)
        tag, kind, text = q_out.get(timeout=TIMEOUT)
        assert tag == "starved" and kind == "SharingError", (kind, text)
        assert "EMFILE" in text and "raise the limit" in text
        q_in.put(again)
        got = q_out.get(timeout=TIMEOUT)
        assert got == ("again", float(again.sum()), 7), got
    finally:
        _join(p)
    del first, lost, again
    assert _wait_for(lambda: cpm.sharing.stats()["leases"] == 0)
    other.close()


def test_opened_events_stay_bounded_with_many_sending_streams():
    n = 80  # more streams than the 64 events a receiver keeps open per exporter
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=W.many_streams_receiver, args=(q_in, q_out, n))
    p.start()
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(n)]
    sent = []
    try:
        for i, s in enumerate(streams):
            with s:
                x = cupy.full(4096, i, dtype=cupy.int32)  # written on its own stream
            sent.append(x)
            q_in.put((i, x))
        tag, ok, opened = q_out.get(timeout=TIMEOUT)
        assert tag == "done" and ok
        assert opened <= 64
        q_in.put(None)
    finally:
        _join(p)
    for s in streams:
        s.synchronize()
    del sent


def test_socket_directories_of_pool_tasks_go_when_their_processes_exit():
    """One directory per exporting process stayed (a Pool(maxtasksperchild=1) left one
    per task)."""
    ctx = mp.get_context("spawn")
    with ctx.Pool(2, maxtasksperchild=1) as pool:
        res = pool.map_async(W.exporting_task, range(4))
        results = res.get(TIMEOUT)
        dirs = set()
        for i, (arr, d) in enumerate(results):
            assert isinstance(arr, cupy.ndarray) and bool((arr == i).all())
            dirs.add(d)
        del results, arr
        pool.close()
        pool.join()
    assert len(dirs) == 4
    assert _wait_for(lambda: not any(os.path.exists(d) for d in dirs)), [
        d for d in dirs if os.path.exists(d)
    ]
