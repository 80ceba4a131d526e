"""CPU tests of the observation recorder, both implementations (compiled and twin).

The Recorder needs no driver: each implementation is driven directly with fake pools
(``fakes.observer``) and through its own hot path (``PoolCore._make_block`` and the
block's free need no CUDA call with a reuse cache and the legacy stream), and their
transcripts are compared: counters, records, CSV lines.
"""

from __future__ import annotations

import csv
import io
import os
import sys
import threading
from array import array
from pathlib import Path

import pytest
from fakes.hotpath import compiled_hotpath
from fakes.observer import FAKES_FILE, FakeBlock, FakeCore, InterruptedName

from cupy_poolmem import _hotpath_py as twin
from cupy_poolmem import _runtime, stats

pytestmark = pytest.mark.filterwarnings("ignore:ExternalStream is deprecated")

PKG = os.path.join(os.path.dirname(stats.__file__), "")


IMPLS = [pytest.param(twin, id="twin")]
if compiled_hotpath() is not None:
    IMPLS.append(pytest.param(compiled_hotpath(), id="cython"))


class _Tls(threading.local):
    """What stats' thread-local gives the recorder: ``tag`` and ``thread``."""

    tag = ""

    def __init__(self) -> None:
        self.thread = threading.current_thread()


class Rig:
    """A recorder of one implementation with its own tag state and callbacks."""

    def __init__(self, hp) -> None:
        self.hp = hp
        self.rec = hp.Recorder()
        self.tls = _Tls()
        self.tags = array("q", [0])
        self.full = 0
        self.errors: list[BaseException] = []
        self.rec.configure(self.tls, self.tags, self._full, self.errors.append, self._reserved)
        self.rec.set_sites((FAKES_FILE, PKG), 32)

    def _full(self) -> None:
        self.full += 1

    @staticmethod
    def _reserved(core) -> int | None:
        return getattr(core, "reserved", None)

    def alloc(self, core, ptr, size, stream=0):
        b = FakeBlock(core, ptr, size, stream)
        self.rec.on_alloc(b)  # ALLOC-SITE
        return b

    def free(self, b) -> None:
        self.rec.on_free(b.core, b.ptr, b.size, b.stream_ptr, b.info)

    def tag(self, name: str) -> None:
        self.tags[0] = 1 if name else 0
        self.tls.tag = name

    def rows(self) -> list[tuple]:
        """Every record so far, time left out (it differs between two runs)."""
        return [r[1:] for b in self.rec.take_batches() for r in b.rows()]


def _alloc_line() -> int:
    src = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(src, 1) if "# ALLOC-SITE" in line)


def _scope(s) -> tuple:
    per_tag = {
        k: (c.n_allocs, c.n_frees, c.total_bytes, c.current_bytes, c.peak_bytes)
        for k, c in s.per_tag.items()
    }
    return (s.n_allocs, s.n_frees, s.current_bytes, s.peak_used_bytes, s.total_bytes, per_tag)


