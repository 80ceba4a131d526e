"""Prefetch and advise for CuPy arrays on managed (unified) memory."""

from __future__ import annotations

from typing import Any

import cupy
from cuda.bindings import driver as _drv

from ._errors import InvalidOptionError, OptionTypeError, check_driver

__all__ = ["prefetch", "advise"]


def _span(arr: Any) -> tuple[int, int]:
    """Byte range ``[start, start+nbytes)`` covered by ``arr`` (a view is covered whole)."""
    if not isinstance(arr, cupy.ndarray):
        raise OptionTypeError(f"expected a cupy.ndarray; got {type(arr).__name__}")
    if arr.size == 0:
        return arr.data.ptr, 0
    lo = hi = arr.data.ptr
    for n, st in zip(arr.shape, arr.strides):
        ext = (n - 1) * st
        if ext < 0:
            lo += ext
        else:
            hi += ext
    return lo, hi - lo + arr.itemsize


def _location(where: Any, name: str) -> Any:
    loc = _drv.CUmemLocation()
    if isinstance(where, str) and where.lower() in ("cpu", "host"):
        loc.type = _drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
        loc.id = 0
    elif isinstance(where, int) and not isinstance(where, bool):
        n = cupy.cuda.runtime.getDeviceCount()
        if not 0 <= where < n:
            raise InvalidOptionError(f"{name}={where} is not a device ordinal (0..{n - 1}) or 'cpu'")
        loc.type = _drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        loc.id = where
    elif isinstance(where, cupy.cuda.Device):
        return _location(where.id, name)
    else:
        raise OptionTypeError(f"{name} must be a device ordinal, a cupy.cuda.Device or 'cpu'; "
                              f"got {where!r}")
    return loc


def _check_managed(ptr: int) -> None:
    err, is_managed = _drv.cuPointerGetAttribute(
        _drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_MANAGED, ptr)
    if int(err) or not is_managed:
        raise InvalidOptionError(
            "the array is not on managed memory; allocate it from a cupy_poolmem.ManagedPool "
            "(cupy.cuda.set_allocator(pool.malloc)) before prefetching or advising")


def prefetch(arr: cupy.ndarray, device: int | str = 0, *, stream: Any = None) -> None:
    """Migrate the managed memory under ``arr`` to a GPU or to the host, stream-ordered.

    Parameters
    ----------
    arr : cupy.ndarray
        An array (or view) on memory from a :class:`ManagedPool`.  A view prefetches
        the byte range it spans.
    device : int or "cpu"
        Destination.
    stream : cupy.cuda.Stream, optional
        Stream to order the migration on; default CuPy's current stream.

    Examples
    --------
    >>> x = cupy.zeros(1 << 20)  # from a ManagedPool  # doctest: +SKIP
    >>> cupy_poolmem.prefetch(x, device="cpu")  # doctest: +SKIP
    >>> cupy_poolmem.prefetch(x[:1000], device=0)  # doctest: +SKIP
    """
    ptr, nbytes = _span(arr)
    if nbytes == 0:
        return
    _check_managed(ptr)
    loc = _location(device, "device")
    s = cupy.cuda.get_current_stream() if stream is None else stream
    check_driver(_drv.cuMemPrefetchAsync(ptr, nbytes, loc, 0, s.ptr), "cuMemPrefetchAsync")


def advise(arr: cupy.ndarray, *, preferred_location: int | str | None = None,
           accessed_by: list[int | str] | None = None, read_mostly: bool | None = None) -> None:
    """Give the driver placement hints for the managed memory under ``arr``.

    Parameters
    ----------
    arr : cupy.ndarray
        An array (or view) on memory from a :class:`ManagedPool`.
    preferred_location : int or "cpu", optional
        Where the pages should live.
    accessed_by : list of int or "cpu", optional
        Processors that map the pages directly (no faults on access).
    read_mostly : bool, optional
        ``True`` lets the driver replicate pages for reading; ``False`` undoes it.
        ``None`` leaves it unchanged.

    Examples
    --------
    >>> cupy_poolmem.advise(x, preferred_location=0, accessed_by=[0], read_mostly=False)  # doctest: +SKIP
    """
    ptr, nbytes = _span(arr)
    if nbytes == 0:
        return
    _check_managed(ptr)
    A = _drv.CUmem_advise
    if preferred_location is not None:
        check_driver(_drv.cuMemAdvise(ptr, nbytes, A.CU_MEM_ADVISE_SET_PREFERRED_LOCATION,
                                      _location(preferred_location, "preferred_location")),
                     "cuMemAdvise")
    if accessed_by is not None:
        if not isinstance(accessed_by, (list, tuple, set)):
            raise OptionTypeError(f"accessed_by must be a list of devices; got {accessed_by!r}")
        for who in accessed_by:
            check_driver(_drv.cuMemAdvise(ptr, nbytes, A.CU_MEM_ADVISE_SET_ACCESSED_BY,
                                          _location(who, "accessed_by")), "cuMemAdvise")
    if read_mostly is not None:
        if not isinstance(read_mostly, bool):
            raise OptionTypeError(f"read_mostly must be True, False or None; got {read_mostly!r}")
        adv = A.CU_MEM_ADVISE_SET_READ_MOSTLY if read_mostly else A.CU_MEM_ADVISE_UNSET_READ_MOSTLY
        check_driver(_drv.cuMemAdvise(ptr, nbytes, adv, _location(0, "device")), "cuMemAdvise")
