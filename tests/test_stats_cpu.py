"""CPU tests of cupy_poolmem.stats: the observer is driven by fake blocks, no GPU needed.

See ``tests/fakes/observer.py`` for how the fakes mimic the hot path.
"""

from __future__ import annotations

import csv
import errno
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest
from fakes.observer import FAKES_FILE, FakeBlock, FakeCore, InterruptedName, alloc, free, observer

from cupy_poolmem import _runtime, stats
from cupy_poolmem._observe.log_writer import LogSettings, LogWriter
from cupy_poolmem._observe.observer import OBSERVER, Observer
from cupy_poolmem._observe.sites import CallSites
from cupy_poolmem._observe.tags import TAGS
from cupy_poolmem.stats import LOG_COLUMNS


@pytest.fixture(autouse=True)
def clean_state():
    """Every test starts and ends with nothing observed."""
    stats.stop_log()
    stats.track(False, depth=32, skip=[FAKES_FILE])
    assert OBSERVER.scopes == ()
    assert observer() is None
    yield
    stats.stop_log()
    stats.track(False)
    assert OBSERVER.scopes == (), "a test left a statistics() scope open"
    assert observer() is None
    assert OBSERVER.n_errors == 0, "the observer swallowed an error"


def _lineno() -> int:
    return sys._getframe(1).f_lineno


# ------------------------------------------------------------------------------------------
# Installing and removing the observer
# ------------------------------------------------------------------------------------------
def test_observer_installed_only_while_needed():
    core = FakeCore()
    with _runtime.registry_lock():
        _runtime.POOLS.add(core)
    try:
        with stats.tag("x"):  # tags alone install nothing
            assert observer() is None
            assert core.observer is None
        with stats.statistics():
            assert observer() is OBSERVER.recorder is _runtime.RECORDER
            assert core.observer is _runtime.RECORDER  # live pools get it
        assert observer() is None and core.observer is None
        assert stats.track(True) is False
        assert observer() is _runtime.RECORDER and stats.is_tracking()
        assert stats.track(False) is True
        assert observer() is None and not stats.is_tracking()
    finally:
        with _runtime.registry_lock():
            _runtime.POOLS.discard(core)


def test_log_installs_and_stop_removes(tmp_path):
    path = stats.start_log(tmp_path / "a.csv")
    assert observer() is _runtime.RECORDER and stats.log_path() == path
    assert not stats.is_tracking()
    with stats.statistics():
        pass
    assert observer() is _runtime.RECORDER  # still needed by the log
    assert stats.stop_log() == path
    assert observer() is None and stats.log_path() is None
    assert stats.stop_log() is None


def test_inactive_observer_ignores_calls():
    core = FakeCore()
    b = FakeBlock(core, 0x10, 8)
    _runtime.RECORDER.on_alloc(b)  # a closed pool may keep a stale observer
    assert b.info is None
    _runtime.RECORDER.on_free(core, 0x10, 8, 0, None)
    with stats.statistics() as st:
        pass
    assert st.n_allocs == 0 and st.n_frees == 0


# ------------------------------------------------------------------------------------------
# statistics()
# ------------------------------------------------------------------------------------------
def test_statistics_counts_and_peak():
    core = FakeCore()
    with stats.statistics() as st:
        assert st.active
        a = alloc(core, 0x1000, 100)
        b = alloc(core, 0x2000, 200)
        free(a)
        c = alloc(core, 0x3000, 50)
    assert not st.active and st.end_time is not None
    assert (st.n_allocs, st.n_frees) == (3, 1)
    assert st.current_bytes == 250
    assert st.peak_used_bytes == 300
    assert st.total_bytes == 350
    # Frozen after the scope: later frees are not counted.
    free(b)
    free(c)
    assert (st.n_frees, st.current_bytes) == (1, 250)
    d = st.to_dict()
    assert d["peak_used_bytes"] == 300 and d["per_tag"][""]["total_bytes"] == 350
    assert "3 allocs" in str(st)


def test_nested_scopes_each_see_their_own_numbers():
    core = FakeCore()
    assert stats.get_statistics() is None
    with stats.statistics() as outer:
        a = alloc(core, 0x1000, 100)
        with stats.statistics() as inner:
            assert stats.get_statistics() is inner
            b = alloc(core, 0x2000, 10)
            free(a)  # allocated before `inner`: not inner's business
            free(b)
        assert stats.get_statistics() is outer
        c = alloc(core, 0x3000, 1)
    assert stats.get_statistics() is None
    assert (inner.n_allocs, inner.n_frees, inner.current_bytes) == (1, 1, 0)
    assert inner.peak_used_bytes == 10 and inner.total_bytes == 10
    assert (outer.n_allocs, outer.n_frees, outer.current_bytes) == (3, 2, 1)
    assert outer.peak_used_bytes == 110 and outer.total_bytes == 111
    free(c)


def test_free_of_memory_from_before_the_scope_is_not_counted():
    core = FakeCore()
    stats.track(True)
    old = alloc(core, 0x1000, 4096)
    with stats.statistics() as st:
        free(old)
        x = alloc(core, 0x2000, 16)
    assert (st.n_allocs, st.n_frees, st.current_bytes, st.peak_used_bytes) == (1, 0, 16, 16)
    free(x)


def test_statistics_filters_by_device_and_kind():
    d0, d1, pinned = FakeCore(0), FakeCore(1), FakeCore(-1, kind=1)
    with (
        stats.statistics(device=1) as s_dev1,
        stats.statistics(kind="pinned") as s_pin,
        stats.statistics() as s_all,
    ):
        blocks = [alloc(d0, 0x10, 1), alloc(d1, 0x20, 2), alloc(pinned, 0x30, 4)]
        for b in blocks:
            free(b)
    assert (s_dev1.n_allocs, s_dev1.total_bytes, s_dev1.n_frees) == (1, 2, 1)
    assert (s_pin.n_allocs, s_pin.total_bytes, s_pin.n_frees) == (1, 4, 1)
    assert (s_all.n_allocs, s_all.total_bytes, s_all.peak_used_bytes) == (3, 7, 7)
    with pytest.raises(ValueError):
        with stats.statistics(kind="gpu"):
            pass


def test_size_zero_allocations_count_like_the_pool_counters():
    core = FakeCore()
    with stats.statistics() as st:
        z = alloc(core, 0, 0)  # the hot path never calls on_free for ptr 0
        assert stats.outstanding(core) == []
    assert (st.n_allocs, st.n_frees, st.total_bytes) == (1, 0, 0)
    del z