def _transcript(hp) -> dict:
    """One scripted run: scopes with filters, nesting, tags, a log, frees of memory
    from before, size 0, a guard line; everything observable comes back."""
    g = Rig(hp)
    rec = g.rec
    d0 = FakeCore(0, reserved=1000)
    d1 = FakeCore(1, reserved=2000)
    pin = FakeCore(-1, kind=1, reserved=300)
    rec.start()
    rec.baseline(d0, 100, 1000)
    before = g.alloc(d0, 0x10, 5)  # observed, before any scope
    s_all = rec.add_scope(None, None)
    s_dev1 = rec.add_scope(1, None)
    s_pin = rec.add_scope(None, 1)
    rec.set_logging(True)
    rec.tracking = True
    a = g.alloc(d0, 0x1000, 100, stream=7)
    g.tag("model")
    b = g.alloc(d1, 0x2000, 200)
    g.tag("model/attn")
    c = g.alloc(pin, 0x3000, 30)
    inner = rec.add_scope(None, None)
    z = g.alloc(d0, 0, 0)  # size 0: counted, not live
    g.free(a)  # from before `inner`
    g.tag("")
    e = g.alloc(d1, 0x4000, 400)
    g.free(before)
    g.free(c)
    rec.note(d1, "guard:out_of_bounds", 0x4000, 400, 0, "model", "alloc x | free y")
    rec.remove_scope(inner)
    g.free(e)  # after `inner` ended: not counted by it
    rec.tracking = False
    f = g.alloc(d0, 0x5000, 50)
    infos = [
        (i.serial, i.tag, i.callsite, i.ptr, i.size, i.stream, i.device)
        for i in (b.info, z.info, f.info)
    ]
    live = sorted((i.ptr, i.size, i.device) for i in rec.live(None))
    live_d1 = sorted(i.ptr for i in rec.live(d1))
    scopes = [_scope(s) for s in (s_all, s_dev1, s_pin, inner)]
    rows = g.rows()
    assert not g.errors, g.errors
    return {
        "infos": infos,
        "live": live,
        "live_d1": live_d1,
        "scopes": scopes,
        "rows": rows,
        "start": [s.start_serial for s in (s_all, inner)],
    }


@pytest.mark.parametrize("hp", IMPLS)
def test_transcript_numbers(hp):
    t = _transcript(hp)
    site = f"{__file__}:{_alloc_line()} in alloc"
    s_all, s_dev1, s_pin, inner = t["scopes"]
    # a, b, c, z, e, f: 6 allocations; frees of a, c, e (before: not the scope's).
    assert s_all[:5] == (6, 3, 250, 630, 780)
    assert s_all[5] == {
        "": (3, 2, 550, 50, 400),
        "model": (1, 0, 200, 200, 200),
        "model/attn": (2, 1, 30, 0, 30),
    }
    assert s_dev1[:5] == (2, 1, 200, 600, 600)
    assert s_pin[:5] == (1, 1, 0, 30, 30) and set(s_pin[5]) == {"model/attn"}
    assert inner[:5] == (2, 0, 400, 400, 400)  # z and e; e freed after it ended
    assert t["infos"][0][1:] == ("model", site, 0x2000, 200, 0, 1)
    assert t["infos"][1][1:] == ("model/attn", site, 0, 0, 0, 0)
    assert t["infos"][2][1:] == ("", None, 0x5000, 50, 0, 0)
    assert t["live"] == [(0x2000, 200, 1), (0x5000, 50, 0)]
    assert t["live_d1"] == [0x2000]
    ops = [(r[6], r[0], r[1], r[3]) for r in t["rows"]]  # op, ptr, size, used
    assert ops == [
        ("alloc", 0x1000, 100, 205),  # used: 100 baseline + before's 5 + 100
        ("alloc", 0x2000, 200, 200),
        ("alloc", 0x3000, 30, 30),
        ("alloc", 0, 0, 205),
        ("free", 0x1000, 100, 105),
        ("alloc", 0x4000, 400, 600),
        ("free", 0x10, 5, 100),
        ("free", 0x3000, 30, 0),
        ("guard:out_of_bounds", 0x4000, 400, 600),
        ("free", 0x4000, 400, 200),
        ("alloc", 0x5000, 50, 150),
    ]
    r0 = t["rows"][0]
    assert r0[2] == 7 and r0[4] == 1000 and r0[5] == 0  # stream, reserved, device
    assert r0[7] == threading.current_thread().name and r0[8] == "" and r0[9] == site
    assert t["rows"][2][4] == 300 and t["rows"][2][5] == -1  # pinned: its own reserved
    assert t["rows"][4][8:] == ("", site)  # a free carries its allocation's tag and site
    assert t["rows"][6][8:] == ("", None)  # allocated before tracking
    assert t["rows"][8][8:] == ("model", "alloc x | free y")


@pytest.mark.skipif(len(IMPLS) < 2, reason="the Cython hot path is not built in this checkout")
def test_compiled_recorder_matches_the_twin():
    assert _transcript(IMPLS[1].values[0]) == _transcript(twin)


