"""CPU tests of guard mode against a fake driver and a fake of its device work.

The guard's logic runs for real on a pool of the pure-Python hot path
(``tests/fakes/hotpath.World``); ``tests/fakes/guard.FakeOps`` plays the fills and
checks on a byte map, ``Heap`` hands freed addresses out again.  Bugs are planted by
writing into that byte map where a kernel should not.
"""

from __future__ import annotations

import csv
import gc
import os
import warnings
import weakref

import cupy
import numpy as np
import pytest
from fakes.guard import FakeOps, Heap
from fakes.hotpath import sharing_hooks

import cupy_poolmem as cpm
from cupy_poolmem import _guard, _pools, report, stats
from cupy_poolmem import _hotpath_py as twin
from cupy_poolmem._guard import GuardOptions
from cupy_poolmem._guard.registry import GUARDS

pytestmark = pytest.mark.filterwarnings("ignore:ExternalStream is deprecated")

S = 0x5000  # the allocation stream of these tests (World's current stream)
RZ = 16
POISON, CANARY = 0xFD, 0xFA
THIS = os.path.basename(__file__)


def _line(marker: str) -> int:
    """The line of this file that carries ``marker`` in a comment."""
    with open(__file__, encoding="utf-8") as f:
        hits = [i for i, text in enumerate(f, 1) if f"# {marker}" in text]
    assert len(hits) == 1, f"marker {marker!r} must be on exactly one line; found {hits}"
    return hits[0]


@pytest.fixture
def world(monkeypatch, fake_retirer, twin_world):
    # (the twin pools' hot path: record_stream and check look blocks up there)
    w = twin_world
    Heap(w, monkeypatch)
    # Pools of these tests retire into a fake retirer: their pretend pointers (leftovers)
    # must never reach the real driver.
    w.retirer = fake_retirer
    fake_retirer._sync = lambda dev: w.log.append(("sync", dev))
    fake_retirer._free = lambda ptr, dev: w.log.append(("legacy_free", ptr, dev))
    return w


def _guarded(world, **opts):
    opts.setdefault("red_zone", RZ)
    p = world.pool(reuse_cache=1 << 20)
    ops = FakeOps(world)
    g = _guard.attach(p, GuardOptions(**opts), ops=ops)
    return p, g, ops


def _frees(world):
    return [e[1] for e in world.log if e[0] == "free"]


def _array(mp, n):
    return cupy.ndarray((n,), dtype=np.uint8, memptr=mp)


# ---------------------------------------------------------------------------- options
def test_options_defaults_and_validation():
    o = GuardOptions()
    assert (o.mode, o.red_zone, o.quarantine_bytes, o.quarantine_blocks) == (
        "raise",
        256,
        256 << 20,
        1024,
    )
    assert (o.cross_stream, o.poison, o.canary) == ("warn", 0xFD, 0xFA)
    assert GuardOptions(quarantine_bytes="1KiB").quarantine_bytes == 1024
    with pytest.raises(cpm.InvalidOptionError, match="mode='loud'"):
        GuardOptions(mode="loud")
    with pytest.raises(cpm.OptionTypeError, match="red_zone must be an int"):
        GuardOptions(red_zone=1.5)  # type: ignore[arg-type]
    with pytest.raises(cpm.OptionTypeError, match="red_zone must be an int"):
        GuardOptions(red_zone=True)
    with pytest.raises(cpm.InvalidOptionError, match=r"poison=256 must be in \[0, 255\]"):
        GuardOptions(poison=256)
    with pytest.raises(cpm.InvalidOptionError, match="quarantine_blocks=-1"):
        GuardOptions(quarantine_blocks=-1)
    with pytest.raises(cpm.InvalidOptionError, match="cross_stream='maybe'"):
        GuardOptions(cross_stream="maybe")
    with pytest.raises(ValueError, match="quarantine_bytes"):
        GuardOptions(quarantine_bytes="lots")


@pytest.mark.parametrize(
    "value, expect",
    [
        ("", None),
        ("0", None),
        (" off ", None),
        ("false", None),
        ("1", GuardOptions()),
        ("on", GuardOptions()),
        ("raise", GuardOptions()),
        ("warn", GuardOptions(mode="warn")),
        ("WARN, red_zone=64", GuardOptions(mode="warn", red_zone=64)),
        ("red_zone=0x40,poison=0xAB", GuardOptions(red_zone=64, poison=0xAB)),
        (
            "warn,quarantine_bytes=1GiB,quarantine_blocks=3,cross_stream=off,history=5",
            GuardOptions(
                mode="warn",
                quarantine_bytes=1 << 30,
                quarantine_blocks=3,
                cross_stream="off",
                history=5,
            ),
        ),
    ],
)
def test_env_parsing(value, expect):
    assert GuardOptions.from_env(value) == expect