def test_a_pools_outstanding_is_the_statistics_own_through_the_hook():
    """Pool.outstanding() reaches the statistics through the hook the public layer
    installs (the pools never import the observability layer)."""
    import cupy_poolmem as cpm
    from cupy_poolmem import _runtime

    assert cpm.Pool is not None  # the GPU names loaded: the public layer ran
    assert _runtime.HOOKS.outstanding is stats.outstanding
    core = FakeCore()
    with stats.statistics():
        b = alloc(core, 0x1000, 64)
        assert [r.size for r in cpm.Pool.outstanding(core)] == [64]
        free(b)
        assert cpm.Pool.outstanding(core) == []


def test_statistics_thread_safe():
    core = FakeCore()
    n_threads, n_iter, size = 8, 2000, 64

    def work(k: int) -> None:
        base = (k + 1) << 32
        for i in range(n_iter):
            b = alloc(core, base + i * 4096, size)
            free(b)

    with stats.statistics() as st:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert st.n_allocs == n_threads * n_iter
    assert st.n_frees == n_threads * n_iter
    assert st.current_bytes == 0
    assert size <= st.peak_used_bytes <= n_threads * size
    assert st.total_bytes == n_threads * n_iter * size


# ------------------------------------------------------------------------------------------
# tag()
# ------------------------------------------------------------------------------------------
def test_tags_nest_as_paths_and_reach_statistics():
    core = FakeCore()
    assert stats.current_tag() is None
    with stats.statistics() as st:
        with stats.tag("model") as t1:
            assert t1 == "model" and stats.current_tag() == "model"
            a = alloc(core, 0x10, 10)
            with stats.tag("attention"):
                assert stats.current_tag() == "model/attention"
                b = alloc(core, 0x20, 20)
            assert stats.current_tag() == "model"
        c = alloc(core, 0x30, 30)
        free(b)
    assert stats.current_tag() is None
    assert set(st.per_tag) == {"model", "model/attention", ""}
    assert st.per_tag["model"].total_bytes == 10
    at = st.per_tag["model/attention"]
    assert (at.n_allocs, at.n_frees, at.total_bytes, at.current_bytes, at.peak_bytes) == (
        1,
        1,
        20,
        0,
        20,
    )
    assert st.per_tag[""].current_bytes == 30
    free(a)
    free(c)


def test_tag_is_a_decorator_and_restores_after_exceptions():
    @stats.tag("loss")
    def f() -> str | None:
        return stats.current_tag()

    assert f() == "loss" and f() == "loss"
    with pytest.raises(RuntimeError):
        with stats.tag("boom"):
            raise RuntimeError
    assert stats.current_tag() is None
    with pytest.raises(TypeError):
        stats.tag("")


def test_tags_are_thread_local():
    core = FakeCore()
    seen: dict[str, str | None] = {}
    go = threading.Barrier(2, timeout=30)

    def worker(name: str, n: int) -> None:
        with stats.tag(name):
            go.wait()  # both threads inside their tags at once
            for i in range(n):
                free(alloc(core, (hash(name) & 0xFFFF) << 24 | (i + 1) << 8, 1))
            seen[name] = stats.current_tag()
            go.wait()

    with stats.statistics() as st, stats.tag("main"):
        t = threading.Thread(target=lambda: seen.setdefault("plain", stats.current_tag()))
        t.start()
        t.join(timeout=30)
        ws = [threading.Thread(target=worker, args=(nm, 300)) for nm in ("left", "right")]
        for w in ws:
            w.start()
        for w in ws:
            w.join(timeout=60)
        assert stats.current_tag() == "main"
        m = alloc(core, 0x99, 5)
    assert seen == {"plain": None, "left": "left", "right": "right"}
    assert st.per_tag["left"].n_allocs == 300 and st.per_tag["right"].n_allocs == 300
    assert st.per_tag["main"].n_allocs == 1
    assert "main/left" not in st.per_tag and "left/right" not in st.per_tag
    free(m)


# ------------------------------------------------------------------------------------------
# outstanding() and tracking
# ------------------------------------------------------------------------------------------
def test_outstanding_biggest_first_with_call_sites():
    core, other = FakeCore(), FakeCore(device=1)
    stats.track(True)
    small = alloc(core, 0x1000, 10)
    small_line = _lineno() - 1  # the line above
    with stats.tag("big"):
        big = alloc(core, 0x2000, 1000)
        big_line = _lineno() - 1  # the line above
    mid = alloc(core, 0x3000, 100)
    gone = alloc(core, 0x4000, 5000)
    free(gone)
    elsewhere = alloc(other, 0x5000, 7)
    recs = stats.outstanding(core, limit=2)
    assert recs.observed
    assert [r.size for r in recs] == [1000, 100]
    assert recs[0].ptr == 0x2000 and recs[0].tag == "big" and recs[0].device == 0
    assert (
        recs[0].callsite
        == f"{__file__}:{big_line} in test_outstanding_biggest_first_with_call_sites"
    )
    assert 0 <= recs[0].age < 60
    everything = stats.outstanding(core, limit=None)
    assert [r.size for r in everything] == [1000, 100, 10]
    assert everything[2].callsite.startswith(f"{__file__}:{small_line} ")
    assert everything[2].tag is None
    assert [r.size for r in stats.outstanding(None, limit=None)] == [1000, 100, 10, 7]
    assert "big" in str(recs)
    for b in (small, big, mid, elsewhere):
        free(b)
    assert stats.outstanding(core) == []


def test_outstanding_without_tracking_lists_allocations_without_call_sites():
    core = FakeCore()
    with stats.statistics():
        b = alloc(core, 0x1000, 64)
        recs = stats.outstanding(core)
        assert [(r.size, r.callsite) for r in recs] == [(64, None)]
        free(b)


def test_outstanding_without_observer_says_so():
    with pytest.warns(UserWarning, match="no allocations are being observed"):
        recs = stats.outstanding(FakeCore())
    assert recs == [] and recs.observed is False and "track(True)" in str(recs)


