"""GPU tests of the steps of expandable and mapped blocks travelling between processes
(issue 35): first the export, mapping and book of ``cupy_poolmem._sharing._steps`` with
the real driver; then, at the end of this file, arrays pickled through multiprocessing
(the reducer, the claim that names the steps held, descriptors over the socket).

The exporter is this process: an exportable ``DevicePool(large_blocks="expandable",
ipc=True)`` (the test-only opt-in ``CUPY_POOLMEM_EXPERIMENTAL_STEP_IPC=1``); receivers
are spawned processes (tests/support/step_workers.py) that map exactly the steps under
a block and check its data.  Every child is joined with a timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing.reduction import recv_handle, send_handle

import pytest

import cupy_poolmem as cpm
from cupy_poolmem._experimental import STEP_IPC_ENV

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")

from support import step_workers as W  # noqa: E402
from support.waits import join  # noqa: E402

MiB = 1 << 20
TIMEOUT = 120


@pytest.fixture
def exporter(monkeypatch):
    """``(pool, blocks, book)``: an exportable expandable pool on GPU 0 whose ranges ask
    the book before unmapping a step."""
    from cuda.bindings import driver

    from cupy_poolmem._sharing._steps import StepExports

    monkeypatch.setenv(STEP_IPC_ENV, "1")
    pool = cpm.DevicePool(device=0, large_blocks="expandable", ipc=True)
    blocks = pool._backend
    book = StepExports(driver)
    blocks.set_pins(book.pins_for(blocks))
    yield pool, blocks, book
    cupy.cuda.Device(0).synchronize()
    pool.close()


class Receiver:
    """A spawned receiver and the exporter's side of its claims."""

    def __init__(self, ctx, cid: int, device: int = 0, peers=(), read_on=None):
        self.cid = cid
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=W.receiver, args=(child, device, tuple(peers), read_on))
        self.proc.start()
        child.close()

    def ask(self, *msg):
        self.conn.send(msg)
        if not self.conn.poll(TIMEOUT):
            pytest.fail(f"receiver {self.cid} did not answer {msg[0]}")
        reply = self.conn.recv()
        assert reply[0] != "error", reply[1]
        return reply

    def send(self, blocks, book, x, owner="exp"):
        """Claim and map the block of array ``x``: ``(index, receiver's reserved bytes)``."""
        ptr, size = x.data.ptr, x.nbytes
        steps = blocks.steps_under(ptr, size)
        have = self.ask("have", owner)[1]
        grants = book.grant(self.cid, blocks, ptr, size, steps, have)
        W.send_block(self.conn, self.proc.pid, owner, ptr, size, grants)
        if not self.conn.poll(TIMEOUT):
            pytest.fail("no answer to map")
        reply = self.conn.recv()
        assert reply[0] == "mapped", reply
        return reply[1], reply[2], steps

    def check(self, i, x, base):
        """Whether block ``i`` holds ``base + arange`` where array ``x`` lies."""
        return self.check_at(i, x.data.ptr, x.size, base)

    def check_at(self, i, ptr, n, base):
        return self.ask("check", i, ptr, n, base)[1]

    def close(self):
        try:
            self.conn.send(None)
        except OSError:
            pass
        join(self.proc, timeout=TIMEOUT)


def _fill(pool, n, base):
    """An int32 array of ``n`` items on ``pool`` holding ``base + arange(n)``; the only
    block it takes from the pool is its own (temporaries come from CuPy's pool)."""
    with cpm.using(pool):
        x = cupy.empty(n, dtype=cupy.int32)
    x[...] = cupy.arange(n, dtype=cupy.int32) + base
    cupy.cuda.Device(0).synchronize()
    return x


