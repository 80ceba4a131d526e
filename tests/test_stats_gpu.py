"""GPU tests of statistics(), outstanding() and the allocation log on real pools."""

from __future__ import annotations

import os
import sys

import pytest

import cupy_poolmem
from cupy_poolmem import report, stats
from cupy_poolmem._observe.observer import OBSERVER

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        cupy_poolmem.device_count() == 0,
        reason="needs a CUDA GPU (cupy_poolmem.device_count() == 0)",
    ),
]

cupy = pytest.importorskip("cupy")

MiB = 1 << 20


@pytest.fixture(autouse=True)
def nothing_observed():
    stats.stop_log()
    stats.track(False)
    yield
    stats.stop_log()
    stats.track(False)
    assert OBSERVER.scopes == ()
    assert OBSERVER.n_errors == 0, "the observer swallowed an error"


@pytest.fixture
def pool():
    p = cupy_poolmem.DevicePool()
    yield p
    cupy.cuda.get_current_stream().synchronize()
    p.close()


def _site(callsite: str) -> tuple[str, int]:
    where = callsite.split(" in ", 1)[0]
    path, line = where.rsplit(":", 1)
    return path, int(line)


def test_statistics_match_the_pool_counters(pool):
    assert pool.observer is None
    with cupy_poolmem.using(pool):
        before = pool.stats()
        with stats.statistics() as st:
            assert pool.observer is not None
            a = cupy.empty(4 * MiB, dtype=cupy.uint8)
            with stats.tag("b"):
                b = cupy.empty(8 * MiB, dtype=cupy.uint8)
            mid = pool.stats()
            del a
            after = pool.stats()
    assert pool.observer is None  # back to the zero-cost hot path
    assert st.n_allocs == mid.n_allocs - before.n_allocs == 2
    assert st.n_frees == after.n_frees - mid.n_frees == 1
    assert st.peak_used_bytes == mid.used_bytes - before.used_bytes == 12 * MiB
    assert st.current_bytes == after.used_bytes - before.used_bytes == 8 * MiB
    assert st.total_bytes == 12 * MiB
    assert st.per_tag["b"].current_bytes == 8 * MiB and st.per_tag[""].current_bytes == 0
    del b


def test_outstanding_lists_allocations_with_their_call_site(pool):
    with pytest.warns(UserWarning):
        assert pool.outstanding() == []  # nothing observed yet
    stats.track(True)
    with cupy_poolmem.using(pool):
        x = cupy.empty(3 * MiB, dtype=cupy.uint8)
        line = sys._getframe().f_lineno - 1  # the line above
        with stats.tag("small"):
            y = cupy.zeros(MiB, dtype=cupy.uint8)
    recs = pool.outstanding(limit=5)
    assert [r.size for r in recs] == [3 * MiB, MiB]
    assert recs[0].ptr == x.data.ptr and recs[0].device == pool.device_id
    path, lineno = _site(recs[0].callsite)
    assert os.path.samefile(path, __file__) and lineno == line
    assert recs[1].tag == "small"
    del x
    assert [r.size for r in pool.outstanding()] == [MiB]
    del y
    assert pool.outstanding() == []


