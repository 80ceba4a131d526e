"""The driver seam: every module calls the driver (and CuPy's runtime, and cuda.core)
the provider ``cupy_poolmem._driver`` hands out; ``use`` replaces it for all of them and
gives the previous one back; the ``fake_driver`` fixture undoes what a test handed in."""

from __future__ import annotations

import threading

import cuda.bindings.driver
import cuda.core
import cupy
import pytest
from fakes.driver import DriverSeat, PassThrough

import cupy_poolmem as cpm
from cupy_poolmem import _block_cache, _device, _driver, _pools, _streams


class Capturing(PassThrough):
    """Says every stream captures; counts the calls it answers."""

    def __init__(self) -> None:
        self.calls = 0

    def cuStreamIsCapturing(self, s):  # noqa: N802
        self.calls += 1
        return 0, _streams.CAPTURE_ACTIVE

    def cuEventQuery(self, ev):  # noqa: N802
        self.calls += 1
        return (0,)


def test_the_real_driver_is_cuda_bindings_loaded_once():
    assert _driver.get() is cuda.bindings.driver
    assert _driver.PROVIDER.driver is cuda.bindings.driver  # kept, not looked up again
    assert _driver.get() is _driver.get()
    assert _driver.runtime() is cupy.cuda.runtime
    assert _driver.core() is cuda.core


def test_a_fake_handed_in_is_what_every_module_calls_and_use_gives_the_old_one_back():
    fake = Capturing()
    previous = _driver.use(fake)
    try:
        assert previous in (None, cuda.bindings.driver)
        assert _streams.capture_status(0x5000) == _streams.CAPTURE_ACTIVE  # _streams
        assert _block_cache.BlockCache._done("ev") is True  # the block cache
        assert _pools._driver.drv() is fake  # the pools
        assert fake.calls == 2
        # another thread sees it too: the driver is the process's
        seen = []
        t = threading.Thread(target=lambda: seen.append(_driver.get()))
        t.start()
        t.join(5)
        assert seen == [fake]
    finally:
        assert _driver.use(previous) is fake
    assert _driver.get() is cuda.bindings.driver
    assert _pools._driver.drv() is cuda.bindings.driver


def test_use_none_brings_the_real_driver_back():
    old = _driver.use(object())
    assert _driver.use(None) is not None
    assert _driver.get() is cuda.bindings.driver
    _driver.use(old)


def test_the_twin_pools_call_the_same_provider(tp):
    """The pools loaded a second time (over the twin hot path) share the one provider:
    a fake handed in once is seen by both copies."""
    fake = Capturing()
    seat = DriverSeat()
    try:
        seat(fake)
        assert tp._driver.drv() is fake and _pools._driver.drv() is fake
    finally:
        seat.restore()
    assert tp._driver.drv() is cuda.bindings.driver


def test_a_seat_undoes_stacked_fakes_in_order():
    before = (_driver.get(), _driver.runtime())
    seat = DriverSeat()
    a, b, rt = Capturing(), Capturing(), object()
    assert seat(a) is a and _driver.get() is a
    assert seat.runtime(rt) is rt and _driver.runtime() is rt
    assert seat(b) is b and _driver.get() is b
    seat.restore()
    assert (_driver.get(), _driver.runtime()) == before
    seat.restore()  # twice: nothing left to undo
    assert (_driver.get(), _driver.runtime()) == before


def test_the_fixture_hands_the_fake_to_the_device_helpers(fake_driver):
    class NoPointer(PassThrough):
        def cuPointerGetAttribute(self, attr, ptr):  # noqa: N802
            return (cuda.bindings.driver.CUresult.CUDA_ERROR_INVALID_VALUE, None)

    fake_driver(NoPointer())
    with pytest.raises(cpm.InvalidOptionError, match="0x1234 is not CUDA memory"):
        _device.pointer_info(0x1234)


def test_sharing_numba_and_the_guard_call_the_driver_the_provider_hands_out(fake_driver):
    """The sharing protocol's Driver, the Numba plugin's pointer lookups and the guard's
    device work ask the provider at each call: a fake handed in after they were made
    (or imported) is the one they call, and the real one is back once it is gone."""
    from cupy_poolmem._guard.device_ops import DeviceOps
    from cupy_poolmem._sharing._driver import Driver

    cpn = pytest.importorskip("cupy_poolmem.numba", reason="needs numba-cuda ('.[numba]')")
    sharing, ops = Driver(), DeviceOps(0)  # made while the real driver is in place

    class Answers(Capturing):
        def cuPointerGetAttribute(self, attr, ptr):  # noqa: N802
            self.calls += 1
            return 0, 0xABC if int(ptr) == 0x7000 else None

        def cuStreamGetFlags(self, s):  # noqa: N802
            self.calls += 1
            return 0, 1  # CU_STREAM_NON_BLOCKING

    fake = fake_driver(Answers())
    assert sharing.event_done(object()) is True  # cuEventQuery answered (0,) by the fake
    assert cpn._pointer_pool(0x7000) == 0xABC and cpn._pointer_pool(0x8000) == 0
    assert ops.non_blocking(0x5000) is True
    assert fake.calls == 4
    fake_driver.restore()
    assert _driver.get() is cuda.bindings.driver
    with pytest.raises(TypeError):  # the real driver refuses what the fake accepted
        sharing.event_done(object())
    assert fake.calls == 4


def test_the_fixture_gave_the_real_driver_back():
    """Runs after the test above (file order): what it handed in is gone."""
    assert _driver.get() is cuda.bindings.driver
    assert _driver.runtime() is cupy.cuda.runtime
