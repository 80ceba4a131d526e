"""Wire format: the descriptor a pickled array carries, and the protocol's frames.

Two things travel.  A :class:`Descriptor` rides inside the user's pickled message
(through whatever channel multiprocessing uses); it holds only plain values and is
checked field by field before anything is mapped.  Protocol *frames* travel over the
sharing connections between a receiver and an exporter; each is a fixed ``struct``
layout named by its first byte, and nothing a peer sends is ever unpickled.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

from .._errors import SharingError

__all__ = [
    "VERSION",
    "Descriptor",
    "check_descriptor",
    "span",
    "Claim",
    "Hit",
    "Drop",
    "Unmap",
    "Mapped",
    "Register",
    "Reply",
    "Evict",
    "Release",
    "Idle",
    "StepClaim",
    "StepReply",
    "step_export_data",
    "step_block",
    "STEP_FD_MAX",
    "encode",
    "encode_batch",
    "decode",
    "ProtocolError",
    "POOL_DEVICE",
    "POOL_PINNED",
    "POOL_MANAGED",
    "OK",
    "REFUSED",
    "NOT_HELD",
    "OUT_OF_SPAN",
    "OTHER_BLOCK",
    "STALE_STEPS",
    "NOT_EXPORTED",
    "block_id",
]

VERSION = 6  # descriptor and frame format; a mismatch is a clear SharingError
POOL_DEVICE, POOL_PINNED, POOL_MANAGED = 0, 1, 2  # the hot path's KIND_* values
TICKET_BYTES = 16
HANDLE_BYTES = 64  # export records and IPC event handles


class ProtocolError(SharingError):
    """A peer sent a frame or descriptor that does not follow the protocol."""


class Descriptor(NamedTuple):
    """What one shared array carries to its receiver (pickled by multiprocessing).

    ``ticket`` is 16 random bytes the exporter registered for this message; ``event``
    is the sender's IPC event handle covering the writes enqueued before the send
    (``None`` when the sender already waited for them, as a forwarder does).
    ``life`` numbers the block's lives in its pool's reuse cache (0: a block that is
    never recycled); a receiver takes a message without a claim for the one life its
    mapping serves, and claims any other (P12).
    """

    version: int
    kind: str  # "cupy" or "numpy"
    address: str  # the exporter's listener
    pool_uuid: str
    device_uuid: str  # "" for host (pinned) pools
    pool_kind: int
    export_id: int
    export_data: bytes
    size: int
    ticket: bytes
    event: bytes | None
    offset: int
    shape: tuple
    strides: tuple
    dtype: str
    life: int


_KINDS = ("cupy", "numpy")
_POOL_KINDS = (POOL_DEVICE, POOL_PINNED, POOL_MANAGED)


def check_descriptor(d: object) -> Descriptor:
    """Return ``d`` if it is a well-formed descriptor of this version, else raise.

    Every message takes this check, so the accepting path is one expression; what
    :func:`_reject` names on failure is the same list of conditions, field by field.
    """
    if type(d) is not Descriptor or d.version != VERSION:
        raise ProtocolError(_problem(d))
    assert isinstance(d, Descriptor)
    item = _itemsize(d.dtype)
    shape, strides = d.shape, d.strides
    if (
        d.kind in _KINDS
        and type(d.address) is str
        and type(d.pool_uuid) is str
        and type(d.device_uuid) is str
        and d.pool_kind in _POOL_KINDS
        and (d.kind == "cupy" or d.pool_kind != POOL_DEVICE)
        and type(d.export_id) is int
        and 0 < d.export_id < 2**64
        and type(d.export_data) is bytes
        and len(d.export_data) == HANDLE_BYTES
        and type(d.size) is int
        and 0 < d.size < 2**63
        and type(d.ticket) is bytes
        and len(d.ticket) == TICKET_BYTES
        and (d.event is None or (type(d.event) is bytes and len(d.event) == HANDLE_BYTES))
        and type(d.offset) is int
        and 0 <= d.offset <= d.size
        and type(shape) is tuple
        and type(strides) is tuple
        and len(strides) == len(shape)
        and all(type(n) is int and n >= 0 for n in shape)
        and all(type(st) is int for st in strides)
        and item > 0
        and _count(shape) * item < 2**63
        and type(d.life) is int
        and 0 <= d.life < 2**64
        and _fits(d, item)
    ):
        return d
    raise ProtocolError(_problem(d) or "a shared array's descriptor is malformed")


def _problem(d: object) -> str | None:
    """What is wrong with descriptor ``d``, checked one condition at a time (None: nothing)."""
    if type(d) is not Descriptor:
        return (
            f"a shared array arrived in a format this cupy_poolmem cannot read "
            f"({type(d).__name__}); install one cupy_poolmem version in every process"
        )
    if d.version != VERSION:
        return (
            f"message format {d.version} from a different cupy_poolmem version (this one "
            f"reads format {VERSION}); install one cupy_poolmem version in every process"
        )
    checks = (
        ("kind", lambda: d.kind in _KINDS),
        ("address", lambda: type(d.address) is str),
        ("pool_uuid", lambda: type(d.pool_uuid) is str),
        ("device_uuid", lambda: type(d.device_uuid) is str),
        ("pool_kind", lambda: d.pool_kind in _POOL_KINDS),
        # a host (numpy) array on device memory: the host would dereference a device address
        ("kind", lambda: d.kind == "cupy" or d.pool_kind != POOL_DEVICE),
        ("export_id", lambda: _int(d.export_id) and 0 < d.export_id < 2**64),
        ("export_data", lambda: _bytes(d.export_data, HANDLE_BYTES)),
        ("size", lambda: _int(d.size) and 0 < d.size < 2**63),
        ("ticket", lambda: _bytes(d.ticket, TICKET_BYTES)),
        ("event", lambda: d.event is None or _bytes(d.event, HANDLE_BYTES)),
        ("offset", lambda: _int(d.offset) and 0 <= d.offset <= d.size),
        ("shape", lambda: type(d.shape) is tuple and all(_int(n) and n >= 0 for n in d.shape)),
        (
            "strides",
            lambda: (
                type(d.strides) is tuple
                and len(d.strides) == len(d.shape)
                and all(_int(st) for st in d.strides)
            ),
        ),
        ("dtype", lambda: _itemsize(d.dtype) > 0),
        ("shape", lambda: _count(d.shape) * _itemsize(d.dtype) < 2**63),
        ("life", lambda: _int(d.life) and 0 <= d.life < 2**64),
    )
    for name, ok in checks:
        if not ok():
            what = f"{name}={getattr(d, name)!r:.80}"
            break
    else:
        if _fits(d, _itemsize(d.dtype)):
            return None
        what = (
            f"an array of shape {d.shape}, strides {d.strides} and dtype {d.dtype} at "
            f"offset {d.offset} does not fit its {d.size}-byte block"
        )
    return f"a shared array's descriptor is malformed ({what}); it was not mapped"


def _count(shape: tuple) -> int:
    """The number of items of ``shape`` (a broadcast array's may exceed its block's:
    its bytes, ``count * itemsize``, must still be an array size, below ``2**63``)."""
    n = 1
    for k in shape:
        n *= k
        if n == 0:
            return 0
    return n


def _int(v: object) -> bool:
    return type(v) is int


def _bytes(v: object, n: int) -> bool:
    return type(v) is bytes and len(v) == n


_ITEMSIZES: dict[str, int] = {}  # dtype string -> item size (0: refused); a few entries


def _itemsize(dtype: object) -> int:
    """The item size of a dtype string; 0 for anything else, and for object dtypes (the
    receiver would read pointers out of shared memory)."""
    if type(dtype) is not str:
        return 0
    n = _ITEMSIZES.get(dtype)
    if n is not None:
        return n
    import numpy as np

    try:
        dt = np.dtype(dtype)
    except Exception:
        return 0
    n = 0 if dt.hasobject else dt.itemsize
    if len(_ITEMSIZES) < 256:  # what peers send cannot grow it without bound
        _ITEMSIZES[dtype] = n
    return n


def span(d: Descriptor, item: int = 0) -> tuple[int, int]:
    """``(first, end)``: the bytes of its block the array ``d`` describes reaches, from
    ``first`` to before ``end``, for any strides (negative ones reach below ``offset``);
    ``(offset, offset)`` for an empty array.  ``item``: the item size, if known."""
    if 0 in d.shape:
        return d.offset, d.offset
    lo = hi = d.offset
    for n, st in zip(d.shape, d.strides):
        reach = (n - 1) * st
        if reach < 0:
            lo += reach
        else:
            hi += reach
    return lo, hi + (item or _itemsize(d.dtype))


def _fits(d: Descriptor, item: int) -> bool:
    """Whether the array ``d`` describes (items of ``item`` bytes) lies within its block
    (an empty one always)."""
    lo, end = span(d, item)
    return lo >= 0 and end <= d.size


# -- frames ---------------------------------------------------------------------------------
class Claim(NamedTuple):
    """Receiver -> exporter: map this block for my ticket (reply awaited before mapping).

    ``want_fd``: send the pool's file descriptor with the reply (first block of a pool
    in this process); ``keep``: the receiver may keep the new mapping idle after use
    (the exporter then asks for it back when it frees it); ``held``: the receiver maps
    the block already (idle, at a life it told the exporter it is done with): no new
    lease, and the exporter counts it busy again once granted (P12).
    ``life``, ``size`` and ``end``: the life, block size and end of the bytes the
    message names (its descriptor's): the exporter grants nothing unless they are the
    block's (I1, I5).  ``block``: :func:`block_id` of the pool and allocation the
    receiver will map, and the pool's kind (its descriptor's): the exporter grants
    nothing unless they are ``export_id``'s, so a live ticket of one block never maps another (I1, I5).
    """

    seq: int
    export_id: int
    ticket: bytes
    want_fd: bool
    keep: bool
    held: bool
    life: int
    size: int
    end: int
    block: bytes


def block_id(pool_uuid: str, pool_kind: int, export_data: bytes) -> bytes:
    """16 bytes naming one allocation: a digest of its pool's uuid and kind and its export
    data (what a receiver maps, and how), sent with a claim and compared by the exporter
    with the block's."""
    import hashlib

    head = pool_uuid.encode("utf-8", "surrogatepass") + b"\0" + bytes((pool_kind & 0xFF,))
    return hashlib.blake2b(head + export_data, digest_size=16).digest()


