"""CPU tests of the paired-ratio estimator the allocation benchmark's goals rest on."""

from __future__ import annotations

import pytest

from cupy_poolmem.benchmarks._paired import PairedRatio, paired_ratio, timed_burst


class FakeCPU:
    """A clock that work advances by its cost times the speed level of the current burst.

    ``levels[i]`` is the level (1.0 fast, 1.8 slow: the lent hosts' 2.3 and 4.2 us) of
    the ``i``-th burst started, warm-ups included; every burst records its name, its
    level and the seconds per call it measured.
    """

    def __init__(self, levels: list[float]) -> None:
        self.t = 0.0
        self.levels = levels
        self.level = 1.0
        self.bursts: list[tuple[str, float, float]] = []

    def now(self) -> float:
        return self.t

    def burst(self, name: str, cost: float):
        def work() -> None:
            self.t += cost * self.level

        timed = timed_burst(work, timer=self.now)

        def burst(n: int) -> float:
            self.level = self.levels[len(self.bursts)]
            dt = timed(n)
            self.bursts.append((name, self.level, dt))
            return dt

        return burst


FAST, SLOW = 1.0, 1.8


def _best_of(cpu: FakeCPU, name: str) -> float:
    return min(dt for n, _level, dt in cpu.bursts[2:] if n == name)


def test_median_holds_where_each_sides_best_does_not():
    """B costs exactly 0.9x A.  The level flips between pairs (pairs 0-2 slow, 3-5 fast,
    6-10 slow) and one short fast spell catches A's burst of pair 7 alone: the paired
    median stays 0.9, each side's best of the same bursts compares A's spell with B's
    fast pairs and gives 0.9x * (spell's level / fast level)."""
    pair_levels = [SLOW] * 3 + [FAST] * 3 + [SLOW] * 5
    levels = [SLOW, SLOW]  # the warm-ups
    for level in pair_levels:
        levels += [level, level]
    spell = 0.8  # turbo for one burst: A's of pair 7 (B first in odd pairs: index 1)
    levels[2 + 2 * 7 + 1] = spell
    cpu = FakeCPU(levels)
    r = paired_ratio(cpu.burst("A", 2e-6), cpu.burst("B", 1.8e-6), pairs=11, calls=300)
    assert r.pairs == 11
    assert r.median == pytest.approx(0.9)
    assert r.low == pytest.approx(0.9) and r.high == pytest.approx(0.9)
    assert cpu.bursts[2 + 2 * 7 + 1][:2] == ("A", spell)
    best = _best_of(cpu, "B") / _best_of(cpu, "A")
    assert best == pytest.approx(0.9 * FAST / spell)  # 1.125x: the verdict would flip
    assert round(best, 2) > 1.0 >= round(r.median, 2)


def test_median_holds_when_the_level_flips_at_every_pair():
    levels = [SLOW, SLOW] + [lvl for k in range(25) for lvl in [(FAST, SLOW)[k % 2]] * 2]
    cpu = FakeCPU(levels)
    r = paired_ratio(cpu.burst("A", 2e-6), cpu.burst("B", 1.8e-6), pairs=25, calls=200)
    assert (r.median, r.pairs) == (pytest.approx(0.9), 25)
    # The bursts themselves swing by the levels' ratio.
    times = [dt for name, _l, dt in cpu.bursts if name == "A"]
    assert max(times) / min(times) == pytest.approx(SLOW / FAST)


def test_pairs_alternate_abba_after_one_warm_up_each():
    calls: list[tuple[str, int]] = []

    def burst(name: str, seconds: float):
        def run(n: int) -> float:
            calls.append((name, n))
            return seconds

        return run

    r = paired_ratio(burst("A", 2.0), burst("B", 1.0), pairs=5, calls=300, warmup=500)
    order = "AB BA AB BA AB".split()  # pairs 0..4
    assert calls[:2] == [("A", 500), ("B", 500)]  # warm-ups, untimed
    assert calls[2:] == [(side, 300) for pair in order for side in pair]
    assert r == PairedRatio(0.5, 0.5, 0.5, 5)  # B over A
    calls.clear()
    paired_ratio(burst("A", 2.0), burst("B", 1.0), pairs=2, calls=300)
    assert calls[:2] == [("A", 300), ("B", 300)]  # the warm-up defaults to a burst's calls
    calls.clear()
    paired_ratio(burst("A", 2.0), burst("B", 1.0), pairs=2, calls=300, warmup=0)
    assert calls == [("A", 300), ("B", 300), ("B", 300), ("A", 300)]


def test_each_pairs_ratio_is_its_own_b_over_a():
    """Ratios per pair, not a ratio of sums: A's and B's times are paired by position."""
    a_times = iter([1.0, 1.0, 2.0, 4.0, 4.0, 4.0])  # warm-up, then pairs 0..4
    b_times = iter([1.0, 3.0, 1.0, 2.0, 2.0, 2.0])
    r = paired_ratio(lambda n: next(a_times), lambda n: next(b_times), pairs=5, calls=10)
    # ratios 3.0, 0.5, 0.5, 0.5, 0.5
    assert r == PairedRatio(0.5, 0.5, 0.5, 5)


@pytest.mark.parametrize(
    ("ratios", "expected"),
    [
        ([1.0, 2.0, 3.0, 4.0, 5.0], (3.0, 2.0, 4.0)),
        ([4.0, 1.0, 3.0, 2.0], (2.5, 1.75, 3.25)),
        ([0.9, 1.1], (1.0, 0.95, 1.05)),
        ([0.97], (0.97, 0.97, 0.97)),
        ([1.0, 1.0, 1.0, 9.0, 1.0, 1.0, 1.0, 1.0, 1.0], (1.0, 1.0, 1.0)),
    ],
)
def test_quartiles_of_known_lists(ratios, expected):
    r = PairedRatio.of(ratios)
    assert (r.median, r.low, r.high) == pytest.approx(expected)
    assert r.pairs == len(ratios)


def test_format_gives_median_quartiles_and_pairs():
    r = PairedRatio(0.9712, 0.9488, 0.9901, 25)
    assert str(r) == "0.97x (IQR 0.95-0.99, 25 pairs)"
    assert r.format("paired median, ") == "0.97x (paired median, IQR 0.95-0.99, 25 pairs)"


def test_no_pairs_is_an_error():
    with pytest.raises(ValueError):
        PairedRatio.of([])
    with pytest.raises(ValueError):
        paired_ratio(lambda n: 1.0, lambda n: 1.0, pairs=0, calls=10)
    with pytest.raises(ValueError):
        paired_ratio(lambda n: 1.0, lambda n: 1.0, pairs=3, calls=0)


def test_timed_burst_gives_seconds_per_call():
    clock = [10.0]
    count = [0]

    def work() -> None:
        count[0] += 1
        clock[0] += 3e-6

    assert timed_burst(work, timer=lambda: clock[0])(250) == pytest.approx(3e-6)
    assert count[0] == 250
