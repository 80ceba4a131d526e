"""The arena's placement (``_arena.pyx`` and its twin ``_arena_py.py``) on a CPU: first
fit by address, splits and merges, the range's top, and both twins on the same random traces."""

from __future__ import annotations

import random

import pytest

from cupy_poolmem import _arena_py

try:
    from cupy_poolmem import _arena as _compiled
except ImportError:  # not built: the twin alone
    _compiled = None

KINDS = [_arena_py] + ([_compiled] if _compiled is not None else [])
BASE = 0x7000_0000_0000


@pytest.fixture(params=KINDS, ids=lambda m: m.__name__.rsplit(".", 1)[1])
def arena(request):
    return lambda limit=1 << 30: request.param.Arena(BASE, limit, 0x5000)


def check(a) -> None:
    """The spans tile [base, top), no two free spans touch, and the holes are exactly
    the free spans; free_bytes and n_live agree."""
    spans = a.spans()
    at = a.base
    for i, (addr, size, free) in enumerate(spans):
        assert addr == at and size > 0 and size % 512 == 0
        if free and i:
            assert not spans[i - 1][2], "two free spans side by side"
        at += size
    assert at == a.top
    assert sorted((s, p) for p, s, f in spans if f) == a.holes()
    assert a.free_bytes == sum(s for _, s, f in spans if f)
    assert a.n_live == sum(1 for *_, f in spans if not f)


def test_nothing_is_taken_before_the_range_is_mapped(arena):
    a = arena()
    assert a.take(1) == 0 and a.mapped == 0


def test_the_lowest_free_span_that_fits_is_taken_at_its_start(arena):
    a = arena()
    a.extend(64 << 10)
    p = [a.take(8 << 10) for _ in range(5)]  # 5 x 8 KiB, then 24 KiB free at the top
    a.give(p[1])  # an 8 KiB hole
    a.give(p[3])  # another
    assert a.take(4 << 10) == p[1]  # the lowest of the three that fit
    assert a.take(8 << 10) == p[3]
    assert a.take(16 << 10) == p[4] + (8 << 10)  # the top's room
    check(a)


def test_first_fit_takes_a_lower_span_over_a_tighter_higher_one(arena):
    a = arena()
    a.extend(64 << 10)
    p = [a.take(n << 10) for n in (16, 4, 8, 4)]  # then 32 KiB free at the top
    a.give(p[0])  # 16 KiB free, low
    a.give(p[2])  # 8 KiB free, higher: best fit would take it for 8 KiB
    assert a.take(8 << 10) == p[0]
    assert a.take(8 << 10) == p[0] + (8 << 10)
    assert a.take(8 << 10) == p[2]
    check(a)


def test_sizes_round_up_to_512_bytes_and_zero_takes_one_unit(arena):
    a = arena()
    a.extend(4096)
    p, q, r = a.take(1), a.take(513), a.take(0)
    assert (q - p, r - q) == (512, 1024)
    assert a.give(q) == 1024 and a.give(r) == 512
    check(a)


def test_a_freed_span_merges_with_both_neighbours(arena):
    a = arena()
    a.extend(3 * 4096)
    p, q, r = a.take(4096), a.take(4096), a.take(4096)
    a.give(p)
    a.give(r)
    assert len(a.spans()) == 3
    a.give(q)
    assert a.spans() == [(BASE, 3 * 4096, True)]
    check(a)


def test_giving_an_address_that_is_no_live_span_changes_nothing(arena):
    a = arena()
    a.extend(8192)
    p = a.take(4096)
    before = a.spans()
    assert a.give(p + 512) == 0 and a.give(BASE + 4096) == 0  # inside, and free
    assert a.give(p) == 4096 and a.give(p) == 0  # a second free of the same block
    assert a.spans() == [(BASE, 8192, True)] and before != a.spans()
    check(a)


def test_extend_grows_the_free_top_and_cut_tail_takes_it_back(arena):
    a = arena(limit=1 << 20)
    a.extend(4096)
    p = a.take(1024)
    a.extend(8192)  # merges with the free 3 KiB at the top
    assert a.tail_free == 3072 + 8192 and len(a.spans()) == 2
    a.cut_tail(8192)
    assert a.top == BASE + 4096 and a.tail_free == 3072
    assert not a.cut_tail(3584)  # more than is free at the top: nothing changes
    assert a.cut_tail(3072)
    assert a.spans() == [(p, 1024, False)] and a.tail_free == 0
    assert not a.cut_tail(512)
    with pytest.raises(ValueError, match="cannot cut 100 bytes"):
        a.cut_tail(100)
    a.extend(1 << 19)  # after a live span: a new free one
    check(a)


@pytest.mark.parametrize("n", [0, 100, (1 << 20) + 512])
def test_extend_refuses_sizes_off_the_unit_and_past_the_limit(arena, n):
    a = arena(limit=1 << 20)
    with pytest.raises(ValueError, match="cannot extend"):
        a.extend(n)
    assert a.mapped == 0


def test_a_request_above_the_limit_is_refused_without_overflow(arena):
    a = arena(limit=1 << 20)
    a.extend(1 << 20)
    assert a.take(2**64 - 1) == 0 and a.take((1 << 20) + 1) == 0
    assert a.take(1 << 20) == BASE


def _replay(mod, seed: int, steps: int = 3000) -> list:
    rng = random.Random(seed)
    a = mod.Arena(BASE, 1 << 34, 0)
    live: list[int] = []
    out = []
    for step in range(steps):
        if live and rng.random() < 0.45:
            p = live.pop(rng.randrange(len(live)))
            out.append(("give", a.give(p)))
        else:
            size = int(2 ** rng.uniform(0, 24))
            p = a.take(size)
            if p == 0:
                a.extend(max(2 << 20, (size + (2 << 20) - 1) // (2 << 20) * (2 << 20)))
                p = a.take(size)
            assert p
            live.append(p)
            out.append(("take", p))
        if step % 7 == 0 and a.tail_free >= 2 << 20:
            a.cut_tail(2 << 20)
            out.append(("cut", a.top))
        if step % 500 == 0:
            check(a)
    check(a)
    for p in live:
        a.give(p)
    out.append(a.spans())
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_traces_keep_the_invariants(seed):
    _replay(_arena_py, seed)


@pytest.mark.skipif(_compiled is None, reason="needs the compiled extension (Cython build)")
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_the_compiled_arena_places_every_block_where_its_twin_does(seed):
    assert _replay(_compiled, seed) == _replay(_arena_py, seed)
