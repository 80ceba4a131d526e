"""GPU tests of guard mode: each bug class planted for real, found with its class and call sites.

- a write through a stale pointer (a raw-pointer view kept after its array died);
- a kernel writing one element past the end (a RawKernel and an ElementwiseKernel);
- a double free through the Numba plugin (its memory manager reset under a live array),
  in a spawned process (Numba picks its memory manager once per process);
- an unordered cross-stream reuse (an array dropped on another stream without
  ``record_stream``);
- a correct program gives the same numbers with and without the guard, and the guard
  reports nothing for it;
- the pool's retirement: a guarded pool dropped in a garbage cycle with its stream, one
  closed during a graph capture, and one closed after the program let go of the
  stream its quarantined block was freed on (each in a process of its own).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import time
import traceback

import numpy as np
import pytest

import cupy_poolmem as cpm

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")

THIS = os.path.basename(__file__)
TIMEOUT = 300

_OOB_RAW = r"""
extern "C" __global__ void write_one_past_the_end(float* a, int n) {
    if (blockIdx.x == 0 && threadIdx.x == 0) a[n] = 42.0f;   // index n: one past the end
}
"""


def _line(marker: str) -> int:
    """The line of this file that carries ``marker`` in a comment."""
    with open(__file__, encoding="utf-8") as f:
        hits = [i for i, text in enumerate(f, 1) if f"# {marker}" in text]
    assert len(hits) == 1, f"marker {marker!r} must be on exactly one line; found {hits}"
    return hits[0]


def _site(marker: str, function: str) -> str:
    return f"{THIS}:{_line(marker)} in {function}"


@pytest.fixture
def pool():
    p = cpm.DevicePool(
        guard=cpm.GuardOptions(mode="raise", cross_stream="raise", quarantine_blocks=64)
    )
    assert p.guard is not None, "DevicePool(guard=...) must attach a guard"
    yield p
    cupy.cuda.runtime.deviceSynchronize()
    gc.collect()
    p.close()


def _raw_view(ptr: int, nbytes: int, dtype, device: int):
    """What a C library, a DLPack consumer or a Numba view keeps: the bare address."""
    mem = cupy.cuda.UnownedMemory(ptr, nbytes, None, device)
    n = nbytes // np.dtype(dtype).itemsize
    return cupy.ndarray((n,), dtype, cupy.cuda.MemoryPointer(mem, 0))


# ---------------------------------------------------------------------------- use after free
def test_write_through_a_stale_pointer_is_use_after_free(pool):
    with cpm.using(pool):
        x = cupy.arange(1024, dtype=cupy.float32)  # ALLOC-UAF
    ptr, gen = x.data.ptr, cpm.check(x).generation
    assert cpm.check(ptr, gen).state == "live"
    stale = _raw_view(ptr, 4096, cupy.float32, pool.device_id)
    del x  # FREE-UAF
    with pytest.raises(cpm.UseAfterFreeError, match="still in the quarantine") as ei:
        cpm.check(ptr, gen)  # the raw pointer's owner asks before using it
    assert ei.value.block.free_site and _site("FREE-UAF", "test_write_through") in (
        ei.value.block.free_site
    ), str(ei.value)
    stale[100:102].fill(7.0)  # the bug: a kernel writes through the stale pointer
    with pytest.raises(cpm.UseAfterFreeError) as ei:
        pool.guard.verify()
    err = ei.value
    text = str(err)
    assert (err.offset, err.n_changed) == (400, 8), (
        f"expected the 8 bytes of elements 100-101 (offset 400) changed; got offset "
        f"{err.offset}, {err.n_changed} bytes: {text}"
    )
    assert (err.block.ptr, err.block.size, err.block.generation) == (ptr, 4096, gen), text
    assert _site("ALLOC-UAF", "test_write_through") in text, text
    assert _site("FREE-UAF", "test_write_through") in text, text
    assert pool.guard.counts["use_after_free"] == 2  # the check() above, and the write


def test_freed_memory_reads_as_poison_while_quarantined(pool):
    with cpm.using(pool):
        x = cupy.full(256, 1.5, dtype=cupy.float64)
    ptr = x.data.ptr
    del x
    seen = _raw_view(ptr, 256 * 8, cupy.uint8, pool.device_id).get()
    assert (seen == pool.guard.options.poison).all(), (
        "a freed block must hold the poison byte until it leaves the quarantine; "
        f"saw bytes {np.unique(seen)[:8]}"
    )


# ---------------------------------------------------------------------------- out of bounds
def _raw_kernel_one_past(a, n):
    k = cupy.RawKernel(_OOB_RAW, "write_one_past_the_end")
    k((1,), (1,), (a, np.int32(n)))


def _elementwise_one_past(a, n):
    k = cupy.ElementwiseKernel(
        "int32 n", "raw float32 a", "if (i == 0) a[n] = 42.0f;", "cpm_test_write_one_past"
    )
    k(np.int32(n), a, size=1)


@pytest.mark.parametrize("kernel", [_raw_kernel_one_past, _elementwise_one_past])
def test_kernel_writing_one_element_past_the_end(pool, kernel):
    n = 1000
    with cpm.using(pool):
        a = cupy.zeros(n, dtype=cupy.float32)  # ALLOC-OOB
    ptr, gen = a.data.ptr, cpm.check(a).generation
    kernel(a, n)
    assert float(a[n - 1]) == 0.0, "the last element itself is untouched"
    del a  # FREE-OOB
    with pytest.raises(cpm.OutOfBoundsWriteError) as ei, cpm.using(pool):
        cupy.empty(8, dtype=cupy.uint8)  # the next allocation raises what the free found
    err = ei.value
    text = str(err)
    assert (err.offset, err.n_changed) == (4 * n, 4), (
        f"expected the 4 bytes of a[{n}] (offset {4 * n}) changed; got offset {err.offset}, "
        f"{err.n_changed} bytes: {text}"
    )
    assert (err.block.ptr, err.block.size, err.block.generation) == (ptr, 4 * n, gen), text
    assert _site("ALLOC-OOB", "test_kernel_writing") in text, text
    assert "bounds test" in text
    with cpm.using(pool):
        ok = cupy.arange(10)  # reported once: allocation works again
    assert int(ok.sum()) == 45


# ---------------------------------------------------------------------------- streams
def test_unordered_cross_stream_reuse_is_reported(pool):
    s1 = cupy.cuda.Stream(non_blocking=True)
    s2 = cupy.cuda.Stream(non_blocking=True)
    with cpm.using(pool):
        with s1:
            x = cupy.ones(1 << 16, dtype=cupy.float32)  # ALLOC-XS
        with s2:
            y = x * 2  # s2 reads x ...
            del x  # FREE-XS  ... and x goes while s2 is current, with no record_stream
    s2.synchronize()
    del y  # its values may hold poison: x's memory was poisoned on s1 while s2 read it
    with pytest.raises(cpm.UnorderedReuseError) as ei:
        pool.guard.raise_pending()
    text = str(ei.value)
    assert f"stream 0x{s1.ptr:x}" in text and f"stream 0x{s2.ptr:x}" in text, text
    assert _site("ALLOC-XS", "test_unordered") in text, text
    assert _site("FREE-XS", "test_unordered") in text, text
    assert isinstance(ei.value, cpm.UseAfterFreeError)
    # The fix: record the other stream before dropping the array.
    with cpm.using(pool):
        with s1:
            x = cupy.ones(1 << 16, dtype=cupy.float32)
        with s2:
            y = x * 2
            cpm.record_stream(x, s2)
            del x
    s2.synchronize()
    assert float(y[0]) == 2.0 and float(y[-1]) == 2.0, "read before the (ordered) poison"
    assert pool.guard.counts["unordered_stream"] == 1, "record_stream orders the free"
    assert pool.guard.stats()["pending"] == 0


# ---------------------------------------------------------------------------- double free
def test_double_free_through_the_numba_plugin():
    pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")
    out = _in_fresh_process(_numba_double_free)
    assert out["kind"] == "double_free", out
    msg = out["msg"]
    assert f"block 0x{out['ptr']:x}" in msg, msg
    assert _site("NUMBA-RESET", "_numba_double_free") in msg, msg  # the first free
    assert _site("NUMBA-DEL", "_numba_double_free") in msg, msg  # the second one
    assert _site("NUMBA-ALLOC", "_numba_double_free") in msg, msg
    assert "Numba pointer's finalizer" in msg
    assert out["newer_intact"], "the stale finalizer must not free the newer allocation"


def _numba_double_free() -> dict:
    import cupy
    import numpy as np
    from numba import cuda

    import cupy_poolmem as cpm
    import cupy_poolmem.numba as cpn

    cuda.set_memory_manager(cpn.PoolmemNumbaManager)
    cpm.set_allocator(ipc=False, guard=cpm.GuardOptions(mode="raise", quarantine_bytes=0))
    d = cuda.device_array(256, dtype=np.float32)  # NUMBA-ALLOC
    ptr = int(d.device_ctypes_pointer.value)
    cuda.current_context().memory_manager.reset()  # NUMBA-RESET  frees d's memory
    newer = cuda.to_device(np.arange(256, dtype=np.float32))  # may reuse the address
    del d  # NUMBA-DEL  d's pointer finalizer frees it a second time
    gc.collect()
    pool = cpm.get_pool()
    try:
        pool.guard.verify()
    except cpm.DoubleFreeError as e:
        kind, msg = e.kind, str(e)
    else:
        kind, msg = None, f"no report; guard stats {pool.guard.stats()}"
    cupy.cuda.runtime.deviceSynchronize()
    intact = bool((newer.copy_to_host() == np.arange(256, dtype=np.float32)).all())
    return {"kind": kind, "msg": msg, "ptr": ptr, "newer_intact": intact}


def _in_fresh_process(fn, *args):
    """Run ``fn(*args)`` in a spawned process; its return value (a crash fails the test
    with the child's exit code instead of taking the whole session down)."""
    import queue

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_trampoline, args=(q, fn, args))
    p.start()
    deadline = time.monotonic() + TIMEOUT
    try:
        while True:
            try:
                status, value = q.get(timeout=1.0)
                break
            except queue.Empty:
                if not p.is_alive():
                    pytest.fail(f"{fn.__name__} died in its process (exit code {p.exitcode})")
                if time.monotonic() > deadline:
                    pytest.fail(f"{fn.__name__} did not answer in {TIMEOUT} s")
    finally:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
            p.join(timeout=10)
    assert status == "ok", value
    return value


