"""The sub-header of a chunk sent through IPC: written by the sender, checked by the receiver."""

from __future__ import annotations

from typing import Any

from .._errors import SharingError
from ._protocol import HEADER_KEY, PROTOCOL

__all__ = ["make_header", "parse_header"]


def make_header(desc: tuple, sender: str) -> dict[str, Any]:
    """The sub-header of a chunk sent through IPC: the descriptor and the sender's address.

    Examples
    --------
    >>> h = make_header(tuple(range(16)), "tcp://10.0.0.1:4000")
    >>> sorted(h)
    ['cupy-poolmem-ipc', 'desc', 'sender']
    """
    return {HEADER_KEY: PROTOCOL, "desc": list(desc), "sender": sender}


def _sharing_wire() -> Any:
    """The sharing package's wire format (descriptor checks, ``ProtocolError``)."""
    # Loaded late: importing the sharing package hooks it into the pools and pickling,
    # which a client or scheduler importing this package must not get.
    from .._sharing import _wire

    return _wire


def _bad(what: str) -> SharingError:
    return _sharing_wire().ProtocolError(
        f"a Dask chunk's cupy_poolmem header is malformed ({what}); it was not mapped. "
        "Install one cupy_poolmem version on every worker"
    )


def parse_header(sub: Any) -> tuple[Any, str]:
    """``(Descriptor, sender address)`` from a sub-header; raises ``ProtocolError``.

    The descriptor is checked field by field (``_wire.check_descriptor``) before
    anything is mapped; lists that msgpack made of tuples are turned back.
    """
    _wire = _sharing_wire()
    if not isinstance(sub, dict):
        raise _bad(f"a {type(sub).__name__}, not a mapping")
    proto = sub.get(HEADER_KEY)
    if type(proto) is not int or proto != PROTOCOL:
        raise _bad(f"protocol {proto!r}, this worker reads {PROTOCOL}")
    sender = sub.get("sender")
    if not isinstance(sender, str) or "://" not in sender:
        raise _bad(f"sender={sender!r:.80}")
    raw = sub.get("desc")
    # The field count of this version's wire format (a peer of another version sends
    # another count, or fails check_descriptor's version test).
    if not isinstance(raw, (list, tuple)) or len(raw) != len(_wire.Descriptor._fields):
        n = len(raw) if isinstance(raw, (list, tuple, str, bytes)) else "?"
        raise _bad(f"desc of {type(raw).__name__} with {n} fields")
    fields = list(raw)
    for i in (12, 13):  # shape, strides
        if isinstance(fields[i], list):
            fields[i] = tuple(fields[i])
    d = _wire.check_descriptor(_wire.Descriptor(*fields))
    if d.kind != "cupy" or d.pool_kind != _wire.POOL_DEVICE or not d.device_uuid:
        raise _bad(f"kind={d.kind!r}, pool_kind={d.pool_kind!r}: not device memory")
    # The sender sends contiguous chunks only, and the cross-GPU receive copies the
    # chunk's bytes as one run from its first byte: any other layout is refused.
    if not _contiguous(d.shape, d.strides, _itemsize(d.dtype)):
        raise _bad(f"shape={d.shape}, strides={d.strides}: not a contiguous chunk")
    return d, sender


def _itemsize(dtype: str) -> int:
    import numpy as np

    return int(np.dtype(dtype).itemsize)


def _contiguous(shape: tuple, strides: tuple, item: int) -> bool:
    """Whether ``shape``/``strides`` is a C- or F-ordered run of ``item``-byte items
    (axes of length 1 may have any stride; an empty array is)."""
    if 0 in shape:
        return True

    def run(axes: list[int]) -> bool:
        want = item
        for i in axes:
            if shape[i] != 1 and strides[i] != want:
                return False
            want *= shape[i]
        return True

    n = len(shape)
    return run(list(range(n - 1, -1, -1))) or run(list(range(n)))
