"""CPU tests of the allocation benchmark's pure parts (the benchmark itself needs a GPU)."""

from __future__ import annotations

import pytest

from cupy_poolmem.benchmarks import alloc
from cupy_poolmem.benchmarks._paired import PairedRatio


def _measured(stats_x: float, log_x: float, track_x: float) -> list[tuple[str, list[float]]]:
    plain = [2e-6, 2.2e-6, 2.4e-6, 40e-6]
    return [
        (alloc.OBS_BASE, [v * 0.95 for v in plain]),
        (alloc.OBS_PLAIN, plain),
        (alloc.OBS_STATS, [v * stats_x for v in plain[:3]] + [41e-6]),
        (alloc.OBS_LOG, [v * log_x for v in plain[:3]] + [44e-6]),
        (alloc.OBS_TRACK, [v * track_x for v in plain[:3]] + [60e-6]),
    ]


def test_observability_table_gives_both_ratios():
    rows, _ = alloc.observability_report(_measured(1.1, 1.5, 3.0))
    assert [r[0] for r in rows] == [
        alloc.OBS_BASE,
        alloc.OBS_PLAIN,
        alloc.OBS_STATS,
        alloc.OBS_LOG,
        alloc.OBS_TRACK,
    ]
    assert all(len(r) == len(alloc.CASES) + 2 for r in rows)
    assert rows[1][1] == "   2.00 us (1.00x, 1.05x)"  # the plain pool: 1x itself
    assert rows[2][1] == "   2.20 us (1.10x, 1.16x)"  # 1.1x the pool, 1.1/0.95 MemoryPool
    assert rows[0][4] == "  38.00 us (0.95x, 1.00x)"


def _r(median: float, pairs: int = 25) -> PairedRatio:
    return PairedRatio(median, median - 0.02, median + 0.02, pairs)


def _paired(
    stats_x: float, log_x: float, track_x: float, plain: float = 1.1
) -> dict[str, list[PairedRatio]]:
    """Made-up paired medians against MemoryPool: the plain pool's, and each observed
    row's at ``x`` times it, per ``cupy.empty`` case."""
    return {
        alloc.OBS_PLAIN: [_r(plain)] * len(alloc.CASES),
        alloc.OBS_STATS: [_r(plain * stats_x)] * len(alloc.CASES),
        alloc.OBS_LOG: [_r(plain * log_x)] * len(alloc.CASES),
        alloc.OBS_TRACK: [_r(plain * track_x)] * len(alloc.CASES),
    }


def test_goal_lines_say_met_or_not_met_with_the_worst_case():
    _, goals = alloc.observability_report(_measured(1.1, 1.5, 3.0), _paired(1.1, 1.5, 3.0))
    assert len(goals) == 3 and all(g.endswith("-> met") for g in goals), goals
    assert goals[0].startswith(f"goal: {alloc.OBS_STATS} at most 1.3x the plain DevicePool")
    paired = _paired(1.2, 2.5, 3.9)
    paired[alloc.OBS_STATS][1] = _r(1.1 * 1.4)  # statistics(): 1.4x on the 1 MiB case only
    _, goals = alloc.observability_report(_measured(1.0, 1.0, 1.0), paired)
    assert "worst 1.40x (empty 1MiB: " in goals[0] and goals[0].endswith("-> NOT met"), goals[0]
    assert "worst 2.50x (empty 1KiB: " in goals[1] and goals[1].endswith("-> NOT met"), goals[1]
    assert goals[2].endswith("-> met")


def test_goal_lines_come_from_the_paired_medians_not_the_table():
    """The table's best rounds say 1.5x (NOT met); the paired medians say 1.2x (met)."""
    _, goals = alloc.observability_report(_measured(1.5, 1.0, 1.0), _paired(1.2, 1.0, 1.0))
    assert goals[0] == (
        f"goal: {alloc.OBS_STATS} at most 1.3x the plain DevicePool per cupy.empty + free: "
        "worst 1.20x (empty 1KiB: observed/MemoryPool 1.32x (IQR 1.30-1.34, 25 pairs) "
        "over plain/MemoryPool 1.10x (IQR 1.08-1.12, 25 pairs), paired medians) -> met"
    )
    _, goals = alloc.observability_report(_measured(1.0, 1.0, 1.0), _paired(1.5, 1.0, 1.0))
    assert goals[0].endswith("-> NOT met")
    assert alloc.observability_report(_measured(1.5, 1.0, 1.0))[1] == []  # no pairs, no goals


