"""CPU tests of ``report --to``: PyTorch memory snapshots and RMM logging-adaptor CSV."""

from __future__ import annotations

import csv
import os
import pickle
import re

import pytest

from cupy_poolmem import report
from cupy_poolmem.report._export import RMM_HEADER, export
from cupy_poolmem.stats import LOG_COLUMNS

T0 = 1_700_000_000.0


def write_log(path, rows) -> str:
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(LOG_COLUMNS)
        w.writerows(rows)
    return str(path)


def ev(t, op, ptr, size, tag="", site="", pid=1, dev=0, thread="MainThread", stream=0):
    return [f"{T0 + t:.6f}", pid, thread, dev, stream, op, hex(ptr), size, tag, site, "", ""]


@pytest.fixture
def log(tmp_path):
    """One process: a reused address, a free from before the log, an unlogged free,
    pinned memory, a guard report, and two blocks live at the end."""
    return write_log(
        tmp_path / "alloc-1.csv",
        [
            ev(0.0, "alloc", 0x1000, 4096, "model/attn", "/src/train.py:10 in step"),
            ev(0.1, "alloc", 0x3000, 2 << 20, "model/mlp", "/src/train.py:11 in step", stream=7),
            ev(0.2, "free", 0x1000, 4096, "model/attn", "/src/train.py:10 in step"),
            ev(0.3, "alloc", 0x1000, 512, "loss", "/src/loss.py:3 in loss", thread="w1"),
            ev(0.4, "free", 0x9000, 64),  # allocated before the log
            ev(0.5, "alloc", 0x1000, 256, "loss", "/src/loss.py:4 in loss"),  # 512's free lost
            ev(0.6, "alloc", 0x5000, 128, dev=-1),  # pinned: not in either format
            ev(0.7, "guard:double_free", 0x1000, 256),
        ],
    )


def test_torch_snapshot_structure(log, tmp_path):
    out = tmp_path / "snap.pickle"
    n, files = export(report.load(log), "torch-snapshot", out)
    assert files == [str(out)]
    with open(out, "rb") as f:
        snap = pickle.load(f)
    assert set(snap) == {"segments", "device_traces"}
    (trace,) = snap["device_traces"]
    assert n == 7  # 4 allocations, 3 frees
    actions = [(e["action"], e["addr"], e["size"]) for e in trace]
    assert actions == [
        ("segment_alloc", 0x1000, 4096),
        ("alloc", 0x1000, 4096),
        ("segment_alloc", 0x3000, 2 << 20),
        ("alloc", 0x3000, 2 << 20),
        ("free_requested", 0x1000, 4096),
        ("free_completed", 0x1000, 4096),
        ("segment_free", 0x1000, 4096),
        ("segment_alloc", 0x1000, 512),
        ("alloc", 0x1000, 512),
        ("free_requested", 0x9000, 64),
        ("free_completed", 0x9000, 64),
        ("segment_free", 0x9000, 64),
        ("free_requested", 0x1000, 512),  # the lost free, before the address is reused
        ("free_completed", 0x1000, 512),
        ("segment_free", 0x1000, 512),
        ("segment_alloc", 0x1000, 256),
        ("alloc", 0x1000, 256),
    ]
    first = trace[1]
    assert first["frames"] == [
        {"filename": "/src/train.py", "line": 10, "name": "step"},
        {"filename": "<cupy_poolmem tag>", "line": 0, "name": "tag model/attn"},
    ]
    assert first["time_us"] == int(T0 * 1e6) and trace[3]["stream"] == 7
    assert trace[12]["frames"][0]["name"] == "loss"  # a free carries its allocation's frames
    segs = sorted(snap["segments"], key=lambda s: s["address"])
    assert [(s["address"], s["total_size"], s["segment_type"]) for s in segs] == [
        (0x1000, 256, "small"),
        (0x3000, 2 << 20, "large"),
    ]
    for s in segs:
        (b,) = s["blocks"]
        assert b["state"] == "active_allocated" and b["size"] == s["allocated_size"]
        assert s["device"] == 0 and s["active_size"] == s["total_size"]


def _annotated(trace):
    """``(action, addr, size)`` of a trace as memory_viz's page reads it: a
    ``free_requested`` followed by its ``free_completed`` is one ``free``."""
    out = []
    for e in trace:
        a = (e["action"], e["addr"], e["size"])
        if a[0] == "free_completed" and out and out[-1][:2] == ("free_requested", a[1]):
            out[-1] = ("free", a[1], a[2])
        else:
            out.append(a)
    return out


