"""A DevicePool's small-block pool: which CUDA pool each block comes from, and the
pool-wide operations (statistics, trim, peak reset, release threshold, retirement)
covering both CUDA pools.

They drive the pure-Python hot path (the twin) against tests/fakes/hotpath.World; the
compiled hot path's choice is checked on a GPU (tests/test_pools_gpu.py), and
test_hotpath_cpu.py checks that both have ``_attach_small``.
"""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import pytest

import cupy_poolmem as cpm
import cupy_poolmem._sharing  # noqa: F401  (sharing hooks into the real hot path first)
from cupy_poolmem import _driver, _pools

pytestmark = pytest.mark.filterwarnings("ignore:ExternalStream is deprecated")

MiB = 1 << 20
MAIN, SMALL = 0xABC, 0xDEF
UUID_MAIN, UUID_SMALL = str(uuid.UUID(int=MAIN)), str(uuid.UUID(int=SMALL))


@pytest.fixture
def world(fake_retirer, twin_world):
    twin_world.retirer = fake_retirer
    return twin_world


def _mrs(p):
    main, small = p._mrs
    return main, small


@pytest.mark.parametrize(
    ("size", "pool"),
    [(1, SMALL), (4096, SMALL), (8 * MiB, SMALL), (8 * MiB + 1, MAIN), (64 * MiB, MAIN)],
)
def test_blocks_up_to_the_limit_come_from_the_small_pool(world, size, pool):
    p = world.pool(small=8 * MiB, reuse_cache=0)
    m = p.malloc(size)
    assert world.alloc_pools == [pool]
    assert p.small_max == 8 * MiB and p.small_pool == 8 * MiB
    del m


def test_without_a_small_pool_every_block_comes_from_the_one_pool(world):
    p = world.pool(reuse_cache=0)
    ms = [p.malloc(n) for n in (1, 4096, 8 * MiB, 64 * MiB)]
    assert world.alloc_pools == [MAIN] * 4 and p.small_pool == 0
    assert p._mrs == (p._mr,)
    del ms


def test_size_zero_touches_no_pool(world):
    p = world.pool(small=8 * MiB)
    m = p.malloc(0)
    assert world.alloc_pools == [] and m.ptr == 0


def test_the_out_of_memory_retry_asks_the_same_pool(world):
    p = world.pool(small=MiB, reuse_cache=0)
    assert p._try_alloc(4096, 0x5000)[0] == 0
    assert p._try_alloc(2 * MiB, 0x5000)[0] == 0
    assert world.alloc_pools == [SMALL, MAIN]


def test_a_cached_small_block_is_reused_for_its_size(world):
    p = world.pool(small=MiB, reuse_cache=64 * MiB)
    m = p.malloc(4096)
    ptr = m.ptr
    del m
    m = p.malloc(4096)  # from the reuse cache: no driver call
    assert m.ptr == ptr and world.alloc_pools == [SMALL]


def test_statistics_sum_both_pools(world):
    p = world.pool(small=MiB)
    main, small = _mrs(p)
    main.attributes.reserved_mem_current, main.attributes.reserved_mem_high = 64 * MiB, 96 * MiB
    small.attributes.reserved_mem_current, small.attributes.reserved_mem_high = 32 * MiB, 32 * MiB
    st = p.stats()
    assert (st.reserved_bytes, st.peak_reserved_bytes) == (96 * MiB, 128 * MiB)
    main.attributes.used_mem_current, small.attributes.used_mem_current = 3, 4
    assert p._safe_used() == 7


def test_the_recorder_reads_the_reserved_bytes_of_both_pools(world):
    from cupy_poolmem import stats

    p = world.pool(small=MiB)
    main, small = _mrs(p)
    main.attributes.reserved_mem_current, small.attributes.reserved_mem_current = 64, 32
    assert stats._reserved(p) == 96


def test_trim_trims_both_and_keeps_the_bytes_asked_for_in_all(world, monkeypatch):
    p = world.pool(small=MiB)
    main, small = _mrs(p)
    main.attributes.reserved_mem_current = 128 * MiB
    small.attributes.reserved_mem_current = 32 * MiB
    trims = []

    def trim_to(pool, keep):  # the driver keeps ``keep`` bytes (or what it has)
        mr = main if int(pool) == MAIN else small
        mr.attributes.reserved_mem_current = min(mr.attributes.reserved_mem_current, keep)
        trims.append((int(pool), keep))
        return (0,)

    monkeypatch.setattr(_driver.get(), "cuMemPoolTrimTo", trim_to, raising=False)
    assert p.trim(keep=48 * MiB) == 112 * MiB  # 160 MiB reserved, 48 kept
    # The main pool keeps what the small one does not already: 48 - 32 = 16 MiB; the
    # small pool then keeps 48 - 16 = 32 MiB (all it has).
    assert trims == [(MAIN, 16 * MiB), (SMALL, 32 * MiB)]
    trims.clear()
    assert p.trim() == 48 * MiB
    assert trims == [(MAIN, 0), (SMALL, 0)]


