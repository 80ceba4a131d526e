"""Multi-GPU tests of peer access: kernels on each GPU read and write the other's pool memory.

Every test checks data.  Work on one GPU that another GPU's memory depends on is
synchronised first: the default streams of two GPUs are not ordered with each other.
A kernel that reads memory its GPU was not granted would break the CUDA context for
the rest of the run, so that case runs only in a child process.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp

import numpy as np
import pytest

import cupy_poolmem as cpm
from cupy_poolmem import _device

pytestmark = [
    pytest.mark.multigpu,
    # CuPy warns "peer access has been activated automatically" on each cross-GPU use.
    pytest.mark.filterwarnings("ignore:.*[Pp]eer access"),
]

cupy = pytest.importorskip("cupy")

from support import peer_workers as W  # noqa: E402

TIMEOUT = 120
N = 1 << 20


@pytest.fixture
def restore_allocator():
    before = cupy.cuda.get_allocator()
    yield
    cupy.cuda.set_allocator(before)


def _sync(*devices):
    for d in devices or (0, 1):
        cupy.cuda.Device(d).synchronize()


def _capable_peers(owner):
    return tuple(
        d for d in range(cpm.device_count()) if d != owner and _device.can_access_peer(d, owner)
    )


def _join(p):
    p.join(TIMEOUT)
    if p.is_alive():
        p.kill()
        p.join(5)
        pytest.fail(f"child {p.name} did not finish")


@pytest.fixture(autouse=True)
def _need_a_peer_pair():
    if not (_device.can_access_peer(1, 0) and _device.can_access_peer(0, 1)):
        pytest.skip("GPUs 0 and 1 cannot access each other (cudaDeviceCanAccessPeer)")


# ---------------------------------------------------------------- kernels across GPUs
def test_kernels_on_each_gpu_read_and_write_the_others_arrays_under_set_allocator(
    restore_allocator,
):
    alloc = cpm.set_allocator()
    ref = np.arange(N, dtype=np.float32)
    with cupy.cuda.Device(0):
        a = cupy.asarray(ref)  # GPU 0's pool
    with cupy.cuda.Device(1):
        b = cupy.asarray(ref) * 2  # GPU 1's pool
    _sync()
    assert a.data.device_id == 0 and b.data.device_id == 1
    with cupy.cuda.Device(1):
        a += 1  # a kernel on GPU 1 writes GPU 0's memory
        c = a + b  # and reads both; c is GPU 1's
    _sync()
    with cupy.cuda.Device(0):
        b *= 3  # a kernel on GPU 0 writes GPU 1's memory
        d = b - a
    _sync()
    assert c.data.device_id == 1 and d.data.device_id == 0
    assert (a.get() == ref + 1).all()
    assert (b.get() == ref * 6).all()
    assert (c.get() == ref * 3 + 1).all()
    assert (d.get() == ref * 5 - 1).all()
    pools = alloc.pools()
    assert pools[0].peer_access == _capable_peers(0)
    assert pools[1].peer_access == _capable_peers(1)
    del a, b, c, d
    _sync()
    alloc.close()


def test_explicit_pools_grant_every_capable_gpu_by_default():
    with cpm.DevicePool(0) as p0, cpm.DevicePool(1) as p1:
        assert p0.peer_access == _capable_peers(0) and 1 in p0.peer_access
        assert p1.peer_access == _capable_peers(1) and 0 in p1.peer_access
        with cupy.cuda.Device(0), cpm.using(p0):
            a = cupy.arange(N, dtype=cupy.int64)
        with cupy.cuda.Device(1), cpm.using(p1):
            b = cupy.full(N, 7, dtype=cupy.int64)
        _sync()
        with cupy.cuda.Device(1), cpm.using(p1):
            b += a  # GPU 1 reads GPU 0's pool
            a -= 1  # and writes it
        _sync()
        with cupy.cuda.Device(0), cpm.using(p0):
            total = b.sum()  # GPU 0 reads GPU 1's pool
            cupy.cuda.Device(0).synchronize()
        ref = np.arange(N, dtype=np.int64)
        assert (a.get() == ref - 1).all()
        assert (b.get() == ref + 7).all()
        assert int(total) == int((ref + 7).sum())
        assert p0.stats().n_allocs >= 2 and p1.stats().n_allocs >= 1
        del a, b, total
        _sync()


def test_none_refuses_up_front_and_a_later_grant_covers_memory_already_there():
    with cpm.DevicePool(0, peer_access=None) as p0, cpm.DevicePool(1, peer_access=None) as p1:
        assert p0.peer_access == () and p1.peer_access == ()
        with cupy.cuda.Device(0), cpm.using(p0):
            a = cupy.arange(N, dtype=cupy.float32)
        _sync(0)
        with pytest.raises(cpm.WrongDeviceError, match="GPU 0 is not accessible from GPU 1"):
            cpm.check_access(a, device=1)
        with cupy.cuda.Device(1), pytest.raises(cpm.WrongDeviceError, match="peer_access"):
            cpm.check_access(a)  # the current device
        cpm.check_access(a, device=0)

        p0.peer_access = [1]  # after the allocation: it covers `a` too
        assert p0.peer_access == (1,)
        cpm.check_access(a, device=1)
        with cupy.cuda.Device(1), cpm.using(p1):
            b = a * 2
            a[...] = -1.0
        _sync()
        assert (b.get() == np.arange(N, dtype=np.float32) * 2).all()
        assert (a.get() == -1.0).all()

        p0.peer_access = None  # revoke (nothing on GPU 1 uses `a` now)
        assert p0.peer_access == ()
        with pytest.raises(cpm.WrongDeviceError):
            cpm.check_access(a, device=1)
        p0.peer_access = "all"  # and grant again: the data is where it was
        with cupy.cuda.Device(1), cpm.using(p1):
            c = a + 3
        _sync()
        assert (c.get() == 2.0).all()
        del a, b, c
        _sync()


def test_set_allocator_peer_access_none_and_bad_values(restore_allocator):
    alloc = cpm.set_allocator(peer_access=None)
    assert cpm.get_pool(0).peer_access == () and cpm.get_pool(1).peer_access == ()
    with cupy.cuda.Device(1):
        x = cupy.ones(1000)
    _sync(1)
    with pytest.raises(cpm.WrongDeviceError, match="GPU 1 is not accessible from GPU 0"):
        cpm.check_access(x, device=0)
    del x
    _sync(1)
    alloc.close()
    n = cpm.device_count()
    with pytest.raises(cpm.InvalidOptionError, match=f"device {n}"):
        cpm.set_allocator(peer_access=[n])
    with pytest.raises(cpm.InvalidOptionError):
        cpm.set_allocator(peer_access="every")
    alloc = cpm.set_allocator(peer_access=[1])
    assert cpm.get_pool(0).peer_access == (1,) and cpm.get_pool(1).peer_access == ()
    alloc.close()


def test_constructor_values():
    with cpm.DevicePool(0, peer_access=[1]) as p:
        assert p.peer_access == (1,)
    with cpm.DevicePool(0, peer_access=[0]) as p:  # its own GPU: nothing to grant
        assert p.peer_access == ()
    with cpm.DevicePool(1, peer_access=[cupy.cuda.Device(0)]) as p:
        assert p.peer_access == (0,)
    with pytest.raises(cpm.InvalidOptionError):
        cpm.DevicePool(0, peer_access=[cpm.device_count()])
    with pytest.raises(cpm.OptionTypeError, match=r"\[1\]"):
        cpm.DevicePool(0, peer_access=1)


def test_a_new_pool_grants_only_what_it_asks_for():
    """A destroyed pool's handle may come back with its grants (nvbug 5698116)."""
    for _ in range(5):
        with cpm.DevicePool(0, peer_access="all") as p:
            assert p.peer_access == _capable_peers(0)
        with cpm.DevicePool(0, peer_access=None) as q:
            assert q.peer_access == ()