def _trampoline(q, fn, args):
    import numpy as np

    if not hasattr(np, "row_stack"):  # numba-cuda <= 0.30 overloads it (gone in NumPy 2.5)
        np.row_stack = np.vstack
    try:
        q.put(("ok", fn(*args)))
    except BaseException:
        q.put(("err", traceback.format_exc()))


# ---------------------------------------------------------------------------- correct programs
def _workload():
    """Temporaries, views, two streams with record_stream, a reduction: deterministic."""
    a = cupy.arange(1 << 15, dtype=cupy.float64)
    for i in range(12):
        b = (a * (i + 1) + 1.0) ** 2
        a = cupy.sqrt(b)[::-1].copy() - i
    s = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.get_current_stream().synchronize()
    with s:
        c = a[1::2] * 3
    cpm.record_stream(a, s)
    s.synchronize()
    total = float(c.sum()) + float(a.sum())
    return cupy.asnumpy(a), cupy.asnumpy(c), total


def _correct_program() -> dict:
    """The workload without and with the guard, in this (fresh) process."""
    import cupy

    import cupy_poolmem as cpm

    pool = cpm.DevicePool(
        guard=cpm.GuardOptions(mode="raise", cross_stream="raise", quarantine_blocks=64)
    )
    plain = cpm.DevicePool(guard=False)
    try:
        with cpm.using(plain):
            ref = _workload()
        with cpm.using(pool):
            got = _workload()
    finally:
        cupy.cuda.runtime.deviceSynchronize()
        gc.collect()
        plain.close()
    out = {"ref": ref, "got": got, "verify": pool.guard.verify()}
    pool.guard.flush()  # every quarantined block checked
    out["counts"] = dict(pool.guard.counts)
    out["events"] = [str(e) for e in pool.guard.events]
    out["internal_errors"] = pool.guard.stats()["internal_errors"]
    pool.close()
    return out


