"""Functions run in spawned child processes by the peer-access tests (importable by name)."""

from __future__ import annotations

import os
import traceback

TIMEOUT = 120


def _quiet():
    import warnings

    # CuPy warns "peer access has been activated automatically" on every cross-GPU use.
    warnings.simplefilter("ignore")


def kernel_without_grant(conn):
    """GPU 1 reads GPU 0's pool memory that grants it nothing: report what happens.

    Sends ("checked", name of check_access's error), then ("ran", data ok) or ("fault",
    error text).  The CUDA context may be broken afterwards, so the process ends with
    os._exit; a Pipe's send is synchronous, so both messages are out by then.
    """
    try:
        _quiet()
        import cupy

        import cupy_poolmem as cpm

        cpm.set_allocator(peer_access=None)
        with cupy.cuda.Device(0):
            x = cupy.arange(1 << 20, dtype=cupy.float32)
            cupy.cuda.Device(0).synchronize()
        try:
            cpm.check_access(x, device=1)
            conn.send(("checked", "no error"))
        except Exception as exc:
            conn.send(("checked", type(exc).__name__))
        try:
            with cupy.cuda.Device(1):
                y = x * 2
                cupy.cuda.Device(1).synchronize()
                ok = bool((y == cupy.arange(1 << 20, dtype=cupy.float32) * 2).all())
            conn.send(("ran", ok))
        except Exception as exc:
            conn.send(("fault", f"{type(exc).__name__}: {exc}"))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()
        os._exit(0)


def use_on_second_gpu(q_in, q_out):
    """Receive an array of GPU 0, read and write it from the other GPU; report the data."""
    try:
        _quiet()
        import cupy
        import numpy as np

        import cupy_poolmem as cpm

        cpm.set_allocator()
        x = q_in.get(timeout=TIMEOUT)
        dev = x.data.device_id
        other = 1 if dev == 0 else 0
        cupy.cuda.Device(dev).synchronize()  # the receive waited on this GPU's stream
        cpm.check_access(x, device=other)  # the grant is in place before any kernel
        with cupy.cuda.Device(other):
            y = x * 2  # a kernel on the other GPU reads the received memory
            x[...] = -x  # and writes it
            cupy.cuda.Device(other).synchronize()
            ok = bool((y.get() == np.arange(x.size, dtype=np.float32) * 2).all())
            del y
        q_out.put(("done", ok, dev, other))
        q_in.get(timeout=TIMEOUT)  # the producer has checked our writes
        del x
    except Exception:
        q_out.put(("error", traceback.format_exc()))


def _numpy_shim():
    """numba-cuda (<= 0.30) overloads np.row_stack, removed in NumPy 2.5 (see test_numba_gpu)."""
    import numpy as np

    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack


def numba_open_on_second_gpu(q_in, q_out, n):
    """Open a PoolIpcHandle of GPU 0's memory in a Numba context on GPU 1; a kernel there
    reads and writes it."""
    try:
        _numpy_shim()
        import numpy as np
        from numba import cuda

        from cupy_poolmem import _device

        h = q_in.get(timeout=TIMEOUT)

        @cuda.jit
        def twice_plus_one(a):
            i = cuda.grid(1)
            if i < a.size:
                a[i] = a[i] * 2 + 1

        with cuda.gpus[1]:
            arr = h.open()
            twice_plus_one[(n + 255) // 256, 256](arr)
            cuda.synchronize()
            ok = np.array_equal(arr.copy_to_host(), np.arange(n, dtype=np.float32) * 2 + 1)
            del arr
            h.close()
        q_out.put(("ok", (ok, list(_device.granted_access().values()))))
    except BaseException:
        q_out.put(("err", traceback.format_exc()))


def numba_exporter(q_result, n):
    """Export Numba memory of GPU 0; a second child opens it on GPU 1 and writes it."""
    try:
        _numpy_shim()
        import multiprocessing as mp

        import numpy as np
        from numba import cuda

        import cupy_poolmem as cpm
        import cupy_poolmem.numba as cpn

        cuda.set_memory_manager(cpn.PoolmemNumbaManager)
        cpm.set_allocator(ipc=True)
        with cuda.gpus[0]:
            d = cuda.to_device(np.arange(n, dtype=np.float32))
            h = d.get_ipc_handle()
        ctx = mp.get_context("spawn")
        q_in, q_out = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=numba_open_on_second_gpu, args=(q_in, q_out, n))
        p.start()
        try:
            q_in.put(h)
            status, value = q_out.get(timeout=TIMEOUT)
        finally:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join(10)
        if status != "ok":
            q_result.put(("err", value))
            return
        with cuda.gpus[0]:
            back = np.array_equal(d.copy_to_host(), np.arange(n, dtype=np.float32) * 2 + 1)
        q_result.put(("ok", (*value, back)))
    except BaseException:
        q_result.put(("err", traceback.format_exc()))


SLOW_SUM = r"""
extern "C" __global__ void slow_sum(const float* x, int n, float* out, long long spin) {
    long long t0 = clock64();
    while (clock64() - t0 < spin) { }  // queued work that reads the memory later
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += x[i];
    atomicAdd(out, s);
}
"""


def revoke_while_a_kernel_will_read(conn):
    """GPU 1 queues a kernel that spins ~0.2 s, then reads GPU 0's pool memory; the
    parent of the kernel revokes GPU 1's access right after the launch.  Sends ("ok",
    sum) when the kernel read with access, or ("fault", error text).  Ends with os._exit
    (a fault breaks the context)."""
    try:
        _quiet()
        import cupy

        import cupy_poolmem as cpm

        n = 1 << 20
        pool = cpm.DevicePool(device=0, peer_access=[1])
        with cupy.cuda.Device(0), cupy.cuda.using_allocator(pool.malloc):
            x = cupy.ones(n, dtype=cupy.float32)
            cupy.cuda.Device(0).synchronize()
        with cupy.cuda.Device(1):
            out = cupy.zeros(1, dtype=cupy.float32)
            kern = cupy.RawKernel(SLOW_SUM, "slow_sum")
            spin = cupy.int64(400_000_000)  # cycles: about 0.2 s at 2 GHz
            kern((1,), (256,), (x, cupy.int32(n), out, spin))  # queued; reads later
        pool.peer_access = None  # must wait for the kernel before PROT_NONE
        try:
            with cupy.cuda.Device(1):
                total = float(out.get()[0])
            conn.send(("ok", total, pool.peer_access))
        except Exception as exc:
            conn.send(("fault", f"{type(exc).__name__}: {exc}", ()))
    except BaseException:
        conn.send(("error", traceback.format_exc(), ()))
    finally:
        conn.close()
        os._exit(0)
