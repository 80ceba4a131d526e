"""``DevicePool(large_blocks="expandable" or "mapped", ipc=True)``: accepted, its
physical memory created exportable, and only for such a pool (docs/sharing.rst, "Mapped
and expandable blocks")."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fakes import expandable as fx
from fakes import mapped as fm
from fakes.steps import FD

import cupy_poolmem as cpm
from cupy_poolmem import _driver, _pools
from cupy_poolmem._sharing._steps import StepExports

drv = fx.drv
made = fx.made
NONE = 0  # CU_MEM_HANDLE_TYPE_NONE
MiB = 1 << 20


@pytest.fixture
def mapped_made(monkeypatch, fake_retirer, drv, made):
    """Both placements on the fake driver; CUDA pools that an ipc=True pool can export."""
    out = fm.made.__wrapped__(monkeypatch, fake_retirer, drv)
    make = _pools.device.cc.DeviceMemoryResource

    def shareable(dev, opts):
        m = make(dev, opts)
        m.allocation_handle, m.uuid = 3, f"pool-{m.handle}"
        return m

    monkeypatch.setattr(_pools.device.cc, "DeviceMemoryResource", shareable)
    return out


@pytest.mark.parametrize("ipc", [False, True])
@pytest.mark.parametrize("mode", ["expandable", "mapped"])
def test_the_memory_is_created_exportable_only_for_an_ipc_pool(mapped_made, monkeypatch, mode, ipc):
    p = cpm.DevicePool(large_blocks=mode, ipc=ipc)
    assert p.ipc is ipc and p.large_blocks == mode
    assert p._backend.exportable is ipc
    assert p._backend._prop.requestedHandleTypes == (FD if ipc else NONE)
    assert mapped_made.mrs and all(m.is_ipc_enabled is ipc for m in mapped_made.mrs)
    p.close()


@pytest.mark.parametrize("mode", ["expandable", "mapped"])
def test_a_block_of_such_a_pool_travels_as_steps_and_never_as_a_cuda_pools_block(
    mapped_made, monkeypatch, mode
):
    p = cpm.DevicePool(large_blocks=mode, ipc=True)
    err, ptr = p._backend.alloc(12 << 20, 0x5000)
    assert err == 0
    assert p._steps_of(ptr) is p._backend  # the exporter sends its steps
    assert p._steps_of(ptr + (1 << 40)) is None  # not its memory
    # A Numba IPC handle names a CUDA pool: refused with the way out named
    with pytest.raises(cpm.SharingError, match=f"large_blocks='{mode}'.*Numba IPC handle"):
        p._ipc_pool_of(ptr)
    p._backend.free(ptr, 0x5000)
    p.close()


@pytest.mark.parametrize("mode", ["expandable", "mapped"])
def test_a_plain_pools_placement_is_never_sent_as_steps(mapped_made, monkeypatch, mode):
    p = cpm.DevicePool(large_blocks=mode, ipc=False)
    err, ptr = p._backend.alloc(12 << 20, 0x5000)
    assert err == 0
    assert p._steps_of(ptr) is None  # not exportable memory: no steps travel
    p._backend.free(ptr, 0x5000)
    p.close()


@pytest.mark.parametrize("way", ["trim", "out-of-memory retry"])
def test_a_pools_trim_and_oom_retry_keep_a_step_a_receiver_maps(mapped_made, drv, monkeypatch, way):
    monkeypatch.setattr(_driver.get(), "cuMemPoolTrimTo", lambda pool, keep: (0,))
    p = cpm.DevicePool(large_blocks="expandable", ipc=True)
    p._synchronize = lambda: None
    b = p._backend
    book = StepExports(drv)
    b.set_pins(book.pins_for(b))
    ptrs = [b.alloc(20 * MiB, 0x5000)[1] for _ in range(3)]
    ((sid, va, _n),) = b.steps_under(ptrs[1], 20 * MiB)
    book.mapped(1, b, [sid])  # a receiver maps the middle step
    for ptr in ptrs:
        b.free(ptr, 0x5000)
    if way == "trim":
        assert p.trim() == 20 * MiB  # the top step only
    else:
        p._reclaim()  # what an allocation that ran out of memory does before it retries
    assert va in drv.mapped and b.reserved == 40 * MiB
    book.drop_peer(1)  # the receiver is gone
    assert p.trim() == 40 * MiB and drv.mapped == {}
    p.close()


@pytest.mark.parametrize("mode", ["expandable", "mapped"])
def test_numbas_ipc_handle_of_such_a_block_is_refused_with_the_way_out(mapped_made, drv, mode):
    """The Numba plugin's ``get_ipc_handle``: the block is in no CUDA pool (the driver
    names none), yet it is the pool's memory: the plugin refuses it with the pool's
    own message instead of taking Numba's legacy path, which cannot export it."""
    cpn = pytest.importorskip("cupy_poolmem.numba", exc_type=ImportError)
    p = cpm.DevicePool(large_blocks=mode, ipc=True)
    err, ptr = p._backend.alloc(12 * MiB, 0x5000)
    assert err == 0
    drv.CUpointer_attribute = SimpleNamespace(CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE=17)
    drv.cuPointerGetAttribute = lambda attr, ptr: (1, None)  # in no CUDA pool
    mgr = cpn.PoolmemNumbaManager(context=None)
    mgr.allocations[ptr] = object()  # as memalloc records the allocation
    view = SimpleNamespace(
        handle=ptr + 4096, owner=SimpleNamespace(device_pointer_value=ptr, size=12 * MiB)
    )
    with pytest.raises(cpm.SharingError, match=f"large_blocks='{mode}'.*Numba IPC handle") as ei:
        mgr.get_ipc_handle(view)
    assert "multiprocessing" in str(ei.value)  # the way out
    p._backend.free(ptr, 0x5000)
    p.close()


@pytest.mark.parametrize("mode", ["expandable", "mapped", "pool"])
def test_a_pool_sent_to_another_process_is_refused_naming_what_travels(mapped_made, mode):
    """A pool is this process's memory: pickling it (a spawn or forkserver Process's
    arguments) says to send its arrays, or to make a pool there, instead of failing on
    a lock inside it."""
    import multiprocessing.reduction as mpr
    import pickle

    p = cpm.DevicePool(large_blocks=mode, ipc=True)
    for dumps in (pickle.dumps, mpr.ForkingPickler.dumps):
        with pytest.raises(cpm.SharingError, match="cannot be sent to another process") as ei:
            dumps(p)
        assert f"large_blocks={mode!r}" in str(ei.value) or mode == "pool"
        assert "send arrays allocated from it" in str(ei.value)
    p.close()