# ------------------------------------------------------------------------------------------
# Through the hot path itself (compiled and twin), without a GPU
# ------------------------------------------------------------------------------------------
def _core(hp):
    """A pool core of ``hp`` whose blocks stay on the legacy stream and in its reuse cache."""

    class Core(hp.PoolCore):
        pass

    c = Core.__new__(Core)
    c._attach(0, 0, hp.KIND_DEVICE)
    c.cache_limit, c.cache_max_block = 1 << 30, 1 << 20
    return c


def _observed(hp):
    """A recorder of ``hp`` observing a pool core, logging, one scope open:
    ``(rig, core, stream, scope)``; the core's blocks are on the legacy stream."""
    import cupy

    g = Rig(hp)
    core = _core(hp)
    core.observer = g.rec
    stream = cupy.cuda.ExternalStream(0, 0)
    g.rec.start()
    g.rec.set_logging(True)
    return g, core, stream, g.rec.add_scope(None, None)


def _hot_transcript(hp) -> tuple:
    import cupy

    g = Rig(hp)
    core = _core(hp)
    core.observer = g.rec
    stream = cupy.cuda.ExternalStream(0, 0)
    g.rec.start()
    scope = g.rec.add_scope(None, None)
    g.rec.set_logging(True)
    g.rec.tracking = True
    m1 = core._make_block(0x1000, 64, stream, 0)  # HOT-SITE
    g.tag("t")
    m2 = core._make_block(0x2000, 128, stream, 0)
    info = m2.mem._owner.info
    del m1
    g.tag("")
    m3 = core._make_block(0x1000, 64, stream, 0)  # reused from the cache
    del m2, m3
    rows = [(r[6], r[0], r[1], r[8], r[9]) for r in g.rows()]
    assert not g.errors, g.errors
    return (
        _scope(scope),
        (info.tag, info.ptr, info.size, info.device),
        rows,
        (core.n_allocs, core.n_frees, core.live_bytes, core.cached_bytes),
        g.rec.live(None),
    )


@pytest.mark.parametrize("hp", IMPLS)
def test_the_hot_path_feeds_the_recorder(hp):
    src = Path(__file__).read_text().splitlines()
    line = next(i for i, t in enumerate(src, 1) if "# HOT-SITE" in t)
    scope, info, rows, counters, live = _hot_transcript(hp)
    assert scope == (3, 3, 0, 192, 256, {"": (2, 2, 128, 0, 64), "t": (1, 1, 128, 0, 128)})
    assert info == ("t", 0x2000, 128, 0)
    site = f"{__file__}:{line} in _hot_transcript"
    assert rows[0] == ("alloc", 0x1000, 64, "", site)
    assert [r[:3] for r in rows] == [
        ("alloc", 0x1000, 64),
        ("alloc", 0x2000, 128),
        ("free", 0x1000, 64),
        ("alloc", 0x1000, 64),
        ("free", 0x2000, 128),
        ("free", 0x1000, 64),
    ]
    assert rows[4][3] == "t"
    assert counters == (3, 3, 0, 256) and live == []  # all three in the cache


@pytest.mark.parametrize("hp", IMPLS)
def test_the_hot_paths_own_frames_do_not_count_against_the_depth(hp):
    """Depth counts Python frames from the hot path's caller: the compiled hot path
    has no frames, and the twin's (its pool core's and its recorder's) are not walked."""
    g, core, stream, scope = _observed(hp)
    g.rec.tracking = True
    g.rec.set_sites((FAKES_FILE, PKG), 1)  # only the caller's frame may be the site
    m = core._make_block(0x1000, 64, stream, 0)  # DEPTH-SITE
    src = Path(__file__).read_text().splitlines()
    line = next(i for i, t in enumerate(src, 1) if "# DEPTH-SITE" in t and "src" not in t)
    assert m.mem._owner.info.callsite == f"{__file__}:{line} in {sys._getframe().f_code.co_name}"
    del m
    g.rec.remove_scope(scope)
    assert not g.errors, g.errors


