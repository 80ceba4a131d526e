"""GPU tests of the steps of expandable and mapped blocks travelling between processes
(issue 35): first the export, mapping and book of ``cupy_poolmem._sharing._steps`` with
the real driver; then, at the end of this file, arrays pickled through multiprocessing
(the reducer, the claim that names the steps held, descriptors over the socket).

The exporter is this process: an exportable ``DevicePool(large_blocks="expandable",
ipc=True)``; receivers are spawned processes (tests/support/step_workers.py) that map exactly the steps under
a block and check its data.

Every wait is bounded: a child has ``START`` seconds to come up (import CuPy, make its
context) and ``ANSWER`` seconds for each answer, is joined within ``ANSWER`` seconds,
and a child that dies fails the test at once with its exit code; a test as a whole
fails after its ``timeout`` mark (pytest-timeout).  A failure says what the child saw
(the first wrong index, its value, where the block was mapped, the child's traceback)
and what the exporter holds (its statistics, the pool's mapped steps).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from multiprocessing.reduction import recv_handle, send_handle

import pytest

import cupy_poolmem as cpm

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(90)]

cupy = pytest.importorskip("cupy")

from support import step_workers as W  # noqa: E402
from support.waits import answer  # noqa: E402
from support.waits import join as _join  # noqa: E402

MiB = 1 << 20
START = 60.0  # a spawned child imports CuPy and makes its context (64 at once: slow)
ANSWER = 20.0  # any other answer, a join, a wait for the exporter


def join(*procs) -> None:
    _join(*procs, timeout=ANSWER)


def held_by(pool) -> str:
    """What the exporter of this process holds, for a failure's message."""
    from cupy_poolmem._sharing._context import context

    ctx = context()
    exp = ctx._exporter
    blocks = pool._backend
    return (
        f"exporter {exp.stats() if exp is not None else None}; pool maps "
        f"{blocks.reserved} bytes in steps {sorted(blocks.step_ids.values())}"
    )


@pytest.fixture
def exporter():
    """``(pool, blocks, book)``: an exportable expandable pool on GPU 0 whose ranges ask
    the book before unmapping a step."""
    from cuda.bindings import driver

    from cupy_poolmem._sharing._steps import StepExports

    pool = cpm.DevicePool(device=0, large_blocks="expandable", ipc=True)
    blocks = pool._backend
    book = StepExports(driver)
    blocks.set_pins(book.pins_for(blocks))
    yield pool, blocks, book
    cupy.cuda.Device(0).synchronize()
    pool.close()


class Child:
    """A spawned child on a pipe: it says ``("ready", pid)`` first, then answers each
    request (every wait bounded, see :func:`support.waits.answer`)."""

    name = "child"

    def __init__(self, ctx, target, args):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), name=self.name)
        self.proc.start()
        child.close()
        self._ready = False

    def ready(self) -> None:
        if not self._ready:
            reply = answer(self.conn, self.proc, "its start", START)
            assert reply[0] == "ready", f"{self.name} started with {reply!r}"
            self._ready = True

    def ask(self, *msg):
        self.ready()
        try:
            self.conn.send(msg)
        except OSError as exc:  # it is gone
            self.proc.join(1)
            pytest.fail(f"{self.name} took no {msg[0]!r} ({exc}; exit code {self.proc.exitcode})")
        return answer(self.conn, self.proc, f"an answer to {msg[0]!r}", ANSWER)

    def close(self):
        """Tell it to exit and join it; one that does not exit is killed (and fails
        the test, unless a failure is under way already: that one says more)."""
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(ANSWER)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
            if sys.exc_info()[0] is None:
                pytest.fail(f"{self.name} did not exit within {ANSWER} s of being told to")


