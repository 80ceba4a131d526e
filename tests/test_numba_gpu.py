"""GPU tests of the Numba EMM plugin.

Every scenario runs in a fresh (spawned) process: Numba picks its memory manager when
it creates its context, once per process, and other tests in this process may have
done that already.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import traceback

import pytest

import cupy_poolmem as cpm

pytestmark = pytest.mark.gpu

if cpm.device_count() == 0:
    pytest.skip("needs a CUDA GPU: this machine has no GPU or driver", allow_module_level=True)

pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")

TIMEOUT = 300


def _in_fresh_process(fn, *args):
    """Run ``fn(*args)`` in a spawned process; return its result or fail with its traceback."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_trampoline, args=(q, fn, args))
    p.start()
    try:
        status, value = q.get(timeout=TIMEOUT)
    finally:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
            p.join(timeout=10)
    assert status == "ok", value
    assert p.exitcode == 0
    return value


def _numpy_shim():
    """numba-cuda (<= 0.30) registers an overload for np.row_stack, removed in NumPy 2.5;
    kernel compilation fails there before reaching any memory manager. Alias it."""
    import numpy as np

    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack


def _trampoline(q, fn, args):
    _numpy_shim()
    try:
        q.put(("ok", fn(*args)))
    except BaseException:
        q.put(("err", traceback.format_exc()))


# -- scenarios (run in the child) -----------------------------------------------------------
def _kernel_writes_cupy_reads(explicit_set_allocator: bool) -> dict:
    import gc

    import cupy
    import numpy as np
    from numba import cuda

    import cupy_poolmem as cpm
    import cupy_poolmem.numba as cpn

    cuda.set_memory_manager(cpn.PoolmemNumbaManager)
    if explicit_set_allocator:
        cpm.set_allocator(max_size="50%")

    @cuda.jit
    def fill(a):
        i = cuda.grid(1)
        if i < a.size:
            a[i] = 3 * i + 1

    n = 1 << 20
    d = cuda.device_array(n, dtype=np.int64)
    assert isinstance(cuda.current_context().memory_manager, cpn.PoolmemNumbaManager)
    pool = cpm.get_pool(0)  # created by set_allocator(), or lazily by the plugin
    st = pool.stats()
    ptr = d.__cuda_array_interface__["data"][0]
    assert pool._owns_handle(cpn._pointer_pool(ptr)), "the Numba array is not in the pool"
    assert st.n_allocs >= 1 and st.used_bytes >= n * 8

    fill[(n + 255) // 256, 256](d)
    cuda.synchronize()
    c = cupy.asarray(d)  # zero-copy
    assert c.data.ptr == ptr
    assert bool((c == cupy.arange(n, dtype=cupy.int64) * 3 + 1).all())
    # CuPy allocates from the same pool (one pool, one set of statistics).
    before = pool.stats().n_allocs
    y = cupy.ones(1000)
    assert pool.stats().n_allocs == before + 1
    del y

    # Views and copies keep working; freeing returns blocks to the pool.
    v = d[1000:2000]
    assert np.array_equal(v.copy_to_host(), 3 * np.arange(1000, 2000) + 1)
    frees = pool.stats().n_frees
    del c, d, v
    gc.collect()
    assert pool.stats().n_frees > frees

    # Pinned host memory from the pinned pool; transfers check the data.
    h = cuda.pinned_array(4096, dtype=np.float32)
    pinned = cpm.get_pinned_pool(0)
    assert pinned.stats().n_allocs >= 1
    h[:] = np.arange(4096, dtype=np.float32)
    back = cuda.to_device(h).copy_to_host()
    assert np.array_equal(back, h)
    m = cuda.mapped_array(16, dtype=np.float32)  # falls back to cuMemHostAlloc
    m[:] = 1.0

    free, total = cuda.current_context().get_memory_info()
    assert 0 < free <= total
    return {"max_size": pool.max_size, "ipc": pool.ipc, "n_allocs": pool.stats().n_allocs}


def _ipc_importer(q_in, q_out, n):
    try:
        import cupy
        import numpy as np
        from numba import cuda

        import cupy_poolmem.numba as cpn

        h_full, h_view = q_in.get(timeout=TIMEOUT)
        assert type(h_full._ipc_handle) is cpn.PoolIpcHandle
        full = h_full.open()
        view = h_view.open()  # same allocation: imported once, shared
        imp = cpn._importer()
        n_imports, n_pools = len(imp.maps), len(imp.pools)
        read_ok = np.array_equal(full.copy_to_host(), np.arange(n, dtype=np.float32))
        view_ok = np.array_equal(view.copy_to_host(), np.arange(1000, 2000, dtype=np.float32))
        zero_copy = float(cupy.asarray(view).sum()) == float(np.arange(1000, 2000).sum())
        full.copy_to_device(np.arange(n, dtype=np.float32) * 2 + 5)  # write back
        cuda.synchronize()
        del full, view
        h_view.close()
        after_one = len(imp.maps)
        h_full.close()
        after_both = len(imp.maps)
        q_out.put(("ok", (read_ok, view_ok, zero_copy, n_imports, n_pools, after_one, after_both)))
    except BaseException:
        q_out.put(("err", traceback.format_exc()))


def _ipc_exporter(n: int) -> tuple:
    import multiprocessing as mp

    import numpy as np
    from numba import cuda

    import cupy_poolmem as cpm
    import cupy_poolmem.numba as cpn

    cuda.set_memory_manager(cpn.PoolmemNumbaManager)
    cpm.set_allocator(ipc=True)
    d = cuda.to_device(np.arange(n, dtype=np.float32))
    h_full = d.get_ipc_handle()
    h_view = d[1000:2000].get_ipc_handle()
    assert type(h_full._ipc_handle) is cpn.PoolIpcHandle
    assert h_view._ipc_handle.offset == 1000 * 4

    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_ipc_importer, args=(q_in, q_out, n))
    p.start()
    try:
        q_in.put((h_full, h_view))
        status, value = q_out.get(timeout=TIMEOUT)
    finally:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
            p.join(timeout=10)
    assert status == "ok", value
    assert p.exitcode == 0
    cuda.synchronize()
    written_back = np.array_equal(d.copy_to_host(), np.arange(n, dtype=np.float32) * 2 + 5)
    return value + (written_back,)