@pytest.mark.skipif(len(IMPLS) < 2, reason="the Cython hot path is not built in this checkout")
def test_compiled_hot_path_matches_the_twin():
    assert _hot_transcript(IMPLS[1].values[0]) == _hot_transcript(twin)


# ------------------------------------------------------------------------------------------
# Batches and their CSV lines
# ------------------------------------------------------------------------------------------
def _parse(data: bytes) -> list[list[str]]:
    return list(csv.reader(io.StringIO(data.decode("utf-8"), newline="")))


@pytest.mark.parametrize("hp", IMPLS)
@pytest.mark.parametrize("n", [1, 4095, 4096, 4097, 10_000])
def test_batches_keep_every_record_in_order(hp, n):
    assert hp.LOG_BATCH == 4096
    g = Rig(hp)
    core = FakeCore(0, reserved=1 << 20)
    g.rec.start()
    g.rec.set_logging(True)
    for i in range(n):
        g.rec.note(core, "alloc", i, i + 1, 0, "", None)
    assert g.full == n // hp.LOG_BATCH  # the writer is woken once per full batch
    batches = g.rec.take_batches()
    assert [len(b) for b in batches[:-1]] == [hp.LOG_BATCH] * (len(batches) - 1)
    assert sum(len(b) for b in batches) == n
    ptrs = [r[1] for b in batches for r in b.rows()]
    assert ptrs == list(range(n))
    lines = [row for b in batches for row in _parse(b.format(4242))]
    assert [int(r[6], 16) for r in lines] == list(range(n))
    assert g.rec.take_batches() == []


@pytest.mark.parametrize("hp", IMPLS)
def test_csv_lines_quote_like_the_csv_module_and_read_back(hp):
    g = Rig(hp)
    core = FakeCore(3, reserved=-1)
    g.rec.start()
    g.rec.set_logging(True)
    odd = ["a,b", 'say "hi"', "two\nlines", "cr\rhere", "ünï", "plain", ""]
    for i, s in enumerate(odd):
        g.rec.note(core, "guard:x", 0xABC + i, i, 2**63 + i, s, s or None)
    g.rec.note(core, "op", (1 << 64) - 1, (1 << 64) - 1, 0, "bad \udce9 utf-8", "x")
    (batch,) = g.rec.take_batches()
    rows = batch.rows()
    data = batch.format(7)
    parsed = _parse(data)
    for r, p in zip(rows, parsed):
        ns, ptr, size, stream, used, reserved, dev, op, thread, tag, site = r
        assert p[0] == f"{ns // 10**9}.{ns // 1000 % 10**6:06d}"
        assert p[1:] == [
            "7",
            thread,
            str(dev),
            str(stream),
            op,
            f"0x{ptr:x}",
            str(size),
            tag.encode("utf-8", "backslashreplace").decode("utf-8"),
            site or "",
            "" if used < 0 else str(used),
            "" if reserved < 0 else str(reserved),
        ]
    assert parsed[-1][8] == "bad \\udce9 utf-8"
    # The quoting is the csv module's (QUOTE_MINIMAL), byte for byte; and a lone '\r',
    # which Python 3.11's writer leaves bare when lines end with '\n', is quoted.
    lines = data.decode("utf-8")
    for row in parsed:
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerow(row)
        line = out.getvalue()
        if "\r" in line:
            line = line.replace("cr\rhere", '"cr\rhere"')
        assert line in lines


@pytest.mark.skipif(len(IMPLS) < 2, reason="the Cython hot path is not built in this checkout")
def test_compiled_csv_lines_match_the_twin():
    fields = ["a,b", 'q"q', "n\nl", "\r", "é", "", "x" * 300]
    out = []
    for hp in (twin, IMPLS[1].values[0]):
        g = Rig(hp)
        core = FakeCore(0)
        g.rec.start()
        g.rec.set_logging(True)
        for i, s in enumerate(fields):
            g.rec.note(core, s or "op", i << 40, i, i, s, s)
        (batch,) = g.rec.take_batches()
        # Same records but for the times: give the twin's lines the compiled one's times.
        lines = batch.format(99).decode().split("\n")
        out.append([ln.split(",", 1)[1] if ln else ln for ln in lines])
    assert out[0] == out[1]