def test_a_correct_program_gives_the_same_results_under_the_guard():
    # In a process of its own: on an H100 this test crashed the interpreter (SIGSEGV
    # in the guard's check of a red zone) when it ran after the other tests of this
    # file in one process, though never on its own; the crash is a failure here.
    r = _in_fresh_process(_correct_program)
    ref, got = r["ref"], r["got"]
    np.testing.assert_array_equal(got[0], ref[0])
    np.testing.assert_array_equal(got[1], ref[1])
    assert got[2] == ref[2]
    assert r["verify"] == 0
    assert sum(r["counts"].values()) == 0, r["events"]
    assert r["internal_errors"] == 0


# ---------------------------------------------------------------------------- retirement
# Each in a process of its own: the retirer is the process's, and a crash (a free on a
# destroyed stream) fails the test instead of the session.
def _wait_retired(timeout: float = 30.0) -> int:
    """Wait for the process's retirer to destroy what is due; returns what is left."""
    from cupy_poolmem import _retire

    r = _retire.retirer()
    deadline = time.monotonic() + timeout
    while r.pending and time.monotonic() < deadline:
        time.sleep(0.05)
    return r.pending


def _new_pool_holds_data(seed: int) -> bool:
    """A pool created after the retirement allocates, and its memory holds a pattern."""
    import cupy

    import cupy_poolmem as cpm

    want = np.random.default_rng(seed).integers(0, 2**31 - 1, 3 << 18, dtype=np.int32)
    q = cpm.DevicePool()
    try:
        with cpm.using(q):
            got = cupy.asarray(want).get()
    finally:
        q.close()
    return bool((got == want).all())


