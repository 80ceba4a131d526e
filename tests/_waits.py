"""Helpers shared by the GPU tests: waiting on children, a busy kernel, IPC pools."""

from __future__ import annotations

import time

import pytest


def join(*procs, timeout: float = 120.0) -> None:
    """Join every child; kill and fail the test for one that does not finish in time."""
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join(5)
            pytest.fail(f"child {p.name} did not finish")


def wait_for(pred, timeout: float = 20.0) -> bool:
    """Poll ``pred`` until it holds or ``timeout`` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def spin(ms: float, stream) -> None:
    """Keep ``stream`` busy for about ``ms`` milliseconds (a long-running kernel)."""
    import cupy
    import numpy as np

    k = cupy.RawKernel(_SPIN, "spin")
    rate = cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrClockRate, 0)  # kHz
    with stream:
        k((1,), (1,), (np.int64(int(ms * rate)),))


@pytest.fixture(scope="module")
def ipc_allocator():
    """CuPy on ``cupy_poolmem.set_allocator()`` (IPC pools) for a whole test module."""
    import cupy

    import cupy_poolmem as cpm

    before = cupy.cuda.get_allocator()
    alloc = cpm.set_allocator()
    yield alloc
    cupy.cuda.set_allocator(before)
