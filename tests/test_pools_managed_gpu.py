"""GPU tests of ManagedPool's backends: advice and prefetch on the memory it hands out,
for one array and for collections, and stream-ordered reuse of cuMemAllocManaged blocks.
Sizes stay far below the GPU's free memory (never oversubscribe managed memory)."""

from __future__ import annotations

import numpy as np
import pytest

import cupy_poolmem as cpm

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")

from support.waits import spin, warm_up  # noqa: E402


def _small_enough(nbytes: int) -> None:
    free = cupy.cuda.Device().mem_info[0]
    assert nbytes < free // 8, "managed test allocations must stay far below free memory"


def _last_prefetch_location(arr) -> int:
    from cuda.bindings import driver

    err, v = driver.cuMemRangeGetAttribute(
        4,
        driver.CUmem_range_attribute.CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION,
        arr.data.ptr,
        arr.nbytes,
    )
    assert int(err) == 0
    return int(v)


def _pool(backend: str):
    try:
        return cpm.ManagedPool(backend=backend)
    except cpm.UnsupportedError as e:  # backend="pool" without CUDA 13
        pytest.skip(str(e))


@pytest.mark.parametrize("backend", ["auto", "managed", "pool"])
def test_advice_and_prefetch_work_on_the_pools_memory(backend):
    import cuda.core as cc

    n = 1 << 20
    _small_enough(4 * n * 4)
    with _pool(backend) as p, cpm.using(p):
        assert p.backend in ("pool", "managed") and p.backend_reason
        x = cupy.arange(n, dtype=cupy.float32)
        try:
            cpm.advise(x, preferred_location=0, accessed_by=[0], read_mostly=False)
        except cpm.UnsupportedError as e:
            # Only a forced pool backend on a driver that refuses: auto never picks it there.
            assert backend == "pool" and "backend='managed'" in str(e)
            assert cpm.managed_backend(0)[0] == "managed"
            cpm.prefetch(x, device="cpu")
            cupy.cuda.get_current_stream().synchronize()
            assert float(x[12345]) == 12345.0
            return
        buf = cc.ManagedBuffer.from_handle(x.data.ptr, x.nbytes, owner=x)
        assert buf.preferred_location == cc.Device(0)
        assert cc.Device(0) in buf.accessed_by and not buf.read_mostly
        cpm.advise(x[1000:], preferred_location="cpu", read_mostly=True)
        assert cc.ManagedBuffer.from_handle(x.data.ptr + 8192, 4096, owner=x).read_mostly
        cpm.prefetch(x, device="cpu")
        cupy.cuda.get_current_stream().synchronize()
        assert _last_prefetch_location(x) == -1  # CU_DEVICE_CPU
        cpm.prefetch(x, device=0)
        assert float(x.sum()) == float(np.arange(n, dtype=np.float64).sum())
        assert _last_prefetch_location(x) == 0
        # The hints go with the array: the next array on the block starts clean.
        ptr = x.data.ptr
        del x, buf
        y = cupy.empty(n, dtype=cupy.float32)
        assert y.data.ptr == ptr  # the reuse cache gave the block back
        buf = cc.ManagedBuffer.from_handle(y.data.ptr, y.nbytes, owner=y)
        assert not buf.read_mostly and cc.Device(0) not in buf.accessed_by
        assert buf.preferred_location == cc.Device(0)
        del y, buf


def test_advise_and_prefetch_a_models_parameters_in_one_call():
    shapes = {"embed": (512, 256), "w1": (256, 1024), "b1": (1024,), "w2": (1024, 256)}
    _small_enough(sum(int(np.prod(s)) for s in shapes.values()) * 4 * 2)
    s1 = cupy.cuda.Stream(non_blocking=True)
    with cpm.ManagedPool() as p, cpm.using(p):
        params = {
            k: cupy.full(shape, i + 1, dtype=cupy.float32)
            for i, (k, shape) in enumerate(shapes.items())
        }
        cupy.cuda.get_current_stream().synchronize()
        cpm.advise(params, preferred_location=0, accessed_by=[0])
        cpm.advise(list(params.values()), read_mostly=True)
        cpm.prefetch(params, device="cpu", stream=s1)
        s1.synchronize()  # one sync for the whole collection
        assert all(_last_prefetch_location(a) == -1 for a in params.values())
        cpm.prefetch(tuple(params.values()), device=0, stream=s1)
        s1.synchronize()
        assert all(_last_prefetch_location(a) == 0 for a in params.values())
        for i, a in enumerate(params.values()):
            assert float(a.sum()) == (i + 1) * a.size
        with pytest.raises(cpm.InvalidOptionError, match=r"item \['plain'\]"):
            with cupy.cuda.using_allocator(None):
                plain = cupy.ones(4)
            cpm.prefetch({**params, "plain": plain}, device=0)


