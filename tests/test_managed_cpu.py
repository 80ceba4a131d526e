"""CPU tests of managed memory: the cuMemAllocManaged backend, the advice probe, and
prefetch/advise over collections, against a fake driver."""

from __future__ import annotations

import gc

import cupy
import numpy as np
import pytest
from cuda.bindings import driver as real
from cupy.cuda.memory import MemoryPointer, UnownedMemory
from fakes.driver import PassThrough, Runtime
from fakes.events import use_driver
from fakes.hotpath import World, twin_pools
from fakes.managed import ManagedCore, ManagedDriver
from support.gc_locks import GcUnderLock

import cupy_poolmem as cpm
from cupy_poolmem import _block_cache, _runtime
from cupy_poolmem import _hotpath_py as twin
from cupy_poolmem._pools import managed as managed_pool

pytestmark = pytest.mark.filterwarnings("ignore:ExternalStream is deprecated")

KB = 4096


@pytest.fixture
def drv(monkeypatch, fake_driver):
    return use_driver(fake_driver, monkeypatch, ManagedDriver())


def testmanaged_poolator_reuses_on_the_same_stream_and_after_events(drv):
    a = managed_pool.ManagedAllocator(0)
    err, p1 = a.alloc(1000, 0x5000)
    assert err == 0 and drv.log[0] == ("alloc", p1, 4096)  # rounded to a page
    assert ("advise", p1, 4096, "CU_MEM_ADVISE_SET_PREFERRED_LOCATION") in drv.log
    a.free(p1, 0x5000)
    assert a.cached == 4096 and a.reserved == 4096
    assert a.alloc(4000, 0x5000) == (0, p1)  # same stream: stream order covers it
    a.free(p1, 0x5000)
    ev = drv.log[-1][1]
    err, p2 = a.alloc(4096, 0x6000)  # other stream, event pending: a new block
    assert p2 != p1 and a.reserved == 8192
    drv.done.add(ev)
    a.free(p2, 0x6000)
    assert a.alloc(4096, 0x7000) == (0, p1)  # p1's event completed: reusable anywhere
    assert a.n_driver_allocs == 2


def testmanaged_poolator_release_and_threshold(drv):
    a = managed_pool.ManagedAllocator(0)
    ptrs = [a.alloc(8192, 0x5000)[1] for _ in range(3)]
    for p in ptrs:
        a.free(p, 0x5000)
    assert a.cached == 3 * 8192
    first_ev = drv.log[-3][1]
    drv.done.add(first_ev)
    assert a.release(0, wait=False) == 8192  # only the completed one
    assert ("free", ptrs[0]) in drv.log and a.cached == 2 * 8192
    assert a.release(0, wait=True) == 2 * 8192  # waits for the others
    assert a.cached == 0 and a.reserved == 0
    assert sum(1 for e in drv.log if e[0] == "sync") == 2
    a.release_threshold = 8192
    p = [a.alloc(8192, 0x5000)[1] for _ in range(2)]
    drv.done.update(f"ev{i}" for i in range(100))
    a.free(p[0], 0x5000)
    a.free(p[1], 0x5000)  # over the threshold: completed blocks go back
    assert a.cached == 8192


def test_probe_says_why_it_refuses_pool_memory(drv):
    drv.advise_result = 801  # CUDA_ERROR_NOT_SUPPORTED
    ok, why = managed_pool.probe_pool_advice(0x1234, 0)
    assert not ok and "CUDA_ERROR_NOT_SUPPORTED" in why and "SET_PREFERRED_LOCATION" in why
    drv.advise_result = 0
    ok, why = managed_pool.probe_pool_advice(0x1234, 0)
    assert ok and "takes advice" in why


@pytest.mark.parametrize(
    "bad,exc",
    [("fast", cpm.InvalidOptionError), (3, cpm.OptionTypeError), (None, cpm.OptionTypeError)],
)
def test_managed_pool_backend_option_is_checked_first(bad, exc):
    with pytest.raises(exc, match="backend"):
        cpm.ManagedPool(backend=bad)


# ---------------------------------------------------------------- prefetch / advise
def _managed_array(ptr: int, n: int, owner=None) -> cupy.ndarray:
    mem = MemoryPointer(UnownedMemory(ptr, n * 8, owner or object(), 0), 0)
    return cupy.ndarray((n,), dtype=np.float64, memptr=mem)


@pytest.fixture
def fake_managed(monkeypatch, fake_driver):
    log: list = []
    unmanaged: set = set()
    fake_driver.core(ManagedCore(log))
    # device 0 exists (on a GPU machine the real count stands: other threads see it too)
    fake_driver.runtime(Runtime(max(1, cpm.device_count())))

    class Drv(PassThrough):
        CUpointer_attribute = real.CUpointer_attribute

        @staticmethod
        def cuPointerGetAttribute(attr, ptr):  # noqa: N802
            return 0, int(ptr) not in unmanaged

    fake_driver(Drv())
    monkeypatch.setattr(
        cupy.cuda, "get_current_stream", lambda *a: cupy.cuda.ExternalStream(0x50, 0)
    )
    return log, unmanaged


def test_prefetch_takes_a_collection_and_merges_views(fake_managed):
    log, _ = fake_managed
    a = _managed_array(0x10000, 512)  # 4 KiB
    b = _managed_array(0x20000, 256)
    params = {"w": a, "w_view": a[100:200], "b": b, "empty": a[:0]}
    cpm.prefetch(params, device=0)
    assert log == [
        ("prefetch", 0x10000, 4096, ("loc", 0), ("stream", 0x50)),
        ("prefetch", 0x20000, 2048, ("loc", 0), ("stream", 0x50)),
    ]
    log.clear()
    cpm.prefetch([b, a[::2]], device="cpu", stream=cupy.cuda.ExternalStream(0x60, 0))
    assert [e[1:] for e in log] == [
        (0x10000, 4088, ("loc", "cpu"), ("stream", 0x60)),  # a[::2] spans 4088 bytes
        (0x20000, 2048, ("loc", "cpu"), ("stream", 0x60)),
    ]
    log.clear()
    c = _managed_array(0x20000 + 2048, 16)  # touches b: another allocation, kept apart
    cpm.prefetch((b, c), device=0)
    assert len(log) == 2