def test_every_block_lies_in_a_segment_at_every_event(log, tmp_path):
    """memory_viz's "Allocator State History" replays the trace backwards from the
    segments and finds each live block's segment (``b.segment.occupied``: a block in no
    segment stops the page).  torch's own invariant: a block is always in a segment."""
    out = tmp_path / "snap.pickle"
    export(report.load(log), "torch-snapshot", out)
    with open(out, "rb") as f:
        snap = pickle.load(f)
    segs = {s["address"]: s["total_size"] for s in snap["segments"] if s["device"] == 0}
    blocks = {}
    for s in snap["segments"]:
        addr = s["address"]
        for b in s["blocks"]:
            blocks[addr] = b["size"]
            addr += b["size"]
    trace = _annotated(snap["device_traces"][0])
    for i in range(len(trace) - 1, -2, -1):  # the state after event i, back to the start
        for addr, size in blocks.items():
            assert any(a <= addr and addr + size <= a + n for a, n in segs.items()), (i, hex(addr))
        if i < 0:
            break
        action, addr, size = trace[i]
        if action in ("free", "free_completed"):
            blocks[addr] = size
        elif action == "alloc":
            del blocks[addr]
        elif action == "segment_free":
            segs[addr] = size
        elif action == "segment_alloc":
            del segs[addr]
    assert {a for a, *_ in trace} >= {"alloc", "free", "segment_alloc", "segment_free"}


def test_torch_memory_viz_reads_the_snapshot(log, tmp_path):
    mv = pytest.importorskip(
        "torch.cuda._memory_viz", reason="torch is not installed (not a test dependency)"
    )
    out = tmp_path / "snap.pickle"
    export(report.load(log), "torch-snapshot", out)
    with open(out, "rb") as f:
        snap = pickle.load(f)
    summary = mv.segsum(snap)
    assert "segments: 2" in summary and "total_allocated: 2.0MiB" in summary
    text = mv.trace(snap)
    assert "17 entries" in text and "del" in text and "cudaFree" in text
    flame = mv.memory(snap, format_flamegraph=lambda lines: lines)
    assert "train.py:11:step" in flame and "tag model/mlp" in flame
    assert mv.segments(snap, format_flamegraph=lambda lines: lines).count("seg_") == 2
    for html in (mv.trace_plot(snap), mv.segment_plot(snap)):
        assert "snapshot.pickle" in html
    pairs = mv.filter_alloc_free_pairs(pickle.loads(pickle.dumps(snap)))
    assert {e["addr"] for e in pairs["device_traces"][0] if e["action"] == "alloc"} == {
        0x3000,
        0x1000,
    }


_TIME = re.compile(r"^\d\d:\d\d:\d\d\.\d{6}$")


def test_rmm_log_has_rmms_columns_and_values(log, tmp_path):
    out = tmp_path / "rmm.csv"
    n, files = export(report.load(log), "rmm-log", out)
    assert files == [str(out)]
    with open(out, newline="") as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0]) == RMM_HEADER == ("Thread", "Time", "Action", "Pointer", "Size", "Stream")
    body = [dict(zip(RMM_HEADER, r)) for r in rows[1:]]
    assert n == len(body) == 6  # the free from before the log is left out
    # What RMM's replay benchmark parses: Thread and Size as integers, Action
    # allocate/free, Pointer as hexadecimal; Time as the adaptor writes it.
    for r in body:
        int(r["Thread"])
        int(r["Size"])
        int(r["Pointer"], 16)
        int(r["Stream"], 16)
        assert r["Action"] in ("allocate", "free") and _TIME.match(r["Time"]), r
        assert r["Pointer"].startswith("0x")
        # RMM streams the cudaStream_t: "0" for the default stream, "0x7f.." otherwise.
        assert r["Stream"] == "0" or r["Stream"].startswith("0x"), r
    got = [(r["Action"], int(r["Pointer"], 16), int(r["Size"])) for r in body]
    assert got == [
        ("allocate", 0x1000, 4096),
        ("allocate", 0x3000, 2 << 20),
        ("free", 0x1000, 4096),
        ("allocate", 0x1000, 512),
        ("free", 0x1000, 512),
        ("allocate", 0x1000, 256),
    ]
    assert [r["Thread"] for r in body] == ["1", "1", "1", "2", "1", "1"]
    assert body[1]["Stream"] == "0x7" and body[0]["Stream"] == "0"


