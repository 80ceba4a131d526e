"""The reuse cache when something runs in the middle of it: a garbage collection (whose
finalizers may switch to another thread) or another thread's flush between two steps,
and exceptions from a free.  Against the fake driver (tests/fakes/hotpath) for the
twin's allocation path, and on a bare PoolCore (no CUDA pool, legacy streams) for what
both implementations run on a CPU.

What must hold: a cached block is handed out or freed exactly once; an exported block
is never freed or reused without its sharing record; ``cached_bytes`` is the sum of the
bins; a free that fails is still counted (a closed pool drains).
"""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import cupy
import pytest
from fakes.hotpath import bare_core, compiled_hotpath, sharing_hooks

from cupy_poolmem import _hotpath_py as twin

pytestmark = pytest.mark.filterwarnings("ignore:ExternalStream is deprecated")

KB = 4096
S = 0x5000  # World's current stream
PYX = Path(twin.__file__).with_name("_hotpath.pyx")


def _impl(name):
    hp = twin if name == "twin" else compiled_hotpath()
    if hp is None:
        pytest.skip("the Cython hot path is not built in this checkout")
    return hp


def _bare_core(hp, fail_free=None):
    return bare_core(hp, 1 << 20, fail_free=fail_free)


def _cached(core):
    return sorted(p for b in core._cache.values() for p, _ in b.entries())


def _bin_sum(core):
    return sum(b.n * b.size for b in core._cache.values())


class _FlushInCollection:
    """A garbage collection that flushes ``core`` (a finalizer that trims the pool, or
    another thread that runs meanwhile): once ``armed``, at the next allocation of an
    object the collector tracks."""

    def __init__(self, core):
        self.core, self.armed, self.fired = core, False, False

    def __call__(self, phase, info):
        if phase == "start" and self.armed and not self.fired:
            self.fired = True
            self.core.flush_cache()

    def __enter__(self):
        gc.collect()
        self.threshold = gc.get_threshold()
        gc.callbacks.append(self)
        gc.set_threshold(1)  # a collection at the next allocation of a tracked object
        return self

    def __exit__(self, *exc):
        gc.set_threshold(*self.threshold)
        gc.callbacks.remove(self)


# ---------------------------------------------------------------- exported blocks
@pytest.mark.parametrize("impl", ["twin", "compiled"])
def test_an_exported_block_cached_while_a_collection_flushes_keeps_its_record(impl):
    """_cache_shared stores the record, then finds the bin: a collection there that
    flushed swapped the records away, and the block went into the new cache without
    its record -- the next flush freed it while other processes could still map it."""
    hp = _impl(impl)
    retired = []
    old = (hp._shared_release, hp._shared_retire)
    hp.set_shared_release(old[0], lambda core, ptr, *a: retired.append(ptr) or True)
    try:
        c = _bare_core(hp)
        s = object()
        assert c._cache_shared(0x1000, 2 * KB, 0, s, "r1")  # the last bin: another key
        with _FlushInCollection(c) as flush:
            flush.armed = True  # nothing allocated from here into _cache_shared
            ok = c._cache_shared(0x2000, KB, 0, s, "r2")
        assert ok
        assert flush.fired and retired == [0x1000]
        assert _cached(c) == [0x2000] and c.cached_bytes == KB == _bin_sum(c)
        c.flush_cache()
        assert retired == [0x1000, 0x2000] and c.freed == []  # its exporter's, not freed
    finally:
        hp.set_shared_release(*old)


# ---------------------------------------------------------------- exceptions
@pytest.mark.parametrize("impl", ["twin", "compiled"])
@pytest.mark.parametrize("exc", [KeyboardInterrupt, MemoryError])
def test_a_free_that_raises_is_still_counted_and_a_closed_pool_drains(impl, exc):
    """An exception from the free of a block's last reference (the driver free's hook,
    a KeyboardInterrupt landing in it) skipped ``n_frees``: a closed pool then never
    saw its last block go and was never retired."""
    hp = _impl(impl)
    c = _bare_core(hp, fail_free={0x7000: exc("in the free")})
    c.cache_limit = 0  # every block goes to the (failing) free
    stream = type("S", (), {"ptr": 0})()
    m = c._make_block(0x7000, KB, stream, 0)
    c._mark_closed()
    del m
    gc.collect()
    assert (c.n_allocs, c.n_frees, c.live_bytes) == (1, 1, 0)
    assert c.n_free_errors == 1 and c.drained == 1