@pytest.mark.parametrize(
    "value, match",
    [
        ("yes please", "is not a switch"),
        ("warn,colour=red", "unknown field 'colour'; valid fields: mode, red_zone"),
        ("red_zone=big", "red_zone must be an integer"),
        ("mode=quiet", "mode='quiet'"),
    ],
)
def test_env_parsing_errors_name_the_variable(value, match):
    with pytest.raises(cpm.InvalidOptionError, match=match) as ei:
        GuardOptions.from_env(value)
    assert "CUPY_POOLMEM_GUARD" in str(ei.value) or "mode=" in match


def test_resolve_reads_the_environment_only_for_none(monkeypatch):
    monkeypatch.setenv("CUPY_POOLMEM_GUARD", "warn,red_zone=8")
    assert _guard.resolve(None) == GuardOptions(mode="warn", red_zone=8)
    assert _guard.resolve(False) is None  # explicit off wins over the variable
    assert _guard.resolve(True) == GuardOptions()
    monkeypatch.delenv("CUPY_POOLMEM_GUARD")
    assert _guard.resolve(None) is None
    assert _guard.resolve("warn") == GuardOptions(mode="warn")
    assert _guard.resolve({"red_zone": 0}) == GuardOptions(red_zone=0)
    o = GuardOptions(history=3)
    assert _guard.resolve(o) is o
    with pytest.raises(cpm.InvalidOptionError, match="unknown field"):
        _guard.resolve({"redzone": 8})
    with pytest.raises(cpm.OptionTypeError, match="guard must be True, False"):
        _guard.resolve(3)
    with pytest.raises(cpm.InvalidOptionError, match="guard="):
        _guard.resolve("sometimes")


def test_errors_belong_to_the_hierarchy():
    for cls in (
        cpm.UseAfterFreeError,
        cpm.UnorderedReuseError,
        cpm.DoubleFreeError,
        cpm.OutOfBoundsWriteError,
    ):
        assert issubclass(cls, cpm.GuardError) and issubclass(cls, cpm.PoolmemError)
        assert issubclass(cls, RuntimeError)
        assert not issubclass(cls, MemoryError), "must not look like out-of-memory"
        assert not issubclass(cls, cpm.CUDADriverError)
    assert issubclass(cpm.UnorderedReuseError, cpm.UseAfterFreeError)
    assert issubclass(cpm.UseAfterFreeError, ReferenceError)
    assert issubclass(cpm.GuardWarning, RuntimeWarning)
    assert cpm.DoubleFreeError("x", unknown=True).kind == "unknown_free"


# ---------------------------------------------------------------------------- red zone
def test_red_zone_follows_each_block_and_is_filled_on_its_stream(world):
    p, g, ops = _guarded(world)
    m = p.malloc(100)
    alloc = [e for e in world.log if e[0] == "alloc"][-1]
    assert alloc[2] == 100 + RZ, "the pool is asked for the size plus the red zone"
    assert m.mem.size == 100 and m.ptr == alloc[1], "the program sees its own size"
    assert m.mem._owner.size == 100 + RZ and m.mem._owner is not None
    assert ("fill", m.ptr + 100, RZ, CANARY, S) in world.log
    assert ops.read(m.ptr + 100, RZ) == bytes([CANARY]) * RZ
    info = _guard.check(m)
    assert (info.ptr, info.size, info.state, info.stream) == (m.ptr, 100, "live", S)
    assert p.cache_limit == 0, "the reuse cache is off under the guard"


def test_out_of_bounds_write_is_found_at_free_and_raised_by_the_next_malloc(world):
    p, g, ops = _guarded(world)
    m = p.malloc(100)  # ALLOC-OOB
    gen = _guard.check(m).generation
    ptr = m.ptr
    ops.write(ptr + 101, b"\x00\x01")  # a kernel writes elements 101 and 102
    del m  # FREE-OOB
    assert g.counts["out_of_bounds"] == 1 and len(g.events) == 1
    with pytest.raises(cpm.OutOfBoundsWriteError) as ei:
        p.malloc(8)
    err = ei.value
    assert (err.offset, err.n_changed) == (101, 2), str(err)
    assert (err.block.ptr, err.block.size, err.block.generation) == (ptr, 100, gen)
    text = str(err)
    assert f"block 0x{ptr:x} (100 bytes, generation {gen}, device 0)" in text, text
    assert f"{THIS}:{_line('ALLOC-OOB')} in test_out_of_bounds" in text, text
    assert f"{THIS}:{_line('FREE-OOB')} in test_out_of_bounds" in text, text
    assert "bounds test" in text, "the message says what to fix"
    m2 = p.malloc(8)  # reported once: the next allocation works
    assert m2.mem.size == 8


def test_red_zone_zero_checks_nothing(world):
    p, g, ops = _guarded(world, red_zone=0)
    m = p.malloc(64)
    assert [e for e in world.log if e[0] == "alloc"][-1][2] == 64
    ops.write(m.ptr + 64, b"\x00")
    del m
    assert g.counts["out_of_bounds"] == 0


