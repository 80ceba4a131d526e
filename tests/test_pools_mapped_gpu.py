"""GPU tests of ``DevicePool(large_blocks="mapped")``: large blocks mapped one by one.

Every test checks data.  The ones that try to break the reuse rule free a block behind
a running kernel that writes it last, and check that no other stream got the block and
that it stayed mapped until the kernel ran (an early unmap faults the kernel).
"""

from __future__ import annotations

import gc
import random
from types import SimpleNamespace

import numpy as np
import pytest

import cupy_poolmem as cpm
from cupy_poolmem import _retire

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")

from support.waits import freed_behind_a_spin, spin, wait_for, warm_up  # noqa: E402

MiB = 1 << 20


def _mapped_pool(**kw):
    return cpm.DevicePool(large_blocks="mapped", **kw)


def test_large_blocks_are_mapped_hold_their_data_and_go_back_to_the_device():
    free0 = cupy.cuda.runtime.memGetInfo()[0]
    pool = _mapped_pool()
    with cpm.using(pool):
        sizes = (9, 17, 40, 100)
        xs = [cupy.arange(n * MiB // 4, dtype=cupy.int32) for n in sizes]
        small = cupy.arange(1024, dtype=cupy.int32)
        assert all(pool._backend.owns(x.data.ptr) for x in xs)
        assert not pool._backend.owns(small.data.ptr)
        for x in xs:
            assert (
                int(x[-1]) == x.size - 1
                and int(x.sum(dtype=cupy.int64)) == x.size * (x.size - 1) // 2
            )
        s = pool.stats()
        assert s.used_bytes == sum(x.nbytes for x in xs) + small.nbytes
        mapped = sum(-(-n // 2) * 2 for n in sizes) * MiB  # at the 2 MiB granularity
        assert s.reserved_bytes >= mapped and pool._backend.reserved == mapped
        del xs, x
        pool.trim()
        assert pool._backend.reserved == 0 and pool._backend.cached == 0
        y = cupy.full(33 * MiB // 4, 5, dtype=cupy.int32)  # a new mapping after the trim
        assert int(y.sum(dtype=cupy.int64)) == 5 * y.size
    pool.close()
    del y, small
    gc.collect()
    _retire.retirer().drain()  # (or its thread: it gives the blocks back after a sync)
    assert wait_for(lambda: pool._backend.reserved == 0)
    cupy.cuda.runtime.deviceSynchronize()
    assert cupy.cuda.runtime.memGetInfo()[0] >= free0 - 64 * MiB  # nothing mapped stays


def test_a_block_freed_behind_a_running_kernel_is_neither_given_to_another_stream_nor_unmapped():
    warm_up()
    pool = _mapped_pool(release_threshold=0)  # unmap every freed block as soon as it may
    s1, s2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    n = 48 * MiB // 4
    with cpm.using(pool):
        zp = freed_behind_a_spin(n, s1)
        assert pool._backend.owns(zp)  # not unmapped: its free has not run
        pool.trim(sync=False)
        assert pool._backend.owns(zp)
        with s2:
            w = cupy.empty(n, dtype=cupy.int32)
            w.fill(1)
        assert w.data.ptr != zp  # another stream: not the block still in use
        s2.synchronize()
        s1.synchronize()  # an unmap under the kernel would fault here
        assert int((w == 1).sum()) == n  # z's last write never landed in w
        with s1:
            v = cupy.empty(n, dtype=cupy.int32)  # its own stream, its free done: reusable
            assert v.data.ptr == zp or not pool._backend.owns(zp)
            v.fill(3)
        s1.synchronize()
        assert int((v == 3).sum()) == n
        del v, w
    pool.trim()
    assert pool._backend.reserved == 0
    pool.close()


def test_a_freed_block_is_reused_at_once_on_its_own_stream_in_stream_order():
    warm_up()
    pool = _mapped_pool()
    s1 = cupy.cuda.Stream(non_blocking=True)
    n = 24 * MiB // 4
    with cpm.using(pool), s1:
        a = cupy.zeros(n, dtype=cupy.int32)
        ap = a.data.ptr
        spin(200, s1)
        a.fill(9)
        del a
        b = cupy.empty(n - 1024, dtype=cupy.int32)  # within the fit: the same block
        assert b.data.ptr == ap and pool._backend.n_hits >= 1
        b.fill(4)  # ordered after the fill of 9 on the same stream
        s1.synchronize()
        assert int((b == 4).sum()) == b.size
        del b
    pool.close()


def test_a_destroyed_streams_handle_on_a_new_stream_gets_the_block_after_the_old_work():
    """The cache knows streams by handle.  A stream destroyed with its work still
    running, whose handle the driver gives the next stream: a block freed on the old
    one serves the new one at once, but its writes land after the old one's."""
    warm_up()
    pool = _mapped_pool(reuse_cache=0)  # frees straight to the mapped blocks' cache
    n = 24 * MiB // 4
    old = cupy.cuda.Stream(non_blocking=True)
    with cpm.using(pool):
        with old:
            z = cupy.zeros(n, dtype=cupy.int32)
        old.synchronize()
        zp, handle = z.data.ptr, old.ptr
        spin(300, old)
        with old:
            z.fill(7)  # the old stream's last write, after the spin
        del z  # freed on the old stream while the spin runs
        del old
        gc.collect()  # destroyed: its work still runs
        new, kept = None, []
        for _ in range(256):
            s = cupy.cuda.Stream(non_blocking=True)
            if s.ptr == handle:
                new = s
                break
            kept.append(s)
        if new is None:
            pool.close()
            pytest.skip("needs a driver that gives a new stream a destroyed one's handle")
        with new:
            w = cupy.empty(n, dtype=cupy.int32)
            assert w.data.ptr == zp  # the same handle: served at once...
            w.fill(1)  # ...but after the old stream's fill of 7
        new.synchronize()
        cupy.cuda.runtime.deviceSynchronize()
        assert int((w == 1).sum()) == n
        del w
    pool.close()


def test_a_capture_takes_graph_memory_and_its_launch_writes_it():
    pool = _mapped_pool()
    g = cupy.cuda.Stream(non_blocking=True)
    with cpm.using(pool), g:
        base = cupy.arange(20 * MiB // 4, dtype=cupy.int32)
        g.synchronize()
        g.begin_capture()
        a = cupy.empty_like(base)
        a[...] = base * 2
        graph = g.end_capture()
        assert not pool._backend.owns(a.data.ptr)  # graph memory, not a mapped block
        graph.launch(g)  # once: its memory is freed outside the graph (see the guide)
        g.synchronize()
        assert int((a == base * 2).sum()) == a.size
        del a, graph
    pool.close()


def test_out_of_memory_names_the_size_and_the_pool_keeps_working():
    pool = _mapped_pool()
    free, total = cupy.cuda.runtime.memGetInfo()
    with cpm.using(pool):
        # More than is free, less than the device has: the mapping itself fails.
        with pytest.raises(cpm.OutOfPoolMemoryError, match="DevicePool"):
            cupy.empty(free + (total - free) // 2, dtype=cupy.uint8)
        assert pool._backend.reserved == 0
        x = cupy.full(16 * MiB, 2, dtype=cupy.uint8)
        assert int(x.sum(dtype=cupy.int64)) == 32 * MiB
        del x
    pool.close()


def test_on_a_churn_what_is_reserved_follows_what_is_live():
    """Sizes 9-64 MiB freed out of order: a CUDA pool's 32 MiB chunks would pin far more."""
    rng = random.Random(3)
    pool = _mapped_pool()
    live: list = []
    held = peak_live = 0
    with cpm.using(pool):
        for step in range(400):
            size = rng.randrange(9 * MiB, 64 * MiB, 4096)
            while live and held + size > 512 * MiB:
                i = rng.randrange(len(live))
                held -= live[i][0].nbytes
                live[i] = live[-1]
                live.pop()
            a = cupy.full(size // 4, step, dtype=cupy.int32)
            live.append((a, step))
            held += a.nbytes
            peak_live = max(peak_live, held)
        for a, step in live:
            assert int((a == step).sum()) == a.size  # no block served two arrays
        be = pool._backend
        # Each block rounded to 2 MiB, up to a third larger when reused; freed blocks
        # kept while the blocks reserve at most the live peak plus a sixteenth (64 MiB
        # at least), a block beyond only when the freed ones had not run yet.
        assert be.live_high <= peak_live * 4 / 3 + 64 * MiB
        assert be.peak_reserved <= be.budget() + 64 * MiB
        assert be.n_hits > 0
        del live, a
    pool.close()


@pytest.mark.multigpu
def test_a_later_peer_grant_covers_mapped_blocks_already_there():
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 GPUs; this machine has 1")
    with _mapped_pool(device=0, peer_access=None) as p0, cpm.DevicePool(1) as p1:
        with cupy.cuda.Device(0), cpm.using(p0):
            a = cupy.arange(12 * MiB // 4, dtype=cupy.int32)
        assert p0._backend.owns(a.data.ptr)
        cupy.cuda.Device(0).synchronize()
        with pytest.raises(cpm.WrongDeviceError, match="mapped block"):
            cpm.check_access(a[1:], device=1)  # CuPy's peer access does not open it
        foreign = SimpleNamespace(__cuda_array_interface__=a[5:].__cuda_array_interface__)
        with pytest.raises(cpm.WrongDeviceError, match="mapped block"):
            cpm.check_access(foreign, device=1)  # a torch or Numba view of it alike
        p0.peer_access = [1]
        cpm.check_access(a[1:], device=1)
        with cupy.cuda.Device(1), cpm.using(p1):
            b = a * 2
            a[...] = -1
        cupy.cuda.Device(1).synchronize()
        assert (b.get() == np.arange(a.size, dtype=np.int32) * 2).all()
        assert (a.get() == -1).all()
        del a, b


def test_check_access_reads_a_mapped_blocks_grants_from_the_driver():
    """The driver's own word on a mapped block (cuMemGetAccess): read-write for its GPU."""
    with _mapped_pool() as p, cpm.using(p):
        a = cupy.arange(10 * MiB // 4, dtype=cupy.int32)
        view = a[1000:]
        blocks, block = _mapped_mod().mapped_block_of(view)
        assert blocks is p._backend and block == a.data.ptr
        rw = blocks._d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        assert int(blocks._access_flags(block, 0)) == int(rw)
        cpm.check_access(view, device=0)
        foreign = SimpleNamespace(__cuda_array_interface__=view.__cuda_array_interface__)
        found = _mapped_mod().mapped_block_of(foreign, view.data.ptr)
        assert found == (blocks, block)
        cpm.check_access(foreign, device=0)
        small = cupy.arange(1000, dtype=cupy.int32)  # from the CUDA pool: not a mapped block
        assert _mapped_mod().mapped_block_of(small) is None
        cpm.check_access(small, device=0)
        assert int(view[0]) == 1000 and int(small[-1]) == 999
        del a, view, small


def _mapped_mod():
    from cupy_poolmem import _mapped

    return _mapped