# ------------------------------------------------------------------------------------------
# Tags, threads, errors, fork
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hp", IMPLS)
def test_the_thread_local_is_read_only_while_a_tag_scope_is_open(hp):
    g = Rig(hp)
    g.rec.start()
    core = FakeCore()
    g.tls.tag = "stale"  # no scope open (count 0): not read
    assert g.alloc(core, 0x10, 1).info.tag == ""
    g.tags[0] = 1
    assert g.alloc(core, 0x20, 1).info.tag == "stale"


@pytest.mark.parametrize("hp", IMPLS)
def test_many_threads_under_nested_scopes_lose_nothing(hp):
    g = Rig(hp)
    rec = g.rec
    rec.start()
    rec.set_logging(True)
    outer = rec.add_scope(None, None)
    cores = [FakeCore(0), FakeCore(1)]
    n_threads, n_iter = 8, 1500
    go = threading.Barrier(n_threads + 1, timeout=30)
    g.tags[0] = 1

    def work(k: int) -> None:
        g.tls.tag = f"t{k % 3}"
        go.wait()
        core = cores[k % 2]
        held = []
        for i in range(n_iter):
            held.append(g.alloc(core, (k + 1) << 40 | (i + 1) << 8, 16 + k))
            if len(held) > 3:
                g.free(held.pop(0))
        for b in held:
            g.free(b)

    ts = [threading.Thread(target=work, args=(k,), name=f"w{k}") for k in range(n_threads)]
    for t in ts:
        t.start()
    go.wait()
    inner = rec.add_scope(1, None)  # opened while the threads run
    for t in ts:
        t.join(timeout=120)
    rec.remove_scope(inner)
    total = sum((16 + k) * n_iter for k in range(n_threads))
    assert (outer.n_allocs, outer.n_frees, outer.current_bytes) == (n_threads * n_iter,) * 2 + (0,)
    assert outer.total_bytes == total
    assert 0 < outer.peak_used_bytes <= sum(4 * (16 + k) for k in range(n_threads))
    assert {k: (c.n_allocs, c.current_bytes) for k, c in outer.per_tag.items()} == {
        f"t{j}": (n_iter * len(range(j, n_threads, 3)), 0) for j in range(3)
    }
    assert inner.n_frees <= inner.n_allocs and inner.current_bytes >= 0
    assert rec.live(None) == []
    rows = g.rows()
    assert len(rows) == 2 * n_threads * n_iter
    for k in range(n_threads):  # each thread's events in its own order
        mine = [(r[6], r[0]) for r in rows if r[7] == f"w{k}"]
        assert len(mine) == 2 * n_iter and mine[0][0] == "alloc"
        assert {r[8] for r in rows if r[7] == f"w{k}"} == {f"t{k % 3}"}
    used = {0: 0, 1: 0}
    for r in rows:  # `used` follows the events one by one, per device
        used[r[5]] += r[1] if r[6] == "alloc" else -r[1]
        assert r[3] == used[r[5]]


@pytest.mark.parametrize("hp", IMPLS)
def test_errors_are_counted_never_raised(hp):
    g = Rig(hp)
    g.rec.start()
    g.rec.on_free(object(), 0x10, 8, 0, None)  # a core without attributes
    g.rec.on_free(None, "x", None, None, ("bad",))
    g.rec.on_alloc(FakeBlock(object(), 0x10, 8))
    g.rec.on_alloc(FakeBlock(FakeCore(), "not a pointer", 8))
    g.rec.on_alloc(None)
    assert g.rec.n_errors == 5 and len(g.errors) == 5