class Receiver(Child):
    """A spawned receiver and the exporter's side of its claims."""

    def __init__(self, ctx, cid: int, device: int = 0, peers=(), read_on=None):
        self.cid = cid
        self.name = f"receiver-{cid}"
        super().__init__(ctx, W.receiver, (device, tuple(peers), read_on))

    def send(self, blocks, book, x, owner="exp"):
        """Claim and map the block of array ``x``: ``(index, receiver's reserved bytes,
        steps)``."""
        ptr, size = x.data.ptr, x.nbytes
        steps = blocks.steps_under(ptr, size)
        have = self.ask("have", owner)[1]
        grants = book.grant(self.cid, blocks, ptr, size, steps, have)
        W.send_block(self.conn, self.proc.pid, owner, ptr, size, grants)
        reply = answer(self.conn, self.proc, f"the mapping of {size} bytes on {steps}", ANSWER)
        assert reply[0] == "mapped", reply
        return reply[1], reply[2], steps

    def check(self, i, x, base):
        """``(ok, what was wrong)``: whether block ``i`` holds ``base + arange`` where
        array ``x`` lies."""
        return self.check_at(i, x.data.ptr, x.size, base)

    def check_at(self, i, ptr, n, base):
        _, ok, why = self.ask("check", i, ptr, n, base)
        return ok, why


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
            seen = f"item {k}: {n} int32 at {x.data.ptr:#x} on steps {steps}"
            # exactly the steps under its blocks: never a whole-GPU range
            assert reserved == sum(windows.values()) < 1 << 30, (seen, reserved, windows)
            ok, why = r.check(i, x, 1000 * k)
            assert ok, f"{seen}: {why}"
            live.append((i, x, 1000 * k))
        assert crossing, "no block crossed a step boundary"
        for i, x, base in live:  # still all there
            ok, why = r.check(i, x, base)
            assert ok, f"block {i} again: {why}"
        st = r.ask("stats")[1]
        mapped_steps = {s for i, x, _b in live for s in blocks.steps_under(x.data.ptr, x.nbytes)}
        assert st["step_handles"] == len(mapped_steps), (st, mapped_steps)  # imported once each
        for i, x, _b in live:
            r.ask("unmap", i)
            book.unmapped(1, blocks, [s[0] for s in blocks.steps_under(x.data.ptr, x.nbytes)])
        st = r.ask("stats")[1]
        assert st == {"step_windows": 0, "step_handles": 0, "step_reserved_bytes": 0}, st
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
    assert len(steps) >= 2, steps
    ctx = mp.get_context("spawn")
    r = Receiver(ctx, 1)
    try:
        i, reserved, _ = r.send(blocks, book, big)
        assert reserved == sum(s[2] for s in steps), (reserved, steps)  # exactly its steps
        ok, why = r.check(i, big, 7)
        assert ok, f"on steps {steps}: {why}"
        r.ask("write", i, big.data.ptr, big.size, 99)  # the receiver writes back
        assert bool((big == cupy.arange(big.size, dtype=cupy.int32) + 99).all())
        assert bool((keep == cupy.arange(n, dtype=cupy.int32) + 3).all())  # its neighbour
    finally:
        r.close()


