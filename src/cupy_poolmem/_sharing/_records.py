"""The exporter's book of shared blocks: one :class:`Record` per exported block, the
:class:`LocalHold` of an array that came back, and the :class:`Peer` of a receiver."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from . import _wire
from ._transport import Conn, Sender

if TYPE_CHECKING:
    from ._exporter import Exporter

__all__ = ["Record", "LocalHold", "Peer"]


class Record:
    """One exported block, as its exporter sees it.

    ``tickets``: messages on their way (ticket -> time registered); ``claimed``:
    the exporter's last ``claimed_max`` tickets received (another copy of one of those messages
    may still claim while the block lives; a copy of an older one is refused); ``leases``:
    mappings per receiver connection (each holder is asked to evict when the block is
    freed); ``events``: receivers' unmap and idle events the final free (and a reuse) waits on.

    Recycling (P12): ``life`` numbers the block's lives in its pool's reuse
    cache (0: a block that is never recycled); ``idle``: per receiver connection, the
    life its last ``Idle`` said (its mapping unused, messages of that life or earlier
    claimed); ``released``: the life each receiver was asked to say ``Idle`` for;
    ``retiring``: the cache let the block go, it waits for its final free.  While the
    block is *dormant* (in the reuse cache, or reused by a new block not exported yet)
    ``core`` is None: the pool's cache holds the record, never the other way round, so
    a pool dropped without ``close()`` can still be collected (the hot path's hooks
    hand the pool back).  ``orphan``: its pool was finalized (a garbage cycle), so its
    stream may be destroyed: the receivers' events are waited for on the host and the
    final free goes to the pool's retirer (``_orphan``), which frees it after a device
    synchronise.
    """

    __slots__ = (
        "exporter",
        "export_id",
        "ptr",
        "size",
        "core",
        "stream",
        "stream_ptr",
        "dev",
        "dev_uuid",
        "data",
        "pool_uuid",
        "pool_mr",
        "ident",
        "tickets",
        "claimed",
        "leases",
        "asked",
        "events",
        "local",
        "in_limbo",
        "block_ref",
        "life",
        "idle",
        "released",
        "retiring",
        "orphan",
        "placement",
        "steps",
    )

    def __init__(
        self,
        exporter: Exporter,
        export_id: int,
        block: Any,
        data: bytes,
        dev: int,
        dev_uuid: str,
        pool: tuple[str, Any],
        placement: Any = None,
        steps: tuple[tuple[int, int, int], ...] = (),
    ) -> None:
        self.exporter = exporter
        self.export_id = export_id
        self.ptr, self.size, self.core = block.ptr, block.size, block.core
        self.stream = block.stream
        self.stream_ptr = int(block.stream_ptr)
        self.dev, self.dev_uuid, self.data = dev, dev_uuid, data
        # The CUDA pool that holds the block (a DevicePool may have two): its uuid goes
        # in every message, its descriptor to a receiver that has not imported it.
        self.pool_uuid, self.pool_mr = pool
        # what a claim must name: this allocation, of this pool, of this kind
        self.ident = _wire.block_id(self.pool_uuid, block.core.kind, data)
        self.tickets: dict[bytes, float] = {}
        self.claimed: OrderedDict[bytes, None] = OrderedDict()
        self.leases: dict[int, int] = {}
        self.asked: set[int] = set()
        self.events: dict[tuple[int, bytes], Any] = {}
        self.local = 0  # round-tripped arrays alive in this process
        self.in_limbo = False
        self.block_ref: Any = weakref.ref(block)
        # Only a plain device pool's block that fits its reuse cache recycles (a pinned
        # pool defers its frees, a managed block may carry hints): see docs/sharing.rst,
        # "Recycled blocks", for the rule.
        core = self.core
        recycle = (
            core.kind == _wire.POOL_DEVICE
            and core.release_hook is None
            and getattr(core, "_cache_shared", None) is not None
            and 0 < self.size <= getattr(core, "cache_limit", 0)
        )
        # A block of a mapped or expandable pool: its placement and the steps under it
        # ``(id, address, bytes)`` when it was exported (fixed while the block lives).
        # It is never recycled: its final free follows its receivers' unmaps.
        self.placement, self.steps = placement, steps
        self.life = 1 if recycle and placement is None else 0
        self.idle: dict[int, int] = {}
        self.released: dict[int, int] = {}
        self.retiring = False
        self.orphan = False

    def busy(self, cid: int) -> bool:
        """Whether receiver ``cid``'s mapping may be in use in the block's current life
        (a block that is never recycled: whether it maps the block at all)."""
        return not self.life or self.idle.get(cid, 0) < self.life

    def held(self) -> bool:
        """Whether anything but the exporter's own arrays holds the block (a recycled
        block: anything but mappings whose receivers said they are idle)."""
        if self.tickets or self.local:
            return True
        if self.life and not self.retiring:
            return any(self.busy(c) for c in self.leases)
        return bool(self.leases)


class LocalHold:
    """An array that came back to its exporter: keeps the block (or its limbo entry)."""

    __slots__ = ("exporter", "rec", "block", "ptr", "size", "__weakref__")

    def __init__(self, exporter: Exporter, rec: Record) -> None:
        self.exporter, self.rec = exporter, rec
        self.block = rec.block_ref()
        self.ptr, self.size = rec.ptr, rec.size

    def __del__(self) -> None:
        try:
            self.exporter.let_go_local(self.rec)
        except Exception:  # interpreter shutdown
            pass


class Peer:
    """The exporter's end of one receiver's connection."""

    __slots__ = ("cid", "conn", "sender", "events", "mapping")

    def __init__(self, cid: int, conn: Conn) -> None:
        self.cid, self.conn = cid, conn
        self.mapping = 0  # claims granted that it has not said ``Mapped`` for yet
        self.sender = Sender(conn, f"cupy_poolmem-to-{conn.peer.pid}")
        self.events: dict[bytes, Any] = {}  # the receiver's IPC events, opened here
