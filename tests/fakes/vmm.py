"""The virtual memory management driver, played on the host: ``VmmDriver`` (address
ranges, physical handles, mappings and access grants, every call logged, any call made to
fail once) and its variations: ``ReusingVA`` hands a freed address range out again,
``ContextVmm`` keeps events per context, ``CapturingVmm`` refuses the legacy stream
during a capture, ``StrictVmm`` refuses access on an address not mapped."""

from __future__ import annotations

import itertools
import threading
from typing import Any

from cuda.bindings import driver as real

from fakes.events import EventsDriver

MiB = 1 << 20
OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY
INVALID_HANDLE = 400  # CUDA_ERROR_INVALID_HANDLE
CAPTURE_IMPLICIT = 906  # CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
INVALID_VALUE = real.CUresult.CUDA_ERROR_INVALID_VALUE


#: Address ranges for every fake driver of the session: as on the real one, no two live
#: blocks share an address, even blocks of pools that earlier tests left open (where
#: ``check_access`` looks among all the pools' blocks).
_VAS = itertools.count(0x7F00_0000_0000, 0x1_0000_0000)


class VmmDriver(EventsDriver):
    """Virtual memory management and events, played on the host; every call logged."""

    def __init__(self) -> None:
        super().__init__()
        self.vas = _VAS
        self.handles = itertools.count(1)
        self.fail: dict[str, int] = {}  # call name -> CUresult it returns once
        self.mapped: dict[int, int] = {}  # va -> bytes, mapped now
        self.reserved_va: set = set()
        self.handles_alive: set = set()
        self.access: dict[int, list] = {}  # va -> [(device, flags name), ...] last set
        self.grants: dict[int, dict[int, str]] = {}  # va -> device -> flags name, merged

    def _failing(self, name: str) -> int:
        return self.fail.pop(name, 0)

    def cuMemGetAllocationGranularity(self, prop, flag):  # noqa: N802
        return 0, 2 * MiB

    def cuMemCreate(self, size, prop, flags):  # noqa: N802
        if err := self._failing("cuMemCreate"):
            return err, None
        h = next(self.handles)
        self.handles_alive.add(h)
        self.log.append(("create", h, size))
        return 0, h

    def cuMemRelease(self, h):  # noqa: N802
        self.handles_alive.discard(h)
        self.log.append(("release", h))
        return (0,)

    def cuMemAddressReserve(self, size, align, hint, flags):  # noqa: N802
        if err := self._failing("cuMemAddressReserve"):
            return err, 0
        va = next(self.vas)
        self.reserved_va.add(va)
        self.log.append(("reserve", va, size))
        return 0, va

    def cuMemAddressFree(self, va, size):  # noqa: N802
        self.reserved_va.discard(va)
        self.log.append(("unreserve", va, size))
        return (0,)

    def cuMemMap(self, va, size, offset, h, flags):  # noqa: N802
        if err := self._failing("cuMemMap"):
            return (err,)
        self.mapped[va] = size
        self.log.append(("map", va, size, h))
        return (0,)

    def cuMemUnmap(self, va, size):  # noqa: N802
        if err := self._failing("cuMemUnmap"):
            return (err,)
        assert self.mapped.pop(va) == size
        self.grants.pop(va, None)
        self.log.append(("unmap", va, size))
        return (0,)

    def cuMemSetAccess(self, va, size, descs, n):  # noqa: N802
        if err := self._failing("cuMemSetAccess"):
            return (err,)
        assert n == len(descs)
        self.access[va] = [(d.location.id, d.flags.name.rsplit("_", 1)[1]) for d in descs]
        self.grants.setdefault(va, {}).update(self.access[va])
        self.log.append(("access", va, size, tuple(self.access[va])))
        return (0,)

    def cuMemGetAccess(self, where, va):  # noqa: N802
        assert where.type == real.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        flags = self.grants.get(va, {}).get(where.id, "NONE")
        return 0, getattr(real.CUmemAccess_flags, f"CU_MEM_ACCESS_FLAGS_PROT_{flags}")

    def last_event(self) -> str:
        return next(e[1] for e in reversed(self.log) if e[0] == "record")


class ReusingVA(VmmDriver):
    """The driver hands a freed address range out again (as the real one does);
    ``on_free`` runs once inside the next cuMemAddressFree (another thread there)."""

    def __init__(self) -> None:
        super().__init__()
        self.freed_vas: list[int] = []
        self.on_free: Any = None

    def cuMemAddressReserve(self, size, align, hint, flags):  # noqa: N802
        if self.freed_vas:
            va = self.freed_vas.pop()
            self.reserved_va.add(va)
            return 0, va
        return super().cuMemAddressReserve(size, align, hint, flags)

    def cuMemAddressFree(self, va, size):  # noqa: N802
        res = super().cuMemAddressFree(va, size)
        self.freed_vas.append(va)
        if self.on_free is not None:
            fn, self.on_free = self.on_free, None
            fn()
        return res


class ContextVmm(VmmDriver):
    """Events belong to the context current when they are created, and cuEventRecord
    refuses an event of another context than the stream's (CUDA_ERROR_INVALID_HANDLE,
    as the driver documents: "hEvent and hStream must be from the same context").
    ``current``: the device whose context is current in the calling thread (None: no
    context bound, cuEventCreate then fails with CUDA_ERROR_INVALID_CONTEXT); per thread,
    as CUDA's current context is (threads other tests left running call on_device too)."""

    def __init__(self) -> None:
        super().__init__()
        self._thread = threading.local()
        self.ctx_of: dict = {}

    @property
    def current(self) -> int | None:
        return getattr(self._thread, "current", 0)

    @current.setter
    def current(self, dev: int | None) -> None:
        self._thread.current = dev

    def on_device(self, dev):
        d = self

        class _On:
            def __enter__(self):
                self.prev, d.current = d.current, dev

            def __exit__(self, *exc):
                d.current = self.prev

        return _On()

    def cuEventCreate(self, flags):  # noqa: N802
        if self.current is None:
            return 201, None  # CUDA_ERROR_INVALID_CONTEXT
        err, ev = super().cuEventCreate(flags)
        self.ctx_of[ev] = self.current
        return err, ev

    def cuEventRecord(self, ev, s):  # noqa: N802
        # The block's stream is device 0's; _record makes device 0 current around it.
        if self.ctx_of.get(ev) != self.current:
            return (INVALID_HANDLE,)
        return super().cuEventRecord(ev, s)


class CapturingVmm(VmmDriver):
    """While ``capturing``, the legacy stream refuses work (another stream is capturing
    in global mode: cuEventRecord on it returns CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, as
    cuMemFreeAsync on it does; the pools already hold such CUDA-pool frees)."""

    capturing = False

    def cuEventRecord(self, ev, s):  # noqa: N802
        if self.capturing and int(s) in (0, 1):
            return (CAPTURE_IMPLICIT,)
        return super().cuEventRecord(ev, s)


class StrictVmm(VmmDriver):
    """cuMemSetAccess on an address that is not mapped fails, as on the real driver."""

    def cuMemSetAccess(self, va, size, descs, n):  # noqa: N802
        if va not in self.mapped:
            return (INVALID_VALUE,)
        return super().cuMemSetAccess(va, size, descs, n)