def test_managed_backend_reuses_a_block_on_another_stream_only_after_its_work():
    n = 1 << 22
    _small_enough(3 * n * 4)
    # Load the test's kernels first (outside the pool): a module load synchronises the
    # context, which would let the spin end before the free it is there to delay.
    warm_up()
    t = cupy.full(16, 5, dtype=cupy.int32)
    assert int((t * 2).sum()) == 160
    del t
    a = cupy.cuda.Stream(non_blocking=True)
    b = cupy.cuda.Stream(non_blocking=True)
    with cpm.ManagedPool(backend="managed", reuse_cache=0) as p, cpm.using(p):
        with a:
            x = cupy.full(n, 5, dtype=cupy.int32)
        a.synchronize()
        ptr = x.data.ptr
        spin(300, a)
        with a:
            y = x * 2  # reads x behind the spin
        del x  # freed on a: its block waits behind a's work
        with b:
            z = cupy.full(n, -1, dtype=cupy.int32)  # another stream: not x's block yet
        assert z.data.ptr != ptr
        a.synchronize()
        b.synchronize()
        assert (y.get() == 10).all() and (z.get() == -1).all()
        with b:
            w = cupy.zeros(n, dtype=cupy.int32)  # a's work is done: x's block is reused
        assert w.data.ptr == ptr
        st = p.stats()
        assert st.kind == "managed" and st.reserved_bytes >= st.used_bytes >= 3 * n * 4
        del y, z, w
        cupy.cuda.runtime.deviceSynchronize()
        assert p.trim() >= 3 * n * 4 and p.stats().reserved_bytes == 0


def test_managed_backend_out_of_memory_and_max_size():
    with cpm.ManagedPool(backend="managed", max_size="8MiB") as p, cpm.using(p):
        a = cupy.empty(6 << 20, dtype=cupy.uint8)
        with pytest.raises(cpm.OutOfPoolMemoryError):
            cupy.empty(6 << 20, dtype=cupy.uint8)
        del a
        b = cupy.ones(6 << 20, dtype=cupy.uint8)  # fits again
        assert int(b.sum()) == 6 << 20


def test_doctor_names_the_managed_backend():
    from cupy_poolmem._doctor import doctor

    lines: list[str] = []
    doctor(out=lines.append, check=False)
    rows = [ln for ln in lines if "managed backend" in ln]
    assert rows and all(("'pool'" in r or "'managed'" in r) for r in rows)
    backend, reason = cpm.managed_backend(0)
    assert f"{backend!r} ({reason})" in rows[0]


@pytest.mark.parametrize("backend", ["auto", "managed"])
def test_a_managed_backend_fallback_is_logged_only_when_auto_falls_back(backend, caplog):
    """INFO on the "cupy_poolmem" logger when backend="auto" takes "managed", with the
    reason; nothing for the backend asked for by name, nor for "auto" taking "pool"."""
    import logging

    caplog.set_level(logging.INFO, logger="cupy_poolmem")
    with _pool(backend) as p, cpm.using(p):
        a = cupy.arange(1024, dtype=cupy.float32)
        assert float(a[-1].get()) == 1023.0  # the pool's memory works
        del a
        msgs = [r.getMessage() for r in caplog.records if "ManagedPool on device" in r.getMessage()]
        if backend == "auto" and p.backend != "pool":
            assert msgs == [
                f"ManagedPool on device {p.device_id}: fallback to backend 'managed': "
                f"{p.backend_reason}"
            ]
        else:
            assert msgs == []
