"""The pools: one module per kind (device, pinned, managed) on a shared ``Pool`` base.

Each pool owns its own CUDA memory pool (created by cuda.core); creating one never
changes process-wide state: the device's default and current pools, and their
attributes, stay as they were.  The per-allocation work is in the hot path.
"""

from __future__ import annotations

from .._runtime import all_pools, hotpath_implementation
from ._base import Pool
from ._options import SMALL_POOL_AUTO
from .device import DevicePool
from .managed import ManagedPool, managed_backend
from .pinned import PinnedPool

__all__ = [
    "DevicePool",
    "PinnedPool",
    "ManagedPool",
    "Pool",
    "SMALL_POOL_AUTO",
    "all_pools",
    "hotpath_implementation",
    "managed_backend",
]