@pytest.mark.timeout(240)  # 64 children start together
def test_sixty_four_receivers_map_one_block_and_each_checks_it(exporter):
    pool, blocks, book = exporter
    x = _fill(pool, 3 * MiB // 4, 11)
    ctx = mp.get_context("spawn")
    rs = [Receiver(ctx, c) for c in range(1, 65)]
    try:
        for r in rs:
            i, reserved, steps = r.send(blocks, book, x)
            assert reserved == sum(s[2] for s in steps), (r.cid, reserved, steps)
        for r in rs:
            ok, why = r.check(0, x, 11)
            assert ok, f"receiver {r.cid}: {why}"
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
            for va in [s[1] for s in steps]:  # still mapped
                assert blocks.step_ids.get(va) in [s[0] for s in steps], (round_, held_by(pool))
            for r, i in ((r1, i1), (r2, i2)):
                ok, why = r.check(i, shared, 5)
                assert ok, f"round {round_}, {r.name}: {why}; {held_by(pool)}"
        r1.proc.kill()  # SIGKILL while it maps
        join(r1.proc)
        book.drop_peer(1)  # what the exporter's reaping does once the process is gone
        ok, why = r2.check(i2, shared, 5)
        assert ok, f"after the SIGKILL: {why}"
        del shared
        cupy.cuda.Device(0).synchronize()
        pool.trim()
        assert all(blocks.step_ids.get(s[1]) == s[0] for s in steps), held_by(pool)  # r2's
        r2.ask("unmap", i2)
        book.unmapped(2, blocks, [s[0] for s in steps])
        pool.trim()
        assert not any(blocks.step_ids.get(s[1]) == s[0] for s in steps), held_by(pool)
        assert blocks.reserved == 0, held_by(pool)
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
        ok, why = r.check(i, x, 21)
        assert ok, why
    finally:
        r.close()


@pytest.mark.multigpu
def test_a_block_on_the_second_gpu_is_read_by_a_receiver_there():
    from cuda.bindings import driver

    from cupy_poolmem._sharing._steps import StepExports

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
            ok, why = r.check(i, x, 31)
            assert ok, why
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
    e = ctx.Process(
        target=W.short_lived_exporter, args=(child, 0, os.getpid(), 1 << 20, 41), name="exporter"
    )
    e.start()
    child.close()
    try:
        msg = answer(e_conn, e, "the block's steps", START)
        assert msg[0] == "map", msg
        _, owner, ptr, size, steps = msg
        fds = [recv_handle(e_conn) for _s, has in steps if has]
        assert answer(e_conn, e, "'sent'", ANSWER) == ("sent",)
        r.ready()
        r.conn.send(msg)  # relayed: the descriptors go on from here
        for fd in fds:
            send_handle(r.conn, fd, r.proc.pid)
            os.close(fd)
        reply = answer(r.conn, r.proc, f"the mapping of {size} bytes on {steps}", ANSWER)
        assert reply[0] == "mapped", reply
        e_conn.send("go")
        join(e)
        assert e.exitcode == 0, e.exitcode
        ok, why = r.check_at(0, ptr, 1 << 20, 41)  # read after its exporter is gone
        assert ok, why
    finally:
        if e.is_alive():
            e.kill()
            e.join(10)
        r.close()


# -- the pickled-array path: arrays sent through multiprocessing, mapped as steps ----------
@pytest.mark.parametrize("mode", ["expandable", "mapped"])
def test_an_array_of_a_mapped_or_expandable_ipc_pool_travels_over_a_pipe(mode):
    from support import mp_workers as MW

    import cupy_poolmem._sharing  # noqa: F401  (the reducer for cupy.ndarray)

    pool = cpm.DevicePool(large_blocks=mode, ipc=True)
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=MW.pipe_worker, args=(b,), name="pipe-worker")
    p.start()
    b.close()
    try:
        with cpm.using(pool):
            x = cupy.arange(3 << 20, dtype=cupy.float32)  # 12 MiB: mapped above 8 MiB
        cupy.cuda.Device(0).synchronize()
        a.send(("x", x[3::2]))  # pickled here, in this thread
        reply = answer(a, p, "the array back", START)
        assert reply[0] == "x", reply
        assert (reply[-1] == cupy.asnumpy(x[3::2])).all()
    finally:
        try:
            a.send(None)
        except OSError:
            pass
        join(p)
        del x
        cupy.cuda.Device(0).synchronize()
        pool.close()


class Pickled(Child):
    """A spawned receiver of pickled arrays (tests/support/step_workers.pickled_receiver):
    each answer is a dict of what it saw (``ok``, ``why``, its reservation...)."""

    def __init__(self, ctx, read_on=None, name="pickled-receiver"):
        self.name = name
        super().__init__(ctx, W.pickled_receiver, (read_on,))

    def take(self, x, base) -> dict:
        """Send array ``x`` (pickled here); what the receiver saw."""
        return self.ask("x", x, base)[1]


@pytest.fixture
def step_pool():
    import cupy_poolmem._sharing  # noqa: F401  (the reducer for cupy.ndarray)

    pool = cpm.DevicePool(device=0, large_blocks="expandable", ipc=True)
    yield pool
    cupy.cuda.Device(0).synchronize()
    pool.close()


def leases_out() -> int:
    from cupy_poolmem._sharing._context import context

    return context().exporter.stats()["leases"]


def trimmed_to_nothing(pool) -> bool:
    """Whether a trim leaves ``pool`` nothing mapped, within ``ANSWER`` seconds: the
    exporter frees a block its last receiver let go just after the lease goes."""
    from support.waits import wait_for

    return wait_for(lambda: pool.trim() >= 0 and pool._backend.reserved == 0, ANSWER)


