"""CPU tests of cupy_poolmem.report: parsing, summary numbers, plotting, the CLI."""

from __future__ import annotations

import csv
import json
import os
import sys

import pytest
from fakes.observer import FAKES_FILE, FakeCore, alloc, free

from cupy_poolmem import report, stats
from cupy_poolmem._errors import InvalidOptionError, LogFormatError, OptionTypeError
from cupy_poolmem.stats import LOG_COLUMNS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _row(
    t, pid, dev, op, ptr, size, tag="", site="", used="", reserved="", thread="MainThread", stream=0
):
    return [f"{t:.6f}", pid, thread, dev, stream, op, hex(ptr), size, tag, site, used, reserved]


@pytest.fixture
def two_logs(tmp_path):
    """Two processes; pointer reuse; a free of memory from before the log; two leaks.

    pid 1 had 70 bytes allocated before its log started (its ``used`` column includes
    them); pid 2 uses pointer 0x100 too, on device 0 and then device 1.
    """
    a = tmp_path / "alloc-1.csv"
    b = tmp_path / "alloc-2.csv"
    rows_a = [
        _row(10.00, 1, 0, "alloc", 0x100, 100, "attn", "m.py:1 in f", 170, 1000),
        _row(10.10, 1, 0, "alloc", 0x200, 300, "mlp", "m.py:2 in g", 470, 1000),
        _row(10.20, 1, 0, "free", 0x100, 100, "attn", "m.py:1 in f", 370, 1000),
        _row(10.30, 1, 0, "alloc", 0x100, 50, "attn/inner", "m.py:3 in h", 420, 2000),
        _row(10.40, 1, 0, "free", 0x100, 50, "attn/inner", "m.py:3 in h", 370, 2000),
        _row(10.50, 1, 0, "free", 0x999, 70, "", "", 300, 2000),
        _row(10.60, 1, -1, "alloc", 0x5000, 10, "", "", 10, 4096),
        _row(10.70, 1, -1, "free", 0x5000, 10, "", "", 0, 4096),
    ]
    rows_b = [
        _row(10.05, 2, 0, "alloc", 0x100, 1000, "attn", "", 1000, ""),
        _row(10.25, 2, 0, "free", 0x100, 1000, "attn", "", 0, ""),
        list(LOG_COLUMNS),  # a second process appending to the file wrote a header
        _row(10.35, 2, 1, "alloc", 0x100, 2000, "", "", 2000, "", thread="w1"),
    ]
    for path, rows in ((a, rows_a), (b, rows_b)):
        with open(path, "w", newline="") as f:
            w = csv.writer(f, lineterminator="\n")
            w.writerow(LOG_COLUMNS)
            w.writerows(rows)
    with open(b, "a") as f:
        f.write("10.9,2,MainThread,0,0,alloc,0x")  # cut short by a crash
    return a, b


def test_read_log_parses_fields(two_logs):
    a, b = two_logs
    events, bad = report.read_log(a)
    assert bad == 0 and len(events) == 8
    e = events[0]
    assert (
        e.time,
        e.pid,
        e.device,
        e.op,
        e.ptr,
        e.size,
        e.tag,
        e.callsite,
        e.used,
        e.reserved,
    ) == (10.0, 1, 0, "alloc", 0x100, 100, "attn", "m.py:1 in f", 170, 1000)
    events, bad = report.read_log(b)
    assert bad == 1 and len(events) == 3  # repeated header skipped, broken line counted
    assert events[0].reserved is None and events[2].thread == "w1"


