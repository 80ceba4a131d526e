"""The package's driver provider (``cupy_poolmem._driver``) in tests: the fixture
``fake_driver`` hands fakes in (``fake_driver(d)`` returns ``d``; every module of the
package then calls ``d``; ``fake_driver.runtime(rt)`` for CuPy's runtime) and puts the
previous ones back when the test ends.

Every module sees the fake, so a fake passes the calls it does not play on (to the real
driver: :class:`PassThrough`, or to the driver below it, as fakes.hotpath's World does:
a test installs a domain fake before the World, which then wraps it)."""

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

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


@pytest.fixture
def fake_driver():
    """``fake_driver(d)``: the package calls ``d`` until the test ends; returns ``d``
    (``fake_driver.runtime(rt)`` likewise for CuPy's runtime)."""
    seat = DriverSeat()
    yield seat
    seat.restore()
