"""Reduce/rebuild pairs for multiprocessing: CuPy arrays, and numpy arrays on pinned pools.

``reduce_cupy`` turns an array into ``(_rebuild, (Descriptor,))``; ``_rebuild`` runs in
the receiver (or back in the exporter) and returns an array on the same memory.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import _runtime
from .._errors import SharingError
from . import _wire
from ._context import context
from ._exporter import LocalHold
from ._importer import Imported

log = logging.getLogger(__name__)

__all__ = [
    "array_on",
    "describe",
    "receive",
    "rebuild",
    "reduce_cupy",
    "reduce_numpy",
    "register_cupy",
    "register_numpy",
]


def _hotpath() -> Any:
    """The hot-path module the pools use (Cython or its pure-Python twin)."""
    return _runtime.hp


def _owner(mem: Any, hp: Any = None) -> Any:
    """The pool Block, Imported or LocalHold behind CuPy (or pinned) memory, else None.

    ``hp``: the hot-path module, when the caller has it at hand already."""
    if hp is None:
        hp = _hotpath()
    owner = getattr(mem, "_owner", None)
    if owner is None and isinstance(mem, (hp.Block, Imported, LocalHold)):
        owner = mem
    return owner


def _shareable(owner: Any, hp: Any = None) -> bool:
    if hp is None:
        hp = _hotpath()
    if isinstance(owner, (Imported, LocalHold)):
        return True
    return (
        isinstance(owner, hp.Block)
        and getattr(owner.core, "ipc", False)
        and not owner.core.closed
        and not owner.flags & hp.FLAG_CAPTURED  # graph memory cannot be exported
    )


def describe(
    ctx: Any, owner: Any, kind: str, offset: int, shape: tuple, strides: tuple, dtype: str
) -> _wire.Descriptor:
    """The descriptor of a new message for ``owner`` (a pool block, a received mapping's
    owner, or a round-tripped array), its ticket registered with the exporter."""
    if ctx.forked:
        ctx.check_not_forked()
    if isinstance(owner, Imported):  # forward to a third process
        m = owner.m
        ticket = ctx.importer.forward(owner)
        assert m.client is not None
        return _wire.Descriptor(
            _wire.VERSION,
            kind,
            m.client.address,
            m.pool.uuid,
            ctx.driver.device_uuid(m.dev) if m.pool.kind != _wire.POOL_PINNED else "",
            m.pool.kind,
            m.export_id,
            m.key[1],
            m.size,
            ticket,
            None,
            offset,
            shape,
            strides,
            dtype,
            m.life,  # the life of the arrays it holds (it cannot say Idle while they live)
        )
    exp = ctx.exporter
    if isinstance(owner, LocalHold) and owner.block is None:
        rec = owner.rec
        ticket, event = exp.export_record(rec)
    else:
        block = owner.block if isinstance(owner, LocalHold) else owner
        rec, ticket, event = exp.export(block)
    core = rec.core
    return _wire.Descriptor(
        _wire.VERSION,
        kind,
        exp.address,
        rec.pool_uuid,
        rec.dev_uuid,
        core.kind,
        rec.export_id,
        rec.data,
        rec.size,
        ticket,
        event,
        offset,
        shape,
        strides,
        dtype,
        rec.life,
    )


def receive(ctx: Any, d: _wire.Descriptor) -> tuple[Any, int]:
    """Take the message ``d`` in this process: ``(owner, device)`` for the new array.

    Back in its exporter, the owner holds the block locally; elsewhere it is the
    importer's owner of a mapping, ordered after the sender's writes.
    """
    if ctx.forked:
        ctx.check_not_forked()
    drv = ctx.driver
    exp = ctx._exporter
    if exp is not None and d.address == exp.own_address:  # back in the exporter: its own memory
        hold = ctx.exporter.take_local(d.export_id, d.ticket, d.life, d.size)
        dev = hold.rec.dev if hold.rec.dev >= 0 else drv.current_device()
        if d.event is not None:
            with drv.on_device(dev):
                drv.sync_stream(hold.rec.stream_ptr)
        return hold, dev
    try:
        dev = drv.local_device(d.device_uuid) if d.device_uuid else drv.current_device()
    except BaseException:
        ctx.importer.give_back(d)  # this process cannot take it: the ticket is returned
        raise
    with drv.on_device(dev):
        stream = drv.current_stream()
        return ctx.importer.receive(d, dev, stream, host_order=d.kind == "numpy"), dev


def rebuild(desc: Any, *extra: Any) -> Any:
    """Receiver side of a shared array (also the round trip back to its exporter)."""
    if extra:  # an older cupy_poolmem's positional message
        raise _wire.ProtocolError(
            f"message format {desc!r} from a different cupy_poolmem version (this one reads "
            f"format {_wire.VERSION}); install one cupy_poolmem version in every process"
        )
    d = _wire.check_descriptor(desc)
    owner, dev = receive(context(), d)
    return array_on(owner, d, dev)


def array_on(owner: Any, d: _wire.Descriptor, dev: int) -> Any:
    """The array ``d`` describes, on the memory ``owner`` holds (``dev``: its GPU)."""
    import cupy

    if d.kind == "numpy":
        import numpy as np

        pmem = cupy.cuda.PinnedMemoryPointer(owner, 0)
        return np.ndarray(d.shape, d.dtype, buffer=pmem, offset=d.offset, strides=d.strides)
    mem = cupy.cuda.UnownedMemory(owner.ptr, d.size, owner, dev)
    return cupy.ndarray(d.shape, d.dtype, cupy.cuda.MemoryPointer(mem, d.offset), d.strides)


def reduce_cupy(arr: Any) -> tuple:
    """Reduce a ``cupy.ndarray`` for multiprocessing: zero-copy when its pool allows it."""
    hp = _hotpath()
    mem = arr.data.mem
    owner = _owner(mem, hp)
    ctx = context()
    if arr.size == 0 or owner is None or not _shareable(owner, hp):
        import cupy

        fb = ctx.settings.fallback
        log.debug("sharing: array not on an IPC pool; fallback %r (size %d)", fb, arr.nbytes)
        if fb == "host" or arr.size == 0:
            return arr.__reduce__()
        if fb == "error":
            raise SharingError(
                "this array's memory cannot be shared zero-copy (it is not from an IPC-enabled "
                "cupy_poolmem pool); call cupy_poolmem.set_allocator() before creating it, or "
                "set cupy_poolmem.sharing.fallback to 'device-copy' or 'host'"
            )
        with ctx.driver.on_device(arr.device.id):
            pool = ctx.sharing_pool(arr.device.id)
            with cupy.cuda.using_allocator(pool.malloc):
                arr = cupy.array(arr, copy=True, order="K")
        mem = arr.data.mem
        owner = _owner(mem, hp)
    offset = arr.data.ptr - owner.ptr
    d = describe(ctx, owner, "cupy", offset, arr.shape, arr.strides, arr.dtype.str)
    return rebuild, (d,)


def reduce_numpy(arr: Any) -> tuple:
    """Reduce a numpy array: zero-copy when it lives on an IPC-enabled PinnedPool."""
    import numpy as np

    base = arr
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    hp = _hotpath()
    owner = getattr(base, "mem", None)
    owner = _owner(owner, hp) if owner is not None else None
    if owner is None or not _shareable(owner, hp) or arr.size == 0:
        return arr.__reduce_ex__(4)
    offset = arr.__array_interface__["data"][0] - owner.ptr
    d = describe(context(), owner, "numpy", offset, arr.shape, arr.strides, arr.dtype.str)
    return rebuild, (d,)


def register_cupy() -> None:
    """Register the CuPy reducer with multiprocessing's pickler."""
    from multiprocessing.reduction import ForkingPickler

    import cupy

    ForkingPickler.register(cupy.ndarray, reduce_cupy)


def register_numpy() -> None:
    """Register the numpy reducer (done when the first shareable pinned pool exists)."""
    from multiprocessing.reduction import ForkingPickler

    import numpy as np

    if getattr(ForkingPickler, "_extra_reducers", {}).get(np.ndarray) is not reduce_numpy:
        ForkingPickler.register(np.ndarray, reduce_numpy)