@pytest.mark.parametrize("impl", ["twin", "compiled"])
def test_a_flush_whose_free_raises_still_frees_the_rest_then_raises(impl):
    """A free that raised in the middle of a flush left every later block neither
    cached nor freed (leaked until the pool went)."""
    hp = _impl(impl)
    c = _bare_core(hp, fail_free={0x2000: KeyboardInterrupt()})
    stream = type("S", (), {"ptr": 0})()
    ms = [c._make_block(p, KB, stream, 0) for p in (0x1000, 0x2000, 0x3000)]
    del ms
    assert c.cached_bytes == 3 * KB
    with pytest.raises(KeyboardInterrupt):
        c.flush_cache()
    assert sorted(c.freed) == [0x1000, 0x3000] and c.cached_bytes == 0 and c._cache == {}


# ---------------------------------------------------------------- another thread's flush
@pytest.fixture
def world(twin_world):
    return twin_world


def _frees(world):
    return [e[1] for e in world.log if e[0] == "free"]


def _flush_after_lookup(monkeypatch, pool):
    """The twin's ``_bin`` returns, then another thread flushes (a thread switch can
    come at any call): once."""
    real = twin.PoolCore._bin
    done = []

    def lookup_then_flush(self, sptr, size, create):
        b = real(self, sptr, size, create)
        if self is pool and not done:
            done.append(1)
            pool.flush_cache()
        return b

    monkeypatch.setattr(twin.PoolCore, "_bin", lookup_then_flush)
    return done


def test_twin_a_hit_after_another_threads_flush_never_hands_out_a_freed_block(world, monkeypatch):
    p = world.pool()
    a = p.malloc(KB)
    cached = a.ptr
    del a
    b = p.malloc(2 * KB)  # the last bin is now another key: the next KB looks it up
    del b
    done = _flush_after_lookup(monkeypatch, p)
    m = p.malloc(KB)
    assert done and _frees(world).count(cached) == 1  # the flush freed it ...
    assert m.ptr != cached  # ... so the allocation must not get it too
    assert p.cached_bytes == 0 == _bin_sum(p)


def test_twin_a_free_after_another_threads_flush_goes_into_the_new_cache(world, monkeypatch):
    p = world.pool()
    a = p.malloc(KB)
    ptr = a.ptr
    done = _flush_after_lookup(monkeypatch, p)
    del a  # _release finds (creates) the bin, the flush takes it, then the push
    assert done and ptr not in _frees(world)
    assert _cached(p) == [ptr] and p.cached_bytes == KB == _bin_sum(p)
    p.flush_cache()
    assert _frees(world).count(ptr) == 1


def test_twin_a_bin_made_while_another_thread_flushes_goes_into_the_new_cache(world, monkeypatch):
    """The new bin's dict must be read after the bin is made (as the .pyx does): made
    first, a collection or thread switch in its making could flush the cache."""
    p = world.pool()
    real = twin._Bin
    done = []

    def bin_with_a_flush(sptr, size):
        b = real(sptr, size)
        if not done:
            done.append(1)
            p.flush_cache()
        return b

    monkeypatch.setattr(twin, "_Bin", bin_with_a_flush)
    a = p.malloc(KB)
    ptr = a.ptr
    del a
    assert done and _cached(p) == [ptr] and p.cached_bytes == KB == _bin_sum(p)
    again = p.malloc(KB)
    assert again.ptr == ptr and p.cached_bytes == 0


