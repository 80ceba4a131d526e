"""CPU tests of a base install: the package without CuPy and the cuda packages.

Each test runs a fresh interpreter in which importing ``cupy``, ``cupyx``,
``cupy_backends``, ``cuda`` or ``fastrlock`` fails as it does when they are not
installed, then imports this copy of cupy_poolmem there.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import pytest

import cupy_poolmem
from cupy_poolmem.stats import LOG_COLUMNS

PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(cupy_poolmem.__file__)))

# Installed first thing in the child: a finder that makes the GPU packages missing.
_BLOCK = textwrap.dedent(
    """
    import sys

    class _NotInstalled:
        blocked = ("cupy", "cupyx", "cupy_backends", "cuda", "fastrlock")

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.blocked:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NotInstalled())
    """
)


def run_without_gpu_packages(code: str, *argv: str, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=PKG_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CUPY_POOLMEM_LOG", None)
    return subprocess.run(
        [sys.executable, "-c", _BLOCK + textwrap.dedent(code), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=env,
    )


def run_cli(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    code = """
    import runpy, sys
    sys.argv = ["cupy_poolmem", *sys.argv[1:]]
    runpy.run_module("cupy_poolmem", run_name="__main__", alter_sys=True)
    """
    return run_without_gpu_packages(code, *argv, cwd=cwd)


def test_the_blocker_really_blocks():
    r = run_without_gpu_packages("import cupy")
    assert r.returncode == 1 and "No module named 'cupy'" in r.stderr


def test_package_imports_and_cpu_features_work():
    r = run_without_gpu_packages(
        """
        import sys
        import cupy_poolmem as c
        assert "cupy" not in sys.modules and "cuda" not in sys.modules
        assert c.parse_bytes("1GiB") == 2**30 and c.format_bytes(2**30) == "1.00 GiB"
        assert c.device_count() == 0
        assert issubclass(c.OutOfPoolMemoryError, MemoryError)
        assert issubclass(c.PinnedOutOfMemoryError, RuntimeError)
        assert c.PinnedOutOfMemoryError("p", 1).status == 2
        assert str(c.OutOfPoolMemoryError("p", 5)).startswith("p: out of memory")
        with c.statistics() as st, c.tag("x"):
            pass
        assert st.n_allocs == 0
        print("ok", c.__version__)
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"ok {cupy_poolmem.__version__}"


@pytest.mark.parametrize("name", ["DevicePool", "set_allocator", "sharing", "prefetch"])
def test_gpu_names_raise_a_package_error_naming_the_extra(name):
    r = run_without_gpu_packages(
        f"""
        import cupy_poolmem as c
        try:
            c.{name}
        except c.MissingDependencyError as exc:
            assert isinstance(exc, ImportError)
            print(exc)
        else:
            raise SystemExit("no error")
        """
    )
    assert r.returncode == 0, r.stderr
    assert f"cupy_poolmem.{name} needs CuPy and cuda.core" in r.stdout
    assert 'pip install "cupy_poolmem[cu13]"' in r.stdout


def test_from_import_of_a_gpu_name_is_an_import_error():
    r = run_without_gpu_packages(
        """
        try:
            from cupy_poolmem import DevicePool
        except ImportError as exc:
            print(type(exc).__name__, exc)
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("MissingDependencyError") and "cupy_poolmem[cu13]" in r.stdout


def test_version_without_gpu_packages():
    r = run_cli("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"cupy_poolmem {cupy_poolmem.__version__}"


def test_report_without_gpu_packages(tmp_path):
    log = tmp_path / "alloc-3.csv"
    with open(log, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(LOG_COLUMNS)
        w.writerow(["1.0", 3, "MainThread", 0, 0, "alloc", "0x10", 2048, "a", "", 2048, ""])
        w.writerow(["2.0", 3, "MainThread", 0, 0, "alloc", "0x20", 1024, "b", "", 3072, ""])
    r = run_cli("report", str(log), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "Peak used memory" in r.stdout and "3.00 KiB" in r.stdout
    if importlib.util.find_spec("matplotlib") is not None:
        out = tmp_path / "u.png"
        r = run_cli("report", str(log), "--plot", str(out), cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert out.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("cmd", ["bench", "demo"])
def test_gpu_commands_name_the_extra_in_one_line(cmd):
    r = run_cli(cmd)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and 'pip install "cupy_poolmem[cu13]"' in lines[0], r.stderr


def test_doctor_without_gpu_packages_names_the_extra():
    r = run_cli()
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr, r.stderr
    assert "cupy_poolmem doctor" in r.stdout
    assert 'pip install "cupy_poolmem[cu13]"' in r.stdout


def test_doctor_says_in_one_short_line_why_the_hot_path_is_unavailable():
    r = run_cli("doctor")
    line = next(x for x in r.stdout.splitlines() if x.strip().startswith("hot path"))
    assert re.fullmatch(
        r"\s*hot path\s+unavailable \(No module named '(cupy|cuda)[\w.]*'\)", line
    ), line
