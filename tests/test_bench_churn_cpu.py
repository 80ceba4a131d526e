"""The churn benchmark's trace and goal line (the replay itself needs a GPU)."""

from __future__ import annotations

from cupy_poolmem.benchmarks import churn

MiB = 1 << 20


def test_the_trace_frees_out_of_order_and_never_exceeds_the_live_bound():
    live = 256 * MiB
    steps = churn.trace(5000, live)
    arrays: list[int] = []
    out_of_order = 0
    for size, frees in steps:
        for i in frees:
            assert 0 <= i < len(arrays)
            out_of_order += i != 0  # not the oldest array
            arrays[i] = arrays[-1]
            arrays.pop()
        arrays.append(size)
        assert sum(arrays) <= max(live, size)
    assert out_of_order > 1000
    sizes = {s for s, _ in steps}
    assert len(sizes) > 2000  # many sizes, not a few bins
    assert sum(1 for s, _ in steps if s == 4 << 20) > 50  # and common ones that repeat


def test_replay_runs_the_same_arrays_for_any_maker_and_drops_them():
    steps = churn.trace(300, 8 * MiB)
    made: list[bytearray] = []

    def make(n: int) -> bytearray:
        b = bytearray(1)
        made.append(b)
        return b

    samples = []
    dt = churn.replay(steps, make, lambda: samples.append(1))
    assert dt > 0 and len(made) == 300 and len(samples) == 300


def test_the_goal_line_says_missed_when_slower_or_bigger():
    base = ("cupy MemoryPool (baseline)", 2e-6, 1000)
    assert "missed" in churn.goal_line([base, ("cupy_poolmem DevicePool (default)", 3e-6, 100)])
    assert "missed" in churn.goal_line([base, ("cupy_poolmem DevicePool (default)", 2e-6, 900)])
    assert "met" in churn.goal_line([base, ("cupy_poolmem DevicePool (default)", 2e-6, 800)])