def test_twin_threads_allocating_while_one_flushes_keep_the_cache_consistent(world):
    """Threads allocate and free a few sizes while another flushes the cache: every
    block is live at most once, and the cache's bytes are its bins' sum."""
    import sys

    p = world.pool()
    live: set[int] = set()
    errors: list[str] = []
    stop = threading.Event()

    def churn(seed):
        world_stream = world.current
        for i in range(3000):
            world.current = world_stream
            ms = [p.malloc(KB * (1 + (seed + i + k) % 3)) for k in range(3)]
            for m in ms:
                if m.ptr in live:
                    errors.append(f"{m.ptr:#x} handed out twice")
                live.add(m.ptr)
            for m in ms:
                live.discard(m.ptr)
            del ms, m

    def flusher():
        while not stop.is_set():
            p.flush_cache()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        f = threading.Thread(target=flusher)
        f.start()
        workers = [threading.Thread(target=churn, args=(k,)) for k in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        stop.set()
        f.join(60)
    finally:
        sys.setswitchinterval(old)
    assert errors == []
    assert p.cached_bytes == _bin_sum(p)
    freed = _frees(world)
    assert len(freed) == len(set(freed))  # the fake never reuses an address
    p.flush_cache()
    assert p.cached_bytes == 0


# ---------------------------------------------------------------- accounting
def test_twin_cached_bytes_is_the_sum_of_the_bins_through_random_steps(world, request):
    """Hits, misses (and the flush after FLUSH_AFTER_MISSES), frees over the limit and
    above cache_max_block, exported blocks, flush, take, trim-like flushes and close:
    after each step cached_bytes is the bins' sum, every cached block is cached once
    and not live, every exported one has its record (and only those)."""
    import random

    retired = []
    sharing_hooks(request, twin, retire=lambda core, ptr, *a: retired.append(ptr))
    rnd = random.Random(4)
    p = world.pool(reuse_cache=24 * KB)
    p.cache_max_block = 8 * KB
    streams = [world.current, cupy.cuda.ExternalStream(0x6000, 0)]
    live: dict[int, object] = {}
    exported = iter(range(0x9000000, 0xA000000, 0x10000))
    shared_hits = 0
    for step in range(4000):
        op = rnd.random()
        world.current = rnd.choice(streams)
        if op < 0.45:
            m = p.malloc(
                KB * rnd.choice([1, 2, 3, 9]) + rnd.choice([0, 0, 0, rnd.randrange(1, 64)])
            )
            assert m.ptr not in live
            live[m.ptr] = m
        elif op < 0.85 and live:
            del live[rnd.choice(list(live))]
        elif op < 0.9:
            ptr = next(exported)
            p._cache_shared(ptr, KB, world.current.ptr, world.current, ("rec", ptr))
        elif op < 0.95:
            p.flush_cache()
        elif op < 0.97:
            p._take_cache()
        else:
            m = p.malloc(KB)  # a hit of an exported block carries its own record
            if m.mem._owner.share is not None:
                assert m.mem._owner.share == ("rec", m.ptr)
                shared_hits += 1
            live[m.ptr] = m
        cached = [ptr for b in p._cache.values() for ptr, _ in b.entries()]
        assert p.cached_bytes == _bin_sum(p) <= p.cache_limit, step
        assert len(cached) == len(set(cached)) and not set(cached) & set(live), step
        assert set(p._shares) <= set(cached), step
        assert all(v == ("rec", k) for k, v in p._shares.items()), step
    assert shared_hits and retired  # both ways out of the cache for exported blocks
    live.clear()
    p._mark_closed()
    assert p.cached_bytes == 0 == _bin_sum(p) and p._shares == {}


@pytest.mark.parametrize("impl", ["twin", "compiled"])
def test_cached_bytes_is_the_sum_of_the_bins_on_both_implementations(impl):
    """What a CPU can run of the compiled cache (frees, exported blocks, flush, take;
    no hits: its malloc needs a GPU), step by step against the same invariants."""
    import random

    hp = _impl(impl)
    old = (hp._shared_release, hp._shared_retire)
    hp.set_shared_release(old[0], lambda core, ptr, *a: ptr % 0x20000 == 0)
    try:
        rnd = random.Random(5)
        c = _bare_core(hp)
        c.cache_limit, c.cache_max_block = 40 * KB, 8 * KB
        streams = [type("S", (), {"ptr": k})() for k in (0, 1)]
        addrs = iter(range(0x100000, 0x10000000, 0x10000))
        live = []
        for step in range(3000):
            op = rnd.random()
            if op < 0.5:
                size = KB * rnd.choice([1, 2, 3, 9])
                live.append(c._make_block(next(addrs), size, rnd.choice(streams), 0))
            elif op < 0.85 and live:
                live.pop(rnd.randrange(len(live)))
            elif op < 0.92:
                s = rnd.choice(streams)
                c._cache_shared(next(addrs), KB * rnd.choice([1, 16]), s.ptr, s, "rec")
            elif op < 0.97:
                c.flush_cache()
            else:
                c._take_cache()
            cached = [ptr for b in c._cache.values() for ptr, _ in b.entries()]
            assert c.cached_bytes == _bin_sum(c) <= c.cache_limit, step
            assert len(cached) == len(set(cached)), step
            assert not set(cached) & set(c.freed), step
        live.clear()
        assert c.n_allocs == c.n_frees and c.live_bytes == 0
        c._mark_closed()
        assert c.cached_bytes == 0 == _bin_sum(c) and c._cache == {}
        assert len(c.freed) == len(set(c.freed))
    finally:
        hp.set_shared_release(*old)


# ---------------------------------------------------------------- finalized streams
class _DyingStream:
    """A stream object whose finalizer destroys its stream (as cupy.cuda.Stream's)."""

    def __init__(self, ptr, log):
        self.ptr, self.log = ptr, log

    def __del__(self):
        self.log.append(("destroy", self.ptr))


class _Holder:
    """An object that lets go of its array in its finalizer (a close() there)."""

    def __del__(self):
        self.arr = None


def _cache_in_a_dying_cycle(alloc, log, sptr):
    """A garbage cycle of a holder and a stream: the holder's finalizer frees its array
    before the stream's finalizer destroys the stream, so the block is cached with the
    stream object (which the cache resurrects) that is destroyed just after."""
    h = _Holder()
    s = _DyingStream(sptr, log)
    h.arr = alloc(s)
    ptr = h.arr.ptr
    h.s, s.h = s, h
    del h, s
    gc.collect()
    assert ("destroy", sptr) in log
    return ptr


def test_twin_a_block_cached_with_a_stream_destroyed_after_is_never_reused_on_it(
    world, fake_retirer
):
    p = world.pool()

    first = world.current

    def alloc(s):
        world.current = s
        m = p.malloc(KB)
        world.current = first
        return m

    ptr = _cache_in_a_dying_cycle(alloc, world.log, 0x7000)
    world.current = _DyingStream(0x7000, [])  # a new stream, given the same handle
    m = p.malloc(KB)
    assert m.ptr != ptr  # not reused: its last work was on a destroyed stream
    del m
    p.flush_cache()
    assert ptr not in _frees(world)  # and never freed on the destroyed stream ...
    fake_retirer.drain()
    assert ("free", ptr, 0) in fake_retirer.log.events  # ... but by the retirer, after a sync
    assert p.cached_bytes == _bin_sum(p)


@pytest.mark.parametrize("impl", ["twin", "compiled"])
def test_a_flush_never_frees_a_block_on_a_stream_finalized_while_it_was_cached(impl):
    hp = _impl(impl)
    c = _bare_core(hp)
    orphans = []
    c._orphan = lambda ptr, size, flags: orphans.append(ptr) or True
    log: list = []

    def alloc(s):
        return c._make_block(0x1000, KB, s, 0)

    ptr = _cache_in_a_dying_cycle(alloc, log, 1)
    assert c.cached_bytes == KB
    c.flush_cache()
    assert c.freed == [] and orphans == [ptr] and c.cached_bytes == 0


# ---------------------------------------------------------------- bins: many, and big
@pytest.mark.parametrize("impl", ["twin", "compiled"])
def test_ten_thousand_sizes_and_a_deep_bin_keep_count_and_references(impl):
    """10,000 bins of one block, one bin of 5,000 (its array grown many times): the
    cache counts them all, a flush frees each once, and no reference to a stream
    object is left behind (the list beside the addresses, the slots taken)."""
    import sys

    hp = _impl(impl)
    c = _bare_core(hp)
    c.cache_limit = c.cache_max_block = 1 << 40
    s = type("S", (), {"ptr": 1})()
    base = sys.getrefcount(s)
    addrs = iter(range(0x100000, 1 << 40, 0x1000))
    for size in range(1, 10001):
        c._make_block(next(addrs), size, s, 0)  # dropped at once: cached
    deep = [c._make_block(next(addrs), 64, s, 0) for _ in range(5000)]
    deep.clear()
    assert len(c._cache) == 10000 and c._cache[1, 64].n == 5001
    assert c.cached_bytes == 10000 * 10001 // 2 + 5000 * 64 == _bin_sum(c)
    assert sys.getrefcount(s) == base + 15000
    assert c.flush_cache() == 10000 * 10001 // 2 + 5000 * 64
    assert len(c.freed) == len(set(c.freed)) == 15000
    gc.collect()
    assert sys.getrefcount(s) == base and c.cached_bytes == 0 and c._cache == {}