def test_ratio_to_plain_divides_the_medians_against_memorypool():
    """An observed pool at 1.25x MemoryPool, the plain one at 0.95x: 1.32x the plain pool,
    to two decimals as the verdict rounds (1.3158 -> 1.32 > 1.3: NOT met)."""
    assert alloc.ratio_to_plain(_r(1.25), _r(0.95)) == pytest.approx(1.25 / 0.95)
    paired = _paired(1.0, 1.0, 1.0, plain=0.95)
    paired[alloc.OBS_STATS] = [_r(1.25)] * len(alloc.CASES)
    assert alloc.observability_goals(paired)[0].startswith(
        f"goal: {alloc.OBS_STATS} at most 1.3x the plain DevicePool per cupy.empty + free: "
        "worst 1.32x (empty 1KiB: observed/MemoryPool 1.25x"
    )
    assert alloc.observability_goals(paired)[0].endswith("-> NOT met")
    paired[alloc.OBS_STATS] = [_r(1.2349)] * len(alloc.CASES)  # 1.2999x: rounds to 1.30
    assert "worst 1.30x" in alloc.observability_goals(paired)[0]
    assert alloc.observability_goals(paired)[0].endswith("-> met")


def test_goals_ignore_the_chain_column_and_missing_rows():
    measured = _measured(1.0, 1.0, 1.0)
    measured[2][1][3] = 1.0  # a huge chain time: not a goal case
    paired = _paired(1.0, 1.0, 1.0)
    paired[alloc.OBS_STATS].append(_r(50.0))  # a fourth ratio: not a cupy.empty case
    del paired[alloc.OBS_LOG], paired[alloc.OBS_TRACK]
    _, goals = alloc.observability_report(measured[:3], paired)
    assert len(goals) == 1 and goals[0].endswith("-> met")
    del paired[alloc.OBS_PLAIN]
    assert alloc.observability_goals(paired) == []  # nothing to divide by


def test_paired_observability_anchors_every_row_on_memorypool_inside_its_context(
    monkeypatch,
):
    """Each row's context is entered once around all its pairs; inside it the row's
    pool is paired against MemoryPool's malloc."""
    events: list[str] = []

    class Ctx:
        def __init__(self, name: str) -> None:
            self.name = name

        def __call__(self) -> Ctx:
            return self

        def __enter__(self) -> None:
            events.append(f"enter {self.name}")

        def __exit__(self, *exc: object) -> None:
            events.append(f"exit {self.name}")

    def mp_malloc(n: int) -> None: ...

    def pool_malloc(n: int) -> None: ...

    entries = [(alloc.OBS_BASE, mp_malloc, None, Ctx("base"))] + [
        (name, pool_malloc, None, Ctx(name)) for name in (alloc.OBS_PLAIN, *alloc.GOALS)
    ]

    def fake_cases(malloc, base, pairs):
        assert malloc is pool_malloc and base is mp_malloc
        events.append(f"pairs {pairs}")
        return [_r(1.0)] * len(alloc.CASES)

    monkeypatch.setattr(alloc, "paired_cases", fake_cases)
    out = alloc._paired_observability(entries, quick=True)
    assert sorted(out) == sorted([alloc.OBS_PLAIN, *alloc.GOALS])
    names = [alloc.OBS_PLAIN, *alloc.GOALS]
    assert events == [
        e for n in names for e in (f"enter {n}", f"pairs {alloc.PAIRS_QUICK}", f"exit {n}")
    ]
    events.clear()
    alloc._paired_observability(entries[:3], quick=False)  # rows it lacks: skipped
    assert events == [
        f"enter {alloc.OBS_PLAIN}",
        f"pairs {alloc.PAIRS}",
        f"exit {alloc.OBS_PLAIN}",
        f"enter {alloc.OBS_STATS}",
        f"pairs {alloc.PAIRS}",
        f"exit {alloc.OBS_STATS}",
    ]


@pytest.mark.parametrize("name", [alloc.OBS_STATS, alloc.OBS_LOG, alloc.OBS_TRACK])
def test_every_goal_names_a_row_the_benchmark_measures(name):
    assert name in alloc.GOALS


def test_pool_goal_lines_give_each_size_against_memorypool_paired():
    goals = alloc.pool_goals(
        [PairedRatio(0.97, 0.95, 0.99, 25), _r(1.004, 60), PairedRatio(1.2, 1.1, 1.31, 25)]
    )
    assert goals == [
        "goal: DevicePool at most 1.00x MemoryPool per cupy.empty(1KiB) + free: "
        "0.97x (paired median, IQR 0.95-0.99, 25 pairs) -> met",
        "goal: DevicePool at most 1.00x MemoryPool per cupy.empty(1MiB) + free: "
        "1.00x (paired median, IQR 0.98-1.02, 60 pairs) -> met",
        "goal: DevicePool at most 1.00x MemoryPool per cupy.empty(64MiB) + free: "
        "1.20x (paired median, IQR 1.10-1.31, 25 pairs) -> NOT met",
    ]
    assert alloc.pool_goals([]) == []  # nothing measured: no lines