# ---------------------------------------------------------------- copies across GPUs
def test_copies_between_gpus(restore_allocator):
    alloc = cpm.set_allocator()
    ref = np.arange(N, dtype=np.int64) * 3
    with cupy.cuda.Device(0):
        x = cupy.asarray(ref)
    _sync(0)
    with cupy.cuda.Device(1):
        copied = x.copy()  # a peer memory copy
        arrayed = cupy.array(x)  # a kernel on GPU 1 reading x
        assigned = cupy.empty(N, dtype=cupy.int64)
        assigned[...] = x  # likewise
        memcpy = cupy.empty(N, dtype=cupy.int64)
        memcpy.data.copy_from_device(x.data, x.nbytes)
        peer = cupy.empty(N, dtype=cupy.int64)
        cupy.cuda.runtime.memcpyPeer(peer.data.ptr, 1, x.data.ptr, 0, x.nbytes)
    _sync()
    for name, arr in [
        ("copy", copied),
        ("array", arrayed),
        ("setitem", assigned),
        ("copy_from_device", memcpy),
        ("memcpyPeer", peer),
    ]:
        assert (arr.get() == ref).all(), name
    assert assigned.data.device_id == 1 and peer.data.device_id == 1
    with cupy.cuda.Device(0):  # and back: GPU 0 copies from GPU 1's pool
        back = cupy.empty(N, dtype=cupy.int64)
        back[...] = assigned
        back2 = peer.copy()
    _sync()
    assert (back.get() == ref).all() and (back2.get() == ref).all()
    del x, copied, arrayed, assigned, memcpy, peer, back, back2
    _sync()
    alloc.close()