@pytest.mark.parametrize("hp", IMPLS)
def test_after_fork_drops_the_parents_records(hp):
    g = Rig(hp)
    core = FakeCore()
    g.rec.start()
    g.rec.set_logging(True)
    for i in range(5000):  # a full batch and a partial one
        g.rec.note(core, "alloc", i, 1, 0, "", None)
    g.rec.after_fork()
    assert g.rec.take_batches() == []
    g.rec.note(core, "alloc", 1, 1, 0, "", None)
    assert [len(b) for b in g.rec.take_batches()] == [1]


@pytest.mark.parametrize("hp", IMPLS)
def test_a_restart_forgets_the_live_list_and_pool_records(hp):
    g = Rig(hp)
    core = FakeCore()
    g.rec.start()
    a = g.alloc(core, 0x10, 8)
    g.rec.stop()
    g.rec.start()
    assert g.rec.live(None) == []
    s = g.rec.add_scope(None, None)
    g.free(a)  # observed before the restart: no scope counts it
    assert (s.n_frees, s.current_bytes) == (0, 0)
    del a  # its Info leaves no dangling link behind
    b = g.alloc(core, 0x20, 8)
    assert [i.ptr for i in g.rec.live(None)] == [0x20]
    g.free(b)
    assert g.rec.live(None) == [] and not g.errors


def test_the_package_recorder_is_the_hot_paths():
    assert isinstance(_runtime.RECORDER, _runtime.hp.Recorder)