def claim_for(d: Descriptor, seq: int, want_fd: bool, keep: bool, held: bool, end: int) -> Claim:
    """The :class:`Claim` of message ``d`` (its export id, ticket, life, size and block),
    asking for the bytes up to ``end``."""
    block = block_id(d.pool_uuid, d.pool_kind, d.export_data)
    return Claim(seq, d.export_id, d.ticket, want_fd, keep, held, d.life, d.size, end, block)


_STEP_MAGIC = b"cpmSTEP1"
_STEP_DATA = struct.Struct("<8sQQQ32s")  # magic, block address, bytes, steps, digest


def step_export_data(ptr: int, size: int, steps: Sequence[Sequence[int]]) -> bytes:
    """The 64-byte export data of a block of a mapped or expandable pool: its address
    and size in the exporter, and a digest of its steps ``(id, address, bytes)``."""
    import hashlib

    flat = b"".join(struct.pack("<QQQ", *s) for s in steps)
    digest = hashlib.blake2b(flat, digest_size=32).digest()
    return _STEP_DATA.pack(_STEP_MAGIC, ptr, size, len(steps), digest)


def step_block(export_data: bytes) -> tuple[int, int, int, bytes] | None:
    """``(address, bytes, steps, digest)`` of a step block's export data; None for a
    CUDA-pool allocation's."""
    if len(export_data) != HANDLE_BYTES or not export_data.startswith(_STEP_MAGIC):
        return None
    _, ptr, size, n, digest = _STEP_DATA.unpack(export_data)
    return ptr, size, n, digest