# ---------------------------------------------------------------------------- quarantine
def test_quarantine_is_fifo_and_bounded_by_count(world):
    p, g, ops = _guarded(world, quarantine_blocks=2)
    ms = [p.malloc(64) for _ in range(4)]
    ptrs = [m.ptr for m in ms]
    for i in range(4):
        ms[i] = None
        if i == 0:
            assert _frees(world) == [] and ("fill", ptrs[0], 64 + RZ, POISON, S) in world.log
    assert _frees(world) == ptrs[:2], "oldest first, two kept"
    assert g.stats()["quarantined_blocks"] == 2
    assert [b.ptr for b in g.blocks() if b.state == "quarantined"] == ptrs[2:]
    assert p.n_frees == 4 and p.live_bytes == 0, "the pool counts quarantined blocks as freed"


def test_a_quarantined_block_keeps_its_stream_until_its_real_free(world, monkeypatch):
    """The record dropped its stream before the free was enqueued on it: when that was
    the last reference (a stream the program had let go), the CUstream was destroyed
    first and the driver crashed in cuMemFreeAsync (H100, pool close after a test)."""
    import weakref

    class Stream:
        ptr = 0x6000

    p, g, ops = _guarded(world, quarantine_blocks=4, cross_stream="off")
    world.current = Stream()
    m = p.malloc(64)
    ptr = m.ptr
    alive = weakref.ref(world.current)
    world.current = cupy.cuda.ExternalStream(S, 0)
    del m  # quarantined: the record holds the only reference to its stream
    assert alive() is not None and _frees(world) == []
    seen = []
    real = twin.driver.free

    def free(fptr, sptr):
        seen.append((fptr, sptr, alive() is not None))
        return real(fptr, sptr)

    monkeypatch.setattr(twin.driver, "free", free)
    assert g.flush() == 1
    assert seen == [(ptr, 0x6000, True)], "freed on a stream that was already gone"
    assert alive() is None, "the stream goes once its last block is really freed"


def test_quarantine_is_bounded_by_bytes(world):
    total = 1000 + RZ
    p, g, ops = _guarded(world, quarantine_bytes=2 * total + 1, quarantine_blocks=100)
    a, b, c = p.malloc(1000), p.malloc(1000), p.malloc(1000)
    pa, pb = a.ptr, b.ptr
    del a, b
    assert _frees(world) == [] and g.stats()["quarantined_bytes"] == 2 * total
    del c
    assert _frees(world) == [pa], "the third block pushed the oldest out"
    assert pb not in _frees(world)


def test_quarantine_zero_frees_at_once_after_checking(world):
    p, g, ops = _guarded(world, quarantine_bytes=0)
    m = p.malloc(32)
    ptr = m.ptr
    del m
    kinds = [e[0] for e in world.log if e[0] in ("fill", "find", "free")]
    assert kinds == ["fill", "find", "fill", "find", "free"], kinds  # canary, rz, poison, poison
    assert _frees(world) == [ptr]


def test_write_after_free_is_reported_when_the_block_leaves_quarantine(world):
    p, g, ops = _guarded(world, quarantine_blocks=1)
    m = p.malloc(256)  # ALLOC-UAF
    ptr, gen = m.ptr, _guard.check(m).generation
    del m  # FREE-UAF
    ops.write(ptr + 40, b"\x2a\x2a\x2a")  # a kernel writes through a stale pointer
    other = p.malloc(16)
    del other  # pushes the first block out of the quarantine: checked there
    assert ptr in _frees(world), "a damaged block is still freed (after the report)"
    with pytest.raises(cpm.UseAfterFreeError) as ei:
        p.malloc(8)
    err = ei.value
    assert type(err) is cpm.UseAfterFreeError and err.kind == "use_after_free"
    assert (err.offset, err.n_changed, err.block.generation) == (40, 3, gen), str(err)
    text = str(err)
    assert f"write after free into block 0x{ptr:x} (256 bytes, generation {gen}" in text
    assert f"{THIS}:{_line('ALLOC-UAF')} in test_write_after_free" in text, text
    assert f"{THIS}:{_line('FREE-UAF')} in test_write_after_free" in text, text
    assert "record_stream" in text and "raw" in text


def test_verify_checks_live_red_zones_and_the_quarantine_now(world):
    p, g, ops = _guarded(world)
    keep = p.malloc(10)
    gone = p.malloc(10)
    gone_ptr = gone.ptr
    del gone
    ops.write(keep.ptr + 10, b"\x00")
    ops.write(gone_ptr, b"\x00")
    with pytest.raises(cpm.OutOfBoundsWriteError):
        g.verify()
    with pytest.raises(cpm.UseAfterFreeError):
        g.verify()  # the second pending error
    assert g.verify() == 0, "the damage was reported once, then the patterns written again"
    assert g.counts["out_of_bounds"] == 1 and g.counts["use_after_free"] == 1


