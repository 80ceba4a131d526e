"""Guard mode: catch use-after-free, double frees, out-of-bounds writes and unordered reuse.

A stream-ordered pool hands freed memory to the next allocation at once, so a raw
pointer kept after its array died, a kernel writing past its array, or a stream still
reading a block another stream reuses give wrong numbers far from their cause.  The
guard, opt-in per pool (``DevicePool(guard=True)``, ``set_allocator(guard=True)`` or
``CUPY_POOLMEM_GUARD=1``), makes those bugs loud:

- every block is allocated with a *red zone* of ``red_zone`` bytes after its end,
  filled with the ``canary`` byte on the allocation stream and checked when the block
  is freed (:class:`~cupy_poolmem.OutOfBoundsWriteError`);
- a freed block is *poisoned* (filled with the ``poison`` byte, on its stream) and
  kept in a FIFO *quarantine* bounded by bytes and by count; when it leaves, to be
  really freed, the pattern must be intact (:class:`~cupy_poolmem.UseAfterFreeError`);
- every allocation gets a *generation*, a number no other allocation of the process
  shares, and :func:`check` tells whether a pointer (and generation) still names a
  live allocation;
- frees of blocks already freed, or of pointers the guard never handed out, are
  reported (:class:`~cupy_poolmem.DoubleFreeError`) and not done;
- a block dropped while another stream is current that was not declared with
  :func:`~cupy_poolmem.record_stream` is reported
  (:class:`~cupy_poolmem.UnorderedReuseError`, a heuristic: see ``cross_stream``).

How it plugs in (the normal path pays nothing): :func:`attach` replaces the pool's
``malloc`` with :meth:`Guard.malloc` (an instance attribute, so ``pool.malloc`` and
everything that calls it go through the guard) and installs :meth:`Guard.release` as
the pool's ``release_hook``, which every free of a pool block reaches: a block's last
reference (``Block.__dealloc__``), the Numba plugin (through the same blocks) and the
sharing limbo (``Exporter._free``).  ``set_allocator(guard=...)`` installs a
dispatch object that calls ``pool.malloc`` instead of the hot path's C-level one.  The
device work (fills, checks, stream questions) is in ``_guard_device.py``; CPU tests
give the guard a fake of it.

Errors found inside a destructor cannot be raised there: in ``mode="raise"`` they
wait, and the next allocation from the pool, :meth:`Guard.verify` or :func:`check`
raises them (one per call); in ``mode="warn"`` a :class:`~cupy_poolmem.GuardWarning`
is issued at once.  Both count them and keep them in ``pool.guard.events``.

Quarantined blocks count as freed for the pool (``n_frees``), so the pool's retirement
(``_retire.py``: its CUDA pool destroyed only after a device synchronisation) must
never leave one behind.  ``Pool.close()`` marks the guard closed (later frees are
checked and freed at once) and frees the quarantine, checked, on the blocks' own
streams, which the records keep alive until then; if nothing may synchronise (a graph
capture under way) the rest goes to the retirer as leftovers.  A pool finalized
without ``close()`` (always inside a garbage collection: the pool and its guard
reference each other) hands its whole quarantine to the retirer unchecked, as it does
its reuse cache: a stream in the same garbage may be destroyed already.  Blocks freed
by the garbage collector are freed at once, unchecked, for the same reason.
``stats()["unchecked_blocks"]`` counts both.
"""

from __future__ import annotations

from .guard import Guard, attach
from .lookup import check
from .options import ENV, GuardOptions, resolve
from .records import GuardedBlock, GuardEvent

__all__ = [
    "GuardOptions",
    "GuardedBlock",
    "GuardEvent",
    "Guard",
    "check",
    "attach",
    "resolve",
    "ENV",
]

# The examples of the names above are this package's (doctest reads ``__test__``).
__test__ = {name: globals()[name] for name in __all__ if name != "ENV"}

# Their public home: documentation tools and pickle name them by it.
for _cls in (Guard, GuardedBlock, GuardEvent, GuardOptions):
    _cls.__module__ = __name__
del _cls
