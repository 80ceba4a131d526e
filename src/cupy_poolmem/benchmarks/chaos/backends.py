"""What the run runs on: the GPU, or a CPU fake with the same interface."""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import types
import weakref
from typing import Any, NamedTuple

import cupy_poolmem

from ..._errors import SharingError
from .checks import extent
from .results import ZERO_AFTER_ROUND

# -- what the run runs on ------------------------------------------------------------------------
WRITER_SPIN_MS = 300  # the killed writer's kernel, before its write


_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def _spin(ms: float) -> None:
    """Keep the current stream busy for about ``ms`` milliseconds."""
    import cupy
    import numpy as np

    k = cupy.RawKernel(_SPIN, "spin")
    rate = cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrClockRate, 0)
    k((1,), (1,), (np.int64(int(ms * rate)),))


class GPU:
    """The real thing: CuPy arrays on cupy_poolmem's IPC pools, shared zero-copy."""

    name = "gpu"

    def __init__(self) -> None:
        import cupy

        self.cupy, self.cpm = cupy, cupy_poolmem

    def setup(self, settings: dict[str, float]) -> None:
        """Make cupy_poolmem CuPy's allocator (IPC pools) and apply sharing settings."""
        self.cpm.set_allocator()
        for k, v in settings.items():
            setattr(self.cpm.sharing, k, v)
        x = self.arange(1, 8)  # load the kernels the checks use
        self.view(x)

    def arange(self, base: int, n: int) -> Any:
        return self.cupy.arange(base, base + n, dtype=self.cupy.int64)

    def new_pool(self) -> Any:
        return self.cpm.DevicePool(ipc=True)

    def using(self, pool: Any = None) -> Any:
        """Allocate from ``pool`` (default: the allocator's pool) in a ``with`` block."""
        return self.cpm.using(pool if pool is not None else self.cpm.get_pool())

    def trim(self) -> None:
        self.cpm.get_pool().trim()

    def ptr(self, arr: Any) -> int:
        return int(arr.data.ptr)

    def geometry(self, arr: Any) -> tuple[tuple, tuple, int, int, int]:
        """``(shape, strides, item size, offset, memory size)`` (see :func:`outside`)."""
        mem = arr.data.mem
        offset = int(arr.data.ptr) - int(mem.ptr)
        return arr.shape, tuple(arr.strides), arr.dtype.itemsize, offset, int(mem.size)

    def view(self, arr: Any) -> tuple[Any, tuple, int, int]:
        """``(host copy, strides, offset, memory size)`` of an array (see :func:`verify`)."""
        import numpy as np

        host = np.ascontiguousarray(self.cupy.asnumpy(arr))
        offset = int(arr.data.ptr) - int(arr.data.mem.ptr)
        return host, tuple(arr.strides), offset, int(arr.data.mem.size)

    def sync(self) -> None:
        self.cupy.cuda.get_current_stream().synchronize()

    def stats(self) -> dict[str, int]:
        return dict(self.cpm.sharing.stats())

    def collect(self) -> None:
        self.cpm.sharing.collect()

    def pool_bytes(self) -> tuple[int, int]:
        """The allocator pool's ``used_bytes`` and ``held_for_sharing_bytes``."""
        st = self.cpm.get_pool().stats()
        return st.used_bytes, st.held_for_sharing_bytes

    def pool_detail(self) -> str:
        """The allocator pool's counters, for a leak's report."""
        st = self.cpm.get_pool().stats()
        return (
            f"used_bytes={st.used_bytes}, live_allocs={st.live_allocs}, "
            f"held_for_sharing_bytes={st.held_for_sharing_bytes}, cached_bytes={st.cached_bytes}"
        )

    def write_late(self, arr: Any) -> None:
        """Queue a write of ``arr`` behind a long kernel."""
        _spin(WRITER_SPIN_MS)
        arr.fill(-1)  # runs after the spin, unless this process is gone by then

    def device(self) -> str:
        cupy = self.cupy
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
        name = props["name"]
        return (name.decode() if isinstance(name, bytes) else str(name)).replace(" ", "_")


class FakeDescriptor(NamedTuple):
    """What a :class:`FakeGPU` message carries: the array's view, and the block (``n``
    int64 from ``base``, remade by the receiver: a message stays small, as a real one)."""

    version: int
    ticket: bytes
    export_id: int
    size: int
    offset: int
    shape: tuple
    strides: tuple
    dtype: str
    life: int
    base: int
    n: int


