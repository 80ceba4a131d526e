"""The reuse cache lets go of blocks nobody asks for: after FLUSH_AFTER_MISSES
allocations in a row that it cannot serve while it holds blocks, they go back to the
CUDA pool (where any size can reuse the memory), against the fake driver."""

from __future__ import annotations

import pytest

from cupy_poolmem import _hotpath_py as twin
from cupy_poolmem import _pools

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


def test_a_hit_resets_the_count_so_a_steady_working_set_keeps_its_cache(world):
    p = world.pool()
    steady = None
    for i in range(5 * N):
        a = p.malloc(KB)  # the steady size: served from the cache after the first
        steady = steady or a.ptr
        assert a.ptr == steady
        b = p.malloc(KB * (2 + i))  # a size seen once: a miss each round
        assert p.cache_misses == (1 if i else 0)  # the hit before restarted the count
        del a, b
    assert steady not in _frees(world)  # never flushed
    assert sum(1 for e in world.log if e[0] == "alloc" and e[2] == KB) == 1


def test_an_empty_cache_counts_no_misses(world):
    p = world.pool()
    live = [p.malloc(KB * (i + 1)) for i in range(3 * N)]
    assert p.cache_misses == 0 and _frees(world) == []
    del live


def test_the_compiled_hot_path_flushes_after_the_same_count():
    pyx = (_pools.__file__.rsplit("/", 1)[0]) + "/_hotpath.pyx"
    src = open(pyx).read()
    assert f"FLUSH_AFTER_MISSES = {N}\n" in src
    assert f"cdef unsigned int _FLUSH_AFTER_MISSES = {N}\n" in src
    hit = src[src.index("stream = hit.take(&dptr)") : src.index("            if dptr == 0:")]
    assert "self.cache_misses = 0\n" in hit
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
    src = open(_pools.__file__.rsplit("/", 1)[0] + "/_hotpath.pyx").read()
    assert "stream = hit.take(&dptr)  # and the stream object that freed it" in src
