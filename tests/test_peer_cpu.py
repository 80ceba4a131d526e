"""CPU tests of peer access: option parsing, errors, grant bookkeeping, doctor rows.

A fake topology stands in for ``cudaDeviceCanAccessPeer`` (4 GPUs: 0<->1 and 2<->3 are
peers, no other pair), and fake grant functions stand in for ``cuMemPoolSetAccess``.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from fakes.driver import PointerDriver
from fakes.resources import PeerMR

import cupy_poolmem as cpm
from cupy_poolmem import _allocator, _device, _doctor, _pools, _runtime

PEERS = {(0, 1), (1, 0), (2, 3), (3, 2)}


def fake_can(dev: int, peer: int) -> bool:
    return dev == peer or (dev, peer) in PEERS


@pytest.fixture
def four_gpus(monkeypatch):
    monkeypatch.setattr(_device, "device_count", lambda: 4)
    monkeypatch.setattr(_pools.device, "device_count", lambda: 4)
    monkeypatch.setattr(_device, "can_access_peer", fake_can)
    monkeypatch.setattr(_pools.device, "sync_device", lambda dev: None)  # no driver here


@pytest.fixture
def grants(monkeypatch, four_gpus):
    """A fresh AccessGrants as the module's, with cuMemPoolSetAccess recorded."""
    calls: list[tuple[int, list[int]]] = []
    monkeypatch.setattr(_device, "grant_access", lambda h, devs: calls.append((h, list(devs))))
    g = _device.AccessGrants()
    monkeypatch.setattr(_device, "GRANTS", g)
    return g, calls


# ---------------------------------------------------------------- option parsing
@pytest.mark.parametrize(
    "value,owner,expected",
    [
        ("all", 0, (1,)),
        ("all", 2, (3,)),
        (" ALL ", 1, (0,)),
        (True, 0, (1,)),
        (None, 0, ()),
        (False, 0, ()),
        ("none", 0, ()),
        ([], 0, ()),
        ((), 3, ()),
        ([0, 1], 0, (1,)),  # the owner is ignored: it always has access
        ([1, 1], 0, (1,)),
        ({1}, 0, (1,)),
        (range(2), 1, (0,)),
        ([SimpleNamespace(id=1)], 0, (1,)),  # cupy.cuda.Device
        ([SimpleNamespace(device_id=3)], 2, (3,)),  # cuda.core Device
    ],
)
def test_resolve_peer_access_values(four_gpus, value, owner, expected):
    assert _device.resolve_peer_access(value, owner) == expected


def test_all_skips_pairs_that_cannot_and_one_gpu_has_no_peers(monkeypatch, four_gpus):
    assert _device.resolve_peer_access("all", 0) == (1,)  # 2 and 3 cannot reach GPU 0
    monkeypatch.setattr(_device, "device_count", lambda: 1)
    assert _device.resolve_peer_access("all", 0) == ()


def test_a_pair_that_cannot_access_is_refused_naming_both_gpus(four_gpus):
    with pytest.raises(cpm.UnsupportedError) as ei:
        _device.resolve_peer_access([1, 2], 0)
    msg = str(ei.value)
    assert "GPU 2 cannot access memory of GPU 0" in msg
    assert "cudaDeviceCanAccessPeer(2, 0)" in msg and "peer_access=[1, 2]" in msg
    assert isinstance(ei.value, RuntimeError)


def test_out_of_range_ordinal_is_an_invalid_option(four_gpus):
    with pytest.raises(cpm.InvalidOptionError, match=r"device 7.*4 device\(s\), ordinals 0\.\.3"):
        _device.resolve_peer_access([7], 0)
    with pytest.raises(cpm.InvalidOptionError, match="device -1"):
        _device.resolve_peer_access([-1], 0)


def test_unknown_word_is_an_invalid_option(four_gpus):
    with pytest.raises(cpm.InvalidOptionError, match=r"peer_access='some'.*'all'.*None"):
        _device.resolve_peer_access("some", 0)


@pytest.mark.parametrize("bad", [1, 1.0, b"all", {"a": 1}, object()])
def test_wrong_types_are_option_type_errors(four_gpus, bad):
    with pytest.raises(cpm.OptionTypeError, match="peer_access") as ei:
        _device.resolve_peer_access(bad, 0)
    assert isinstance(ei.value, TypeError)


