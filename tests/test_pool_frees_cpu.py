"""The hot path's free against dead streams, empty blocks and a concurrent close().

They drive the pure-Python hot path (the twin) against tests/fakes/hotpath.World and the
fake retirer, with real garbage collections where the order is the garbage collector's;
the last test checks that the compiled hot path takes the same branches.
"""

from __future__ import annotations

import gc
import threading

import cupy
import pytest
from fakes.guard import FakeOps

from cupy_poolmem import _guard, _streams
from cupy_poolmem import _hotpath_py as twin
from cupy_poolmem._guard import GuardOptions

pytestmark = [
    pytest.mark.filterwarnings("ignore:ExternalStream is deprecated"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

KB = 4096
S = 0x5000


@pytest.fixture
def world(monkeypatch, fake_retirer, twin_world):
    waits: list = []
    monkeypatch.setattr(
        _streams,
        "wait_streams",
        lambda target, dev, sources: waits.append(
            (target, [(e[0], gc.is_finalized(e[2])) for e in sources])
        ),
    )
    w = twin_world
    w.waits = waits
    w.retirer = fake_retirer
    fake_retirer._sync = lambda dev: w.log.append(("sync", dev))
    fake_retirer._free = lambda ptr, dev: w.log.append(("legacy_free", ptr, dev))
    return w


def _closing(world, p):
    p._mr.close = lambda: world.log.append(("close_pool",))


class _DyingStream(cupy.cuda.ExternalStream):
    """A stream whose finalizer 'destroys' it, as cupy's Stream.__del__ does."""

    log: list = []

    def __del__(self):
        _DyingStream.log.append(("stream_destroyed", self.ptr))


def test_a_size_zero_allocation_does_not_keep_a_closed_pool_from_being_retired(world):
    """malloc(0) counts an allocation; its free is counted too (nothing to free), so a
    pool that served an empty array (cupy.empty((0, 5))) is still retired."""
    p = world.pool()
    _closing(world, p)
    z = p.malloc(0)
    del z
    assert p.n_allocs == 1 and p.n_frees == 1
    p.close()
    world.retirer.drain()
    assert world.retirer.held == 0 and ("close_pool",) in world.log


def test_a_recorded_stream_finalized_in_the_same_garbage_is_never_waited_on(world, monkeypatch):
    """record_stream keeps the other stream alive only through the block: in a garbage
    cycle that stream's finalizer (cupy destroys the CUstream) runs before the block is
    freed.  The block then goes to the retirer (freed after a sync on every device, on
    the legacy stream); nothing waits on the dead stream."""
    monkeypatch.setattr(_DyingStream, "log", world.log)
    p = world.pool()
    s2 = _DyingStream(0x6200, 0)  # created first: finalized before the block
    m = p.malloc(KB)
    ptr = m.ptr
    m.mem._owner._record((0x6200, 0, s2))  # what record_stream(x, s2) stores
    del s2  # the user keeps only the array
    holder = [m]
    holder.append(holder)
    del m, holder
    gc.collect()
    assert ("stream_destroyed", 0x6200) in world.log
    assert world.waits == []  # no event recorded on the destroyed stream
    assert ("free", ptr, S) not in world.log
    world.retirer.drain()
    assert ("legacy_free", ptr, 0) in world.log


def test_close_in_another_thread_never_retires_the_pool_before_an_in_flight_free(world):
    """A free in flight in a worker thread (the guard's red-zone check releases the GIL
    between counting and queueing it) while the main thread closes the pool: the pool is
    retired only once that free is queued, so the destroy comes after it."""
    p = world.pool(reuse_cache=0)
    _closing(world, p)
    ops = FakeOps(world)
    _guard.attach(p, GuardOptions(red_zone=16, quarantine_blocks=8), ops=ops)
    entered, go = threading.Event(), threading.Event()
    find = ops.find

    def slow_find(*a):  # the red-zone check: a stream synchronise, GIL released
        entered.set()
        go.wait(5)
        return find(*a)

    ops.find = slow_find
    m = p.malloc(64)
    holder = [m]
    del m
    t = threading.Thread(target=holder.clear)  # a worker thread drops the last array
    t.start()
    assert entered.wait(5)
    p.close()  # the main thread closes the pool meanwhile
    assert world.retirer.pending == 0  # not retired: a free is still on its way
    go.set()
    t.join(5)
    world.retirer.drain()
    events = [e[0] for e in world.log if e[0] in ("free", "close_pool")]
    assert "close_pool" in events and events.index("close_pool") == len(events) - 1


def test_the_compiled_hot_path_sends_blocks_of_finalized_streams_to_the_retirer():
    """The .pyx free takes the same branch as the twin (there is no GPU here: the
    compiled module is read, not run): both test the pool's finalized flag, the
    block's own stream and its recorded streams before touching any stream."""
    import pathlib

    src = pathlib.Path(twin.__file__).with_name("_hotpath.pyx").read_text()
    dealloc = src[src.index("    def __dealloc__(self):") : src.index("cdef bint _any_finalized")]
    assert "core.finalized or PyObject_GC_IsFinalized(self.stream)" in dealloc
    assert "_any_finalized(self._recorded)" in dealloc
    assert dealloc.index("_any_finalized") < dealloc.index("core._wait_recorded")
    assert dealloc.rindex("core.n_frees += 1") > dealloc.index("core._release(")
    assert (
        "if self.ptr == 0:" in dealloc
        and "n_frees += 1" in dealloc.split("if self.ptr == 0:")[1][:80]
    )
