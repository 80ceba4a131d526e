# ruff: noqa: F811  (the fixtures are tests/fakes/expandable.py's, imported)
"""``DevicePool(large_blocks="expandable")`` under races on a CPU: other threads' hot
paths between two steps of the ranges' slow paths, per-thread default streams, a
capture under way during a trim, a collection inside the twin arena (reproducers of
faults once found, kept)."""

from __future__ import annotations

import threading

import pytest
from fakes.expandable import SPAN, drv, expandable_twin, made, world  # noqa: F401  (fixtures)
from fakes.hotpath import compiled_hotpath

from cupy_poolmem import _arena_py, _driver, _expandable

pytestmark = pytest.mark.filterwarnings("ignore:ExternalStream is deprecated")

MiB = 1 << 20
ARENAS = [_arena_py.Arena]
_hp = compiled_hotpath()
if _hp is not None:
    ARENAS.append(_hp.ARENA)


@pytest.fixture(params=ARENAS, ids=lambda a: a.__module__.rsplit(".", 1)[1])
def arena_cls(request):
    return request.param


def _ranges(drv, arena_cls):
    return _expandable.ExpandableBlocks(
        0, span=SPAN, arena=arena_cls, driver=drv, sync=drv.sync_device
    )


# 1. CU_STREAM_PER_THREAD (2) is a different stream in every thread, yet one arena pair.
def test_per_thread_default_stream_block_goes_to_another_thread_at_once(drv, arena_cls):
    b = _ranges(drv, arena_cls)
    got = {}

    def thread_a():
        p = b.alloc(4 * MiB, 2)[1]
        drv.busy.add(2)  # thread A's kernel on ITS per-thread stream still uses p
        b.free(p, 2)  # (the hot path's _arena_give does the same, no event)
        got["a"] = p

    def thread_b():
        got["b"] = b.alloc(4 * MiB, 2)[1]  # thread B's per-thread stream: unordered

    for f in (thread_a, thread_b):
        t = threading.Thread(target=f)
        t.start()
        t.join()
    assert got["b"] != got["a"], "block handed to another thread's stream while in use"


def test_twin_pool_per_thread_default_stream(world, drv):  # noqa: F811
    import cupy

    p, b = expandable_twin(world, drv)
    world.current = cupy.cuda.ExternalStream(2, 0)  # cupy.cuda.Stream.ptds's handle
    got = {}

    def thread_a():
        x = p.malloc(4 * MiB)
        got["a"] = x.ptr
        del x  # freed: back to arena (2,) at once

    def thread_b():
        got["b"] = p.malloc(4 * MiB).ptr

    for f in (thread_a, thread_b):
        t = threading.Thread(target=f)
        t.start()
        t.join()
    assert got["b"] != got["a"], "block handed to another thread's stream while in use"


# 2. release(wait=False): the idle check is once per stream, before the loop; a block
#    freed meanwhile (GIL released in cuMemUnmap) with pending work is unmapped.
def test_release_nowait_unmaps_a_step_freed_after_the_idle_check(drv, arena_cls):
    b = _ranges(drv, arena_cls)
    ps = [b.alloc(20 * MiB, 0x5000)[1] for _ in range(2)]
    b.free(ps[1], 0x5000)  # top step free, stream idle
    b.free(b.alloc(20 * MiB, 0x6000)[1], 0x6000)  # another stream's free room, busy:
    drv.busy.add(0x6000)  # counted in release's `free`, never unmapped here
    unmapped_while_busy = []
    real_unmap = drv.cuMemUnmap

    def unmap(va, n):
        if 0x5000 in drv.busy:
            unmapped_while_busy.append(va)
        if va == ps[1]:  # another thread, while this one waits in the driver:
            drv.busy.add(0x5000)  # launches a kernel on ps[0] and frees it
            b.free(ps[0], 0x5000)
        return real_unmap(va, n)

    drv.cuMemUnmap = unmap
    b.release(0, wait=False)
    assert unmapped_while_busy == [], "unmapped a step its stream is still using"


# 2b. trim(sync=True): release(wait=True) trusts a sync made before cuMemPoolTrimTo;
#     a block freed by another thread in between is unmapped with its kernel running.
def test_trim_unmaps_a_block_freed_after_its_sync(made, monkeypatch):  # noqa: F811
    import cupy_poolmem as cpm

    p = cpm.DevicePool(large_blocks="expandable")
    b = p._backend
    ps = [b.alloc(20 * MiB, 0x5000)[1] for _ in range(2)]
    b.free(ps[1], 0x5000)
    p._synchronize = lambda: made.drv.busy.discard(0x5000)

    def other_thread_frees(pool, keep):
        made.drv.busy.add(0x5000)  # kernel using ps[0] queued after the sync
        b.free(ps[0], 0x5000)
        return (0,)

    monkeypatch.setattr(_driver.get(), "cuMemPoolTrimTo", other_thread_frees)
    real_unmap, busy_unmaps = made.drv.cuMemUnmap, []

    def unmap(va, n):
        if 0x5000 in made.drv.busy:
            busy_unmaps.append(va)
        return real_unmap(va, n)

    made.drv.cuMemUnmap = unmap
    p.trim()
    assert busy_unmaps == [], "trim unmapped memory of a stream still running"


