"""The churn benchmark's trace, goal line and page-mapper sketch (the replays need a GPU)."""

from __future__ import annotations

import pytest

from cupy_poolmem.benchmarks import churn
from cupy_poolmem.benchmarks._paired import PairedRatio

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
    base = (churn.BASE_LABEL, 2e-6, 1000)
    assert "missed" in churn.goal_line([base, ("cupy_poolmem DevicePool (default)", 3e-6, 100)])
    assert "missed" in churn.goal_line([base, ("cupy_poolmem DevicePool (default)", 2e-6, 900)])
    assert "met" in churn.goal_line([base, ("cupy_poolmem DevicePool (default)", 2e-6, 800)])


def test_the_goal_line_takes_the_paired_time_ratio_over_the_medians():
    """The rows' medians say equal speed, the paired replays say 1.3x: missed."""
    base = (churn.BASE_LABEL, 2e-6, 1000)
    rows = [base, (churn.MAPPED_LABEL, 2e-6, 700)]
    assert "met (0.70x, 1.00x)" in churn.goal_line(rows)
    paired = {churn.MAPPED_LABEL: PairedRatio(1.3, 1.2, 1.4, 8)}
    assert "missed (0.70x, 1.30x paired)" in churn.goal_line(rows, paired)
    paired = {churn.MAPPED_LABEL: PairedRatio(0.9, 0.8, 1.0, 8)}
    assert "met (0.70x, 0.90x paired)" in churn.goal_line(rows, paired)


class _Clock:
    """A host whose speed halves after a while: the first allocator timed in a process
    also pays a first-use cost ten times its replay."""

    def __init__(self) -> None:
        self.t = 0.0
        self.first = True

    def run(self, label: str, cost: float, log: list[str]) -> churn.Run:
        def run() -> tuple[float, int]:
            slow = 2.0 if self.t > 1.0 else 1.0
            dt = cost * slow * (10.0 if self.first else 1.0)
            self.first = False
            self.t += dt
            log.append(label)
            return dt, 100

        return run


def test_timed_rounds_warm_every_allocator_up_and_rotate_the_order():
    clock, log = _Clock(), []
    runs = {"base": clock.run("base", 0.1, log), "ours": clock.run("ours", 0.1, log)}
    out = churn.timed_rounds(runs, rounds=4)
    # The warm-up round is untimed: the first-use cost charged to "base" is not counted.
    assert log[:2] == ["base", "ours"]
    assert log[2:] == ["base", "ours", "ours", "base", "base", "ours", "ours", "base"]
    assert out["base"][0] == pytest.approx(out["ours"][0])
    assert out["base"][1] == 100


def test_the_paired_speed_holds_when_the_host_slows_between_allocators():
    """Timed one after the other, a host that halves its speed midway would make equal
    allocators look 2x apart; paired replays see the same speed in each pair."""
    clock, log = _Clock(), []
    clock.first = False
    base, ours = clock.run("base", 0.05, log), clock.run("ours", 0.05 * 1.2, log)
    ratio = churn.paired_speed(base, ours, pairs=12)
    assert ratio.median == pytest.approx(1.2, rel=0.01)
    assert ratio.pairs == 12
    assert log[:4] == ["base", "ours", "ours", "base"]  # ABBA


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


class _FakePages:
    """PageMapper's driver: checks that a page is mapped at one place at a time, and
    that every range is unmapped and given back as it was reserved."""

    def __init__(self, page: int, fail_map_at: int = -1) -> None:
        self.page, self.fail_map_at = page, fail_map_at
        self.created = 0
        self.where: dict[str, int] = {}  # page handle -> address it is mapped at
        self.ranges: dict[int, int] = {}  # reserved address -> bytes
        self.next_va = 1 << 40
        self.maps = 0
        self.released: list[str] = []

    def create(self, n: int) -> str:
        assert n == self.page
        self.created += 1
        return f"page{self.created}"

    def reserve(self, n: int) -> int:
        va, self.next_va = self.next_va, self.next_va + n + self.page
        self.ranges[va] = n
        return va

    def map(self, va: int, n: int, h: str) -> None:
        assert n == self.page
        self.maps += 1
        if self.maps == self.fail_map_at:
            raise RuntimeError("cuMemMap failed: CUDA_ERROR_OUT_OF_MEMORY")
        assert h not in self.where, f"{h} mapped twice"
        assert any(b <= va < b + n for b, n in self.ranges.items())
        self.where[h] = va

    def access(self, va: int, n: int) -> None:
        assert self.ranges[va] == n

    def unmap(self, va: int, n: int) -> None:
        gone = [h for h, a in self.where.items() if va <= a < va + n]
        assert len(gone) * self.page == n, "unmapped what was not mapped"
        for h in gone:
            del self.where[h]

    def unreserve(self, va: int, n: int) -> None:
        assert self.ranges.pop(va) == n

    def release(self, h: str) -> None:
        assert h not in self.where
        self.released.append(h)


