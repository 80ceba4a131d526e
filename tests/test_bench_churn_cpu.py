"""The churn benchmark's trace, timing rounds, goal line and CUDA-pool variants (the replays
need a GPU)."""

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
    out = churn.timed_rounds(runs, rounds=2)
    # The warm-up round is untimed: the first-use cost charged to "base" is not counted.
    assert log[:2] == ["base", "ours"]
    assert log[2:] == ["base", "ours", "ours", "base"]
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


def test_a_device_pool_replay_finishes_its_retirement_before_the_next_replay(monkeypatch):
    """A closed DevicePool is retired by the retirer's thread: left to it, the sync,
    the park and (mapped pools) the unmapping of every cached block would land in the
    next allocator's timed replay."""
    from cupy_poolmem import _retire

    drained: list[int] = []

    class Retirer:
        pending = 2

        def drain(self):
            drained.append(self.pending)
            self.pending -= 1
            return True

    closed = []
    retirer = Retirer()
    monkeypatch.setattr(_retire, "retirer", lambda: retirer)
    pool = type("Pool", (), {"close": lambda self: closed.append(1)})()
    churn.close_device_pool(pool)
    assert closed == [1] and drained == [2, 1] and retirer.pending == 0


class _FakeTorch:
    """torch.cuda's allocator calls played on the host: settings, peak, emptying."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.log: list = []
        self.expandable = False
        self.fail_at = fail_at
        self.n = 0
        self.uint8 = "uint8"
        fake = self

        class Memory:
            @staticmethod
            def _set_allocator_settings(text: str) -> None:
                fake.log.append(text)
                fake.expandable = text.endswith("True")

        class Cuda:
            memory = Memory

            synchronize = staticmethod(lambda: None)
            reset_peak_memory_stats = staticmethod(lambda: fake.log.append("reset"))
            empty_cache = staticmethod(lambda: fake.log.append("empty"))
            max_memory_reserved = staticmethod(lambda: 123 if fake.expandable else 456)

        self.cuda = Cuda
        self._C = type("C", (), {})()  # a torch before 2.11: the setter in torch.cuda.memory

    def empty(self, n, dtype, device):
        self.n += 1
        if self.n == self.fail_at:
            raise MemoryError("out of memory")
        return bytearray(1)


@pytest.mark.parametrize("expandable", [False, True])
def test_torch_expandable_segments_are_on_for_their_own_replay_only(expandable):
    steps = churn.trace(50, 8 * MiB)
    t = _FakeTorch()
    dt, peak = churn.torch_run(steps, t, expandable=expandable)()
    assert t.n == 50 and dt > 0
    if expandable:  # emptied first, on for the replay (its peak), off after
        assert t.log == [
            "empty",
            "expandable_segments:True",
            "reset",
            "empty",
            "expandable_segments:False",
        ]
        assert peak == 123 and not t.expandable
    else:
        assert "expandable_segments:True" not in t.log and peak == 456


def test_torch_expandable_segments_go_off_when_the_replay_fails():
    t = _FakeTorch(fail_at=10)
    with pytest.raises(MemoryError):
        churn.torch_run(churn.trace(50, 8 * MiB), t, expandable=True)()
    assert t.log[-1] == "expandable_segments:False" and not t.expandable


def test_torch_2_11s_setter_is_preferred_when_there():
    t = _FakeTorch()
    calls = []
    t._C._accelerator_setAllocatorSettings = calls.append
    churn.torch_run(churn.trace(20, 8 * MiB), t, expandable=True)()
    assert calls == ["expandable_segments:True", "expandable_segments:False"]
    assert "expandable_segments:True" not in t.log  # the deprecated one is not called