def test_trim_close_and_oom_empty_the_quarantine(world):
    p, g, ops = _guarded(world)
    m = p.malloc(64)
    ptr = m.ptr
    del m
    assert _frees(world) == []
    p.trim()
    assert _frees(world) == [ptr] and g.stats()["quarantined_blocks"] == 0
    m = p.malloc(64)
    ptr2 = m.ptr
    del m
    p.close()
    assert _frees(world)[-1] == ptr2, "close checks and frees the quarantine first"


def test_blocks_leaving_the_quarantine_never_enter_the_reuse_cache(world):
    """The guard turns the cache off: a block out of the quarantine goes to the driver,
    and every allocation asks the driver (reuse would hide a stale read)."""
    p, g, ops = _guarded(world, quarantine_blocks=1)
    ptrs = []
    for _ in range(4):
        m = p.malloc(64)
        ptrs.append(m.ptr)
        del m
    assert p.cached_bytes == 0 and p._cache == {}
    assert _frees(world) == ptrs[:3] and sum(1 for e in world.log if e[0] == "alloc") == 4


def test_after_close_frees_are_checked_but_not_quarantined(world):
    p, g, ops = _guarded(world)
    m = p.malloc(64)
    ptr = m.ptr
    p.close()
    ops.write(ptr + 64, b"\x01")
    del m
    assert _frees(world) == [ptr]
    assert g.counts["out_of_bounds"] == 1


# ---------------------------------------------------------------------------- retirement
def _closing(world, p):
    """The pool's CUDA pool destruction, in the world's log in order with the frees."""
    p._mr.close = lambda: world.log.append(("close_pool",))


def _device_work(world, since):
    return [e for e in world.log[since:] if e[0] in ("fill", "find", "free")]


def test_close_frees_the_quarantine_checked_then_the_pool_is_retired(world):
    p, g, ops = _guarded(world, quarantine_blocks=8)
    _closing(world, p)
    a, b = p.malloc(64), p.malloc(32)  # ALLOC-CLOSE
    pa, pb = a.ptr, b.ptr
    del a, b  # both quarantined
    ops.write(pb + 3, b"\x07")  # a stale pointer writes into the second
    assert _frees(world) == [] and world.retirer.held == 1
    p.close()
    assert ("find", pa, 64 + RZ, POISON, S) in world.log, "checked on its own stream"
    assert ("find", pb, 32 + RZ, POISON, S) in world.log
    assert _frees(world) == [pa, pb], "freed on their streams, oldest first"
    assert g.counts["use_after_free"] == 1 and g.stats()["quarantined_blocks"] == 0
    assert g.stats()["unchecked_blocks"] == 0
    assert world.retirer.pending == 1, "drained: the pool is handed to the retirer"
    assert world.retirer._due[0][2] == (), "nothing left for the retirer to free"
    world.retirer.drain()
    assert [e for e in world.log if e[0] in ("free", "sync", "close_pool")][-2:] == [
        ("sync", 0),
        ("close_pool",),
    ]
    p.close()  # twice: harmless
    assert world.retirer.pending == 0 and world.retirer.held == 0


def test_close_during_a_capture_hands_the_quarantine_to_the_retirer(world):
    p, g, ops = _guarded(world, quarantine_blocks=8)
    _closing(world, p)
    ms = [p.malloc(64) for _ in range(3)]
    del ms
    ptrs = [b.ptr for b in g.blocks()]  # quarantine order, oldest first
    assert len(ptrs) == 3 and all(b.state == "quarantined" for b in g.blocks())
    ops.underway = True  # another stream captures a graph: nothing may synchronise
    n = len(world.log)
    p.close()
    assert _device_work(world, n) == [], "no check, no free while the capture runs"
    assert g.stats()["quarantined_blocks"] == 0 and g.stats()["unchecked_blocks"] == 3
    assert world.retirer.pending == 1 and world.retirer._due[0][2] == tuple(ptrs)
    world.retirer.drain()
    assert world.log[n:] == [
        ("sync", 0),
        *[("legacy_free", ptr, 0) for ptr in ptrs],
        ("sync", 0),
        ("close_pool",),
    ], "freed after the sync, on the legacy stream, then synced again before the destroy"


def test_a_closed_pool_with_live_blocks_keeps_quarantine_leftovers_until_drained(world):
    p, g, ops = _guarded(world, quarantine_blocks=8)
    _closing(world, p)
    gone, live = p.malloc(64), p.malloc(16)
    pg = gone.ptr
    del gone
    ops.underway = True
    p.close()
    ops.underway = False
    assert world.retirer.pending == 0, "a live block: the CUDA pool stays"
    n = len(world.log)
    del live  # the last block: checked (red zone) and freed at once, not quarantined
    assert [e[0] for e in _device_work(world, n)] == ["find", "free"]
    assert world.retirer.pending == 1 and world.retirer._due[0][2] == (pg,)
    world.retirer.drain()
    assert ("legacy_free", pg, 0) in world.log and world.log[-1] == ("close_pool",)


