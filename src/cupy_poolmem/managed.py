"""Prefetch and advise for CuPy arrays on managed (unified) memory.

Both functions take one array or a collection (a list, tuple or dict of arrays, such
as a model's parameters), check them all before acting, and merge the byte ranges
that overlap.  Neither synchronises a stream.
"""

from __future__ import annotations

from typing import Any

import cupy

from . import _driver, _runtime
from ._errors import InvalidOptionError, OptionTypeError, UnsupportedError
from ._pools._driver import wrap
from ._streams import as_stream

__all__ = ["prefetch", "advise"]


def _span(arr: Any) -> tuple[int, int]:
    """Byte range ``[start, start+nbytes)`` covered by ``arr`` (a view is covered whole)."""
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
    cc = _driver.core()
    if isinstance(where, str) and where.lower() in ("cpu", "host"):
        return cc.Host()
    if isinstance(where, cupy.cuda.Device):
        where = where.id
    if isinstance(where, int) and not isinstance(where, bool):
        n = _driver.runtime().getDeviceCount()
        if not 0 <= where < n:
            raise InvalidOptionError(
                f"{name}={where} is not a device ordinal (0..{n - 1}) or 'cpu'"
            )
        return cc.Device(where)
    raise OptionTypeError(
        f"{name} must be a device ordinal, a cupy.cuda.Device or 'cpu'; got {where!r}"
    )


def _arrays(arrays: Any, what: str) -> list[tuple[str, Any]]:
    """``[(label, array), ...]`` from one array or a list, tuple or dict of arrays."""
    if isinstance(arrays, cupy.ndarray):
        return [("array", arrays)]
    if isinstance(arrays, dict):
        items = [(f"[{k!r}]", a) for k, a in arrays.items()]
    elif isinstance(arrays, (list, tuple)):
        items = [(f"[{i}]", a) for i, a in enumerate(arrays)]
    else:
        raise OptionTypeError(
            f"{what} takes a cupy.ndarray, or a list, tuple or dict of them; "
            f"got {type(arrays).__name__}"
        )
    for label, a in items:
        if not isinstance(a, cupy.ndarray):
            raise OptionTypeError(
                f"{what}: item {label} is a {type(a).__name__}, not a cupy.ndarray"
            )
    return items


def _managed_spans(items: list[tuple[str, Any]], what: str) -> list[tuple[int, int]]:
    """The byte ranges the arrays span, checked to be managed, merged where they overlap.

    Only overlapping ranges merge (views of one block, repeated arrays): they lie in
    one allocation, while ranges that merely touch may be two.
    """
    spans = []
    for label, arr in items:
        ptr, nbytes = _span(arr)
        if nbytes == 0:
            continue
        drv = _driver.get()
        err, is_managed = drv.cuPointerGetAttribute(
            drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_MANAGED, ptr
        )
        if int(err) or not is_managed:
            where = "" if label == "array" else f" (item {label})"
            raise InvalidOptionError(
                f"{what}: the array{where} on device {arr.device.id} is not on managed memory; "
                "allocate it from a cupy_poolmem.ManagedPool (`with cupy_poolmem.using(pool):`) "
                "before prefetching or advising"
            )
        spans.append((ptr, ptr + nbytes))
    spans.sort()
    merged: list[list[int]] = []
    for lo, hi in spans:
        if merged and lo < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi - lo) for lo, hi in merged]


def _core_stream(stream_ptr: int) -> Any:
    return _driver.core().Stream.from_handle(stream_ptr)


def _buffer(ptr: int, nbytes: int, owner: Any) -> Any:
    return _driver.core().ManagedBuffer.from_handle(ptr, nbytes, owner=owner)