class Hit(NamedTuple):
    """Receiver -> exporter: ticket received (a message of ``life``); I hold a lease on
    this block already.  An acknowledgement only: a dead ticket or another life's is
    ignored."""

    export_id: int
    ticket: bytes
    life: int


class Drop(NamedTuple):
    """Receiver -> exporter: ticket received, but the message could not be taken."""

    export_id: int
    ticket: bytes


class Unmap(NamedTuple):
    """Receiver -> exporter: one mapping gone; its free precedes ``event`` (or none)."""

    export_id: int
    event: bytes | None


class Mapped(NamedTuple):
    """Receiver -> exporter: a granted Claim is settled (mapped, or its lease given back).

    An exporter's exit waits for it: the allocation must be mapped before the
    exporter's context, and the allocations nobody maps with it, are gone.
    """

    export_id: int


class Register(NamedTuple):
    """Forwarder -> exporter: a message with ``ticket`` is on its way (reply awaited)."""

    seq: int
    export_id: int
    ticket: bytes


class Reply(NamedTuple):
    """Exporter -> receiver: the answer to a Claim or Register; a pool fd may follow."""

    seq: int
    status: int
    has_fd: bool


class Evict(NamedTuple):
    """Exporter -> receiver: I freed this block; unmap it once your arrays are gone."""

    export_id: int


