"""Device helpers shared by the pools, sharing, Numba and Dask: one home for each fact.

Ordinals and UUIDs (so ``CUDA_VISIBLE_DEVICES`` orders may differ between processes),
the host NUMA node nearest a GPU, binding a device's primary context to a thread, and
granting devices access to a memory pool.  Nothing here allocates or keeps state
beyond small per-process caches of facts that never change while a process lives.
"""

from __future__ import annotations

import threading
import uuid as _uuid
from typing import Any

from ._errors import InvalidOptionError, NoGPUError, OptionTypeError, SharingError, check_driver

__all__ = [
    "device_count",
    "require_gpu",
    "check_device",
    "device_uuid",
    "local_device",
    "nearest_numa_node",
    "on_device",
    "grant_access",
    "can_access_peer",
]


def _runtime() -> Any:
    import cupy

    return cupy.cuda.runtime


def _drv() -> Any:
    from cuda.bindings import driver

    return driver


def device_count() -> int:
    """Number of CUDA devices visible to this process (0 without a driver or GPU).

    Examples
    --------
    >>> cupy_poolmem.device_count() >= 0
    True
    """
    try:
        return int(_runtime().getDeviceCount())
    except Exception:
        return 0


def require_gpu(what: str = "cupy_poolmem") -> int:
    """Raise :class:`NoGPUError` with an explanation unless a CUDA device is usable.

    Returns the number of visible devices.
    """
    try:
        n = int(_runtime().getDeviceCount())
    except Exception as exc:
        raise NoGPUError(
            f"{what} needs an NVIDIA GPU and its driver, but CUDA could not be initialised "
            f"({type(exc).__name__}: {exc}). Check `nvidia-smi`, the driver installation and "
            "CUDA_VISIBLE_DEVICES."
        ) from None
    if n == 0:
        raise NoGPUError(
            f"{what} needs an NVIDIA GPU, but CUDA sees no device (is CUDA_VISIBLE_DEVICES empty?)"
        )
    return n


def check_device(device: Any, name: str = "device") -> int:
    """A device ordinal from an int, a ``cupy.cuda.Device`` or a ``cuda.core`` Device.

    ``None`` means the current device.  Raises :class:`OptionTypeError` for other types
    and :class:`InvalidOptionError` for ordinals this process cannot see.
    """
    if device is None:
        require_gpu()
        return int(_runtime().getDevice())
    if hasattr(device, "id") and not isinstance(device, int):
        device = device.id
    elif hasattr(device, "device_id") and not isinstance(device, int):
        device = device.device_id
    if isinstance(device, bool) or not isinstance(device, int):
        raise OptionTypeError(
            f"{name} must be a device ordinal (int) or a cupy.cuda.Device; "
            f"got {device!r} of type {type(device).__name__}"
        )
    n = require_gpu()
    if not 0 <= device < n:
        raise InvalidOptionError(
            f"{name}={device} is out of range: this process sees {n} device(s), ordinals 0..{n - 1}"
        )
    return device


_uuid_lock = threading.Lock()
_uuid_by_ordinal: dict[int, str] = {}
_ordinal_by_uuid: dict[str, int] = {}


def device_uuid(dev: int) -> str:
    """The UUID of device ``dev`` as a string (cached: it never changes)."""
    u = _uuid_by_ordinal.get(dev)
    if u is None:
        drv = _drv()
        handle = check_driver(drv.cuDeviceGet(dev), "cuDeviceGet")
        raw = check_driver(drv.cuDeviceGetUuid(handle), "cuDeviceGetUuid")
        u = str(_uuid.UUID(bytes=bytes(raw.bytes)))
        with _uuid_lock:
            _uuid_by_ordinal[dev] = u
            _ordinal_by_uuid[u] = dev
    return u


def local_device(uuid: str) -> int:
    """This process's ordinal of the GPU with ``uuid``.

    Raises :class:`NoGPUError` when this process sees no GPU and
    :class:`SharingError` when it cannot see that one.
    """
    d = _ordinal_by_uuid.get(uuid)
    if d is not None:
        return d
    n = device_count()
    if n == 0:
        raise NoGPUError(
            "received GPU memory from another process, but this process has no GPU "
            "(check CUDA_VISIBLE_DEVICES in the receiver)"
        )
    for i in range(n):
        if device_uuid(i) == uuid:
            return i
    raise SharingError(
        f"received memory of GPU {uuid}, which this process cannot see (it sees {n} "
        "device(s)); CUDA_VISIBLE_DEVICES of the receiver must include that GPU"
    )


def nearest_numa_node(device: int | None = None) -> int:
    """Host NUMA node nearest ``device`` (default: current), or ``-1`` if unknown.

    Asks the driver (``host_numa_id``), then Linux's sysfs entry for the GPU's PCI device.

    Examples
    --------
    >>> cupy_poolmem.nearest_numa_node(0)  # doctest: +SKIP
    0
    """
    import cuda.core as cc

    dev = int(_runtime().getDevice()) if device is None else device
    try:
        node = int(cc.Device(dev).properties.host_numa_id)
        if node >= 0:
            return node
    except Exception:
        pass
    try:
        bus = cc.Device(dev).pci_bus_id.lower()
        with open(f"/sys/bus/pci/devices/{bus}/numa_node") as f:
            return int(f.read().strip())
    except Exception:
        return -1


class on_device:
    """Make ``dev`` current, with its primary context bound to this thread, for a block.

    Threads the user never touched CUDA in (multiprocessing's feeder, the sharing
    server's threads, dask's worker threads) have no current context until a runtime
    call makes one.  When ``dev`` is already current (the common case) this costs one
    runtime and one driver query.
    """

    __slots__ = ("dev", "prev")

    def __init__(self, dev: int) -> None:
        self.dev = dev
        self.prev = -1

    def __enter__(self) -> None:
        rt = _runtime()
        self.prev = rt.getDevice()
        if self.prev != self.dev:
            rt.setDevice(self.dev)  # binds the device's primary context
            return
        err, ctx = _drv().cuCtxGetCurrent()
        if int(err) or not int(ctx):
            rt.setDevice(self.dev)
            rt.free(0)  # makes the primary context current

    def __exit__(self, *exc: Any) -> None:
        if self.prev != self.dev:
            _runtime().setDevice(self.prev)


def can_access_peer(dev: int, peer: int) -> bool:
    """Whether device ``dev`` can read and write memory of device ``peer`` (same: True)."""
    if dev == peer:
        return True
    return bool(_runtime().deviceCanAccessPeer(dev, peer))


def grant_access(pool_handle: int, devices: list[int], *, read_write: bool = True) -> None:
    """Give ``devices`` access to the memory of the CUDA pool ``pool_handle``.

    One ``cuMemPoolSetAccess`` call for all of them.  A pool's own device always has
    access; host pools need it granted for copies at full DMA speed.
    """
    drv = _drv()
    flag = (
        drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        if read_write
        else drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_NONE
    )
    descs = []
    for d in devices:
        desc = drv.CUmemAccessDesc()
        desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = d
        desc.flags = flag
        descs.append(desc)
    if descs:
        check_driver(
            drv.cuMemPoolSetAccess(drv.CUmemoryPool(int(pool_handle)), descs, len(descs)),
            "cuMemPoolSetAccess",
        )
