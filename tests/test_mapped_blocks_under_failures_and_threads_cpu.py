# ruff: noqa: F811  (the fixtures drv, made and world come from tests/fakes/mapped.py)
"""Mapped blocks and the block cache under failures, other contexts, captures and
threads: each test guards against a fault that once broke these paths.  CPU only:
the driver is played by the fakes of tests/fakes/vmm.py.  Docstrings describe
the fault each test guards against.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import cupy
import pytest
from fakes.events import use_driver
from fakes.mapped import (  # noqa: F401  (fixtures: drv, made, world)
    a_view_of_a_mapped_block,
    drv,
    made,
    mapped_twin,
    world,
)
from fakes.vmm import OOM, CapturingVmm, ContextVmm, MiB, ReusingVA, VmmDriver

import cupy_poolmem as cpm
from cupy_poolmem import _device, _driver, _mapped

pytestmark = pytest.mark.filterwarnings("ignore:ExternalStream is deprecated")


# --------------------------------------------------------------------------------------
@pytest.fixture
def ctx_drv(monkeypatch, fake_driver):
    d = fake_driver(ContextVmm())
    monkeypatch.setattr(_device, "on_device", d.on_device)
    return d


@pytest.mark.parametrize("current", [1, None], ids=["gpu1-current", "no-context"])
def test_a_block_freed_while_another_device_is_current_is_cached(ctx_drv, current):
    """BlockCache.free creates its event (``_event`` -> cuEventCreate) before
    ``on_device(self.device)``, in whatever context the freeing thread has: another GPU's
    (a multi-GPU program, a garbage collection under ``with Device(1)``), or none (a
    fresh thread, the retirer freeing a finalized pool's leftovers).  The record on the
    block's stream then fails, the free raises, the hot path swallows it
    (``n_free_errors``) and the block is neither cached nor unmapped: leaked for good
    (``reserved`` keeps it, ``close`` never unmaps it).  Both calls once ran
    outside ``on_device``."""
    b = _mapped.MappedBlocks(0, driver=ctx_drv)
    b.release_threshold = 1 << 40
    va = b.alloc(32 * MiB, 0x5000)[1]
    ctx_drv.current = current  # the freeing thread: GPU 1 current, or no context at all
    b.free(va, 0x5000)  # raised CUDADriverError
    assert b.cached == 32 * MiB
    ctx_drv.current = 0
    b.close()
    assert ctx_drv.mapped == {} and b.reserved == 0


# --------------------------------------------------------------------------------------
@pytest.fixture
def capturing_drv(monkeypatch, fake_driver):
    """CapturingVmm in place (a test asks for it before ``world``, whose driver wraps it)."""
    return use_driver(fake_driver, monkeypatch, CapturingVmm())


def test_a_mapped_block_freed_on_the_legacy_stream_during_a_capture_is_not_lost(
    capturing_drv, world
):
    """A CUDA-pool block freed on the legacy stream while a capture is under way
    gets a capture error from cuMemFreeAsync and is held until the capture ends
    (``_free_failed`` -> ``_hold_free``).  A mapped block in the same place reaches
    BlockCache.free, whose cuEventRecord gets the same error: the exception is
    swallowed by ``_backend_free`` (``n_free_errors``) and the block is gone from every
    list but ``_sizes``: never reused, never unmapped, ``reserved`` forever.  CuPy's
    default current stream is the legacy null stream (handle 0)."""
    d = capturing_drv
    p, _ = mapped_twin(world)
    b = _mapped.MappedBlocks(0, driver=d)
    p._backend = b
    p._attach_backend(b, 8 * MiB + 1, b._sizes)
    world.current = cupy.cuda.ExternalStream(0, 0)  # the legacy stream
    m = p.malloc(32 * MiB)
    va = m.ptr
    assert b.owns(va)
    d.capturing = True  # another thread captures a graph on a blocking stream
    del m
    d.capturing = False  # the capture ended
    p._drain_capture_held()
    assert p.n_free_errors == 0, "the free was dropped"
    assert b.cached == 32 * MiB, "the mapped block is neither held, cached nor unmapped"


# --------------------------------------------------------------------------------------
def test_a_mapping_call_failing_on_the_out_of_memory_retry_is_named(made, monkeypatch):
    """the first try runs out of memory (cuMemCreate), the retry after reclaiming
    fails in cuMemMap with another error: ``_alloc_failed`` reports it under the pool's
    ``_alloc_call``, "cuMemAllocFromPoolAsync", a call that was never made (the first
    failure is named right: ``_backend_alloc`` asks the backend's ``failed_call``)."""
    monkeypatch.setattr(_driver.get(), "cuMemPoolTrimTo", lambda pool, keep: (0,))
    p = cpm.DevicePool(large_blocks="mapped")
    p._synchronize = lambda: None
    made.drv.fail["cuMemCreate"] = OOM
    made.drv.fail["cuMemMap"] = 1  # CUDA_ERROR_INVALID_VALUE, on the retry
    with pytest.raises(cpm.CUDADriverError, match="CUDA_ERROR_INVALID_VALUE") as e:
        p._backend_alloc(16 * MiB, SimpleNamespace(ptr=0x5000))
    assert e.value.call == "cuMemMap", e.value.call


# --------------------------------------------------------------------------------------
def test_the_failing_mapping_call_is_named_when_another_thread_maps_meanwhile(made):
    """``failed_call`` is one attribute of the backend, read by ``_backend_alloc``
    after ``alloc`` has returned and released the mapping lock.  Forced switch: right
    after this thread's alloc fails in cuMemMap, another thread maps a block (which
    resets ``failed_call`` to "") before this one reads it: the error then names
    "cuMemAllocFromPoolAsync" instead of cuMemMap."""
    p = cpm.DevicePool(large_blocks="mapped")
    b = p._backend
    orig = b.alloc

    def alloc(size, sptr):
        res = orig(size, sptr)
        if res[0]:  # the switch: another thread allocates before failed_call is read
            t = threading.Thread(target=orig, args=(10 * MiB, 0x6000))
            t.start()
            t.join(5)
        return res

    b.alloc = alloc
    made.drv.fail["cuMemMap"] = 1
    with pytest.raises(cpm.CUDADriverError) as e:
        p._backend_alloc(16 * MiB, SimpleNamespace(ptr=0x5000))
    assert e.value.call == "cuMemMap", e.value.call


# --------------------------------------------------------------------------------------
def test_a_size_near_size_t_max_raises_the_pools_error(made):
    """any size up to 2**64-1 passes the hot path's size check; the mapped
    backend rounds it up to the 2 MiB granularity, past size_t, and cuda.bindings
    raises a bare OverflowError converting it (checked on the real binding:
    ``cuMemCreate(2**64, prop, 0)`` and ``cuMemAddressReserve(2**64, ...)`` raise
    "Python int too large to convert to C unsigned long").  That escapes the package's
    hierarchy; the CUDA-pool path gives OutOfPoolMemoryError ("more than the device
    has") for the same size."""

    def create(size, prop, flags):
        if size > 2**64 - 1:
            raise OverflowError("Python int too large to convert to C unsigned long")
        return VmmDriver.cuMemCreate(made.drv, size, prop, flags)

    made.drv.cuMemCreate = create
    p = cpm.DevicePool(large_blocks="mapped")
    with pytest.raises(cpm.PoolmemError):
        p._backend_alloc(2**64 - 1, SimpleNamespace(ptr=0x5000))


# --------------------------------------------------------------------------------------
def test_check_access_finds_a_live_mapped_block_of_a_closed_pool(made, monkeypatch):
    """``check_access`` finds a mapped block behind a __cuda_array_interface__ view
    by its address among ``all_pools()``, which a pool leaves at ``close()`` while its
    live arrays stay valid ("Live allocations stay valid and are freed normally").  Such
    an array then passes as plain cudaMalloc memory for GPU 1 (device-level peer access),
    although its block grants GPU 1 nothing: a kernel there faults."""
    p, va, cai = a_view_of_a_mapped_block(monkeypatch)
    with pytest.raises(cpm.WrongDeviceError, match="mapped block"):
        cpm.check_access(cai, device=1)  # open pool: found
    # A live array keeps the pool from retiring: close() leaves the block mapped.
    p.n_allocs += 1
    p.close()
    assert p._backend.owns(va) and va in made.drv.mapped
    with pytest.raises(cpm.WrongDeviceError, match="mapped block"):
        cpm.check_access(cai, device=1)  # closed pool, live block: passed


# --------------------------------------------------------------------------------------
def test_set_peers_never_sets_the_access_of_another_allocation_at_a_reused_address(
    monkeypatch,
    fake_driver,
):
    """set_peers lists the blocks under the cache lock, then sets each one's access
    holding only ``_map_lock``.  A free past the threshold (or a trim) in another thread
    may unmap a listed block and free its address range meanwhile; ``_map_lock`` stops
    *this* cache from mapping there again, but not another pool (a second mapped
    DevicePool on the GPU, any VMM user in the process), and the driver hands freed
    ranges out again.  set_peers then succeeds on the other pool's block and gives it
    this pool's access: here GPU 1 revoked from pool B's block, whose kernels on GPU 1
    then fault.  (``owns`` is only asked after a *failed* call.)

    Forced switches, inside set_peers' first cuMemSetAccess: thread 2 releases pool A's
    cached block (its range freed), then thread 3 maps a block of pool B, which gets
    that range."""
    d = use_driver(fake_driver, monkeypatch, ReusingVA())
    a = _mapped.MappedBlocks(0, peers=(1,), driver=d)
    b = _mapped.MappedBlocks(0, peers=(1,), driver=d)
    a.release_threshold = b.release_threshold = 1 << 40
    a.alloc(10 * MiB, 0x5000)  # live
    cached = a.alloc(12 * MiB, 0x5000)[1]
    a.free(cached, 0x5000)
    d.done.add(d.last_event())
    real_set = d.cuMemSetAccess
    todo = [True]
    got: list[int] = []
    threads: list[threading.Thread] = []

    def set_access(va, size, descs, n):
        if todo and todo.pop():
            for fn in (lambda: a.release(0), lambda: got.append(b.alloc(12 * MiB, 0x6000)[1])):
                t = threading.Thread(target=fn)
                threads.append(t)
                t.start()
                # The release waits for set_peers (it used to unmap here); the
                # join below lets both finish after it.
                t.join(0.1)
        return real_set(va, size, descs, n)

    d.cuMemSetAccess = set_access
    a.set_peers([])  # pool A revokes GPU 1 from its blocks
    for t in threads:
        t.join(5)
    assert len(got) == 1 and b.owns(got[0])
    # (got[0] == cached when pool B's new block took the range pool A freed.)
    assert b.has_access(got[0], 1), "pool A's set_peers revoked GPU 1 on pool B's block"


# --------------------------------------------------------------------------------------
def test_close_destroys_the_idle_events_even_when_an_unmap_fails(drv):
    """BlockCache.close releases every cached block, then destroys the idle events;
    when one unmap fails, release raises (after recycling every victim's event into
    the idle list) and close never reaches the destruction.  The retirer swallows the
    error and never closes the resource again: the events leak for good."""
    destroyed: list = []
    real_destroy = drv.cuEventDestroy

    def destroy(ev):
        destroyed.append(ev)
        return real_destroy(ev)

    drv.cuEventDestroy = destroy
    b = _mapped.MappedBlocks(0, driver=drv)
    b.release_threshold = 1 << 40
    vas = [b.alloc(10 * MiB, 0x5000 + i)[1] for i in range(2)]
    for va in vas:
        b.free(va, 0x5000)
    events = {e[1] for e in drv.log if e[0] == "record"}
    assert len(events) == 2
    drv.fail["cuMemUnmap"] = 1
    with pytest.raises(cpm.CUDADriverError):
        b.close()
    assert set(destroyed) == events, f"events never destroyed: {events - set(destroyed)}"


# --------------------------------------------------------------------------------------
def test_a_request_larger_than_the_device_leaves_the_cache_of_freed_blocks_alone(made):
    """``_alloc_failed`` checks first whether a request exceeds the device ("Nothing
    to reclaim can help: say so instead of trimming everything first").  A mapped
    request reaches the backend before that check, and the backend has already given
    back every freed block whose free has run: ``_make_room`` (the request is past the
    budget) and, after cuMemCreate's CUDA_ERROR_OUT_OF_MEMORY, ``_release_quietly(0)``.
    One mistaken size (a unit or shape error, 32 GiB on a 16 GiB GPU) unmaps the whole
    cache, and the next allocations map again (~80 us each).  (The fake's cuMemCreate
    returns CUDA_ERROR_OUT_OF_MEMORY beyond the GPU's 16 GiB.)"""
    real_create = made.drv.cuMemCreate

    def create(size, prop, flags):
        if size > 1 << 34:  # more than the fake GPU has
            return OOM, None
        return real_create(size, prop, flags)

    made.drv.cuMemCreate = create
    p = cpm.DevicePool(large_blocks="mapped")
    b = p._backend
    vas = [b.alloc(64 * MiB, 0x5000)[1] for _ in range(4)]
    for va in vas:
        b.free(va, 0x5000)
    made.drv.done.update(e[1] for e in made.drv.log if e[0] == "record")
    assert b.cached == 256 * MiB
    with pytest.raises(cpm.OutOfPoolMemoryError, match="more than"):
        p._backend_alloc(32 << 30, SimpleNamespace(ptr=0x5000))
    assert b.cached == 256 * MiB and all(va in made.drv.mapped for va in vas)
