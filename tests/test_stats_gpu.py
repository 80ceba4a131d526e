"""GPU tests of statistics(), outstanding() and the allocation log on real pools."""

from __future__ import annotations

import os
import sys

import pytest

import cupy_poolmem
from cupy_poolmem import report, stats

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
    assert stats._OBSERVER._scopes == ()
    assert stats._OBSERVER.n_errors == 0, "the observer swallowed an error"


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