def test_a_bare_ordinal_suggests_a_list(four_gpus):
    with pytest.raises(cpm.OptionTypeError, match=r"write \[1\] for one device"):
        _device.resolve_peer_access(1, 0)


@pytest.mark.parametrize("bad", [[True], [1.0], ["1"], [None]])
def test_list_items_must_be_ordinals(four_gpus, bad):
    with pytest.raises(cpm.OptionTypeError, match="ordinals"):
        _device.resolve_peer_access(bad, 0)


def test_error_names_the_option(four_gpus):
    with pytest.raises(cpm.InvalidOptionError, match="devices="):
        _device.resolve_peer_access("x", 0, name="devices")


def test_peer_topology(four_gpus):
    m = _device.peer_topology()
    assert [row[:2] for row in m[:2]] == [[True, True], [True, True]]
    assert m[0][2] is False and m[3][2] is True and len(m) == 4


# ---------------------------------------------------------------- DevicePool, set_allocator
def _fake_pool(
    device: int = 0, mr: PeerMR | None = None, small: PeerMR | None = None
) -> cpm.DevicePool:
    from cupy_poolmem import _retire

    pool = cpm.DevicePool.__new__(cpm.DevicePool)
    pool._attach(0x1000, device, _runtime.hp.KIND_DEVICE)
    pool._mr = mr or PeerMR()
    pool._mrs = (pool._mr,) if small is None else (pool._mr, small)
    resource = pool._mr if small is None else _pools._recycle.Resources(pool._mrs)
    pool._retire_token = _retire.retirer().adopt(resource)
    return pool


def test_peer_access_property_sets_and_reads_the_driver_state(four_gpus):
    pool = _fake_pool(0)
    assert pool.peer_access == ()
    pool.peer_access = "all"
    assert pool.peer_access == (1,) and pool._mr.peers == (1,)
    pool.peer_access = None  # revoke: cuda.core sends PROT_NONE for the dropped GPU
    assert pool.peer_access == () and pool._mr.peers == ()
    pool.peer_access = [0, 1]
    assert pool.peer_access == (1,)


def test_revoking_a_gpu_waits_for_its_queued_work_first(monkeypatch, four_gpus):
    """A kernel queued on GPU 1 that reads the pool's memory must finish before the
    grant goes: the setter synchronises each GPU it removes, before the driver call."""
    mr = PeerMR()
    pool = _fake_pool(2, mr)
    monkeypatch.setattr(_pools.device, "sync_device", lambda dev: mr.events.append(("sync", dev)))
    pool.peer_access = [3]  # a grant waits for nothing
    pool.peer_access = [3]  # nor does assigning what is granted already
    pool.peer_access = None
    assert mr.events == [("set", (3,)), ("set", (3,)), ("sync", 3), ("set", ())]


def test_a_failed_wait_before_revoking_keeps_the_grant_and_the_error_name(monkeypatch, four_gpus):
    pool = _fake_pool(0)
    pool.peer_access = [1]

    def fail(dev: int) -> None:
        raise cpm.CUDADriverError("cuCtxSynchronize", 700, "CUDA_ERROR_ILLEGAL_ADDRESS")

    monkeypatch.setattr(_pools.device, "sync_device", fail)
    with pytest.raises(cpm.CUDADriverError) as ei:
        pool.peer_access = None
    assert ei.value.name == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert pool.peer_access == (1,)  # nothing revoked


def test_peer_access_setter_validates_before_touching_the_pool(four_gpus):
    pool = _fake_pool(2)
    pool.peer_access = [3]
    with pytest.raises(cpm.UnsupportedError, match="GPU 0 cannot access memory of GPU 2"):
        pool.peer_access = [0, 3]
    with pytest.raises(cpm.InvalidOptionError):
        pool.peer_access = [9]
    assert pool._mr.events == [("set", (3,))]  # the failed assignments changed nothing


def test_cuda_core_refusal_becomes_unsupported_error(four_gpus):
    pool = _fake_pool(0, PeerMR(fail=ValueError("Device 0 cannot access peer(s): 1")))
    with pytest.raises(cpm.UnsupportedError, match="GPU 0's pool.*GPU\\(s\\) 1"):
        pool.peer_access = [1]


