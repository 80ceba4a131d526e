"""CPU tests of the command line: per-command help, --version, one-line errors, report's inputs."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

import cupy_poolmem
from cupy_poolmem import report
from cupy_poolmem.stats import LOG_COLUMNS

PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(cupy_poolmem.__file__)))
NO_GPU = cupy_poolmem.device_count() == 0


def cli(*args: str, cwd=None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m cupy_poolmem ARGS`` with this copy of the package."""
    env = dict(os.environ, PYTHONPATH=PKG_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "cupy_poolmem", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )


def one_line_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    """Assert: exit 2, no traceback, exactly one line on stderr containing ``needles``."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "error:" in lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def write_log(path, rows) -> str:
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(LOG_COLUMNS)
        w.writerows(rows)
    return str(path)


@pytest.fixture
def small_log(tmp_path):
    return write_log(
        tmp_path / "alloc-1.csv",
        [
            ["1.0", 1, "MainThread", 0, 0, "alloc", "0x100", 4096, "step", "", 4096, 8192],
            ["1.5", 1, "MainThread", 0, 0, "alloc", "0x900", 512, "", "", 4608, 8192],
            ["2.0", 1, "MainThread", 0, 0, "free", "0x100", 4096, "step", "", 512, 8192],
        ],
    )


# -- help and version --------------------------------------------------------------------
def test_version():
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"cupy_poolmem {cupy_poolmem.__version__}"


def test_top_level_help_lists_commands_without_markup():
    r = cli("--help")
    assert r.returncode == 0
    for cmd in ("doctor", "demo", "bench", "report", "--version", "examples:"):
        assert cmd in r.stdout, cmd
    assert "``" not in r.stdout and ":func:" not in r.stdout  # no raw reST


@pytest.mark.parametrize(
    "cmd,own",
    [
        ("doctor", "--no-check"),
        ("demo", "python -m cupy_poolmem demo"),
        ("bench", "--quick"),
        ("report", "--tag-depth"),
    ],
)
def test_each_command_has_its_own_help_with_an_example(cmd, own):
    r = cli(cmd, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: python -m cupy_poolmem {cmd}"), r.stdout[:200]
    assert own in r.stdout and "example" in r.stdout and "exit status" in r.stdout
    assert "``" not in r.stdout
    others = {"doctor", "demo", "bench", "report"} - {cmd}
    assert not any(f"usage: python -m cupy_poolmem {o}" in r.stdout for o in others)


def test_bench_help_lists_every_benchmark():
    from cupy_poolmem.benchmarks import BENCHMARKS

    out = cli("bench", "--help").stdout
    for name in BENCHMARKS:
        assert f"  {name} " in out, name


# -- one-line errors ---------------------------------------------------------------------
def test_unknown_command_and_option():
    one_line_error(cli("frobnicate"), "invalid choice", "frobnicate")
    one_line_error(cli("doctor", "--bogus"), "--bogus")
    one_line_error(cli("bench", "nosuch"), "unknown benchmark 'nosuch'", "alloc")


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--top", "-1"], "--top: must be >= 0; got -1"),
        (["--top", "many"], "'many' is not an integer"),
        (["--tag-depth", "0"], "--tag-depth: must be >= 1; got 0"),
    ],
)
def test_report_rejects_bad_numbers(small_log, args, needle):
    one_line_error(cli("report", small_log, *args), needle)


def test_report_missing_file(tmp_path):
    missing = str(tmp_path / "nope.csv")
    one_line_error(cli("report", missing), missing, "No such file")


def test_report_binary_file_names_it(tmp_path):
    p = tmp_path / "data.bin"
    p.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 8)
    one_line_error(cli("report", str(p)), str(p), "binary")
    q = tmp_path / "latin1.csv"
    q.write_bytes(b"time,pid\n\xe9\xe8\xff\n")
    one_line_error(cli("report", str(q)), str(q), "not UTF-8")


def test_report_empty_file_is_not_a_log(tmp_path):
    p = tmp_path / "empty.csv"
    p.write_bytes(b"")
    one_line_error(cli("report", str(p)), str(p), "empty file")


def test_report_other_csv_is_not_a_log(tmp_path):
    p = tmp_path / "other.csv"
    p.write_text("a,b,c\n1,2,3\n")
    one_line_error(cli("report", str(p)), str(p), "not a cupy_poolmem allocation log")


def test_report_directory_without_logs(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    one_line_error(cli("report", str(tmp_path)), str(tmp_path), "no *.csv allocation logs")


def test_report_plot_suffix_must_be_a_picture_format(small_log, tmp_path):
    out = tmp_path / "usage.txt"
    one_line_error(cli("report", small_log, "--plot", str(out)), "usage.txt", ".png")
    assert not out.exists()


def test_report_header_only_log_is_valid(tmp_path):
    p = write_log(tmp_path / "quiet.csv", [])
    r = cli("report", p)
    assert r.returncode == 0 and "(no events)" in r.stdout


# -- report output -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "suffix,magic", [(".pdf", b"%PDF"), (".svg", b"<?xml"), (".png", b"\x89PNG")]
)
def test_report_plot_writes_the_format_its_suffix_names(small_log, tmp_path, suffix, magic):
    pytest.importorskip("matplotlib")
    out = tmp_path / f"usage{suffix}"
    r = cli("report", small_log, "--plot", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[: len(magic)] == magic


def test_plot_legend_stays_off_the_lines(tmp_path, monkeypatch):
    """The legend sits outside every panel, so neither line runs through it."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    rows = []
    used = 0
    for i in range(200):
        size = 1 << 20
        used += size if i % 3 else -size // 2
        rows.append([f"{i * 0.01:.6f}", 5, "t", 0, 0, "alloc", hex(0x1000 + i * size), size,
                     f"tag{i % 4}", "", max(used, 0), max(used, 0) * 2])  # fmt: skip
    path = write_log(tmp_path / "l.csv", rows)
    seen = []
    real = Figure.savefig

    def capture(self, *a, **k):
        seen.append(self)
        return real(self, *a, **k)

    monkeypatch.setattr(Figure, "savefig", capture)
    report.plot(path, tmp_path / "l.png")
    (fig,) = seen
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()  # lays the figure out as savefig did
    renderer = canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend()
        assert legend is not None
        lb = legend.get_window_extent(renderer)
        ab = ax.get_window_extent(renderer)
        assert lb.x0 >= ab.x1, (lb, ab)  # entirely to the right of the plotting area


