"""cupy_poolmem: CUDA stream-ordered memory pools for CuPy.

Device, NUMA-aware pinned and managed pools behind CuPy's allocator hooks, built on
cuda.core, with zero-copy sharing of arrays between processes.

A base install (``pip install cupy_poolmem``) imports without any CUDA package: the
errors, :func:`parse_bytes`, :mod:`cupy_poolmem.stats` and :mod:`cupy_poolmem.report`
(reading and plotting allocation logs) work on any machine.  The GPU features load on
first use and need the ``cu13`` (or ``cu12``) extra; without it they raise
:class:`MissingDependencyError` naming the command that installs it.

Examples
--------
>>> import cupy_poolmem
>>> cupy_poolmem.parse_bytes("512MiB")
536870912
>>> cupy_poolmem.set_allocator(max_size="90%")  # doctest: +SKIP
>>> cupy_poolmem.set_pinned_memory_allocator()  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import logging as _logging
from typing import TYPE_CHECKING, Any

from . import stats
from ._access import check_access
from ._device import device_count, nearest_numa_node
from ._errors import (
    CUDADriverError,
    DoubleFreeError,
    GuardError,
    GuardWarning,
    HandleStateError,
    InvalidOptionError,
    InvalidSizeError,
    LogFormatError,
    MissingDependencyError,
    NoGPUError,
    OptionTypeError,
    OutOfBoundsWriteError,
    OutOfPoolMemoryError,
    PinnedOutOfMemoryError,
    PoolClosedError,
    PoolmemError,
    SharingError,
    TransferError,
    UnorderedReuseError,
    UnsupportedError,
    UsageError,
    UseAfterFreeError,
    WrongDeviceError,
)
from ._poolstats import PoolStats
from ._sizes import format_bytes, parse_bytes
from .stats import (
    current_tag,
    flush_log,
    get_statistics,
    is_tracking,
    outstanding,
    start_log,
    statistics,
    stop_log,
    tag,
    track,
)

if TYPE_CHECKING:  # what the lazy names below are, for type checkers and IDEs
    from ._allocator import (
        PoolAllocator,
        get_pinned_pool,
        get_pool,
        set_allocator,
        set_pinned_memory_allocator,
        using,
    )
    from ._guard import Guard, GuardedBlock, GuardEvent, GuardOptions, check
    from ._pools import (
        DevicePool,
        ManagedPool,
        PinnedPool,
        Pool,
        all_pools,
        hotpath_implementation,
        managed_backend,
    )
    from ._pools._blocks import record_stream
    from ._sharing import SharingSettings
    from ._sharing import settings as sharing
    from .managed import advise, prefetch

__version__ = "0.1.0"

# Operational events (exporter started, peer gone, fallback taken, pool retired) go to
# the "cupy_poolmem" logger; silent until the application routes it (docs/observability).
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

#: Public names that need CuPy and cuda.core: ``name -> (module, attribute)``.  They
#: are imported on first access (``cupy_poolmem.DevicePool``), so the package imports
#: on a machine without CUDA packages.
_LAZY: dict[str, tuple[str, str]] = {
    "PoolAllocator": ("._allocator", "PoolAllocator"),
    "get_pinned_pool": ("._allocator", "get_pinned_pool"),
    "get_pool": ("._allocator", "get_pool"),
    "set_allocator": ("._allocator", "set_allocator"),
    "set_pinned_memory_allocator": ("._allocator", "set_pinned_memory_allocator"),
    "using": ("._allocator", "using"),
    "check": ("._guard", "check"),
    "Guard": ("._guard", "Guard"),
    "GuardEvent": ("._guard", "GuardEvent"),
    "GuardOptions": ("._guard", "GuardOptions"),
    "GuardedBlock": ("._guard", "GuardedBlock"),
    "DevicePool": ("._pools", "DevicePool"),
    "ManagedPool": ("._pools", "ManagedPool"),
    "PinnedPool": ("._pools", "PinnedPool"),
    "Pool": ("._pools", "Pool"),
    "all_pools": ("._pools", "all_pools"),
    "hotpath_implementation": ("._pools", "hotpath_implementation"),
    "managed_backend": ("._pools", "managed_backend"),
    "record_stream": ("._pools._blocks", "record_stream"),
    "sharing": ("._sharing", "settings"),
    "SharingSettings": ("._sharing", "SharingSettings"),
    "advise": (".managed", "advise"),
    "prefetch": (".managed", "prefetch"),
}

#: Modules imported together on the first access to any lazy name.  Importing
#: ``_sharing`` hooks it into the pools (through ``_runtime``) and registers the CuPy
#: reducer (arrays of other allocators then travel by a device copy,
#: ``sharing.fallback``); ``_allocator`` imports it too.
_GPU_CORE: tuple[str, ...] = ("._pools", "._allocator", "._sharing", ".managed")

# Top-level modules whose absence means "the GPU extra is not installed".
_GPU_PACKAGES = ("cupy", "cupyx", "cupy_backends", "cuda", "fastrlock")

__all__ = [
    "CUDADriverError",
    "DevicePool",
    "DoubleFreeError",
    "Guard",
    "GuardError",
    "GuardEvent",
    "GuardOptions",
    "GuardWarning",
    "GuardedBlock",
    "HandleStateError",
    "InvalidOptionError",
    "InvalidSizeError",
    "LogFormatError",
    "ManagedPool",
    "MissingDependencyError",
    "NoGPUError",
    "OptionTypeError",
    "OutOfBoundsWriteError",
    "OutOfPoolMemoryError",
    "PinnedOutOfMemoryError",
    "PinnedPool",
    "Pool",
    "PoolAllocator",
    "PoolClosedError",
    "PoolStats",
    "PoolmemError",
    "SharingError",
    "TransferError",
    "SharingSettings",
    "UnorderedReuseError",
    "UnsupportedError",
    "UsageError",
    "UseAfterFreeError",
    "WrongDeviceError",
    "__version__",
    "advise",
    "all_pools",
    "check",
    "check_access",
    "current_tag",
    "device_count",
    "format_bytes",
    "get_pinned_pool",
    "flush_log",
    "get_pool",
    "get_statistics",
    "hotpath_implementation",
    "is_tracking",
    "managed_backend",
    "nearest_numa_node",
    "outstanding",
    "parse_bytes",
    "prefetch",
    "record_stream",
    "set_allocator",
    "set_pinned_memory_allocator",
    "sharing",
    "start_log",
    "statistics",
    "stats",
    "stop_log",
    "tag",
    "track",
    "using",
]


def _import_gpu_module(module: str, feature: str) -> Any:
    try:
        return importlib.import_module(module, __name__)
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        if top in _GPU_PACKAGES:
            raise MissingDependencyError(feature, str(exc)) from None
        raise


#: 0.1 spellings kept for one release: ``name -> sharing method``.
_DEPRECATED = {"collect": "collect", "sharing_stats": "stats"}


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        import warnings

        new = _DEPRECATED[name]
        warnings.warn(
            f"cupy_poolmem.{name} is deprecated; use cupy_poolmem.sharing.{new}()",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(__getattr__("sharing"), new)
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    feature = f"{__name__}.{name}"
    for module in _GPU_CORE:
        _import_gpu_module(module, feature)
    value = getattr(_import_gpu_module(target[0], feature), target[1])
    globals()[name] = value  # later accesses skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


stats._init_from_env()