def test_call_site_skips_listed_packages(tmp_path, monkeypatch):
    helper = tmp_path / "myalloc_helper.py"
    helper.write_text(
        textwrap.dedent("""
        def make(alloc, core):
            return alloc(core, 0x1000, 8)   # line 3
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import myalloc_helper

    stats.track(True)
    b = myalloc_helper.make(alloc, FakeCore())
    assert b.info.callsite.startswith(f"{helper}:3 in make")
    free(b)
    stats.track(True, skip=[str(tmp_path) + os.sep, FAKES_FILE])
    b = myalloc_helper.make(alloc, FakeCore())
    line = _lineno() - 1  # the line above
    assert b.info.callsite == f"{__file__}:{line} in test_call_site_skips_listed_packages"
    free(b)


def test_call_site_walk_is_bounded():
    stats.track(True, depth=1)  # only the fakes' alloc() frame (skipped): no site
    b = alloc(FakeCore(), 0x1000, 8)
    assert b.info is not None and b.info.callsite is None
    free(b)
    with pytest.raises(ValueError):
        stats.track(True, depth=0)


# ------------------------------------------------------------------------------------------
# The hooks never raise, and survive re-entry from the garbage collector
# ------------------------------------------------------------------------------------------
def test_on_free_never_raises():
    with stats.statistics():
        before = OBSERVER.n_errors
        with pytest.warns(RuntimeWarning):
            observer().on_free(object(), 0x10, 8, 0, None)  # a core without attributes
        observer().on_free(None, "x", None, None, ("bad",))
        assert OBSERVER.n_errors == before + 2
    OBSERVER.n_errors = 0
    OBSERVER.warned = False


def test_free_reentering_during_an_alloc_is_applied_not_deadlocked():
    victim_core = FakeCore()
    holder: dict[str, FakeBlock] = {}

    class ReentrantCore(FakeCore):
        """Frees another block in the middle of the observer's work (as a GC would)."""

        fired = False

        @property
        def device_id(self) -> int:
            if not ReentrantCore.fired and "victim" in holder:
                ReentrantCore.fired = True
                free(holder.pop("victim"))
            return 0

        @device_id.setter
        def device_id(self, v: int) -> None:
            pass

    result: dict[str, object] = {}

    def run() -> None:
        with stats.statistics() as st:
            holder["victim"] = alloc(victim_core, 0x1000, 100)
            b = alloc(ReentrantCore(), 0x2000, 5)
            result["st"] = st
            free(b)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive(), "observer deadlocked on a re-entrant free"
    st = result["st"]
    assert ReentrantCore.fired
    # The free ran while the allocation read its pool (before its counters change in one
    # step): it lands first, so the two blocks were never live together.
    assert (st.n_allocs, st.n_frees, st.current_bytes, st.peak_used_bytes) == (2, 2, 0, 100)


# ------------------------------------------------------------------------------------------
# The log
# ------------------------------------------------------------------------------------------
def _read(path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0]) == LOG_COLUMNS
    return [dict(zip(rows[0], r)) for r in rows[1:]]


def test_log_lines(tmp_path, monkeypatch):
    import weakref

    # Only the fake pools count (real pools may be alive when this runs on a GPU machine).
    monkeypatch.setattr(_runtime, "POOLS", weakref.WeakSet())
    core = FakeCore(device=0, reserved=1 << 20, used=1000)  # 1000 bytes live before the log
    pinned = FakeCore(device=-1, kind=1, reserved=4096)
    with _runtime.registry_lock():
        _runtime.POOLS.add(core)  # a live pool: its counters seed `used`
    try:
        t_start = time.time()
        path = stats.start_log(tmp_path / "sub" / "alloc.csv", track=True)
        assert stats.is_tracking()
        with stats.tag("attn"):
            a = alloc(core, 0xABC000, 300, stream_ptr=77)
            line = _lineno() - 1  # the line above
        b = alloc(pinned, 0x5000, 16)
        free(a)
        free(b)
        stats.stop_log()
        assert not stats.is_tracking()
        c = alloc(core, 0x1, 1)  # after stop: not logged
        assert c.info is None
    finally:
        with _runtime.registry_lock():
            _runtime.POOLS.discard(core)
    rows = _read(path)
    assert [(r["op"], r["pointer"], r["size"]) for r in rows] == [
        ("alloc", "0xabc000", "300"),
        ("alloc", "0x5000", "16"),
        ("free", "0xabc000", "300"),
        ("free", "0x5000", "16"),
    ]
    r0, r1, r2, r3 = rows
    assert r0["pid"] == str(os.getpid()) and r0["thread"] == threading.current_thread().name
    assert r0["device"] == "0" and r0["stream"] == "77" and r1["device"] == "-1"
    assert t_start <= float(r0["time"]) <= float(r3["time"]) <= time.time() + 1
    assert r0["tag"] == "attn" and r2["tag"] == "attn"  # frees carry the alloc's tag
    assert r0["callsite"] == f"{__file__}:{line} in test_log_lines" == r2["callsite"]
    assert [r["used"] for r in rows] == ["1300", "16", "1000", "0"]  # per device, seeded
    assert r0["reserved"] == str(1 << 20) and r1["reserved"] == "4096"


def test_log_from_several_threads_keeps_every_line(tmp_path):
    path = stats.start_log(tmp_path / "t.csv")
    core = FakeCore()

    def work(k: int) -> None:
        for i in range(500):
            free(alloc(core, (k + 1) << 32 | (i + 1) << 12, 8))

    ts = [threading.Thread(target=work, args=(k,), name=f"w{k}") for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    stats.stop_log()
    rows = _read(path)
    assert len(rows) == 4 * 500 * 2
    assert {r["thread"] for r in rows} == {"w0", "w1", "w2", "w3"}
    assert rows[-1]["used"] == "0"
    assert all(r["callsite"] == "" for r in rows)  # no tracking


def test_log_append_writes_one_header(tmp_path):
    p = tmp_path / "a.csv"
    core = FakeCore()
    for _ in range(2):
        stats.start_log(p, append=True)
        free(alloc(core, 0x10, 1))
        stats.stop_log()
    text = p.read_text().splitlines()
    assert text[0] == ",".join(LOG_COLUMNS) and text.count(text[0]) == 1 and len(text) == 5
    stats.start_log(p)  # default: truncate
    stats.stop_log()
    assert p.read_text().splitlines() == [",".join(LOG_COLUMNS)]


def test_env_variable_starts_a_log_per_pid(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPY_POOLMEM_LOG", str(tmp_path / "alloc-{pid}.csv"))
    monkeypatch.setenv("CUPY_POOLMEM_TRACK", "1")
    stats._init_from_env()
    try:
        assert stats.log_path() == str(tmp_path / f"alloc-{os.getpid()}.csv")
        assert stats.is_tracking()
        free(alloc(FakeCore(), 0x10, 1))
    finally:
        stats.stop_log()
    assert len(_read(tmp_path / f"alloc-{os.getpid()}.csv")) == 2
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("CUPY_POOLMEM_LOG", str(tmp_path / "a_file" / "alloc.csv"))
    monkeypatch.delenv("CUPY_POOLMEM_TRACK")
    with pytest.warns(RuntimeWarning, match="cannot write the allocation log"):
        stats._init_from_env()
    assert stats.log_path() is None


_CHILD = """
import os, sys
sys.path.insert(0, {tests!r})
from cupy_poolmem import stats
from fakes.observer import FakeCore, alloc
stats.start_log({path!r})
blocks = [alloc(FakeCore(), 0x1000 * (i + 1), 10) for i in range(3)]
{tail}
"""


def test_log_lines_flushed_survive_a_hard_exit(tmp_path):
    path = str(tmp_path / "crash.csv")
    tail = "stats.flush_log()\nos._exit(3)"
    code = _CHILD.format(tests=os.path.dirname(__file__), path=path, tail=tail)
    proc = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True)
    assert proc.returncode == 3, proc.stderr.decode()
    assert [r["op"] for r in _read(path)] == ["alloc"] * 3


def test_log_lines_reach_the_file_without_a_flush(tmp_path):
    """The writer thread writes what is logged within LOG_INTERVAL_S, log still open."""
    path = tmp_path / "w.csv"
    code = _CHILD.format(
        tests=os.path.dirname(__file__),
        path=str(path),
        tail="import time\ntime.sleep(30 * stats.LOG_INTERVAL_S)\nos._exit(3)",
    )
    proc = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True)
    assert proc.returncode == 3, proc.stderr.decode()
    assert [r["op"] for r in _read(path)] == ["alloc"] * 3


def test_log_is_complete_at_a_normal_exit(tmp_path):
    path = str(tmp_path / "exit.csv")
    code = _CHILD.format(tests=os.path.dirname(__file__), path=path, tail="")
    proc = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()
    assert [r["op"] for r in _read(path)] == ["alloc"] * 3


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_writes_its_own_pid_file(tmp_path):
    template = str(tmp_path / "f-{pid}.csv")
    tail = textwrap.dedent("""
        pid = os.fork()
        if pid == 0:
            alloc(FakeCore(), 0xF000, 1)
            stats.flush_log()
            os._exit(0)
        os.waitpid(pid, 0)
        print(os.getpid(), pid)
    """)
    code = _CHILD.format(tests=os.path.dirname(__file__), path=template, tail=tail)
    proc = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    parent, child = map(int, proc.stdout.split()[-2:])
    parent_rows = _read(template.replace("{pid}", str(parent)))
    assert [r["pid"] for r in parent_rows] == [str(parent)] * 3
    child_rows = _read(template.replace("{pid}", str(child)))
    assert [(r["pid"], r["pointer"]) for r in child_rows] == [(str(child), "0xf000")]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_sharing_the_file_writes_only_its_own_lines(tmp_path):
    """The parent's records not yet written when it forks are the parent's: the child
    drops them (no line twice), and its restarted writer thread writes its own lines."""
    path = str(tmp_path / "shared.csv")
    tail = textwrap.dedent("""
        pid = os.fork()
        if pid == 0:
            alloc(FakeCore(), 0xC000, 1)
            import time
            time.sleep(30 * stats.LOG_INTERVAL_S)  # no flush: the child's writer thread
            os._exit(0)
        os.waitpid(pid, 0)
        stats.stop_log()
        print(os.getpid(), pid)
    """)
    code = _CHILD.format(tests=os.path.dirname(__file__), path=path, tail=tail)
    proc = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    parent, child = map(int, proc.stdout.split()[-2:])
    rows = _read(path)
    assert sorted((r["pid"], r["pointer"]) for r in rows) == sorted(
        [(str(parent), hex(0x1000 * (i + 1))) for i in range(3)] + [(str(child), "0xc000")]
    )


_MP_CHILD = """
import multiprocessing as mp, os, sys
sys.path.insert(0, {tests!r})
from cupy_poolmem import stats
from cupy_poolmem._observe.log_writer import LogSettings
from cupy_poolmem._observe.observer import OBSERVER
from fakes.observer import FakeCore, alloc

def work():
    global kept
    kept = [alloc(FakeCore(), 0xD000 + i, 1) for i in range(2)]  # no flush: exit does it

if __name__ == "__main__":
    OBSERVER.log_settings = LogSettings(interval=3600.0)  # the writer would not write in time
    stats.start_log({path!r})
    p = mp.get_context("fork").Process(target=work)
    p.start()
    p.join(60)
    print(p.pid, p.exitcode)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_multiprocessing_child_writes_its_lines_before_it_exits(tmp_path):
    template = str(tmp_path / "mp-{pid}.csv")
    code = _MP_CHILD.format(tests=os.path.dirname(__file__), path=template)
    proc = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    pid, exitcode = proc.stdout.split()[-2:]
    assert exitcode == "0"
    rows = _read(template.replace("{pid}", pid))
    assert [r["pointer"] for r in rows] == ["0xd000", "0xd001"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_counts_only_its_own_open_tag_scopes():
    code = textwrap.dedent("""
        import os, threading
        from cupy_poolmem import stats
        from cupy_poolmem._observe.tags import TAGS
        inside, done = threading.Event(), threading.Event()
        def other():
            with stats.tag("other"):
                inside.set()
                done.wait(30)
        t = threading.Thread(target=other)
        t.start()
        inside.wait(30)
        with stats.tag("a"), stats.tag("b"):
            assert TAGS.scopes[0] == 3
            pid = os.fork()
            if pid == 0:
                ok = TAGS.scopes[0] == 2 and stats.current_tag() == "a/b"
                with stats.tag("c"):
                    ok = ok and TAGS.scopes[0] == 3
                os._exit(0 if ok and TAGS.scopes[0] == 2 else 1)
            _, status = os.waitpid(pid, 0)
        done.set()
        t.join(30)
        assert TAGS.scopes[0] == 0
        print(os.waitstatus_to_exitcode(status))
    """)
    proc = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == "0"


def test_tag_scopes_are_counted_for_the_recorder():
    assert TAGS.scopes[0] == 0
    with stats.tag("a"):
        with stats.tag("b"):
            assert TAGS.scopes[0] == 2
        assert TAGS.scopes[0] == 1
    with pytest.raises(KeyError):
        with stats.tag("c"):
            raise KeyError
    assert TAGS.scopes[0] == 0


def test_log_interval_set_on_the_stats_module_paces_the_writer(tmp_path, monkeypatch):
    """``stats.LOG_INTERVAL_S`` (documented in the API reference) is what the writer
    thread waits between two writes: set to an hour, nothing is written before a flush."""
    monkeypatch.setattr(stats, "LOG_INTERVAL_S", 3600.0)
    path = stats.start_log(tmp_path / "i.csv")
    core = FakeCore()
    blocks = [alloc(core, 0x1000 * (i + 1), 8) for i in range(3)]
    time.sleep(0.5)  # five default intervals: a writer on 0.1 s would have written
    assert _read(path) == []
    assert stats.flush_log() == path
    assert [r["op"] for r in _read(path)] == ["alloc"] * 3
    for b in blocks:
        free(b)
    stats.stop_log()


def test_flush_log_writes_while_the_log_stays_open(tmp_path, monkeypatch):
    monkeypatch.setattr(
        OBSERVER, "log_settings", LogSettings(interval=3600.0)
    )  # the writer thread stays asleep
    assert stats.flush_log() is None
    path = stats.start_log(tmp_path / "f.csv")
    core = FakeCore()
    blocks = [alloc(core, 0x1000 * (i + 1), 8) for i in range(5)]
    assert _read(path) == []  # not written yet
    assert stats.flush_log() == path
    assert [r["op"] for r in _read(path)] == ["alloc"] * 5
    for b in blocks:
        free(b)
    stats.stop_log()
    assert [r["op"] for r in _read(path)] == ["alloc"] * 5 + ["free"] * 5


def test_a_writer_falling_behind_is_caught_up_by_the_allocating_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(OBSERVER, "log_settings", LogSettings(interval=3600.0, max_pending=0))
    path = stats.start_log(tmp_path / "b.csv")
    w = OBSERVER.writer
    w._closing = True  # the thread ends at its next wake: only this thread writes
    w._wake.set()
    w._thread.join(30)
    rec = OBSERVER.recorder
    core = FakeCore()
    n = _runtime.hp.LOG_BATCH
    for i in range(n + 10):
        rec.note(core, "alloc", i, 1, 0, "", None)
    assert len(_read(path)) == n  # the full batch, written by this thread
    stats.stop_log()
    assert len(_read(path)) == n + 10


def test_a_new_log_takes_over_from_the_old_one(tmp_path):
    core = FakeCore()
    first = stats.start_log(tmp_path / "1.csv")
    a = alloc(core, 0x10, 1)
    second = stats.start_log(tmp_path / "2.csv")
    free(a)
    stats.stop_log()
    assert [(r["op"], r["pointer"]) for r in _read(first)] == [("alloc", "0x10")]
    assert [(r["op"], r["pointer"]) for r in _read(second)] == [("free", "0x10")]


def test_many_threads_tags_and_nested_scopes_with_a_log(tmp_path):
    core = FakeCore()
    n_threads, n_iter = 6, 800
    path = stats.start_log(tmp_path / "m.csv")

    def work(k: int) -> None:
        with stats.tag(f"k{k % 2}"):
            for i in range(n_iter):
                b = alloc(core, (k + 1) << 36 | (i + 1) << 8, 8)
                if i % 2:
                    free(b)
                else:
                    held.append(b)

    held: list = []
    with stats.statistics() as outer:
        with stats.statistics() as inner:
            ts = [threading.Thread(target=work, args=(k,), name=f"m{k}") for k in range(n_threads)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(timeout=120)
        for b in held:
            free(b)
    stats.stop_log()
    n = n_threads * n_iter
    assert (inner.n_allocs, inner.n_frees, inner.current_bytes) == (n, n // 2, 8 * n // 2)
    assert (outer.n_allocs, outer.n_frees, outer.current_bytes) == (n, n, 0)
    assert outer.peak_used_bytes == inner.peak_used_bytes
    assert {k: t.n_allocs for k, t in outer.per_tag.items()} == {"k0": n // 2, "k1": n // 2}
    rows = _read(path)
    assert len(rows) == 2 * n
    assert {r["thread"] for r in rows if r["op"] == "alloc"} == {f"m{k}" for k in range(n_threads)}
    assert rows[-1]["used"] == "0"
    assert {r["tag"] for r in rows} == {"k0", "k1"}


def test_statistics_objects_compare_print_and_build_by_keyword():
    t = stats.TagStatistics(n_allocs=2, total_bytes=64, current_bytes=32, peak_bytes=64)
    assert t == stats.TagStatistics(2, 0, 64, 32, 64) and t != stats.TagStatistics()
    assert "n_allocs=2" in repr(t)
    st = stats.Statistics(n_allocs=3, peak_used_bytes=10, per_tag={"x": t}, kind="device")
    assert st.per_tag["x"] == t and st.to_dict()["per_tag"]["x"]["total_bytes"] == 64
    assert st.active and st.kind == "device" and "3 allocs" in str(st)
    st.n_allocs = 4
    assert st.n_allocs == 4 and st != stats.Statistics()
    with stats.statistics() as live:
        t_live = None
        core = FakeCore()
        with stats.tag("q"):
            b = alloc(core, 0x10, 16)
        t_live = live.per_tag["q"]
        assert t_live.current_bytes == 16
        free(b)
        assert t_live.current_bytes == 0  # the view reads the live counters


def test_ctrl_c_in_an_observed_allocation_is_not_swallowed(tmp_path, monkeypatch):
    """A KeyboardInterrupt raised while the observer runs Python code (here: the
    thread's name) reaches the program; it is no observer error."""

    monkeypatch.setattr(TAGS.tls, "thread", InterruptedName("MainThread"))
    stats.start_log(tmp_path / "k.csv")
    with pytest.raises(KeyboardInterrupt):
        alloc(FakeCore(), 0x1000, 8)


# ------------------------------------------------------------------------------------------
# Fork while another thread is inside start_log/stop_log/statistics()
# ------------------------------------------------------------------------------------------
_FORK_CTL = """
import os, signal, sys, threading
sys.path.insert(0, {tests!r})
from cupy_poolmem import stats
from fakes.observer import FakeCore, alloc
from cupy_poolmem._observe.observer import OBSERVER

stats.start_log({path!r})
kept = [alloc(FakeCore(), 0x1000 + i, 8) for i in range(3)]
w = OBSERVER.writer
entered, release = threading.Event(), threading.Event()

class Slow:
    # stop_log() writes the last lines to a slow disk, _CTL held
    def __init__(self, f): self.f = f
    def write(self, d):
        entered.set(); release.wait(10); return self.f.write(d)
    def fileno(self): return self.f.fileno()
    def close(self): self.f.close()

w.file = Slow(w.file)
t = threading.Thread(target=stats.stop_log)
t.start()
entered.wait(30)
pid = os.fork()  # e.g. a multiprocessing worker started by another thread
if pid == 0:
    signal.alarm(10)  # a deadlocked child dies of SIGALRM
    with stats.statistics() as st:
        pass
    os._exit(0)
release.set()
t.join(30)
_, status = os.waitpid(pid, 0)
print("child", status)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_can_use_stats_while_the_parent_held_the_control_lock(tmp_path):
    """stats' _CTL (an RLock) is held across file I/O and thread joins (start_log,
    stop_log, the first statistics() that installs the observer); a fork from another
    thread meanwhile leaves it held in the child by a thread that does not exist
    there.  The child's statistics(), start_log(), track() and its atexit stop_log()
    would block forever: the child makes a new one."""
    code = _FORK_CTL.format(tests=os.path.dirname(__file__), path=str(tmp_path / "f.csv"))
    proc = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    status = int(proc.stdout.split()[-1])
    assert os.waitstatus_to_exitcode(status) == 0, "the child deadlocked on stats._CTL"


def test_fork_inside_start_logs_switch_leaves_no_logging_without_a_writer(tmp_path):
    """A fork while start_log had the recorder logging but no writer set yet: the
    child's after-fork hook turns logging off, so records do not pile up unread; a
    recorder scope with no statistics() (a fork inside statistics()'s entry) goes."""
    stats.start_log(tmp_path / "a.csv")
    rec = OBSERVER.recorder
    w, OBSERVER.writer = OBSERVER.writer, None
    orphan = rec.add_scope(None, None)
    try:
        OBSERVER.after_fork_child()  # what the child runs (here in this process)
        assert rec.logging is False
        assert orphan not in rec.scopes
        with stats.statistics():  # _CTL usable
            pass
    finally:
        OBSERVER.writer = w
        rec.set_logging(True)
        rec.remove_scope(orphan)


def test_log_keeps_its_lines_when_a_call_site_path_is_not_utf8(tmp_path):
    """End to end: tracking on, one allocation made from a file whose name has an
    accent and an undecodable byte (``os.fsdecode`` gives a surrogate): every line of
    the batch around it must reach the file (none is lost, no error counted)."""
    core = FakeCore()
    path = stats.start_log(tmp_path / "s.csv", track=True)
    alloc(core, 0x1000, 8)
    fname = os.path.join(str(tmp_path), "caf\u00e9", "\udcffmod.py")
    ns: dict = {}
    exec(compile("def f(alloc, core):\n    return alloc(core, 0x2000, 8)\n", fname, "exec"), ns)
    kept = ns["f"](alloc, core)
    alloc(core, 0x3000, 8)
    stats.stop_log()
    assert OBSERVER.n_errors == 0
    events = _events(path)
    assert [e.ptr for e in events] == [0x1000, 0x2000, 0x3000]
    assert events[1].callsite.startswith(fname.encode("utf-8", "backslashreplace").decode())
    del kept


def _events(path) -> list:
    """The log's events as the report reads them; no torn or unparsable line."""
    from cupy_poolmem import report

    events, n_bad = report.read_log(path)
    assert n_bad == 0, f"{n_bad} torn or unparsable line(s) in {path}"
    return events


# ------------------------------------------------------------------------------------------
# The backlog stays bounded while the writer thread is in a long write
# ------------------------------------------------------------------------------------------
class _StuckFile:
    """The log file on a disk that stalls: the first write blocks until released."""

    def __init__(self, real, entered: threading.Event, release: threading.Event) -> None:
        self.real, self.entered, self.release = real, entered, release
        self.first = True

    def write(self, data):
        if self.first:
            self.first = False
            self.entered.set()
            self.release.wait(60)
        return self.real.write(data)

    def fileno(self):
        return self.real.fileno()

    def close(self):
        self.real.close()


def _writer_stuck_in_a_write(path):
    """A log at ``path`` whose writer thread is inside a write that blocks until
    ``release`` is set: (writer, recorder, core, release)."""
    stats.start_log(path)
    w = OBSERVER.writer
    rec = OBSERVER.recorder
    entered, release = threading.Event(), threading.Event()
    w.file = _StuckFile(w.file, entered, release)
    core = FakeCore()
    rec.note(core, "alloc", 0, 1, 0, "", None)
    w._wake.set()
    assert entered.wait(30), "the writer thread did not start its write"
    return w, rec, core, release


def test_backlog_stays_bounded_while_the_writer_is_stuck_in_a_write(tmp_path, monkeypatch):
    """Beyond _MAX_PENDING_BATCHES full batches, the allocating thread waits for the
    writer thread's slow write to end and writes the backlog itself: a fast allocation
    rate into a slow disk does not grow memory without bound.  The slow write ends
    after 1 s (a timer); no record is lost."""
    monkeypatch.setattr(OBSERVER, "log_settings", LogSettings(max_pending=2))
    w, rec, core, release = _writer_stuck_in_a_write(tmp_path / "slow.csv")
    timer = threading.Timer(1.0, release.set)
    timer.start()
    try:
        n = _runtime.hp.LOG_BATCH
        for i in range(10 * n):
            rec.note(core, "alloc", i, 1, 0, "", None)
        pending = len(rec.take_batches())  # what memory holds now
    finally:
        release.set()
        timer.cancel()
    assert pending <= 2 + 1, f"{pending} full batches held while the writer was stuck"
    assert w.n_dropped == 0


def test_backlog_is_dropped_with_a_warning_when_the_writer_stays_stuck(tmp_path, monkeypatch):
    """A write stuck beyond _MAX_WAIT_S (a hung network disk): the allocating thread
    stops waiting, drops the records waiting (counted, one warning) and goes on."""
    monkeypatch.setattr(OBSERVER, "log_settings", LogSettings(max_pending=2, max_wait=0.05))
    w, rec, core, release = _writer_stuck_in_a_write(tmp_path / "stuck.csv")
    n = _runtime.hp.LOG_BATCH
    try:
        with pytest.warns(RuntimeWarning, match="records dropped"):
            for i in range(6 * n):
                rec.note(core, "alloc", i, 1, 0, "", None)
        held = sum(len(b) for b in rec.take_batches())
    finally:
        release.set()
    assert held <= 3 * n
    assert w.n_dropped >= n and w.n_dropped + held <= 6 * n
    assert OBSERVER.n_errors >= 1
    OBSERVER.n_errors = 0
    OBSERVER.warned = False


# ------------------------------------------------------------------------------------------
# The used column when observation starts while another thread allocates
# ------------------------------------------------------------------------------------------
def _alloc_on(core: FakeCore, ptr: int, size: int) -> FakeBlock:
    """PoolCore._wrap's way: the observer installed on this pool, if any."""
    b = FakeBlock(core, ptr, size)
    if core.observer is not None:
        core.observer.on_alloc(b)
    return b


class _BusyCore(FakeCore):
    """A pool whose reserved-bytes query lets another thread allocate from ``other``
    (the query is Python code in cuda.core: the GIL may switch there)."""

    other: FakeCore | None = None
    kept: list = []

    def stats(self):
        other = _BusyCore.other
        if other is not None:
            _BusyCore.other = None
            other.used += 100  # the pool's own counter, as PoolCore._wrap does first
            _BusyCore.kept.append(_alloc_on(other, 0xB000, 100))
        return super().stats()


def test_used_is_not_counted_twice_when_observation_starts(tmp_path):
    """Observation starts: each pool gets the observer and its live bytes are read in
    one step, so an allocation made by another thread meanwhile (here: inside another
    pool's reserved-bytes query, Python code) is counted once, by the recorder or in
    the baseline, and `used` is right for the rest of the log."""
    a, b = _BusyCore(used=0), FakeCore(used=0)
    with _runtime.registry_lock():
        _runtime.POOLS.add(a)
        _runtime.POOLS.add(b)
    try:
        _BusyCore.other, _BusyCore.kept = b, []
        path = stats.start_log(tmp_path / "u.csv")
        b.used += 1
        c = _alloc_on(b, 0xC000, 1)
        stats.stop_log()
        events = _events(path)
        # 101 bytes are live in b (a holds none).
        assert (events[-1].ptr, events[-1].used) == (0xC000, 101)
        del c
    finally:
        _BusyCore.other, _BusyCore.kept = None, []
        with _runtime.registry_lock():
            _runtime.POOLS.discard(a)
            _runtime.POOLS.discard(b)


# ------------------------------------------------------------------------------------------
# A failed write in the middle of a line (a disk filling up)
# ------------------------------------------------------------------------------------------
class _DiskFull:
    """write(2) on a filling disk: part of the data, then ENOSPC, then space again."""

    def __init__(self, real) -> None:
        self.real = real
        self.calls = 0

    def write(self, data):
        self.calls += 1
        if self.calls == 1:
            return self.real.write(bytes(data[: len(data) // 2 + 7]))  # mid-line
        if self.calls == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.real.write(data)

    def fileno(self):
        return self.real.fileno()

    def close(self):
        self.real.close()


@pytest.mark.filterwarnings("ignore:cupy_poolmem observer error")
def test_log_has_no_torn_line_after_a_partial_write_and_enospc(tmp_path, monkeypatch):
    """A write that fails after half a line keeps the rest of that line and writes it
    first next time: the torn line is finished, not glued to the next batch's first
    line (which read back with a time 10^6 times too big).  The failed batch's later
    lines are lost (counted); the lines after read back right."""
    monkeypatch.setattr(OBSERVER, "log_settings", LogSettings(interval=3600.0))
    path = stats.start_log(tmp_path / "full.csv")
    w = OBSERVER.writer
    w.file = _DiskFull(w.file)
    core = FakeCore()
    t0 = time.time()
    first = [alloc(core, 0x1000 + i, 8) for i in range(4)]
    stats.flush_log()  # the disk fills up
    assert OBSERVER.n_errors == 1
    second = [alloc(core, 0x2000 + i, 8) for i in range(4)]
    stats.flush_log()  # space again
    stats.stop_log()
    t1 = time.time()
    events = _events(path)
    assert [e.ptr for e in events if e.ptr >= 0x2000] == [0x2000, 0x2001, 0x2002, 0x2003]
    assert all(t0 <= e.time <= t1 for e in events), [e.time for e in events]
    assert len([e for e in events if e.ptr < 0x2000]) >= 1  # the torn line, finished
    OBSERVER.n_errors = 0
    OBSERVER.warned = False
    del first, second


# ------------------------------------------------------------------------------------------
# The call-site cache and code objects
# ------------------------------------------------------------------------------------------
def test_call_site_cache_does_not_keep_generated_code_alive_after_tracking(tmp_path):
    """The recorder's call-site cache holds the code objects it met (up to 8192) while
    tracking is on; it is emptied when tracking or observation stops, so code made by
    exec() (templating, dataclasses, JIT front ends) and its constants can go."""
    core = FakeCore()
    stats.track(True)  # keeps the skip list: the cache is not reset below
    refs = []
    for i in range(5):
        ns: dict = {}
        big = "x" * 100_000
        src = f"def f(alloc, core, p):\n    s = {big!r}\n    return alloc(core, p, 8)\n"
        exec(compile(src, f"<generated-{i}>", "exec"), ns)
        b = ns["f"](alloc, core, 0x1000 + i)
        assert b.info.callsite.startswith(f"<generated-{i}>:3")
        free(b)
        refs.append(weakref.ref(ns["f"].__code__))
        del ns, b
    stats.track(False)
    assert observer() is None
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive == 0, f"{alive} generated code objects kept alive by the call-site cache"


def test_call_site_cache_is_emptied_when_tracking_stops_under_an_open_scope():
    """Tracking off while a statistics() scope keeps the observer installed."""
    core = FakeCore()
    with stats.statistics():
        stats.track(True)
        ns: dict = {}
        exec(compile("def f(alloc, core):\n    return alloc(core, 0x10, 8)\n", "<gen>", "exec"), ns)
        b = ns["f"](alloc, core)
        free(b)
        ref = weakref.ref(ns["f"].__code__)
        del ns, b
        stats.track(False)
        assert observer() is not None
        gc.collect()
        assert ref() is None


# ------------------------------------------------------------------------------------------
# flush_log() racing a start_log() that replaces the log
# ------------------------------------------------------------------------------------------
def test_flush_of_a_replaced_writer_does_not_take_the_new_logs_lines(tmp_path, monkeypatch):
    """flush_log() reads _OBSERVER._writer without _CTL, then flushes it; when another
    thread's start_log() closed that writer in between, that flush must leave the
    recorder's records (they belong to the new log) alone.  Here the old writer's
    flush is called at that point."""
    monkeypatch.setattr(OBSERVER, "log_settings", LogSettings(interval=3600.0))
    core = FakeCore()
    stats.start_log(tmp_path / "1.csv")
    old = OBSERVER.writer
    second = stats.start_log(tmp_path / "2.csv")
    a = alloc(core, 0x10, 1)
    old.flush()  # the other thread's flush_log(), which got `old` before the switch
    stats.stop_log()
    assert OBSERVER.n_errors == 0
    assert [(e.op, e.ptr) for e in _events(second)] == [("alloc", 0x10)]
    del a


# ------------------------------------------------------------------------------------------
# The log writer on its own: its recorder, error sink and pacing come from its constructor
# ------------------------------------------------------------------------------------------
class _Batch:
    """A recorder batch: ``n`` CSV lines, or a format that fails."""

    def __init__(self, first: int, n: int, fail: bool = False) -> None:
        self.first, self.n, self.fail = first, n, fail

    def __len__(self) -> int:
        return self.n

    def format(self, pid: int) -> bytes:
        if self.fail:
            raise ValueError("cannot format this batch")
        rows = [f"1.0,{pid},T,0,0,alloc,0x{self.first + i:x},8,,,8,\n" for i in range(self.n)]
        return "".join(rows).encode()


class _Recorder:
    """Hands out the batches queued in ``batches``, as ``Recorder.take_batches`` does."""

    def __init__(self) -> None:
        self.batches: list[_Batch] = []

    def take_batches(self) -> list[_Batch]:
        out, self.batches = self.batches, []
        return out


class _Sink:
    def __init__(self) -> None:
        self.errors: list[BaseException] = []
        self.counted = 0

    def error(self, exc: BaseException) -> None:
        self.errors.append(exc)

    def count_error(self) -> None:
        self.counted += 1


def test_a_writer_of_its_own_writes_every_good_batch_and_counts_the_bad_one(tmp_path):
    """A batch that cannot be formatted loses only its own lines (counted in the
    writer's error sink, never raised); the batches around it are written whole."""
    rec, sink = _Recorder(), _Sink()
    w = LogWriter(str(tmp_path / "own.csv"), False, rec, sink, LogSettings(interval=3600.0))
    rec.batches = [_Batch(0x100, 3), _Batch(0x200, 2, fail=True), _Batch(0x300, 2)]
    w.flush()
    w.close()
    rows = _read(w.path)
    assert [int(r["pointer"], 0) for r in rows] == [0x100, 0x101, 0x102, 0x300, 0x301]
    assert w.n_lines == 5
    assert [str(e) for e in sink.errors] == ["cannot format this batch"]
    assert sink.counted == 0


def test_a_closed_writer_of_its_own_takes_no_more_records(tmp_path):
    """After close() the writer never takes the recorder's records (they belong to the
    next log), even when a batch fills and the writer is flushed again."""
    rec, sink = _Recorder(), _Sink()
    w = LogWriter(str(tmp_path / "closed.csv"), False, rec, sink, LogSettings(max_pending=0))
    w.start()
    w.close()
    rec.batches = [_Batch(0x100, 4)]
    w.batch_full()
    w.flush()
    assert len(rec.batches) == 1, "a closed writer took the next log's records"
    assert _read(w.path) == [] and sink.errors == []


# ------------------------------------------------------------------------------------------
# The observer's protocol: installed exactly while something needs it (stateful model)
# ------------------------------------------------------------------------------------------
def _observer_model():
    """A state machine over statistics scopes, logs, tracking, allocations and frees.

    Invariants after every step: the recorder is on the pools exactly while a scope,
    a log or tracking needs it; tracking is on exactly while track(True) or a tracking
    log asks for it; every open scope counts exactly the allocations made (and freed)
    while it was open; no error is swallowed."""
    import shutil
    import tempfile

    from hypothesis import strategies as hst
    from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

    class ObserverModel(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.dir = tempfile.mkdtemp(prefix="observer-model-")
            self.core = FakeCore()
            with _runtime.registry_lock():
                _runtime.POOLS.add(self.core)
            self.scopes: list[tuple[object, object, int]] = []  # (manager, Statistics, serial)
            self.expected: dict[int, list[int]] = {}  # serial -> [n_allocs, n_frees, live]
            self.serial = 0
            self.live: list[tuple[FakeBlock, tuple[int, ...]]] = []
            self.log: bool | None = None  # None: no log; else its track flag
            self.user_track = False
            self.next_ptr = 0x10000
            self.n_logs = 0

        def teardown(self) -> None:
            try:
                for b, _ in self.live:
                    free(b)
                for cm, _, _ in reversed(self.scopes):
                    cm.__exit__(None, None, None)
                stats.stop_log()
                stats.track(False)
            finally:
                with _runtime.registry_lock():
                    _runtime.POOLS.discard(self.core)
                shutil.rmtree(self.dir, ignore_errors=True)

        @rule()
        def open_scope(self) -> None:
            cm = stats.statistics()
            st = cm.__enter__()
            self.serial += 1  # not id(st): a closed scope's id may come back
            self.scopes.append((cm, st, self.serial))
            self.expected[self.serial] = [0, 0, 0]

        @precondition(lambda self: self.scopes)
        @rule(data=hst.data())
        def close_scope(self, data) -> None:
            i = data.draw(hst.integers(0, len(self.scopes) - 1))
            cm, st, serial = self.scopes.pop(i)
            cm.__exit__(None, None, None)
            assert not st.active
            del self.expected[serial]

        @rule(track=hst.booleans())
        def start_log(self, track: bool) -> None:
            self.n_logs += 1
            stats.start_log(os.path.join(self.dir, f"{self.n_logs}.csv"), track=track)
            self.log = track

        @rule()
        def stop_log(self) -> None:
            path = stats.stop_log()
            assert (path is None) == (self.log is None)
            self.log = None

        @rule(enabled=hst.booleans())
        def track(self, enabled: bool) -> None:
            assert stats.track(enabled) is self.user_track
            self.user_track = enabled

        @rule(size=hst.integers(0, 4096))
        def allocate(self, size: int) -> None:
            self.next_ptr += 0x1000
            b = alloc(self.core, self.next_ptr, size)
            inside = tuple(serial for _, _, serial in self.scopes)
            for k in inside:
                e = self.expected[k]
                e[0] += 1
                e[2] += size
            self.live.append((b, inside))

        @precondition(lambda self: self.live)
        @rule(data=hst.data())
        def free_one(self, data) -> None:
            b, inside = self.live.pop(data.draw(hst.integers(0, len(self.live) - 1)))
            free(b)
            for k in inside:
                if k in self.expected:
                    e = self.expected[k]
                    e[1] += 1
                    e[2] -= b.size

        @invariant()
        def installed_exactly_while_needed(self) -> None:
            tracking = self.user_track or bool(self.log)
            need = bool(self.scopes) or self.log is not None or tracking
            assert stats.is_tracking() is tracking
            assert (observer() is not None) is need
            assert self.core.observer is observer()
            assert [st for _, st, _ in self.scopes] == list(OBSERVER.scopes)
            assert (stats.log_path() is None) == (self.log is None)

        @invariant()
        def scopes_count_what_they_saw(self) -> None:
            for _, st, serial in self.scopes:
                n_allocs, n_frees, live = self.expected[serial]
                assert (st.n_allocs, st.n_frees, st.current_bytes) == (n_allocs, n_frees, live)

        @invariant()
        def no_error_swallowed(self) -> None:
            assert OBSERVER.n_errors == 0

    return ObserverModel


def test_observer_protocol_model():
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(
        _observer_model(),
        settings=hypothesis.settings(
            max_examples=40,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=list(hypothesis.HealthCheck),
        ),
    )


def test_an_observer_without_a_runtime_observes_nothing_and_fails_nothing(tmp_path):
    """The base install (no CUDA packages, so no runtime): scopes, a tracking log and
    their ends all work on an observer of its own, with nothing to record."""
    obs = Observer(sites=CallSites(), runtime=lambda: None)
    st = stats.Statistics()
    obs.add_scope(st)
    assert obs.active and obs.recorder is None
    path = obs.open_log(str(tmp_path / "base.csv"), False, True)
    assert obs.tracking and obs.writer is not None
    obs.remove_scope(st)
    assert st.end_time is not None and obs.active  # the log still needs it
    assert obs.close_log() == path
    assert not obs.active and not obs.tracking and obs.n_errors == 0
    assert _read(path) == []