# ---------------------------------------------------------------- pinned and managed
def test_pinned_pool_devices_is_its_access_rule():
    cupyx = pytest.importorskip("cupyx")
    with cpm.PinnedPool(devices=[0]) as only0, cpm.PinnedPool() as every:
        with cpm.using(only0):
            h0 = cupyx.empty_pinned((N,), dtype=np.float32)
        with cpm.using(every):
            h1 = cupyx.empty_pinned((N,), dtype=np.float32)
        h0[:] = np.arange(N, dtype=np.float32)
        h1[:] = h0
        cpm.check_access(h0, device=0)
        with pytest.raises(cpm.WrongDeviceError, match="PinnedPool"):
            cpm.check_access(h0, device=1)
        cpm.check_access(h1, device=1)
        with cupy.cuda.Device(1):  # copies still work without the grant (staged)
            d0 = cupy.asarray(h0)
            d1 = cupy.asarray(h1)
            cupy.cuda.Device(1).synchronize()
            assert (d0.get() == h0).all() and (d1.get() == h1).all()
            del d0, d1
        del h0, h1


def test_managed_pool_memory_is_used_from_the_other_gpu():
    free = cupy.cuda.Device(0).mem_info[0]
    n = min(N, free // 64)
    with cpm.ManagedPool(device=0) as mp_, cpm.DevicePool(1) as p1:
        with cupy.cuda.Device(0), cpm.using(mp_):
            x = cupy.arange(n, dtype=cupy.float32)
        _sync(0)
        cpm.check_access(x, device=1)  # managed memory: every GPU
        with cupy.cuda.Device(1), cpm.using(p1):
            x *= 2  # GPU 1 writes the managed pages
            y = x + 1
        _sync()
        assert (y.get() == np.arange(n, dtype=np.float32) * 2 + 1).all()
        with cupy.cuda.Device(0):
            assert (x.get() == np.arange(n, dtype=np.float32) * 2).all()
        del x, y
        _sync()


# ---------------------------------------------------------------- child processes
@contextlib.contextmanager
def _spawned(target):
    """A spawned child running ``target(conn)``; yields ``recv(what)``, which waits up to
    TIMEOUT for the child's next message.  The child is joined on exit."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=target, args=(b,))
    p.start()
    b.close()

    def recv(what: str = "nothing"):
        assert a.poll(TIMEOUT), f"the child sent {what}"
        return a.recv()

    try:
        yield recv
    finally:
        _join(p)


def test_without_a_grant_a_kernel_on_the_other_gpu_faults_and_check_access_says_so_first():
    """What ``peer_access=None`` protects against, run where a fault cannot hurt."""
    with _spawned(W.kernel_without_grant) as recv:
        msg = recv()
        assert msg == ("checked", "WrongDeviceError"), msg
        tag, value = recv("no result")
        assert tag == "fault", (tag, value)  # "ran" would mean pool memory is mapped anyway
        assert "cudaError" in value or "CUDA_ERROR" in value, value


def test_received_array_is_used_from_a_second_gpu_in_the_receiver(restore_allocator):
    """Needs the sharing importer to grant access (``_device.ensure_peer_access``)."""
    cpm.set_allocator()
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=W.use_on_second_gpu, args=(q_in, q_out))
    p.start()
    try:
        with cupy.cuda.Device(0):
            x = cupy.arange(N, dtype=cupy.float32)
            q_in.put(x)
        msg = q_out.get(timeout=TIMEOUT)
        assert msg[0] == "done", msg[1]
        _, ok, dev, other = msg
        assert ok and (dev, other) == (0, 1)
        assert (x.get() == -np.arange(N, dtype=np.float32)).all()  # written from GPU 1
    finally:
        q_in.put(None)
        _join(p)


def test_numba_handle_opened_on_the_second_gpu_gets_its_grant_once():
    pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    n = 1 << 20
    p = ctx.Process(target=W.numba_exporter, args=(q, n))
    p.start()
    try:
        status, value = q.get(timeout=2 * TIMEOUT)
    finally:
        _join(p)
    assert status == "ok", value
    ok, grants, written_back = value
    assert ok  # a Numba kernel on GPU 1 read and wrote GPU 0's memory
    # One imported pool, granted once to every GPU that can reach GPU 0 (GPU 1 among them).
    assert grants == [_capable_peers(0)] and 1 in grants[0]
    assert written_back  # the exporter sees the writes


def test_revoking_a_gpu_lets_its_queued_kernel_finish_reading_first():
    """``pool.peer_access = None`` while GPU 1 has a kernel queued that reads the pool's
    memory: the kernel reads with access (the right sum), and the grant is gone after."""
    with _spawned(W.revoke_while_a_kernel_will_read) as recv:
        tag, value, peers = recv()
        assert tag == "ok", value
        assert value == float(1 << 20)
        assert peers == ()
