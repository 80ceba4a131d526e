"""The guard's device work: byte-pattern fills and checks, and questions about streams.

``Guard`` calls one object with this interface; CPU tests give it a fake.

- ``fill(ptr, n, byte, stream)``: ``cuMemsetD8Async`` on the stream (no sync).
- ``find(ptr, n, byte, stream)``: ``(first offset whose byte differs or -1, how many
  differ)``.  One kernel on the stream (a grid-stride loop, ``atomicMin`` of the first
  offset, ``atomicAdd`` of the count into a 16-byte result buffer), then a 16-byte copy
  back and a synchronisation of that stream: the one host wait of each check.
- ``current_stream()``, ``non_blocking(stream_ptr)``, ``capturing(stream_ptr)``,
  ``capture_underway()``.

Result buffers come from ``cudaMalloc`` (never from a pool, so a check never allocates
through the guard it serves), 16 bytes each, kept per device for the process and
reused; a check that runs inside another (a destructor run by the garbage collector
during a check) takes a buffer of its own.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import cupy
import numpy as np

from .. import _streams
from .._device import on_device
from .._driver import get as drv
from .._errors import UnsupportedError, check_driver

__all__ = ["DeviceOps"]

_SOURCE = r"""
extern "C" __global__ void cupy_poolmem_guard_find(
    const unsigned char* p, unsigned long long n, unsigned int pattern,
    unsigned long long* out)
{
    const unsigned char want = (unsigned char)pattern;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += stride) {
        if (p[i] != want) {
            atomicMin(&out[0], i);
            atomicAdd(&out[1], 1ULL);
        }
    }
}
"""
_NAME = "cupy_poolmem_guard_find"
_THREADS = 256
_MAX_BLOCKS = 4096
_NONE = np.uint64(0xFFFFFFFFFFFFFFFF)
_CU_STREAM_NON_BLOCKING = 1


class DeviceResources:
    """What the checks keep for the process, per device: the compiled check kernel
    (``kernels``; ``keep`` holds its programs, whose kernels are used by handle) and
    the free 16-byte result buffers (``buffers``), under ``lock``.  Nothing to do at a
    fork: the package never forks after CUDA is initialised."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kernels: dict[int, Any] = {}
        self.keep: list[Any] = []
        self.buffers: dict[int, list[int]] = {}


RESOURCES = DeviceResources()


def _sptr(stream: Any) -> int:
    """A stream handle from a CuPy/cuda.core stream object or an int."""
    ptr = getattr(stream, "ptr", None)
    if ptr is None:
        ptr = getattr(stream, "handle", stream)
    return int(ptr or 0)


class DeviceOps:
    """Fills and checks on device ``device`` (see the module docstring).

    Nothing here goes through CuPy: these run inside the pool's free, which CuPy may
    call from the middle of its own work (a temporary dropped between two kernels),
    where a CuPy kernel launch and read-back crashed the process (H100, CuPy 14.2).
    No cuda.core ``Stream`` is made either (wrapping the program's streams with
    ``Stream.from_handle`` in every check left later driver calls crashing).  The
    check kernel is compiled by cuda.core (NVRTC) once; its launch
    (``cuLaunchKernel`` on the stream handle), the fills, the result buffer and its
    read-back are driver calls.
    """

    def __init__(self, device: int, resources: DeviceResources = RESOURCES) -> None:
        self.device = int(device)
        self.resources = resources

    def prepare(self) -> None:
        """Compile the check kernel now (NVRTC), not in a free."""
        self._kernel()

    def _kernel(self) -> Any:
        res = self.resources
        k = res.kernels.get(self.device)
        if k is None:
            from cuda.core import Device, Program, ProgramOptions

            try:
                with on_device(self.device):
                    cc = Device(self.device).compute_capability
                    opts = ProgramOptions(arch=f"sm_{cc[0]}{cc[1]}")
                    code = Program(_SOURCE, code_type="c++", options=opts).compile("cubin")
                    kobj = code.get_kernel(_NAME)
                    k = drv().CUkernel(int(kobj.handle))
                    res.keep.append((code, kobj))  # the library stays loaded for the process
            except Exception as exc:
                raise UnsupportedError(
                    f"the guard's check kernel does not compile on device {self.device} "
                    f"({type(exc).__name__}: {exc}); the guard needs NVRTC (cuda.core's "
                    "Program). Create the pool without guard=..."
                ) from exc
            k = res.kernels.setdefault(self.device, k)
        return k

    def _take(self) -> int:
        res = self.resources
        with res.lock:
            free = res.buffers.setdefault(self.device, [])
            if free:
                return free.pop()
        with on_device(self.device):
            return int(check_driver(drv().cuMemAlloc(16), "cuMemAlloc"))

    def _give(self, buf: int) -> None:
        res = self.resources
        with res.lock:
            res.buffers.setdefault(self.device, []).append(buf)

    def fill(self, ptr: int, n: int, byte: int, stream: Any) -> None:
        if n <= 0:
            return
        with on_device(self.device):
            check_driver(
                drv().cuMemsetD8Async(int(ptr), int(byte), int(n), _sptr(stream)),
                "cuMemsetD8Async",
            )

    def find(self, ptr: int, n: int, byte: int, stream: Any) -> tuple[int, int]:
        if n <= 0:
            return -1, 0
        kernel = self._kernel()
        buf = self._take()
        res = np.empty(2, dtype=np.uint64)
        try:
            d = drv()
            with on_device(self.device):
                sptr = _sptr(stream)
                # out[0] = UINT64_MAX (no difference yet), out[1] = 0 (count).
                check_driver(d.cuMemsetD8Async(buf, 0xFF, 8, sptr), "cuMemsetD8Async")
                check_driver(d.cuMemsetD8Async(buf + 8, 0, 8, sptr), "cuMemsetD8Async")
                blocks = max(1, min(_MAX_BLOCKS, (n + _THREADS - 1) // _THREADS))
                fn = check_driver(d.cuKernelGetFunction(kernel), "cuKernelGetFunction")
                args = (
                    (int(ptr), int(n), int(byte), int(buf)),
                    (ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_uint, ctypes.c_void_p),
                )
                check_driver(
                    d.cuLaunchKernel(fn, blocks, 1, 1, _THREADS, 1, 1, 0, sptr, args, 0),
                    "cuLaunchKernel",
                )
                check_driver(
                    d.cuMemcpyDtoHAsync(res.ctypes.data, buf, 16, sptr), "cuMemcpyDtoHAsync"
                )
                check_driver(d.cuStreamSynchronize(sptr), "cuStreamSynchronize")
        finally:
            self._give(buf)
        first, count = res[0], int(res[1])
        return (-1 if first == _NONE else int(first)), count

    def current_stream(self) -> int:
        return int(cupy.cuda.get_current_stream().ptr)

    def non_blocking(self, stream_ptr: int) -> bool:
        if stream_ptr <= 2:
            return False
        err, flags = drv().cuStreamGetFlags(stream_ptr)
        if int(err):
            return True  # unknown (another device's stream?): assume no implicit ordering
        return bool(int(flags) & _CU_STREAM_NON_BLOCKING)

    def capturing(self, stream_ptr: int) -> bool:
        return _streams.capture_status(int(stream_ptr)) != _streams.CAPTURE_NONE

    def capture_underway(self) -> bool:
        return _streams.any_capture_underway()
