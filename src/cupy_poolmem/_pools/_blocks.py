"""Pool blocks under arrays: finding the block of an array, and ``record_stream``."""

from __future__ import annotations

from typing import Any

import cupy
import numpy as np

from .. import _runtime, _streams
from .._errors import InvalidOptionError, OptionTypeError

__all__ = ["block_of", "record_stream"]


def block_of(array: Any, what: str) -> Any:
    """The pool ``Block`` under a CuPy array or a pinned numpy array (``None`` if empty)."""
    hp = _runtime.hp  # read here: tests run the pools on the twin hot path
    if isinstance(array, cupy.ndarray):
        if array.size == 0:
            return None
        mem = array.data.mem
        owner = getattr(mem, "_owner", None)
        if isinstance(owner, hp.Block):
            return owner
        raise InvalidOptionError(
            f"{what}: this cupy.ndarray (device {array.device.id}, {array.nbytes:,} bytes) is "
            f"not on memory from a cupy_poolmem pool (its memory is a {type(mem).__name__}); "
            "allocate it under cupy_poolmem.set_allocator() or `with cupy_poolmem.using(pool):`"
        )
    if isinstance(array, np.ndarray):
        if array.size == 0:
            return None
        base: Any = array
        while isinstance(base, np.ndarray) and base.base is not None:
            base = base.base
        if isinstance(base, memoryview):  # np.frombuffer keeps a view of the buffer
            base = base.obj
        owner = getattr(base, "mem", None)
        if isinstance(owner, hp.Block):
            return owner
        raise InvalidOptionError(
            f"{what}: this numpy array ({array.nbytes:,} bytes) is not on pinned memory from "
            "a cupy_poolmem PinnedPool; create it with cupyx.empty_pinned() under "
            "cupy_poolmem.set_pinned_memory_allocator() or `with cupy_poolmem.using(pinned):`"
        )
    raise OptionTypeError(
        f"{what} takes a cupy.ndarray or a numpy array on pinned memory from a PinnedPool; "
        f"got {type(array).__name__}"
    )


def record_stream(array: Any, stream: Any) -> None:
    """Declare that ``stream`` uses ``array``'s memory, so its free waits for that work.

    A pool frees a block on the stream it was allocated on.  When another stream
    still reads or writes the memory, call ``record_stream(array, other)`` before the
    last reference goes away: the free then makes the allocation stream wait, on the
    device, for everything enqueued on ``other`` up to the moment of the free (one
    event per recorded stream; no host synchronisation).  Only then can the block be
    reused, by the pool's reuse cache, by the CUDA pool or, for pinned memory, by the
    host.  Views record for the whole block.  Recording the allocation stream, or a
    stream twice, does nothing more.

    Parameters
    ----------
    array : cupy.ndarray or numpy.ndarray
        An array (or view) on memory from a :class:`DevicePool`, :class:`ManagedPool`
        or, for numpy arrays, a :class:`PinnedPool`.
    stream : cupy.cuda.Stream or stream-like
        The other stream (``cupy.cuda.Stream``, ``ExternalStream``, or an object with
        ``__cuda_stream__`` such as a ``cuda.core`` stream).  It is kept alive until
        the free.

    Raises
    ------
    OptionTypeError
        ``array`` is not an array, or ``stream`` is not a stream.
    InvalidOptionError
        The array's memory does not come from a cupy_poolmem pool.

    Examples
    --------
    >>> s = cupy.cuda.Stream(non_blocking=True)  # doctest: +SKIP
    >>> x = cupy.arange(1 << 20)  # allocated on the current stream  # doctest: +SKIP
    >>> with s:  # doctest: +SKIP
    ...     y = x * 2  # s reads x
    >>> cupy_poolmem.record_stream(x, s)  # doctest: +SKIP
    >>> del x  # its memory is reused only after s's work above  # doctest: +SKIP
    """
    block = block_of(array, "record_stream")
    if block is None or block.ptr == 0:
        _streams.as_stream(stream)  # still reject what is not a stream
        return
    core = block.core
    dev = block.stream.device_id
    if dev < 0:
        dev = core.device_id if core.device_id >= 0 else _streams.current_device()
    entry = _streams.as_stream(stream, device=dev)
    if entry[0] == block.stream_ptr and entry[1] == dev:
        return  # the allocation stream: the free is ordered after its work already
    block._record(entry)
    guard = getattr(core, "guard", None)
    if guard is not None:  # guard mode: a free with this stream current is ordered
        guard.note_stream(block.ptr, entry[0])