def prefetch(
    arrays: cupy.ndarray | list | tuple | dict, device: int | str = 0, *, stream: Any = None
) -> None:
    """Migrate the managed memory under one array or a collection, stream-ordered.

    Parameters
    ----------
    arrays : cupy.ndarray, or a list, tuple or dict (its values) of them
        Arrays (or views) on memory from a :class:`ManagedPool` (or
        ``cudaMallocManaged``).  A view prefetches the byte range it spans; ranges of
        several arrays that overlap (views of one array) are merged.
    device : int or "cpu"
        Destination.
    stream : cupy.cuda.Stream or stream-like, optional
        Stream to order the migration on; default CuPy's current stream.  Nothing
        is synchronised: work enqueued on the stream afterwards sees the pages in
        place, and ``stream.synchronize()`` (one call for the whole collection)
        waits for them from the host.

    Raises
    ------
    OptionTypeError
        Not an array or a collection of arrays, or ``stream`` is not a stream.
    InvalidOptionError
        An array is not on managed memory, or ``device`` is not a device.

    Examples
    --------
    >>> x = cupy.zeros(1 << 20)  # from a ManagedPool  # doctest: +SKIP
    >>> cupy_poolmem.prefetch(x, device="cpu")  # doctest: +SKIP
    >>> cupy_poolmem.prefetch(x[:1000], device=0)  # doctest: +SKIP
    >>> cupy_poolmem.prefetch(model_params, device=0)  # a dict of arrays  # doctest: +SKIP
    """
    loc = _location(device, "device")
    items = _arrays(arrays, "prefetch")
    if stream is None:
        sptr = cupy.cuda.get_current_stream().ptr
    else:
        sptr = as_stream(stream, "stream")[0]
    spans = _managed_spans(items, "prefetch")
    if not spans:
        return
    cs = _core_stream(sptr)
    try:
        for ptr, nbytes in spans:
            _buffer(ptr, nbytes, items).prefetch(loc, stream=cs)
    except Exception as exc:
        raise _as_driver_error(exc, "cuMemPrefetchAsync") from exc


def advise(
    arrays: cupy.ndarray | list | tuple | dict,
    *,
    preferred_location: int | str | None = None,
    accessed_by: list[int | str] | None = None,
    read_mostly: bool | None = None,
) -> None:
    """Give the driver placement hints for the managed memory under arrays.

    Parameters
    ----------
    arrays : cupy.ndarray, or a list, tuple or dict (its values) of them
        Arrays (or views) on memory from a :class:`ManagedPool` (or
        ``cudaMallocManaged``).  Overlapping ranges are merged, as for :func:`prefetch`.
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
        The driver rejects advice on this memory: a ``ManagedPool`` created with
        ``backend="pool"`` on a driver that refuses advice on managed-pool memory
        (``backend="auto"``, the default, avoids that pool there).

    Notes
    -----
    ``cuMemAdvise`` is not stream-ordered and needs no synchronisation; none is
    made.  Hints on memory from a :class:`ManagedPool` are reset when the array's
    block is freed, so they never reach the next array that block serves.

    Examples
    --------
    >>> cupy_poolmem.advise(x, preferred_location=0, accessed_by=[0], read_mostly=False)  # doctest: +SKIP
    >>> cupy_poolmem.advise(list(params.values()), read_mostly=True)  # doctest: +SKIP
    """
    pref = (
        None if preferred_location is None else _location(preferred_location, "preferred_location")
    )
    if accessed_by is not None and not isinstance(accessed_by, (list, tuple, set)):
        raise OptionTypeError(f"accessed_by must be a list of devices; got {accessed_by!r}")
    acc = None if accessed_by is None else [_location(w, "accessed_by") for w in accessed_by]
    if read_mostly is not None and not isinstance(read_mostly, bool):
        raise OptionTypeError(f"read_mostly must be True, False or None; got {read_mostly!r}")
    items = _arrays(arrays, "advise")
    spans = _managed_spans(items, "advise")
    try:
        for ptr, nbytes in spans:
            buf = _buffer(ptr, nbytes, items)
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
                "580 / CUDA 13.0). prefetch() works on it; for advice, use "
                "ManagedPool(backend='managed') (what backend='auto' picks on such a driver)."
            ) from exc
        raise err from exc
    if pref is not None or acc is not None or read_mostly is not None:
        _mark_advised(items)


def _mark_advised(items: list[tuple[str, Any]]) -> None:
    """Flag pool blocks whose hints must be reset when they are freed."""
    hp = _runtime.hp  # read here: tests run the pools on the twin hot path
    for _label, arr in items:
        if arr.size:
            owner = getattr(arr.data.mem, "_owner", None)
            if isinstance(owner, hp.Block):
                owner._mark_advised()


def _as_driver_error(exc: Exception, call: str) -> Exception:
    return wrap(exc, call)