def test_driver_failure_keeps_the_cuda_error_name(four_gpus):
    err = RuntimeError("cuMemPoolSetAccess: CUDA_ERROR_INVALID_DEVICE: invalid device ordinal")
    pool = _fake_pool(0, PeerMR(fail=err))
    with pytest.raises(cpm.CUDADriverError) as ei:
        pool.peer_access = [1]
    assert ei.value.name == "CUDA_ERROR_INVALID_DEVICE"


def test_closed_and_drained_pool_refuses_new_grants(four_gpus):
    pool = _fake_pool(0)
    pool._mark_closed()
    with pytest.raises(cpm.PoolClosedError):
        pool.peer_access = [1]


def test_drained_pool_revokes_its_grants_before_closing(four_gpus, fake_retirer):
    pool = _fake_pool(0)
    pool.peer_access = [1]
    pool._close_done = True  # as close() leaves it
    pool._drained()
    assert pool._mr.events == [("set", (1,)), ("set", ())]  # closed by the retirer
    other = _fake_pool(0)  # never granted anything: no driver call before close
    other._close_done = True
    other._drained()
    assert fake_retirer.drain()
    assert pool._mr.events == [("set", (1,)), ("set", ()), ("close",)]
    assert other._mr.events == [("close",)]


def test_a_small_block_pool_gets_the_same_grants_and_goes_with_the_pool(four_gpus, fake_retirer):
    small = PeerMR()
    pool = _fake_pool(0, small=small)
    pool.peer_access = "all"
    assert pool._mr.peers == small.peers == (1,)  # memory of both pools is mapped there
    pool.peer_access = None
    assert small.events == [("set", (1,)), ("set", ())]
    pool.peer_access = [1]
    pool._close_done = True
    pool._drained()
    assert fake_retirer.drain()
    for mr in (pool._mr, small):  # both revoked before the retirer closed them
        assert mr.events[-2:] == [("set", ()), ("close",)], mr.events


def test_device_pool_checks_peer_access_before_creating_a_pool(monkeypatch, four_gpus):
    def no_pool(*a, **k):
        raise AssertionError("a pool was created before the option was checked")

    monkeypatch.setattr(_pools.device, "check_device", lambda d: 0)
    monkeypatch.setattr(_pools.device.cc, "DeviceMemoryResource", no_pool)
    with pytest.raises(cpm.UnsupportedError, match="GPU 3 cannot access memory of GPU 0"):
        cpm.DevicePool(peer_access=[3])
    with pytest.raises(cpm.InvalidOptionError):
        cpm.DevicePool(peer_access="everything")
    with pytest.raises(cpm.OptionTypeError):
        cpm.DevicePool(peer_access=1)


def test_device_pool_default_is_all():
    import inspect

    sig = inspect.signature(cpm.DevicePool.__init__)
    assert sig.parameters["peer_access"].default == "all"


def test_set_allocator_checks_every_pair_up_front(monkeypatch, four_gpus):
    monkeypatch.setattr(_allocator, "require_gpu", lambda *a: 4)

    def no_alloc(*a, **k):
        raise AssertionError("set_allocator went on after a bad peer_access")

    monkeypatch.setattr(_allocator, "PoolAllocator", no_alloc)
    # [0, 1] is fine for the pools of GPUs 0 and 1, but GPU 2's pool cannot grant GPU 0.
    with pytest.raises(cpm.UnsupportedError, match="GPU 0 cannot access memory of GPU 2"):
        cpm.set_allocator(peer_access=[0, 1])
    with pytest.raises(cpm.InvalidOptionError, match="peer_access"):
        cpm.set_allocator(peer_access="most")
    with pytest.raises(cpm.OptionTypeError, match="peer_access"):  # listed as a valid option
        cpm.set_allocator(peer_acess="all")