@pytest.mark.parametrize("hp", IMPLS)
def test_call_sites_walk_skipped_frames_up_to_depth(hp, tmp_path, monkeypatch):
    helper = tmp_path / "deep_helper.py"
    helper.write_text(
        "def nest(k, fn):\n    if k == 0:\n        return fn()\n    return nest(k - 1, fn)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "deep_helper", raising=False)  # the other run's
    import deep_helper

    g = Rig(hp)
    g.rec.start()
    g.rec.tracking = True
    core = FakeCore()
    # Frames: Rig.alloc (this file), nest x5 (skipped), the lambda's caller here.
    g.rec.set_sites((FAKES_FILE, PKG, str(helper)), 32)
    b = deep_helper.nest(4, lambda: g.alloc(core, 0x10, 1))
    assert b.info.callsite == f"{__file__}:{_alloc_line()} in alloc"
    # Skip this file too: the walk goes through the lambda, alloc, 5 nest frames...
    g.rec.set_sites((FAKES_FILE, PKG, str(helper), __file__), 32)
    for _ in range(2):  # the second time from the caches
        b = deep_helper.nest(4, lambda: g.alloc(core, 0x20, 1))
        line = b.info.callsite
        assert line is not None and not line.startswith((__file__, str(helper)))
    # ...and never more than `depth` frames: alloc, lambda, 5 nest frames are 7.
    g.rec.set_sites((FAKES_FILE, PKG, str(helper), __file__), 7)
    assert deep_helper.nest(4, lambda: g.alloc(core, 0x30, 1)).info.callsite is None
    assert not g.errors


# ------------------------------------------------------------------------------------------
# A signal's exception (Ctrl-C, SystemExit) inside an observed allocation
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hp", IMPLS)
def test_keyboard_interrupt_in_an_observed_allocation_propagates_and_stays_counted(hp):
    """Only an Exception of the pre-step is counted as an observer error; a
    KeyboardInterrupt reaches the program, after the allocation was counted (with a
    Info on the block), so that the block, dropped by the caller, has its free counted."""

    g, core, stream, scope = _observed(hp)
    g.tls.thread = InterruptedName(threading.current_thread().name)
    with pytest.raises(KeyboardInterrupt):
        core._make_block(0x1000, 64, stream, 0)
    import gc

    gc.collect()  # the interrupted frame's block
    ops = [(r[7], r[1]) for b in g.rec.take_batches() for r in b.rows()]
    assert not g.errors and g.rec.n_errors == 0
    assert ops == [("alloc", 0x1000), ("free", 0x1000)]
    assert (scope.n_allocs, scope.n_frees, scope.current_bytes) == (1, 1, 0)
    assert g.rec.live(None) == []


@pytest.mark.parametrize("hp", IMPLS)
def test_system_exit_in_an_observed_allocation_propagates(hp):
    g = Rig(hp)
    g.rec.start()
    core = FakeCore()

    class _Exit:
        @property
        def name(self) -> str:
            raise SystemExit(3)

    g.tls.thread = _Exit()
    g.rec.set_logging(True)
    b = FakeBlock(core, 0x10, 8)
    with pytest.raises(SystemExit):
        g.rec.on_alloc(b)
    assert b.info is not None and b.info.tag == ""
    g.rec.set_logging(False)
    g.free(b)
    assert g.rec.live(None) == [] and not g.errors


def test_twin_scope_opened_by_another_thread_mid_allocation():
    """A statistics() scope opened by another thread between the twin's pre-step
    (which makes the per-tag counters) and its locked step has no counters for the
    tag: the allocation is still observed, and its free leaves nothing listed."""
    g = Rig(twin)
    core = FakeCore()
    g.rec.start()
    orig = g.rec._prepare_tags

    def prepare_then_switch(*args):
        orig(*args)
        g.rec.add_scope(None, None)  # another thread enters statistics() here

    g.rec._prepare_tags = prepare_then_switch
    g.tag("t")
    b = g.alloc(core, 0x10, 8)
    g.rec._prepare_tags = orig
    assert b.info is not None
    g.free(b)
    assert not g.errors, g.errors
    assert g.rec.live(None) == []


@pytest.mark.skipif(not os.environ.get("CUPY_POOLMEM_STRESS"), reason="set CUPY_POOLMEM_STRESS=1")
@pytest.mark.parametrize("hp", IMPLS)
def test_stress_scopes_opened_while_threads_allocate(hp):
    import time

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        g = Rig(hp)
        g.rec.start()
        g.tags[0] = 1
        core = FakeCore()
        stop = threading.Event()

        def scoper():
            while not stop.is_set():
                g.rec.remove_scope(g.rec.add_scope(None, None))

        t = threading.Thread(target=scoper)
        t.start()
        held, i, t0 = [], 0, time.time()
        while time.time() - t0 < 3:
            g.tls.tag = f"t{i % 50}"
            held.append(g.alloc(core, 0x1000 + i, 8))
            if len(held) > 10:
                g.free(held.pop(0))
            i += 1
        stop.set()
        t.join()
        for b in held:
            g.free(b)
    finally:
        sys.setswitchinterval(old)
    assert not g.errors and g.rec.live(None) == []


# ------------------------------------------------------------------------------------------
# A block that dies in a garbage cycle keeps what its Info says
# ------------------------------------------------------------------------------------------
class _Cycle:
    pass


@pytest.mark.parametrize("hp", IMPLS)
def test_block_freed_in_a_garbage_cycle_keeps_its_tag_and_call_site(hp):
    """Only the block refers to its Info: when the block dies in a reference cycle (an
    exception's traceback holding a frame that holds the array), the collector must
    not empty the Info before the block's free reads its tag, call site and pool."""
    import gc

    g, core, stream, scope = _observed(hp)
    g.rec.tracking = True
    untagged = core._make_block(0x1000, 32, stream, 0)  # live all along, untagged
    g.tag("model")
    m = core._make_block(0x2000, 64, stream, 0)
    g.tag("")
    site = m.mem._owner.info.callsite
    assert site is not None
    holder = _Cycle()
    holder.me, holder.arr = holder, m  # made after the block: the collector meets it last
    del m, holder
    gc.collect()
    rows = [(r[7], r[1], r[9], r[10]) for b in g.rec.take_batches() for r in b.rows()]
    per_tag = {k: (c.n_allocs, c.n_frees, c.current_bytes) for k, c in scope.per_tag.items()}
    del untagged  # before any assert: a failing test's frame must not keep a block
    assert not g.errors, g.errors
    assert (rows[-1], per_tag) == (
        ("free", 0x2000, "model", site),
        {"": (1, 0, 32), "model": (1, 1, 0)},
    )


@pytest.mark.parametrize("hp", IMPLS)
def test_blocks_freed_from_an_exception_cycle_balance_their_tag(hp):
    """The common form: ``except E as e: err = e`` keeps a frame (with its arrays) in
    a cycle; collected later, every free is charged to its tag, none to untagged."""
    import gc

    g, core, stream, scope = _observed(hp)

    def work():
        g.tag("model")
        arrs = [core._make_block(0x3000 + 0x100 * i, 16, stream, 0) for i in range(4)]
        g.tag("")
        try:
            raise ValueError(len(arrs))
        except ValueError as exc:
            return exc  # its traceback holds this frame, which holds the arrays

    err = work()
    err.keep = err  # a cycle through the exception
    del err
    gc.collect()
    per_tag = {k: (c.n_allocs, c.n_frees, c.current_bytes) for k, c in scope.per_tag.items()}
    assert not g.errors, g.errors
    assert per_tag == {"model": (4, 4, 0)}
    frees = [r[9] for b in g.rec.take_batches() for r in b.rows() if r[7] == "free"]
    assert frees == ["model"] * 4
    assert g.rec.live(None) == []


@pytest.mark.parametrize("hp", IMPLS)
def test_format_a_string_with_a_lone_surrogate_and_non_ascii(hp):
    """A string UTF-8 cannot encode (a lone surrogate, from an undecodable byte of a
    file name) next to other non-ASCII characters: the surrogate is written as a
    backslash escape, the rest as UTF-8, by both implementations."""
    g = Rig(hp)
    core = FakeCore()
    g.rec.start()
    g.rec.set_logging(True)
    g.rec.note(core, "alloc", 1, 8, 0, "before", None)
    g.rec.note(core, "alloc", 2, 8, 0, "caf\u00e9/\udcff", "/data/caf\u00e9/\udcff.py:3 in f")
    g.rec.note(core, "alloc", 3, 8, 0, "after", None)
    (batch,) = g.rec.take_batches()
    lines = batch.format(1).decode("utf-8").splitlines()
    assert len(lines) == 3
    assert lines[1].split(",")[8] == "caf\u00e9/\\udcff"  # as the twin writes it


@pytest.mark.parametrize("hp", IMPLS)
def test_install_counts_a_pools_live_bytes_once(hp):
    """install() sets the observer and counts the bytes already live in the pool;
    on a pool it already observes (made after the global observer was set) it adds
    nothing, so those bytes, counted by the hook, are not counted again."""
    import cupy

    g = Rig(hp)
    core = _core(hp)
    stream = cupy.cuda.ExternalStream(0, 0)
    before = core._make_block(0x1000, 64, stream, 0)  # not observed
    g.rec.start()
    g.rec.set_logging(True)
    g.rec.install(core, None)
    assert core.observer is g.rec
    after = core._make_block(0x2000, 32, stream, 0)
    g.rec.install(core, None)  # again: nothing added
    del before
    rows = [(r[7], r[1], r[4]) for b in g.rec.take_batches() for r in b.rows()]
    del after
    assert rows == [("alloc", 0x2000, 96), ("free", 0x1000, 32)]


# ------------------------------------------------------------------------------------------
# note() with a None tag
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hp", IMPLS)
def test_note_with_a_none_tag_writes_an_empty_field(hp):
    """Recorder.note(..., tag=None, callsite=None): empty fields, in both
    implementations (the compiled one wrote the text "None" for the tag)."""
    g = Rig(hp)
    g.rec.start()
    g.rec.set_logging(True)
    g.rec.note(FakeCore(), "guard:double_free", 0x10, 8, 0, None, None)
    (batch,) = g.rec.take_batches()
    line = batch.format(1).decode()
    assert line.rstrip("\n").split(",")[8:10] == ["", ""]
