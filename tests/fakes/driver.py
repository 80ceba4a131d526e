"""The package's driver provider (``cupy_poolmem._driver``) in tests: the fixture
``fake_driver`` hands fakes in (``fake_driver(d)`` returns ``d``; every module of the
package then calls ``d``; ``fake_driver.runtime(rt)`` for CuPy's runtime,
``fake_driver.core(cc)`` for cuda.core) and puts the previous ones back when the test
ends.

Every module sees the fake, so a fake passes the calls it does not play on (to the real
driver: :class:`PassThrough`, or to the driver below it, as fakes.hotpath's World does:
a test installs a domain fake before the World, which then wraps it).  ``PointerDriver``
answers pointer attributes from a table, ``Runtime`` is CuPy's runtime with a given
number of devices."""

from __future__ import annotations

from typing import Any

import pytest
from cuda.bindings import driver as real

from cupy_poolmem import _driver


class PassThrough:
    """Base of a small fake driver: the calls it does not play go to the real driver."""

    def __getattr__(self, name: str) -> Any:
        return getattr(real, name)


class DriverSeat:
    """Hands drivers (and runtimes) to the provider and remembers what to give back."""

    def __init__(self) -> None:
        self._undo: list[Any] = []

    def __call__(self, d: Any) -> Any:
        previous = _driver.use(d)
        self._undo.append(lambda: _driver.use(previous))
        return d

    def runtime(self, rt: Any) -> Any:
        """Make ``rt`` the CUDA runtime the package calls (CuPy's by default); returns it."""
        previous = _driver.use_runtime(rt)
        self._undo.append(lambda: _driver.use_runtime(previous))
        return rt

    def core(self, core: Any) -> Any:
        """Make ``core`` the cuda.core the package calls; returns it."""
        previous = _driver.use_core(core)
        self._undo.append(lambda: _driver.use_core(previous))
        return core

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


@pytest.fixture
def fake_driver():
    """``fake_driver(d)``: the package calls ``d`` until the test ends; returns ``d``
    (``fake_driver.runtime(rt)`` likewise for CuPy's runtime, ``fake_driver.core(cc)``
    for cuda.core)."""
    seat = DriverSeat()
    yield seat
    seat.restore()


class Runtime:
    """CuPy's runtime with ``n`` devices; every other call CuPy's."""

    def __init__(self, n: int) -> None:
        self.n = n

    def getDeviceCount(self) -> int:  # noqa: N802
        return self.n

    def __getattr__(self, name: str) -> Any:
        import cupy

        return getattr(cupy.cuda.runtime, name)


class PointerDriver(PassThrough):
    """What pointer_info asks cuda.bindings.driver, answered from a table by pointer."""

    class CUpointer_attribute:
        CU_POINTER_ATTRIBUTE_IS_MANAGED = "managed"
        CU_POINTER_ATTRIBUTE_MEMORY_TYPE = "type"
        CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE = "pool"
        CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = "ordinal"

    class CUresult:
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1

    class CUmemorytype:
        CU_MEMORYTYPE_HOST = 1
        CU_MEMORYTYPE_DEVICE = 2
        CU_MEMORYTYPE_UNIFIED = 4

    CUdeviceptr = int
    HOST, DEVICE, UNIFIED = 1, 2, 4

    def __init__(self) -> None:
        self.table: dict[int, dict[str, tuple]] = {}

    def add(self, ptr, *, managed=False, mtype=DEVICE, pool=None, ordinal=0, valid=True):
        if not valid:
            self.table[ptr] = {"managed": (1, None)}
            return
        self.table[ptr] = {
            "managed": (0, managed),
            "type": (0, mtype),
            "pool": (0, pool) if pool else (1, None),  # not pool memory: an error
            "ordinal": (0, ordinal),
        }

    def cuPointerGetAttribute(self, attr, ptr):
        return self.table[ptr][attr]