def test_set_allocator_defaults_to_all(monkeypatch, four_gpus):
    seen = {}

    class Stop(Exception):
        pass

    def capture(factory, kind):
        seen["factory"] = factory
        raise Stop

    monkeypatch.setattr(_allocator, "require_gpu", lambda *a: 4)
    monkeypatch.setattr(_allocator, "PoolAllocator", capture)

    class Spy(cpm.DevicePool):  # DevicePool's signature; calling it returns the options
        def __new__(cls, **kw):
            return kw

    monkeypatch.setattr(_allocator, "DevicePool", Spy)
    with pytest.raises(Stop):
        cpm.set_allocator()
    assert seen["factory"](1)["peer_access"] == "all"
    with pytest.raises(Stop):
        cpm.set_allocator(peer_access=None)
    assert seen["factory"](1)["peer_access"] is None


# ---------------------------------------------------------------- grants to imported pools
def test_ensure_access_grants_once_per_pool_and_device(grants):
    g, calls = grants
    _device.ensure_access(0xA0, 1, 0)
    _device.ensure_access(0xA0, 1, 0)
    assert calls == [(0xA0, [1])]
    _device.ensure_access(0xB0, 1, 0)  # another pool: its own grant
    _device.ensure_access(0xA0, 0, 0)  # the pool's own GPU: nothing to do
    assert calls == [(0xA0, [1]), (0xB0, [1])]
    assert _device.granted_access() == {0xA0: (1,), 0xB0: (1,)}


def test_ensure_access_refuses_a_pair_that_cannot_naming_both(grants):
    g, calls = grants
    with pytest.raises(cpm.UnsupportedError) as ei:
        _device.ensure_access(0xA0, 2, 0)
    assert "GPU 2 cannot access memory of GPU 0" in str(ei.value)
    assert calls == []
    _device.ensure_access(0xA0, 1, 0)  # a capable GPU still gets its grant
    assert calls == [(0xA0, [1])]


def test_a_failed_grant_is_not_recorded(monkeypatch, grants):
    g, calls = grants
    fail = [True]

    def flaky(h, devs):
        if fail[0]:
            raise cpm.CUDADriverError("cuMemPoolSetAccess", 101, "CUDA_ERROR_INVALID_DEVICE")
        calls.append((h, list(devs)))

    monkeypatch.setattr(_device, "grant_access", flaky)
    with pytest.raises(cpm.CUDADriverError, match="CUDA_ERROR_INVALID_DEVICE"):
        _device.ensure_access(0xA0, 1, 0)
    fail[0] = False
    _device.ensure_access(0xA0, 1, 0)
    assert calls == [(0xA0, [1])]


def test_ensure_access_from_many_threads_grants_once(monkeypatch, grants):
    g, calls = grants
    gate = threading.Barrier(16)

    def slow_grant(h, devs):
        calls.append((h, list(devs)))

    monkeypatch.setattr(_device, "grant_access", slow_grant)
    errors = []

    def worker():
        try:
            gate.wait()
            _device.ensure_access(0xC0, 3, 2)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors and calls == [(0xC0, [3])]


def test_ensure_peer_access_grants_all_capable_in_one_call(grants):
    g, calls = grants
    assert _device.ensure_peer_access(0xD0, 2) == (3,)
    assert _device.ensure_peer_access(0xD0, 2) == (3,)
    _device.ensure_access(0xD0, 3, 2)
    assert calls == [(0xD0, [3])]
    assert _device.ensure_peer_access(0xE0, 0, peer_access=None) == ()
    assert calls == [(0xD0, [3])]
    with pytest.raises(cpm.UnsupportedError, match="GPU 1 cannot access memory of GPU 2"):
        _device.ensure_peer_access(0xD0, 2, peer_access=[1])


def test_host_pools_need_no_peer_path(grants):
    g, calls = grants
    assert _device.resolve_peer_access("all", -1) == (0, 1, 2, 3)
    assert _device.resolve_peer_access([0, 2], -1) == (0, 2)
    assert _device.ensure_peer_access(0xF0, -1) == (0, 1, 2, 3)
    _device.ensure_access(0xF1, 2, -1)
    assert calls == [(0xF0, [0, 1, 2, 3]), (0xF1, [2])]


def test_forget_access_makes_the_next_grant_real(grants):
    g, calls = grants
    _device.ensure_access(0xA0, 1, 0)
    _device.forget_access(0xA0)
    assert _device.granted_access() == {}
    _device.ensure_access(0xA0, 1, 0)
    assert calls == [(0xA0, [1]), (0xA0, [1])]