def test_reset_peak_and_the_release_threshold_cover_both_pools(world, monkeypatch):
    p = world.pool(small=MiB)
    set_attrs = []
    monkeypatch.setattr(world.tp._driver, "set_attr", lambda mr, attr, v: set_attrs.append((mr, v)))
    p.reset_peak()
    assert [mr.handle for mr, _ in set_attrs] == [MAIN, MAIN, SMALL, SMALL]
    set_attrs.clear()
    p.set_release_threshold(0)
    assert [(mr.handle, v) for mr, v in set_attrs] == [(MAIN, 0), (SMALL, 0)]


def test_a_drained_pool_retires_both_cuda_pools_together(world):
    p = world.pool(small=MiB)
    main, small = _mrs(p)
    closed = []
    main.close = lambda: closed.append(MAIN)
    small.close = lambda: closed.append(SMALL)
    m = p.malloc(4096)
    p.close()
    assert closed == []  # a live block: nothing retired yet
    del m
    assert world.retirer.drain()
    assert closed == [MAIN, SMALL]


def test_resources_close_every_pool_even_when_one_fails():
    closed = []

    def boom():
        closed.append("main")
        raise RuntimeError("CUDA_ERROR_INVALID_VALUE")

    r = _pools._recycle.Resources(
        (SimpleNamespace(close=boom), SimpleNamespace(close=lambda: closed.append("small")))
    )
    with pytest.raises(RuntimeError, match="CUDA_ERROR_INVALID_VALUE"):
        r.close()
    assert closed == ["main", "small"]


def test_the_pool_that_owns_a_handle_is_found_by_either_handle(world):
    p = world.pool(small=MiB)
    assert p._owns_handle(MAIN) and p._owns_handle(SMALL) and not p._owns_handle(0x123)


# ------------------------------------------------------------------ the option itself
@pytest.mark.parametrize(
    ("value", "max_size", "want"),
    [
        ("auto", 0, _pools.SMALL_POOL_AUTO),
        ("auto", 1 << 30, 0),
        (None, 0, 0),
        (0, 0, 0),
        ("1MiB", 0, MiB),
        (4096, 0, 4096),
    ],
)
def test_small_pool_size_rule(value, max_size, want):
    assert _pools._options.small_pool_size(value, max_size) == want


def test_an_explicit_small_pool_with_max_size_is_refused_naming_the_fix():
    with pytest.raises(cpm.InvalidOptionError) as ei:
        _pools._options.small_pool_size("2MiB", 1 << 30)
    msg = str(ei.value)
    assert "small_pool='2MiB'" in msg and "max_size=1.00 GiB" in msg and "small_pool=None" in msg


@pytest.mark.parametrize("bad", ["lots", -1, 1.5j])
def test_a_bad_small_pool_value_raises_a_typed_error(bad):
    with pytest.raises(cpm.PoolmemError) as ei:
        _pools._options.small_pool_size(bad, 0)
    assert "small_pool" in str(ei.value)


def test_device_pool_checks_small_pool_before_creating_a_cuda_pool(monkeypatch):
    from fakes.hotpath import fake_device_pools

    def no_pool(*a, **k):
        raise AssertionError("a CUDA pool was created before the option was checked")

    fake_device_pools(monkeypatch, no_pool)
    with pytest.raises(cpm.InvalidOptionError, match="small_pool"):
        cpm.DevicePool(max_size="1GiB", small_pool="1MiB", peer_access=None)
    with pytest.raises(cpm.OptionTypeError, match="small_pool"):
        cpm.DevicePool(small_pool=[1], peer_access=None)


# ------------------------------------------------------------------ sharing (ipc=True)
def _driver_says_pool(world, monkeypatch, answer=None):
    """``cuPointerGetAttribute(MEMPOOL_HANDLE, ptr)`` answered from the fake driver's
    allocations (or ``answer(ptr)``); the calls are listed in the returned list."""
    calls = []

    def get(attr, ptr):
        calls.append(int(ptr))
        if answer is not None:
            return answer(int(ptr))
        allocs = [e[1] for e in world.log if e[0] == "alloc"]
        owner = dict(zip(allocs, world.alloc_pools))
        return 0, owner.get(int(ptr), 0x999)

    monkeypatch.setattr(_driver.get(), "cuPointerGetAttribute", get)
    return calls


