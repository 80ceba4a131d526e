"""CPU tests of ``bench dask-cuda``: the parser of dask-cuda's ``local_cupy`` output, the
table, the goal lines, and peers that cannot run here skipped with the reason.

The samples were printed by dask-cuda 26.10.0's own ``pretty_print_results``
(``dask_cuda.benchmarks.local_cupy``), fed with chosen durations and bandwidths.
"""

from __future__ import annotations

import contextlib
import io

import pytest

pytest.importorskip("dask", reason="dask is not installed")

from cupy_poolmem.benchmarks import BENCHMARKS  # noqa: E402
from cupy_poolmem.benchmarks import dask_cuda_local as B  # noqa: E402

GiB = 2**30

TCP_SAMPLE = """\
2026-11-28 09:40:01,123 - distributed.nanny - INFO - Start Nanny at: 'tcp://127.0.0.1:40001'
Roundtrip benchmark
--------------------------------------------------------------------------------
Backend                   | dask
Operation                 | transpose_sum
Array type                | cupy
User size                 | 20000
User second size          | 1000
User chunk size           | 20000
Compute shape             | (20000, 20000)
Compute chunk size        | (5000, 5000)
Ignore size               | 1.00 MiB
Device(s)                 | 0,1
Data processed            | 2.98 GiB
RMM Pool                  | False
Protocol                  | tcp
Worker thread(s)          | 1
Number of workers         | 2
================================================================================
Wall clock                | Throughput
--------------------------------------------------------------------------------
944.00 ms                 | 3.16 GiB/s
61.20 ms                  | 48.70 GiB/s
58.70 ms                  | 50.77 GiB/s
59.30 ms                  | 50.26 GiB/s
60.10 ms                  | 49.59 GiB/s
================================================================================
Throughput                | 12.59 GiB/s +/- 8.42 GiB/s
Bandwidth                 | 37.23 GiB/s +/- 673.93 MiB/s
Wall clock                | 236.66 ms +/- 353.67 ms
================================================================================
(w1,w2)                   | 25% 50% 75% (total nbytes)
--------------------------------------------------------------------------------
(0,1)                     | 32.60 GiB/s 37.25 GiB/s 40.98 GiB/s (1.49 GiB)
(1,0)                     | 29.80 GiB/s 35.39 GiB/s 39.12 GiB/s (1.49 GiB)
================================================================================
Worker index              | Worker address
--------------------------------------------------------------------------------
0                         | tcp://127.0.0.1:40001
1                         | tcp://127.0.0.1:40002
================================================================================
"""

UCXX_SAMPLE = """\
RMM already setup on external cluster, skipping RMM configuration arguments
Roundtrip benchmark
--------------------------------------------------------------------------------
Backend                   | dask
Operation                 | transpose_sum
Array type                | cupy
User size                 | 20000
User second size          | 1000
User chunk size           | 20000
Compute shape             | (20000, 20000)
Compute chunk size        | (5000, 5000)
Ignore size               | 1.00 MiB
Device(s)                 | 0,1
Data processed            | 2.98 GiB
RMM Pool                  | False
Protocol                  | ucxx
UCX transport selection   | manual
TCP                       | False
InfiniBand                | False
NVLink                    | False
Worker thread(s)          | 1
Number of workers         | 2
================================================================================
Wall clock                | Throughput
--------------------------------------------------------------------------------
1.49 s                    | 2.00 GiB/s
1.15 s                    | 2.59 GiB/s
57.30 ms                  | 52.01 GiB/s
58.10 ms                  | 51.29 GiB/s
59.00 ms                  | 50.51 GiB/s
================================================================================
Throughput                | 5.29 GiB/s +/- 2.64 GiB/s
Bandwidth                 | 37.23 GiB/s +/- 673.93 MiB/s
Wall clock                | 562.88 ms +/- 627.47 ms
================================================================================
(w1,w2)                   | 25% 50% 75% (total nbytes)
--------------------------------------------------------------------------------
(0,1)                     | 32.60 GiB/s 37.25 GiB/s 40.98 GiB/s (1.49 GiB)
(1,0)                     | 29.80 GiB/s 35.39 GiB/s 39.12 GiB/s (1.49 GiB)
================================================================================
Worker index              | Worker address
--------------------------------------------------------------------------------
0                         | tcp://127.0.0.1:40001
1                         | tcp://127.0.0.1:40002
================================================================================
"""


def test_the_tcp_sample_parses_to_its_runs_bandwidth_and_pairs():
    out = B.parse_local_cupy(TCP_SAMPLE)
    assert [round(s, 6) for s in out["wall_clocks"]] == [0.944, 0.0612, 0.0587, 0.0593, 0.0601]
    assert len(out["throughputs"]) == 5 and round(out["throughputs"][1] / GiB, 2) == 48.70
    assert round(out["bandwidth"] / GiB, 2) == 37.23
    assert round(out["bandwidth_std"] / 2**20, 2) == 673.93
    assert round(out["wall_clock_mean"], 5) == 0.23666
    assert out["protocol"] == "tcp" and out["workers"] == 2
    assert set(out["pairs"]) == {"(0,1)", "(1,0)"}
    assert round(out["pairs"]["(0,1)"]["q50"] / GiB, 2) == 37.25


def test_the_ucxx_sample_parses_seconds_and_its_transport_lines():
    out = B.parse_local_cupy(UCXX_SAMPLE)
    assert [round(s, 4) for s in out["wall_clocks"]] == [1.49, 1.15, 0.0573, 0.0581, 0.059]
    assert out["protocol"] == "ucxx"