# ---------------------------------------------------------------- up-front checks
@pytest.fixture
def access(monkeypatch, four_gpus):
    granted: set[tuple[int, int]] = set()
    queries: list = []

    def fake_has(pool, dev):
        queries.append((pool, dev))
        return (pool, dev) in granted

    monkeypatch.setattr(_device, "has_access", fake_has)
    return granted, queries


def test_require_access_distinguishes_no_grant_from_no_hardware(access):
    granted, queries = access
    _device.require_access(0xA0, 0, 0)  # own GPU: no query
    assert queries == []
    with pytest.raises(cpm.WrongDeviceError) as ei:
        _device.require_access(0xA0, 0, 1, "memory of x")
    msg = str(ei.value)
    assert "memory of x on GPU 0 is not accessible from GPU 1" in msg
    assert "cudaErrorIllegalAddress" in msg and "peer_access" in msg
    assert isinstance(ei.value, ValueError)
    with pytest.raises(cpm.UnsupportedError, match="GPU 2 cannot access memory of GPU 0"):
        _device.require_access(0xA0, 0, 2)
    granted.add((0xA0, 1))
    _device.require_access(0xA0, 0, 1)


def test_require_access_on_a_pinned_pool_names_its_devices_option(access):
    granted, _ = access
    with pytest.raises(cpm.WrongDeviceError, match=r"PinnedPool with devices=\[\.\.\., 3\]"):
        _device.require_access(0xF0, -1, 3)
    granted.add((0xF0, 3))
    _device.require_access(0xF0, -1, 3)


@pytest.fixture
def pointers(monkeypatch, access):
    info: dict[int, tuple[int, int, bool]] = {}
    asked: list[int] = []

    class NoBind:
        def __init__(self, dev):
            pass

        def __enter__(self):
            return None

        def __exit__(self, *exc):
            return None

    def fake_info(ptr):
        asked.append(ptr)
        return info[ptr]

    monkeypatch.setattr(_device, "check_device", lambda d, name="device": 1 if d is None else d)
    monkeypatch.setattr(_device, "on_device", NoBind)
    monkeypatch.setattr(_device, "pointer_info", fake_info)
    return info, asked, access[0]


def _cupy_like(ptr: int):
    return SimpleNamespace(data=SimpleNamespace(ptr=ptr))


def test_check_access_on_pool_memory(pointers):
    info, asked, granted = pointers
    info[0x100] = (0, 0xA0, False)  # GPU 0's pool 0xA0
    granted.add((0xA0, 0))  # a pool's own GPU always has access (what the driver says)
    with pytest.raises(cpm.WrongDeviceError, match="GPU 0 is not accessible from GPU 1"):
        cpm.check_access(_cupy_like(0x100))  # default: the current device (1 here)
    cpm.check_access(_cupy_like(0x100), device=0)
    granted.add((0xA0, 1))
    cpm.check_access(_cupy_like(0x100), device=1)
    with pytest.raises(cpm.UnsupportedError, match="GPU 3 cannot access memory of GPU 0"):
        cpm.check_access(_cupy_like(0x100), device=3)


def test_check_access_when_the_driver_names_the_wrong_gpu(pointers):
    """2 x H200, driver 580: CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL said 0 for memory of a
    GPU 1 pool with peer_access=None, so check_access(x, device=0) passed and a kernel on
    GPU 0 would have faulted with cudaErrorIllegalAddress."""
    info, _, granted = pointers
    info[0x500] = (0, 0xB0, False)  # the driver says GPU 0; the pool is GPU 1's
    granted.add((0xB0, 1))
    with pytest.raises(cpm.WrongDeviceError, match="GPU 1 is not accessible from GPU 0"):
        cpm.check_access(_cupy_like(0x500), device=0)  # found from the pool's access
    on_gpu1 = SimpleNamespace(data=SimpleNamespace(ptr=0x500, device_id=1))
    with pytest.raises(cpm.WrongDeviceError, match="GPU 1 is not accessible from GPU 0"):
        cpm.check_access(on_gpu1, device=0)  # CuPy's own record of the array's GPU
    cpm.check_access(on_gpu1, device=1)
    info[0x600] = (0, 0xB1, False)  # a pool nobody can use (closed under us)
    with pytest.raises(cpm.WrongDeviceError, match="grants that GPU no access"):
        cpm.check_access(_cupy_like(0x600), device=0)
    granted.add((0xB0, 0))
    cpm.check_access(on_gpu1, device=0)  # granted now