def _dropped_in_cycles_with_their_streams() -> dict:
    import weakref

    import cupy

    import cupy_poolmem as cpm
    from cupy_poolmem import _retire

    r = _retire.retirer()
    sums, quarantined, collected = [], [], []
    for i in range(8):
        s = cupy.cuda.Stream(non_blocking=True)
        p = cpm.DevicePool(guard=cpm.GuardOptions(quarantine_blocks=64), ipc=bool(i % 2))
        with s, cpm.using(p):
            x = cupy.full(1 << 18, i, dtype=cupy.int32)
            sums.append(int(x.sum()))
            del x  # poisoned on s and quarantined: its record holds s
        quarantined.append(p.guard.stats()["quarantined_blocks"])
        guard = weakref.ref(p.guard)
        cycle = [p, s]
        cycle.append(cycle)
        del p, s, cycle
        gc.collect()  # s's finalizer may destroy it before the pool's runs
        collected.append(guard() is None)
    return {
        "sums": sums,
        "quarantined": quarantined,
        "collected": collected,
        "pending": _wait_retired(),
        "retired": r.n_retired,
        "sync_errors": r.n_sync_errors,
        "data": _new_pool_holds_data(1),
    }


def test_a_guarded_pool_dropped_in_a_cycle_with_its_stream_is_retired_safely():
    """Its quarantined blocks were poisoned on a stream that goes in the same garbage:
    the finalizer hands them to the retirer unchecked (a free or a check on the
    destroyed stream crashed the driver), which frees them after a sync."""
    r = _in_fresh_process(_dropped_in_cycles_with_their_streams)
    assert r["sums"] == [i << 18 for i in range(8)], r
    assert all(q >= 1 for q in r["quarantined"]), r
    assert all(r["collected"]), r
    assert r["pending"] == 0 and r["retired"] >= 8 and r["sync_errors"] == 0, r
    assert r["data"], "a pool created afterwards must hold its data"


def _closed_during_a_capture() -> dict:
    import cupy

    import cupy_poolmem as cpm
    from cupy_poolmem import _retire

    r = _retire.retirer()
    freed: list[int] = []
    real_free = r._free

    def free(ptr: int, dev: int) -> None:  # the retirer's free of leftovers, recorded
        freed.append(int(ptr))
        real_free(ptr, dev)

    r._free = free
    n = 1 << 20
    guarded = cpm.DevicePool(guard=cpm.GuardOptions(quarantine_blocks=64))
    with cpm.using(guarded):
        xs = [cupy.full(n, i, dtype=cupy.int32) for i in range(4)]
        values = [int(x[-1]) for x in xs]
    del xs  # poisoned and quarantined
    cupy.cuda.runtime.deviceSynchronize()
    ptrs = sorted(b.ptr for b in guarded.guard.blocks() if b.state == "quarantined")
    plain = cpm.DevicePool()
    s = cupy.cuda.Stream(non_blocking=True)
    with cpm.using(plain), s:
        a = cupy.arange(n, dtype=cupy.int32)
        b = a + 1  # warm-up: the kernel is built before the capture
        del b
        s.synchronize()
        s.begin_capture(cupy.cuda.runtime.streamCaptureModeRelaxed)
        b = a + 1  # graph memory of the plain pool: the pools know a capture is under way
        guarded.close()  # a check would synchronise: the quarantine goes to the retirer
        stats = guarded.guard.stats()
        used_during = guarded._safe_used()  # still allocated, not freed (both CUDA pools)
        pending_during = r.pending
        freed_during = list(freed)
        graph = s.end_capture()
        graph.launch(s)
        s.synchronize()
        got = b.get()
        del b
        s.synchronize()
        del graph
    out = {
        "values": values,
        "ptrs": ptrs,
        "quarantined_after": stats["quarantined_blocks"],
        "unchecked": stats["unchecked_blocks"],
        "used_during": used_during,
        "block_bytes": 4 * n + guarded.guard.options.red_zone,
        "pending_during": pending_during,
        "freed_during": freed_during,
        "graph_ok": bool((got == np.arange(n, dtype=np.int32) + 1).all()),
        "pending": _wait_retired(),
        "sync_errors": r.n_sync_errors,
    }
    out["freed"] = sorted(freed)
    plain.close()
    out["data"] = _new_pool_holds_data(2)
    return out


