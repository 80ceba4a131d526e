"""The hot path's reuse cache, block by block, against the fake driver (tests/fakes/hotpath).

Per (stream handle, size) bins, the last bin remembered: reuse only on the same stream
and the exact size, last freed first; ``cached_bytes``, ``cache_limit`` and
``cache_max_block``; ``flush_cache`` and ``_take_cache``; exported blocks kept with their
sharing records (``_cache_shared``); the stream object that freed a block kept alive
while it is cached and handed to the next block made of it; the out-of-memory flush.
They drive the pure-Python twin; the compiled hot path runs the same cache scenarios
where it can without a GPU (the sharing entry point, flushes), and the lines of its
allocation path are compared with the twin's.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import cupy
import pytest
from fakes.hotpath import bare_core, compiled_hotpath, sharing_hooks

import cupy_poolmem as cpm
from cupy_poolmem import _hotpath_py as twin
from cupy_poolmem import _pools

pytestmark = pytest.mark.filterwarnings("ignore:ExternalStream is deprecated")

KB = 4096
S = 0x5000  # World's current stream
S2 = 0x6000
PYX = Path(twin.__file__).with_name("_hotpath.pyx")


@pytest.fixture
def world(twin_world):
    return twin_world


def _allocs(world):
    return [e[1] for e in world.log if e[0] == "alloc"]


def _frees(world):
    return [(e[1], e[2]) for e in world.log if e[0] == "free"]


def _on(world, sptr):
    world.current = cupy.cuda.ExternalStream(sptr, 0)
    return world.current


# ---------------------------------------------------------------- hits and misses
def test_a_block_is_reused_only_on_its_stream_and_at_its_exact_size(world):
    p = world.pool()
    m = p.malloc(KB)
    ptr = m.ptr
    del m
    assert p.cached_bytes == KB and _frees(world) == []
    other_size = p.malloc(KB + 256)  # a miss: another size
    _on(world, S2)
    other_stream = p.malloc(KB)  # a miss: another stream
    assert ptr not in (other_size.ptr, other_stream.ptr) and p.cached_bytes == KB
    _on(world, S)
    hit = p.malloc(KB)
    assert hit.ptr == ptr and p.cached_bytes == 0
    assert len(_allocs(world)) == 3  # the hit asked the driver nothing
    del other_size, other_stream, hit


def test_blocks_of_one_bin_come_back_last_freed_first(world):
    p = world.pool()
    ms = [p.malloc(KB) for _ in range(3)]
    ptrs = [m.ptr for m in ms]
    for i in range(3):
        ms[i] = None  # freed in allocation order
    assert p.cached_bytes == 3 * KB
    assert [p.malloc(KB).ptr for _ in range(1)] == [ptrs[2]]  # dropped again at once
    again = [p.malloc(KB) for _ in range(3)]
    assert [m.ptr for m in again] == [ptrs[2], ptrs[1], ptrs[0]]
    assert p.cached_bytes == 0


def test_alternating_sizes_and_streams_each_find_their_own_bin(world):
    """The last-bin shortcut must never hand a block of another key."""
    p = world.pool()
    keys = [(S, KB), (S, 2 * KB), (S2, KB), (S2, 2 * KB)]
    first = {}
    for sptr, size in keys:
        _on(world, sptr)
        m = p.malloc(size)
        first[sptr, size] = m.ptr
        del m
    for _ in range(3):
        for sptr, size in keys + keys[::-1]:
            _on(world, sptr)
            m = p.malloc(size)
            assert m.ptr == first[sptr, size] and m.mem._owner.stream_ptr == sptr
            del m
    assert len(_allocs(world)) == 4 and p.cached_bytes == 6 * KB


def test_size_zero_never_enters_the_cache(world):
    p = world.pool()
    z = p.malloc(0)
    assert z.ptr == 0
    del z
    assert p.cached_bytes == 0 and p._cache == {}


# ---------------------------------------------------------------- limits
def test_the_cache_keeps_blocks_up_to_its_limit_and_frees_the_rest(world):
    p = world.pool(reuse_cache=2 * KB)
    ms = [p.malloc(KB) for _ in range(3)]
    ptrs = [m.ptr for m in ms]
    for i in range(3):
        ms[i] = None
    assert p.cached_bytes == 2 * KB  # two fit, the third goes to the driver
    assert _frees(world) == [(ptrs[2], S)]


def test_blocks_above_cache_max_block_always_go_to_the_driver(world):
    p = world.pool(reuse_cache=1 << 20)
    p.cache_max_block = 2 * KB
    big, small = p.malloc(2 * KB + 1), p.malloc(2 * KB)
    bptr = big.ptr
    del big, small
    assert _frees(world) == [(bptr, S)] and p.cached_bytes == 2 * KB


def test_a_pool_without_a_cache_frees_every_block(world):
    p = world.pool(reuse_cache=0)
    m = p.malloc(KB)
    ptr = m.ptr
    del m
    assert _frees(world) == [(ptr, S)] and p.cached_bytes == 0 and p._cache == {}


def test_a_closed_pool_caches_nothing(world):
    p = world.pool()
    m = p.malloc(KB)
    ptr = m.ptr
    p._mark_closed()
    del m
    assert _frees(world) == [(ptr, S)] and p.cached_bytes == 0


# ---------------------------------------------------------------- flush and take
def test_flush_frees_each_block_on_its_stream_and_starts_a_fresh_cache(world):
    p = world.pool()
    a = p.malloc(KB)
    _on(world, S2)
    b = p.malloc(2 * KB)
    pa, pb = a.ptr, b.ptr
    del a, b
    assert p.flush_cache() == 3 * KB
    assert sorted(_frees(world)) == sorted([(pa, S), (pb, S2)])
    assert p.cached_bytes == 0 and p._cache == {}
    # Freed after the flush: cached in the new cache (the last bin was forgotten) ...
    c = p.malloc(2 * KB)
    pc = c.ptr
    del c
    assert p.cached_bytes == 2 * KB and [e for b in p._cache.values() for e in b.entries()] == [
        (pc, world.current)
    ]
    # ... where the next flush finds it.
    assert p.flush_cache() == 2 * KB and _frees(world)[-1] == (pc, S2)
    assert p.flush_cache() == 0


def test_take_cache_hands_the_addresses_over_and_forgets_the_last_bin(world):
    p = world.pool()
    m = p.malloc(KB)
    ptr = m.ptr
    del m
    n = len(world.log)
    assert p._take_cache() == [ptr] and world.log[n:] == [] and p.cached_bytes == 0
    m = p.malloc(KB)  # a miss: the cache is empty
    assert m.ptr != ptr
    del m
    assert p._take_cache() != [] and p._take_cache() == []


def test_out_of_memory_flushes_the_cache_before_the_retry(world, monkeypatch):
    p = world.pool()
    m = p.malloc(KB)
    cached = m.ptr
    del m
    attempts = iter([(2, 0), (0, 0x777000)])
    monkeypatch.setattr(twin.driver, "alloc", lambda size, pool, s: next(attempts))
    big = p.malloc(8 * KB)  # a miss, the driver is out of memory, the cache goes back
    assert big.ptr == 0x777000 and p.n_oom == 1
    assert (cached, S) in _frees(world) and p.cached_bytes == 0


# ---------------------------------------------------------------- the stream objects
def test_a_cached_block_keeps_the_stream_object_that_freed_it_alive(world):
    p = world.pool()
    s = _on(world, S)
    m = p.malloc(KB)
    ref = weakref.ref(s)
    _on(world, S2)
    del s, m  # the block is cached with its stream: the only reference left
    gc.collect()
    assert ref() is not None
    _on(world, S)  # another object for the same handle
    hit = p.malloc(KB)
    assert hit.mem._owner.stream is ref()  # the hit hands that object on
    del hit
    assert ref() is not None  # cached again, with it
    _on(world, S2)
    p.flush_cache()
    gc.collect()
    assert ref() is None  # flushed: nothing holds it any more


def test_each_cached_block_keeps_its_own_stream_object(world):
    """Two objects for one handle free into one bin: each block comes back with its own."""
    p = world.pool()
    s1 = _on(world, S)
    a = p.malloc(KB)
    s2 = _on(world, S)
    b = p.malloc(KB)
    pa, pb = a.ptr, b.ptr
    del a, b
    assert [p.malloc(KB).mem._owner.stream for _ in range(1)] == [s2]  # b, dropped again
    got = [p.malloc(KB) for _ in range(2)]
    assert [(m.ptr, m.mem._owner.stream) for m in got] == [(pb, s2), (pa, s1)]


# ---------------------------------------------------------------- exported blocks
def test_an_exported_block_comes_back_with_its_record_and_only_it(world):
    p = world.pool()
    rec = object()
    s = world.current
    assert p._cache_shared(0x900000, KB, S, s, rec) is True
    m = p.malloc(KB)
    plain = p.malloc(KB)  # the cache is empty now: a fresh block, no record
    assert m.ptr == 0x900000 and m.mem._owner.share is rec and m.mem._owner.stream is s
    assert plain.mem._owner.share is None and p._shares == {}
    pp = plain.ptr
    del plain
    again = p.malloc(KB)  # a plain block back from the cache: still no record
    assert again.ptr == pp and again.mem._owner.share is None


def test_exported_blocks_are_refused_when_the_cache_cannot_take_them(world):
    p = world.pool(reuse_cache=2 * KB)
    assert not p._cache_shared(0x900000, 3 * KB, S, None, object())  # over the limit
    assert p._cache_shared(0x900000, 2 * KB, S, None, object())  # any size within it
    p.flush_cache()
    p._mark_finalized()
    assert not p._cache_shared(0x910000, KB, S, None, object())
    q = world.pool()
    q._mark_closed()
    assert not q._cache_shared(0x920000, KB, S, None, object())
    assert q._shares == {} and q.cached_bytes == 0


def test_flush_and_take_give_exported_blocks_to_their_exporter(world, request):
    retired = []
    keep = set()

    def retire(core, ptr, size, stream, share):
        retired.append((ptr, size, stream, share))
        return ptr in keep

    sharing_hooks(request, twin, retire=retire)
    p = world.pool()
    s = world.current
    r1, r2 = object(), object()
    p._cache_shared(0x900000, KB, S, s, r1)
    p._cache_shared(0x910000, KB, S, s, r2)
    m = p.malloc(2 * KB)
    plain = m.ptr
    del m
    keep.add(0x910000)  # receivers still map it: the exporter keeps it
    assert p.flush_cache() == 4 * KB
    assert retired == [(0x900000, KB, s, r1), (0x910000, KB, s, r2)]
    assert sorted(_frees(world)) == sorted([(0x900000, S), (plain, S)])
    assert p._shares == {}
    retired.clear()
    p._cache_shared(0x900000, KB, S, s, r1)
    p._cache_shared(0x910000, KB, S, s, r2)
    assert p._take_cache() == [0x900000]  # the stream is not passed: it may be gone
    assert retired == [(0x900000, KB, None, r1), (0x910000, KB, None, r2)]


def test_a_failed_push_leaves_no_orphan_record(world):
    p = world.pool()

    class NoRoom(list):
        def append(self, item):
            raise MemoryError("no memory for the reuse cache")

    p._bin(S, KB, True).items = NoRoom()
    with pytest.raises(MemoryError):
        p._cache_shared(0x900000, KB, S, None, object())
    assert p._shares == {} and p.cached_bytes == 0


def test_a_bin_created_twice_by_a_nested_free_is_kept_once(world, monkeypatch):
    """A garbage collection while a bin is made can free a block of the same key (its
    _release makes the bin first): the outer call must use that bin, not replace it."""
    p = world.pool()
    real = twin._Bin
    nested = []

    def bin_with_a_collection(sptr, size):
        if not nested:
            nested.append(1)
            p._release(0x800000, size, sptr, world.current)  # the collection's free
        return real(sptr, size)

    monkeypatch.setattr(twin, "_Bin", bin_with_a_collection)
    p._release(0x810000, KB, S, world.current)
    assert p.cached_bytes == 2 * KB
    assert [e[0] for e in p._cache[S, KB].entries()] == [0x800000, 0x810000]


# ---------------------------------------------------------------- the compiled cache
def _bare_core(hp):
    return bare_core(hp, 16 * KB, with_streams=True)


@pytest.mark.parametrize("impl", ["twin", "compiled"])
def test_both_implementations_keep_flush_and_take_exported_blocks_alike(impl):
    hp = twin if impl == "twin" else compiled_hotpath()
    if hp is None:
        pytest.skip("the Cython hot path is not built in this checkout")
    retired = []
    old = (hp._shared_release, hp._shared_retire)
    hp.set_shared_release(old[0], lambda core, *a: retired.append(a) or a[0] == 0x3000)
    try:
        c = _bare_core(hp)
        s0, s0b, s1 = object(), object(), object()
        assert c._cache_shared(0x1000, KB, 0, s0, "r1")
        assert c._cache_shared(0x2000, KB, 0, s0b, "r2")
        assert c._cache_shared(0x3000, 2 * KB, 1, s1, "r3")
        assert not c._cache_shared(0x4000, 13 * KB, 0, s0, "r4")  # over the limit
        assert c.cached_bytes == 4 * KB
        assert sorted(c._cache) == [(0, KB), (1, 2 * KB)]
        b = c._cache[0, KB]
        assert (b.stream_ptr, b.size, b.n) == (0, KB, 2)
        assert b.entries() == [(0x1000, s0), (0x2000, s0b)]
        assert c.flush_cache() == 4 * KB and c.cached_bytes == 0 and c._cache == {}
        assert retired == [
            (0x1000, KB, s0, "r1"),
            (0x2000, KB, s0b, "r2"),
            (0x3000, 2 * KB, s1, "r3"),
        ]
        assert c.freed == [(0x1000, 0), (0x2000, 0)]  # 0x3000: its exporter keeps it
        retired.clear()
        c._cache_shared(0x1000, KB, 1, s1, "r1")
        c._cache_shared(0x3000, KB, 1, s1, "r3")
        assert c._take_cache() == [0x1000] and c.cached_bytes == 0
        assert retired == [(0x1000, KB, None, "r1"), (0x3000, KB, None, "r3")]
        assert c._take_cache() == [] and c.flush_cache() == 0
        c._mark_finalized()
        assert not c._cache_shared(0x5000, KB, 0, s0, "r5")
    finally:
        hp.set_shared_release(*old)


def test_the_compiled_allocation_path_uses_the_cache_as_the_twin_does():
    """There is no GPU to run the compiled malloc here: its cache lines are compared.
    (The twin makes _bin's first test inline: a Python call costs more than the test.)"""
    pyx = PYX.read_text()
    py = Path(twin.__file__).read_text()
    assert "hit = self._bin(sptr, size, False)" in pyx
    assert "stream = hit.take(&dptr)  # and the stream object that freed it" in pyx
    # A collection in _bin (it allocates) may close the pool: tested again, then pushed.
    release = pyx[pyx.index("    cdef _release(") : pyx.index("    def _cache_shared(")]
    assert (
        release.index("b = self._bin(stream_ptr, size, True)")
        < release.index("if not self.closed:")
        < release.index("b.push(ptr, stream)")
    )
    assert "if hit is None or size != self._last_size or sptr != self._last_sptr:" in py
    assert "dptr, freer = hit.items.pop()" in py
    assert "if b is None or size != self._last_size or stream_ptr != self._last_sptr:" in py
    for src in (pyx, py):
        assert "share = self._shares.pop(dptr, None)" in src
        # _bin: the last bin first, then the dict; a new bin through setdefault.
        assert "if b is not None and size == self._last_size and sptr == self._last_sptr" in src
        assert "self._cache.setdefault(" in src
        assert "self._last_bin, self._last_sptr, self._last_size = b, sptr, size" in src
        # Emptied in one place, which forgets the last bin (the records stay).
        assert "self._last_bin, self._last_sptr, self._last_size = None, 0, 0" in src
        assert src.count("self._swap_cache()") == 2
        assert "self._shares = {}" not in src[src.index(" _swap_cache(self)") :]
        # An exported block's record goes in before the block.
        shared = src[src.index("def _cache_shared") :]
        push = ".push(ptr, stream)" if src is pyx else ".items.append(item)"
        assert shared.index("self._shares[ptr] = share") < shared.index(push)
        # ...and the pool tested again after _bin, before the push (B3).
        again = "if self.closed or self.finalized:  # closed by a collection in _bin"
        assert shared.index("self._bin(stream_ptr, size, True)") < shared.index(again)
        assert shared.index(again) < shared.index(push)
    # The compiled bin never shrinks its list of streams, and clears a taken slot.
    take = pyx[pyx.index("    cdef object take(") : pyx.index("    def entries(")]
    assert "self.streams[self.n] = None" in take


def test_an_oom_reclaim_flushes_the_cache():
    src = Path(_pools._base.__file__).read_text()
    reclaim = src[src.index("    def _reclaim(") : src.index("    # -- blocks from a backend")]
    assert "self.flush_cache()" in reclaim
    assert issubclass(cpm.OutOfPoolMemoryError, MemoryError)
