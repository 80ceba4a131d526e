"""CUDA events played on the host, for fakes of the driver (``done``: completed ones):
``FakeEvents``, and ``EventsDriver``, the base of the domain fakes (events logged, every
other call the real driver's)."""

from __future__ import annotations

import contextlib
import itertools

from fakes.driver import PassThrough


class FakeEvents:
    """cuEventCreate/Record/Query/Synchronize/Destroy; a subclass sets ``log`` (a list).

    ``repend_on_record``: recording an event again makes it pending until that record
    runs, as the driver does (a cache that reuses events needs it).
    """

    repend_on_record = True

    def __init__(self) -> None:
        self.evs = itertools.count(1)
        self.done: set = set()

    def cuEventCreate(self, flags):  # noqa: N802
        return 0, f"ev{next(self.evs)}"

    def cuEventRecord(self, ev, s):  # noqa: N802
        if self.repend_on_record:
            self.done.discard(ev)
        self.log.append(("record", ev, s))
        return (0,)

    def cuEventQuery(self, ev):  # noqa: N802
        return (0 if ev in self.done else 600,)  # CUDA_ERROR_NOT_READY

    def cuEventSynchronize(self, ev):  # noqa: N802
        self.log.append(("sync", ev))
        self.done.add(ev)
        return (0,)

    def cuEventDestroy(self, ev):  # noqa: N802
        return (0,)

    #: what cuStreamWaitEvent returns (a test sets an error: a stream not usable)
    wait_result = 0

    def cuStreamWaitEvent(self, s, ev, flags):  # noqa: N802
        self.log.append(("wait", s, ev))
        return (self.wait_result,)


class EventsDriver(FakeEvents, PassThrough):
    """Events played on the host and logged in ``log``; every other call the real driver's."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list = []


def use_driver(fake_driver, monkeypatch, d):
    """Make ``d`` the driver the package calls (through ``fake_driver``, the fixture of
    fakes.driver), with no device switching (``_device.on_device`` does nothing);
    returns ``d``."""
    from cupy_poolmem import _device

    fake_driver(d)
    monkeypatch.setattr(_device, "on_device", lambda dev: contextlib.nullcontext())
    return d