def test_a_guarded_pool_closed_during_a_capture_leaves_its_quarantine_to_the_retirer():
    r = _in_fresh_process(_closed_during_a_capture)
    assert r["values"] == [0, 1, 2, 3], r
    assert len(r["ptrs"]) == 4, r
    assert r["quarantined_after"] == 0 and r["unchecked"] == 4, r
    assert r["used_during"] >= 4 * r["block_bytes"], "quarantined blocks freed in a capture"
    assert r["pending_during"] == 1 and r["freed_during"] == [], r
    assert r["graph_ok"], "the capture was not disturbed"
    assert r["pending"] == 0 and r["sync_errors"] == 0, r
    assert r["freed"] == r["ptrs"], "the retirer freed exactly the quarantined blocks"
    assert r["data"], "a pool created afterwards must hold its data"


def _close_checks_on_a_stream_the_program_dropped() -> dict:
    import weakref

    import cupy

    import cupy_poolmem as cpm

    pool = cpm.DevicePool(guard=cpm.GuardOptions(quarantine_blocks=64, cross_stream="off"))
    s = cupy.cuda.Stream(non_blocking=True)
    with s, cpm.using(pool):
        x = cupy.arange(1 << 16, dtype=cupy.float32)
        ptr, gen = x.data.ptr, cpm.check(x).generation
        del x  # poisoned on s and quarantined
    s.synchronize()
    stale = _raw_view(ptr, 4 << 16, cupy.float32, pool.device_id)
    stale[10:12].fill(3.0)  # a stale pointer writes (on the legacy stream)
    cupy.cuda.runtime.deviceSynchronize()
    del stale
    alive = weakref.ref(s)
    del s  # only the block's record holds the stream now
    held = alive() is not None
    pool.close()  # checks the block on its stream, frees it there, then lets go of s
    try:
        pool.guard.raise_pending()
    except cpm.UseAfterFreeError as e:
        found = {"offset": e.offset, "n": e.n_changed, "gen": e.block.generation}
    else:
        found = None
    return {
        "held": held,
        "released": alive() is None,
        "gen": gen,
        "found": found,
        "pending": _wait_retired(),
        "data": _new_pool_holds_data(3),
    }


def test_close_checks_the_quarantine_on_a_stream_the_program_let_go():
    r = _in_fresh_process(_close_checks_on_a_stream_the_program_dropped)
    assert r["held"], "a quarantined block's record keeps its stream alive"
    assert r["found"] == {"offset": 40, "n": 8, "gen": r["gen"]}, r
    assert r["released"], "the stream goes once its last block is really freed"
    assert r["pending"] == 0 and r["data"], r


def test_set_allocator_with_guard_dispatches_through_the_guard():
    before = cupy.cuda.get_allocator()
    try:
        alloc = cpm.set_allocator(ipc=False, guard="warn")
        x = cupy.arange(100, dtype=cupy.int64)
        info = cpm.check(x)
        assert info.state == "live" and info.size == 800
        assert alloc.pool().guard is not None and alloc.pool().guard.options.mode == "warn"
        assert int(x.sum()) == 4950
        ptr = x.data.ptr
        del x
        with pytest.warns(cpm.GuardWarning, match="use after free"):
            assert cpm.check(ptr).state == "quarantined"
        alloc.close()
    finally:
        cupy.cuda.set_allocator(before)


def test_environment_variable_guards_new_device_pools(monkeypatch):
    monkeypatch.setenv("CUPY_POOLMEM_GUARD", "warn,red_zone=64")
    p = cpm.DevicePool()
    try:
        assert p.guard is not None and p.guard.options.red_zone == 64
    finally:
        p.close()
    monkeypatch.setenv("CUPY_POOLMEM_GUARD", "0")
    q = cpm.DevicePool()
    try:
        assert q.guard is None
    finally:
        q.close()