def test_pickled_arrays_of_many_sizes_across_step_boundaries_read_in_another_process(step_pool):
    from support.waits import wait_for

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
            saw = r.take(x, 1000 * k)
            seen = f"item {k}: {n} int32 at {x.data.ptr:#x} on steps {steps}; receiver: {saw}"
            assert saw["ok"], seen
            # exactly the steps under the blocks it holds: never a whole-GPU range
            assert saw["step_reserved_bytes"] == sum(windows.values()) < 1 << 30, (seen, windows)
            live.append((saw["index"], x, 1000 * k))
        del x
        assert crossing, "no block crossed a step boundary"
        for i, base in [(i, base) for i, _x, base in live]:  # all still there
            saw = r.ask("check", i, base)[1]
            assert saw["ok"], f"array {i} again: {saw}"
        left = r.ask("drop")[1]  # every window unmapped, nothing reserved
        assert left["step_windows"] == left["step_reserved_bytes"] == 0, left
        live.clear()
        cupy.cuda.Device(0).synchronize()
        assert wait_for(lambda: leases_out() == 0, ANSWER), held_by(pool)
        assert trimmed_to_nothing(pool), held_by(pool)  # nothing pinned any more
    finally:
        r.close()


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
    assert len(steps) >= 2, steps
    r = Pickled(mp.get_context("spawn"))
    try:
        saw = r.take(big, 7)
        assert saw["ok"] and saw["step_windows"] == 1, (steps, saw)
        assert saw["step_reserved_bytes"] == sum(s[2] for s in steps), (steps, saw)
    finally:
        r.close()


def test_arrays_from_a_new_pool_per_task_leave_the_receiver_no_entry_per_pool():
    """An exporter that makes a pool per task: each array reads right in the receiver,
    and once it is let go the receiver keeps no entry for that pool."""
    from support.waits import wait_for

    import cupy_poolmem._sharing  # noqa: F401  (the reducer for cupy.ndarray)

    r = Pickled(mp.get_context("spawn"))
    try:
        for k in range(6):
            pool = cpm.DevicePool(device=0, large_blocks="expandable", ipc=True)
            try:
                x = _fill(pool, 3 * MiB // 4, 100 * k)
                saw = r.take(x, 100 * k)
                assert saw["ok"] and saw["step_pools"] == 1, (k, saw)
                left = r.ask("drop")[1]
                assert left["step_windows"] == left["step_pools"] == 0, (k, left)
                del x
                assert wait_for(lambda: leases_out() == 0, ANSWER), held_by(pool)
            finally:
                cupy.cuda.Device(0).synchronize()
                pool.close()
    finally:
        r.close()


def test_sigkilled_receivers_while_the_exporter_trims_and_reallocates_see_no_reuse(step_pool):
    from support.waits import wait_for

    pool = step_pool
    blocks = pool._backend
    ctx = mp.get_context("spawn")
    r1, r2 = Pickled(ctx, name="receiver-1"), Pickled(ctx, name="receiver-2")
    try:
        shared = _fill(pool, 25 * MiB // 4, 5)
        steps = blocks.steps_under(shared.data.ptr, shared.nbytes)
        for r in (r1, r2):
            saw = r.take(shared, 5)
            assert saw["ok"], (r.name, steps, saw)
        r1.proc.kill()  # SIGKILL while it maps
        join(r1.proc)
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
            mapped = all(blocks.step_ids.get(s[1]) == s[0] for s in steps)
            assert mapped, (round_, steps, held_by(pool))
            saw = r2.ask("check", 0, 5)[1]  # the pattern, never another block's
            assert saw["ok"], (round_, saw, held_by(pool))
        left = r2.ask("drop")[1]
        assert left["step_windows"] == left["step_reserved_bytes"] == 0, left
        assert wait_for(lambda: leases_out() == 0, ANSWER), held_by(pool)  # r1 reaped too
        assert trimmed_to_nothing(pool), held_by(pool)
    finally:
        r1.close()
        r2.close()


def test_a_pickled_array_outlives_its_exporter():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    e = ctx.Process(
        target=W.exiting_exporter, args=(q, "expandable", 5 * MiB // 4, 77), name="exporter"
    )
    e.start()
    try:
        import queue

        import cupy_poolmem._sharing  # noqa: F401  (the reducer: this process receives)

        try:
            x = q.get(timeout=START)
        except queue.Empty:
            pytest.fail(f"the exporter sent nothing within {START} s (exit code {e.exitcode})")
        why = W.mismatch(cupy, x, 77)
        assert not why, why
        join(e)  # the exporter is gone...
        assert e.exitcode == 0, e.exitcode
        why = W.mismatch(cupy, x, 77)
        assert not why, f"after its exporter exited: {why}"  # ...its memory is still read
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
        saw = r.take(x, 21)  # a kernel of GPU 1 reads GPU 0's steps
        assert saw["ok"], saw
    finally:
        r.close()
