"""CPU tests of the allocation benchmark's pure parts (the benchmark itself needs a GPU)."""

from __future__ import annotations

import pytest

from cupy_poolmem.benchmarks import alloc


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


def test_goal_lines_say_met_or_not_met_with_the_worst_case():
    _, goals = alloc.observability_report(_measured(1.1, 1.5, 3.0))
    assert len(goals) == 3 and all(g.endswith("-> met") for g in goals), goals
    assert goals[0].startswith(f"goal: {alloc.OBS_STATS} at most 1.3x the plain DevicePool")
    measured = _measured(1.2, 2.5, 3.9)
    measured[2][1][1] = 2.2e-6 * 1.4  # statistics(): 1.4x on the 1 MiB case only
    _, goals = alloc.observability_report(measured)
    assert goals[0].endswith("worst 1.40x (empty 1MiB) -> NOT met"), goals[0]
    assert goals[1].endswith("worst 2.50x (empty 1KiB) -> NOT met"), goals[1]
    assert goals[2].endswith("-> met")


def test_goals_ignore_the_chain_column_and_missing_rows():
    measured = _measured(1.0, 1.0, 1.0)
    measured[2][1][3] = 1.0  # a huge chain time: not a goal case
    _, goals = alloc.observability_report(measured[:3])
    assert len(goals) == 1 and goals[0].endswith("-> met")


@pytest.mark.parametrize("name", [alloc.OBS_STATS, alloc.OBS_LOG, alloc.OBS_TRACK])
def test_every_goal_names_a_row_the_benchmark_measures(name):
    assert name in alloc.GOALS


def _plain_table(pool_x: list[float]) -> list[tuple[str, list[float], object]]:
    base = [2e-6, 2.2e-6, 2.4e-6, 40e-6]
    return [
        (alloc.BASELINE_ROW, base, None),
        ("cupy MemoryAsyncPool", [v * 3 for v in base], None),
        ("cupy_poolmem DevicePool [cython]", [b * x for b, x in zip(base, pool_x)], None),
        ("cupy_poolmem DevicePool [pure python, child process]", [1.0] * 4, None),
    ]


def test_pool_goal_lines_give_each_size_against_memorypool():
    goals = alloc.pool_goals(_plain_table([0.97, 1.004, 1.2, 9.0]))
    assert goals == [
        "goal: DevicePool at most 1.00x MemoryPool per cupy.empty(1KiB) + free: 0.97x -> met",
        "goal: DevicePool at most 1.00x MemoryPool per cupy.empty(1MiB) + free: 1.00x -> met",
        "goal: DevicePool at most 1.00x MemoryPool per cupy.empty(64MiB) + free: 1.20x -> NOT met",
    ]  # the chain column is not a goal; the child's pure-Python row is not the pool's
    assert alloc.pool_goals(_plain_table([1.0] * 4)[1:]) == []  # no baseline: no lines


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
    monkeypatch.setattr(alloc, "_pure_python_row", lambda n: None)
    monkeypatch.setattr(alloc, "_stream_costs", lambda quick: "(stream table)")
    monkeypatch.setattr(alloc, "_peer_costs", lambda quick: None)
    monkeypatch.setattr(alloc, "_bare_costs", lambda quick: "(bare table)")
    alloc.main(["--quick"])
    out = capsys.readouterr().out
    assert "observability: microseconds per op (ratio to the plain DevicePool" in out
    # The pool's goals after the first table, then the bare table, then observability.
    pool_goal = out.index("goal: DevicePool at most 1.00x MemoryPool per cupy.empty(1KiB)")
    assert pool_goal < out.index("(bare table)") < out.index("observability: ")
    assert out.index(alloc.OBS_TRACK) < out.index("goal: " + alloc.OBS_STATS)
    assert out.count("-> met") == 3 + len(alloc.CASES)
    assert cleaned == ["pool", "obs"]
