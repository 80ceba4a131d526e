"""CPU tests of examples/: each script compiles and, without a GPU, exits cleanly with a message."""

from __future__ import annotations

import ast
import glob
import os
import py_compile
import subprocess
import sys

import pytest

import cupy_poolmem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "*.py")))
NEW = [
    "one_line_allocator.py",
    "pinned_staging.py",
    "managed_prefetch.py",
    "queue_zero_copy.py",
    "allocation_log.py",
]
IDS = [os.path.basename(p) for p in EXAMPLES]


def test_the_examples_are_there():
    assert set(NEW) <= set(IDS), set(NEW) - set(IDS)


@pytest.mark.parametrize("path", EXAMPLES, ids=IDS)
def test_example_compiles_and_is_documented(path, tmp_path):
    py_compile.compile(path, cfile=str(tmp_path / "x.pyc"), doraise=True)
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    doc = ast.get_docstring(tree)
    assert doc and "python examples/" in doc, "the docstring must say how to run it"
    guards = [
        n
        for n in tree.body
        if isinstance(n, ast.If)
        and "__name__" in ast.unparse(n.test)
        and "__main__" in ast.unparse(n.test)
    ]
    assert guards, 'no `if __name__ == "__main__":` guard'


@pytest.mark.skipif(
    cupy_poolmem.device_count() > 0, reason="this machine has a GPU: the examples would really run"
)
@pytest.mark.parametrize("path", EXAMPLES, ids=IDS)
def test_example_without_gpu_exits_with_a_message(path, tmp_path):
    env = dict(
        os.environ,
        PYTHONPATH=os.path.dirname(os.path.dirname(cupy_poolmem.__file__))
        + os.pathsep
        + os.environ.get("PYTHONPATH", ""),
    )
    r = subprocess.run(
        [sys.executable, path], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300
    )
    text = r.stdout + r.stderr
    assert r.returncode != 0, f"exited 0 without a GPU:\n{text}"
    assert "Traceback" not in text, text
    assert "GPU" in r.stderr, f"no clear message on stderr:\n{text}"
    assert list(tmp_path.iterdir()) == [], "wrote files although it could not run"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name,args",
    [
        ("one_line_allocator.py", []),
        ("pinned_staging.py", []),
        ("managed_prefetch.py", []),
        ("queue_zero_copy.py", ["--arrays", "12", "--mib", "4"]),
        ("allocation_log.py", ["usage.png"]),
    ],
)
def test_example_runs_on_a_gpu(name, args, tmp_path):
    """On a GPU machine the new examples run to the end and report success (status 0)."""
    env = dict(
        os.environ,
        PYTHONPATH=os.path.dirname(os.path.dirname(cupy_poolmem.__file__))
        + os.pathsep
        + os.environ.get("PYTHONPATH", ""),
    )
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", name), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=280,
    )
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-6000:]
    assert "Traceback" not in text, text[-6000:]
    if name == "allocation_log.py":
        assert (tmp_path / "usage.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (tmp_path / "usage.csv").stat().st_size > 0
