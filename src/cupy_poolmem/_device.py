"""Device helpers shared by the pools, sharing, Numba and Dask: one home for each fact.

Ordinals and UUIDs (so ``CUDA_VISIBLE_DEVICES`` orders may differ between processes),
the host NUMA node nearest a GPU, binding a device's primary context to a thread, and
granting devices access to a memory pool (peer access).  Nothing here allocates or
keeps state beyond small per-process caches: facts that never change while a process
lives, and the record of the access this process granted to imported pools.
"""

from __future__ import annotations

import threading
import uuid as _uuid
from typing import Any

from . import _driver
from ._errors import (
    InvalidOptionError,
    NoGPUError,
    OptionTypeError,
    SharingError,
    UnsupportedError,
    WrongDeviceError,
    check_driver,
    error_name,
)

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
    "peer_topology",
    "resolve_peer_access",
    "has_access",
    "require_access",
    "require_attribute",
    "AccessGrants",
    "ensure_access",
    "ensure_peer_access",
    "forget_access",
    "granted_access",
]


def device_count() -> int:
    """Number of CUDA devices visible to this process (0 without a driver or GPU).

    Returns
    -------
    int
        The count; 0 also when ``CUDA_VISIBLE_DEVICES`` is empty.

    Examples
    --------
    >>> cupy_poolmem.device_count() >= 0
    True
    """
    try:
        return int(_driver.runtime().getDeviceCount())
    except Exception:
        return 0


def require_gpu(what: str = "cupy_poolmem") -> int:
    """Raise :class:`NoGPUError` with an explanation unless a CUDA device is usable.

    Returns the number of visible devices.
    """
    try:
        n = int(_driver.runtime().getDeviceCount())
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


def require_attribute(device: int, attribute: str, needs: str) -> None:
    """Raise :class:`UnsupportedError` unless ``device``'s ``CU_DEVICE_ATTRIBUTE_``
    ``attribute`` is set; ``needs`` says what needs it and what to use instead.

    A failed query counts as unset: the error says which attribute was asked.
    """
    drv = _driver.get()
    name = f"CU_DEVICE_ATTRIBUTE_{attribute}"
    err, value = drv.cuDeviceGetAttribute(getattr(drv.CUdevice_attribute, name), device)
    if int(err) or not int(value):
        why = "is 0" if not int(err) else f"could not be read: {error_name(err)}"
        raise UnsupportedError(f"device {device} does not support {needs} ({name} {why})")


