"""The package's driver provider (``cupy_poolmem._driver``) in tests: the fixture
``fake_driver`` hands fakes in (``fake_driver(d)`` returns ``d``; every module of the
package then calls ``d``) and puts the previous driver back when the test ends.

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
    """Hands drivers to the provider and remembers what to give back."""

    def __init__(self) -> None:
        self._previous: list[Any] = []

    def __call__(self, d: Any) -> Any:
        self._previous.append(_driver.use(d))
        return d

    def restore(self) -> None:
        while self._previous:
            _driver.use(self._previous.pop())


@pytest.fixture
def fake_driver():
    """``fake_driver(d)``: the package calls ``d`` until the test ends; returns ``d``."""
    seat = DriverSeat()
    yield seat
    seat.restore()
