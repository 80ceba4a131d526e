"""Prefetch and advise for CuPy arrays on managed (unified) memory."""

from __future__ import annotations

from typing import Any

import cupy
from cuda.bindings import driver as _drv

from ._errors import InvalidOptionError, OptionTypeError, UnsupportedError

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
    """A cuda.core ``Device`` or ``Host`` for a device ordinal, ``cupy.cuda.Device`` or "cpu"."""
    import cuda.core as cc

    if isinstance(where, str) and where.lower() in ("cpu", "host"):
        return cc.Host()
    if isinstance(where, cupy.cuda.Device):
        where = where.id
    if isinstance(where, int) and not isinstance(where, bool):
        n = cupy.cuda.runtime.getDeviceCount()
        if not 0 <= where < n:
            raise InvalidOptionError(
                f"{name}={where} is not a device ordinal (0..{n - 1}) or 'cpu'"
            )
        return cc.Device(where)
    raise OptionTypeError(
        f"{name} must be a device ordinal, a cupy.cuda.Device or 'cpu'; got {where!r}"
    )


def _managed_buffer(arr: Any) -> Any:
    """A cuda.core ``ManagedBuffer`` over the bytes ``arr`` spans (``None`` if empty)."""
    import cuda.core as cc

    ptr, nbytes = _span(arr)
    if nbytes == 0:
        return None
    err, is_managed = _drv.cuPointerGetAttribute(
        _drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_MANAGED, ptr
    )
    if int(err) or not is_managed:
        raise InvalidOptionError(
            "the array is not on managed memory; allocate it from a cupy_poolmem.ManagedPool "
            "(cupy.cuda.set_allocator(pool.malloc)) before prefetching or advising"
        )
    return cc.ManagedBuffer.from_handle(ptr, nbytes, owner=arr)


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
    import cuda.core as cc

    loc = _location(device, "device")
    buf = _managed_buffer(arr)
    if buf is None:
        return
    s = cupy.cuda.get_current_stream() if stream is None else stream
    try:
        buf.prefetch(loc, stream=cc.Stream.from_handle(s.ptr))
    except Exception as exc:
        raise _as_driver_error(exc, "cuMemPrefetchAsync") from exc


def advise(
    arr: cupy.ndarray,
    *,
    preferred_location: int | str | None = None,
    accessed_by: list[int | str] | None = None,
    read_mostly: bool | None = None,
) -> None:
    """Give the driver placement hints for the managed memory under ``arr``.

    Parameters
    ----------
    arr : cupy.ndarray
        An array (or view) on memory from a :class:`ManagedPool`.
    preferred_location : int or "cpu", optional
        Where the pages should live.
    accessed_by : list of int or "cpu", optional
        Processors that map the pages directly (no faults on access); replaces the
        current set.
    read_mostly : bool, optional
        ``True`` lets the driver replicate pages for reading; ``False`` undoes it.
        ``None`` leaves it unchanged.

    Raises
    ------
    UnsupportedError
        The driver rejects advice on this memory (CUDA 13.0 drivers reject it on
        memory from managed memory pools; prefetch still works there).

    Examples
    --------
    >>> cupy_poolmem.advise(x, preferred_location=0, accessed_by=[0], read_mostly=False)  # doctest: +SKIP
    """
    pref = (
        None if preferred_location is None else _location(preferred_location, "preferred_location")
    )
    if accessed_by is not None and not isinstance(accessed_by, (list, tuple, set)):
        raise OptionTypeError(f"accessed_by must be a list of devices; got {accessed_by!r}")
    acc = None if accessed_by is None else [_location(w, "accessed_by") for w in accessed_by]
    if read_mostly is not None and not isinstance(read_mostly, bool):
        raise OptionTypeError(f"read_mostly must be True, False or None; got {read_mostly!r}")
    buf = _managed_buffer(arr)
    if buf is None:
        return
    try:
        if pref is not None:
            buf.preferred_location = pref
        if acc is not None:
            buf.accessed_by = acc
        if read_mostly is not None:
            buf.read_mostly = read_mostly
    except Exception as exc:
        err = _as_driver_error(exc, "cuMemAdvise")
        if getattr(err, "name", "") == "CUDA_ERROR_NOT_SUPPORTED":
            raise UnsupportedError(
                "cuMemAdvise failed: CUDA_ERROR_NOT_SUPPORTED: this driver does not accept "
                "placement advice on memory from a managed memory *pool* (seen with driver "
                "580 / CUDA 13.0). prefetch() works on it; for advice, allocate with "
                "cupy.cuda.malloc_managed instead."
            ) from exc
        raise err from exc


def _as_driver_error(exc: Exception, call: str) -> Exception:
    from ._pools import _wrap

    return _wrap(exc, call)