def test_check_access_on_other_memory(pointers):
    info, asked, _ = pointers
    info[0x200] = (-2, 0, True)  # managed: every GPU
    cpm.check_access(_cupy_like(0x200), device=3)
    info[0x300] = (0, 0, False)  # cudaMalloc: device-level peer access, CuPy enables it
    cpm.check_access(_cupy_like(0x300), device=1)
    with pytest.raises(cpm.UnsupportedError):
        cpm.check_access(_cupy_like(0x300), device=2)
    info[0x400] = (-1, 0xF0, False)  # a pinned pool, through __cuda_array_interface__
    arr = SimpleNamespace(__cuda_array_interface__={"data": (0x400, False)})
    with pytest.raises(cpm.WrongDeviceError, match="PinnedPool"):
        cpm.check_access(arr, device=2)
    cpm.check_access(_cupy_like(0), device=2)  # empty array: nothing to check
    assert 0 not in asked
    with pytest.raises(cpm.OptionTypeError, match="check_access"):
        cpm.check_access([1, 2, 3], device=1)


def test_pointer_info_classifies_memory(fake_driver):
    drv = fake_driver(PointerDriver())
    drv.add(0x10, managed=True)
    drv.add(0x20, mtype=drv.UNIFIED)
    drv.add(0x30, mtype=drv.HOST, pool=0xF0)
    drv.add(0x40, pool=0xA0, ordinal=1)
    drv.add(0x50, ordinal=3)  # cudaMalloc: no pool
    drv.add(0x60, valid=False)  # pageable host memory
    assert _device.pointer_info(0x10) == (-2, 0, True)
    assert _device.pointer_info(0x20) == (-2, 0, True)
    assert _device.pointer_info(0x30) == (-1, 0xF0, False)
    assert _device.pointer_info(0x40) == (1, 0xA0, False)
    assert _device.pointer_info(0x50) == (3, 0, False)
    with pytest.raises(cpm.InvalidOptionError, match="0x60 is not CUDA memory"):
        _device.pointer_info(0x60)


# ---------------------------------------------------------------- doctor
def test_doctor_peer_table():
    rows = _doctor._peer_rows([[True, True, False], [True, True, False], [False, False, True]])
    text = "\n".join(rows)
    assert "cudaDeviceCanAccessPeer" in text
    assert rows[2].split() == ["GPU", "0", "-", "yes", "NO"]
    assert rows[4].split() == ["GPU", "2", "NO", "NO", "-"]
    assert "UnsupportedError" in text
    assert _doctor._peer_rows([[True]]) == ["  peer access: one GPU, nothing to grant"]
    assert "NO" not in "\n".join(_doctor._peer_rows([[True, True], [True, True]]))


def test_doctor_reports_what_pools_grant():
    def pool(kind, desc, **kw):
        return SimpleNamespace(_kind_name=kind, _describe=lambda: desc, **kw)

    class Broken:
        _kind_name = "device"
        device_id = 0

        def _describe(self):
            return "DevicePool(device=0)"

        @property
        def peer_access(self):
            raise RuntimeError("closed")

    rows = _doctor._access_rows(
        [
            pool("device", "DevicePool(device=0)", device_id=0, peer_access=(1, 2)),
            pool("device", "DevicePool(device=1)", device_id=1, peer_access=()),
            pool("pinned", "PinnedPool(numa_node=0)", devices=[0, 1]),
            pool("managed", "ManagedPool(device=0)", device_id=0),
            Broken(),
        ],
        {0xA0: (1,), 0xB0: (0, 2)},
    )
    text = "\n".join(rows)
    assert "DevicePool(device=0): GPU 0 and peers 1, 2" in text
    assert "DevicePool(device=1): GPU 1 only" in text
    assert "PinnedPool(numa_node=0): GPUs 0, 1" in text
    assert "ManagedPool(device=0): every GPU" in text
    assert "unknown (RuntimeError: closed)" in text
    assert "imported pools: 2 with grants to other GPUs (3 in all)" in text
    assert "no pool alive" in "\n".join(_doctor._access_rows([], {}))