def test_a_guarded_pool_dropped_without_close_is_retired_with_its_quarantine(
    world, tp, monkeypatch
):
    """Inside a garbage cycle (a guarded pool is always in one: it and its guard
    reference each other) the quarantined blocks' streams may be destroyed already:
    nothing reaches the driver from the finalizer; the retirer frees them after a sync."""
    monkeypatch.setattr(tp.Pool, "__del__", _pools.Pool.__del__)  # the real finalizer
    p, g, ops = _guarded(world, quarantine_blocks=8)
    _closing(world, p)
    ms = [p.malloc(64) for _ in range(2)]
    del ms
    ptrs = [b.ptr for b in g.blocks()]  # quarantine order, oldest first
    assert len(ptrs) == 2 and g.stats()["quarantined_blocks"] == 2
    guard = weakref.ref(g)
    n = len(world.log)
    del p, g
    gc.collect()
    assert guard() is None, "the pool and its guard were collected"
    assert _device_work(world, n) == [], "no check, fill or free from the finalizer"
    assert world.retirer.pending == 1 and world.retirer.held == 0
    world.retirer.drain()
    assert world.log[n:] == [
        ("sync", 0),
        *[("legacy_free", ptr, 0) for ptr in ptrs],
        ("sync", 0),
        ("close_pool",),
    ]


def test_a_block_freed_while_close_runs_is_never_left_in_the_quarantine(world):
    """close() empties the quarantine under the guard's lock; a free that passed the
    closed test before must not put its block there afterwards (it would never be
    freed, and the pool would be retired without it)."""
    p, g, ops = _guarded(world, quarantine_blocks=8)
    _closing(world, p)
    m = p.malloc(64)
    ptr = m.ptr
    fill = ops.fill

    def fill_then_close(fptr, n, byte, stream):  # the poison fill: close() runs meanwhile
        fill(fptr, n, byte, stream)
        if byte == POISON:
            p.close()

    ops.fill = fill_then_close
    del m
    assert g.stats()["quarantined_blocks"] == 0 and _frees(world) == [ptr]
    assert world.retirer.pending == 1, "its free was the last: the pool is retired"


def test_blocks_freed_by_the_garbage_collector_are_freed_unchecked(world):
    """A garbage collection may have destroyed the block's stream (a CuPy Stream's
    finalizer) before the block's free: the guard adds no device work there, and the
    stream current at that moment says nothing about the block."""
    p, g, ops = _guarded(world, quarantine_blocks=8, cross_stream="raise")
    old = p.malloc(32)
    po = old.ptr
    del old  # quarantined normally
    m = p.malloc(64)
    ptr = m.ptr
    cycle = [m]
    cycle.append(cycle)
    world.current = cupy.cuda.ExternalStream(0x6000, 0)  # no sign of use: not reported
    n = len(world.log)
    del m, cycle
    gc.collect()
    assert _device_work(world, n) == [("free", ptr, S)], "freed at once on its stream"
    assert g.stats()["unchecked_blocks"] == 1 and g.counts["unordered_stream"] == 0
    assert [b.ptr for b in g.blocks()] == [po], "the quarantine is not evicted meanwhile"
    with pytest.raises(cpm.UseAfterFreeError, match="which was freed at"):
        _guard.check(ptr)  # remembered for later reports
    assert not GUARDS.in_gc


# ---------------------------------------------------------------------------- generations
def test_generations_change_with_each_reuse_of_an_address(world):
    p, g, ops = _guarded(world, quarantine_bytes=0)
    m = p.malloc(64)  # ALLOC-GEN
    ptr, gen1 = m.ptr, _guard.check(m).generation
    del m  # FREE-GEN
    m2 = p.malloc(64)
    assert m2.ptr == ptr, "the fake heap hands the address out again"
    gen2 = _guard.check(m2).generation
    assert gen2 > gen1
    assert g.generation(ptr) == gen2
    assert _guard.check(ptr, gen2).state == "live"
    assert _guard.check(ptr + 63).generation == gen2, "an interior pointer finds its block"
    with pytest.raises(cpm.UseAfterFreeError) as ei:
        _guard.check(ptr + 8, gen1)
    text = str(ei.value)
    assert f"generation {gen1}" in text and f"generation {gen2}" in text, text
    assert "now belongs to" in text
    assert f"{THIS}:{_line('FREE-GEN')} in test_generations" in text, text
    assert ei.value.block.generation == gen1 and ei.value.block.state == "freed"


def test_check_of_a_quarantined_or_unknown_pointer(world, monkeypatch):
    p, g, ops = _guarded(world)
    m = p.malloc(64)
    ptr, gen = m.ptr, _guard.check(m).generation
    del m
    with pytest.raises(cpm.UseAfterFreeError, match="still in the quarantine"):
        _guard.check(ptr)
    with pytest.raises(cpm.UseAfterFreeError, match="still in the quarantine"):
        _guard.check(ptr, generation=gen)
    with pytest.raises(cpm.InvalidOptionError, match="no guarded pool has allocated"):
        _guard.check(0xDEAD0000)
    with pytest.raises(cpm.OptionTypeError):
        _guard.check("0x1000")
    with pytest.raises(cpm.OptionTypeError, match="generation"):
        _guard.check(ptr, generation="1")  # type: ignore[arg-type]
    monkeypatch.setattr(GUARDS, "alive", type(GUARDS.alive)())
    with pytest.raises(cpm.UsageError, match="no pool in this process has a guard"):
        _guard.check(ptr)