def test_read_log_rejects_other_files(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(LogFormatError, match="not a cupy_poolmem allocation log") as ei:
        report.read_log(p)
    assert ei.value.path == str(p) and str(ei.value).startswith(str(p))


@pytest.mark.parametrize(
    "content,reason",
    [(b"", "empty file"), (b"\x00\x01\x02", "binary"), (b"time\n\xff\xfe\n", "not UTF-8")],
)
def test_read_log_names_the_file_it_cannot_read(tmp_path, content, reason):
    p = tmp_path / "bad.csv"
    p.write_bytes(content)
    with pytest.raises(LogFormatError, match=reason) as ei:
        report.read_log(p)
    assert str(ei.value).startswith(f"{p}: ")


def test_load_of_a_directory_without_logs(tmp_path):
    with pytest.raises(LogFormatError, match="no \\*.csv allocation logs"):
        report.load(tmp_path)


@pytest.mark.parametrize(
    "kw,exc",
    [
        (dict(top=-1), InvalidOptionError),
        (dict(top=1.5), OptionTypeError),
        (dict(tag_depth=0), InvalidOptionError),
        (dict(tag_depth="1"), OptionTypeError),
    ],
)
def test_summarize_checks_its_options(two_logs, kw, exc):
    with pytest.raises(exc):
        report.summarize(list(two_logs), **kw)


def test_plot_format_comes_from_the_suffix(two_logs, tmp_path):
    assert report.plot_format("a.PDF") == "pdf" and report.plot_format("a.jpg") == "jpeg"
    with pytest.raises(InvalidOptionError, match="suffix"):
        report.plot(list(two_logs), tmp_path / "usage")
    assert not (tmp_path / "usage").exists()


def test_load_merges_by_time_keeping_file_order(two_logs):
    loaded = report.load(list(two_logs))
    events = list(loaded.events())
    times = [e.time for e in events]
    assert times == sorted(times) and len(times) == 11 and loaded.n_bad == 1
    assert [e.pid for e in events[:3]] == [1, 2, 1]
    assert [e.time for e in loaded.events()] == times  # read again, same events
    assert report.load(os.path.dirname(two_logs[0])).files == [str(p) for p in two_logs]


def test_summary_numbers(two_logs):
    s = report.summarize(list(two_logs))
    assert s.pids == [1, 2] and s.n_events == 11 and s.n_bad_lines == 1
    assert (s.n_allocs, s.n_frees) == (6, 5)
    assert (s.n_unmatched_frees, s.unmatched_free_bytes) == (1, 70)
    assert s.peaks == {(1, 0): 470, (2, 0): 1000, (2, 1): 2000, (1, -1): 10}
    assert s.duration == pytest.approx(0.7)
    by = {(x.pid, x.device): x for x in s.series}
    assert by[(1, 0)].peak_time == pytest.approx(0.1)
    assert by[(1, 0)].peak_reserved_bytes == 2000 and by[(2, 0)].peak_reserved_bytes is None
    assert by[(1, 0)].at_peak == {"attn": 100, "mlp": 300, report.BEFORE_LOG: 70}
    assert (by[(1, 0)].n_allocs, by[(1, 0)].n_frees, by[(1, 0)].final_used_bytes) == (3, 3, 300)
    # Leaks: matched per (pid, device, pointer) in time order, so reused 0x100 is not one.
    assert [(lk.pid, lk.device, lk.ptr, lk.size, lk.tag) for lk in s.leaks] == [
        (2, 1, 0x100, 2000, ""),
        (1, 0, 0x200, 300, "mlp"),
    ]
    assert s.leaked_bytes == 2300 and s.leaks[1].callsite == "m.py:2 in g"
    assert s.leaks[0].time == pytest.approx(0.35)
    tags = s.per_tag
    assert (tags["attn"].n_allocs, tags["attn"].total_bytes) == (2, 1100)
    assert tags["attn"].peak_live_bytes == 1100  # both processes at t=10.05
    assert tags["attn/inner"].total_bytes == 50 and tags["attn"].leaked_bytes == 0
    assert (tags["mlp"].leaked_bytes, tags["mlp"].n_leaks) == (300, 1)
    assert (tags[""].total_bytes, tags[""].leaked_bytes) == (2010, 2000)
    assert [c.callsite for c in s.top_callsites] == ["m.py:2 in g", "m.py:1 in f", "m.py:3 in h"]
    assert [c.total_bytes for c in s.top_callsites] == [300, 100, 50]
    assert report.summarize(list(two_logs), top=1).top_callsites[0].callsite == "m.py:2 in g"


def test_tag_depth_groups_nested_tags(two_logs):
    tags = report.summarize(list(two_logs), tag_depth=1).per_tag
    assert "attn/inner" not in tags
    assert (tags["attn"].n_allocs, tags["attn"].total_bytes) == (3, 1150)


def test_summary_text_and_json(two_logs, capsys):
    text = report.summarize(list(two_logs)).format()
    assert "Leaks at end of log" in text and "2 allocation(s)" in text
    assert "m.py:2 in g" in text and "pinned" in text and "(untagged)" in text
    assert report.main([str(p) for p in two_logs] + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["leaked_bytes"] == 2300 and d["n_allocs"] == 6


def _check_png(path) -> None:
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 10_000  # an actual picture, not an empty canvas


def test_plot_writes_a_png(two_logs, tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(FileNotFoundError, match="no such directory"):
        report.plot(list(two_logs), tmp_path / "out" / "usage.png")
    assert not (tmp_path / "out").exists()  # no directory created unasked
    out = report.plot(list(two_logs), tmp_path / "usage.png")
    _check_png(out)


def test_plot_thins_long_logs(tmp_path):
    pytest.importorskip("matplotlib")
    p = tmp_path / "long.csv"
    with open(p, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(LOG_COLUMNS)
        used = 0
        for i in range(20_000):
            size = 1 << 20
            ptr = 0x1000 + (i % 50) * size
            if (i // 50) % 2 == 0:
                used += size
                w.writerow(_row(i * 1e-3, 7, 0, "alloc", ptr, size, f"t{i % 12}", "", used, ""))
            else:
                used -= size
                w.writerow(_row(i * 1e-3, 7, 0, "free", ptr, size, f"t{i % 12}", "", used, ""))
    out = report.plot(p, tmp_path / "long.png", max_points=500, max_tags=4)
    _check_png(out)
    # The thinned series: at most two moments per bucket, and the peaks survive.
    from cupy_poolmem.report._plot import sample_series

    loaded = report.load(p)
    (panel,) = sample_series(loaded.events(), [(7, 0)], ["t0", "t1"], 0.0, 19.999, n_buckets=250)
    assert 250 <= len(panel.moments) <= 500
    assert max(m[1] for m in panel.moments) == 50 << 20  # the highest use, kept
    assert panel.moments[-1][1] == 0  # the last moment: all freed
    times = [m[0] for m in panel.moments]
    assert times == sorted(times)


def test_cli_prints_summary_and_plots(two_logs, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "u.png"
    assert report.main([str(p) for p in two_logs] + ["--plot", str(png), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "Peak used memory" in out and "plot written to" in out and "... 1 more" in out
    _check_png(png)


def test_report_module_runs_as_a_script(two_logs):
    """``python -m cupy_poolmem.report LOG`` runs the report's command line, as the
    module ``cupy_poolmem.report`` always did."""
    import subprocess

    import cupy_poolmem

    env = dict(os.environ)
    src = os.path.dirname(os.path.dirname(os.path.abspath(cupy_poolmem.__file__)))
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(
        [sys.executable, "-m", "cupy_poolmem.report", str(two_logs[0]), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    with open(two_logs[0], newline="") as f:
        allocs = sum(row["op"] == "alloc" for row in csv.DictReader(f))
    assert json.loads(r.stdout)["n_allocs"] == allocs == 4


def test_cli_errors(tmp_path, capsys):
    assert report.main([str(tmp_path / "missing.csv")]) == 2
    assert "error:" in capsys.readouterr().err
    bad = tmp_path / "bad.csv"
    bad.write_text("hello\n")
    assert report.main([str(bad)]) == 2


def test_plot_without_matplotlib_is_a_clear_error(two_logs, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    with pytest.raises(ImportError, match="needs matplotlib"):
        report.plot(list(two_logs), tmp_path / "x.png")
    assert report.main([str(two_logs[0]), "--plot", str(tmp_path / "x.png")]) == 1
    assert "needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_empty_log(tmp_path):
    p = tmp_path / "e.csv"
    stats.start_log(p)
    stats.stop_log()
    s = report.summarize(p)
    assert s.n_events == 0 and s.leaks == [] and "(no events)" in s.format()
    with pytest.raises(ValueError, match="no events"):
        report.plot(p, tmp_path / "e.png")


def test_round_trip_from_the_observer(tmp_path):
    """A log written by stats (fake blocks) reads back with the right numbers."""
    stats.track(False, skip=[FAKES_FILE])
    path = stats.start_log(tmp_path / "rt-{pid}.csv", track=True)
    try:
        core = FakeCore()
        with stats.tag("attention"):
            a = alloc(core, 0x1000, 4096)
            b = alloc(core, 0x2000, 1024)
        free(a)
        with stats.tag("mlp"):
            c = alloc(core, 0x1000, 512)  # pointer reused
        free(c)
        keep = alloc(core, 0x3000, 8)
        line = sys._getframe().f_lineno - 1  # the line above
    finally:
        stats.stop_log()
        stats.track(False)
    s = report.summarize(path)
    assert s.pids == [os.getpid()] and (s.n_allocs, s.n_frees) == (4, 2)
    assert s.peaks == {(os.getpid(), 0): 5120}
    assert [(lk.ptr, lk.size, lk.tag) for lk in s.leaks] == [
        (0x2000, 1024, "attention"),
        (0x3000, 8, ""),
    ]
    assert s.leaks[1].callsite == f"{__file__}:{line} in test_round_trip_from_the_observer"
    assert s.per_tag["attention"].total_bytes == 5120 and s.per_tag["mlp"].total_bytes == 512
    free(b)
    free(keep)