def test_the_page_mapper_creates_pages_only_for_the_most_ever_live():
    from cupy_poolmem.benchmarks import _churn_variants as cv
    from cupy_poolmem.benchmarks._page_mapper import PageMapper

    page = 2 * MiB
    steps = churn.trace(3000, 256 * MiB)
    small, drv = _FakePools(), _FakePages(page)
    ops = cv.PagedOps(small, PageMapper(drv, page))
    live: dict[int, int] = {}
    most = 0
    orig_alloc, orig_free = ops.mapper.alloc, ops.mapper.free

    def alloc(size):
        nonlocal most
        va = orig_alloc(size)
        live[va] = -(-size // page)
        most = max(most, sum(live.values()))
        assert len(drv.where) == sum(live.values())  # every live page mapped, once
        return va

    def free(va):
        orig_free(va)
        del live[va]

    ops.mapper.alloc, ops.mapper.free = alloc, free
    cv.replay_on(steps, ops, cv.PAGED_SPLIT, False)
    assert most and ops.mapper.pages == most == drv.created
    assert not drv.where and not drv.ranges and not live  # all unmapped, ranges given back
    assert max(small.by_pool[0]) <= cv.PAGED_SPLIT and not small.by_pool[1]
    assert ops.mapper.peak_bytes == most * page
    ops.mapper.close()
    assert sorted(drv.released) == sorted(f"page{i}" for i in range(1, most + 1))


def test_a_page_mapper_alloc_that_fails_gives_everything_back():
    from cupy_poolmem.benchmarks._page_mapper import PageMapper

    drv = _FakePages(2 * MiB, fail_map_at=3)
    m = PageMapper(drv, 2 * MiB)
    with pytest.raises(RuntimeError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        m.alloc(6 * MiB)  # the third page's map fails
    assert not drv.where and not drv.ranges and not m.blocks
    assert m.pages == 3 and len(m.free_pages) == 3  # created pages kept for the next
    va = m.alloc(6 * MiB)
    assert m.pages == 3 and len(drv.where) == 3 and m.blocks[va]


class _FakeBlocks(_FakePages):
    """BlockMapper's driver: any size, a handle per block, released once unmapped."""

    def __init__(self, page: int, fail: str = "") -> None:
        super().__init__(page)
        self.fail = fail
        self.alive: set[str] = set()

    def create(self, n: int) -> str:
        assert n % self.page == 0
        self.created += 1
        self.alive.add(f"block{self.created}")
        return f"block{self.created}"

    def map(self, va: int, n: int, h: str) -> None:
        if self.fail == "map":
            raise RuntimeError("cuMemMap failed: CUDA_ERROR_OUT_OF_MEMORY")
        assert h not in self.where and self.ranges[va] == n
        self.where[h] = va

    def access(self, va: int, n: int) -> None:
        if self.fail == "access":
            raise RuntimeError("cuMemSetAccess failed: CUDA_ERROR_INVALID_VALUE")
        super().access(va, n)

    def unmap(self, va: int, n: int) -> None:
        gone = [h for h, a in self.where.items() if a == va]
        assert len(gone) == 1
        del self.where[gone[0]]

    def release(self, h: str) -> None:
        assert h not in self.where
        self.alive.remove(h)


def test_the_block_mapper_reserves_what_is_live_rounded_to_the_page():
    from cupy_poolmem.benchmarks import _churn_variants as cv
    from cupy_poolmem.benchmarks._page_mapper import BlockMapper

    page = 2 * MiB
    steps = churn.trace(3000, 256 * MiB)
    drv = _FakeBlocks(page)
    ops = cv.PagedOps(_FakePools(), BlockMapper(drv, page))
    most, live = 0, 0
    orig_alloc = ops.mapper.alloc

    def alloc(size):
        nonlocal most, live
        va = orig_alloc(size)
        live = sum(n for _, n in ops.mapper.blocks.values())
        most = max(most, live)
        assert len(drv.alive) == len(ops.mapper.blocks)  # freed blocks' memory released
        return va

    ops.mapper.alloc = alloc
    cv.replay_on(steps, ops, cv.PAGED_SPLIT, False)
    assert most and ops.mapper.peak_bytes == most and ops.mapper.live == 0
    assert not drv.alive and not drv.where and not drv.ranges


@pytest.mark.parametrize("fail", ["map", "access"])
def test_a_block_mapper_alloc_that_fails_gives_everything_back(fail):
    from cupy_poolmem.benchmarks._page_mapper import BlockMapper

    drv = _FakeBlocks(2 * MiB, fail=fail)
    m = BlockMapper(drv, 2 * MiB)
    with pytest.raises(RuntimeError, match="failed: CUDA_ERROR"):
        m.alloc(5 * MiB)
    assert not drv.alive and not drv.where and not drv.ranges and not m.blocks and m.live == 0