# -- tests ---------------------------------------------------------------------------------
def test_numba_kernel_writes_into_pool_memory_cupy_reads_it():
    out = _in_fresh_process(_kernel_writes_cupy_reads, True)
    assert out["max_size"] > 0 and out["ipc"] is True


def test_plugin_creates_the_shared_pool_lazily():
    out = _in_fresh_process(_kernel_writes_cupy_reads, False)
    assert out["max_size"] == 0 and out["ipc"] is True  # set_allocator() defaults


def test_env_var_selects_the_plugin_in_a_fresh_process():
    code = "\n".join(
        [
            "import numpy as np",
            "from numba import cuda",
            "import cupy_poolmem as cpm, cupy_poolmem.numba as cpn",
            "d = cuda.to_device(np.arange(1000, dtype=np.float64))",
            "mgr = cuda.current_context().memory_manager",
            "assert isinstance(mgr, cpn.PoolmemNumbaManager), type(mgr)",
            "st = cpm.get_pool(0).stats()",
            "assert st.n_allocs >= 1 and st.used_bytes >= 8000, st",
            "assert d.copy_to_host().sum() == np.arange(1000).sum()",
            "print('OK', type(mgr).__name__)",
        ]
    )
    env = dict(os.environ, NUMBA_CUDA_MEMORY_MANAGER="cupy_poolmem.numba")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert "OK PoolmemNumbaManager" in out.stdout


def test_numba_ipc_handle_round_trip_between_processes():
    n = 1 << 20
    (read_ok, view_ok, zero_copy, n_imports, n_pools, after_one, after_both, written_back) = (
        _in_fresh_process(_ipc_exporter, n)
    )
    assert read_ok and view_ok and zero_copy  # exporter -> importer
    assert written_back  # importer -> exporter
    assert (n_imports, n_pools) == (1, 1)  # one pool, one allocation imported
    assert (after_one, after_both) == (1, 0)  # freed when the last handle closed
