"""GPU tests of where a shared mapped or expandable pool (``large_blocks="expandable"``
or ``"mapped"`` with ``ipc=True``) meets the rest of the package: ``set_allocator``,
guard mode and the Numba plugin.  Each test checks data in another (spawned) process
or refuses with the package's error; every child is joined within a bound.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import traceback

import numpy as np
import pytest

import cupy_poolmem as cpm

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]

cupy = pytest.importorskip("cupy")

from support import mp_workers as MW  # noqa: E402
from support.waits import answer, join  # noqa: E402

MODES = ["expandable", "mapped"]
N = 3 << 20  # 12 MiB of int32: above the mapped pool's 8 MiB, so a step block in both


def _read_in_another_process(x) -> np.ndarray:
    """``x`` pickled to a spawned process (zero-copy), read there; its host copy."""
    import cupy_poolmem._sharing  # noqa: F401  (the reducer for cupy.ndarray)

    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=MW.pipe_worker, args=(b,), name="pipe-worker")
    p.start()
    b.close()
    try:
        a.send(("x", x))
        reply = answer(a, p, "the array back", 90.0)
        assert reply[0] == "x", reply
        return reply[-1]
    finally:
        try:
            a.send(None)
        except OSError:
            pass
        join(p, timeout=30.0)


@pytest.mark.parametrize("mode", MODES)
def test_set_allocator_with_a_shared_placement_allocates_there_and_shares(mode):
    from cupy_poolmem import _doctor

    before = cupy.cuda.get_allocator()
    alloc = None
    try:
        alloc = cpm.set_allocator(large_blocks=mode)
        pool = alloc.pool()
        assert (pool.large_blocks, pool.ipc) == (mode, True)
        x = cupy.arange(N, dtype=cupy.int32) + 7
        cupy.cuda.Device().synchronize()
        assert pool._steps_of(x.data.ptr) is pool._backend  # it travels as steps
        got = _read_in_another_process(x[1::3])
        assert np.array_equal(got, cupy.asnumpy(x[1::3]))
        assert pool.stats().used_bytes >= x.nbytes
        row = _doctor._placement_row(alloc)
        assert f"'{mode}' (as set_allocator() was called (ipc=True))" in row, row
        del x
    finally:
        cupy.cuda.set_allocator(before)
        cupy.cuda.Device().synchronize()
        if alloc is not None:
            alloc.close()


_ONE_PAST = cupy.ElementwiseKernel(
    "int32 n", "raw float32 a", "if (i == 0) a[n] = 42.0f;", "cpm_surface_write_one_past"
)


@pytest.mark.parametrize("mode", MODES)
def test_a_guarded_shared_placement_shares_arrays_and_catches_an_overrun(mode):
    pool = cpm.DevicePool(
        large_blocks=mode, ipc=True, guard=cpm.GuardOptions(mode="raise", quarantine_blocks=64)
    )
    assert pool.guard is not None
    try:
        with cpm.using(pool):
            x = cupy.empty(N, dtype=cupy.int32)
        x[...] = cupy.arange(N, dtype=cupy.int32) + 11
        cupy.cuda.Device().synchronize()
        assert pool._steps_of(x.data.ptr) is pool._backend
        got = _read_in_another_process(x[5:])  # the red zone past it never travels as data
        assert np.array_equal(got, cupy.asnumpy(x[5:]))
        n = 1000
        with cpm.using(pool):
            a = cupy.zeros(n, dtype=cupy.float32)
        _ONE_PAST(np.int32(n), a, size=1)
        del a
        with pytest.raises(cpm.OutOfBoundsWriteError), cpm.using(pool):
            cupy.empty(8, dtype=cupy.uint8)  # the next allocation raises what the free found
        del x
    finally:
        cupy.cuda.Device().synchronize()
        gc.collect()
        pool.close()


def _numba_handle_of_a_step_block(mode: str, q) -> None:
    """In a fresh process (Numba picks its memory manager once per process)."""
    try:
        from numba import cuda

        import cupy_poolmem as cpm
        import cupy_poolmem.numba as cpn

        cuda.set_memory_manager(cpn.PoolmemNumbaManager)
        cpm.set_allocator(large_blocks=mode)
        d = cuda.to_device(np.arange(N, dtype=np.float32))
        try:
            d.get_ipc_handle()
            refused = None
        except cpm.SharingError as exc:
            refused = str(exc)
        intact = bool(np.array_equal(d.copy_to_host(), np.arange(N, dtype=np.float32)))
        small = None
        if mode == "mapped":  # blocks up to 8 MiB are a CUDA pool's: a handle carries them
            s = cuda.to_device(np.arange(1000, dtype=np.float32))
            small = type(s.get_ipc_handle()._ipc_handle).__name__
        q.put(("ok", (refused, intact, small)))
    except BaseException:
        q.put(("err", traceback.format_exc()))


@pytest.mark.parametrize("mode", MODES)
def test_numbas_ipc_handle_of_a_step_block_is_refused_with_the_way_out(mode):
    pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_numba_handle_of_a_step_block, args=(mode, q), name="numba")
    p.start()
    try:
        status, value = q.get(timeout=120)
    finally:
        join(p, timeout=30.0)
    assert status == "ok", value
    refused, intact, small = value
    assert refused is not None, "get_ipc_handle of a step block was not refused"
    assert f"large_blocks='{mode}'" in refused and "Numba IPC handle" in refused, refused
    assert intact
    assert small == ("PoolIpcHandle" if mode == "mapped" else None)
