"""The CUDA driver the package calls: ``cuda.bindings.driver``, or a fake a test hands in.

Every module below the public layer asks :func:`get` for the driver when it calls it, so
one :func:`use` replaces it for all of them.  The real module is imported on the first
call and then kept.  This module imports nothing of the package.
"""

from __future__ import annotations

from typing import Any

__all__ = ["get", "use"]


class DriverProvider:
    """Holds the driver module of this process (None: not resolved yet)."""

    def __init__(self) -> None:
        self.driver: Any = None

    def get(self) -> Any:
        if self.driver is None:
            # Late: the base install imports the package's floor without cuda.bindings.
            from cuda.bindings import driver

            self.driver = driver
        return self.driver

    def use(self, driver: Any) -> Any:
        previous, self.driver = self.driver, driver
        return previous


PROVIDER = DriverProvider()


def get() -> Any:
    """The driver to call: ``cuda.bindings.driver`` unless :func:`use` handed in another.

    Examples
    --------
    >>> from cupy_poolmem import _driver
    >>> _driver.get().cuDriverGetVersion()  # doctest: +SKIP
    (<CUresult.CUDA_SUCCESS: 0>, 13000)
    """
    return PROVIDER.get()


def use(driver: Any) -> Any:
    """Make ``driver`` the one :func:`get` returns (None: the real one again); returns
    the previous one (None if the real one was not loaded yet), to hand back later.

    Examples
    --------
    >>> from cupy_poolmem import _driver
    >>> previous = _driver.use(object())
    >>> _ = _driver.use(previous)
    """
    return PROVIDER.use(driver)
