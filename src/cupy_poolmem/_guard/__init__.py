"""Guard mode: catch use-after-free, double frees, out-of-bounds writes and unordered reuse.

Opt-in per pool (``DevicePool(guard=True)``, ``set_allocator(guard=True)`` or
``CUPY_POOLMEM_GUARD=1``): red zones after each block, a poisoned quarantine of freed
blocks, a generation per allocation for :func:`check`, and reports of bad frees and
unordered reuse.  This package re-exports its public names; :doc:`guard` says how it
works.
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