def test_pool_goal_verdict_is_the_median_not_the_quartiles():
    """A high quartile above the goal does not fail it; a median above it does."""
    assert alloc.pool_goals([PairedRatio(0.99, 0.90, 1.20, 25)])[0].endswith("-> met")
    assert alloc.pool_goals([PairedRatio(1.01, 0.80, 1.00, 25)])[0].endswith("-> NOT met")


def test_the_bare_table_gives_microseconds_and_the_ratio_to_memorypool():
    rows = alloc.bare_report(
        {
            alloc.BARE_ROWS[0]: [0.5e-6, 0.5e-6, 0.52e-6],
            alloc.BARE_ROWS[1]: [0.45e-6, 0.5e-6, 0.78e-6],
        }
    )
    assert rows == [
        [alloc.BARE_ROWS[0], "  0.500 us (1.00x)", "  0.500 us (1.00x)", "  0.520 us (1.00x)"],
        [alloc.BARE_ROWS[1], "  0.450 us (0.90x)", "  0.500 us (1.00x)", "  0.780 us (1.50x)"],
    ]


def test_main_prints_the_observability_table_and_goal_lines(monkeypatch, capsys):
    """main() end to end with the GPU parts replaced: both tables, then the goals."""
    cleaned: list[str] = []
    fake_peers = [
        (alloc.BASELINE_ROW, None, None),
        ("cupy_poolmem DevicePool [cython]", None, lambda: cleaned.append("pool")),
    ]
    obs = [(name, None, None, None) for name, _ in _measured(1, 1, 1)]
    obs[-1] = (*obs[-1][:2], lambda: cleaned.append("obs"), None)
    values = dict(_measured(1.1, 1.5, 3.0))

    def fake_measure(entries, n, rounds=4):
        return [values.get(e[0], [1e-6, 2e-6, 3e-6, 4e-6]) for e in entries]

    monkeypatch.setattr(alloc, "require_gpu", lambda name: None)
    monkeypatch.setattr(alloc, "header", lambda title: title)
    monkeypatch.setattr(alloc, "peers", lambda: list(fake_peers))
    monkeypatch.setattr(alloc, "observed_entries", lambda: list(obs))
    monkeypatch.setattr(alloc, "measure_interleaved", fake_measure)
    quick_seen: list[bool] = []

    def fake_paired_pool(quick):
        quick_seen.append(quick)
        return [_r(0.97), _r(0.98), _r(1.07)]  # 64 MiB: not met

    def fake_paired_obs(entries, quick):
        assert [e[0] for e in entries] == [e[0] for e in obs]  # the table's own entries
        quick_seen.append(quick)
        return _paired(1.1, 1.5, 3.0)

    measurements = alloc.Measurements(
        pure_python_row=lambda n: None,
        paired_pool=fake_paired_pool,
        paired_shared_expandable=lambda quick: [_r(0.99), _r(1.0), _r(1.02)],
        paired_observability=fake_paired_obs,
        bare_costs=lambda quick: "(bare table)",
        stream_costs=lambda quick: "(stream table)",
        peer_costs=lambda quick: None,
    )
    alloc.main(["--quick"], measurements)
    out = capsys.readouterr().out
    assert "observability: microseconds per op (ratio to the plain DevicePool" in out
    # The pool's goals after the first table, then the bare table, then observability.
    pool_goal = out.index("goal: DevicePool at most 1.00x MemoryPool per cupy.empty(1KiB)")
    assert pool_goal < out.index("(bare table)") < out.index("observability: ")
    assert out.index(alloc.OBS_TRACK) < out.index("goal: " + alloc.OBS_STATS)
    assert out.count("-> met") == 3 + len(alloc.CASES) - 1 + 2
    shared = "goal: DevicePool large_blocks='expandable' ipc=True at most 1.00x MemoryPool"
    assert out.count(shared) == 3 and pool_goal < out.index(shared) < out.index("(bare table)")
    assert (
        "cupy.empty(64MiB) + free: 1.07x (paired median, IQR 1.05-1.09, 25 pairs) -> NOT met" in out
    )
    assert out.count("paired medians) -> met") == 3
    assert quick_seen == [True, True]
    assert cleaned == ["pool", "obs"]


def test_the_shared_expandable_pool_is_judged_by_the_same_goal_under_its_own_name():
    """Issue 35's default needs the shared expandable pool at most 1.00x MemoryPool at
    every size: its lines name it, and a size over the goal fails it."""
    goals = alloc.pool_goals(
        [_r(0.98), _r(0.99), _r(1.04)], "DevicePool large_blocks='expandable' ipc=True"
    )
    assert [g.split(" at most ")[0] for g in goals] == [
        "goal: DevicePool large_blocks='expandable' ipc=True"
    ] * 3
    assert [g.rsplit("-> ", 1)[1] for g in goals] == ["met", "met", "NOT met"]