def test_an_ipc_pool_shares_both_cuda_pools_and_exports_their_handles_at_setup(world):
    p = world.pool(small=8 * MiB, ipc=True)
    assert [u for _, u, _ in p._ipc_pools] == [UUID_MAIN, UUID_SMALL]
    assert p._pool_uuid == UUID_MAIN
    assert sorted(world.handles_read) == [MAIN, SMALL]  # not in the middle of a first send


def test_each_block_is_shared_under_the_cuda_pool_the_driver_says_holds_it(world, monkeypatch):
    p = world.pool(small=8 * MiB, ipc=True, reuse_cache=0)
    calls = _driver_says_pool(world, monkeypatch)
    small, large = p.malloc(8 * MiB), p.malloc(8 * MiB + 1)
    uuid, mr = p._ipc_pool_of(small.ptr)
    assert uuid == UUID_SMALL and mr.allocation_handle == SMALL + 1000
    uuid, mr = p._ipc_pool_of(large.ptr)
    assert uuid == UUID_MAIN and mr.allocation_handle == MAIN + 1000
    assert calls == [small.ptr, large.ptr]
    del small, large


def test_a_handle_the_caller_read_already_is_not_asked_again(world, monkeypatch):
    p = world.pool(small=8 * MiB, ipc=True, reuse_cache=0)
    calls = _driver_says_pool(world, monkeypatch)
    m = p.malloc(4096)
    assert p._ipc_pool_of(m.ptr, SMALL)[0] == UUID_SMALL and calls == []
    del m


def test_a_pool_with_one_cuda_pool_asks_the_driver_nothing(world, monkeypatch):
    p = world.pool(ipc=True, reuse_cache=0)
    calls = _driver_says_pool(world, monkeypatch)
    m = p.malloc(4096)
    assert p._ipc_pool_of(m.ptr)[0] == UUID_MAIN and calls == []
    del m


def test_a_pointer_of_another_pool_is_refused_naming_both(world, monkeypatch):
    p = world.pool(small=8 * MiB, ipc=True)
    _driver_says_pool(world, monkeypatch)
    with pytest.raises(cpm.SharingError) as ei:
        p._ipc_pool_of(0x7000)
    assert "0x7000" in str(ei.value) and "0x999" in str(ei.value)


def test_a_driver_error_keeps_its_cuda_name(world, monkeypatch):
    from cuda.bindings import driver

    p = world.pool(small=8 * MiB, ipc=True)
    err = driver.CUresult.CUDA_ERROR_INVALID_VALUE
    _driver_says_pool(world, monkeypatch, answer=lambda ptr: (err, None))
    with pytest.raises(cpm.CUDADriverError, match="CUDA_ERROR_INVALID_VALUE"):
        p._ipc_pool_of(0x7000)


def test_a_pool_without_ipc_refuses_to_share_naming_the_fix(world):
    p = world.pool(small=8 * MiB)
    assert p._ipc_pools == ()
    with pytest.raises(cpm.SharingError, match="ipc=True"):
        p._ipc_pool_of(0x7000)


def test_a_numba_handle_names_the_cuda_pool_that_holds_the_block(tp, world, monkeypatch):
    import cuda.core

    from cupy_poolmem import numba as cpn

    p = world.pool(small=8 * MiB, ipc=True, reuse_cache=0)
    _driver_says_pool(world, monkeypatch)
    monkeypatch.setattr(cpn, "DevicePool", tp.DevicePool)
    record = SimpleNamespace(reserved=list(range(64)))
    monkeypatch.setattr(_driver.get(), "cuMemPoolExportPointer", lambda ptr: (0, record))
    monkeypatch.setattr(cuda.core, "Device", lambda dev: SimpleNamespace(uuid="GPU-x"))
    for size, handle in ((4096, SMALL), (8 * MiB + 1, MAIN)):
        m = p.malloc(size)
        h = cpn.PoolIpcHandle._export(p, SimpleNamespace(size=size), m.ptr, size, 0, None)
        assert h.pool_uuid == uuid.UUID(int=handle) and h._export_fd == handle + 1000
        del m
    # The exporting process finds the pool, and the handle to check grants on, by uuid.
    assert cpn._pool_uuids(p) == {uuid.UUID(int=MAIN): MAIN, uuid.UUID(int=SMALL): SMALL}
