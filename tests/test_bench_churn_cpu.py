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


class _FakePools:
    """CUDA pools as the variants replay drives them: blocks handed out and taken back."""

    def __init__(self) -> None:
        self.next = 1
        self.live: dict[int, tuple[int, int]] = {}  # ptr -> (pool, size)
        self.freed: list[int] = []
        self.trims = [0, 0]
        self.by_pool: list[list[int]] = [[], []]

    def alloc(self, i: int, size: int) -> int:
        ptr, self.next = self.next, self.next + 1
        self.live[ptr] = (i, size)
        self.by_pool[i].append(size)
        return ptr

    def free(self, ptr: int) -> None:
        assert ptr in self.live, f"{ptr} freed twice or never allocated"
        del self.live[ptr]
        self.freed.append(ptr)

    def trim(self, i: int) -> None:
        self.trims[i] += 1


def test_the_variants_replay_frees_every_block_once_and_splits_by_size():
    from cupy_poolmem.benchmarks import _churn_variants as cv

    steps = churn.trace(2000, 64 * MiB)
    for _label, split, trim in cv.VARIANTS:
        ops = _FakePools()
        trims, left = cv.replay_on(steps, ops, split, trim)
        assert not ops.live and len(ops.freed) == len(steps)  # each block freed once
        assert left == len(steps) - sum(len(f) for _, f in steps)
        with_frees = sum(1 for _, f in steps if f)
        assert trims == (with_frees if trim else 0)
        assert ops.trims == [trims, trims if split else 0]
        if split:
            assert ops.by_pool[0] and max(ops.by_pool[0]) <= split
            assert ops.by_pool[1] and min(ops.by_pool[1]) > split
        else:
            assert not ops.by_pool[1]
