"""Helpers shared by the GPU tests: waiting on children, a busy kernel, IPC pools."""

from __future__ import annotations

import os
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


def answer(conn, proc, what: str, timeout: float = 20.0) -> tuple:
    """The next message child ``proc`` sends on ``conn``, within ``timeout`` seconds.

    Fails the test with a message naming ``what`` was awaited and why nothing usable
    came: the child exited (its exit code: -9 is SIGKILL), closed its end, answered
    ``("error", traceback)`` (the traceback is in the message), or stayed silent (its
    pid, to look it up).  A child that dies is seen within a tenth of a second.
    """
    deadline = time.monotonic() + timeout
    while not conn.poll(0.1):
        if not proc.is_alive():
            if conn.poll(0):  # its last words arrived as it exited
                break
            pytest.fail(f"child {proc.name} exited with code {proc.exitcode} before {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"child {proc.name} (pid {proc.pid}) gave no {what} within {timeout} s")
    try:
        reply = conn.recv()
    except (EOFError, OSError) as exc:
        pytest.fail(
            f"child {proc.name} closed its pipe before {what} ({type(exc).__name__}; "
            f"exit code {proc.exitcode})"
        )
    if isinstance(reply, tuple) and reply and reply[0] == "error":
        pytest.fail(f"child {proc.name} failed before {what}:\n{reply[1]}")
    return reply


def wait_for(pred, timeout: float = 20.0) -> bool:
    """Poll ``pred`` until it holds or ``timeout`` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def fd_kinds() -> dict[str, int]:
    """Open descriptors by kind: "anon_inode:[pidfd]", "socket", "pipe", a device file..."""
    kinds: dict[str, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(("socket:", "pipe:")):
            target = target.split(":")[0]
        elif target.startswith("/tmp/#"):
            target = "/tmp/#N"  # a driver's unlinked file
        kinds[target] = kinds.get(target, 0) + 1
    return kinds


def grown(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Kinds of descriptors whose count changed from ``before`` to ``after``, by how much."""
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}


_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def spin(ms: float = 50.0, stream=None) -> None:
    """Keep ``stream`` (the current stream by default) busy for about ``ms`` milliseconds
    (a long-running kernel)."""
    import cupy
    import numpy as np

    k = cupy.RawKernel(_SPIN, "spin")
    rate = cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrClockRate, 0)  # kHz
    with stream or cupy.cuda.get_current_stream():
        k((1,), (1,), (np.int64(int(ms * rate)),))


def warm_up() -> None:
    """Load the kernels the stream tests use once: a module load synchronises the
    context, which would let a spinning kernel finish early."""
    import cupy

    s = cupy.cuda.Stream(non_blocking=True)
    spin(0.01, s)
    with s:
        x = cupy.empty(16, dtype=cupy.int32)
        x.fill(1)
        int(x.sum())
    s.synchronize()


def freed_behind_a_spin(n: int, stream) -> int:
    """A block of ``n`` int32 from the pool in use, on ``stream``: zeroed, then, behind a
    0.3 s spin, filled with 7 (the block's last write), and freed while the spin runs.
    Its address."""
    import cupy

    with stream:
        z = cupy.zeros(n, dtype=cupy.int32)
    stream.synchronize()
    zp = z.data.ptr
    spin(300, stream)
    with stream:
        z.fill(7)  # runs after the spin: the last write to the block
    del z  # freed on the stream while the spin runs
    return zp


@pytest.fixture(scope="module")
def ipc_allocator():
    """CuPy on ``cupy_poolmem.set_allocator()`` (IPC pools) for a whole test module."""
    import cupy

    import cupy_poolmem as cpm

    before = cupy.cuda.get_allocator()
    alloc = cpm.set_allocator()
    yield alloc
    cupy.cuda.set_allocator(before)
