"""CPU tests of cross-stream frees (record_stream) and graph capture, against a fake driver.

The pools' logic runs for real (the pure-Python hot path and the pools' slow paths);
only the driver is played by ``tests/fakes/hotpath.World``.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from types import SimpleNamespace

import cupy
import numpy as np
import pytest
from cupy.cuda.memory import MemoryPointer, UnownedMemory
from fakes.driver import PassThrough
from fakes.hotpath import World, sharing_hooks, twin_pools
from support.gc_locks import GcUnderLock

import cupy_poolmem as cpm
from cupy_poolmem import _device, _runtime, _streams
from cupy_poolmem import _hotpath_py as twin

pytestmark = pytest.mark.filterwarnings("ignore:ExternalStream is deprecated")

S = 0x5000  # the capture stream of these tests
KB = 4096


@pytest.fixture(scope="module")
def tp():
    return twin_pools()


@pytest.fixture
def world(monkeypatch, fake_driver, tp):
    monkeypatch.setattr(_runtime, "hp", twin)  # record_stream looks blocks up there
    # Blocks here carry made-up stream handles: one freed after the fakes are undone
    # would reach the real driver (on a GPU machine, with an invalid stream).
    monkeypatch.setattr(_streams, "wait_streams", lambda *a: None)
    yield World(monkeypatch, tp, fake_driver)
    gc.collect()  # free what the test left in cycles while the fakes are still in place


def _frees(world, kind="free"):
    return [e[1] for e in world.log if e[0] == kind]


# ---------------------------------------------------------------- graph capture
def test_capture_never_takes_from_or_feeds_the_reuse_cache(world):
    p = world.pool()
    m = p.malloc(KB)
    warm = m.ptr
    del m  # the warm-up's block waits in the reuse cache
    assert p.cached_bytes == KB
    world.status[S] = (1, 7)  # s.begin_capture()
    m = p.malloc(KB)
    g = m.ptr
    assert g != warm and world.log[-1][0] == "pool_alloc"  # an allocation node
    assert p.cached_bytes == KB
    st = p.stats()
    assert st.graph_bytes == KB and st.used_bytes == KB and p.n_graph_allocs == 1
    del m  # freed inside the capture: a free node on the capture stream
    assert world.log[-1] == ("graph_free", g, S)
    assert p.cached_bytes == KB  # graph memory never enters the cache
    assert p.stats().graph_bytes == 0 and p.stats().used_bytes == 0
    del world.status[S]  # s.end_capture()
    m = p.malloc(KB)
    assert m.ptr == warm  # the cache serves plain allocations again


def test_legacy_stream_is_never_asked_about_capture(world):
    p = world.pool()
    world.current = cupy.cuda.ExternalStream(0, 0)
    m = p.malloc(KB)
    del m
    p.malloc(KB)
    assert world.queried == []
    world.current = cupy.cuda.ExternalStream(S, 0)
    p.malloc(8)
    assert world.queried == [S]


def test_free_of_a_block_from_before_the_capture_waits_for_its_end(world):
    p = world.pool(reuse_cache=0)
    m = p.malloc(1 << 20)
    old = m.ptr
    world.status[S] = (1, 7)
    del m  # a driver free now would be a free node of non-graph memory
    assert old not in _frees(world) and p.n_capture_held == 1
    assert p._capture_held[0][4] is world.current  # the stream object is kept with it
    keep = p.malloc(64)  # allocations in the capture do not release it
    assert old not in _frees(world)
    del world.status[S]
    p.malloc(128)  # the next driver allocation drains what was held
    assert old in _frees(world) and p.n_capture_held == 0
    del keep


def test_graph_memory_after_the_capture_in_another_capture_and_invalidated(world):
    p = world.pool()
    world.status[S] = (1, 7)
    m = p.malloc(256)
    g = m.ptr
    del world.status[S]
    del m  # a survivor dropped after the capture (after a launch): freed outside it
    assert ("graph_free", g, S) in world.log
    world.status[S] = (1, 7)
    m = p.malloc(256)
    g2 = m.ptr
    world.status[S] = (1, 8)  # a new capture on the same stream
    del m
    assert ("graph_free", g2, S) not in world.log and p.n_capture_held == 1
    p.stats()
    assert p.n_capture_held == 1  # still capturing: still held
    del world.status[S]
    p.stats()
    assert ("graph_free", g2, S) in world.log and p.n_capture_held == 0
    world.status[S] = (1, 9)
    m = p.malloc(64)
    g3 = m.ptr
    world.status[S] = (2, 0)  # invalidated: the graph is discarded with its memory
    del m
    assert ("graph_free", g3, S) not in world.log and p.n_capture_held == 0
    assert p.stats().graph_bytes == 0 and p.stats().used_bytes == 0


def test_ipc_pool_captures_through_the_devices_pool_then_a_template(world, monkeypatch):
    p = world.pool(ipc=True)
    world.status[S] = (1, 7)
    m = p.malloc(KB)
    assert world.log[-1][0] == "async_alloc" and world.log[-1][1] == m.ptr
    world.graph_errors = [801]  # the device's current pool is IPC-enabled too
    monkeypatch.setattr(world.tp._capture, "graph_template", lambda dev: "TEMPLATE")
    m2 = p.malloc(KB)
    assert world.log[-1][0] == "pool_alloc" and world.log[-1][4] == "TEMPLATE"
    assert m2.ptr != m.ptr


def test_out_of_memory_during_a_capture_trims_without_synchronising(world):
    p = world.pool()
    world.status[S] = (1, 7)
    world.graph_errors = [2, 2]
    with pytest.raises(cpm.OutOfPoolMemoryError, match="CUDA graph"):
        p.malloc(KB)
    assert ("trim", 0) in world.log and ("sync",) not in world.log
    world.graph_errors = [2]
    m = p.malloc(KB)  # a retry that works
    assert m.ptr and p.n_oom == 2


def test_pinned_and_managed_pools_refuse_allocations_in_a_capture(world, tp):
    pinned = world.pool(tp.PinnedPool, kind=twin.KIND_PINNED, numa_node=0)
    managed = world.pool(kind=twin.KIND_MANAGED)
    world.status[S] = (1, 7)
    with pytest.raises(cpm.UnsupportedError, match="pinned host memory cannot"):
        pinned.malloc(64)
    with pytest.raises(cpm.UnsupportedError, match="managed memory cannot"):
        managed.malloc(64)
    assert pinned.malloc(0).ptr == 0  # size 0 needs no memory


def test_capture_query_failures_are_driver_errors(world, monkeypatch):
    p = world.pool()
    world.status[S] = (2, 0)
    with pytest.raises(cpm.CUDADriverError, match="STREAM_CAPTURE_INVALIDATED"):
        p.malloc(KB)
    monkeypatch.setattr(twin.driver, "is_capturing", lambda s: (1, 0))
    with pytest.raises(cpm.CUDADriverError, match="CUDA_ERROR_INVALID_VALUE"):
        p.malloc(KB)


def test_free_refused_because_of_a_capture_is_retried_after_it(world, monkeypatch):
    """The legacy stream during a blocking stream's capture: CUDA_ERROR_STREAM_CAPTURE_IMPLICIT."""
    p = world.pool(reuse_cache=0)
    world.current = cupy.cuda.ExternalStream(0, 0)
    m = p.malloc(KB)
    ptr = m.ptr
    refusals = [906]
    monkeypatch.setattr(
        twin.driver, "free", lambda pt, s: (refusals.pop(),) if refusals else world._free(pt, s)
    )
    monkeypatch.setattr(_streams, "any_capture_underway", lambda: False)
    del m
    assert p.n_capture_held == 1 and p.n_free_errors == 0
    p.stats()
    assert ("free", ptr, 0) in world.log and p.n_capture_held == 0


