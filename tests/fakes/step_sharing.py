"""Step-backed pools in the fake sharing world: a pool whose blocks lie in the steps of
an exportable ``ExpandableBlocks`` or ``MappedBlocks`` on the VMM fake
(:class:`~fakes.steps.StepVmm`), sent through the real exporter, wire and importer of
``tests/fakes/sharing.py``.  Bytes written by the exporter are read by receivers through
their own mappings of the same physical memory.

``step_pool(proc, vmm, mode)`` makes one; the test puts the VMM fake on the world's GPU
(``world.gpu.vmm = vmm``) so that every simulated process maps through it.
"""

from __future__ import annotations

from typing import Any

from cupy_poolmem import _arena_py
from cupy_poolmem._expandable import ExpandableBlocks
from cupy_poolmem._mapped import MappedBlocks
from cupy_poolmem._sharing import _wire
from fakes.expandable import SPAN
from fakes.sharing import FakeBlock, FakeStream, SimProc

STREAM = 0x5000


class FakeStepCore:
    """A ``DevicePool(large_blocks=mode, ipc=True)`` as the exporter sees it: its blocks
    come from ``placement`` (exportable memory), ``_steps_of`` names it."""

    def __init__(self, proc: SimProc, vmm: Any, mode: str = "expandable") -> None:
        self.proc, self.vmm, self.mode = proc, vmm, mode
        self.device_id = 0
        self.kind = _wire.POOL_DEVICE
        self.ipc = True
        self.closed = False
        self.release_hook: Any = None
        self._held_for_sharing = 0
        self.n_allocs = self.n_frees = 0
        self.cache_limit = 0
        self._cache_shared = None  # no reuse cache for exported blocks
        self.finalized = False
        if mode == "expandable":
            self.placement: Any = ExpandableBlocks(
                0,
                span=SPAN,
                arena=_arena_py.Arena,
                driver=vmm,
                sync=vmm.sync_device,
                exportable=True,
            )
        else:
            self.placement = MappedBlocks(0, driver=vmm, exportable=True)
        self.freed: list[int] = []

    def _steps_of(self, ptr: int) -> Any:
        return self.placement if self.placement.owns(ptr) else None

    def _ipc_pool_of(self, ptr: int) -> Any:
        raise AssertionError("a step block's CUDA pool was asked for")

    def alloc(self, size: int, payload: Any = None, stream: FakeStream | None = None) -> Any:
        stream = stream or FakeStream(STREAM, 0)
        err, ptr = self.placement.alloc(size, stream.ptr)
        assert err == 0, err
        self.n_allocs += 1
        b = StepBlock(self, ptr, size, stream)
        if payload is not None:
            b.write(payload)
        return b

    def _free_now(self, ptr: int, stream_ptr: int, stream: Any = None) -> None:
        self.freed.append(ptr)
        self.placement.free(ptr, stream_ptr)

    def _drained(self) -> None:
        pass

    def trim(self) -> int:
        """``DevicePool.trim()``: every step nothing uses (nor another process maps)."""
        return int(self.placement.release(0, True) or 0)

    def dispose(self) -> None:
        pass


class StepBlock(FakeBlock):
    """A live block of a step-backed pool; its payload is the value at its first byte."""

    def write(self, payload: Any, stream: FakeStream | None = None) -> None:
        self.core.vmm.write(self.ptr, payload)
        if self.size > 1:
            self.core.vmm.write(self.ptr + self.size - 1, payload)

    def read(self) -> tuple[int, Any]:
        return 0, self.core.vmm.read(self.ptr)


def step_pool(proc: SimProc, vmm: Any, mode: str = "expandable") -> FakeStepCore:
    """A step-backed pool of ``proc`` (torn down with the world)."""
    core = FakeStepCore(proc, vmm, mode)
    proc.cores.append(core)  # type: ignore[arg-type]
    return core


def read_here(proc: SimProc, owner: Any, size: int) -> tuple[Any, Any]:
    """``(first byte, last byte)`` a kernel of ``proc`` reads through a received owner
    of a ``size``-byte block."""
    vmm = proc.gpu.vmm
    return vmm.read(owner.ptr), vmm.read(owner.ptr + size - 1)