def test_check_of_memory_from_an_unguarded_pool(world):
    p = world.pool()
    m = p.malloc(64)
    with pytest.raises(cpm.UsageError, match="has no guard"):
        _guard.check(m)


def test_check_takes_arrays_and_array_interfaces(world):
    p, g, ops = _guarded(world)
    m = p.malloc(64)
    arr = _array(m, 64)
    assert _guard.check(arr[8:]).ptr == m.ptr, "a view checks its whole block"

    class Foreign:
        __cuda_array_interface__ = {"data": (m.ptr + 4, False)}

    assert _guard.check(Foreign()).generation == _guard.check(m).generation


# ---------------------------------------------------------------------------- double frees
def test_double_free_is_reported_and_not_done(world):
    p, g, ops = _guarded(world)
    m = p.malloc(64)
    ptr, stream = m.ptr, m.mem._owner.stream
    del m  # FREE-DF
    n_frees = len(_frees(world))
    kept = p.release_hook(ptr, 64 + RZ, stream)  # a second free of the same block
    assert kept is True, "a double free must not reach the driver"
    assert len(_frees(world)) == n_frees
    with pytest.raises(cpm.DoubleFreeError) as ei:
        p.malloc(8)
    assert ei.value.kind == "double_free"
    assert f"{THIS}:{_line('FREE-DF')} in test_double_free" in str(ei.value), str(ei.value)
    assert "second free was not done" in str(ei.value)


def test_free_of_an_unknown_pointer_is_reported(world):
    p, g, ops = _guarded(world, mode="warn")
    with pytest.warns(cpm.GuardWarning, match="never handed out"):
        kept = p.release_hook(0xBAD000, 64, world.current)
    assert kept is False  # a block of this pool the guard did not see: the pool frees it
    assert g.counts["unknown_free"] == 1
    assert g.events[-1].error.kind == "unknown_free"


def test_foreign_double_free_names_both_frees_and_history_is_bounded(world):
    p, g, ops = _guarded(world, quarantine_bytes=0, history=2)
    ms = [p.malloc(64 + i) for i in range(3)]
    info = [(m.ptr, _guard.check(m).generation) for m in ms]
    for i in range(3):
        ms[i] = None  # freed oldest first: the history keeps the last two
    g.report_foreign_free(info[2][0], info[2][1], "a test's finalizer")  # FOREIGN
    with pytest.raises(cpm.DoubleFreeError) as ei:
        g.raise_pending()
    assert ei.value.kind == "double_free" and ei.value.block.generation == info[2][1]
    assert "then again through a test's finalizer" in str(ei.value)
    assert f"{THIS}:{_line('FOREIGN')} in test_foreign" in str(ei.value)
    g.report_foreign_free(info[0][0], info[0][1], "a test's finalizer")  # forgotten: unknown
    with pytest.raises(cpm.DoubleFreeError) as ei:
        g.raise_pending()
    assert ei.value.kind == "unknown_free" and g.stats()["remembered_frees"] == 2


def test_numba_finalizer_frees_only_its_own_allocation():
    pytest.importorskip("cupy_poolmem.numba")
    from cupy_poolmem import _numba_memory as nb

    calls = []

    class G:
        def report_foreign_free(self, ptr, gen, via):
            calls.append((ptr, gen, via))

    allocations: dict = {}
    held = allocations[0x1000] = nb.Held("mem")
    fin = nb.forget(allocations, 0x1000, held, G(), 7)
    del held
    fin()
    assert allocations == {} and calls == [], "the normal free pops its own entry"
    # reset() freed everything, and the address went to a newer allocation:
    held = allocations[0x1000] = nb.Held("old")
    stale = nb.forget(allocations, 0x1000, held, G(), 8)
    allocations.clear()
    del held
    newer = allocations[0x1000] = nb.Held("new")
    stale()
    assert allocations[0x1000] is newer, "a stale finalizer must not free a newer allocation"
    assert calls == [(0x1000, 8, "a Numba pointer's finalizer")]
    stale_unguarded = nb.forget(allocations, 0x1000, nb.Held("x"))
    stale_unguarded()
    assert allocations[0x1000] is newer


# ---------------------------------------------------------------------------- warn vs raise
def test_warn_mode_warns_at_once_and_goes_on(world):
    p, g, ops = _guarded(world, mode="warn")
    m = p.malloc(32)
    ops.write(m.ptr + 32, b"\x00")
    with pytest.warns(cpm.GuardWarning, match="out-of-bounds write past the end"):
        del m
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m2 = p.malloc(32)  # nothing pending in warn mode
    assert m2.mem.size == 32 and g.stats()["pending"] == 0
    assert g.counts["out_of_bounds"] == 1
    assert isinstance(g.events[-1].error, cpm.OutOfBoundsWriteError)


