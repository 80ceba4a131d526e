"""What this process maps of other processes' blocks: imported pools and mappings.

:class:`ImportedPool` (one per exporter's pool), :class:`Mapping` (one per mapped
allocation) and :class:`Imported` (what the arrays of one received message hold).
The :class:`~cupy_poolmem._sharing._importer.Importer` keeps the tables of them.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, NamedTuple

from ._warn import warn_kept

if TYPE_CHECKING:
    from ._client import Client
    from ._importer import Importer

__all__ = ["ImportedPool", "Mapping", "Imported", "LEGACY_STREAM", "GONE"]


class _Stream(NamedTuple):
    ptr: int


LEGACY_STREAM = _Stream(0)


class ImportedPool:
    """An exporter's pool imported into this process (one per pool, whoever asked)."""

    __slots__ = (
        "uuid",
        "handle",
        "keepalive",
        "dev",
        "kind",
        "users",
        "client",
        "granted",
        "frees",
    )

    def __init__(self, uuid: str, handle: int, keepalive: Any, dev: int, kind: int) -> None:
        self.uuid, self.handle, self.keepalive = uuid, handle, keepalive
        self.dev, self.kind = dev, kind
        self.users = 0  # mappings of this pool alive here
        self.client: Client | None = None  # the exporter it came from, when known
        self.granted: set[int] = set()  # devices given access to it here
        # stream -> event recorded after the latest free of one of its mappings there: the
        # pool is destroyed once they are done (see Importer.close_done_pools)
        self.frees: dict[int, Any] = {}


class Mapping:
    """One exported block mapped into this process (one per driver allocation)."""

    __slots__ = (
        "key",
        "ptr",
        "size",
        "pool",
        "dev",
        "client",
        "export_id",
        "leased",
        "users",
        "keep",
        "evict",
        "last_use",
        "last_stream",
        "waits",
        "life",
        "fence",
        "told",
        "ask",
        "eager",
        "window",
    )

    def __init__(self, key: tuple[str, bytes], ptr: int, size: int, pool: ImportedPool) -> None:
        self.key, self.ptr, self.size, self.pool, self.dev = key, ptr, size, pool, pool.dev
        self.client: Client | None = None
        self.export_id = 0
        self.leased = False  # a lease at the exporter covers it (the CuPy protocol)
        self.users = 1  # live Imported owners and open Numba handles
        self.keep = False  # received before: likely to come again (P5)
        self.evict = False  # the exporter asked for it back
        self.last_use: Any = None  # event recorded when the last user went (idle)
        self.last_stream = 0  # the stream ``last_use`` was recorded on
        self.waits: dict[int, Any] = {}  # stream -> event of earlier users' last use
        # Recycled blocks (P12): ``life``: the life of the messages its arrays
        # came from; ``fence``: messages of this life or earlier are claimed, never hit
        # (promised to the exporter by an Idle); ``told``: the life of the last Idle the
        # exporter still counts (a granted claim makes it count us busy again);
        # ``ask``: the life a Release asked for; ``eager``: say Idle when the last array
        # goes, unasked (the exporter recycles this block between messages).
        self.life = 0
        self.fence = 0
        self.told = 0
        self.ask = 0
        self.eager = False
        # A block of a mapped or expandable pool: the key of its window of steps in the
        # importer's StepMappings (None: a CUDA pool's allocation).
        self.window: Any = None


class Imported:
    """What the arrays of one received message hold on a mapping.

    ``stream`` is the stream that was current when the message was unpickled; the
    mapping is let go in order on it (the way the pools free a block on its
    allocation stream), after every other stream that used the mapping.
    """

    __slots__ = ("importer", "m", "ptr", "size", "stream", "__weakref__")

    def __init__(self, importer: Importer, m: Mapping, stream: Any) -> None:
        self.importer, self.m, self.ptr, self.size, self.stream = importer, m, m.ptr, m.size, stream

    def __del__(self) -> None:
        try:
            self.importer.dropped(self.m, self.stream)
        except Exception as exc:
            if not sys.is_finalizing():  # at shutdown the mappings go with the process
                warn_kept("letting go of a received array", exc)


GONE = (
    "the process that owns this array has exited (or closed its sharing connection); "
    "memory shared by an exited process is gone: keep it alive until receivers have the "
    "array (see cupy_poolmem.sharing.exit_timeout)"
)
