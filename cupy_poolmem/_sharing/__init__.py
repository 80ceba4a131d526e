"""Zero-copy sharing of CuPy arrays between processes: the lifetime protocol.

Parts, one file each: ``_wire`` (the descriptor a pickled array carries and the
protocol's fixed frames), ``_transport`` (authenticated connections, per-peer
senders), ``_exporter`` (tickets, leases, limbo, the server), ``_importer``
(clients, mappings, eviction, the one imported-pool cache), ``_reducers``
(multiprocessing's reduce/rebuild pairs), ``_settings`` and ``_context`` (the
process's state and its owner), ``_driver`` (the CUDA calls, faked in CPU tests).

Invariants (every change to this package must keep them):

1. Ownership.  The process that allocated a block (the *exporter*) is the only one
   that frees it.  A block it has exported is freed only when (a) its own last local
   reference is gone, (b) it holds no unclaimed *ticket*, (c) no *lease* and (d) no
   round-tripped array of its own.  Until then it sits in *limbo*
   (``held_for_sharing_bytes``), never in the reuse cache, and its pool is not
   released by ``close()``.  (A recycled block's leases of idle mappings hold back
   only its final free: invariant 12.)
2. Tickets cover messages.  Every pickled reference carries a fresh ticket of 16
   random bytes, registered with the exporter before the message can reach anyone:
   at reduce time in the exporter, or, for a forwarded array, by a ``Register`` the
   exporter answers before the forwarder's message exists.  A ticket ends when a
   receiver claims it (or says ``Drop``), or after ``inflight_timeout`` (a message
   nobody reads pins memory that long at most).  A claimed ticket may be claimed
   again, by another copy of the same message, while the block lives and while it is
   among the block's 4096 most recently claimed tickets; a copy of an older message
   is refused (``REFUSED``: :class:`SharingError`), never given other data.
3. Claims come before mappings.  A receiver that does not map the block yet sends
   ``Claim`` and waits for the answer: a live ticket becomes a *lease* (and, the
   first time, the pool's file descriptor comes with it); a stale one is refused,
   and the receiver raises :class:`SharingError` instead of mapping memory the
   exporter may have reused.  Once it has mapped the block (or given the lease back)
   the receiver says ``Mapped``.  A receiver that maps it already sends ``Hit``,
   lazily: its sender thread batches them within a few milliseconds (nobody waits
   for one; the ticket pins the block until it arrives), in order with its other
   frames.
4. Leases cover mappings.  A receiver holds one lease per mapping, from the granted
   claim to ``Unmap``, while arrays use the mapping and while it idles in the
   receiver's cache.  Leases are counted per connection.  When a connection closes,
   its leases are given back only once the receiver's process has exited (its GPU
   context, and the work it queued, are gone then); a receiver of pid 0 (another pid
   namespace) cannot be watched: its leases stay until the exporter exits.
5. Eviction.  A receiver keeps the mapping of a block it received more than once
   after its arrays are gone (at most ``keep_mappings``, least recently used out
   first).  When a block in limbo is held by leases only, the exporter asks each
   holder that may keep it to ``Evict``: an idle mapping is unmapped at once, a used
   one when its last array goes.  Receivers unmap the idle mappings of an exporter
   whose connection closed, and forget everything of it once nothing maps its
   blocks (connection, opened events, imported pools).
6. Driver rule.  An importer frees its mapping (stream-ordered, after its last use
   on every stream that used it) and records an IPC event *before* it sends
   ``Unmap``; the exporter's free, and its reuse of the block, wait on every such
   event (a wait on the host with no lock held).  A new mapping of the same
   allocation waits for the old one's free.
7. Ordering.  A message carries the exporter's IPC event recorded on the block's
   allocation stream, whatever thread pickles.  The receiver waits for it before
   the array exists: on the host by default (``receive_order="sync"``), so any
   thread and stream may use the array; or on the unpickling thread's stream
   (``"stream"``).  A forwarder waits for its own writes before forwarding.  At exit
   an exporter waits for the work its messages' events cover.
8. One import per allocation per process.  The CuPy reducers and the Numba plugin
   map through one importer: an allocation mapped (in use or idle) is reused; the
   pool is imported once per process.
9. Same GPU.  Devices are matched by UUID, so ``CUDA_VISIBLE_DEVICES`` orders may differ.
10. Trust.  Connections are Unix sockets in a 0700 directory, authenticated both ways
    with the multiprocessing authkey of the process family; peers of another user are
    refused; a connection not authenticated 5 s after it connected is dropped whatever
    it sends, in a thread of its own, at most 64 at once.  Frames are fixed ``struct`` layouts, never unpickled; a pool's
    file descriptor goes only to a peer presenting a live ticket for a block of that
    pool.  The pickled *message* itself is unpickled by the receiver's
    multiprocessing channel, as for any pickle: receive only from trusted processes.
11. Exit.  A process that shared arrays waits at exit, after multiprocessing has
    flushed its queues, until its messages are claimed and the granted claims mapped
    (``exit_timeout``): an allocation nobody maps goes with the exporter's context.
    Receivers' mappings stay valid after it is gone.  A ``fork`` child gets a fresh, empty
    sharing state and refuses to share when CUDA was in use in its parent; arrays it
    inherited go without touching the parent's sharing state (its locks, the driver).
12. Recycling.  A device pool's exported block that fits its reuse cache (``life`` >
    0; others are never recycled) goes back to the cache with its record when it has
    no ticket, no round trip, and every lease is an idle mapping whose receiver said
    ``Idle`` at the block's current *life*; first the block's stream waits for the
    receivers' Idle and Unmap events, and the claimed tickets of that life are
    forgotten: every message of an earlier life is refused from then on.  The next
    message of a reused block starts a new life.  A receiver uses its mapping for a
    message without a claim only when the message's life is newer than the last life
    it said ``Idle`` for; otherwise it claims (``held``: no new lease), and a granted
    claim makes the exporter count it busy again.  Before recycling, the exporter asks
    (``Release``) every receiver it does not count idle at the current life, and asks
    again after a claim's ``Mapped`` (a Release that reached the receiver before it
    knew the mapping was ignored).  Frames from one receiver reach its exporter in
    the order they were made: a request is sent directly only when nothing is queued,
    so a claim never overtakes an ``Idle``.  The final free (trim, close, out of
    memory, a full cache) is invariant 1's: receivers evict, then the driver free.
    While in the cache the record holds no pool (the cache holds the record); a pool
    finalized with such blocks, or with a block made of one, touches no stream: the
    exporter waits for the unmaps on the host and hands the block to the pool's
    retirer (``_orphan``), which frees it after a device synchronise.  A stream being
    captured is never made to wait on a receiver's event (the wait would join the
    graph): the exporter waits for those on the host instead.
    A Dask refetch reads a live block only in the life its descriptor names.
"""