# ---------------------------------------------------------------- record_stream
def _array(mem: MemoryPointer, n: int = KB // 8) -> cupy.ndarray:
    return cupy.ndarray((n,), dtype=np.float64, memptr=mem)


def test_record_stream_orders_the_free_before_every_other_path(world, monkeypatch, request):
    p = world.pool()
    m = p.malloc(KB)
    arr = _array(m)
    blk = m.mem._owner
    other = cupy.cuda.ExternalStream(0x6000, 0)
    cpm.record_stream(arr[::2], other)  # a view records for the whole block
    cpm.record_stream(arr, other)  # twice: once
    cpm.record_stream(arr, world.current)  # the allocation stream: nothing to wait for
    assert blk.recorded_streams == (other,) and blk.flags & twin.FLAG_RECORDED
    order: list = []
    monkeypatch.setattr(
        _streams,
        "wait_streams",
        lambda tptr, tdev, src: order.append(("wait", tptr, tdev, [e[0] for e in src])),
    )
    p.observer = type(
        "Obs", (), {"on_free": lambda self, *a: order.append("observer"), "on_alloc": print}
    )()
    sharing_hooks(request, twin, release=lambda *a: order.append("shared") or False)
    blk.share = object()
    p.release_hook = lambda ptr, size, stream: order.append("hook") or False
    del arr, m, blk
    assert order == [("wait", S, 0, [0x6000]), "observer", "shared", "hook"]
    assert p.cached_bytes == KB  # then the usual path: the reuse cache


def test_block_wait_recorded_for_the_sharing_protocol(world, monkeypatch):
    p = world.pool()
    m = p.malloc(KB)
    blk = m.mem._owner
    calls: list = []
    monkeypatch.setattr(_streams, "wait_streams", lambda *a: calls.append(a))
    blk.wait_recorded(cupy.cuda.ExternalStream(0x7000, 0))
    assert calls == []  # nothing recorded: nothing to wait for
    cpm.record_stream(_array(m), cupy.cuda.ExternalStream(0x6000, 0))
    blk.wait_recorded(cupy.cuda.ExternalStream(0x7000, 0))
    assert calls[0][:2] == (0x7000, 0) and calls[0][2][0][0] == 0x6000


def test_record_stream_takes_pinned_numpy_arrays(world, tp):
    pinned = world.pool(tp.PinnedPool, kind=twin.KIND_PINNED, numa_node=0)
    world.current = cupy.cuda.ExternalStream(S, 0)
    m = pinned.malloc(KB)

    class Buf(bytearray):  # stands in for the PinnedMemoryPointer numpy keeps as base
        pass

    buf = Buf(KB)
    buf.mem = m.mem
    h = np.ndarray((KB,), dtype=np.uint8, buffer=buf)[10:20]  # as cupyx.empty_pinned does
    other = cupy.cuda.ExternalStream(0x6000, 0)
    cpm.record_stream(h, other)
    assert m.mem.recorded_streams == (other,)
    cpm.record_stream(np.frombuffer(buf, dtype=np.uint8), cupy.cuda.ExternalStream(0x6100, 0))
    assert len(m.mem.recorded_streams) == 2


def test_record_stream_bad_input(world):
    p = world.pool()
    arr = _array(p.malloc(KB))
    s = cupy.cuda.ExternalStream(0x6000, 0)
    with pytest.raises(cpm.OptionTypeError, match="stream must be"):
        cpm.record_stream(arr, "s1")
    with pytest.raises(cpm.OptionTypeError, match="ExternalStream"):
        cpm.record_stream(arr, 0x6000)
    with pytest.raises(cpm.OptionTypeError, match="list"):
        cpm.record_stream([1, 2], s)
    with pytest.raises(cpm.InvalidOptionError, match="not on pinned memory"):
        cpm.record_stream(np.ones(4), s)
    foreign = cupy.ndarray((4,), np.float64, MemoryPointer(UnownedMemory(0x9000, 32, s, 0), 0))
    with pytest.raises(cpm.InvalidOptionError, match="not on memory from a cupy_poolmem pool"):
        cpm.record_stream(foreign, s)
    with pytest.raises(cpm.OptionTypeError):
        cpm.record_stream(np.ones(0), "not a stream")  # empty: still a stream check
    cpm.record_stream(np.ones(0), s)  # and nothing else


def test_stream_protocol_objects_are_streams():
    class CoreStream:  # what a cuda.core Stream offers
        device = type("D", (), {"device_id": 1})()

        def __cuda_stream__(self):
            return (0, 0x4242)

    s = CoreStream()
    assert _streams.as_stream(s) == (0x4242, 1, s)
    e = cupy.cuda.ExternalStream(0x77, 0)
    assert _streams.as_stream(e) == (0x77, 0, e)
    null = cupy.cuda.ExternalStream(0, -1)
    assert _streams.as_stream(null, device=3) == (0, 3, null)


def test_wait_streams_records_one_event_per_other_stream(monkeypatch, fake_driver):
    calls: list = []
    entered: list = []

    class Drv(PassThrough):
        class CUevent_flags:  # noqa: N801
            CU_EVENT_DISABLE_TIMING = 2

        def __init__(self):
            self.n = 0

        def cuEventCreate(self, flags):  # noqa: N802
            self.n += 1
            calls.append(("create", flags))
            return 0, f"ev{self.n}"

        def cuEventRecord(self, ev, s):  # noqa: N802
            calls.append(("record", ev, s))
            return (0,)

        def cuStreamWaitEvent(self, s, ev, flags):  # noqa: N802
            calls.append(("wait", s, ev))
            return (0,)

        def cuEventDestroy(self, ev):  # noqa: N802
            calls.append(("destroy", ev))
            return (0,)

    fake_driver(Drv())

    me = threading.current_thread()

    @contextlib.contextmanager
    def on_device(dev):
        if threading.current_thread() is me:  # (not the process's retirer, left running)
            entered.append(dev)
        yield

    monkeypatch.setattr(_device, "on_device", on_device)
    _streams.wait_streams(0x5000, 0, [(0x6000, 0, None), (0x5000, 0, None), (0x7000, 1, None)])
    assert calls == [
        ("create", 2),
        ("record", "ev1", 0x6000),
        ("wait", 0x5000, "ev1"),
        ("destroy", "ev1"),
        ("create", 2),
        ("record", "ev2", 0x7000),
        ("wait", 0x5000, "ev2"),
        ("destroy", "ev2"),
    ]
    assert entered == [0, 1, 0]  # each event on its stream's device, the wait on the target's


# ---------------------------------------------------------------- out of memory
def test_oom_collects_limbo_trims_and_retries_once(world, monkeypatch):
    p = world.pool(reuse_cache=0)
    world.current = cupy.cuda.ExternalStream(0, 0)
    collected: list = []
    monkeypatch.setattr(world.tp._base._runtime.HOOKS, "oom", [lambda: collected.append(1)])
    attempts = iter([(2, 0), (2, 0)])
    monkeypatch.setattr(twin.driver, "alloc", lambda size, pool, s: next(attempts))
    with pytest.raises(cpm.OutOfPoolMemoryError) as ei:
        p.malloc(KB)
    assert collected == [1] and ("trim", 0) in world.log and ("sync",) in world.log
    assert "after garbage collection" in str(ei.value) and p.n_oom == 1
    attempts = iter([(2, 0), (0, 0x777000)])
    monkeypatch.setattr(twin.driver, "alloc", lambda size, pool, s: next(attempts))
    assert p.malloc(KB).ptr == 0x777000 and collected == [1, 1]


def test_oom_beyond_the_device_says_so_without_reclaiming(world, monkeypatch):
    p = world.pool()
    p._capacity = 80 << 30
    world.current = cupy.cuda.ExternalStream(0, 0)
    collected: list = []
    monkeypatch.setattr(world.tp._base._runtime.HOOKS, "oom", [lambda: collected.append(1)])
    monkeypatch.setattr(twin.driver, "alloc", lambda size, pool, s: (1, 0))  # INVALID_VALUE
    with pytest.raises(cpm.OutOfPoolMemoryError, match="more than the 80.00 GiB") as ei:
        p.malloc(1 << 50)
    assert collected == [] and ("trim", 0) not in world.log
    assert isinstance(ei.value, cupy.cuda.memory.OutOfMemoryError)


# ---------------------------------------------------------------- garbage collections under locks
def _garbage_block(p) -> int:
    """A block of ``p`` that only cyclic garbage references (freed at the next gc)."""
    gc.collect()
    m = p.malloc(KB)
    cycle = [m]
    cycle.append(cycle)
    return m.ptr


def test_a_gc_under_the_capture_registry_lock_may_free_a_block_on_a_capturing_stream(
    world, monkeypatch
):
    """any_capture_underway() copies the registry under its lock (the retirer asks
    at every drain); a collection started there frees a block on a capturing stream,
    whose held free notes the capture: the same lock, the same thread."""
    p = world.pool(reuse_cache=0)
    ptr = _garbage_block(p)
    world.status[S] = (1, 7)
    _streams.CAPTURES.streams[S] = world.current
    lock = GcUnderLock(_streams.CAPTURES.lock)
    monkeypatch.setattr(_streams.CAPTURES, "lock", lock)
    assert _streams.any_capture_underway()
    assert not lock.deadlocked and lock.nested == 1
    assert p.n_capture_held == 1 and ptr not in _frees(world)  # held for the capture
    del world.status[S]
    p._drain_capture_held()
    assert _frees(world).count(ptr) == 1


def test_a_gc_under_the_pool_lock_may_free_a_block_on_a_capturing_stream(world):
    """_hold_free appends under Pool._lock (a tuple: a collection may start there); a
    garbage block of the same pool freed in it on the capturing stream holds its free
    too, under the same lock: both frees are held, each done once after the capture."""
    p = world.pool(reuse_cache=0)
    g = _garbage_block(p)
    trigger = [p.malloc(KB)]
    t = trigger[0].ptr
    world.status[S] = (1, 7)  # the blocks' stream begins a capture
    p._lock = lock = GcUnderLock(p._lock)
    trigger.clear()  # its free is held: the collection starts under the lock
    assert not lock.deadlocked and lock.nested >= 1
    assert p.n_capture_held == 2 and {e[1] for e in p._capture_held} == {g, t}
    del world.status[S]
    p._drain_capture_held()
    assert p.n_capture_held == 0
    assert sorted(_frees(world)) == sorted([g, t])


def test_a_gc_while_held_frees_are_drained_holds_the_new_ones_without_losing_any(world):
    """_drain_capture_held swaps the list under Pool._lock and works on its copy: a
    collection there whose garbage block is freed on a stream still capturing adds to
    the new list, never to the one being drained."""
    p = world.pool(reuse_cache=0)
    old = p.malloc(KB)
    optr = old.ptr
    world.status[S] = (1, 7)
    del old  # held
    world.status.pop(S)
    world.current = cupy.cuda.ExternalStream(0x6000, 0)
    g = _garbage_block(p)
    world.status[0x6000] = (1, 9)  # its stream begins a capture
    p._lock = lock = GcUnderLock(p._lock)
    p._drain_capture_held()  # the collection runs as it takes the lock
    assert not lock.deadlocked
    assert _frees(world) == [optr]  # S is done capturing
    assert [e[1] for e in p._capture_held] == [g] and p.n_capture_held == 1
    del world.status[0x6000]
    p._drain_capture_held()
    assert _frees(world) == [optr, g]


class _Ev:
    """A pinned deferral's event; ``on_query`` runs when ``done`` is asked."""

    def __init__(self, done: bool = False, on_query=None) -> None:
        self._done, self.on_query = done, on_query

    @property
    def done(self) -> bool:
        if self.on_query is not None:
            f, self.on_query = self.on_query, None
            f()
        return self._done

    def record(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _deferring_pinned_pool(world, tp, monkeypatch, done: bool):
    """A PinnedPool whose frees are deferred behind fake events (done or not)."""
    fake_cupy = SimpleNamespace(
        cuda=SimpleNamespace(
            Device=lambda d: contextlib.nullcontext(),
            Event=lambda **k: _Ev(done),
            get_current_stream=lambda: world.current,
            runtime=SimpleNamespace(getDevice=lambda: 0),
        )
    )
    monkeypatch.setattr(tp.pinned, "cupy", fake_cupy)
    p = world.pool(cls=tp.PinnedPool, kind=twin.KIND_PINNED)
    p.release_hook = p._defer_free
    p.cache_limit = p.cache_max_block = 0
    return p


def test_a_gc_under_the_pinned_deferral_lock_may_defer_a_pinned_free(world, tp, monkeypatch):
    """_release_done asks the first deferred entry under _pending_lock; a collection
    started under it frees a garbage pinned block, which defers its free under the same
    lock (same thread)."""
    p = _deferring_pinned_pool(world, tp, monkeypatch, done=False)
    p._pending.append(([_Ev()], 0x1234, world.current))  # not done yet
    g = _garbage_block(p)
    p._pending_lock = lock = GcUnderLock(p._pending_lock)
    assert p._release_done() == 0
    assert not lock.deadlocked and lock.nested >= 1
    assert [e[1] for e in p._pending] == [0x1234, g]  # deferred, nothing freed
    assert _frees(world) == []


def test_a_deferred_pinned_free_released_during_its_own_event_query_is_done_once(
    world, tp, monkeypatch
):
    """A collection while _release_done asks whether the first entry's events are done
    (its generator is an allocation) frees a pinned block, whose deferral releases
    every finished entry, the first one too.  The outer call must then neither free
    that entry again nor take another one in its place."""
    p = _deferring_pinned_pool(world, tp, monkeypatch, done=True)
    g = _garbage_block(p)
    p._pending.append(([_Ev(True, on_query=gc.collect)], 0x1234, world.current))
    assert p._release_done() == 0  # the nested call did the work
    assert not p._pending
    assert sorted(_frees(world)) == sorted([0x1234, g])  # each once


def test_taking_a_pinned_pools_deferred_frees_survives_a_gc_under_the_lock(world, tp, monkeypatch):
    """_take_pending (retire, finalize) swaps the queue under the lock: a collection
    there that defers another free never changes the queue being read."""
    p = _deferring_pinned_pool(world, tp, monkeypatch, done=False)
    p._pending.append(([_Ev()], 0x1234, world.current))
    g = _garbage_block(p)
    p._pending_lock = GcUnderLock(p._pending_lock)
    left = p._take_pending()
    assert sorted(left + [e[1] for e in p._pending]) == sorted([0x1234, g])
