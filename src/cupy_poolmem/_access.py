"""check_access: whether a GPU can use an array's memory (pools, mapped blocks, peers)."""

from __future__ import annotations

from typing import Any

from . import _device
from ._errors import OptionTypeError, WrongDeviceError
from ._expandable import expandable_range_of
from ._mapped import mapped_block_of

__all__ = ["check_access"]


def _data_pointer(array: Any) -> int:
    ptr = getattr(getattr(array, "data", None), "ptr", None)
    if ptr is not None:  # cupy.ndarray
        return int(ptr)
    for attr in ("__cuda_array_interface__", "__array_interface__"):
        iface = getattr(array, attr, None)
        if iface is not None:
            return int(iface["data"][0] or 0)
    raise OptionTypeError(
        "check_access takes a cupy.ndarray, an object with __cuda_array_interface__ or a "
        f"numpy array on pinned memory; got {type(array).__name__}"
    )


def check_access(array: Any, device: Any = None) -> None:
    """Raise a clear error unless GPU ``device`` can read and write ``array``'s memory.

    A kernel that reads pool memory its GPU was not granted fails with
    ``cudaErrorIllegalAddress``, and that error breaks the CUDA context for the rest of
    the process.  CuPy cannot see pool grants (it checks only that the two GPUs are
    peer capable), so call this before using an array from a GPU other than its own
    when you cannot be sure of the grants (``peer_access=None`` pools, memory from
    other libraries).

    Parameters
    ----------
    array : cupy.ndarray, object with ``__cuda_array_interface__``, or numpy.ndarray
        Device memory (any pool, or plain ``cudaMalloc``), managed memory, or host
        memory from a pinned pool.
    device : int or cupy.cuda.Device, optional
        The GPU that will use it; default the current device.

    Raises
    ------
    WrongDeviceError
        The memory's pool grants ``device`` no access (grant it: ``pool.peer_access``).
    UnsupportedError
        The two GPUs cannot access each other at all; both are named.
    InvalidOptionError
        The driver does not know the memory (pageable host memory, on most systems).

    Notes
    -----
    Managed memory passes (every GPU can use it).  A mapped block of a
    ``DevicePool(large_blocks="mapped")`` carries its own grants, which the driver is
    asked for, whatever the array type (a ``cupy.ndarray``, or any view of the memory
    through ``__cuda_array_interface__``).  Other device memory that is not from a pool
    passes when the two GPUs are peer capable: CuPy enables peer access for it (memory
    another library mapped with virtual memory management is not told apart from it).

    Examples
    --------
    >>> pool = cupy_poolmem.DevicePool(device=0, peer_access=None)  # doctest: +SKIP
    >>> with cupy_poolmem.using(pool):  # doctest: +SKIP
    ...     x = cupy.ones(10)
    >>> cupy_poolmem.check_access(x, device=1)  # doctest: +SKIP
    Traceback (most recent call last):
    WrongDeviceError: memory of a cupy.ndarray on GPU 0 is not accessible from GPU 1: ...
    """
    dev = _device.check_device(device)
    ptr = _data_pointer(array)
    if ptr == 0:  # empty: nothing to access
        return
    with _device.on_device(dev):
        owner, pool, managed = _device.pointer_info(ptr)
    if managed:
        return
    what = f"memory of a {type(array).__module__.split('.')[0]}.{type(array).__name__}"
    if owner >= 0:  # CuPy's own record of the array's GPU comes first
        owner = int(getattr(getattr(array, "data", None), "device_id", owner))
    if pool == 0:  # cudaMalloc, registered or mapped memory
        mapped = mapped_block_of(array, ptr) or expandable_range_of(ptr)
        if mapped is not None:
            owner = mapped[0].device
        if owner >= 0 and owner != dev and not _device.can_access_peer(dev, owner):
            raise _device.cannot_access(dev, owner, f" ({what})")
        if mapped is not None and not mapped[0].has_access(mapped[1], dev):
            # Each mapped block carries its own grants, like a pool's: peer access between
            # the GPUs (which CuPy enables) does not open it.
            raise WrongDeviceError(
                f"{what} (a mapped block of a DevicePool with large_blocks="
                f"'{mapped[0].mode}') on GPU "
                f"{owner} is not accessible from GPU {dev}: its pool grants that GPU no "
                f"access. Grant it with pool.peer_access = [{dev}] or 'all'."
            )
        return  # not from a pool: device-level peer access applies
    if owner == dev and not _device.has_access(pool, dev):
        # A pool's own GPU always has access, so the driver named the wrong GPU (seen:
        # CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL said 0 for pool memory on GPU 1, driver 580).
        owner = _pool_owner(pool, dev)
        if owner < 0:
            raise WrongDeviceError(
                f"{what} (pool memory) is not accessible from GPU {dev}: its pool grants that "
                f"GPU no access. Grant it with pool.peer_access = [{dev}] or 'all'."
            )
    _device.require_access(pool, owner, dev, what)


def _pool_owner(pool_handle: int, not_this: int) -> int:
    """A GPU that can use the pool ``pool_handle`` other than ``not_this`` (its owner when
    nothing else was granted); ``-3`` when none can."""
    for d in range(_device.device_count()):
        if d != not_this and _device.has_access(pool_handle, d):
            return d
    return -3
