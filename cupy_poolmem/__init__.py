"""cupy_poolmem: CUDA stream-ordered memory pools for CuPy.

Device, NUMA-aware pinned and managed pools behind CuPy's allocator hooks, built on
cuda.core.  Importing the package also registers multiprocessing reducers so CuPy
arrays on IPC-enabled pools travel zero-copy through ``multiprocessing`` channels.

Examples
--------
>>> import cupy, cupy_poolmem
>>> cupy_poolmem.set_allocator()  # doctest: +SKIP
>>> cupy_poolmem.set_pinned_memory_allocator()  # doctest: +SKIP
"""

from . import stats
from ._allocator import (
    PoolAllocator,
    get_pinned_pool,
    get_pool,
    set_allocator,
    set_pinned_memory_allocator,
    using,
)
from ._device import check_access, device_count, nearest_numa_node
from ._errors import (
    CUDADriverError,
    InvalidOptionError,
    InvalidSizeError,
    NoGPUError,
    OptionTypeError,
    OutOfPoolMemoryError,
    PinnedOutOfMemoryError,
    PoolClosedError,
    PoolmemError,
    SharingError,
    UnsupportedError,
    WrongDeviceError,
)
from ._pools import (
    DevicePool,
    ManagedPool,
    PinnedPool,
    Pool,
    all_pools,
    hotpath_implementation,
    managed_backend,
)
from ._poolstats import PoolStats
from ._sharing import install as _install_sharing
from ._sharing import settings as sharing
from ._sizes import format_bytes, parse_bytes
from ._streams import record_stream
from .managed import advise, prefetch
from .stats import (
    current_tag,
    get_statistics,
    is_tracking,
    outstanding,
    start_log,
    statistics,
    stop_log,
    tag,
    track,
)

__version__ = "0.1.0"

__all__ = [
    "CUDADriverError",
    "DevicePool",
    "InvalidOptionError",
    "InvalidSizeError",
    "ManagedPool",
    "NoGPUError",
    "OptionTypeError",
    "OutOfPoolMemoryError",
    "PinnedOutOfMemoryError",
    "PinnedPool",
    "Pool",
    "PoolAllocator",
    "PoolClosedError",
    "PoolStats",
    "PoolmemError",
    "SharingError",
    "UnsupportedError",
    "WrongDeviceError",
    "__version__",
    "advise",
    "current_tag",
    "get_statistics",
    "is_tracking",
    "outstanding",
    "start_log",
    "statistics",
    "stats",
    "stop_log",
    "tag",
    "track",
    "sharing",
    "all_pools",
    "check_access",
    "device_count",
    "format_bytes",
    "get_pinned_pool",
    "get_pool",
    "hotpath_implementation",
    "managed_backend",
    "nearest_numa_node",
    "parse_bytes",
    "prefetch",
    "record_stream",
    "set_allocator",
    "set_pinned_memory_allocator",
    "using",
]

stats._init_from_env()
_install_sharing()


def __getattr__(name: str) -> object:
    # 0.1 spellings, kept for one release: cupy_poolmem.sharing.collect() / .stats().
    if name in ("collect", "sharing_stats"):
        import warnings

        new = "collect" if name == "collect" else "stats"
        warnings.warn(
            f"cupy_poolmem.{name} is deprecated; use cupy_poolmem.sharing.{new}()",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(sharing, new)
    raise AttributeError(f"module 'cupy_poolmem' has no attribute {name!r}")