def check_device(device: Any, name: str = "device") -> int:
    """A device ordinal from an int, a ``cupy.cuda.Device`` or a ``cuda.core`` Device.

    ``None`` means the current device.  Raises :class:`OptionTypeError` for other types
    and :class:`InvalidOptionError` for ordinals this process cannot see.
    """
    if device is None:
        require_gpu()
        return int(_driver.runtime().getDevice())
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
        drv = _driver.get()
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

    Parameters
    ----------
    device : int, optional
        Device ordinal; defaults to the current device.

    Returns
    -------
    int
        The NUMA node's number, or ``-1``.

    Examples
    --------
    >>> cupy_poolmem.nearest_numa_node(0)  # doctest: +SKIP
    0
    """
    import cuda.core as cc

    dev = int(_driver.runtime().getDevice()) if device is None else device
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


class _Bound(threading.local):
    """Per thread: the device whose primary context this thread was seen to have bound."""

    dev = -1


_bound = _Bound()


class on_device:
    """Make ``dev`` current, with its primary context bound to this thread, for a block.

    Threads the user never touched CUDA in (multiprocessing's feeder, the sharing
    server's threads, dask's worker threads) have no current context until a runtime
    call makes one.  When ``dev`` is already current (the common case) this costs one
    runtime query; the driver is asked for the bound context once per thread and device.
    """

    __slots__ = ("dev", "prev")

    def __init__(self, dev: int) -> None:
        self.dev = dev
        self.prev = -1

    def __enter__(self) -> None:
        rt = _driver.runtime()
        prev = self.prev = rt.getDevice()
        if prev != self.dev:
            rt.setDevice(self.dev)  # binds the device's primary context
            return
        if _bound.dev == prev:
            return
        err, ctx = _driver.get().cuCtxGetCurrent()
        if int(err) or not int(ctx):
            rt.setDevice(self.dev)
            rt.free(0)  # makes the primary context current
        _bound.dev = prev

    def __exit__(self, *exc: Any) -> None:
        if self.prev != self.dev:
            _driver.runtime().setDevice(self.prev)


def can_access_peer(dev: int, peer: int) -> bool:
    """Whether device ``dev`` can read and write memory of device ``peer`` (same: True)."""
    if dev == peer:
        return True
    return bool(_driver.runtime().deviceCanAccessPeer(dev, peer))


def grant_access(pool_handle: int, devices: list[int], *, read_write: bool = True) -> None:
    """Give ``devices`` access to the memory of the CUDA pool ``pool_handle``.

    One ``cuMemPoolSetAccess`` call for all of them.  A pool's own device always has
    access; host pools need it granted for copies at full DMA speed.
    """
    drv = _driver.get()
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


# --------------------------------------------------------------------------------------
# Peer access: which GPUs may read and write a pool's memory
# --------------------------------------------------------------------------------------
# Memory from a CUDA pool is mapped only on the pool's own device until
# cuMemPoolSetAccess grants other devices access; cudaDeviceEnablePeerAccess (what CuPy
# calls) does not cover pool memory, and the grants of an exporting process do not
# carry over to the processes that import its pool.


def peer_topology(n: int | None = None) -> list[list[bool]]:
    """``m[i][j]``: whether GPU ``i`` can read and write memory of GPU ``j`` (diagonal True).

    What ``cudaDeviceCanAccessPeer`` says for every ordered pair of the ``n`` visible
    devices (default: all of them).
    """
    n = device_count() if n is None else n
    return [[can_access_peer(i, j) for j in range(n)] for i in range(n)]


def _ordinal(item: Any, name: str, n: int) -> int:
    d = item
    if not isinstance(d, int):
        if hasattr(d, "id"):
            d = d.id
        elif hasattr(d, "device_id"):
            d = d.device_id
    if isinstance(d, bool) or not isinstance(d, int):
        raise OptionTypeError(
            f"{name} lists devices as ordinals (int) or cupy.cuda.Device objects; "
            f"got {item!r} of type {type(item).__name__}"
        )
    if not 0 <= d < n:
        raise InvalidOptionError(
            f"{name} names device {d}, but this process sees {n} device(s)"
            + (f", ordinals 0..{n - 1}" if n else "")
        )
    return d


def cannot_access(device: int, owner: int, what: str) -> UnsupportedError:
    return UnsupportedError(
        f"GPU {device} cannot access memory of GPU {owner}{what}: "
        f"cudaDeviceCanAccessPeer({device}, {owner}) is 0 (no NVLink or PCIe peer path "
        "between them, or peer access disabled on this system; `python -m cupy_poolmem` "
        f"shows the topology). Use the memory on GPU {owner}, or copy it through the host."
    )


def resolve_peer_access(value: Any, owner: int, *, name: str = "peer_access") -> tuple[int, ...]:
    """The devices, other than ``owner``, that ``value`` lets access a pool on GPU ``owner``.

    Parameters
    ----------
    value : "all", None, or a list of devices
        ``"all"`` (or ``True``): every visible GPU that can access ``owner``'s memory
        (``cudaDeviceCanAccessPeer``); pairs that cannot are skipped.  ``None``,
        ``"none"``, ``False`` or an empty list: no other GPU.  A list, tuple or set of
        ordinals or ``cupy.cuda.Device`` objects: exactly those (``owner`` itself is
        ignored: a pool's own GPU always has access).
    owner : int
        The pool's device, or ``-1`` for a host (pinned) pool: every GPU can be
        granted access to host memory, so no pair is checked.
    name : str
        The option's name, for error messages.

    Returns
    -------
    tuple of int
        Sorted device ordinals, ``owner`` excluded.

    Raises
    ------
    OptionTypeError
        ``value`` is of the wrong type (a bare ordinal must be written ``[1]``).
    InvalidOptionError
        An unknown word, or an ordinal this process cannot see.
    UnsupportedError
        A listed GPU cannot access ``owner``'s memory; the message names both.

    Examples
    --------
    >>> resolve_peer_access("all", 0)  # doctest: +SKIP
    (1, 2, 3)
    >>> resolve_peer_access([0, 2], 0)  # doctest: +SKIP
    (2,)
    """
    if value is None or value is False:
        return ()
    if value is True:
        value = "all"
    n = device_count()
    if isinstance(value, str):
        word = value.strip().lower()
        if word == "all":
            return tuple(
                d for d in range(n) if d != owner and (owner < 0 or can_access_peer(d, owner))
            )
        if word == "none":
            return ()
        raise InvalidOptionError(
            f"{name}={value!r} is not a valid choice: use 'all' (every GPU the hardware "
            "allows), None (no other GPU) or a list of device ordinals such as [0, 1]"
        )
    if not isinstance(value, (list, tuple, set, frozenset, range)):
        hint = f"; write [{value}] for one device" if isinstance(value, int) else ""
        raise OptionTypeError(
            f"{name} must be 'all', None or a list of device ordinals; got {value!r} "
            f"of type {type(value).__name__}{hint}"
        )
    wanted = {_ordinal(item, name, n) for item in value}
    wanted.discard(owner)
    for d in sorted(wanted):
        if owner >= 0 and not can_access_peer(d, owner):
            raise cannot_access(d, owner, f" (asked for by {name}={list(value)!r})")
    return tuple(sorted(wanted))


def has_access(pool_handle: int, device: int) -> bool:
    """Whether GPU ``device`` may read and write the memory of the pool ``pool_handle``.

    One ``cuMemPoolGetAccess`` query (the driver's current state, whoever set it).
    """
    drv = _driver.get()
    loc = drv.CUmemLocation()
    loc.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    loc.id = int(device)
    flags = check_driver(
        drv.cuMemPoolGetAccess(drv.CUmemoryPool(int(pool_handle)), loc), "cuMemPoolGetAccess"
    )
    return int(flags) != int(drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_NONE)


def require_access(pool_handle: int, owner: int, device: int, what: str = "pool memory") -> None:
    """Raise unless GPU ``device`` can use memory of the pool ``pool_handle`` (on ``owner``).

    ``owner`` is the pool's GPU, or ``-1`` for a host (pinned) pool.  Raises
    :class:`UnsupportedError` when the hardware cannot (both GPUs named) and
    :class:`WrongDeviceError` when it could but the pool grants ``device`` no access:
    the check that prevents a kernel from faulting with ``cudaErrorIllegalAddress``,
    which breaks the CUDA context for good.
    """
    if device == owner:
        return
    if owner >= 0 and not can_access_peer(device, owner):
        raise cannot_access(device, owner, f" ({what})")
    if has_access(pool_handle, device):
        return
    if owner < 0:
        raise WrongDeviceError(
            f"{what} (a pinned host pool) is not accessible from GPU {device}: the pool "
            f"grants that GPU no access. Create the PinnedPool with devices=[..., {device}] "
            "(the default grants every visible GPU)."
        )
    raise WrongDeviceError(
        f"{what} on GPU {owner} is not accessible from GPU {device}: its pool grants GPU "
        f"{device} no access, so a kernel there would fail with cudaErrorIllegalAddress "
        "(which breaks the CUDA context for good). Grant it with "
        f"pool.peer_access = [{device}] or 'all', or cupy_poolmem.set_allocator("
        "peer_access='all') (the default); or copy the data on its own GPU first."
    )


def pointer_info(ptr: int) -> tuple[int, int, bool]:
    """``(owner, pool_handle, managed)`` of a CUDA pointer; owner ``-1`` for host memory."""
    drv = _driver.get()
    attr = drv.CUpointer_attribute
    p = drv.CUdeviceptr(int(ptr))
    result = drv.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_IS_MANAGED, p)
    if int(result[0]) == int(drv.CUresult.CUDA_ERROR_INVALID_VALUE):
        raise InvalidOptionError(
            f"address {int(ptr):#x} is not CUDA memory (pageable host memory?): no GPU "
            "accesses it directly, so there is no access to check"
        )
    if check_driver(result, "cuPointerGetAttribute"):
        return -2, 0, True
    mtype = check_driver(
        drv.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p),
        "cuPointerGetAttribute",
    )
    if int(mtype) == int(drv.CUmemorytype.CU_MEMORYTYPE_UNIFIED):
        return -2, 0, True
    err, pool = drv.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, p)
    pool = int(pool) if int(err) == 0 and pool is not None else 0
    if int(mtype) == int(drv.CUmemorytype.CU_MEMORYTYPE_HOST):
        return -1, pool, False
    owner = check_driver(
        drv.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p),
        "cuPointerGetAttribute",
    )
    return int(owner), pool, False


class AccessGrants:
    """The read-write grants this process gave devices on pools it did not create.

    One instance per process (module ``GRANTS``) records each ``(pool, device)`` pair
    once, under one lock, so importers of a shared pool (array sharing, the Numba
    plugin, dask transfers) call ``cuMemPoolSetAccess`` once per pair however often
    they receive memory from that pool.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._pairs: dict[int, set[int]] = {}

    def ensure(self, pool_handle: int, device: int, owner: int) -> bool:
        """Grant ``device`` access to ``pool_handle`` (on ``owner``) unless done; True if now."""
        h, device, owner = int(pool_handle), int(device), int(owner)
        if device == owner:
            return False
        done = self._pairs.get(h)
        if done is not None and device in done:  # the common case: no lock
            return False
        with self._lock:
            done = self._pairs.setdefault(h, set())
            if device in done:
                return False
            if owner >= 0 and not can_access_peer(device, owner):
                raise cannot_access(device, owner, f" (imported pool {h:#x})")
            grant_access(h, [device])
            done.add(device)
            return True

    def ensure_peers(self, pool_handle: int, owner: int, peer_access: Any = "all") -> tuple:
        """Grant every device ``peer_access`` names (default: all capable) in one call."""
        h = int(pool_handle)
        targets = resolve_peer_access(peer_access, int(owner))
        with self._lock:
            done = self._pairs.setdefault(h, set())
            new = [d for d in targets if d not in done]
            if new:
                grant_access(h, new)
                done.update(new)
        return targets

    def forget(self, pool_handle: int) -> None:
        """Drop the record of ``pool_handle`` (call when the pool is closed)."""
        with self._lock:
            self._pairs.pop(int(pool_handle), None)

    def granted(self) -> dict[int, tuple[int, ...]]:
        """``{pool handle: devices granted}``, a snapshot."""
        with self._lock:
            return {h: tuple(sorted(d)) for h, d in self._pairs.items() if d}


GRANTS = AccessGrants()


def ensure_access(pool_handle: int, device: int, owner: int) -> None:
    """Give GPU ``device`` read-write access to the pool ``pool_handle``, once per process.

    For importers of a pool another process created (array sharing, Numba IPC
    handles, dask transfers): an imported pool is mapped only on its own GPU, whatever
    the exporter granted, so a GPU that uses received memory needs its own grant.  The
    first call for a ``(pool_handle, device)`` pair calls ``cuMemPoolSetAccess``; later
    calls return at once (a lock-protected record, :class:`AccessGrants`).  A grant
    covers the pool's existing and future allocations.

    Parameters
    ----------
    pool_handle : int
        The ``CUmemoryPool`` (for example ``int(mr.handle)`` of the imported resource).
    device : int
        The GPU that will use the memory (this process's ordinal).
    owner : int
        The pool's own GPU in this process (found by UUID), or ``-1`` for an imported
        pinned (host) pool.  Needed because a pool handle does not tell which device
        it lives on; ``device == owner`` is a no-op.

    Raises
    ------
    UnsupportedError
        ``cudaDeviceCanAccessPeer(device, owner)`` is 0; the message names both GPUs.
    CUDADriverError
        ``cuMemPoolSetAccess`` failed (the CUDA error name is kept).

    Examples
    --------
    >>> mr = cuda.core.DeviceMemoryResource.from_allocation_handle(0, fd)  # doctest: +SKIP
    >>> ensure_access(int(mr.handle), device=1, owner=0)  # doctest: +SKIP
    """
    GRANTS.ensure(pool_handle, device, owner)


def ensure_peer_access(pool_handle: int, owner: int, peer_access: Any = "all") -> tuple:
    """Grant every GPU ``peer_access`` names access to an imported pool, once per pair.

    Like :func:`ensure_access` for a whole set at once: ``"all"`` (default) grants every
    visible GPU that can access ``owner``'s memory, skipping pairs that cannot, so a
    received array works from any GPU CuPy lets read it; lists are validated as for
    ``DevicePool(peer_access=...)``.  ``owner=-1`` (an imported pinned pool) grants
    every GPU named.  Returns the devices granted (``owner`` excluded).  The place to
    call it is right after a pool is imported, before its first pointer is used.
    """
    return GRANTS.ensure_peers(pool_handle, owner, peer_access)


def forget_access(pool_handle: int) -> None:
    """Forget the grants recorded for ``pool_handle`` (when that pool is closed)."""
    GRANTS.forget(pool_handle)


def granted_access() -> dict[int, tuple[int, ...]]:
    """The grants this process gave on imported pools: ``{pool handle: devices}``."""
    return GRANTS.granted()
