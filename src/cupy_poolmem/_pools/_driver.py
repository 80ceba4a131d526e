"""The driver calls the pools make, in one place.

Every pool module reaches the driver through this module: ``drv()`` (the package's
driver provider, :mod:`cupy_poolmem._driver`, asked at each call) and the helpers below.
"""

from __future__ import annotations

from typing import Any

from cuda.bindings import driver as _bindings

from .._driver import get as drv
from .._errors import CUDADriverError, UnsupportedError, check_driver

A = _bindings.CUmemPool_attribute
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_SUPPORTED = 801


def pool_handle(mr: Any) -> Any:
    return drv().CUmemoryPool(int(mr.handle))


def set_attr(mr: Any, attr: Any, value: int) -> None:
    check_driver(
        drv().cuMemPoolSetAttribute(pool_handle(mr), attr, drv().cuuint64_t(value)),
        "cuMemPoolSetAttribute",
    )


def cuda13_missing() -> str:
    """Empty when managed pools are possible here, else what is missing."""
    import cuda.bindings

    drv_version = check_driver(drv().cuDriverGetVersion(), "cuDriverGetVersion")
    major = int(cuda.bindings.__version__.split(".")[0])
    if drv_version >= 13000 and major >= 13:
        return ""
    return (
        f"driver {drv_version // 1000}.{drv_version % 1000 // 10}, "
        f"cuda-bindings {cuda.bindings.__version__}"
    )


def require_cuda13(what: str) -> None:
    drv_version = check_driver(drv().cuDriverGetVersion(), "cuDriverGetVersion")
    import cuda.bindings

    major = int(cuda.bindings.__version__.split(".")[0])
    if drv_version < 13000 or major < 13:
        raise UnsupportedError(
            f"{what} needs CUDA 13 (driver >= 13.0 and cuda-bindings 13); this process has "
            f"driver {drv_version // 1000}.{drv_version % 1000 // 10} and cuda-bindings "
            f"{cuda.bindings.__version__}. Install cupy_poolmem[cu13] or use DevicePool."
        )


def wrap(exc: Exception, what: str) -> Exception:
    if isinstance(exc, CUDADriverError):
        return exc
    text = str(exc)
    name = next(
        (
            w
            for w in text.replace(":", " ").replace("'", " ").split()
            if w.startswith("CUDA_ERROR_")
        ),
        None,
    )
    if name:
        return CUDADriverError(what, getattr(drv().CUresult, name, -1), name, text)
    return exc