def test_report_json_into_a_closed_pipe_ends_quietly(tmp_path):
    """``report --json | head -c 100``: no BrokenPipeError traceback."""
    rows = [
        [f"{i:.6f}", 9, "t", 0, 0, "alloc", hex(0x1000 + i * 64), 64, f"t{i}", f"f.py:{i} in g", "", ""]
        for i in range(3000)
    ]  # fmt: skip
    path = write_log(tmp_path / "big.csv", rows)
    env = dict(os.environ, PYTHONPATH=PKG_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen(
        [sys.executable, "-m", "cupy_poolmem", "report", path, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    head = p.stdout.read(100)
    p.stdout.close()  # the reader goes away, as `head` does
    with p.stderr:
        err = p.stderr.read().decode()
    p.wait(timeout=120)
    assert head.startswith(b"{")
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert p.returncode in (0, 1)


def test_report_json_is_parseable(small_log):
    r = cli("report", small_log, "--json")
    assert r.returncode == 0
    d = json.loads(r.stdout)
    assert d["n_allocs"] == 2 and d["leaked_bytes"] == 512


# -- commands that need a GPU ------------------------------------------------------------
@pytest.mark.skipif(not NO_GPU, reason="checks the behaviour without a GPU")
@pytest.mark.parametrize("cmd", ["bench", "demo"])
def test_gpu_commands_without_a_gpu_say_so_in_one_line(cmd):
    one_line_error(cli(cmd), "GPU")


@pytest.mark.skipif(not NO_GPU, reason="checks the behaviour without a GPU")
def test_bench_with_names_without_a_gpu():
    one_line_error(cli("bench", "alloc", "--quick"), "bench needs a CUDA GPU")


def test_benchmarks_ship_with_the_package():
    """`bench` runs modules of the installed package, not scripts next to a checkout."""
    import importlib.util

    from cupy_poolmem.benchmarks import BENCHMARKS, DEFAULT

    assert set(DEFAULT) <= set(BENCHMARKS)
    for module, _what in BENCHMARKS.values():
        spec = importlib.util.find_spec(f"cupy_poolmem.benchmarks.{module}")
        assert spec is not None and spec.origin.startswith(os.path.dirname(cupy_poolmem.__file__))
