# ruff: noqa: F811  (the fixtures drv, made and world come from tests/fakes/mapped.py)
"""``DevicePool(large_blocks="mapped")`` on a CPU: the block cache's reuse and release
rules, the mapping calls and their unwinding, which blocks go where in both hot paths,
and the options.  A GPU checks the data (tests/test_pools_mapped_gpu.py).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
from cuda.bindings import driver as real
from fakes.events import use_driver
from fakes.hotpath import compiled_hotpath
from fakes.mapped import (  # noqa: F401  (fixtures: drv, made, world)
    FakeBackend,
    a_view_of_a_mapped_block,
    drv,
    made,
    mapped_twin,
    world,
)
from fakes.vmm import INVALID_VALUE, OOM, MiB, ReusingVA, StrictVmm
from support.waits import wait_for

import cupy_poolmem as cpm
from cupy_poolmem import _device, _driver, _mapped, _pools
from cupy_poolmem import _hotpath_py as twin

pytestmark = pytest.mark.filterwarnings("ignore:ExternalStream is deprecated")


def blocks(drv, **kw):
    """MappedBlocks on the fake driver, keeping every freed block unless told."""
    b = _mapped.MappedBlocks(0, driver=drv, **kw)
    b.release_threshold = 1 << 40
    return b


# -- the block cache ------------------------------------------------------------------
def test_a_block_is_mapped_on_memory_of_its_own_and_unmapping_gives_it_back(drv):
    b = blocks(drv)
    err, va = b.alloc(9 * MiB + 1, 0x5000)
    assert err == 0 and b.reserved == 10 * MiB  # rounded to the 2 MiB granularity
    names = [e[0] for e in drv.log]
    assert names == ["create", "reserve", "map", "access", "release"]
    assert drv.mapped == {va: 10 * MiB} and not drv.handles_alive  # the mapping holds it
    assert drv.access[va] == [(0, "READWRITE")]
    b.free(va, 0x5000)
    assert drv.mapped and b.cached == 10 * MiB  # cached, still mapped
    assert b.release(0) == 10 * MiB
    assert drv.mapped == {} and drv.reserved_va == set() and b.reserved == 0


@pytest.mark.parametrize(
    "step", ["cuMemCreate", "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess"]
)
def test_a_mapping_step_that_fails_undoes_the_ones_before(drv, step):
    b = blocks(drv)
    drv.fail[step] = OOM if step == "cuMemCreate" else 1  # CUDA_ERROR_INVALID_VALUE
    err, va = b.alloc(16 * MiB, 0x5000)
    assert err == (OOM if step == "cuMemCreate" else 1) and va == 0
    assert drv.mapped == {} and drv.reserved_va == set() and not drv.handles_alive
    assert b.reserved == 0 and not b.owns(va)
    assert b.alloc(16 * MiB, 0x5000)[0] == 0  # and the next one works


def test_a_freed_block_serves_its_stream_at_once_and_others_once_its_event_completed(drv):
    b = blocks(drv)
    va = b.alloc(32 * MiB, 0x5000)[1]
    b.free(va, 0x5000)
    assert b.alloc(32 * MiB, 0x6000)[1] != va  # its free may not have run yet
    assert b.alloc(32 * MiB, 0x5000)[1] == va  # stream order covers its own stream
    b.free(va, 0x5000)
    drv.done.add(drv.last_event())
    assert b.alloc(32 * MiB, 0x7000)[1] == va  # completed: any stream
    assert b.n_driver_allocs == 2 and b.n_hits == 2


def test_a_block_serves_requests_down_to_its_fit_and_the_smallest_that_fits_first(drv):
    b = blocks(drv, fit=0.25)
    vas = {n: b.alloc(n * MiB, 0x5000)[1] for n in (20, 24, 40)}
    for va in vas.values():
        b.free(va, 0x5000)
    assert b.alloc(42 * MiB, 0x5000)[1] not in vas.values()  # larger than all: new
    assert b.alloc(19 * MiB, 0x5000)[1] == vas[20]  # 20 MiB: 20 and 24 fit (<= 25)
    assert b.alloc(17 * MiB, 0x5000)[1] not in vas.values()  # 18 MiB: 24 > 22.5
    assert b.alloc(20 * MiB, 0x5000)[1] == vas[24]
    assert b.alloc(30 * MiB, 0x5000)[1] not in vas.values()  # 40 > 1.25 x 30
    assert b.cached == 40 * MiB


def test_beyond_the_threshold_the_oldest_done_blocks_are_unmapped_pending_ones_stay(drv):
    b = blocks(drv)
    b.release_threshold = 20 * MiB
    vas = [b.alloc(10 * MiB, 0x5000 + i)[1] for i in range(4)]
    events = []
    for va in vas[:2]:
        b.free(va, 0x5000)
        events.append(drv.last_event())
    assert b.cached == 20 * MiB and len(drv.mapped) == 4
    drv.done.add(events[1])  # the second is done, the first not yet
    b.free(vas[2], 0x5000)  # 30 MiB cached: the oldest done block goes
    assert set(drv.mapped) == {vas[0], vas[2], vas[3]} and b.cached == 20 * MiB
    b.free(vas[3], 0x5000)  # 30 MiB again; nothing done: none unmapped
    assert b.cached == 30 * MiB and b.reserved == 30 * MiB
    assert b.release(0, wait=True) == 30 * MiB  # waits for each
    assert drv.mapped == {} and [e for e in drv.log if e[0] == "sync"]


def test_without_a_threshold_freed_blocks_stay_until_a_new_block_would_pass_the_budget(drv):
    b = _mapped.MappedBlocks(0, driver=drv)
    assert b.release_threshold is None
    vas = [b.alloc(64 * MiB, 0x5000)[1] for _ in range(16)]  # 1 GiB live at most
    assert b.budget() == 1024 * MiB + 64 * MiB  # a sixteenth: 64 MiB
    for va in vas[:8]:
        b.free(va, 0x5000)
        drv.done.add(drv.last_event())
    assert b.cached == 512 * MiB  # a free gives nothing back
    assert b.alloc(64 * MiB, 0x6000)[1] == vas[0]  # a hit: nothing to make room for
    b.free(vas[0], 0x6000)  # its event pending from here on
    big = b.alloc(100 * MiB, 0x5000)[1]  # no fit: 512 + 512 + 100 > 1088 MiB
    assert big not in vas and b.reserved <= b.budget()
    assert vas[0] in drv.mapped  # the pending one stays; the oldest done went instead
    assert vas[1] not in drv.mapped and b.cached == 448 * MiB
    b.free(big, 0x5000)
    for va in vas[8:]:
        b.free(va, 0x5000)
    drv.done.update(e[1] for e in drv.log if e[0] == "record")
    b.alloc(900 * MiB, 0x5000)  # the oldest done blocks go, as many as it takes
    assert b.reserved == 1028 * MiB <= b.budget() and b.cached == 128 * MiB
    b.alloc(1100 * MiB, 0x5000)  # more than the budget alone: every done block goes
    assert b.cached == 0 and b.reserved == 2000 * MiB
    bigger = _mapped.MappedBlocks(0, driver=drv)
    bigger.live_high = 4096 * MiB
    assert bigger.budget() == 4096 * MiB + 256 * MiB


def test_out_of_memory_gives_back_done_blocks_first(drv):
    b = blocks(drv)
    va = b.alloc(32 * MiB, 0x5000)[1]
    b.free(va, 0x5000)
    drv.done.add(drv.last_event())
    drv.fail["cuMemCreate"] = OOM
    err, va2 = b.alloc(40 * MiB, 0x5000)  # no fit: create fails, the cache goes, retry
    assert err == 0 and va not in drv.mapped and b.cached == 0 and b.reserved == 40 * MiB


def test_a_failed_unmap_is_counted_and_raised_and_the_others_still_go(drv):
    b = blocks(drv)
    vas = [b.alloc(10 * MiB, 0x5000)[1] for _ in range(2)]
    for va in vas:
        b.free(va, 0x5000)
    drv.fail["cuMemUnmap"] = 1
    with pytest.raises(cpm.CUDADriverError, match="cuMemUnmap"):
        b.release(0)
    assert b.n_errors == 1 and vas[1] not in drv.mapped and b.reserved == 0


def test_peers_are_granted_on_every_block_and_revoked_ones_set_to_none(drv):
    b = blocks(drv, peers=(1,))
    live = b.alloc(10 * MiB, 0x5000)[1]
    cached = b.alloc(10 * MiB, 0x5000)[1]
    b.free(cached, 0x5000)
    assert drv.access[live] == [(0, "READWRITE"), (1, "READWRITE")]
    b.set_peers([2])
    for va in (live, cached):
        assert drv.access[va] == [(0, "READWRITE"), (2, "READWRITE"), (1, "NONE")]
    new = b.alloc(30 * MiB, 0x5000)[1]
    assert drv.access[new] == [(0, "READWRITE"), (2, "READWRITE")] and b.peers == (2,)


def test_a_leftover_is_freed_on_the_legacy_stream_and_given_back_at_close(drv):
    b = blocks(drv)
    va = b.alloc(10 * MiB, 0x5000)[1]
    b.free_leftover(va)
    assert ("record", drv.last_event(), 0) in drv.log
    b.close()
    assert drv.mapped == {} and b.reserved == 0


# -- the hot paths: which blocks the backend serves -----------------------------------
def test_twin_blocks_above_the_threshold_come_from_the_backend_and_go_back_to_it(world):
    p, be = mapped_twin(world)
    small, large = p.malloc(8 * MiB), p.malloc(8 * MiB + 1)
    assert world.alloc_pools == [0xABC]  # only the small one from the CUDA pool
    assert be.log == [("alloc", large.ptr, 8 * MiB + 1, 0x5000)]
    lp, sp = large.ptr, small.ptr
    del large, small
    assert be.log[-1] == ("free", lp, 0x5000)
    assert ("free", sp, 0x5000) in world.log and ("free", lp, 0x5000) not in world.log
    assert p._try_alloc(64 * MiB, 0x6000)[1] in be.ptrs  # the out-of-memory retry too
    assert p._free_direct(next(iter(be.ptrs)), 0x6000) == 0 and be.ptrs == {}


def test_twin_large_blocks_skip_the_reuse_cache(world):
    p, be = mapped_twin(world, reuse_cache=1 << 30)
    m = p.malloc(16 * MiB)
    del m
    assert p.cached_bytes == 0 and be.log[-1][0] == "free"  # the backend's cache decides


def test_twin_a_capture_takes_large_blocks_from_the_cuda_pool(world):
    p, be = mapped_twin(world)
    world.status[0x5000] = (1, 7)  # capturing
    m = p.malloc(32 * MiB)
    assert be.log == [] and world.log[-1][0] == "pool_alloc"  # graph memory
    world.status[0x5000] = (0, 0)
    del m
    assert be.log == []


def test_twin_a_large_free_on_a_capturing_stream_waits_for_the_capture(world):
    p, be = mapped_twin(world)
    m = p.malloc(32 * MiB)
    ptr = m.ptr
    world.status[0x5000] = (1, 7)
    del m
    assert be.ptrs == {ptr: 32 * MiB} and p.n_capture_held == 1
    world.status[0x5000] = (0, 0)
    p._drain_capture_held()
    assert be.ptrs == {} and be.log[-1] == ("free", ptr, 0x5000)


def test_compiled_routes_as_the_twin_does():
    hp = compiled_hotpath()
    if hp is None:
        pytest.skip("needs the compiled hot path (python setup.py build_ext --inplace)")

    class Core(hp.PoolCore):
        def _backend_alloc(self, size, stream):
            return self._backend.alloc(size, 0)[1]

        def _backend_try(self, size, stream_ptr):
            return self._backend.alloc(size, stream_ptr)

        def _backend_free(self, ptr, stream_ptr):
            self._backend.free(ptr, stream_ptr)

    c = Core()
    c._attach(0xABC, 0, hp.KIND_DEVICE)
    assert c.backend_min == 2**64 - 1  # a CUDA pool and no backend: none from one
    be = FakeBackend()
    c._attach_backend(be, 8 * MiB + 1, be.ptrs)
    assert c.backend_min == 8 * MiB + 1
    err, ptr = c._try_alloc(8 * MiB + 1, 0x6000)
    assert err == 0 and be.ptrs == {ptr: 8 * MiB + 1}
    assert c._free_direct(ptr, 0x6000) == 0 and be.ptrs == {}
    ptr = c._try_alloc(64 * MiB, 0)[1]
    c._free_now(ptr, 0)  # the legacy stream: no capture query
    assert be.log[-1] == ("free", ptr, 0)
    bare = Core()
    bare._attach(0, 0, hp.KIND_MANAGED)
    assert bare.backend_min == 0  # no CUDA pool: every block from the backend


# -- the option -----------------------------------------------------------------------
def test_a_mapped_pool_has_one_cuda_pool_and_maps_above_the_small_pool_size(made):
    p = cpm.DevicePool(large_blocks="mapped", reuse_cache="1GiB")
    assert p.large_blocks == "mapped" and len(made.mrs) == 1 and p._mrs == (made.mrs[0],)
    assert p.small_pool == 8 * MiB and p.backend_min == 8 * MiB + 1
    assert p.cache_max_block == 8 * MiB
    assert p._backend.release_threshold is None  # keeps within the live peak + 1/16
    q = cpm.DevicePool(large_blocks="mapped", small_pool="2MiB", release_threshold="32MiB")
    assert q.small_pool == 2 * MiB and q._backend.release_threshold == 32 * MiB
    assert cpm.DevicePool().large_blocks == "pool"


def test_a_mapped_pools_statistics_trim_and_peak_count_its_mapped_blocks(made, monkeypatch):
    monkeypatch.setattr(_driver.get(), "cuMemPoolTrimTo", lambda pool, keep: (0,))
    p = cpm.DevicePool(large_blocks="mapped")
    b = p._backend
    vas = [b.alloc(20 * MiB, 0x5000)[1] for _ in range(3)]
    b.free(vas[0], 0x5000)
    s = p.stats()
    assert s.reserved_bytes == 60 * MiB and s.peak_reserved_bytes == 60 * MiB
    assert p._safe_used() == 40 * MiB
    p._synchronize = lambda: None
    made.drv.done.add(made.drv.last_event())
    assert p.trim() == 20 * MiB and p.stats().reserved_bytes == 40 * MiB
    p.reset_peak()
    assert p.stats().peak_reserved_bytes == 40 * MiB


def test_a_mapped_pool_gives_its_blocks_back_when_retired(made):
    p = cpm.DevicePool(large_blocks="mapped")
    b = p._backend
    va = b.alloc(20 * MiB, 0x5000)[1]
    b.free(va, 0x5000)
    p.close()
    made.retirer.drain()
    assert made.drv.mapped == {} and made.mrs[0].closed
    assert made.retirer.log.events[0][0] == "sync"  # after a sync, not parked


def test_a_mapped_pools_leftover_goes_to_whichever_holds_it(made, monkeypatch):
    p = cpm.DevicePool(large_blocks="mapped")
    owner = _pools._recycle.Resources.owner(p._mrs, p._backend, 0)
    va = p._backend.alloc(20 * MiB, 0x5000)[1]
    owner.free_leftover(va)
    assert ("record", made.drv.last_event(), 0) in made.drv.log and p._backend.cached
    freed = []
    monkeypatch.setattr(
        _pools._recycle._retire, "free_on_legacy_stream", lambda ptr, dev: freed.append((ptr, dev))
    )
    owner.free_leftover(0x1234)  # not a mapped block: the CUDA pool's free
    assert freed == [(0x1234, 0)]


@pytest.mark.parametrize(
    ("opts", "exc", "words"),
    [
        ({"large_blocks": "vmm"}, cpm.InvalidOptionError, "'pool'"),
        ({"large_blocks": True}, cpm.OptionTypeError, "bool"),
        ({"large_blocks": "mapped", "small_pool": None}, cpm.InvalidOptionError, "small_pool"),
    ],
)
def test_bad_large_blocks_options_say_what_to_pass(made, opts, exc, words):
    with pytest.raises(exc, match=words):
        cpm.DevicePool(**opts)
    assert made.mrs == []  # checked before any CUDA pool is made


def test_a_gpu_without_virtual_memory_management_is_refused(monkeypatch):
    asked = []

    def get(attr, dev):
        asked.append((attr, dev))
        return 0, 0

    monkeypatch.setattr(_driver.get(), "cuDeviceGetAttribute", get, raising=False)
    with pytest.raises(cpm.UnsupportedError, match="virtual memory management") as e:
        _pools.device.new_mapped_blocks(3, ())
    vmm = _driver.get().CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
    assert asked == [(vmm, 3)]
    assert "device 3" in str(e.value) and "SUPPORTED is 0" in str(e.value)
    assert "use large_blocks='pool'" in str(e.value)


@pytest.mark.parametrize(
    "answer,words",
    [((0, 0), "MANAGED_MEMORY is 0"), ((101, 0), "could not be read: CUDA_ERROR_INVALID_DEVICE")],
)
def test_a_gpu_without_managed_memory_is_refused_naming_the_attribute(monkeypatch, answer, words):
    monkeypatch.setattr(
        _driver.get(), "cuDeviceGetAttribute", lambda attr, dev: answer, raising=False
    )
    with pytest.raises(cpm.UnsupportedError, match=words) as e:
        _pools.managed.require_managed_memory(1)
    assert "ManagedPool needs" in str(e.value) and "use DevicePool" in str(e.value)


def test_twin_and_compiled_agree_on_the_backend_interface():
    assert "_attach_backend" in dir(twin.PoolCore)
    hp = compiled_hotpath()
    if hp is not None:
        assert "_attach_backend" in dir(hp.PoolCore) and "backend_min" in dir(hp.PoolCore)


# -- reused addresses, failing calls, peers, trims and statistics ---------------------
def test_a_block_made_at_the_address_of_one_being_unmapped_keeps_its_bookkeeping(
    monkeypatch, fake_driver
):
    d = use_driver(fake_driver, monkeypatch, ReusingVA())
    b = _mapped.MappedBlocks(0, driver=d)
    va = b.alloc(20 * MiB, 0x5000)[1]
    b.free(va, 0x5000)
    d.done.add(d.last_event())
    new: list[int] = []
    d.on_free = lambda: new.append(b.alloc(20 * MiB, 0x6000)[1])
    b.release(0, wait=False)
    assert new == [va] and va in d.mapped  # another block at the same address, live
    assert b.owns(va) and b.reserved == 20 * MiB  # so its free comes back here


def test_a_block_mapped_while_peers_change_gets_the_new_grants(drv):
    b = blocks(drv, peers=(1,))
    old = b.alloc(10 * MiB, 0x5000)[1]
    made: list[int] = []
    real_set = drv.cuMemSetAccess
    todo = [True]

    def set_access(va, size, descs, n):
        if todo and todo.pop():  # a block mapped in the middle of set_peers
            made.append(b.alloc(30 * MiB, 0x5000)[1])
        return real_set(va, size, descs, n)

    drv.cuMemSetAccess = set_access
    b.set_peers([2])
    assert drv.access[made[0]] in (
        [(0, "READWRITE"), (2, "READWRITE")],
        [(0, "READWRITE"), (2, "READWRITE"), (1, "NONE")],
    )
    assert drv.access[old] == [(0, "READWRITE"), (2, "READWRITE"), (1, "NONE")]


def test_reset_peak_leaves_the_budget_of_freed_blocks_alone(drv):
    b = _mapped.MappedBlocks(0, driver=drv)
    vas = [b.alloc(64 * MiB, 0x5000)[1] for _ in range(8)]  # 512 MiB live at most
    for va in vas:
        b.free(va, 0x5000)
    drv.done.update(e[1] for e in drv.log if e[0] == "record")
    b.reset_peak()
    assert b.peak_reserved == 512 * MiB and b.live_high == 512 * MiB
    b.alloc(40 * MiB, 0x5000)  # within the budget (576 MiB): nothing unmapped
    assert b.cached == 512 * MiB


def test_a_failed_unmap_of_another_block_does_not_fail_the_allocation(drv):
    b = _mapped.MappedBlocks(0, driver=drv)
    vas = [b.alloc(64 * MiB, 0x5000)[1] for _ in range(2)]
    for va in vas:
        b.free(va, 0x5000)
    drv.done.update(e[1] for e in drv.log if e[0] == "record")
    drv.fail["cuMemUnmap"] = 1
    err, ptr = b.alloc(200 * MiB, 0x5000)  # makes room: one unmap fails
    assert err == 0 and b.owns(ptr)
    assert b.n_errors == 1 and b.leaked == 64 * MiB and b.cached == 0


def test_the_per_thread_default_stream_reuses_only_after_the_event(drv):
    b = blocks(drv)
    va = b.alloc(32 * MiB, 2)[1]
    b.free(va, 2)  # handle 2: each thread's own stream
    assert b.alloc(32 * MiB, 2)[1] != va
    drv.done.add(next(e[1] for e in drv.log if e[0] == "record"))
    assert b.alloc(32 * MiB, 2)[1] == va


def test_trim_keeps_at_least_what_it_is_told(made, monkeypatch):
    monkeypatch.setattr(_driver.get(), "cuMemPoolTrimTo", lambda pool, keep: (0,))
    p = cpm.DevicePool(large_blocks="mapped")
    p._synchronize = lambda: None
    b = p._backend
    for va in [b.alloc(n * MiB, 0x5000)[1] for n in (30, 30, 40)]:
        b.free(va, 0x5000)
    p.trim(keep="50MiB")
    assert p.stats().reserved_bytes >= 50 * MiB
    p.trim()
    assert p.stats().reserved_bytes == 0


def test_the_statistics_recorder_counts_mapped_blocks(made):
    from cupy_poolmem import stats

    p = cpm.DevicePool(large_blocks="mapped")
    p._backend.alloc(64 * MiB, 0x5000)
    assert stats._reserved(p) == p.stats().reserved_bytes == 64 * MiB


def test_a_mapping_call_that_fails_is_named_in_the_error(made):
    p = cpm.DevicePool(large_blocks="mapped")
    made.drv.fail["cuMemMap"] = 1  # CUDA_ERROR_INVALID_VALUE
    with pytest.raises(cpm.CUDADriverError, match="cuMemMap") as e:
        p._backend_alloc(16 * MiB, SimpleNamespace(ptr=0x5000))
    assert "CUDA_ERROR_INVALID_VALUE" in str(e.value) and p._backend.reserved == 0


@pytest.mark.parametrize(
    ("opts", "words"),
    [({"max_size": "1GiB"}, "max_size"), ({"small_pool": "1MiB"}, "2 MiB|2.0 MiB")],
)
def test_a_mapped_pool_refuses_a_cap_and_tiny_thresholds(made, opts, words):
    with pytest.raises(cpm.InvalidOptionError, match=words):
        cpm.DevicePool(large_blocks="mapped", **opts)
    assert made.mrs == []


def test_set_peers_is_all_or_nothing_when_the_driver_refuses_a_block(drv):
    """The third block's grant fails: the two changed before it get the old access back,
    the peers stay, and a block mapped after keeps the old access too."""
    b = blocks(drv, peers=(1,))
    vas = [b.alloc((10 + 2 * i) * MiB, 0x5000)[1] for i in range(4)]
    calls = [0]
    real_set = drv.cuMemSetAccess

    def set_access(va, size, descs, n):
        calls[0] += 1
        if calls[0] == 3:
            return (real.CUresult.CUDA_ERROR_INVALID_VALUE,)
        return real_set(va, size, descs, n)

    drv.cuMemSetAccess = set_access
    with pytest.raises(cpm.CUDADriverError, match="CUDA_ERROR_INVALID_VALUE"):
        b.set_peers([2])
    drv.cuMemSetAccess = real_set
    assert b.peers == (1,)
    for va in vas:
        assert drv.grants[va].get(1) == "READWRITE" and drv.grants[va].get(2, "NONE") == "NONE"
        assert b.has_access(va, 1) and not b.has_access(va, 2)
    new = b.alloc(40 * MiB, 0x5000)[1]
    assert drv.access[new] == [(0, "READWRITE"), (1, "READWRITE")]


def test_a_failed_undo_of_set_peers_names_the_blocks_left_mixed(drv):
    b = blocks(drv, peers=())
    first, second = (b.alloc(n * MiB, 0x5000)[1] for n in (10, 12))
    real_set = drv.cuMemSetAccess

    def set_access(va, size, descs, n):
        if va == second:  # refuses the grant and the undo
            return (real.CUresult.CUDA_ERROR_INVALID_VALUE,)
        return real_set(va, size, descs, n)

    drv.cuMemSetAccess = set_access
    with pytest.raises(cpm.CUDADriverError) as ei:
        b.set_peers([1])
    notes = " ".join(getattr(ei.value, "__notes__", []))
    assert f"{second:#x}" in notes and "mixed" in notes and f"{first:#x}" not in notes
    assert not b.has_access(first, 1) and b.peers == ()


def test_has_access_asks_the_driver_and_the_own_gpu_always_has_it(drv):
    b = blocks(drv, peers=(1,))
    va = b.alloc(10 * MiB, 0x5000)[1]
    assert b.has_access(va, 0) and b.has_access(va, 1) and not b.has_access(va, 2)
    b.set_peers([2])
    assert not b.has_access(va, 1) and b.has_access(va, 2)


def _array_on(b, va: int, offset: int = 0) -> Any:
    """A cupy.ndarray as check_access sees one: data.ptr, and the pool Block behind it."""
    block = SimpleNamespace(ptr=va, core=SimpleNamespace(_backend=b))
    return SimpleNamespace(data=SimpleNamespace(ptr=va + offset, mem=SimpleNamespace(_owner=block)))


def test_check_access_asks_a_mapped_blocks_own_grants(drv, monkeypatch):
    """Before: memory with no CUDA pool passed when the two GPUs were peer capable, and a
    kernel on an ungranted GPU would have faulted (cudaErrorIllegalAddress)."""
    b = blocks(drv, peers=())
    va = b.alloc(10 * MiB, 0x5000)[1]
    # The driver reports no pool for mapped memory, and (driver 580) may name GPU 0.
    monkeypatch.setattr(_device, "pointer_info", lambda ptr: (1, 0, False))
    monkeypatch.setattr(_device, "check_device", lambda d, name="device": d)
    monkeypatch.setattr(_device, "can_access_peer", lambda a, c: {a, c} <= {0, 1})
    x = _array_on(b, va, offset=4096)
    with pytest.raises(cpm.WrongDeviceError, match="mapped block .* on GPU 0 is not accessible"):
        cpm.check_access(x, device=1)
    cpm.check_access(x, device=0)
    with pytest.raises(cpm.UnsupportedError, match="GPU 2 cannot access memory of GPU 0"):
        cpm.check_access(x, device=2)
    b.set_peers([1])
    cpm.check_access(x, device=1)
    other = SimpleNamespace(data=SimpleNamespace(ptr=0x1234, mem=None))  # cudaMalloc memory
    cpm.check_access(other, device=1)  # device-level peer access, as before


def _two_peer_gpus(monkeypatch):
    """Two peer-capable GPUs; no stale grants to revoke, no device to wait for."""
    for mod in (_device, _pools.device):
        monkeypatch.setattr(mod, "device_count", lambda: 2)
    monkeypatch.setattr(_device, "can_access_peer", lambda a, b: True)
    monkeypatch.setattr(_pools.device, "revoke_stale", lambda mr, dev: None)
    monkeypatch.setattr(_pools.device, "sync_device", lambda dev: None)


def test_peer_access_stays_as_it_was_when_the_mapped_blocks_refuse(made, monkeypatch):
    """The CUDA pool is granted first; the mapped blocks then refuse: the CUDA pool goes
    back to what it granted, so the pool's peers are not half set."""
    _two_peer_gpus(monkeypatch)
    p = cpm.DevicePool(large_blocks="mapped", peer_access=None)
    mr = made.mrs[0]
    mr.peer_accessible_by = ()
    va = p._backend.alloc(20 * MiB, 0x5000)[1]
    made.drv.fail["cuMemSetAccess"] = int(real.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
    with pytest.raises(cpm.CUDADriverError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        p.peer_access = [1]
    assert p.peer_access == () and mr.peer_accessible_by == ()
    assert not p._backend.has_access(va, 1) and p._backend.peers == ()
    p.peer_access = [1]  # the driver agrees now: both the CUDA pool and the blocks
    assert p.peer_access == (1,) and p._backend.has_access(va, 1)


# -- peer access under concurrency and failure -------------------------------------
# 1 -------------------------------------------------------------------------------------
def test_a_concurrent_release_unmaps_a_listed_block_only_after_set_peers(
    drv, monkeypatch, fake_driver
):
    """set_peers lists the blocks, then sets each under _map_lock.  A release (a trim,
    a free past the threshold) in another thread forgets a listed block at once, but
    unmaps it and frees its address range (which the driver hands to the next mapping,
    any pool's) only once set_peers is done with it: set_peers never sets the access
    of a range that is no longer this pool's block."""
    d = use_driver(fake_driver, monkeypatch, StrictVmm())
    b = blocks(d, peers=())
    v1 = b.alloc(10 * MiB, 0x5000)[1]
    v2 = b.alloc(12 * MiB, 0x5000)[1]
    b.free(v2, 0x5000)  # cached, still mapped
    real_set = d.cuMemSetAccess
    todo = [True]
    threads: list[threading.Thread] = []

    def set_access(va, size, descs, n):
        if todo and todo.pop():  # another thread trims while set_peers runs
            t = threading.Thread(target=b.release, args=(0,))
            threads.append(t)
            t.start()
            assert wait_for(lambda: not b.owns(v2), 5)  # forgotten at once...
            t.join(0.05)
            assert t.is_alive() and v2 in d.mapped  # ...its unmap waits for set_peers
        return real_set(va, size, descs, n)

    d.cuMemSetAccess = set_access
    b.set_peers([1])
    threads[0].join(5)
    assert not threads[0].is_alive() and v2 not in d.mapped and b.reserved == 10 * MiB
    assert b.peers == (1,) and b.has_access(v1, 1)


# 2 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("again", [[1], []], ids=["the-old-peers", "no-peers"])
def test_a_block_left_mixed_is_fixed_by_setting_the_peers_again(drv, again):
    """The note says 'their access is mixed until peer_access is set again': the next
    set_peers also revokes the peers a failed undo may have left granted."""
    b = blocks(drv, peers=(1,))
    v1 = b.alloc(10 * MiB, 0x5000)[1]
    b.alloc(12 * MiB, 0x5000)
    real_set = drv.cuMemSetAccess
    calls = [0]

    def set_access(va, size, descs, n):
        calls[0] += 1
        # call 1: grant on v1 ok; call 2: grant on v2 refused; call 3: undo on v1 refused
        if calls[0] in (2, 3):
            return (INVALID_VALUE,)
        return real_set(va, size, descs, n)

    drv.cuMemSetAccess = set_access
    with pytest.raises(cpm.CUDADriverError) as ei:
        b.set_peers([2])
    assert f"{v1:#x}" in " ".join(ei.value.__notes__)  # v1 named as mixed
    assert b.has_access(v1, 2) and b.peers == (1,)  # v1: 2 granted, 1 revoked
    drv.cuMemSetAccess = real_set  # the driver agrees again
    b.set_peers(again)  # "set again"
    assert b.peers == tuple(again) and b.has_access(v1, 1) == bool(again)
    assert not b.has_access(v1, 2), f"GPU 2 keeps access to a block after peers={again}"


# 3 -------------------------------------------------------------------------------------
class _PausingLock:
    """_map_lock that lets the test decide when a thread's set_peers enters it."""

    def __init__(self, inner, pause_in, arrived, go):
        self.inner, self.pause_in, self.arrived, self.go = inner, pause_in, arrived, go

    def __enter__(self):
        if threading.current_thread().name == self.pause_in:
            self.arrived.set()
            assert self.go.wait(5)
        return self.inner.__enter__()

    def __exit__(self, *a):
        return self.inner.__exit__(*a)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_concurrent_set_peers_leave_the_blocks_as_the_peers_say(drv):
    """Thread B (peers -> ()) waits for the lock while thread A grants GPU 1: B reads
    the peers to revoke under the lock, so it revokes GPU 1 (it read them before)."""
    b = blocks(drv, peers=())
    va = b.alloc(10 * MiB, 0x5000)[1]
    arrived, go = threading.Event(), threading.Event()
    b._map_lock = _PausingLock(b._map_lock, "B", arrived, go)
    tb = threading.Thread(target=b.set_peers, args=([],), name="B")
    tb.start()
    assert arrived.wait(5)  # B has computed its lists from old=()
    b.set_peers([1])  # A, in this thread, runs to the end
    go.set()
    tb.join(5)
    assert b.peers == ()
    assert not b.has_access(va, 1), "peers == () but GPU 1 still has access"


def test_check_access_finds_a_mapped_block_behind_any_array_type(made, monkeypatch):
    """A torch or Numba array, or cupy.asarray of one, reaches a mapped block through
    __cuda_array_interface__ (no pool Block behind it): found by its address among the
    pools' mapped blocks."""
    p, va, cai = a_view_of_a_mapped_block(monkeypatch)
    with pytest.raises(cpm.WrongDeviceError, match="mapped block"):
        cpm.check_access(cai, device=1)
    elsewhere = SimpleNamespace(__cuda_array_interface__={"data": (va + 10 * MiB, False)})
    cpm.check_access(elsewhere, device=1)  # past the block's end: not a mapped block
    p._backend.set_peers([1])
    cpm.check_access(cai, device=1)


def test_a_failed_undo_of_the_cuda_pools_grant_is_still_revoked_at_retire(made, monkeypatch):
    """The blocks refuse, then putting the CUDA pool back fails too: the CUDA pool keeps
    GPU 1's grant, so the pool revokes its grants at retirement (nvbug 5698116)."""
    _two_peer_gpus(monkeypatch)
    p = cpm.DevicePool(large_blocks="mapped", peer_access=None)
    mr = made.mrs[0]
    mr.peer_accessible_by = ()
    p._backend.alloc(20 * MiB, 0x5000)
    real_set_peers = _pools.device.set_peers
    calls = [0]

    def set_peers(m, owner, peers):
        calls[0] += 1
        if calls[0] == 2:  # the undo
            raise cpm.UnsupportedError("refused")
        return real_set_peers(m, owner, peers)

    monkeypatch.setattr(_pools.device, "set_peers", set_peers)
    made.drv.fail["cuMemSetAccess"] = int(real.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
    with pytest.raises(cpm.CUDADriverError) as ei:
        p.peer_access = [1]
    assert "stays unset" in " ".join(ei.value.__notes__)
    assert tuple(mr.peer_accessible_by) == (1,)  # the CUDA pool still grants GPU 1
    assert p._peers_set, "a grant left on the CUDA pool is not revoked at retire"