def test_log_of_a_real_run_renders_a_report(pool, tmp_path):
    pytest.importorskip("matplotlib")
    path = stats.start_log(tmp_path / "run-{pid}.csv", track=True)
    with cupy_poolmem.using(pool):
        with stats.tag("init"):
            a = cupy.ones((1024, 1024), dtype=cupy.float32)
        with stats.tag("attention"):
            for _ in range(5):
                b = a @ a
                c = cupy.exp(b / 1024)
                del b
        with stats.tag("mlp"):
            d = cupy.tanh(a) * 2
        del a
        cupy.cuda.get_current_stream().synchronize()
    stats.stop_log()
    assert pool.observer is None
    s = report.summarize(path)
    assert s.pids == [os.getpid()] and s.n_bad_lines == 0
    assert {"init", "attention", "mlp"} <= set(s.per_tag)
    assert s.per_tag["init"].total_bytes == 4 * MiB and s.per_tag["init"].leaked_bytes == 0
    assert s.peaks[(os.getpid(), pool.device_id)] >= 3 * 4 * MiB  # a, b and c at once
    leaked = {(lk.tag, lk.size) for lk in s.leaks}  # c and d are still alive
    assert ("attention", 4 * MiB) in leaked and ("mlp", 4 * MiB) in leaked
    assert any(os.path.samefile(_site(c.callsite)[0], __file__) for c in s.top_callsites)
    png = report.plot(path, tmp_path / "usage.png")
    data = open(png, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert report.main([path, "--plot", str(tmp_path / "cli.png")]) == 0
    del c, d


def _device_used(device: int) -> int:
    """What the log's ``used`` column counts: live bytes of this process's pools there."""
    from cupy_poolmem import _pools

    return sum(int(p.live_bytes) for p in _pools.all_pools() if p.device_id == device)


def _rows(path) -> list[dict[str, str]]:
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_threads_counters_and_log_agree_with_the_pool(pool, tmp_path):
    """Threads allocate real arrays (data checked) under nested scopes, tags and a
    tracked log: the scopes' numbers are the pool's, and the log has every event once
    stop_log() returns."""
    import threading

    n_threads, n_iter, n = 4, 200, 4096  # 4096 float32: 16 KiB blocks
    path = stats.start_log(tmp_path / "t-{pid}.csv", track=True)
    bad: list[str] = []
    go = threading.Barrier(n_threads)

    def work(k: int) -> None:
        with cupy.cuda.Device(pool.device_id), cupy_poolmem.using(pool), stats.tag(f"w{k}"):
            go.wait()
            for i in range(n_iter):
                x = cupy.full(n, k * 1000 + i, dtype=cupy.float32)
                if float(x.sum()) != float(n * (k * 1000 + i)):
                    bad.append(f"thread {k} iteration {i}")
                del x

    before = pool.stats()
    with stats.statistics() as outer:
        with stats.statistics(device=pool.device_id) as inner:
            ts = [threading.Thread(target=work, args=(k,), name=f"g{k}") for k in range(n_threads)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(timeout=300)
        cupy.cuda.get_current_stream().synchronize()
    stats.stop_log()
    after = pool.stats()
    assert not bad, bad[:5]
    n_pool = after.n_allocs - before.n_allocs
    assert n_pool >= n_threads * n_iter  # cupy.full and sum() temporaries included
    assert inner.n_allocs == n_pool == after.n_frees - before.n_frees
    assert (inner.n_frees, inner.current_bytes) == (n_pool, 0)
    assert outer.n_allocs >= inner.n_allocs and outer.current_bytes == 0
    assert {f"w{k}" for k in range(n_threads)} <= set(inner.per_tag)
    for k in range(n_threads):
        t = inner.per_tag[f"w{k}"]
        assert t.n_allocs >= n_iter and t.n_frees == t.n_allocs and t.current_bytes == 0
        assert t.peak_bytes >= 4 * n
    rows = [r for r in _rows(path) if int(r["device"]) == pool.device_id]
    mine = [r for r in rows if r["thread"].startswith("g")]
    assert sum(r["op"] == "alloc" for r in mine) == n_pool
    assert sum(r["op"] == "free" for r in mine) == n_pool
    sites = {r["callsite"] for r in mine if r["op"] == "alloc"}
    assert all(os.path.samefile(_site(s)[0], __file__) for s in sites), sites
    assert rows[-1]["used"] == str(_device_used(pool.device_id))


def test_flush_log_shows_the_lines_of_an_open_log(pool, tmp_path):
    path = stats.start_log(tmp_path / "f-{pid}.csv")
    with cupy_poolmem.using(pool):
        x = cupy.arange(MiB, dtype=cupy.uint8)
        assert stats.flush_log() == path
        rows = [r for r in _rows(path) if int(r["pointer"], 16) == x.data.ptr]
        assert [(r["op"], int(r["size"])) for r in rows] == [("alloc", MiB)]
        assert int(rows[0]["used"]) == _device_used(pool.device_id)
        assert int(rows[0]["reserved"]) >= MiB
        assert int(x[255]) == 255 and int(x[-1]) == (MiB - 1) % 256
        ptr = x.data.ptr
        del x
    stats.stop_log()
    rows = [r for r in _rows(path) if int(r["pointer"], 16) == ptr]
    assert [r["op"] for r in rows] == ["alloc", "free"]


def test_the_compiled_recorder_is_installed_when_the_hot_path_is(pool):
    from cupy_poolmem import _runtime

    with stats.statistics():
        assert pool.observer is _runtime.RECORDER
        assert type(pool.observer).__module__ == type(pool).__mro__[-2].__module__


def test_arrays_freed_from_an_exception_cycle_are_charged_to_their_tag(pool, tmp_path):
    """Real arrays kept alive only by an exception's traceback (``except E as e:
    err = e``), freed later by the garbage collector: every free is charged to the
    tag the allocation had, and its log line carries that tag and call site."""
    import gc

    path = str(tmp_path / "cycle.csv")
    with cupy_poolmem.using(pool):
        stats.start_log(path, track=True)
        with stats.statistics() as st:

            def work():
                with stats.tag("model"):
                    arrs = [cupy.full(MiB // 8, i, dtype=cupy.float64) for i in range(4)]
                assert [int(a[-1]) for a in arrs] == [0, 1, 2, 3]
                try:
                    raise ValueError(len(arrs))
                except ValueError as exc:
                    return exc  # its traceback holds this frame, which holds the arrays

            err = work()
            err.keep = err  # a reference cycle through the exception
            del err
            gc.collect()
            cupy.cuda.get_current_stream().synchronize()
            per_tag = {k: (t.n_allocs, t.n_frees, t.current_bytes) for k, t in st.per_tag.items()}
        stats.stop_log()
    assert per_tag["model"] == (4, 4, 0)
    assert per_tag.get("", (0, 0, 0))[2] >= 0
    events, n_bad = report.read_log(path)
    assert n_bad == 0
    frees = [e for e in events if e.op == "free"]
    assert len(frees) == 4
    assert {e.tag for e in frees} == {"model"}
    assert all(e.callsite and e.callsite.startswith(__file__) for e in frees)
