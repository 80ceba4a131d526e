"""Zero-copy sharing of CuPy arrays between processes: the lifetime protocol.

Parts, one file each: ``_wire`` (the descriptor a pickled array carries and the
protocol's fixed frames), ``_transport`` (authenticated connections, per-peer
senders), ``_exporter`` (tickets, leases, limbo, the server), ``_importer``
(clients, mappings, eviction, the one imported-pool cache), ``_reducers``
(multiprocessing's reduce/rebuild pairs), ``_settings`` and ``_context`` (the
process's state and its owner), ``_driver`` (the CUDA calls, faked in CPU tests).

Invariants (every change must keep them; docs/sharing.rst lists the same lines and
the protocol rules P1-P12 that keep them; tests/test_sharing_model_cpu.py checks each
where its name says):

I1 Data: an array reads only its message's block, in the life it was sent; any other
   copy (stale, another life) is refused with SharingError (model: i1_*, _take).
I2 Delivery: a genuine message whose sender still holds its memory is received while
   its ticket lives (model: _take, "must succeed").
I3 Ownership: only the exporter frees a block, after every importer's free; nothing is
   freed, recycled or unmapped while a mapping, lease or ticket needs it (model: i3_*).
I4 Order: a receiver reads after the sender's writes; a reuse waits for every
   receiver's last use (model: i3_*, the fake GPU's clocks).
I5 Span: no mapping or array covers bytes outside its block, whatever a descriptor
   says (model: i5_*, forge).
I6 Baseline: once every process lets go, counters, threads, fds, events and imported
   pools return to where they were (model: teardown).
I7 Bounded: no step waits without a bound (model: i7_*).
I8 Trust: peers authenticate; frames are never unpickled; a pool's descriptor goes only
   with a live ticket of that pool (tests/test_sharing_cpu.py, not the model).
"""

from __future__ import annotations

from .. import _runtime
from ._context import SharingContext, context, register_exit_wait, settings
from ._reducers import register_cupy, register_numpy
from ._settings import SharingSettings

__all__ = ["settings", "SharingSettings", "SharingContext", "context", "install"]


def _release(core: object, ptr: int, size: int, stream: object, rec: object) -> bool:
    return rec.exporter.release(ptr, size, stream, rec, core)  # type: ignore[attr-defined]


def _retire(core: object, ptr: int, size: int, stream: object, rec: object) -> bool:
    return rec.exporter.retire(ptr, size, stream, rec, core)  # type: ignore[attr-defined]


def _on_ipc_pool(pool: object) -> None:
    if getattr(pool, "kind", None) == _runtime.hp.KIND_PINNED:
        register_numpy()


def install() -> None:
    """Hook sharing into the pools and multiprocessing (run once, when this package is
    imported: by ``cupy_poolmem``'s GPU names and by ``_allocator``, the public layer)."""
    _runtime.hp.set_shared_release(_release, _retire)
    _runtime.HOOKS.oom.append(lambda: context().collect())
    _runtime.HOOKS.ipc_pool.append(_on_ipc_pool)
    for p in _runtime.all_pools():
        if getattr(p, "ipc", False):
            _on_ipc_pool(p)
    register_cupy()
    register_exit_wait()


install()