class Release(NamedTuple):
    """Exporter -> receiver: I want to put this block back into its pool's reuse cache
    after life ``life``; say :class:`Idle` once no array of yours uses it (keep the
    mapping)."""

    export_id: int
    life: int


class Idle(NamedTuple):
    """Receiver -> exporter: no array of mine uses this block; my last use precedes
    ``event``.  From now on I take a message without a claim only of life ``life + 1``
    (P12)."""

    export_id: int
    life: int
    event: bytes


class StepClaim(NamedTuple):
    """Receiver -> exporter: a :class:`Claim` of a block of a mapped or expandable pool.

    ``claim``: the claim itself (``want_fd`` unused); ``have``: ids of that pool's steps
    the receiver holds imported (and keeps imported until the reply is handled): the
    exporter sends descriptors of the block's other steps only.
    """

    claim: Claim
    have: tuple[int, ...]


class StepReply(NamedTuple):
    """Exporter -> receiver: the answer to a :class:`StepClaim`.  ``steps``: the block's
    steps ``(id, address in the exporter, bytes, a descriptor follows)`` in address
    order (empty unless granted); the descriptors follow in that order."""

    seq: int
    status: int
    steps: tuple[tuple[int, int, int, bool], ...]


OK, REFUSED, NOT_HELD, OUT_OF_SPAN, OTHER_BLOCK, STALE_STEPS = 0, 1, 2, 3, 4, 5  # Reply.status
NOT_EXPORTED = 6  # a StepReply's: the exporter's driver refused to export a step (it warns)

#: the most step ids a StepClaim names (a larger set is cut: those steps come again)
HAVE_MAX = 4096
#: descriptors per SCM_RIGHTS message (the kernel's SCM_MAX_FD is 253)
STEP_FD_MAX = 250

_CLAIM, _HIT, _DROP, _UNMAP, _REGISTER, _MAPPED, _IDLE = 1, 2, 3, 4, 5, 6, 7
_REPLY, _EVICT, _RELEASE, _BATCH = 16, 17, 18, 32
_STEP_CLAIM, _STEP_REPLY = 8, 19  # variable length: a head, a count, the entries
_COUNT = struct.Struct("<I")
_HAVE = struct.Struct("<Q")
_STEP = struct.Struct("<QQQB")
_LAYOUT: dict[int, tuple[struct.Struct, type]] = {
    _CLAIM: (struct.Struct("<BIQ16sBBBQQQ16s"), Claim),
    _HIT: (struct.Struct("<BQ16sQ"), Hit),
    _DROP: (struct.Struct("<BQ16s"), Drop),
    _UNMAP: (struct.Struct("<BQ64sB"), Unmap),
    _REGISTER: (struct.Struct("<BIQ16s"), Register),
    _MAPPED: (struct.Struct("<BQ"), Mapped),
    _IDLE: (struct.Struct("<BQQ64s"), Idle),
    _REPLY: (struct.Struct("<BIBB"), Reply),
    _EVICT: (struct.Struct("<BQ"), Evict),
    _RELEASE: (struct.Struct("<BQQ"), Release),
}
_OP = {cls: op for op, (_, cls) in _LAYOUT.items()}
_LEN = struct.Struct("<H")
_ZERO_HANDLE = bytes(HANDLE_BYTES)


