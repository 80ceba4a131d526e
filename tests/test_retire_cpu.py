"""CPU tests of how pools' CUDA pools are destroyed: never before a sync saw their frees.

Driver 580 corrupts its heap when a pool, plain or shareable, is destroyed while a
free of its memory is pending (seen on an H100: a pool created later crashed in
``cuMemAllocFromPoolAsync``), so
the pools hand their cuda.core resource to ``_retire.Retirer``; these tests play the
driver (``tests/fakes/hotpath.World`` and the ``fake_retirer`` fixture).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import cupy
import pytest
from fakes.hotpath import sharing_hooks

from cupy_poolmem import _errors, _pools, _retire, _streams
from cupy_poolmem import _hotpath_py as twin
from cupy_poolmem._pools.managed import ManagedAllocator

pytestmark = pytest.mark.filterwarnings("ignore:ExternalStream is deprecated")

KB = 4096


class Resource:
    def __init__(self, log: list, name: str = "r") -> None:
        self.log, self.name = log, name

    def close(self) -> None:
        self.log.append(("close", self.name))


def _failing_sync_retirer(sync, log: list) -> _retire.Retirer:
    """A retirer on device 0 whose ``sync`` the test controls; frees go to ``log``, and
    three failed drains in a row count as a broken context."""
    r = _retire.Retirer(
        sync,
        lambda: False,
        lambda: [0],
        free=lambda p, d: log.append(("free", p)),
        background=False,
    )
    r.max_failures = 3
    return r


# ---------------------------------------------------------------- the retirer itself
def test_nothing_is_closed_before_a_sync_of_its_devices(fake_retirer):
    log = fake_retirer.log.events
    a = fake_retirer.adopt(Resource(log, "a"))
    b = fake_retirer.adopt(Resource(log, "b"))
    assert fake_retirer.held == 2
    fake_retirer.retire(a, 1)
    fake_retirer.retire(b, 1)
    fake_retirer.retire(a, 1)  # twice: harmless
    assert log == [] and fake_retirer.pending == 2 and fake_retirer.held == 0
    assert fake_retirer.drain()
    assert log == [("sync", 1), ("close", "a"), ("close", "b")]  # one sync per device
    assert fake_retirer.pending == 0 and fake_retirer.n_retired == 2


def test_a_capture_under_way_holds_retirement_back(fake_retirer):
    log = fake_retirer.log.events
    fake_retirer.retire(fake_retirer.adopt(Resource(log)), 0)
    fake_retirer.log.capturing = True  # a sync now would invalidate the capture
    assert not fake_retirer.drain()
    assert log == [] and fake_retirer.pending == 1
    fake_retirer.log.capturing = False
    assert fake_retirer.drain()
    assert log == [("sync", 0), ("close", "r")]


def test_a_host_pool_syncs_every_active_device(fake_retirer):
    log = fake_retirer.log.events
    fake_retirer.log.active = [0, 2]
    fake_retirer.retire(fake_retirer.adopt(Resource(log, "pinned")), _retire.ALL_DEVICES)
    fake_retirer.retire(fake_retirer.adopt(Resource(log, "dev2")), 2)
    fake_retirer.drain()
    assert log == [("sync", 0), ("sync", 2), ("close", "pinned"), ("close", "dev2")]


def test_a_failing_sync_is_retried_and_the_pool_never_destroyed_unsynced():
    log: list = []
    fail = [True]

    def sync(dev):
        if fail[0]:
            raise RuntimeError("CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
        log.append(("sync", dev))

    r = _retire.Retirer(sync, lambda: False, lambda: [0], background=False)
    r.retire(r.adopt(Resource(log)), 0)
    assert not r.drain() and r.n_sync_errors == 1 and log == [] and r.pending == 1
    fail[0] = False
    assert r.drain() and log == [("sync", 0), ("close", "r")]


def test_a_sync_that_keeps_failing_keeps_the_pool_for_good():
    log: list = []

    def broken(dev):
        raise RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS")

    r = _retire.Retirer(broken, lambda: False, lambda: [0], background=False)
    r.max_failures = 3
    r.retire(r.adopt(Resource(log)), 0)
    for _ in range(3):
        assert not r.drain()
    assert r.pending == 0 and len(r._kept) == 1 and log == []  # leaked, never destroyed


def test_a_capture_the_pools_never_saw_holds_retirement_back_however_long_it_lasts():
    """cuCtxSynchronize refused for a capture (CUDA_ERROR_STREAM_CAPTURE_*) is not a
    broken context: never counted toward max_failures, the batch waits for the end of
    the capture, and a live pool's leftovers are freed before it is destroyed."""
    log: list = []
    capturing = [True]

    def sync(dev):
        if capturing[0]:
            raise RuntimeError("CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
        log.append(("sync", dev))

    r = _failing_sync_retirer(sync, log)
    live = r.adopt(Resource(log, "live"))
    r.add_leftovers(live, 0, [0xA])  # an orphaned block of a live pool
    r.retire(r.adopt(Resource(log, "gone")), 0)
    for _ in range(10):  # the capture goes on (a 5 s capture: 100 drains)
        assert not r.drain()
    assert r.n_sync_errors == 10 and r._kept == [] and r.pending == 1 and log == []
    capturing[0] = False  # the capture ends
    r.retire(live, 0)  # the live pool is closed later
    assert r.drain()
    assert log == [("sync", 0), ("free", 0xA), ("sync", 0), ("close", "gone"), ("close", "live")]
    assert r._kept == [] and r.n_retired == 2


def test_a_sync_error_keeps_the_pools_due_but_never_drops_a_live_pools_leftovers():
    """max_failures sync errors that are not a capture's: the resources retired are
    kept for good; leftovers of a pool still held stay due and are freed once a sync
    works again, before that pool's own close."""
    log: list = []
    broken = [True]

    def sync(dev):
        if broken[0]:
            raise _errors.CUDADriverError("cuCtxSynchronize", 700, "CUDA_ERROR_ILLEGAL_ADDRESS")
        log.append(("sync", dev))

    r = _failing_sync_retirer(sync, log)
    live = r.adopt(Resource(log, "live"))
    r.add_leftovers(live, 0, [0xA])
    gone = Resource(log, "gone")
    r.retire(r.adopt(gone), 0, [0xB])  # its leftover stays in it: kept with it
    for _ in range(3):
        assert not r.drain()
    assert r._kept == [gone] and r.pending == 0 and log == []
    broken[0] = False
    r.retire(live, 0)
    assert r.drain()
    assert log == [("sync", 0), ("free", 0xA), ("sync", 0), ("close", "live")]


def test_a_capture_error_is_told_from_other_sync_errors():
    capture = [
        _errors.CUDADriverError("cuCtxSynchronize", 900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"),
        _errors.CUDADriverError("cuCtxSynchronize", 907, "CUDA_ERROR_CAPTURED_EVENT"),
        RuntimeError("cuCtxSynchronize failed: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"),
    ]
    other = [
        _errors.CUDADriverError("cuCtxSynchronize", 700, "CUDA_ERROR_ILLEGAL_ADDRESS"),
        RuntimeError("CUDA_ERROR_INVALID_CONTEXT"),
        ValueError("no device"),
    ]
    assert all(_retire._is_capture_error(e) for e in capture)
    assert not any(_retire._is_capture_error(e) for e in other)


def test_a_drain_that_raises_loses_nothing():
    log: list = []
    r = _retire.Retirer(lambda dev: None, lambda: False, lambda: [0], background=False)

    class Bad(Resource):
        def close(self):
            raise KeyboardInterrupt

    r.retire(r.adopt(Bad(log)), 0)
    with pytest.raises(KeyboardInterrupt):
        r.drain()
    assert r.pending == 1  # tried again next time


def test_a_drain_that_raises_after_freeing_leftovers_never_frees_them_again():
    """A BaseException out of a resource's close() puts the batch back: the leftovers
    freed before it, and the resources closed before it, are not in it any more."""
    log: list = []
    r = _retire.Retirer(
        lambda dev: log.append(("sync", dev)),
        lambda: False,
        lambda: [0],
        free=lambda p, d: log.append(("free", p)),
        background=False,
    )
    interrupt = [True]

    class Bad(Resource):
        def close(self):
            if interrupt:
                interrupt.pop()
                raise KeyboardInterrupt
            super().close()

    live = r.adopt(Resource(log, "live"))
    r.add_leftovers(live, 0, [0xB])  # a live pool's orphans
    r.retire(r.adopt(Resource(log, "good")), 0, [0xC])
    r.retire(r.adopt(Bad(log, "bad")), 0, [0xA])
    with pytest.raises(KeyboardInterrupt):
        r.drain()
    assert r.pending == 1  # the one whose close() was interrupted
    assert r.drain()
    frees = [e for e in log if e[0] == "free"]
    assert sorted(frees) == [("free", 0xA), ("free", 0xB), ("free", 0xC)]  # each once
    assert [e for e in log if e[0] == "close"] == [("close", "good"), ("close", "bad")]
    assert log[-2:] == [("sync", 0), ("close", "bad")]  # synchronised again first


def test_a_free_interrupted_among_leftovers_is_never_done_twice():
    """A BaseException out of a leftover's free: that one and those before it are not
    freed again (a leak at worst, never a double free); the rest are, before the close."""
    log: list = []

    def free(p, d):
        log.append(("free", p))
        if p == 0xB and len(log) < 4:
            raise KeyboardInterrupt

    r = _retire.Retirer(lambda dev: None, lambda: False, lambda: [0], free=free, background=False)
    r.retire(r.adopt(Resource(log)), 0, [0xA, 0xB, 0xC])
    with pytest.raises(KeyboardInterrupt):
        r.drain()
    assert r.drain()
    assert log == [("free", 0xA), ("free", 0xB), ("free", 0xC), ("close", "r")]


def test_retire_from_a_finalizer_while_the_lock_is_held_does_not_deadlock(fake_retirer):
    log = fake_retirer.log.events
    token = fake_retirer.adopt(Resource(log))
    done = threading.Event()

    def body():
        with fake_retirer._lock:  # a garbage collection starting under the lock ...
            fake_retirer.retire(token, 0)  # ... runs a pool's finalizer here
        done.set()

    t = threading.Thread(target=body, daemon=True)
    t.start()
    assert done.wait(5), "retire() deadlocked on its own lock"
    assert fake_retirer.pending == 1


def test_the_background_thread_retires_and_then_stops():
    log: list = []
    synced = threading.Event()

    def sync(dev):
        log.append(("sync", dev))
        synced.set()

    r = _retire.Retirer(sync, lambda: False, lambda: [0], delay=0.01)
    for i in range(3):
        r.retire(r.adopt(Resource(log, str(i))), 0)
    deadline = time.monotonic() + 10
    while (r.pending or r._thread is not None) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert synced.is_set() and r.pending == 0 and r._thread is None
    assert log[0] == ("sync", 0) and sorted(log[1:]) == [
        ("close", "0"),
        ("close", "1"),
        ("close", "2"),
    ]


def _wait_for(cond, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_the_background_thread_survives_an_error_and_retires_everything(recwarn):
    """An exception out of drain() (active_devices() here; a MemoryError anywhere) is
    warned about once and retried: the thread goes on, the batch is retired later."""
    log: list = []
    calls: list = []

    def active():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device_count failed once")
        return [0]

    r = _retire.Retirer(lambda dev: log.append(("sync", dev)), lambda: False, active, delay=0.01)
    r.retire(r.adopt(Resource(log, "host")), _retire.ALL_DEVICES)
    assert _wait_for(lambda: len(calls) >= 1)
    r.retire(r.adopt(Resource(log, "later")), 0)  # a later pool
    assert _wait_for(lambda: r.pending == 0 and r._thread is None)
    assert sorted(e for e in log if e[0] == "close") == [("close", "host"), ("close", "later")]
    assert r.n_errors == 1
    assert [str(w.message) for w in recwarn.list if "retiring pools" in str(w.message)] == [
        "cupy_poolmem: retiring pools failed (RuntimeError('device_count failed once')); retrying"
    ]


def test_the_background_thread_backs_off_while_syncs_fail():
    """A long capture the pools never saw: the thread retries less and less often (up
    to max_delay between drains) instead of every 10 ms, then retires at its end."""
    log: list = []
    capturing = threading.Event()
    capturing.set()

    def sync(dev):
        log.append(("sync", dev))
        if capturing.is_set():
            raise RuntimeError("CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")

    r = _retire.Retirer(sync, lambda: False, lambda: [0], delay=0.01)
    r.max_delay = 0.08
    r.retire(r.adopt(Resource(log)), 0)
    time.sleep(0.6)  # 60 drains without a back-off; about 10 with it
    n = len(log)
    assert 3 <= n < 20, n
    capturing.clear()
    assert _wait_for(lambda: r.pending == 0 and r._thread is None)
    assert log[-2:] == [("sync", 0), ("close", "r")] and r._backoff == 0


class _Fatal(BaseException):
    pass


def test_a_background_thread_that_dies_is_replaced_while_work_remains(monkeypatch):
    """An error that is not an Exception ends the thread: its slot is freed, and a new
    thread takes the work over (one left in _thread would block every later start)."""
    log: list = []
    r = _retire.Retirer(
        lambda dev: log.append(("sync", dev)), lambda: False, lambda: [0], delay=0.01
    )
    drain, fail = r.drain, [True]

    def drain_once_fatal():
        if fail:
            fail.pop()
            raise _Fatal
        return drain()

    monkeypatch.setattr(r, "drain", drain_once_fatal)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # expected traceback
    r.retire(r.adopt(Resource(log, "a")), 0)
    assert _wait_for(lambda: r.pending == 0 and r._thread is None)
    assert log == [("sync", 0), ("close", "a")]


def test_a_fork_child_never_closes_the_parents_pools(fake_retirer):
    log = fake_retirer.log.events
    kept = fake_retirer.adopt(Resource(log, "kept"))
    due = Resource(log, "due")
    fake_retirer.retire(fake_retirer.adopt(due), 0)
    fake_retirer._after_fork_in_child()
    fake_retirer.retire(kept, 0)
    fake_retirer.retire(fake_retirer.adopt(Resource(log, "child")), 0)
    assert fake_retirer.drain() and log == []  # no sync, no close: CUDA is unusable
    assert fake_retirer.pending == 0 and fake_retirer.held == 0
    assert due in fake_retirer._kept and len(fake_retirer._kept) == 3  # never released


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_the_fork_handler_is_registered():
    """A fresh interpreter (no CUDA: nothing allocated) forks; the child's retirer must
    have been switched by ``os.register_at_fork`` (the handler itself is tested above),
    and must keep a resource retired there instead of closing it."""
    code = (
        "import os, sys\n"
        "from cupy_poolmem import _retire as R\n"
        "class Res:\n"
        "    def close(self): os._exit(4)\n"
        "r = R.retirer()\n"
        "t = r.adopt(Res())\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    ok = r._forked and not r._background\n"
        "    r.retire(t, 0); r.drain()\n"
        "    os._exit(0 if ok and r.pending == 0 and len(r._kept) == 1 else 3)\n"
        "_, st = os.waitpid(pid, 0)\n"
        "sys.exit(os.waitstatus_to_exitcode(st))\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "-c", code], env=env, timeout=120, capture_output=True)
    assert run.returncode == 0, run.stderr.decode()[-2000:]


def test_leftovers_of_a_held_pool_are_freed_after_a_sync_and_before_its_close(fake_retirer):
    log = fake_retirer.log.events
    token = fake_retirer.adopt(Resource(log))
    fake_retirer.add_leftovers(token, 1, [0xA, 0xB])
    fake_retirer.add_leftovers(token, 1, [])  # nothing: no work
    fake_retirer.add_leftovers(12345, 1, [0xC])  # no such pool: never freed blindly
    assert fake_retirer.n_leftovers_lost == 1
    assert fake_retirer.pending == 0  # nothing to close yet
    assert fake_retirer.drain()
    assert log == [("sync", 1), ("free", 0xA, 1), ("free", 0xB, 1), ("sync", 1)]
    assert fake_retirer.held == 1  # the pool itself is not closed: it is still live
    fake_retirer.add_leftovers(token, 1, [0xD])
    fake_retirer.retire(token, 1)
    log.clear()
    assert fake_retirer.drain()  # one batch: its frees come first, the close last
    assert log == [("sync", 1), ("free", 0xD, 1), ("sync", 1), ("close", "r")]
    fake_retirer.add_leftovers(token, 1, [0xE])  # closed: its memory went with it
    assert fake_retirer.drain() and log[-1] == ("close", "r")
    assert fake_retirer.n_leftovers_lost == 2


def test_leftovers_of_a_pool_retired_but_not_closed_yet_are_freed_before_its_close(
    fake_retirer,
):
    """add_leftovers after the pool was retired (a close() that hands its guard's
    quarantine over while another thread's last free retired the pool): the pool is
    still due, so the blocks are freed before its close, not dropped."""
    log = fake_retirer.log.events
    token = fake_retirer.adopt(Resource(log))
    other = fake_retirer.adopt(Resource(log, "other"))
    fake_retirer.retire(token, 0)
    fake_retirer.retire(other, 0)
    fake_retirer.add_leftovers(token, 0, [0xA])
    fake_retirer.retire(token, 0, [0xB])  # retired twice: its leftovers all the same
    assert fake_retirer.pending == 2 and fake_retirer.n_leftovers_lost == 0
    assert fake_retirer.drain()
    assert log == [
        ("sync", 0),
        ("free", 0xA, 0),
        ("free", 0xB, 0),
        ("sync", 0),
        ("close", "r"),
        ("close", "other"),
    ]


def test_leftovers_that_come_while_a_drain_retires_their_pool_are_freed_before_its_close(
    fake_retirer,
):
    """Leftovers for a pool whose batch a drain (the retirer's thread) is working on,
    after its sync: the close waits for the next drain, which frees them first."""
    log = fake_retirer.log.events
    token = fake_retirer.adopt(Resource(log))
    sync = fake_retirer._sync

    def sync_then_late_leftovers(dev):
        sync(dev)
        if log.count(("sync", 0)) == 1:  # another thread, meanwhile
            fake_retirer.add_leftovers(token, 0, [0xA])

    fake_retirer._sync = sync_then_late_leftovers
    fake_retirer.retire(token, 0)
    fake_retirer.drain()
    assert ("close", "r") not in log and fake_retirer.pending == 1
    assert fake_retirer.drain()
    assert log == [("sync", 0), ("sync", 0), ("free", 0xA, 0), ("sync", 0), ("close", "r")]
    assert fake_retirer.n_leftovers_lost == 0 and fake_retirer._inflight == {}


def test_leftovers_that_come_during_a_failed_drain_go_back_before_their_close():
    log: list = []
    fail = [True]
    r = _retire.Retirer(
        lambda dev: None,
        lambda: False,
        lambda: [0],
        free=lambda p, d: log.append(p),
        background=False,
    )
    token = r.adopt(Resource(log))

    def sync(dev):
        if fail:
            fail.pop()
            r.add_leftovers(token, 0, [0xA])  # arrives while the batch is out
            raise RuntimeError("CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")

    r._sync = sync
    r.retire(token, 0)
    assert not r.drain()
    assert [(e.leftovers, e.close) for e in r._due] == [((0xA,), False), ((), True)]
    assert r.drain() and log == [0xA, ("close", "r")] and r.n_leftovers_lost == 0


def test_leftovers_of_blocks_used_on_other_streams_sync_every_device(fake_retirer):
    log = fake_retirer.log.events
    fake_retirer.log.active = [0, 1, 2]
    token = fake_retirer.adopt(Resource(log))
    fake_retirer.add_leftovers(token, 1, [0xA], everywhere=True)  # record_stream'd
    fake_retirer.drain()
    assert log == [("sync", 0), ("sync", 1), ("sync", 2), ("free", 0xA, 1), ("sync", 1)]


def test_a_resource_with_its_own_free_frees_its_leftovers(fake_retirer):
    log = fake_retirer.log.events

    class Backend(Resource):
        def free_leftover(self, ptr):
            self.log.append(("own_free", ptr))

    fake_retirer.retire(fake_retirer.adopt(Backend(log, "b")), 0, [0xA])
    fake_retirer.drain()
    assert log == [("sync", 0), ("own_free", 0xA), ("sync", 0), ("close", "b")]


def test_a_pool_waiting_for_a_capture_is_polled_until_done():
    log: list = []
    r = _retire.Retirer(
        lambda dev: log.append(("sync", dev)), lambda: False, lambda: [0], delay=0.01
    )
    token = r.adopt(Resource(log))
    polls = []
    capture_over = threading.Event()

    def poll():  # what a closed pool with frees held for a capture gives the retirer
        polls.append(1)
        if not capture_over.is_set():
            return False
        r.retire(token, 0)
        return True

    r.after_captures(poll)
    deadline = time.monotonic() + 10
    while len(polls) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(polls) >= 3 and r.waiting == 1 and log == []  # the thread keeps polling
    capture_over.set()
    while (r._thread is not None or r.pending) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r.waiting == 0 and log == [("sync", 0), ("close", "r")] and r._thread is None


def test_drain_says_when_a_pool_still_waits_and_retries_a_poll_that_raises(fake_retirer):
    answers = [False, True]
    fake_retirer.after_captures(lambda: answers.pop(0))
    assert not fake_retirer.drain() and fake_retirer.waiting == 1
    assert fake_retirer.drain() and fake_retirer.waiting == 0

    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("a CUDA error")

    fake_retirer.max_failures = 3
    fake_retirer.after_captures(broken)
    with pytest.warns(RuntimeWarning, match=r"held for a capture failed .*a CUDA error.*retrying"):
        assert not fake_retirer.drain() and fake_retirer.waiting == 1  # tried again
    assert not fake_retirer.drain() and fake_retirer.waiting == 1
    with pytest.warns(RuntimeWarning, match="gave up"):
        assert fake_retirer.drain() and fake_retirer.waiting == 0  # its frees leak, no more
    assert len(calls) == 3 and fake_retirer.n_poll_errors == 3


def test_a_fork_child_never_polls_the_parents_waiting_pools(fake_retirer):
    polled = []
    fake_retirer.after_captures(lambda: polled.append(1))
    fake_retirer._after_fork_in_child()
    fake_retirer.after_captures(lambda: polled.append(2))
    assert fake_retirer.drain() and polled == [] and fake_retirer.waiting == 0
    assert len(fake_retirer._kept) == 2  # kept: their pools' streams are never destroyed


# ---------------------------------------------------------------- pools use it
@pytest.fixture
def world(fake_retirer, twin_world):
    twin_world.retirer = fake_retirer
    return twin_world


def _closing(world, p):
    """Record the pool's resource closing in the world's log, in order with the frees."""
    p._mr.close = lambda: world.log.append(("close_pool",))
    world.retirer._sync = lambda dev: world.log.append(("sync", dev))
    world.retirer._free = lambda ptr, dev: world.log.append(("legacy_free", ptr, dev))


@pytest.mark.parametrize("ipc", [False, True])
def test_a_closed_pool_is_destroyed_only_after_its_last_free_and_a_sync(world, ipc):
    """Plain or shareable: driver 580 crashes on either destroyed with a free pending."""
    p = world.pool(ipc=ipc)
    _closing(world, p)
    m = p.malloc(KB)
    ptr = m.ptr
    p.close()
    assert world.retirer.pending == 0  # a block is live: the CUDA pool stays
    del m
    assert ("free", ptr, 0x5000) in world.log and ("close_pool",) not in world.log
    assert world.retirer.pending == 1
    world.retirer.drain()
    tail = [e for e in world.log if e[0] in ("free", "sync", "close_pool")]
    assert tail[-3:] == [("free", ptr, 0x5000), ("sync", 0), ("close_pool",)]


def test_a_pool_dropped_without_close_frees_its_cache_then_retires(world, tp, monkeypatch):
    monkeypatch.setattr(tp.Pool, "__del__", _pools.Pool.__del__)  # the real finalizer
    p = world.pool()
    _closing(world, p)
    m = p.malloc(KB)
    ptr = m.ptr
    del m
    assert p.cached_bytes == KB  # in the reuse cache, not freed
    n = len(world.log)
    del p
    gc.collect()
    # Nothing reaches the driver from the finalizer (the cached block's stream may be
    # gone already inside a garbage cycle) ...
    assert world.log[n:] == [] and world.retirer.pending == 1
    world.retirer.drain()
    # ... the retirer frees it after a sync, on the legacy stream, and syncs again.
    assert world.log[n:] == [("sync", 0), ("legacy_free", ptr, 0), ("sync", 0), ("close_pool",)]


def test_take_cache_empties_the_cache_without_freeing(world):
    p = world.pool()
    a, b = p.malloc(KB), p.malloc(2 * KB)
    ptrs = {a.ptr, b.ptr}
    del a, b
    n = len(world.log)
    assert p.cached_bytes == 3 * KB
    assert set(p._take_cache()) == ptrs and p.cached_bytes == 0 and world.log[n:] == []
    assert p._take_cache() == []


def test_a_pinned_pool_syncs_every_active_device(world, tp):
    world.retirer.log.active = [0, 1]
    p = world.pool(kind=twin.KIND_PINNED)
    _closing(world, p)
    p.close()
    world.retirer.drain()
    assert world.log[-3:] == [("sync", 0), ("sync", 1), ("close_pool",)]


def test_pool_holds_its_resource_through_the_retirer(world):
    p = world.pool()
    token = p._retire_token
    assert world.retirer._held[token] is p._mr
    p._mr = SimpleNamespace()  # a garbage cycle clearing the pool's dict: nothing destroyed
    assert token in world.retirer._held


def test_a_closed_pinned_pool_whose_last_free_is_deferred_is_retired(world, tp, monkeypatch):
    world.retirer.log.active = [0]
    p = world.pool(cls=tp.PinnedPool, kind=twin.KIND_PINNED)
    _closing(world, p)
    p._pending = __import__("collections").deque()
    p._pending_lock = threading.Lock()

    def defer(ptr, size, stream):  # the pinned pool's hook: held until its stream is done
        p._pending.append(([], ptr, stream))
        return True

    p.release_hook = defer
    m = p.malloc(KB)
    ptr = m.ptr
    p.close()
    n = len(world.log)
    del m  # the hook keeps it; the pool is drained all the same
    assert world.retirer.pending == 1
    world.retirer.drain()
    assert world.log[n:] == [("sync", 0), ("legacy_free", ptr, 0), ("sync", 0), ("close_pool",)]


# ---------------------------------------------------------------- pools in garbage cycles
def _pyx_fields() -> tuple[list[str], list[str]]:
    """PoolCore's fields in ``_hotpath.pyx``: (C-typed ones, object ones)."""
    pyx = Path(twin.__file__).with_name("_hotpath.pyx").read_text()
    body = pyx.split("cdef class PoolCore")[1].split("\ncdef class ")[0]
    classes = set(re.findall(r"^cdef class (\w+)", pyx, re.M))  # typed object fields too
    classes |= {
        n.strip() for c in re.findall(r"^from \S+ cimport (.+)$", pyx, re.M) for n in c.split(",")
    }
    scalars, objects = [], []
    fields = re.findall(r"^    cdef (?:readonly |public )?([\w ]+?) (\w+)\s*(?:#.*)?$", body, re.M)
    for kind, name in fields:
        (objects if kind in ("object", "dict", "list") or kind in classes else scalars).append(name)
    return scalars, objects


def _collector_clears(p) -> None:
    """What the garbage collector's tp_clear does to a pool of the compiled hot path: the
    Python subclass's ``__dict__`` is emptied and PoolCore's object fields set to None;
    its C fields (counters, flags, the retire token) keep their values.  (The twin keeps
    them all in ``__dict__``; the fields are read from the .pyx.)"""
    scalars, objects = _pyx_fields()
    assert {"closed", "n_frees", "_last_size"} <= set(scalars)
    assert {"_backend", "_cache", "_shares", "_last_bin", "observer"} <= set(objects)
    kept = {k: v for k, v in vars(p).items() if k in scalars}
    vars(p).clear()
    vars(p).update(kept)
    for name in objects:
        setattr(p, name, None)


def test_a_live_block_of_a_pool_finalized_in_a_garbage_cycle_is_retired_safely(world, tp):
    """A pool unreachable with its live blocks (they hold it): the collector runs the
    finalizers (the pool's, and a cupy Stream's, which destroys the stream), then
    tp_clear, then frees the blocks.  Such a block must not reach its stream, and the
    pool must still be retired."""
    p = world.pool()
    _closing(world, p)
    m, cached = p.malloc(KB), p.malloc(2 * KB)
    ptr, cptr = m.ptr, cached.ptr
    del cached  # into the reuse cache
    token = p._retire_token
    _pools.Pool.__del__(p)  # the finalizer (the twin module's is disabled)
    world.log.append(("stream_destroyed",))
    _collector_clears(p)
    n_queried = len(world.queried)
    del m
    assert world.queried[n_queried:] == []  # no capture query on the dead stream
    assert ("free", ptr, 0x5000) not in world.log and ("free", cptr, 0x5000) not in world.log
    assert token not in world.retirer._held and world.retirer.pending == 1
    assert p.n_free_errors == 0
    world.retirer.drain()
    tail = world.log[world.log.index(("stream_destroyed",)) + 1 :]
    assert tail == [
        ("sync", 0),
        ("legacy_free", cptr, 0),
        ("legacy_free", ptr, 0),
        ("sync", 0),
        ("close_pool",),
    ]


class _DyingStream(cupy.cuda.ExternalStream):
    """A stream whose finalizer 'destroys' it, as cupy's Stream.__del__ does."""

    def __del__(self):
        _DyingStream.log.append(("stream_destroyed", self.ptr))


def test_a_pool_collected_with_its_stream_and_a_live_array_never_frees_on_the_dead_stream(
    world, tp, monkeypatch
):
    monkeypatch.setattr(tp.Pool, "__del__", _pools.Pool.__del__)  # the real finalizer
    monkeypatch.setattr(_DyingStream, "log", world.log, raising=False)
    p = world.pool()
    _closing(world, p)
    world.current = s = _DyingStream(0x6000, 0)
    m = p.malloc(KB)
    ptr = m.ptr
    cycle = [p, s, m]
    cycle.append(cycle)
    del p, s, m, cycle
    world.current = cupy.cuda.ExternalStream(0x5000, 0)
    gc.collect()
    dead = world.log.index(("stream_destroyed", 0x6000))
    assert ("free", ptr, 0x6000) not in world.log[dead:]
    assert world.retirer.pending == 1
    world.retirer.drain()
    assert world.log[-4:] == [("sync", 0), ("legacy_free", ptr, 0), ("sync", 0), ("close_pool",)]
    assert world.retirer.held == 0


def test_a_pinned_pool_finalized_with_deferred_and_live_blocks_is_retired(world, tp):
    world.retirer.log.active = [0]
    p = world.pool(cls=tp.PinnedPool, kind=twin.KIND_PINNED)
    _closing(world, p)
    p._pending = collections.deque()
    p._pending_lock = threading.Lock()

    def defer(ptr, size, stream):  # the pinned pool's hook: held until its stream is done
        p._pending.append(([], ptr, stream))
        return True

    p.release_hook = defer
    deferred, live = p.malloc(KB), p.malloc(KB)
    dptr, lptr = deferred.ptr, live.ptr
    del deferred
    n = len(world.log)
    _pools.Pool.__del__(p)
    _collector_clears(p)
    del live  # neither the hook nor the stream: the retirer
    assert world.log[n:] == [] and world.retirer.pending == 1
    world.retirer.drain()
    assert world.log[n:] == [
        ("sync", 0),
        ("legacy_free", dptr, 0),
        ("legacy_free", lptr, 0),
        ("sync", 0),
        ("close_pool",),
    ]


# ---------------------------------------------------------------- frees held for a capture
def test_a_closed_pool_does_its_frees_held_for_a_capture_before_it_is_retired(world):
    p = world.pool(reuse_cache=0)
    _closing(world, p)
    m = p.malloc(KB)
    ptr = m.ptr
    world.status[0x5000] = (1, 7)  # the block's stream begins a capture
    p.close()
    del m  # held: a free now would become a node of the graph
    assert p.n_capture_held == 1 and world.retirer.pending == 0 and world.retirer.waiting == 1
    assert world.retirer.held == 1 and ("close_pool",) not in world.log
    assert _streams.CAPTURES.streams  # the retirer knows of the capture now
    assert not world.retirer.drain()  # still capturing: still held, nothing synchronised
    assert ("free", ptr, 0x5000) not in world.log and ("close_pool",) not in world.log
    del world.status[0x5000]  # end_capture()
    assert world.retirer.drain()
    tail = [e for e in world.log if e[0] in ("free", "sync", "close_pool")]
    assert tail[-3:] == [("free", ptr, 0x5000), ("sync", 0), ("close_pool",)]
    assert world.retirer.waiting == 0 and world.retirer.held == 0


def _closed_pool_waiting_for_a_capture(world):
    """A closed pool whose last free is held for a capture: the retirer polls it."""
    p = world.pool(reuse_cache=0)
    _closing(world, p)
    m = p.malloc(KB)
    ptr = m.ptr
    world.status[0x5000] = (1, 7)
    p.close()
    del m  # held for the capture; the retirer polls the pool
    assert world.retirer.waiting == 1 and world.retirer.held == 1
    return p, ptr


def _breaking_polls(tp, monkeypatch):
    def broken(dev):
        raise RuntimeError("CUDA_ERROR_INVALID_CONTEXT")

    monkeypatch.setattr(tp._capture, "on_device", broken)
    return lambda: monkeypatch.setattr(
        tp._capture, "on_device", lambda dev: contextlib.nullcontext()
    )


def test_a_closed_pool_whose_poll_raised_once_is_polled_again_and_retired(world, tp, monkeypatch):
    """A poll that raises (here on_device: a context not bound yet) is not dropped:
    the retirer keeps the pool and polls it again, and retires it after the capture."""
    monkeypatch.setattr(tp.Pool, "__del__", _pools.Pool.__del__)  # the real finalizer
    p, ptr = _closed_pool_waiting_for_a_capture(world)
    repair = _breaking_polls(tp, monkeypatch)
    del p  # the retirer's poll keeps it
    with pytest.warns(RuntimeWarning, match="retrying"):
        assert not world.retirer.drain()
    assert world.retirer.waiting == 1 and world.retirer.held == 1
    repair()
    del world.status[0x5000]  # the capture ends
    assert world.retirer.drain()
    frees = [e for e in world.log if e[0] in ("free", "legacy_free") and e[1] == ptr]
    assert frees == [("free", ptr, 0x5000)]  # once, on its stream
    assert world.log[-2:] == [("sync", 0), ("close_pool",)]
    assert world.retirer.held == 0 and world.retirer.waiting == 0


def test_a_closed_pool_dropped_by_the_retirer_after_failed_polls_is_retired_by_its_finalizer(
    world, tp, monkeypatch
):
    """After max_failures polls that raised, the retirer gives the pool up; its
    finalizer then hands the held free over as a leftover and retires the pool (close()
    returns at once for a closed pool: before, nothing ever retired it)."""
    monkeypatch.setattr(tp.Pool, "__del__", _pools.Pool.__del__)
    world.retirer.max_failures = 2
    p, ptr = _closed_pool_waiting_for_a_capture(world)
    token = p._retire_token
    repair = _breaking_polls(tp, monkeypatch)
    del p
    with pytest.warns(RuntimeWarning):
        world.retirer.drain()
        world.retirer.drain()  # dropped: the pool is finalized
    assert world.retirer.waiting == 0 and not world.retirer.is_held(token)
    repair()
    del world.status[0x5000]  # the capture ends
    world.retirer.drain()
    assert world.log[-4:] == [("sync", 0), ("legacy_free", ptr, 0), ("sync", 0), ("close_pool",)]
    assert ("free", ptr, 0x5000) not in world.log
    assert world.retirer.held == 0 and world.retirer.pending == 0


def test_a_retired_pools_finalizer_does_not_retire_it_again(world, tp, monkeypatch):
    monkeypatch.setattr(tp.Pool, "__del__", _pools.Pool.__del__)
    p = world.pool()
    _closing(world, p)
    p.close()
    world.retirer.drain()
    assert world.log.count(("close_pool",)) == 1
    retired = []
    monkeypatch.setattr(tp.DevicePool, "_retire_now", lambda self, left=(): retired.append(1))
    del p
    gc.collect()
    world.retirer.drain()
    assert retired == [] and world.log.count(("close_pool",)) == 1


def test_a_guard_quarantine_handed_over_after_the_pool_was_retired_is_freed_first(world):
    """close() marks the pool closed, then hands the guard's quarantine to the retirer
    (a capture is under way: it cannot be checked now).  Another thread's last free in
    between does not retire the pool (close() does, at its end): the quarantined block
    is freed, after a sync, before the CUDA pool is destroyed, not dropped with the
    token."""
    from fakes.guard import FakeOps

    from cupy_poolmem import _guard
    from cupy_poolmem._guard import GuardOptions

    p = world.pool(reuse_cache=0)
    _closing(world, p)
    ops = FakeOps(world)
    g = _guard.attach(p, GuardOptions(red_zone=16, quarantine_blocks=8), ops=ops)
    q = p.malloc(64)
    qptr = q.ptr
    del q  # quarantined
    assert g.stats()["quarantined_blocks"] == 1
    last = [p.malloc(64)]  # held by a worker thread
    mark_closed = p._mark_closed

    def mark_closed_then_switch():
        mark_closed()
        last.clear()  # the worker's last free runs here

    p._mark_closed = mark_closed_then_switch
    ops.underway = True  # a capture elsewhere: the quarantine cannot be checked now
    p.close()
    ops.underway = False
    world.retirer.drain()
    assert world.log[-1] == ("close_pool",)
    i = world.log.index(("close_pool",))
    assert ("legacy_free", qptr, 0) in world.log[:i]  # freed (after a sync) before the pool
    freed = [e for e in world.log if e[0] in ("free", "legacy_free") and e[1] == qptr]
    assert freed == [("legacy_free", qptr, 0)] and world.retirer.n_leftovers_lost == 0


def test_a_closed_pools_graph_memory_held_for_a_capture_is_freed_then_it_is_retired(world):
    p = world.pool()
    _closing(world, p)
    world.status[0x5000] = (1, 7)
    m = p.malloc(KB)  # graph memory of capture 7
    g = m.ptr
    world.status[0x5000] = (1, 8)  # another capture on that stream
    p.close()
    del m
    assert p.n_capture_held == 1 and world.retirer.waiting == 1
    del world.status[0x5000]
    world.retirer.drain()
    assert ("graph_free", g, 0x5000) in world.log  # on its stream, not a leftover
    assert ("legacy_free", g, 0) not in world.log
    assert world.log[-2:] == [("sync", 0), ("close_pool",)]


def test_a_dropped_pool_hands_its_held_frees_to_the_retirer(world, tp):
    p = world.pool(reuse_cache=0)
    _closing(world, p)
    old = p.malloc(KB)
    ptr = old.ptr
    world.status[0x5000] = (1, 7)
    m = p.malloc(KB)  # graph memory
    g = m.ptr
    world.status[0x5000] = (1, 8)
    del m, old  # both held until capture 8 ends
    assert p.n_capture_held == 2
    _pools.Pool.__del__(p)
    assert p.n_capture_held == 0 and world.retirer.waiting == 1  # the graph memory
    assert not world.retirer.drain()  # pool memory: after a sync; graph memory: waits
    assert ("legacy_free", ptr, 0) in world.log and ("graph_free", g, 0x5000) not in world.log
    assert world.log[-1] == ("close_pool",)
    del world.status[0x5000]
    assert world.retirer.drain() and ("graph_free", g, 0x5000) in world.log
    assert ("legacy_free", g, 0) not in world.log


def test_graph_memory_whose_stream_was_finalized_is_left_to_its_graph(world, tp, monkeypatch):
    resurrected: list = []
    asked: list = []
    me = threading.current_thread()

    def capture_status(sptr):
        if threading.current_thread() is me:  # (not the process's retirer, left running)
            asked.append(sptr)
        return 0

    monkeypatch.setattr(_streams, "capture_status", capture_status)

    class Resurrecting(_DyingStream):
        def __del__(self):  # a cupy Stream's finalizer destroys it; this one survives
            resurrected.append(self)

    s = Resurrecting(0x7000, 0)
    cycle = [s]
    cycle.append(cycle)
    del s, cycle
    gc.collect()
    (s,) = resurrected
    assert gc.is_finalized(s)
    live = cupy.cuda.ExternalStream(0x8000, 0)
    frees = tp._capture.GraphFrees(
        [("graph", 0xA, 64, 0x7000, s), ("graph", 0xB, 64, 0x8000, live)], 0
    )
    assert frees()
    assert asked == [0x8000]  # the destroyed stream is never asked about
    assert ("graph_free", 0xA, 0x7000) not in world.log and ("graph_free", 0xB, 0x8000) in world.log


# ---------------------------------------------------------------- the "managed" backend
class _FakeBackend(ManagedAllocator):
    """ManagedPool's "managed" backend, logging instead of calling the driver."""

    def __init__(self, log: list) -> None:
        super().__init__(0)
        self.log, self.ptrs = log, itertools.count(0x900000, 0x10000)

    def alloc(self, size, stream_ptr):
        return 0, next(self.ptrs)

    def free(self, ptr, stream_ptr):
        self.log.append(("backend_free", ptr, stream_ptr))

    def close(self):
        self.log.append(("backend_close",))


def _managed_backend_pool(world, tp):
    backend = _FakeBackend(world.log)
    p = world.pool(tp.ManagedPool, kind=twin.KIND_MANAGED, cuda_pool=False, _backend=backend)
    p.backend = "managed"
    world.retirer._sync = lambda dev: world.log.append(("sync", dev))
    world.retirer._free = lambda ptr, dev: world.log.append(("legacy_free", ptr, dev))
    return p, backend


def test_a_dropped_managed_backend_pool_frees_its_cache_through_the_backend(world, tp):
    p, backend = _managed_backend_pool(world, tp)
    assert world.retirer._held[p._retire_token] is backend
    m = p.malloc(KB)
    ptr = m.ptr
    del m
    assert p.cached_bytes == KB
    n = len(world.log)
    _pools.Pool.__del__(p)
    assert world.log[n:] == [] and world.retirer.pending == 1  # nothing on the stream
    world.retirer.drain()
    # On the legacy stream after a sync, through the backend, which then closes.
    assert world.log[n:] == [("sync", 0), ("backend_free", ptr, 0), ("sync", 0), ("backend_close",)]


def test_a_managed_backend_pool_in_a_garbage_cycle_frees_its_live_block_through_the_backend(
    world, tp
):
    p, backend = _managed_backend_pool(world, tp)
    m = p.malloc(KB)
    ptr = m.ptr
    _pools.Pool.__del__(p)
    _collector_clears(p)  # _backend is None now
    n = len(world.log)
    del m
    assert world.log[n:] == [] and world.retirer.pending == 1
    world.retirer.drain()
    assert world.log[n:] == [("sync", 0), ("backend_free", ptr, 0), ("sync", 0), ("backend_close",)]


def test_an_array_collected_with_its_stream_while_its_pool_lives_never_frees_there(
    world, tp, monkeypatch
):
    """A garbage cycle of an array and its stream (a user object holding both), the
    pool alive (the global allocator's): the stream's finalizer runs first and destroys
    it, so the block goes to the retirer, freed after a sync on the legacy stream; the
    pool stays open and allocates on."""
    monkeypatch.setattr(_DyingStream, "log", world.log, raising=False)
    p = world.pool()
    _closing(world, p)
    world.current = s = _DyingStream(0x6100, 0)
    m = p.malloc(KB)
    ptr = m.ptr
    cycle = [s, m]
    cycle.append(cycle)
    del s, m, cycle
    world.current = cupy.cuda.ExternalStream(0x5000, 0)
    gc.collect()
    dead = world.log.index(("stream_destroyed", 0x6100))
    assert ("free", ptr, 0x6100) not in world.log[dead:]
    assert ("cache", ptr) not in world.log and p.cached_bytes == 0  # not cached for reuse
    assert p.n_frees == p.n_allocs and not p.closed
    world.retirer.drain()
    assert ("legacy_free", ptr, 0) in world.log
    i = world.log.index(("legacy_free", ptr, 0))
    assert world.log[i - 1] == ("sync", 0)  # after a sync
    m2 = p.malloc(KB)  # the pool goes on
    assert m2.ptr
    del m2


# ---------------------------------------------------------------- exported blocks in the cache
class _Exporter:
    """The sharing hooks (``set_shared_release``), recording each call; ``keep`` says
    which records the exporter keeps (receivers map them still), ``raises`` which fail."""

    def __init__(self, request, keep=(), raises=()) -> None:
        self.calls: list[tuple] = []
        self.keep, self.raises = set(keep), set(raises)
        sharing_hooks(request, twin, release=self.release, retire=self.retire)

    def release(self, core, ptr, size, stream, share):
        self.calls.append(("release", core, ptr, size, stream, share))
        return False

    def retire(self, core, ptr, size, stream, share):
        self.calls.append(("retire", core, ptr, size, stream, share))
        if share in self.raises:
            raise RuntimeError("the exporter failed")
        return share in self.keep


def test_an_exported_block_returns_to_the_cache_with_its_record(world, monkeypatch, request):
    """_cache_shared keeps an exported block whatever cache_max_block says (within
    cache_limit); the next allocation of that size on that stream is a block that
    carries the record, with no driver call; other blocks carry none."""
    hooks = _Exporter(request)
    p = world.pool(reuse_cache=64 * KB)
    p.cache_max_block = KB  # for blocks never exported
    rec, s = object(), world.current
    assert p._cache_shared(0x9000, 8 * KB, s.ptr, s, rec)
    assert p.cached_bytes == 8 * KB
    assert not p._cache_shared(0xA000, 64 * KB, s.ptr, s, object())  # over cache_limit
    n = len(world.log)
    m = p.malloc(8 * KB)
    blk = m.mem._owner
    assert (m.ptr, blk.share) == (0x9000, rec) and world.log[n:] == []
    other = p.malloc(KB)
    assert other.mem._owner.share is None
    del m, blk
    assert hooks.calls == [("release", p, 0x9000, 8 * KB, s, rec)]  # the pool handed over
    p.close()
    assert not p._cache_shared(0x9000, 8 * KB, s.ptr, s, rec)  # a closed pool refuses
    del other


def test_a_finalized_pool_refuses_exported_blocks(world):
    p = world.pool()
    p._mark_finalized()
    assert not p._cache_shared(0x9000, KB, 0x5000, world.current, object())


def test_flush_gives_exported_blocks_to_their_exporter(world, monkeypatch, request):
    """trim/close/OOM: an exported cached block's final free is its exporter's (kept
    while receivers map it); one it lets go is freed on its stream; a failing hook
    keeps the block (leaked, never freed while another process may map it)."""
    kept, freed, broken = object(), object(), object()
    hooks = _Exporter(request, keep=[kept], raises=[broken])
    p = world.pool()
    s = world.current
    plain = p.malloc(KB)
    pptr = plain.ptr
    del plain
    for ptr, share in ((0x9000, kept), (0xA000, freed), (0xB000, broken)):
        assert p._cache_shared(ptr, 2 * KB, s.ptr, s, share)
    n = len(world.log)
    assert p.flush_cache() == 7 * KB and p.cached_bytes == 0
    frees = sorted(e[1] for e in world.log[n:] if e[0] == "free")
    assert frees == sorted([pptr, 0xA000])
    assert sorted(c[2] for c in hooks.calls) == [0x9000, 0xA000, 0xB000]
    assert all(c[0] == "retire" and c[1] is p and c[4] is s for c in hooks.calls)
    assert p.n_free_errors == 1


def test_a_dropped_pool_gives_its_exported_cached_blocks_to_the_exporter_streamless(
    world, tp, monkeypatch, request
):
    """Pool.__del__: the exporter gets each exported cached block without its stream
    (None: nothing of a finalized pool touches a stream); what it lets go goes to the
    retirer with the rest of the cache; what it keeps (receivers map it) does not."""
    kept, freed = object(), object()
    hooks = _Exporter(request, keep=[kept])
    p = world.pool()
    _closing(world, p)
    s = world.current
    plain = p.malloc(KB)
    pptr = plain.ptr
    del plain
    assert p._cache_shared(0x9000, 2 * KB, s.ptr, s, kept)
    assert p._cache_shared(0xA000, 2 * KB, s.ptr, s, freed)
    n = len(world.log)
    _pools.Pool.__del__(p)
    assert world.log[n:] == []  # nothing on any stream
    assert sorted((c[0], c[2], c[4]) for c in hooks.calls) == [
        ("retire", 0x9000, None),
        ("retire", 0xA000, None),
    ]
    world.retirer.drain()
    legacy = sorted(e[1] for e in world.log[n:] if e[0] == "legacy_free")
    assert legacy == sorted([pptr, 0xA000])  # never the block receivers still map


@pytest.mark.parametrize("exporter_keeps", [True, False])
def test_a_reused_exported_block_freed_after_its_pool_was_finalized(
    world, tp, monkeypatch, exporter_keeps, request
):
    """A block made of an exported cached one, freed after its pool's finalizer ran (a
    garbage cycle): its exporter gets it first, without its stream; only a block the
    exporter lets go is an orphan for the retirer."""
    rec = object()
    hooks = _Exporter(request, keep=[rec] if exporter_keeps else [])
    p = world.pool()
    _closing(world, p)
    s = world.current
    assert p._cache_shared(0x9000, 2 * KB, s.ptr, s, rec)
    m = p.malloc(2 * KB)
    _pools.Pool.__del__(p)
    _collector_clears(p)
    n = len(world.log)
    del m
    assert hooks.calls == [("retire", p, 0x9000, 2 * KB, None, rec)]
    assert world.log[n:] == [] and p.n_free_errors == 0
    world.retirer.drain()
    legacy = [e[1] for e in world.log[n:] if e[0] == "legacy_free"]
    assert legacy == ([] if exporter_keeps else [0x9000])


def test_pending_and_waiting_count_what_a_drain_is_working_on(fake_retirer):
    """A caller waiting until ``pending`` and ``waiting`` are 0 (a test, a shutdown) must
    not see 0 while a drain is still freeing a pool's leftovers and closing it, or
    calling a pool's poll: the batch and the polls are counted until they are done."""
    seen = {}

    class Slow:
        def __init__(self) -> None:
            self.closed = False

        def free_leftover(self, ptr: int) -> None:
            seen["leftover"] = (fake_retirer.pending, fake_retirer.waiting)

        def close(self) -> None:
            seen["close"] = (fake_retirer.pending, fake_retirer.waiting)
            self.closed = True

    def poll() -> bool:
        seen["poll"] = fake_retirer.waiting
        return True

    res = Slow()
    token = fake_retirer.adopt(res)
    fake_retirer.add_leftovers(token, 0, (0x100,))
    fake_retirer.retire(token, 0)
    fake_retirer.after_captures(poll)
    assert (fake_retirer.pending, fake_retirer.waiting) == (1, 1)
    assert fake_retirer.drain()
    assert seen == {"poll": 1, "leftover": (1, 0), "close": (1, 0)}
    assert res.closed and (fake_retirer.pending, fake_retirer.waiting) == (0, 0)


# ---------------------------------------------------------------- recycling
def test_a_recyclable_resource_is_parked_without_a_sync_and_goes_to_the_next_pool_of_its_key(
    fake_retirer,
):
    log = fake_retirer.log.events
    parked = []
    r1 = Resource(log, "r1")
    fake_retirer.retire(fake_retirer.adopt(r1, ("dev", 0), parked.append), 0)
    assert fake_retirer.pending == 1  # until a drain parks it
    assert fake_retirer.take_recycled(("dev", 0)) is None
    assert fake_retirer.drain()
    assert log == [] and parked == [r1] and fake_retirer.pending == 0  # no sync, no close
    assert fake_retirer.recycled == 1 and fake_retirer.n_parked == 1
    assert fake_retirer.take_recycled(("dev", 1)) is None  # another key
    assert fake_retirer.take_recycled(("dev", 0)) is r1
    assert fake_retirer.take_recycled(("dev", 0)) is None and fake_retirer.recycled == 0
    # adopted again by the new pool, and parked again when that one is drained
    fake_retirer.retire(fake_retirer.adopt(r1, ("dev", 0), parked.append), 0)
    assert fake_retirer.drain() and parked == [r1, r1] and log == []


def test_parking_goes_on_while_a_capture_is_under_way(fake_retirer):
    """A sync would invalidate the capture, a park does not need one."""
    log = fake_retirer.log.events
    fake_retirer.retire(fake_retirer.adopt(Resource(log, "plain"), "k", lambda r: None), 0)
    fake_retirer.retire(fake_retirer.adopt(Resource(log, "other")), 0)
    fake_retirer.log.capturing = True
    assert not fake_retirer.drain()  # the other one waits for the capture
    assert fake_retirer.recycled == 1 and log == [] and fake_retirer.pending == 1
    fake_retirer.log.capturing = False
    assert fake_retirer.drain() and log == [("sync", 0), ("close", "other")]


def test_at_most_max_recycled_wait_per_key_the_next_is_destroyed(fake_retirer):
    log = fake_retirer.log.events
    fake_retirer.max_recycled = 2
    tokens = [fake_retirer.adopt(Resource(log, f"r{i}"), "k", lambda r: None) for i in range(3)]
    for t in tokens:
        fake_retirer.retire(t, 0)
    assert fake_retirer.drain()
    assert fake_retirer.recycled == 2 and log == [("sync", 0), ("close", "r2")]


@pytest.mark.parametrize("when", ["before", "with"])
def test_a_recyclable_pool_with_leftovers_is_destroyed_after_a_sync(fake_retirer, when):
    """Its leftovers are freed on the legacy stream after a sync: the pool goes the
    usual way (never parked with blocks of its last owner still to free)."""
    log = fake_retirer.log.events
    parked = []
    token = fake_retirer.adopt(Resource(log, "r"), "k", parked.append)
    if when == "before":
        fake_retirer.add_leftovers(token, 0, [0xA])
        fake_retirer.retire(token, 0)
    else:
        fake_retirer.retire(token, 0, [0xA])
    assert fake_retirer.drain()
    assert parked == [] and fake_retirer.recycled == 0
    assert log == [("sync", 0), ("free", 0xA, 0), ("sync", 0), ("close", "r")]


def test_a_park_that_fails_destroys_the_resource_after_a_sync(fake_retirer):
    log = fake_retirer.log.events

    def park(r):
        raise RuntimeError("cuMemPoolTrimTo failed: CUDA_ERROR_INVALID_VALUE")

    fake_retirer.retire(fake_retirer.adopt(Resource(log, "r"), "k", park), 0)
    fake_retirer.drain()
    assert fake_retirer.recycled == 0 and fake_retirer.n_park_errors == 1
    assert log == [("sync", 0), ("close", "r")] and fake_retirer.pending == 0


def test_parks_run_in_relaxed_capture_mode():
    """Another thread's global-mode capture forbids this thread's pool calls (a trim)
    unless it is in relaxed mode."""
    log: list = []

    @contextlib.contextmanager
    def relaxed():
        log.append("relaxed")
        yield
        log.append("restored")

    r = _retire.Retirer(
        lambda dev: None, lambda: False, lambda: [0], background=False, relaxed=relaxed
    )
    r.retire(r.adopt(Resource(log), "k", lambda res: log.append("park")), 0)
    assert r.drain() and log == ["relaxed", "park", "restored"]
    monkey = _retire.PROCESS.install(None)
    try:
        assert _retire.retirer()._relaxed is _retire._relaxed_capture_mode
    finally:
        _retire.PROCESS.install(monkey)


def test_a_fork_child_never_parks_or_hands_out_the_parents_resources(fake_retirer):
    log = fake_retirer.log.events
    parked = []
    a = fake_retirer.adopt(Resource(log, "a"), "k", parked.append)
    b = fake_retirer.adopt(Resource(log, "b"), "k", parked.append)
    fake_retirer.retire(a, 0)
    fake_retirer.drain()
    fake_retirer.retire(b, 0)  # parking, not parked yet
    fake_retirer._after_fork_in_child()
    assert fake_retirer.take_recycled("k") is None and fake_retirer.drain()
    assert len(parked) == 1 and log == [] and len(fake_retirer._kept) == 2


def test_the_background_thread_parks_and_then_stops():
    parked = threading.Event()
    r = _retire.Retirer(lambda dev: None, lambda: False, lambda: [0], delay=0.01)
    r.retire(r.adopt(Resource([]), "k", lambda res: parked.set()), 0)
    assert parked.wait(5)
    deadline = time.monotonic() + 5
    while r._thread is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r._thread is None and r.recycled == 1 and r.pending == 0


def test_a_pool_retired_while_a_drain_frees_its_leftovers_is_not_parked(fake_retirer):
    """Its last free lands while the drain that frees its leftovers syncs: parking it
    then could hand it to a new pool with its last owner's blocks not freed yet."""
    log = fake_retirer.log.events
    parked: list = []
    token = fake_retirer.adopt(Resource(log, "r"), "k", parked.append)
    fake_retirer.add_leftovers(token, 0, [0xA])
    sync = fake_retirer._sync

    def sync_then_last_free(dev):
        sync(dev)
        if log.count(("sync", 0)) == 1:  # another thread's last free, meanwhile
            assert fake_retirer.retire(token, 0) is False

    fake_retirer._sync = sync_then_last_free
    fake_retirer.drain()
    fake_retirer.drain()
    assert parked == [] and fake_retirer.recycled == 0
    assert log == [("sync", 0), ("free", 0xA, 0), ("sync", 0), ("sync", 0), ("close", "r")]


def test_parked_resources_are_capped_over_every_key(fake_retirer):
    log = fake_retirer.log.events
    fake_retirer.max_recycled_total = 3
    for i in range(5):
        fake_retirer.retire(fake_retirer.adopt(Resource(log, f"r{i}"), ("k", i), lambda r: None), 0)
    assert fake_retirer.drain()
    assert fake_retirer.recycled == 3 and log == [("sync", 0), ("close", "r3"), ("close", "r4")]


def test_a_park_under_way_counts_as_pending_and_against_the_cap(fake_retirer):
    seen = []
    log = fake_retirer.log.events
    fake_retirer.max_recycled = 1
    later = fake_retirer.adopt(Resource(log, "later"), "k", lambda r: None)

    def park(res):
        seen.append(fake_retirer.pending)
        # another pool of the key retired while this one is being parked: no room
        seen.append(fake_retirer.will_park(later))
        seen.append(fake_retirer.retire(later, 0))

    fake_retirer.retire(fake_retirer.adopt(Resource([], "first"), "k", park), 0)
    fake_retirer.drain()
    assert seen == [1, False, False] and fake_retirer.recycled == 1
    # "later" was destroyed the usual way, after a sync, in the same drain
    assert fake_retirer.pending == 0 and log == [("sync", 0), ("close", "later")]


def test_a_pool_retired_while_the_interpreter_finalizes_lets_the_process_exit():
    """A pool only a reference cycle holds (a half-built one in a traceback, say) is
    collected while the interpreter finalizes; retiring it there must not start the
    retirer's thread, which can no longer run (Python 3.11 then waits for it forever)."""
    code = (
        "import gc\n"
        "from cupy_poolmem import _retire as R\n"
        "class Res:\n"
        "    def close(self): pass\n"
        "class Pool:\n"
        "    def __del__(self):\n"
        "        self.r.retire(self.token, 0)\n"
        "        print('retired', self.r._thread is None, flush=True)\n"
        "gc.disable()\n"
        "p = Pool()\n"
        "p.r = R.retirer()\n"
        "p.token = p.r.adopt(Res())\n"
        "p.cycle = p\n"
        "del p\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "-c", code], env=env, timeout=30, capture_output=True)
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    assert run.stdout.decode().split() == ["retired", "True"]  # collected at exit, no thread
