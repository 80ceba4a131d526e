"""CPU tests of ``report`` on damaged and crafted logs, and of its inputs at their edges."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import subprocess
import sys
import threading
import tracemalloc

import pytest

import cupy_poolmem
from cupy_poolmem import report
from cupy_poolmem._errors import LogFormatError
from cupy_poolmem.stats import LOG_COLUMNS

PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(cupy_poolmem.__file__)))
T0 = 1_700_000_000.0


def row(t, op="alloc", ptr=0x100, size=4096, tag="", site="", used="", reserved="", pid=1):
    return [t, pid, "MainThread", 0, 0, op, ptr if isinstance(ptr, str) else hex(ptr), size,
            tag, site, used, reserved]  # fmt: skip


def write_log(path, rows, bom: bool = False, quote_all: bool = False) -> str:
    with open(path, "w", newline="", encoding="utf-8-sig" if bom else "utf-8") as f:
        w = csv.writer(
            f, lineterminator="\n", quoting=csv.QUOTE_ALL if quote_all else csv.QUOTE_MINIMAL
        )
        w.writerow(LOG_COLUMNS)
        w.writerows(rows)
    return str(path)


def good_rows(n=3, tag="step", pid=1):
    return [
        row(f"{T0 + 1:.6f}", "alloc", 0x100, 4096, tag, "m.py:1 in f", 4096, 8192, pid=pid),
        row(f"{T0 + 2:.6f}", "alloc", 0x900, 512, "", "", 4608, 8192, pid=pid),
        row(f"{T0 + 3:.6f}", "free", 0x100, 4096, tag, "m.py:1 in f", 512, 8192, pid=pid),
    ][:n]


def cli(*args: str, stdin: bytes | None = None, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=PKG_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "cupy_poolmem", "report", *args],
        input=stdin,
        capture_output=True,
        timeout=120,
        cwd=cwd,
        env=env,
    )


def strict_json(text: str) -> dict:
    def refuse(name):
        raise AssertionError(f"non-finite number {name} in JSON")

    return json.loads(text, parse_constant=refuse)


# -- invalid values ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad,reason",
    [
        (row("inf"), "time 'inf' is not a timestamp"),
        (row("nan"), "time 'nan' is not a timestamp"),
        (row("-1e400"), "time '-1e400' is not a timestamp"),
        (row(f"{T0:.6f}", size=-5), "size '-5' is negative"),
        (row(f"{T0:.6f}", size=10**32), "size '1" + "0" * 32 + "' is above 2**64 - 1"),
        (row(f"{T0:.6f}", size="1e32"), "size '1e32' is not an integer"),
        (row(f"{T0:.6f}", size="9" * 400), "is too long for a 64-bit value"),
        (row(f"{T0:.6f}", used=10**32), "used '1" + "0" * 32 + "' is above 2**64 - 1"),
        (row(f"{T0:.6f}", ptr="-0x10"), "pointer '-0x10' is negative"),
        (row(f"{T0:.6f}", op="malloc"), "op 'malloc' is not alloc, free"),
    ],
    ids=[
        "inf",
        "nan",
        "-1e400",
        "negative",
        "1e32 digits",
        "1e32",
        "400 digits",
        "used",
        "pointer",
        "op",
    ],  # fmt: skip
)
def test_an_invalid_value_skips_its_row_with_a_counted_reason(tmp_path, capsys, bad, reason):
    path = write_log(tmp_path / "a.csv", [good_rows()[0], bad, *good_rows()[1:]])
    s = report.summarize(path)
    assert (s.n_events, s.n_bad_lines) == (3, 1)
    assert s.first_bad_line.startswith(f"{path} line 3: ") and reason in s.first_bad_line
    assert s.peaks == {(1, 0): 4608} and s.duration == pytest.approx(2.0)
    text = s.format()
    assert "skipped 1 invalid row(s) (first: " in text and reason in text
    assert "nan s" not in text and "inf s" not in text
    assert report.main([path, "--json"]) == 0
    out, err = capsys.readouterr()
    d = strict_json(out)
    assert d["n_bad_lines"] == 1 and reason in d["first_bad_line"]
    assert "skipped 1 invalid row(s)" in err


def test_damaged_rows_do_not_leak_warnings_or_tracebacks(tmp_path):
    rows = [row("nan"), row("inf", size=-1), row(f"{T0:.6f}", size="9" * 400), *good_rows()]
    path = write_log(tmp_path / "a.csv", rows)
    r = cli(path, "--json")
    assert r.returncode == 0, r.stderr
    assert b"RuntimeWarning" not in r.stderr and b"Traceback" not in r.stderr
    d = strict_json(r.stdout.decode())
    assert d["n_bad_lines"] == 3 and d["duration"] == 2.0


def test_every_number_in_the_json_is_finite(tmp_path):
    path = write_log(tmp_path / "a.csv", good_rows())
    d = report.summarize(path).to_dict()
    json.dumps(d, allow_nan=False)  # raises on a non-finite float


def test_sizes_up_to_2_64_format_in_big_units(tmp_path):
    path = write_log(tmp_path / "a.csv", [row(f"{T0:.6f}", size=2**64 - 1, used=2**64 - 1)])
    text = report.summarize(path).format()
    assert "16.00 EiB" in text and "TiB" not in text


# -- encodings, tags, terminal safety ------------------------------------------------------
def test_a_log_saved_with_a_byte_order_mark_reads(tmp_path):
    path = write_log(tmp_path / "excel.csv", good_rows(), bom=True)
    with open(path, "rb") as f:
        assert f.read(3) == b"\xef\xbb\xbf"
    s = report.summarize(path)
    assert (s.n_events, s.n_bad_lines, s.leaked_bytes) == (3, 0, 512)


def test_long_tags_print_whole_and_distinct(tmp_path):
    a = "model/encoder/layer_0/attention/query_projection"
    b = "model/encoder/layer_0/attention/query_projection_bias"
    rows = [row(f"{T0 + 1:.6f}", ptr=0x100, tag=a), row(f"{T0 + 2:.6f}", ptr=0x200, tag=b)]
    text = report.summarize(write_log(tmp_path / "a.csv", rows)).format()
    lines = [ln for ln in text.splitlines() if "query_projection" in ln and "allocs" not in ln]
    assert any(ln.endswith(a) for ln in lines) and any(ln.endswith(b) for ln in lines)


def test_control_characters_never_reach_the_terminal(tmp_path):
    evil = "x\x1b]0;pwned\x07\x1b[2J\r\u202eok"
    rows = [
        row(f"{T0 + 1:.6f}", tag=evil, site=evil + ".py:1 in f"),
        row(f"{T0 + 2:.6f}", "guard:" + evil, tag=evil, site=evil),  # a guard report's kind
    ]
    path = write_log(tmp_path / "a.csv", rows, quote_all=True)  # "\r" in quotes, as logs have
    r = cli(path, "--top", "5")
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    assert not any(c in out for c in "\x1b\x07\r\u202e")
    assert "x\\x1b]0;pwned\\x07\\x1b[2J\\r\\u202eok" in out


def test_control_characters_in_a_file_name_are_escaped_in_errors(tmp_path):
    name = tmp_path / "bad\x1b[31m.csv"
    name.write_text("not,a,log\n")
    r = cli(str(name))
    assert r.returncode == 2
    assert b"\x1b" not in r.stderr and b"bad\\x1b[31m.csv" in r.stderr


def test_rows_with_bytes_that_are_not_utf8_are_skipped(tmp_path):
    path = tmp_path / "a.csv"
    write_log(path, good_rows())
    with open(path, "ab") as f:
        f.write(f"{T0 + 4:.6f},1,MainThread,0,0,alloc,0x300,64,bad\xff,,,\n".encode("latin-1"))
    s = report.summarize(path)
    assert s.n_events == 3 and s.n_bad_lines == 1 and "not UTF-8" in s.first_bad_line
    json.dumps(s.to_dict(), allow_nan=False).encode("utf-8")


# -- files, directories, globs, stdin --------------------------------------------------------
def test_a_bad_file_in_a_directory_is_skipped_with_a_warning(tmp_path):
    d = tmp_path / "logs"
    d.mkdir()
    write_log(d / "alloc-1.csv", good_rows())
    (d / "notes.csv").write_text("hello,world\n")
    (d / "empty.csv").write_bytes(b"")
    r = cli(str(d))
    assert r.returncode == 0, r.stderr
    err = r.stderr.decode().splitlines()
    assert len(err) == 2 and all("warning: skipped" in ln for ln in err)
    assert any("empty.csv: empty file" in ln for ln in err)
    assert any("notes.csv: not a cupy_poolmem allocation log" in ln for ln in err)
    assert b"1 file(s), 3 events" in r.stdout and b"2 file(s) skipped" in r.stdout
    # Named explicitly, a bad file is still an error.
    r = cli(str(d / "notes.csv"), str(d / "alloc-1.csv"))
    assert r.returncode == 2 and b"notes.csv: not a cupy_poolmem allocation log" in r.stderr


def test_a_directory_of_only_bad_files_is_an_error(tmp_path):
    (tmp_path / "x.csv").write_text("hello\n")
    with pytest.raises(LogFormatError, match="none of its 1 file"):
        report.summarize(tmp_path)


def test_a_quoted_glob_is_expanded(tmp_path):
    write_log(tmp_path / "alloc-1.csv", good_rows(pid=1))
    write_log(tmp_path / "alloc-2.csv", good_rows(pid=2))
    write_log(tmp_path / "other.csv", good_rows(pid=3))
    r = cli("alloc-*.csv", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    d = strict_json(r.stdout.decode())
    assert d["pids"] == [1, 2] and d["files"] == ["alloc-1.csv", "alloc-2.csv"]
    r = cli("nothing-*.csv", cwd=tmp_path)
    assert r.returncode == 2 and b"no file matches this pattern" in r.stderr


def test_standard_input_is_a_log(tmp_path):
    pytest.importorskip("matplotlib")
    data = open(write_log(tmp_path / "a.csv", good_rows()), "rb").read()
    r = cli("-", "--json", "--plot", str(tmp_path / "p.png"), stdin=data)
    assert r.returncode == 0, r.stderr
    d = strict_json(r.stdout.decode())
    assert d["files"] == ["<stdin>"] and d["n_events"] == 3
    assert (tmp_path / "p.png").stat().st_size > 1000  # a second pass over stdin
    r = cli("-", stdin=b"")
    assert r.returncode == 2 and b"<stdin>: empty file" in r.stderr


# -- plot: pipes and directories ---------------------------------------------------------
def test_a_closed_pipe_does_not_stop_the_plot(tmp_path):
    pytest.importorskip("matplotlib")
    # More text than a pipe holds (3000 tags and leaks listed: about 400 kB).
    rows = [row(f"{T0 + i:.6f}", ptr=0x100 + 64 * i, size=64, tag=f"t{i}") for i in range(3000)]
    path = write_log(tmp_path / "a.csv", rows)
    png = tmp_path / "u.png"
    env = dict(os.environ, PYTHONPATH=PKG_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [
        sys.executable,
        "-m",
        "cupy_poolmem",
        "report",
        path,
        "--plot",
        str(png),
        "--top",
        "3000",
    ]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = p.stdout.readline()
    p.stdout.close()  # as `| head -1` does
    with p.stderr:
        err = p.stderr.read().decode()
    p.wait(timeout=120)
    assert first.startswith(b"cupy_poolmem allocation log")
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert png.stat().st_size > 1000


def test_plot_into_a_missing_directory_is_an_error(tmp_path):
    pytest.importorskip("matplotlib")
    path = write_log(tmp_path / "a.csv", good_rows())
    r = cli(path, "--plot", str(tmp_path / "nope" / "u.png"))
    assert r.returncode == 2
    err = r.stderr.decode().strip().splitlines()
    assert len(err) == 1 and "no such directory" in err[0] and "nope" in err[0]
    assert not (tmp_path / "nope").exists()
    assert b"Peak used memory" in r.stdout  # the summary is still printed


def test_tags_that_look_like_math_plot(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [row(f"{T0 + 1:.6f}", tag="$\\undefined{x}$"), row(f"{T0 + 2:.6f}", ptr=0x200, tag="$")]
    out = report.plot(write_log(tmp_path / "a.csv", rows), tmp_path / "m.svg")
    assert os.path.getsize(out) > 1000


def test_plot_bands_add_up_to_the_used_column(tmp_path):
    from cupy_poolmem.report._plot import sample_series

    rows, used = [], 70  # 70 bytes allocated before the log
    for i in range(3000):
        ptr, size = 0x1000 + (i % 40) * 256, 100 + i % 7
        if (i // 40) % 2 == 0:
            used += size
            rows.append(row(f"{T0 + i * 1e-3:.6f}", "alloc", ptr, size, f"t{i % 5}", "", used))
        else:
            prev = 100 + (i - 40) % 7
            used -= prev
            rows.append(row(f"{T0 + i * 1e-3:.6f}", "free", ptr, prev, "", "", used))
    loaded = report.load(write_log(tmp_path / "a.csv", rows))
    (panel,) = sample_series(loaded.events(), [(1, 0)], ["t0", "t1"], T0, T0 + 3, n_buckets=100)
    assert len(panel.moments) <= 200
    for _t, used_m, _res, bands in panel.moments:
        assert sum(bands) == used_m and bands[-1] == 70  # shown + other + before the log
    assert max(m[1] for m in panel.moments) == max(int(r[10]) for r in rows)


# -- memory ------------------------------------------------------------------------------
def test_summary_memory_does_not_grow_with_the_log(tmp_path):
    """40,000 rows (about 4 MB of text): the summary holds the live blocks, not the rows."""
    path = tmp_path / "big.csv"
    with open(path, "w") as f:
        f.write(",".join(LOG_COLUMNS) + "\n")
        for i in range(40_000):
            op = "alloc" if (i // 100) % 2 == 0 else "free"
            f.write(f"{T0 + i * 1e-4:.6f},7,MainThread,0,0,{op},{hex(0x1000 + (i % 100) * 64)},"
                    f"64,model/layer{i % 8},/src/m.py:{i % 20} in f,,\n")  # fmt: skip
    size = os.path.getsize(path)
    tracemalloc.start()
    try:
        s = report.summarize(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert s.n_events == 40_000
    assert peak < size / 2, (peak, size)  # a list of the rows would take several times `size`


# -- many files, the same file twice -----------------------------------------------------
@pytest.mark.skipif(sys.platform == "win32", reason="needs POSIX resource limits")
def test_more_logs_than_the_open_file_limit(tmp_path):
    """A directory of more logs than files a process may open at once still merges."""
    d = tmp_path / "logs"
    d.mkdir()
    n = 300
    for pid in range(1, n + 1):
        rows = [row(f"{T0 + i + pid / 1000:.6f}", "alloc", 0x100 * (i + 1), 64, pid=pid)
                for i in range(5)]  # fmt: skip
        write_log(d / f"alloc-{pid}.csv", rows)
    code = (
        "import resource, sys, json\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (100, resource.getrlimit("
        "resource.RLIMIT_NOFILE)[1]))\n"
        "from cupy_poolmem import report\n"
        f"s = report.summarize({str(d)!r})\n"
        "times = [lk.time for lk in s.leaks]\n"
        "print(json.dumps([s.n_events, len(s.pids), s.leaked_bytes, s.end_time]))\n"
    )
    env = dict(os.environ, PYTHONPATH=PKG_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert json.loads(r.stdout) == [5 * n, n, 5 * n * 64, T0 + 4 + n / 1000]


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_reading_in_chunks_gives_the_same_rows_and_reasons(tmp_path, chunk):
    from cupy_poolmem.report._read import BadRows, LogSource, iter_events

    head = ",".join(LOG_COLUMNS).encode()
    body = [
        b"\xef\xbb\xbf" + head,
        b'1.0,1,T,0,0,alloc,0x10,100,"multi\r\nline, tag",,,',
        b"2.0,1,T\xff,0,0,alloc,0x20,100,x,,,",
        b"3.0,1,T,0,0,alloc,0x30,-5,x,,,",
        head,
        "4.0,1,T,0,0,alloc,0x40,100,modèle,,,".encode(),
        b"5.0,1,T,0,0,free,0x10,100",
        b"6.0,1,T,0,0,free,0x10,100,,,,",
    ]
    path = tmp_path / "a.csv"
    path.write_bytes(b"\r\n".join(body) + b"\r\n")
    src = LogSource(str(path), str(path))

    class Every(BadRows):
        def add(self, where: str, reason: str) -> None:
            super().add(where, reason)
            self.where = [*getattr(self, "where", []), where.rsplit(" ", 1)[1]]

    whole, parts = Every(), Every()
    expect = list(iter_events(src, whole))
    assert [e.time for e in expect] == [1.0, 4.0, 6.0] and expect[0].tag == "multi\r\nline, tag"
    assert list(iter_events(src, parts, chunk)) == expect
    assert whole.first == f"{path} line 4: bytes that are not UTF-8"
    assert parts.where == whole.where == ["4", "5", "8"] and parts.first == whole.first


def test_a_file_named_twice_is_read_once(tmp_path, capsys):
    path = write_log(tmp_path / "alloc-1.csv", good_rows())
    os.symlink(path, tmp_path / "link.csv")
    r = cli(str(tmp_path), path, str(tmp_path / "link.csv"), "--json")
    assert r.returncode == 0, r.stderr
    d = strict_json(r.stdout.decode())
    assert d["n_events"] == 3 and d["n_allocs"] == 2 and d["leaked_bytes"] == 512
    assert len(d["files"]) == 1
    assert b"warning: skipped" in r.stderr and b"same file as" in r.stderr


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_named_pipe_is_read_once(tmp_path):
    """``report <(zcat alloc.csv.gz)`` and ``report /dev/stdin``: a pipe can be read once."""
    data = open(write_log(tmp_path / "a.csv", good_rows()), "rb").read()
    r = cli("/dev/stdin", "--json", stdin=data)
    assert r.returncode == 0, r.stderr
    assert strict_json(r.stdout.decode())["n_events"] == 3
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "logs").mkdir()
    os.mkfifo(tmp_path / "logs" / "b.csv")  # in a directory: skipped, never waited on
    write_log(tmp_path / "logs" / "a.csv", good_rows(pid=2))
    env = dict(os.environ, PYTHONPATH=PKG_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cupy_poolmem",
            "report",
            str(fifo),
            str(tmp_path / "logs"),
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )

    def feed() -> None:  # blocks until the report opens the pipe: a thread, not the test
        with contextlib.suppress(OSError), open(fifo, "wb") as w:
            w.write(data)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))  # frees a feeder still waiting
        feeder.join(timeout=10)
    assert proc.returncode == 0, err
    assert strict_json(out.decode())["n_events"] == 6
    assert b"b.csv: not a regular file" in err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_for_the_output_is_one_line_not_a_traceback(tmp_path):
    path = write_log(tmp_path / "a.csv", good_rows())
    env = dict(os.environ, PYTHONPATH=PKG_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for extra in ([], ["--json"]):
        with open("/dev/full", "w") as full:
            r = subprocess.run(
                [sys.executable, "-m", "cupy_poolmem", "report", path, *extra],
                stdout=full,
                stderr=subprocess.PIPE,
                timeout=120,
                env=env,
            )
        err = r.stderr.decode()
        assert r.returncode == 1, err
        assert err.splitlines() == [
            "python -m cupy_poolmem report: error: cannot write the output: No space left on device"
        ]


def test_plot_samples_stay_bounded_when_times_go_back():
    """Processes appending to one file write their batches out of time order: times
    before the first event or after the last still land in the first or last bucket."""
    from cupy_poolmem.report._plot import sample_series
    from cupy_poolmem.report._read import LogEvent

    events = [
        LogEvent(T0 - i if i % 2 else T0 + i / 1000, 1, "T", 0, 0, "alloc", 64 * (i + 1), 64,
                 "a", "", None, None)
        for i in range(2000)
    ]  # fmt: skip
    (panel,) = sample_series(events, [(1, 0)], ["a"], T0, T0 + 2, n_buckets=4)
    assert len(panel.moments) <= 8
    assert max(m[1] for m in panel.moments) == 2000 * 64


def test_a_compressed_log_names_how_to_read_it(tmp_path):
    import gzip

    path = tmp_path / "alloc.csv.gz"
    with gzip.open(path, "wb") as f:
        f.write(open(write_log(tmp_path / "a.csv", good_rows()), "rb").read())
    r = cli(str(path))
    assert r.returncode == 2
    assert b"alloc.csv.gz: gzip-compressed: decompress it first" in r.stderr
    assert b"<(zcat " in r.stderr