def test_raise_mode_is_silent_at_free_and_raises_one_error_per_call(world):
    p, g, ops = _guarded(world)
    a, b = p.malloc(16), p.malloc(16)
    ops.write(a.ptr + 16, b"\x00")
    ops.write(b.ptr + 16, b"\x00")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del a, b
    assert g.stats()["pending"] == 2
    for _ in range(2):
        with pytest.raises(cpm.OutOfBoundsWriteError):
            p.malloc(8)
    assert p.malloc(8).mem.size == 8


def test_check_in_warn_mode_returns_the_freed_block(world):
    p, g, ops = _guarded(world, mode="warn")
    m = p.malloc(64)
    ptr = m.ptr
    del m
    with pytest.warns(cpm.GuardWarning, match="use after free"):
        info = _guard.check(ptr)
    assert info.state == "quarantined" and info.ptr == ptr


# ---------------------------------------------------------------------------- streams
def test_free_with_another_stream_current_is_unordered(world):
    p, g, ops = _guarded(world, cross_stream="raise")
    m = p.malloc(64)  # ALLOC-XS
    world.current = cupy.cuda.ExternalStream(0x6000, 0)
    del m  # FREE-XS
    with pytest.raises(cpm.UnorderedReuseError) as ei:
        p.malloc(8)
    text = str(ei.value)
    assert "stream 0x5000" in text and "stream 0x6000" in text and "record_stream" in text
    assert f"{THIS}:{_line('FREE-XS')} in test_free_with" in text, text
    assert isinstance(ei.value, cpm.UseAfterFreeError)


def test_record_stream_orders_the_other_stream(world):
    p, g, ops = _guarded(world, cross_stream="raise")
    m = p.malloc(64)
    other = cupy.cuda.ExternalStream(0x6000, 0)
    cpm.record_stream(_array(m, 64), other)
    assert _guard.check(m).streams == (S, 0x6000)
    world.current = other
    del m
    assert g.counts["unordered_stream"] == 0


@pytest.mark.parametrize(
    "alloc_stream, free_stream, non_blocking, reported",
    [
        (S, 0, False, False),  # a default stream current at the free: no evidence
        (S, 2, False, False),  # per-thread default stream: no evidence either
        (0, 0x6000, False, False),  # legacy stream and a blocking stream order each other
        (0, 0x6000, True, True),  # ... a non-blocking one does not
        (1, 0x6000, True, True),
        (S, 0x6000, False, True),  # two blocking streams do not order each other
    ],
)
def test_implicit_ordering_rules(world, alloc_stream, free_stream, non_blocking, reported):
    p, g, ops = _guarded(world, cross_stream="warn")
    world.current = cupy.cuda.ExternalStream(alloc_stream, 0)
    m = p.malloc(64)
    world.current = cupy.cuda.ExternalStream(free_stream, 0)
    if non_blocking:
        ops.non_blocking_streams.add(free_stream)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        del m
    assert g.counts["unordered_stream"] == int(reported), [str(x.message) for x in w]
    assert [x.category for x in w] == ([cpm.GuardWarning] if reported else [])


def test_cross_stream_off(world):
    p, g, ops = _guarded(world, cross_stream="off")
    m = p.malloc(64)
    world.current = cupy.cuda.ExternalStream(0x6000, 0)
    del m
    assert g.counts["unordered_stream"] == 0


def test_capture_blocks_are_not_guarded_and_frees_in_a_capture_are_not_quarantined(world):
    p, g, ops = _guarded(world)
    world.status[S] = (1, 7)  # the current stream captures a graph
    m = p.malloc(64)
    assert m.mem._owner.flags & twin.FLAG_CAPTURED
    assert not [e for e in world.log if e[0] == "fill"], "nothing may be enqueued in a capture"
    del m
    assert g.stats()["live_blocks"] == 0 and g.counts["unknown_free"] == 0
    world.status[S] = (0, 0)
    m = p.malloc(64)
    ops.capturing_streams.add(S)
    n_before = len(world.log)
    del m
    assert g.stats()["quarantined_blocks"] == 0
    assert not [e for e in world.log[n_before:] if e[0] in ("fill", "find")]


def test_a_failing_check_never_raises_from_the_free(world):
    p, g, ops = _guarded(world)
    m = p.malloc(64)
    ptr = m.ptr
    ops.fail_find = True
    with pytest.warns(RuntimeWarning, match="could not run"):
        del m
    assert g.stats()["internal_errors"] == 1
    assert p.n_free_errors == 0 and ptr in _frees(world), "the normal free path took over"


def test_sizes_the_pool_handles_itself(world):
    p, g, ops = _guarded(world)
    assert p.malloc(0).ptr == 0 and g.stats()["live_blocks"] == 0
    with pytest.raises(cpm.InvalidSizeError):
        p.malloc(-1)
    with pytest.raises(cpm.OptionTypeError):
        p.malloc(1.5)