from __future__ import annotations

from ._context import SharingContext, context, register_exit_wait, settings
from ._settings import SharingSettings

__all__ = ["settings", "SharingSettings", "SharingContext", "context", "install"]


def _release(core: object, ptr: int, size: int, stream: object, rec: object) -> bool:
    return rec.exporter.release(ptr, size, stream, rec, core)  # type: ignore[attr-defined]


def _retire(core: object, ptr: int, size: int, stream: object, rec: object) -> bool:
    return rec.exporter.retire(ptr, size, stream, rec, core)  # type: ignore[attr-defined]


def _on_ipc_pool(pool: object) -> None:
    from .._pools import _hp
    from ._reducers import register_numpy

    if getattr(pool, "kind", None) == _hp.KIND_PINNED:
        register_numpy()


def install() -> None:
    """Hook sharing into the pools and multiprocessing (run once, when this package is
    imported: by ``cupy_poolmem``'s GPU names, or by the first IPC-enabled pool)."""
    from .._pools import _IPC_POOL_CALLBACKS, _OOM_CALLBACKS, _hp, all_pools
    from ._reducers import register_cupy

    _hp.set_shared_release(_release, _retire)
    _OOM_CALLBACKS.append(lambda: context().collect())
    _IPC_POOL_CALLBACKS.append(_on_ipc_pool)
    for p in all_pools():
        if getattr(p, "ipc", False):
            _on_ipc_pool(p)
    register_cupy()
    register_exit_wait()


install()