# 3. release's check of the top step and its cut_tail are two steps: a hot-path take
#    in another thread in between makes cut_tail raise ValueError out of trim().
def test_release_raises_valueerror_when_a_take_lands_between_check_and_cut(drv):
    class Racy(_arena_py.Arena):
        def cut_tail(self, n):
            self.take(1 * MiB + 1)  # another thread's hot path, between check and cut
            return super().cut_tail(n)

    import cupy_poolmem as cpm

    b = _expandable.ExpandableBlocks(0, span=SPAN, arena=Racy, driver=drv, sync=drv.sync_device)
    ps = [b.alloc(20 * MiB, 0x5000)[1] for _ in range(2)]
    b.free(ps[1], 0x5000)
    try:
        b.release(0)
    except cpm.PoolmemError:
        pass
    except Exception as exc:
        pytest.fail(f"release raised {type(exc).__name__} outside the hierarchy: {exc}")


# 4. alloc(): after _grow, the hot path of another thread may take the new room before
#    alloc's own take: a spurious out-of-memory (the pool then gc's, syncs, trims).
def test_alloc_reports_oom_when_another_thread_takes_the_room_it_just_mapped(drv):
    class Racy(_arena_py.Arena):
        stolen = False

        def extend(self, n):
            super().extend(n)
            if not Racy.stolen:  # another thread's hot path, right after the extend
                Racy.stolen = bool(self.take(n))

    b = _expandable.ExpandableBlocks(0, span=SPAN, arena=Racy, driver=drv, sync=drv.sync_device)
    err, ptr = b.alloc(4 * MiB, 0x5000)
    assert err == 0, f"spurious CUresult {err} with {SPAN >> 20} MiB of range free"


# 5. trim(sync=False) during a capture (what _graph_alloc's OOM retry and _reclaim do):
#    release(wait=False) calls cuStreamQuery on every stream with ranges, the capturing
#    one too: CUDA forbids querying a capturing stream (or the legacy stream while a
#    blocking stream captures) and invalidates the capture.
def test_trim_during_capture_queries_the_capturing_stream(world, drv):  # noqa: F811
    p, b = expandable_twin(world, drv)
    x = p.malloc(30 * MiB)  # made before the capture, on the stream that will capture
    del x
    queried = []
    drv.cuStreamQuery = lambda s: (queried.append(s), (0,))[1]
    world.status[0x5000] = (1, 7)  # CU_STREAM_CAPTURE_STATUS_ACTIVE, capture id 7
    drv.capturing.add(0x5000)
    p.trim(sync=False)
    assert 0x5000 not in queried, "cuStreamQuery on a capturing stream"


# 6. The twin Arena's take/give hold a threading.Lock; on Python >= 3.12 a collection
#    runs at the eval breaker (a function's entry, a loop), so a freed array in a
#    cycle re-enters give() inside take() and the thread deadlocks.
def test_twin_arena_gc_reentry_deadlocks_on_312(tmp_path):
    import shutil
    import subprocess
    from pathlib import Path

    py = next(
        (
            p
            for p in ("/root/.pyenv/versions/3.12.1/bin/python", shutil.which("python3.12") or "")
            if p and Path(p).exists()
        ),
        None,
    )
    if py is None:
        pytest.skip("no Python 3.12 here")
    src = Path(_arena_py.__file__)
    script = tmp_path / "gc_twin.py"
    script.write_text(f"""
import gc, importlib.util, os, threading, time
spec = importlib.util.spec_from_file_location("_arena_py", {str(src)!r})
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
a = m.Arena(1 << 40, 1 << 36, 0); a.extend(1 << 34)
threading.Thread(target=lambda: (time.sleep(5), os._exit(3)), daemon=True).start()
class Block:
    def __init__(self, p): self.p, self.me = p, self
    def __del__(self): a.give(self.p)
gc.set_threshold(1)
for i in range(20000):
    Block(a.take(4096))
os._exit(0)
""")
    rc = subprocess.run([py, str(script)], timeout=60).returncode
    assert rc == 0, "deadlock: a collection inside Arena.take re-entered Arena.give"


# 7. the per-thread key is the thread ident; idents are reused once a thread
#    ends, so a new thread's per-thread stream takes the dead thread's freed blocks.
def test_dead_threads_ptds_arena_goes_to_a_new_thread_with_its_ident(drv, arena_cls):
    b = _ranges(drv, arena_cls)
    got = {}

    def run(name, free):
        p = b.alloc(4 * MiB, 2)[1]
        got[name] = (p, threading.get_ident())
        if free:
            b.free(p, 2)  # kernel on this thread's per-thread stream may still run

    t = threading.Thread(target=run, args=("a", True))
    t.start()
    t.join()
    # the OS hands a dead thread's ident to a later thread, mostly the next one: keep
    # starting threads (each keeps its block) until one gets thread a's ident
    for _ in range(64):
        t = threading.Thread(target=run, args=("c", False))
        t.start()
        t.join()
        assert got["c"][0] != got["a"][0], "new thread's stream got a dead thread's block"
        if got["c"][1] == got["a"][1]:
            break
    else:
        pytest.skip("needs the OS to give a later thread the first one's ident")


def test_ptds_with_both_threads_alive(drv, arena_cls):
    b = _ranges(drv, arena_cls)
    got, freed, done = {}, threading.Event(), threading.Event()

    def a():
        p = b.alloc(4 * MiB, 2)[1]
        b.free(p, 2)
        got["a"] = p
        freed.set()
        done.wait()  # thread A stays alive

    ta = threading.Thread(target=a)
    ta.start()
    freed.wait()
    tb = threading.Thread(target=lambda: got.__setitem__("b", b.alloc(4 * MiB, 2)[1]))
    tb.start()
    tb.join()
    done.set()
    ta.join()
    assert got["b"] != got["a"]