# ---------------------------------------------------------------------------- log, report
def test_guard_reports_go_to_the_log_and_the_report(world, tmp_path):
    p, g, ops = _guarded(world, mode="warn")
    path = stats.start_log(tmp_path / "alloc.csv")
    try:
        with cpm.tag("step"):
            m = p.malloc(48)  # ALLOC-LOG
        ptr = m.ptr
        ops.write(ptr + 48, b"\x00")
        with pytest.warns(cpm.GuardWarning):
            del m
    finally:
        stats.stop_log()
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["op"].startswith("guard:")]
    assert len(rows) == 1, rows
    r = rows[0]
    assert (r["op"], int(r["pointer"], 0), int(r["size"]), r["tag"]) == (
        "guard:out_of_bounds",
        ptr,
        48,
        "step",
    )
    assert int(r["stream"]) == S
    assert f"alloc {os.path.abspath(__file__)}:{_line('ALLOC-LOG')}" in r["callsite"]
    assert "| free " in r["callsite"]
    summ = report.summarize(path)
    assert summ.n_bad_lines == 0
    assert [(x.kind, x.ptr, x.size) for x in summ.guard_reports] == [("out_of_bounds", ptr, 48)]
    text = summ.format()
    assert "Guard reports: 1 (out_of_bounds 1)" in text, text
    assert summ.to_dict()["guard_reports"][0]["kind"] == "out_of_bounds"


def test_report_reads_guard_lines_without_counting_them_as_frees(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text(
        ",".join(stats.LOG_COLUMNS)
        + "\n1.0,7,Main,0,0,alloc,0x1000,64,,,64,\n"
        + "2.0,7,Main,0,0,free,0x1000,64,,,0,\n"
        + "3.0,7,Main,0,0,guard:use_after_free,0x1000,64,t,alloc a.py:1 | free a.py:2,0,\n"
    )
    summ = report.summarize(str(path))
    assert (summ.n_allocs, summ.n_frees, summ.n_unmatched_frees, summ.n_bad_lines) == (1, 1, 0, 0)
    assert summ.guard_reports[0].kind == "use_after_free"
    assert summ.guard_reports[0].time == pytest.approx(2.0)
    assert "alloc a.py:1 | free a.py:2" in summ.format()


def test_a_block_held_for_other_processes_is_guarded_when_sharing_frees_it(world, request):
    p, g, ops = _guarded(world)
    m = p.malloc(64)
    block = m.mem._owner
    ptr, size, stream = block.ptr, block.size, block.stream
    block.share = object()  # exported: sharing keeps it in limbo when the array goes
    sharing_hooks(request, twin, release=lambda *a: True)
    del m, block
    assert _guard.check(ptr).state == "live", "other processes still map it"
    assert g.stats()["quarantined_blocks"] == 0
    # The exporter's last receiver unmapped it: Exporter._free calls the release hook.
    assert p.release_hook(ptr, size, stream) is True
    assert g.stats()["quarantined_blocks"] == 1
    assert ("fill", ptr, size, POISON, S) in world.log


def test_check_of_a_raw_pointer_asks_the_guard_that_knows_it_best(world):
    p1, g1, _ = _guarded(world, quarantine_bytes=0)
    p2, g2, _ = _guarded(world)
    m = p1.malloc(64)
    ptr, old_gen = m.ptr, _guard.check(m).generation
    del m  # p1 frees it at once: the address goes back to the (shared) fake heap
    m2 = p2.malloc(64)
    assert m2.ptr == ptr, "the fake heap reuses the address for the other pool"
    new_gen = _guard.check(ptr).generation
    assert new_gen == _guard.check(m2).generation != old_gen, "the live block wins"
    with pytest.raises(cpm.UseAfterFreeError, match=f"generation {old_gen}"):
        _guard.check(ptr, old_gen)  # the generation names p1's block
    del m2
    with pytest.raises(cpm.UseAfterFreeError, match="still in the quarantine"):
        _guard.check(ptr, new_gen)


def test_benchmark_reports_the_guards_overhead_per_allocation():
    from cupy_poolmem.benchmarks import alloc

    plain = [1e-6, 2e-6, 3e-6, 50e-6]
    guarded = [21e-6, 32e-6, 103e-6, 90e-6]
    line = alloc.guard_overhead(
        [
            ("cupy MemoryPool (baseline)", [1.0] * 4, None),
            ("cupy_poolmem DevicePool [python]", plain, None),
            (alloc.GUARD_ROW, guarded, None),
        ]
    )
    assert line == (
        "guard overhead per allocation + free (vs DevicePool): "
        "empty 1KiB +20.0 us, empty 1MiB +30.0 us, empty 64MiB +100.0 us"
    )
    assert alloc.guard_overhead([("cupy_poolmem DevicePool [python]", plain, None)]) is None