def test_rmm_log_replays_cleanly(log, tmp_path):
    """The replay's invariant: every free names a live allocation of the same size."""
    out = tmp_path / "rmm.csv"
    export(report.load(log), "rmm-log", out)
    live: dict[int, int] = {}
    with open(out, newline="") as f:
        for r in csv.DictReader(f):
            ptr, size = int(r["Pointer"], 16), int(r["Size"])
            if r["Action"] == "allocate":
                assert ptr not in live
                live[ptr] = size
            else:
                assert live.pop(ptr) == size


def test_several_processes_give_one_file_each(tmp_path):
    a = write_log(tmp_path / "a.csv", [ev(0, "alloc", 0x10, 8, pid=11)])
    b = write_log(
        tmp_path / "b.csv",
        [ev(1, "alloc", 0x10, 16, pid=12), ev(2, "alloc", 0x20, 4, pid=12, dev=1)],
    )
    loaded = report.load([a, b])
    n, files = export(loaded, "torch-snapshot", tmp_path / "s.pickle")
    assert n == 3 and [os.path.basename(p) for p in files] == ["s.pid11.pickle", "s.pid12.pickle"]
    with open(files[1], "rb") as f:
        assert [len(t) for t in pickle.load(f)["device_traces"]] == [2, 2]
    n, files = export(loaded, "rmm-log", tmp_path / "r.csv")
    assert [os.path.basename(p) for p in files] == [
        "r.pid11.dev0.csv",
        "r.pid12.dev0.csv",
        "r.pid12.dev1.csv",
    ]
    assert not [p for p in os.listdir(tmp_path) if ".part" in p]


def test_cli_to(log, tmp_path):
    out = tmp_path / "x.pickle"
    assert report.main([log, "--to", "torch-snapshot", str(out)]) == 0
    assert out.stat().st_size > 100
    with pytest.raises(SystemExit):
        report.main([log, "--to", "torch-snapshot"])  # FORMAT and FILE both needed
    assert report.main([log, "--to", "pprof", str(out)]) == 2
    assert report.main([log, "--to", "rmm-log", str(tmp_path / "no" / "r.csv")]) == 2
    assert not (tmp_path / "no").exists()


def test_an_output_that_is_one_of_the_logs_is_refused(log, tmp_path, capsys):
    """``report alloc.csv --to rmm-log alloc.csv`` (both are .csv) must not replace the log."""
    before = open(log, "rb").read()
    os.symlink(log, tmp_path / "link.csv")
    for args in (
        [log, "--to", "rmm-log", log],
        [str(tmp_path), "--to", "torch-snapshot", str(tmp_path / "link.csv")],
    ):
        assert report.main(args) == 2
        assert "that file is a log being read" in capsys.readouterr().err
        assert open(log, "rb").read() == before


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs POSIX resource limits")
def test_rmm_logs_of_more_processes_than_open_files(tmp_path):
    """One RMM log per process: 300 processes under a limit of 100 open files."""
    import json
    import subprocess
    import sys

    import cupy_poolmem

    d = tmp_path / "logs"
    d.mkdir()
    for pid in range(1, 301):
        write_log(d / f"a-{pid}.csv", [ev(pid / 1000, "alloc", 0x10, 8, pid=pid),
                                        ev(1 + pid / 1000, "free", 0x10, 8, pid=pid)])  # fmt: skip
    parent = os.path.dirname(os.path.dirname(os.path.abspath(cupy_poolmem.__file__)))
    code = (
        "import resource, json\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (100, resource.getrlimit("
        "resource.RLIMIT_NOFILE)[1]))\n"
        "from cupy_poolmem import report\n"
        "from cupy_poolmem.report._export import export\n"
        f"print(json.dumps(export(report.load({str(d)!r}), 'rmm-log', {str(tmp_path / 'r.csv')!r})))\n"
    )
    env = dict(os.environ, PYTHONPATH=parent + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    n, files = json.loads(r.stdout)
    assert n == 600 and len(files) == 300
    with open(tmp_path / "r.pid7.dev0.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0]) == RMM_HEADER and [r[2] for r in rows[1:]] == ["allocate", "free"]
    assert not [p for p in os.listdir(tmp_path) if ".part" in p]


def test_a_failed_rmm_export_leaves_no_part_files(log, tmp_path):
    class Failing:
        def events(self):
            yield from report.load(log).events()
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        export(Failing(), "rmm-log", tmp_path / "r.csv")
    assert [p for p in os.listdir(tmp_path) if p != "alloc-1.csv"] == []