def test_prefetch_and_advise_check_everything_before_acting(fake_managed):
    log, unmanaged = fake_managed
    a = _managed_array(0x10000, 512)
    d = _managed_array(0x30000, 8)
    unmanaged.add(0x30000)
    with pytest.raises(cpm.InvalidOptionError, match=r"item \['d'\].*not on managed memory"):
        cpm.prefetch({"a": a, "d": d}, device=0)
    with pytest.raises(cpm.OptionTypeError, match=r"item \[1\] is a ndarray"):
        cpm.advise([a, np.ones(3)], read_mostly=True)
    with pytest.raises(cpm.OptionTypeError, match="list, tuple or dict"):
        cpm.prefetch(iter([a]), device=0)
    with pytest.raises(cpm.OptionTypeError, match="stream must be"):
        cpm.prefetch(a, device=0, stream="s")
    assert log == []  # nothing was prefetched or advised


def test_advise_marks_pool_blocks_whose_free_resets_the_hints(
    fake_managed, monkeypatch, fake_driver
):
    log, _ = fake_managed
    tp = twin_pools()
    monkeypatch.setattr(_runtime, "hp", twin)
    world = World(monkeypatch, tp, fake_driver)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda *a: world.current)
    p = world.pool(cls=tp.ManagedPool, kind=twin.KIND_MANAGED)
    m = p.malloc(4096)
    x = cupy.ndarray((512,), np.float64, memptr=m)
    y = _managed_array(0x40000, 8)  # not from a pool: advised, nothing to mark
    cpm.advise([x, y], preferred_location=0, accessed_by=[0, "cpu"], read_mostly=True)
    assert [e[0] for e in log] == ["preferred_location", "accessed_by", "read_mostly"] * 2
    assert log[1][3] == [("loc", 0), ("loc", "cpu")]
    blk = m.mem._owner
    assert blk.flags & twin.FLAG_ADVISED
    resets: list = []
    monkeypatch.setattr(tp.managed, "reset_advice", lambda ptr, size, dev: resets.append(ptr))
    ptr = m.ptr
    del x, m, blk
    assert resets == [ptr] and p.cached_bytes == 4096  # reset, then the reuse cache
    m2 = p.malloc(4096)
    assert m2.ptr == ptr and not m2.mem._owner.flags  # a fresh block: no hints, no flag


# ---------------------------------------------------------------- garbage collections under the lock
class _FreedInGc:
    """Cyclic garbage that frees a block of ``a`` when collected, as a garbage pool
    block of a "managed"-backend pool does (blocks over 64 MiB, or a full cache)."""

    def __init__(self, a, ptr: int, stream_ptr: int) -> None:
        self.a, self.ptr, self.stream_ptr = a, ptr, stream_ptr
        self.cycle = self

    def __del__(self) -> None:
        self.a.free(self.ptr, self.stream_ptr)


def _collect_once():
    """A callable that runs one garbage collection, the first time only."""
    todo = [gc.collect]
    return lambda: todo and todo.pop()()


def test_a_block_freed_by_a_gc_under_the_allocators_lock_is_cached(drv, monkeypatch):
    """free() allocates under the lock (the deque of a new size class): a collection
    started there frees another block, which must not take the lock again."""
    a = managed_pool.ManagedAllocator(0)
    p1, p2 = a.alloc(KB, 0x5000)[1], a.alloc(KB, 0x5000)[1]
    gc.collect()
    _FreedInGc(a, p1, 0x5000)
    a._lock = lock = GcUnderLock(a._lock, collect=False)
    collect = _collect_once()
    real_deque = _block_cache.deque
    monkeypatch.setattr(_block_cache, "deque", lambda *x: (collect(), real_deque(*x))[1])
    a.free(p2, 0x5000)
    assert not lock.deadlocked
    assert a.cached == 2 * KB and {e[0] for e in a._free[KB]} == {p1, p2}
    assert {a.alloc(KB, 0x5000)[1], a.alloc(KB, 0x5000)[1]} == {p1, p2}  # both reusable
    assert a.n_driver_allocs == 2


def test_a_block_freed_by_a_gc_while_alloc_searches_the_cache_is_cached(drv, monkeypatch):
    """alloc() walks a size class under the lock and asks each entry's event: a
    collection there frees a block of that class, which must not be appended to the
    deque being walked (nor take the lock again); it is cached once alloc is done."""
    a = managed_pool.ManagedAllocator(0)
    p1, p2 = a.alloc(KB, 0x5000)[1], a.alloc(KB, 0x6000)[1]
    a.free(p1, 0x5000)  # its event never completes here
    gc.collect()
    _FreedInGc(a, p2, 0x6000)
    a._lock = lock = GcUnderLock(a._lock, collect=False)
    collect = _collect_once()
    query = drv.cuEventQuery
    monkeypatch.setattr(drv, "cuEventQuery", lambda ev: (collect(), query(ev))[1], raising=False)
    err, p3 = a.alloc(KB, 0x7000)  # nothing reusable on this stream: a new block
    assert err == 0 and p3 not in (p1, p2)
    assert not lock.deadlocked
    assert a.cached == 2 * KB and [e[0] for e in a._free[KB]] == [p1, p2]
    assert a.alloc(KB, 0x6000) == (0, p2)  # its own stream: reused
