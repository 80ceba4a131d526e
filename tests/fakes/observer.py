"""Fake pools and blocks that drive cupy_poolmem's observer without a GPU.

They mimic the hot path: after an allocation ``PoolCore.malloc`` calls
``observer.on_alloc(block)``; when the block dies ``Block.__dealloc__`` calls
``observer.on_free(core, ptr, size, stream_ptr, block.info)`` — only while an observer
is installed.  The compiled hot path has no Python frame, so tests pass this file to
``stats.track(skip=[FAKES_FILE])`` to keep call sites pointing at the test lines.
"""

from __future__ import annotations

from types import SimpleNamespace

from cupy_poolmem import _runtime

FAKES_FILE = __file__


class InterruptedName:
    """A thread whose ``name`` raises KeyboardInterrupt once, then reads ``name``:
    SIGINT's handler running in the Python code of the recorder's pre-step (which
    reads the thread's name, a property)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self.fired = False

    @property
    def name(self) -> str:
        if not self.fired:
            self.fired = True
            raise KeyboardInterrupt
        return self._name


class FakeCore:
    """Stands in for a pool: what the observer reads from ``block.core``."""

    _next_serial = 10_000

    def __init__(
        self, device: int = 0, kind: int = 0, reserved: int = 1 << 30, used: int = 0
    ) -> None:
        self.device_id = device
        self.kind = kind
        self.reserved = reserved
        self.used = used
        self.observer = None
        FakeCore._next_serial += 1
        self._serial = FakeCore._next_serial

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(used_bytes=self.used, reserved_bytes=self.reserved)


class FakeBlock:
    def __init__(self, core: FakeCore, ptr: int, size: int, stream_ptr: int = 0) -> None:
        self.core = core
        self.ptr = ptr
        self.size = size
        self.stream_ptr = stream_ptr
        self.info = None


def observer():
    return _runtime.HOOKS.observer


def alloc(core: FakeCore, ptr: int, size: int, stream_ptr: int = 0) -> FakeBlock:
    """What PoolCore.malloc does after the driver call."""
    b = FakeBlock(core, ptr, size, stream_ptr)
    obs = observer()
    if obs is not None:
        obs.on_alloc(b)
    return b


def free(b: FakeBlock) -> None:
    """What Block.__dealloc__ does before the driver call."""
    obs = observer()
    if obs is not None:
        obs.on_free(b.core, b.ptr, b.size, b.stream_ptr, b.info)
