"""GPU tests of ``DevicePool(large_blocks="expandable")``: every block placed in growing
mapped ranges, two per stream.

Every test checks data.  The ones that try to break the reuse rule free a block behind
a running kernel that writes it last, and check that another stream never got its
room and that the stream's own next block is written after that kernel.
"""

from __future__ import annotations

import gc
import random
import threading

import pytest

import cupy_poolmem as cpm
from cupy_poolmem import _expandable, _retire

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")

from support.waits import freed_behind_a_spin, spin, wait_for, warm_up  # noqa: E402

MiB = 1 << 20


def _pool(**kw):
    return cpm.DevicePool(large_blocks="expandable", **kw)


def _check(arrays: dict) -> None:
    for value, x in arrays.items():
        assert int((x == value).sum()) == x.size, f"array {value} was overwritten"


def test_random_blocks_of_every_size_hold_their_data_through_reuse():
    pool = _pool()
    rng = random.Random(5)
    live: dict[int, object] = {}
    with cpm.using(pool):
        for value in range(1, 1500):
            if live and rng.random() < 0.45:
                del live[rng.choice(list(live))]
            n = max(1, int(2 ** rng.uniform(8, 25)) // 4)
            x = cupy.full(n, value, dtype=cupy.int32)
            assert pool._backend.owns(x.data.ptr)
            live[value] = x
            if value % 300 == 0:
                _check(live)
        _check(live)
        s = pool.stats()
        assert s.used_bytes == sum(x.nbytes for x in live.values())
        assert s.reserved_bytes == pool._backend.reserved >= s.used_bytes
        # Placed in freed room: far less mapped than everything ever allocated.
        assert pool._backend.peak_reserved < 0.5 * s.n_allocs * (32 * MiB // 2)
        live.clear()
        del x
    assert pool._backend.cached == pool._backend.reserved  # all free, still mapped
    pool.close()


def test_a_freed_blocks_room_serves_another_size_between_live_neighbours():
    pool = _pool()
    n = 6 * MiB // 4
    with cpm.using(pool):
        a, b, c = (cupy.full(n, v, dtype=cupy.int32) for v in (1, 2, 3))
        assert b.data.ptr == a.data.ptr + a.nbytes and c.data.ptr == b.data.ptr + b.nbytes
        bp = b.data.ptr
        del b
        d = cupy.full(n // 3, 4, dtype=cupy.int32)  # first fit: b's room
        e = cupy.full(n // 2, 5, dtype=cupy.int32)  # the rest of it
        assert d.data.ptr == bp and e.data.ptr == bp + d.nbytes
        _check({1: a, 3: c, 4: d, 5: e})
        del a, c, d, e
    pool.close()


def test_a_block_freed_behind_a_running_kernel_is_written_in_stream_order():
    warm_up()
    pool = _pool()
    s1, s2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    n = 24 * MiB // 4
    with cpm.using(pool):
        zp = freed_behind_a_spin(n, s1)
        with s2:
            w = cupy.empty(n, dtype=cupy.int32)
            w.fill(1)
        assert not (zp <= w.data.ptr < zp + n * 4)  # another stream: another range
        pool.trim(sync=False)  # s1 is busy: its range keeps the block mapped
        assert pool._backend.owns(zp)
        with s1:
            v = cupy.empty(n, dtype=cupy.int32)  # its own stream: the same room, at once
            assert v.data.ptr == zp
            v.fill(3)  # ordered after the fill of 7
        s2.synchronize()
        s1.synchronize()
        assert int((w == 1).sum()) == n and int((v == 3).sum()) == n
        del v, w
    pool.close()


def test_record_stream_orders_the_next_block_after_the_other_streams_work():
    warm_up()
    pool = _pool()
    s1, s2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    n = 16 * MiB // 4
    with cpm.using(pool):
        with s1:
            x = cupy.zeros(n, dtype=cupy.int32)
        s1.synchronize()
        xp = x.data.ptr
        spin(300, s2)
        with s2:
            x.fill(8)  # on s2, after its spin
        cpm.record_stream(x, s2)
        del x  # freed on s1: its next block there waits for s2's fill
        with s1:
            y = cupy.empty(n, dtype=cupy.int32)
            assert y.data.ptr == xp
            y.fill(6)
        s1.synchronize()
        assert int((y == 6).sum()) == n
        del y
    pool.close()


def test_trim_gives_the_free_top_back_to_the_device_and_close_gives_everything():
    cupy.cuda.runtime.deviceSynchronize()
    free0 = cupy.cuda.runtime.memGetInfo()[0]
    pool = _pool()
    with cpm.using(pool):
        keep = cupy.full(4 * MiB // 4, 9, dtype=cupy.int32)
        big = [cupy.full(100 * MiB // 4, i, dtype=cupy.int32) for i in range(4)]
        mapped = pool._backend.reserved
        assert mapped == 404 * MiB  # 20 MiB, then what each array needed beyond it
        del big
        released = pool.trim()
        # Every step above the first, which holds ``keep`` (20 MiB, mapped for it).
        assert released == mapped - 20 * MiB and pool._backend.reserved == 20 * MiB
        assert int((keep == 9).sum()) == keep.size
        assert cupy.cuda.runtime.memGetInfo()[0] >= free0 - 64 * MiB
        again = cupy.full(50 * MiB // 4, 2, dtype=cupy.int32)  # maps anew after the trim
        assert int((again == 2).sum()) == again.size
    pool.close()
    del keep, again
    gc.collect()
    _retire.retirer().drain()
    assert wait_for(lambda: pool._backend.reserved == 0)
    cupy.cuda.runtime.deviceSynchronize()
    assert cupy.cuda.runtime.memGetInfo()[0] >= free0 - 64 * MiB


def test_a_graph_capture_takes_graph_memory_and_replays_with_the_right_data():
    pool = _pool()
    s = cupy.cuda.Stream(non_blocking=True)
    with cpm.using(pool), s:
        x = cupy.arange(1 << 20, dtype=cupy.float32)
        s.begin_capture()
        y = x * 2  # allocated during the capture: graph memory
        z = y + 1
        g = s.end_capture()
        assert not pool._backend.owns(y.data.ptr) and pool.n_graph_allocs >= 1
        g.launch(s)
        s.synchronize()
        assert float(z[-1]) == float((x[-1] * 2) + 1)
        del y, z, g
    pool.close()


def test_threads_on_streams_of_their_own_keep_their_data():
    pool = _pool()
    errors: list = []

    def work(seed: int) -> None:
        try:
            rng = random.Random(seed)
            s = cupy.cuda.Stream(non_blocking=True)
            live: dict[int, object] = {}
            with cpm.using(pool), s:
                for i in range(300):
                    value = seed * 1000 + i
                    if live and rng.random() < 0.5:
                        del live[rng.choice(list(live))]
                    live[value] = cupy.full(int(2 ** rng.uniform(6, 22)), value, dtype=cupy.int32)
                _check(live)
                live.clear()
            s.synchronize()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert len(pool._backend.arenas) >= 4  # each stream its own ranges
    pool.close()


def test_check_access_and_the_statistics_see_the_ranges():
    pool = _pool(peer_access=None)
    with cpm.using(pool):
        x = cupy.ones(3 * MiB, dtype=cupy.uint8)
        cpm.check_access(x, device=0)
        found = _expandable.expandable_range_of(x.data.ptr)
        assert found is not None and found[0] is pool._backend
        assert pool.stats().reserved_bytes >= x.nbytes
        del x
    pool.close()