def test_blocks_of_many_sizes_across_step_boundaries_read_in_another_process(exporter):
    pool, blocks, book = exporter
    ctx = mp.get_context("spawn")
    r = Receiver(ctx, 1)
    try:
        sizes = [1, 1000, 250_000, 262_144, 300_000, 5 * MiB // 4, 21 * MiB // 4, 47 * MiB // 4]
        live = []
        windows: dict = {}  # step ids -> bytes: what the receiver may reserve, no more
        crossing = 0
        for k, n in enumerate(sizes * 2):
            x = _fill(pool, n, 1000 * k)
            i, reserved, steps = r.send(blocks, book, x)
            windows[tuple(s[0] for s in steps)] = sum(s[2] for s in steps)
            crossing += len(steps) > 1
            # exactly the steps under its blocks: never a whole-GPU range
            assert reserved == sum(windows.values()) < 1 << 30, (n, k)
            assert r.check(i, x, 1000 * k), (n, k)
            live.append((i, x, 1000 * k))
        assert crossing, "no block crossed a step boundary"
        for i, x, base in live:  # still all there
            assert r.check(i, x, base)
        st = r.ask("stats")[1]
        mapped_steps = {s for i, x, _b in live for s in blocks.steps_under(x.data.ptr, x.nbytes)}
        assert st["step_handles"] == len(mapped_steps)  # each step imported once
        for i, x, _b in live:
            r.ask("unmap", i)
            book.unmapped(1, blocks, [s[0] for s in blocks.steps_under(x.data.ptr, x.nbytes)])
        assert r.ask("stats")[1] == {
            "step_windows": 0,
            "step_handles": 0,
            "step_reserved_bytes": 0,
        }
    finally:
        r.close()


def test_a_block_spanning_several_steps_reads_and_writes_both_ways(exporter):
    pool, blocks, book = exporter
    n = 30 * MiB // 4
    a, b = _fill(pool, n, 1), _fill(pool, n, 2)
    keep = _fill(pool, n, 3)
    a_ptr = a.data.ptr
    del a, b
    big = _fill(pool, 2 * n, 7)
    assert big.data.ptr == a_ptr
    steps = blocks.steps_under(big.data.ptr, big.nbytes)
    assert len(steps) >= 2
    ctx = mp.get_context("spawn")
    r = Receiver(ctx, 1)
    try:
        i, reserved, _ = r.send(blocks, book, big)
        assert reserved == sum(s[2] for s in steps)  # exactly the steps under it
        assert r.check(i, big, 7)
        r.ask("write", i, big.data.ptr, big.size, 99)  # the receiver writes back
        assert bool((big == cupy.arange(big.size, dtype=cupy.int32) + 99).all())
        assert bool((keep == cupy.arange(n, dtype=cupy.int32) + 3).all())  # its neighbour
    finally:
        r.close()


def test_sixty_four_receivers_map_one_block_and_each_checks_it(exporter):
    pool, blocks, book = exporter
    x = _fill(pool, 3 * MiB // 4, 11)
    ctx = mp.get_context("spawn")
    rs = [Receiver(ctx, c) for c in range(1, 65)]
    try:
        for r in rs:
            i, reserved, steps = r.send(blocks, book, x)
            assert reserved == sum(s[2] for s in steps)
        for r in rs:
            assert r.check(0, x, 11)
        assert book.receivers(blocks, steps[0][0]) == set(range(1, 65))
    finally:
        for r in rs:
            r.close()


def test_a_trim_under_receivers_and_a_sigkilled_receiver_never_reuse_a_mapped_step(exporter):
    pool, blocks, book = exporter
    ctx = mp.get_context("spawn")
    r1, r2 = Receiver(ctx, 1), Receiver(ctx, 2)
    try:
        shared = _fill(pool, 25 * MiB // 4, 5)
        i1, _, steps = r1.send(blocks, book, shared)
        i2, _, _ = r2.send(blocks, book, shared)
        for round_ in range(4):  # trim and reallocate around the mapped block
            sizes = (3 * MiB, 41 * MiB, MiB, 23 * MiB)
            extra = [_fill(pool, n // 4, 100 * round_ + k) for k, n in enumerate(sizes)]
            for k, y in enumerate(extra):
                assert bool((y == cupy.arange(y.size, dtype=cupy.int32) + 100 * round_ + k).all())
            del extra, y
            cupy.cuda.Device(0).synchronize()
            pool.trim()
            for va in [s[1] for s in steps]:
                assert blocks.step_ids.get(va) in [s[0] for s in steps]  # still mapped
            assert r1.check(i1, shared, 5) and r2.check(i2, shared, 5)
        r1.proc.kill()  # SIGKILL while it maps
        join(r1.proc, timeout=TIMEOUT)
        book.drop_peer(1)  # what the exporter's reaping does once the process is gone
        assert r2.check(i2, shared, 5)
        del shared
        cupy.cuda.Device(0).synchronize()
        pool.trim()
        assert all(blocks.step_ids.get(s[1]) == s[0] for s in steps)  # r2 still maps them
        r2.ask("unmap", i2)
        book.unmapped(2, blocks, [s[0] for s in steps])
        pool.trim()
        assert not any(blocks.step_ids.get(s[1]) == s[0] for s in steps)  # now they went
        assert blocks.reserved == 0
    finally:
        r1.close()
        r2.close()


@pytest.mark.multigpu
def test_a_receiver_reads_the_block_from_the_other_gpu_with_the_senders_grant(exporter):
    pool, blocks, book = exporter
    x = _fill(pool, 5 * MiB // 4, 21)
    ctx = mp.get_context("spawn")
    r = Receiver(ctx, 1, device=0, peers=(1,), read_on=1)
    try:
        i, _, _ = r.send(blocks, book, x)
        assert r.check(i, x, 21)
    finally:
        r.close()


@pytest.mark.multigpu
def test_a_block_on_the_second_gpu_is_read_by_a_receiver_there(monkeypatch):
    from cuda.bindings import driver

    from cupy_poolmem._sharing._steps import StepExports

    monkeypatch.setenv(STEP_IPC_ENV, "1")
    pool = cpm.DevicePool(device=1, large_blocks="expandable", ipc=True)
    book = StepExports(driver)
    ctx = mp.get_context("spawn")
    r = Receiver(ctx, 1, device=1)
    try:
        with cupy.cuda.Device(1):
            with cpm.using(pool):
                x = cupy.empty(3 * MiB // 4, dtype=cupy.int32)
            x[...] = cupy.arange(x.size, dtype=cupy.int32) + 31
            cupy.cuda.Device(1).synchronize()
            i, _, _ = r.send(pool._backend, book, x)
            assert r.check(i, x, 31)
            del x
    finally:
        r.close()
        with cupy.cuda.Device(1):
            cupy.cuda.Device(1).synchronize()
            pool.close()


def test_a_receivers_mapping_outlives_an_exporter_that_exits():
    ctx = mp.get_context("spawn")
    r = Receiver(ctx, 1)
    e_conn, child = ctx.Pipe()
    e = ctx.Process(target=W.short_lived_exporter, args=(child, 0, os.getpid(), 1 << 20, 41))
    e.start()
    child.close()
    try:
        assert e_conn.poll(TIMEOUT), "the exporter sent nothing"
        msg = e_conn.recv()
        assert msg[0] == "map", msg
        _, owner, ptr, size, steps = msg
        fds = [recv_handle(e_conn) for _s, has in steps if has]
        assert e_conn.recv() == ("sent",)
        r.conn.send(msg)  # relayed: the descriptors go on from here
        for fd in fds:
            send_handle(r.conn, fd, r.proc.pid)
            os.close(fd)
        assert r.conn.poll(TIMEOUT)
        assert r.conn.recv()[0] == "mapped"
        e_conn.send("go")
        join(e, timeout=TIMEOUT)
        assert not e.is_alive()
        assert r.check_at(0, ptr, 1 << 20, 41)  # read after its exporter is gone
    finally:
        if e.is_alive():
            e.kill()
            e.join(10)
        r.close()


# -- the pickled-array path: arrays sent through multiprocessing, mapped as steps ----------
@pytest.mark.parametrize("mode", ["expandable", "mapped"])
def test_an_array_of_a_mapped_or_expandable_ipc_pool_travels_over_a_pipe(monkeypatch, mode):
    from support import mp_workers as MW

    import cupy_poolmem._sharing  # noqa: F401  (the reducer for cupy.ndarray)

    monkeypatch.setenv(STEP_IPC_ENV, "1")
    pool = cpm.DevicePool(large_blocks=mode, ipc=True)
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=MW.pipe_worker, args=(b,))
    p.start()
    try:
        with cpm.using(pool):
            x = cupy.arange(3 << 20, dtype=cupy.float32)  # 12 MiB: mapped above 8 MiB
        cupy.cuda.Device(0).synchronize()
        a.send(("x", x[3::2]))  # pickled here, in this thread
        assert a.poll(TIMEOUT)
        reply = a.recv()
        assert reply[0] == "x", reply
        assert (reply[-1] == cupy.asnumpy(x[3::2])).all()
    finally:
        a.send(None)
        join(p, timeout=TIMEOUT)
        del x
        cupy.cuda.Device(0).synchronize()
        pool.close()


class Pickled:
    """A spawned receiver of pickled arrays (tests/support/step_workers.pickled_receiver)."""

    def __init__(self, ctx, read_on=None):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=W.pickled_receiver, args=(child, read_on))
        self.proc.start()
        child.close()

    def ask(self, *msg):
        self.conn.send(msg)
        if not self.conn.poll(TIMEOUT):
            pytest.fail(f"the receiver did not answer {msg[0]}")
        reply = self.conn.recv()
        assert reply[0] != "error", reply[1]
        return reply

    def close(self):
        try:
            self.conn.send(None)
        except OSError:
            pass
        join(self.proc, timeout=TIMEOUT)


@pytest.fixture
def step_pool(monkeypatch):
    import cupy_poolmem._sharing  # noqa: F401  (the reducer for cupy.ndarray)

    monkeypatch.setenv(STEP_IPC_ENV, "1")
    pool = cpm.DevicePool(device=0, large_blocks="expandable", ipc=True)
    yield pool
    cupy.cuda.Device(0).synchronize()
    pool.close()


def test_pickled_arrays_of_many_sizes_across_step_boundaries_read_in_another_process(step_pool):
    pool = step_pool
    blocks = pool._backend
    r = Pickled(mp.get_context("spawn"))
    try:
        sizes = [1, 1000, 250_000, 262_144, 300_000, 5 * MiB // 4, 21 * MiB // 4, 47 * MiB // 4]
        live, windows, crossing = [], {}, 0
        for k, n in enumerate(sizes * 2):
            x = _fill(pool, n, 1000 * k)
            steps = blocks.steps_under(x.data.ptr, x.nbytes)
            windows[tuple(s[0] for s in steps)] = sum(s[2] for s in steps)
            crossing += len(steps) > 1
            _, ok, reserved, _n = r.ask("x", x, 1000 * k)
            assert ok, (n, k)
            # exactly the steps under the blocks it holds: never a whole-GPU range
            assert reserved == sum(windows.values()) < 1 << 30, (n, k)
            live.append((len(live), x, 1000 * k))
        assert crossing, "no block crossed a step boundary"
        for i, _x, base in live:  # all still there
            assert r.ask("check", i, base)[1]
        assert r.ask("drop")[1:] == (0, 0)  # every window unmapped, nothing reserved
        del live, x
        cupy.cuda.Device(0).synchronize()
        ctx = cupy_poolmem_context()
        assert join_until(lambda: ctx.exporter.stats()["leases"] == 0)
        pool.trim()
        assert blocks.reserved == 0  # nothing pinned any more
    finally:
        r.close()


def cupy_poolmem_context():
    from cupy_poolmem._sharing._context import context

    return context()


def join_until(pred, timeout: float = 30.0) -> bool:
    from support.waits import wait_for

    return wait_for(pred, timeout)


def test_a_pickled_block_spanning_several_steps_is_read_whole(step_pool):
    pool = step_pool
    blocks = pool._backend
    n = 30 * MiB // 4
    a, b = _fill(pool, n, 1), _fill(pool, n, 2)
    keep = _fill(pool, n, 3)  # noqa: F841  (the range cannot shrink under a and b)
    a_ptr = a.data.ptr
    del a, b
    big = _fill(pool, 2 * n, 7)
    assert big.data.ptr == a_ptr
    steps = blocks.steps_under(big.data.ptr, big.nbytes)
    assert len(steps) >= 2
    r = Pickled(mp.get_context("spawn"))
    try:
        _, ok, reserved, windows = r.ask("x", big, 7)
        assert ok and windows == 1 and reserved == sum(s[2] for s in steps)
    finally:
        r.close()


def test_sigkilled_receivers_while_the_exporter_trims_and_reallocates_see_no_reuse(step_pool):
    pool = step_pool
    blocks = pool._backend
    ctx = mp.get_context("spawn")
    r1, r2 = Pickled(ctx), Pickled(ctx)
    try:
        shared = _fill(pool, 25 * MiB // 4, 5)
        steps = blocks.steps_under(shared.data.ptr, shared.nbytes)
        assert r1.ask("x", shared, 5)[1] and r2.ask("x", shared, 5)[1]
        r1.proc.kill()  # SIGKILL while it maps
        join(r1.proc, timeout=TIMEOUT)
        del shared  # the exporter lets go: held for r2 (and r1 until it is reaped)
        for round_ in range(4):  # trim and reallocate around the mapped block
            extra = [
                _fill(pool, m // 4, 100 * round_ + k)
                for k, m in enumerate((3 * MiB, 41 * MiB, MiB, 23 * MiB))
            ]
            for k, y in enumerate(extra):
                assert bool((y == cupy.arange(y.size, dtype=cupy.int32) + 100 * round_ + k).all())
            del extra, y
            cupy.cuda.Device(0).synchronize()
            pool.trim()
            assert all(blocks.step_ids.get(s[1]) == s[0] for s in steps)  # still mapped
            assert r2.ask("check", 0, 5)[1], round_  # the pattern, never another block's
        assert r2.ask("drop")[1:] == (0, 0)
        c = cupy_poolmem_context()
        assert join_until(lambda: c.exporter.stats()["leases"] == 0)  # r1 reaped too
        pool.trim()
        assert blocks.reserved == 0
    finally:
        r1.close()
        r2.close()


def test_a_pickled_array_outlives_its_exporter():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    e = ctx.Process(target=W.exiting_exporter, args=(q, "expandable", 5 * MiB // 4, 77))
    e.start()
    try:
        import cupy_poolmem._sharing  # noqa: F401  (the reducer: this process receives)

        x = q.get(timeout=TIMEOUT)
        want = cupy.arange(x.size, dtype=cupy.int32) + 77
        assert bool((x == want).all())
        join(e, timeout=TIMEOUT)  # the exporter is gone...
        assert e.exitcode == 0
        assert bool((x == want).all())  # ...and its memory is still read here
        del x
    finally:
        if e.is_alive():
            e.kill()
            e.join(10)


@pytest.mark.multigpu
def test_a_pickled_array_is_read_from_the_other_gpu_with_the_receivers_grant(step_pool):
    pool = step_pool
    x = _fill(pool, 5 * MiB // 4, 21)
    r = Pickled(mp.get_context("spawn"), read_on=1)
    try:
        assert r.ask("x", x, 21)[1]  # a kernel of GPU 1 reads GPU 0's steps
    finally:
        r.close()
