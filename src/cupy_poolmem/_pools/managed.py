"""ManagedPool, its two backends and the probe that chooses between them.

``"pool"`` is a CUDA managed memory pool; ``"managed"`` (:class:`ManagedAllocator`)
caches ``cuMemAllocManaged`` blocks.  See docs/managed_pool.rst, "How it works".
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import cuda.core as cc
import cupy

from .. import _device, _retire
from .._block_cache import BlockCache
from .._device import check_device, on_device
from .._errors import InvalidOptionError, OptionTypeError, check_driver, error_name
from .._runtime import hp as _hp
from .._sizes import parse_bytes
from . import _driver
from ._base import Pool

log = logging.getLogger("cupy_poolmem._pools")

__all__ = ["ManagedPool", "managed_backend", "ManagedAllocator", "probe_pool_advice"]

_GRANULE = 4096  # sizes are rounded up to pages: blocks of one class serve each other

_choices: dict[int, tuple[str, str]] = {}  # device -> (backend, reason)
_choices_lock = threading.Lock()


def recorded_choice(device: int) -> tuple[str, str] | None:
    """The backend the probe chose for ``device`` in this process, with its reason."""
    return _choices.get(device)


def record_choice(device: int, backend: str, reason: str) -> tuple[str, str]:
    with _choices_lock:
        return _choices.setdefault(device, (backend, reason))


def _device_location(device: int) -> Any:
    drv = _driver.drv()
    loc = drv.CUmemLocation()
    loc.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    loc.id = device
    return loc


def mem_advise(ptr: int, size: int, advice: Any, device: int) -> int:
    """``cuMemAdvise`` toward ``device`` with the signature of this cuda-bindings; CUresult."""
    drv = _driver.drv()
    import cuda.bindings

    if int(cuda.bindings.__version__.split(".")[0]) >= 13:
        (res,) = drv.cuMemAdvise(ptr, size, advice, _device_location(device))
    elif hasattr(drv, "cuMemAdvise_v2"):
        (res,) = drv.cuMemAdvise_v2(ptr, size, advice, _device_location(device))
    else:  # pragma: no cover - old 12.x bindings
        (res,) = drv.cuMemAdvise(ptr, size, advice, device)
    return int(res)


def probe_pool_advice(pool_handle: int, device: int) -> tuple[bool, str]:
    """Whether the driver takes placement advice on memory from the managed pool.

    Allocates 4 KiB from the pool (nothing near the GPU's free memory), gives it the
    pool's own preferred location and read-mostly on then off, and frees it.
    """
    drv = _driver.drv()
    A = drv.CUmem_advise
    err, ptr = drv.cuMemAllocFromPoolAsync(_GRANULE, drv.CUmemoryPool(pool_handle), 0)
    if int(err):
        return False, f"probe allocation failed ({error_name(int(err))})"
    try:
        check_driver(drv.cuStreamSynchronize(0), "cuStreamSynchronize")
        for advice in (
            A.CU_MEM_ADVISE_SET_PREFERRED_LOCATION,
            A.CU_MEM_ADVISE_SET_READ_MOSTLY,
            A.CU_MEM_ADVISE_UNSET_READ_MOSTLY,
        ):
            res = mem_advise(ptr, _GRANULE, advice, device)
            if res:
                return False, (
                    f"this driver refuses advice on managed-pool memory: cuMemAdvise "
                    f"({advice.name}) returned {error_name(res)}"
                )
        return True, "this driver takes advice on managed-pool memory"
    finally:
        drv.cuMemFreeAsync(ptr, 0)
        drv.cuStreamSynchronize(0)


def require_managed_memory(device: int) -> None:
    _device.require_attribute(
        device, "MANAGED_MEMORY", "managed memory, which ManagedPool needs; use DevicePool"
    )


class ManagedAllocator(BlockCache):
    """``cuMemAllocManaged`` blocks for one device, cached by size, reuse ordered by events.

    A :class:`~cupy_poolmem._block_cache.BlockCache` of page-rounded blocks, each
    serving its own size class only.  ``release`` (trim, close, out-of-memory) gives
    cached blocks back with ``cuMemFree`` once their events have completed (all of
    them with ``wait``).
    """

    def __init__(self, device: int) -> None:
        super().__init__(device, _GRANULE)

    def _create(self, r: int) -> tuple[int, int]:
        drv = _driver.drv()
        err, p = drv.cuMemAllocManaged(r, drv.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL.value)
        if int(err):
            return int(err), 0
        ptr = int(p)
        # The pool prefers its GPU, as a managed pool created for it does.
        mem_advise(ptr, r, drv.CUmem_advise.CU_MEM_ADVISE_SET_PREFERRED_LOCATION, self.device)
        return 0, ptr

    def _destroy(self, ptr: int, r: int) -> None:
        check_driver(_driver.drv().cuMemFree(ptr), "cuMemFree")


class ManagedPool(Pool):
    """A pool of managed (unified) memory, preferring one GPU, that takes advice.

    Use :func:`cupy_poolmem.prefetch` and :func:`cupy_poolmem.advise` to place its
    arrays: both work on this pool's memory with every driver.

    Parameters
    ----------
    device : int, optional
        Preferred device (and the device whose allocator this pool serves); default
        the current device.
    max_size, release_threshold, reuse_cache : int or str, optional
        As for :class:`DevicePool`.  ``max_size`` caps the bytes live at once
        (checked by the pool itself: the driver has no cap for managed memory).
    backend : {"auto", "pool", "managed"}
        ``"pool"``: a CUDA managed memory pool (stream-ordered, CUDA 13).
        ``"managed"``: ``cuMemAllocManaged`` blocks cached for reuse, with reuse on
        another stream ordered by events.  ``"auto"`` (default) uses the pool where
        the driver takes advice on its memory, found by a one-time probe of 4 KiB
        per device, and ``"managed"`` elsewhere (driver 580 / CUDA 13.0 refuses
        advice on managed-pool memory; CUDA 12 has no managed pools).

    Attributes
    ----------
    backend : str
        ``"pool"`` or ``"managed"``, the backend in use.
    backend_reason : str
        Why: the probe's finding, or that it was asked for.

    Notes
    -----
    Hints given with :func:`advise` belong to an array: when its block is freed,
    the pool resets them (preferred location back to the pool's device, no
    read-mostly, no accessed-by) before the block serves another array.  Managed
    memory cannot be allocated during a CUDA graph capture
    (:class:`UnsupportedError`); allocate it before ``begin_capture()``.

    Examples
    --------
    >>> managed = cupy_poolmem.ManagedPool(device=0)  # doctest: +SKIP
    >>> managed.backend  # doctest: +SKIP
    'managed'
    >>> with cupy_poolmem.using(managed):  # doctest: +SKIP
    ...     x = cupy.zeros(1 << 20)
    >>> cupy_poolmem.advise(x, preferred_location=0, accessed_by=[0])  # doctest: +SKIP
    >>> cupy_poolmem.prefetch(x, device="cpu")  # doctest: +SKIP
    """

    _kind_name = "managed"

    def __init__(
        self,
        device: int | Any = None,
        max_size: int | str | None = None,
        release_threshold: int | str | None = None,
        reuse_cache: int | str = "1GiB",
        backend: str = "auto",
    ) -> None:
        if not isinstance(backend, str):
            raise OptionTypeError(
                f"backend must be 'auto', 'pool' or 'managed'; got {backend!r} of type "
                f"{type(backend).__name__}"
            )
        if backend not in ("auto", "pool", "managed"):
            raise InvalidOptionError(
                f"backend={backend!r} is not one of 'auto', 'pool' (a CUDA managed memory "
                "pool) or 'managed' (cached cuMemAllocManaged blocks)"
            )
        dev = check_device(device)
        cache = parse_bytes(reuse_cache, name="reuse_cache")
        with cupy.cuda.Device(dev) as d:
            total = d.mem_info[1]
            max_b = parse_bytes(max_size, name="max_size", total=total, allow_none=True) or 0
            parse_bytes(release_threshold, name="release_threshold", allow_none=True)
            require_managed_memory(dev)
            mr, reason = None, ""
            if backend == "auto":
                known = recorded_choice(dev)
                missing = _driver.cuda13_missing()
                if known is not None:
                    choice, reason = known
                elif missing:
                    choice, reason = record_choice(
                        dev, "managed", f"managed memory pools need CUDA 13 ({missing})"
                    )
                else:
                    choice = "pool"
            else:
                choice, reason = backend, f"backend={backend!r} was asked for"
            if choice == "pool":
                if backend == "pool":
                    _driver.require_cuda13("ManagedPool(backend='pool')")
                mr = _managed_resource(dev)
                if backend == "auto" and recorded_choice(dev) is None:
                    ok, why = probe_pool_advice(int(mr.handle), dev)
                    choice, reason = record_choice(dev, "pool" if ok else "managed", why)
                    if choice != "pool":
                        _retire.retirer().retire_resource(mr, dev)  # the probe's free
                        mr = None
            self.backend = choice
            self.backend_reason = reason
            if backend == "auto" and choice != "pool":
                log.info(
                    "ManagedPool on device %d: fallback to backend %r: %s", dev, choice, reason
                )
            if mr is None:
                self._backend = ManagedAllocator(dev)
            self._setup(mr, dev, _hp.KIND_MANAGED, release_threshold, max_b, cache)
            if mr is None:
                self._alloc_call = "cuMemAllocManaged"
            self._capacity = int(total)

    @property
    def memory_resource(self) -> Any:
        """The cuda.core memory resource of the ``"pool"`` backend (``None`` otherwise).

        Examples
        --------
        >>> cupy_poolmem.ManagedPool(backend="managed").memory_resource is None  # doctest: +SKIP
        True
        """
        return self._mr

    @property
    def handle(self) -> int:
        """The ``CUmemoryPool`` handle as an int (``0`` for the ``"managed"`` backend).

        Examples
        --------
        >>> cupy_poolmem.ManagedPool(backend="managed").handle  # doctest: +SKIP
        0
        """
        return 0 if self._mr is None else int(self._mr.handle)

    def _describe(self) -> str:
        return f"ManagedPool(device={self.device_id}, backend={self.backend!r})"

    def _reset_advice(self, ptr: int, size: int) -> None:
        """Hints given to a managed block do not follow it to its next array."""
        reset_advice(ptr, size, self.device_id)


def reset_advice(ptr: int, size: int, device: int) -> None:
    """Back to a fresh block of a ManagedPool: preferred location ``device``, no other hint."""
    try:
        with on_device(device):
            buf = cc.ManagedBuffer.from_handle(ptr, size, owner=reset_advice)  # owns nothing
            buf.read_mostly = False
            buf.accessed_by = []
            buf.preferred_location = cc.Device(device)
    except Exception:  # a hint left behind is slower memory, never wrong data
        pass


def _managed_resource(dev: int) -> Any:
    try:
        opts = cc.ManagedMemoryResourceOptions(
            preferred_location=dev, preferred_location_type="device"
        )
        return cc.ManagedMemoryResource(opts)
    except Exception as exc:
        raise _driver.wrap(exc, "creating a managed pool") from exc


def managed_backend(device: int | None = None) -> tuple[str, str]:
    """The backend ``ManagedPool(backend="auto")`` uses on ``device``, and why.

    Runs the one-time probe (a 4 KiB allocation from a temporary managed pool) when
    no pool on that device has yet.

    Parameters
    ----------
    device : int, optional
        Device ordinal; defaults to the current device.

    Returns
    -------
    tuple of (str, str)
        ``"pool"`` or ``"managed"``, and the reason for the choice.

    Examples
    --------
    >>> cupy_poolmem.managed_backend(0)  # doctest: +SKIP
    ('managed', 'this driver refuses advice on managed-pool memory: ...')
    """
    dev = check_device(device)
    known = recorded_choice(dev)
    if known is not None:
        return known
    with cupy.cuda.Device(dev):
        require_managed_memory(dev)
        missing = _driver.cuda13_missing()
        if missing:
            return record_choice(dev, "managed", f"managed memory pools need CUDA 13 ({missing})")
        mr = _managed_resource(dev)
        try:
            ok, why = probe_pool_advice(int(mr.handle), dev)
        finally:
            _retire.retirer().retire_resource(mr, dev)  # after the probe's free is done
    return record_choice(dev, "pool" if ok else "managed", why)