def encode(frame: NamedTuple) -> bytes:
    """The bytes of one frame."""
    if type(frame) is StepClaim:
        have = frame.have[:HAVE_MAX]
        head = encode(frame.claim)
        return b"".join(
            [bytes((_STEP_CLAIM,)), head[1:], _COUNT.pack(len(have))]
            + [_HAVE.pack(i) for i in have]
        )
    if type(frame) is StepReply:
        steps = frame.steps
        head = _LAYOUT[_REPLY][0].pack(_STEP_REPLY, frame.seq, frame.status, False)
        return b"".join([head, _COUNT.pack(len(steps))] + [_STEP.pack(*st) for st in steps])
    op = _OP[type(frame)]
    st = _LAYOUT[op][0]
    if op == _UNMAP:
        ev = frame.event  # type: ignore[attr-defined]
        return st.pack(op, frame.export_id, ev or _ZERO_HANDLE, ev is not None)  # type: ignore[attr-defined]
    return st.pack(op, *frame)


def encode_batch(frames: list[NamedTuple]) -> bytes:
    """Several frames in one message (what a sender thread found queued)."""
    if len(frames) == 1:
        return encode(frames[0])
    parts = [bytes((_BATCH,))]
    for f in frames:
        b = encode(f)
        parts.append(_LEN.pack(len(b)))
        parts.append(b)
    return b"".join(parts)


def _decode_steps(buf: bytes) -> NamedTuple:
    """A :class:`StepClaim` or :class:`StepReply` (variable length)."""
    claim = buf[0] == _STEP_CLAIM
    head = _LAYOUT[_CLAIM if claim else _REPLY][0]
    entry = _HAVE if claim else _STEP
    n = head.size + _COUNT.size
    if len(buf) < n:
        raise ProtocolError(f"malformed sharing frame ({len(buf)} bytes, op {buf[:1]!r})")
    (count,) = _COUNT.unpack_from(buf, head.size)
    if len(buf) != n + count * entry.size or count > (HAVE_MAX if claim else STEPS_MAX_WIRE):
        raise ProtocolError(f"malformed sharing frame ({len(buf)} bytes, {count} entries)")
    items = [entry.unpack_from(buf, n + k * entry.size) for k in range(count)]
    if claim:
        c = _decode_one(bytes((_CLAIM,)) + buf[1 : head.size])
        return StepClaim(c, tuple(i for (i,) in items))  # type: ignore[arg-type]
    _, seq, status, _ = head.unpack_from(buf)
    return StepReply(seq, status, tuple((a, b, c, bool(f)) for a, b, c, f in items))


#: the most steps a StepReply names (as ``_steps.STEPS_MAX``)
STEPS_MAX_WIRE = 1 << 17


def _decode_one(buf: bytes) -> NamedTuple:
    if buf and buf[0] in (_STEP_CLAIM, _STEP_REPLY):
        return _decode_steps(buf)
    ent = _LAYOUT.get(buf[0]) if buf else None
    if ent is None or len(buf) != ent[0].size:
        raise ProtocolError(f"malformed sharing frame ({len(buf)} bytes, op {buf[:1]!r})")
    st, cls = ent
    _, *fields = st.unpack(buf)
    if cls is Unmap:
        return Unmap(fields[0], fields[1] if fields[2] else None)
    if cls is Claim:
        fields[3:6] = [bool(fields[3]), bool(fields[4]), bool(fields[5])]
    elif cls is Reply:
        fields[-1] = bool(fields[-1])
    return cls(*fields)


def decode(buf: bytes) -> list[NamedTuple]:
    """The frames in one received message; raises :class:`ProtocolError` if malformed."""
    if not buf or buf[0] != _BATCH:
        return [_decode_one(buf)]
    out, i, n = [], 1, len(buf)
    while i < n:
        if i + 2 > n:
            raise ProtocolError("truncated sharing batch")
        (ln,) = _LEN.unpack_from(buf, i)
        i += 2
        if i + ln > n:
            raise ProtocolError("truncated sharing batch")
        out.append(_decode_one(buf[i : i + ln]))
        i += ln
    return out
