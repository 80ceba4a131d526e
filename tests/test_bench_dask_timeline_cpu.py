"""bench dask-timeline: the per-run analysis, the counters' difference, and a dry run on
CPU workers through ``python -m`` (where the probe must reach the workers by name)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cupy_poolmem.benchmarks import dask_timeline as tl


def _rec(key, worker, *ss):
    return {"key": key, "worker": worker, "startstops": list(ss)}


def test_analyse_counts_each_transfer_once_and_names_the_slowest_task():
    t = {"action": "transfer", "start": 10.0, "stop": 10.004, "source": "w2"}
    recs = [
        _rec("('sum-a', 0, 0)", "w1", t, {"action": "compute", "start": 10.005, "stop": 10.007}),
        # the same gather seen again from a second dependent task
        _rec("('sum-a', 0, 1)", "w1", t, {"action": "compute", "start": 10.007, "stop": 10.057}),
        _rec("('add-b', 1, 1)", "w2", {"action": "compute", "start": 10.001, "stop": 10.002}),
    ]
    r = tl.analyse_run(recs, 0.08)
    assert r["transfers"] == 1 and r["transfer_total"] == pytest.approx(0.004)
    assert r["computes"] == 3 and r["compute_max"] == pytest.approx(0.05)
    assert r["slowest_compute"][1] == "('sum-a', 0, 1)" and r["slowest_compute"][2] == "w1"
    assert r["span"] == pytest.approx(0.057)
    assert r["compute_by_prefix"] == {"sum": pytest.approx(0.05), "add": pytest.approx(0.001)}


def test_diff_keeps_what_one_run_added():
    before = {"sent_ipc": 2, "installed": True, "fallback": {"small": 3},
              "timings": {"copy": {"n": 2, "total_s": 0.002, "max_s": 0.001}}}  # fmt: skip
    after = {"sent_ipc": 5, "installed": True, "fallback": {"small": 3, "other-host": 1},
             "timings": {"copy": {"n": 3, "total_s": 0.0035, "max_s": 0.0015},
                         "receive.claim": {"n": 1, "total_s": 0.002, "max_s": 0.002}}}  # fmt: skip
    d = tl._diff(before, after)
    assert d["sent_ipc"] == 3 and "installed" not in d
    assert d["fallback"] == {"other-host": 1}
    assert d["timings"]["copy"]["n"] == 1
    assert d["timings"]["copy"]["total_s"] == pytest.approx(0.0015)
    assert d["timings"]["receive.claim"] == {"n": 1, "total_s": 0.002}


def test_fit_of_wall_against_transfers():
    runs = [{"wall": 0.03 + 0.002 * n, "transfers": n} for n in (5, 7, 9, 13)]
    a, b, r = tl.fit(runs)
    assert a == pytest.approx(0.03) and b == pytest.approx(0.002) and r == pytest.approx(1.0)
    assert tl.fit([{"wall": 0.05, "transfers": 4}]) == (0.05, 0.0, 0.0)


def _run(t0_wall, events):
    w = {"lag": [e[2] for e in events if e[0] == "lag"],
         "gc": [e[2] for e in events if e[0] == "gc"], "events": events, "counters": {}}  # fmt: skip
    r = {"wall": 0.05, "span": 0.04, "transfers": 6, "transfer_total": 0.01,
         "transfer_max": 0.002, "compute_max": 0.001, "workers": {"w1": w}}  # fmt: skip
    if t0_wall is not None:
        r["t0_wall"] = t0_wall
    return r


def test_a_workers_lag_before_the_graph_was_submitted_is_not_the_runs():
    """Every worker's loop was late about 18 ms just before each run (the probe's own
    call, the previous run's clean-up); the lag column gave it to the run."""
    events = [("lag", 99.99, 0.018, None), ("gc", 99.995, 0.002, 2),
              ("lag", 100.01, 0.003, None), ("lag", 100.02, 0.004, None)]  # fmt: skip
    assert tl.in_run(_run(100.0, events), "lag") == [0.003, 0.004]
    assert tl.in_run(_run(100.0, events), "gc") == []
    row = tl.render("v", {"runs": [_run(100.0, events)]}).splitlines()
    cells = [c.strip() for c in next(x for x in row if x.startswith("0 ")).split("|")]
    assert cells[7] == "2/7.0/4.0" and cells[8] == "0/0.0/0.0"
    # results saved before runs had their start: every event counts, as then
    assert tl.in_run(_run(None, events), "lag") == [0.018, 0.003, 0.004]


def test_render_says_why_a_variant_did_not_run():
    assert "skipped (distributed_ucxx is not installed)" in tl.render(
        "ucxx", {"skipped": "distributed_ucxx is not installed"}
    )


def test_no_runs_is_refused_before_a_cluster_starts(capsys):
    # --runs 0 started a cluster, then the table's first run was an IndexError.
    with pytest.raises(SystemExit) as e:
        tl.main(["--runs", "0", "--cpu"])
    assert e.value.code == 2
    assert "--runs must be at least 1 (got 0)" in capsys.readouterr().err


def test_dry_run_on_cpu_workers(tmp_path):
    pytest.importorskip("distributed")
    out = tmp_path / "tl.json"
    p = subprocess.run(
        [sys.executable, "-m", "cupy_poolmem.benchmarks.dask_timeline", "--cpu",
         "--variants", "tcp", "--runs", "3", "--size", "600", "--chunk", "200",
         "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    assert "later runs: wall =" in p.stdout
    res = json.loads(out.read_text())["results"]["tcp"]
    assert len(res["runs"]) == 3 and all(r["computes"] > 0 for r in res["runs"])
    # The probe reached the workers (by the module's name): lags and GCs are lists there.
    for r in res["runs"]:
        assert len(r["workers"]) == 2
        for w in r["workers"].values():
            assert isinstance(w["lag"], list) and isinstance(w["gc"], list)
            assert w["probe_installed"] is True
