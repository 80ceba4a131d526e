"""Managed memory played on the host: ``ManagedDriver`` (cuMemAllocManaged, events and
advice, every call logged) and ``ManagedCore``, the cuda.core that prefetch and advise
call (its buffers, ``FakeBuffer``, log what they are asked)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

from fakes.events import EventsDriver


class ManagedDriver(EventsDriver):
    """cuMemAllocManaged, events and advice, played on the host."""

    # Its tests mark events done by name ahead of their frees (written before events
    # were reused): a new record leaves a completed event completed.
    repend_on_record = False

    def __init__(self) -> None:
        super().__init__()
        self.ptrs = itertools.count(0x7000_0000, 0x10_0000)
        self.advise_result = 0

    def cuMemAllocManaged(self, size, flags):  # noqa: N802
        p = next(self.ptrs)
        self.log.append(("alloc", p, size))
        return 0, p

    def cuMemFree(self, ptr):  # noqa: N802
        self.log.append(("free", ptr))
        return (0,)

    def cuMemAdvise(self, ptr, size, advice, loc):  # noqa: N802
        self.log.append(("advise", ptr, size, advice.name))
        return (self.advise_result,)

    def cuMemAllocFromPoolAsync(self, size, pool, s):  # noqa: N802
        return 0, 0x9000

    def cuMemFreeAsync(self, ptr, s):  # noqa: N802
        return (0,)

    def cuStreamSynchronize(self, s):  # noqa: N802
        return (0,)


class FakeBuffer:
    def __init__(self, log, ptr, nbytes):
        self.log, self.ptr, self.nbytes = log, ptr, nbytes

    def prefetch(self, loc, stream):
        self.log.append(("prefetch", self.ptr, self.nbytes, loc, stream))

    def __setattr__(self, name, value):
        if name in ("preferred_location", "accessed_by", "read_mostly"):
            self.log.append((name, self.ptr, self.nbytes, value))
        object.__setattr__(self, name, value)


class ManagedCore:
    """cuda.core as prefetch and advise see it: locations ``("loc", where)``, streams
    ``("stream", handle)``, buffers that log to ``log``."""

    def __init__(self, log: list) -> None:
        self.Stream = SimpleNamespace(from_handle=lambda s: ("stream", s))
        self.ManagedBuffer = SimpleNamespace(from_handle=lambda p, n, owner: FakeBuffer(log, p, n))

    def Host(self):  # noqa: N802
        return ("loc", "cpu")

    def Device(self, where):  # noqa: N802
        return ("loc", where)
