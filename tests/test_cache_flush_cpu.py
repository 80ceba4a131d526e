"""The reuse cache lets go of blocks nobody asks for: once the allocations it cannot
serve while it holds blocks outnumber the ones it serves by FLUSH_AFTER_MISSES (a hit
takes one miss back), they go back to the CUDA pool (where any size can reuse the
memory), against the fake driver."""

from __future__ import annotations

import pytest

from cupy_poolmem import _hotpath_py as twin

pytestmark = pytest.mark.filterwarnings("ignore:ExternalStream is deprecated")

KB = 4096
N = twin.FLUSH_AFTER_MISSES


@pytest.fixture
def world(twin_world):
    return twin_world


def _frees(world):
    return [e[1] for e in world.log if e[0] == "free"]


def test_misses_in_a_row_flush_the_blocks_of_sizes_no_longer_asked_for(world):
    p = world.pool()
    old = [p.malloc(KB * (i + 1)) for i in range(4)]
    ptrs = {m.ptr for m in old}
    del old
    assert p.cached_bytes == KB * 10 and _frees(world) == []
    live = []
    for i in range(N - 1):  # new sizes: misses, the cache keeps its blocks meanwhile
        live.append(p.malloc(KB * (100 + i)))
        assert p.cache_misses == i + 1
    assert p.cached_bytes == KB * 10 and _frees(world) == []
    live.append(p.malloc(KB * 200))  # the N-th miss in a row: the cache is flushed
    assert p.cached_bytes == 0 and p.cache_misses == 0
    assert set(_frees(world)) == ptrs  # each freed to the CUDA pool, once
    del live


def test_hits_as_often_as_misses_keep_a_steady_working_set_cached(world):
    p = world.pool()
    steady = None
    for i in range(5 * N):
        a = p.malloc(KB)  # the steady size: served from the cache after the first
        steady = steady or a.ptr
        assert a.ptr == steady
        b = p.malloc(KB * (2 + i))  # a size seen once: a miss each round
        assert p.cache_misses == (1 if i else 0)  # the hit took the miss before back
        del a, b
    assert steady not in _frees(world)  # never flushed
    assert sum(1 for e in world.log if e[0] == "alloc" and e[2] == KB) == 1


def test_hits_fewer_than_misses_flush_though_no_run_of_misses_is_long(world):
    """One steady size among three sizes that never repeat: the hits alone used to keep
    the cache (each reset a count of misses in a row), so the one-off sizes stayed
    reserved up to ``reuse_cache`` bytes; now the count grows by two a round."""
    p = world.pool()
    warm = p.malloc(KB)
    steady = warm.ptr
    del warm
    held, flushed_in = [], None
    for r in range(1, N + 1):
        a = p.malloc(KB)  # a hit: one miss taken back
        assert a.ptr == steady
        for j in range(3):  # three misses
            held.append(p.malloc(512 * (10 + 3 * r + j)))  # under the 1 MiB cache
            if _frees(world):
                flushed_in = flushed_in or r
                assert p.cached_bytes == 0 and p.cache_misses == 0
        del a
        if flushed_in:
            break
        held.pop()  # one of the one-off blocks goes to the cache each round
    # Round 1 counts nothing (its hit emptied the cache); round 2 counts three misses,
    # each round after two more (three misses, one hit): 2r - 1 >= N in round (N+2)//2.
    assert flushed_in == (N + 2) // 2
    freed = _frees(world)
    assert steady not in freed  # it was live (``a``) when the cache was flushed
    assert len(freed) == len(set(freed)) and len(freed) == flushed_in - 1
    del held


def test_a_hit_with_no_misses_counted_leaves_the_count_at_zero(world):
    p = world.pool()
    a = p.malloc(KB)
    del a
    for _ in range(3):
        a = p.malloc(KB)
        assert p.cache_misses == 0
        del a


def test_an_empty_cache_counts_no_misses(world):
    p = world.pool()
    live = [p.malloc(KB * (i + 1)) for i in range(3 * N)]
    assert p.cache_misses == 0 and _frees(world) == []
    del live


def test_the_compiled_hot_path_counts_and_flushes_by_the_same_rule():
    pyx = (twin.__file__.rsplit("/", 1)[0]) + "/_hotpath.pyx"
    src = open(pyx).read()
    assert f"FLUSH_AFTER_MISSES = {N}\n" in src
    assert f"cdef unsigned int _FLUSH_AFTER_MISSES = {N}\n" in src
    hit = src[src.index("stream = hit.take(&dptr)") : src.index("            if dptr == 0:")]
    assert "if self.cache_misses:  # a hit takes one miss back" in hit
    assert "self.cache_misses -= 1\n" in hit and "self.cache_misses = 0" not in hit
    assert "\n                else:\n                    self._cache_missed()\n" in hit


def test_a_cache_hit_keeps_the_stream_object_that_freed_the_block(world):
    """The block served from the cache holds the stream object it was cached with (the
    one kept alive while it waited), as the compiled hot path does, not another wrapper
    of the same handle that happens to be current."""
    import cupy

    first = world.current
    m = world.pool().malloc(KB)
    p = m.mem._owner.core
    ptr = m.ptr
    del m
    world.current = cupy.cuda.ExternalStream(first.ptr, 0)  # same handle, new object
    m = p.malloc(KB)
    assert m.ptr == ptr and m.mem._owner.stream is first
    src = open(twin.__file__.rsplit("/", 1)[0] + "/_hotpath.pyx").read()
    assert "stream = hit.take(&dptr)  # and the stream object that freed it" in src


@pytest.mark.parametrize(
    ("hit_rate", "flushes"), [(0.75, (0, 0)), (0.5, (1, 60)), (0.1, (150, 400))]
)
def test_hits_and_misses_in_random_order_flush_by_hit_rate(world, hit_rate, flushes):
    """A steady size the cache serves at ``hit_rate`` among sizes seen once, in a seeded
    random order: about three hits in four never flush the cache in 4000 allocations,
    one in two flushes it now and then, one in ten every twenty allocations or so."""
    import random

    p = world.pool()
    n_flushes = 0
    flush = p.flush_cache

    def counting_flush():
        nonlocal n_flushes
        n_flushes += 1
        return flush()

    p.flush_cache = counting_flush  # the twin's hot path calls it by attribute
    rng = random.Random(1234)
    kept = []
    for i in range(4000):
        if rng.random() < hit_rate:
            x = p.malloc(KB)  # the steady size: a hit whenever its block is cached
            del x
        else:
            kept.append(p.malloc(512 * (16 + i)))  # seen once, kept live: a miss
            if len(kept) > 64:
                kept.pop(0)  # freed: cached (or over the limit), never asked for again
    lo, hi = flushes
    assert lo <= n_flushes <= hi
    del kept