@pytest.mark.parametrize(
    "text, seconds",
    [("944.00 ms", 0.944), ("123.45 us", 0.00012345), ("1.49 s", 1.49), ("20m 34s", 1234.0),
     ("3hr 25m", 12300.0), ("14d 6hr", 1231200.0)],
)  # fmt: skip
def test_every_format_time_form_is_read(text, seconds):
    from dask.utils import format_time

    assert B.parse_time(text) == pytest.approx(seconds)
    assert B.parse_time(format_time(seconds)) == pytest.approx(seconds, rel=0.01, abs=1.0)


@pytest.mark.parametrize("bad", ["", "12 parsecs", "ms 12"])
def test_what_is_not_a_time_is_refused(bad):
    with pytest.raises(ValueError):
        B.parse_time(bad)


def test_output_of_a_failed_script_is_refused():
    with pytest.raises(ValueError, match="no wall clock table"):
        B.parse_local_cupy("Traceback (most recent call last):\n  ...\nImportError: rmm\n")
    # A truncated table (killed mid-run) keeps the runs it printed.
    cut = TCP_SAMPLE.split("Throughput                |")[0]
    assert len(B.parse_local_cupy(cut)["wall_clocks"]) == 5


def _results():
    return {
        "tcp+cupy_poolmem": B.parse_local_cupy(TCP_SAMPLE),
        "tcp+rmm": {"wall_clocks": [1.06, 0.70, 0.29, 0.31, 0.30], "bandwidth": 0.8 * GiB},
        "ucxx": B.parse_local_cupy(UCXX_SAMPLE),
    }


def test_goal_lines_judge_the_sample_against_the_peers():
    lines = B.goals(_results())
    assert lines[0].startswith("PASS  steady")  # 61.2 ms is within 10% of 58.7 ms
    assert lines[1].startswith("FAIL  steady wall clock at most UCXX's")  # 59.7 vs 58.1 ms
    assert lines[2].startswith("PASS  first run no slower than UCXX's first")  # 0.94 vs 1.49 s
    assert lines[3].startswith("PASS  at least 5x faster than TCP+RMM")
    assert lines[4].startswith("FAIL  bandwidth at least 2x UCXX's")  # same bandwidth


def test_goal_lines_fail_an_unsteady_run_and_say_what_is_missing():
    r = _results()
    r["tcp+cupy_poolmem"]["wall_clocks"] = [0.944, 0.058, 0.247, 0.058, 0.232]
    assert B.goals(r)[0].startswith("FAIL  steady")
    r["ucxx"] = {"skipped": "distributed_ucxx is not installed"}
    assert sum(line.startswith("n/a") for line in B.goals(r)) == 3
    assert B.goals({"tcp+cupy_poolmem": {"skipped": "rmm"}}) == [
        "n/a   tcp+cupy_poolmem did not run (rmm)"
    ]


def test_the_table_has_a_row_per_peer_and_ratios_to_the_baseline():
    r = _results()
    r["ucxx"] = {"skipped": "distributed_ucxx is not installed"}
    text = B.render(r)
    lines = text.splitlines()
    assert lines[0].split(" | ")[0].strip() == "peer" and len(lines) == 5
    ours = next(x for x in lines if x.startswith("tcp+cupy_poolmem"))
    assert "944.0 ms" in ours and "37.23 GiB/s" in ours
    assert "5.11x" in ours  # 305 ms / 59.7 ms: steady (median after the first) against steady
    assert "skipped: distributed_ucxx is not installed" in text


def test_each_peer_gets_only_its_own_configuration():
    import os

    os.environ["DASK_DISTRIBUTED__NANNY__PRELOAD"] = '["leftover"]'
    try:
        env = B._env_for({})
        assert "DASK_DISTRIBUTED__NANNY__PRELOAD" not in env
        env = B._env_for(B.CONFIGURED_ENV)
        assert env["DASK_DISTRIBUTED__NANNY__PRELOAD"] == '["cupy_poolmem_dask"]'
        assert env["DASK_DISTRIBUTED__WORKER__PRELOAD"] == '["cupy_poolmem_dask"]'
    finally:
        del os.environ["DASK_DISTRIBUTED__NANNY__PRELOAD"]
    assert "--disable-rmm" in B.PEERS["tcp+cupy_poolmem"][0]
    assert B.PEERS["ucxx"][0] == ["-p", "ucxx"]
    assert BENCHMARKS["dask-cuda"][0] == "dask_cuda_local"


def test_peers_that_cannot_run_here_are_skipped_with_the_reason(monkeypatch):
    import importlib.util

    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "distributed_ucxx" else object()
    )
    assert B._why_not("tcp+rmm") is None
    assert "distributed_ucxx is not installed" in (B._why_not("ucxx") or "")
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = B.main(["--no-transfer", "--peers", "tcp+cupy_poolmem,ucxx"])
    out = buf.getvalue()
    assert rc == 1  # our peer did not run
    assert "skipped: dask-cuda is not installed" in out
    assert "n/a   tcp+cupy_poolmem did not run (dask-cuda is not installed)" in out


def test_kernel_warm_up_failure_names_the_last_line_of_its_error():
    from cupy_poolmem.benchmarks import dask_cuda_local as b

    seen = []

    def failing(cmd, env, timeout):
        seen.append(cmd)
        return "", "Traceback\n    libnvvm.so.4\n", "1"

    assert b.warm_kernel_cache(failing) == "no (exit 1: libnvvm.so.4)"
    assert "(a + a.T).sum()" in seen[0][-1]  # the graph's kernels, compiled in a child
    assert b.warm_kernel_cache(lambda cmd, env, t: ("", "", "0")) == "yes"
