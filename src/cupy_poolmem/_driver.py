"""The CUDA APIs the package calls: ``cuda.bindings.driver``, CuPy's runtime and
``cuda.core`` (for managed buffers), or fakes a test hands in.

Every module below the public layer asks :func:`get` for the driver when it calls it
(``_device`` asks :func:`runtime` for the runtime, ``managed`` :func:`core` for
cuda.core), so one :func:`use` replaces it for all of them.  The real modules are
imported on the first call and then kept.  This module imports nothing of the package.
"""

from __future__ import annotations

from typing import Any

__all__ = ["get", "use", "runtime", "use_runtime", "core", "use_core"]


class DriverProvider:
    """Holds the driver, runtime and cuda.core modules of this process (None: not
    loaded yet)."""

    def __init__(self) -> None:
        self.driver: Any = None
        self.runtime: Any = None
        self.core: Any = None

    def get(self) -> Any:
        if self.driver is None:
            # Late: the base install imports the package's floor without cuda.bindings.
            from cuda.bindings import driver

            self.driver = driver
        return self.driver

    def get_runtime(self) -> Any:
        if self.runtime is None:
            import cupy  # third-party, late: the base install has no CuPy

            self.runtime = cupy.cuda.runtime
        return self.runtime

    def get_core(self) -> Any:
        if self.core is None:
            import cuda.core  # third-party, late: the base install has no cuda.core

            self.core = cuda.core
        return self.core


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
    previous, PROVIDER.driver = PROVIDER.driver, driver
    return previous


def runtime() -> Any:
    """CuPy's CUDA runtime (``cupy.cuda.runtime``) unless :func:`use_runtime` handed in
    another.

    Examples
    --------
    >>> from cupy_poolmem import _driver
    >>> _driver.runtime().getDeviceCount() >= 0  # doctest: +SKIP
    True
    """
    return PROVIDER.get_runtime()


def use_runtime(rt: Any) -> Any:
    """Make ``rt`` the one :func:`runtime` returns (None: CuPy's again); returns the
    previous one, to hand back later.

    Examples
    --------
    >>> from cupy_poolmem import _driver
    >>> previous = _driver.use_runtime(object())
    >>> _ = _driver.use_runtime(previous)
    """
    previous, PROVIDER.runtime = PROVIDER.runtime, rt
    return previous


def core() -> Any:
    """``cuda.core`` unless :func:`use_core` handed in another.

    Examples
    --------
    >>> from cupy_poolmem import _driver
    >>> _driver.core().Host()  # doctest: +SKIP
    """
    return PROVIDER.get_core()


def use_core(core: Any) -> Any:
    """Make ``core`` the one :func:`core` returns (None: cuda.core again); returns the
    previous one, to hand back later.

    Examples
    --------
    >>> from cupy_poolmem import _driver
    >>> previous = _driver.use_core(object())
    >>> _ = _driver.use_core(previous)
    """
    previous, PROVIDER.core = PROVIDER.core, core
    return previous