def fake_rebuild(d: FakeDescriptor) -> FakeArray:
    """Receive a :class:`FakeGPU` message: refused (a typed error) unless its view lies
    within its block, as the sharing protocol promises; else a copy of the block."""
    import numpy as np

    try:
        dt = np.dtype(d.dtype)
    except TypeError:
        raise SharingError(f"dtype {d.dtype!r}") from None
    lo, hi = extent(d.shape, d.strides, dt.itemsize, d.offset)
    if d.version != 1 or dt.hasobject or d.size != 8 * d.n or lo < 0 or hi > d.size:
        raise SharingError("a fake descriptor that does not fit its block")
    block = bytearray(np.arange(d.base, d.base + d.n, dtype=np.int64).tobytes())
    view = np.ndarray(d.shape, dt, buffer=block, offset=d.offset, strides=d.strides)
    arr = FakeArray(view, d.offset, block, d.base)
    arr.received = True
    return arr


class FakeArray:
    """A :class:`FakeGPU` array: a numpy view at ``offset`` into its block's bytes."""

    _ptrs = itertools.count(1 << 12, 1 << 12)

    def __init__(self, data: Any, offset: int, block: bytearray, base: int) -> None:
        self.data, self.offset, self.block, self.base = data, offset, block, base
        self.ptr = next(FakeArray._ptrs)
        self.received = False

    def __reduce__(self) -> tuple:
        d = FakeDescriptor(
            1,
            bytes(16),
            1,
            len(self.block),
            self.offset,
            self.data.shape,
            self.data.strides,
            self.data.dtype.str,
            1,
            self.base,
            len(self.block) // 8,
        )
        return fake_rebuild, (d,)


class FakeGPU:
    """A CPU stand-in for :class:`GPU` (tests of the run's own machinery): numpy arrays
    sent by value in messages that forgeries can change.  It shows what the run counts
    when the protocol keeps its promises: every check passes, nothing leaks.  Its
    ``pool_bytes`` are the bytes of the arrays it made that are still alive, as a
    pool's ``used_bytes`` (so a reference the harness forgets is a leak here too).

    ``corrupt``: every received array shows one wrong element; ``leak``: the hub keeps a
    pipe open and an array alive per collection (both to see that the run counts them).
    """

    def __init__(self, corrupt: bool = False, leak: bool = False) -> None:
        self.corrupt, self.leak = corrupt, leak
        self.name = "fake" + ("-corrupt" if corrupt else "") + ("-leaky" if leak else "")
        self._kept: list[tuple[tuple[int, int], FakeArray]] = []
        self.used_bytes = 0  # bytes of the arrays made here that are alive (a pool's)

    def setup(self, settings: dict[str, float]) -> None:
        pass

    def arange(self, base: int, n: int) -> FakeArray:
        import numpy as np

        block = bytearray(np.arange(base, base + n, dtype=np.int64).tobytes())
        arr = FakeArray(np.ndarray((n,), np.int64, buffer=block), 0, block, base)
        self.used_bytes += len(block)  # as a pool's used_bytes: until the array goes
        weakref.finalize(arr, self._freed, len(block))
        return arr

    def _freed(self, nbytes: int) -> None:
        self.used_bytes -= nbytes

    def new_pool(self) -> Any:
        return types.SimpleNamespace(closed=False, close=lambda: None)

    def using(self, pool: Any = None) -> Any:
        return contextlib.nullcontext()

    def trim(self) -> None:
        pass

    def ptr(self, arr: FakeArray) -> int:
        return arr.ptr

    def geometry(self, arr: FakeArray) -> tuple[tuple, tuple, int, int, int]:
        d = arr.data
        return d.shape, d.strides, d.dtype.itemsize, arr.offset, len(arr.block)

    def view(self, arr: FakeArray) -> tuple[Any, tuple, int, int]:
        import numpy as np

        host = np.array(arr.data, order="C")
        if self.corrupt and arr.received and host.size:
            host.flat[0] += 1
        return host, arr.data.strides, arr.offset, len(arr.block)

    def sync(self) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return dict.fromkeys((*ZERO_AFTER_ROUND, "peers", "clients"), 0)

    def collect(self) -> None:
        if self.leak:
            self._kept.append((os.pipe(), self.arange(1, 512)))

    def pool_bytes(self) -> tuple[int, int]:
        return self.used_bytes, 0

    def pool_detail(self) -> str:
        return f"used_bytes={self.used_bytes}"

    def write_late(self, arr: FakeArray) -> None:
        arr.data[...] = -1  # its own copy: nobody else sees it

    def device(self) -> str:
        return "fake"


#: What ``run`` can run on (``opts.backend``, "gpu" unless a test says "fake").
BACKENDS: dict[str, Any] = {
    "gpu": GPU,
    "fake": FakeGPU,
    "fake-corrupt": functools.partial(FakeGPU, corrupt=True),
    "fake-leaky": functools.partial(FakeGPU, leak=True),
}
