"""CPU test of the documentation: the Sphinx site builds with warnings as errors."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import zlib

import pytest

import cupy_poolmem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
PAGES = [
    "index",
    "quickstart",
    "choosing",
    "device_pool",
    "pinned_pool",
    "managed_pool",
    "sharing",
    "observability",
    "guard",
    "dask",
    "numba",
    "cli",
    "comparison",
    "migration",
    "troubleshooting",
    "compatibility",
    "api",
    "changelog",
]
MODULES = [
    "cupy_poolmem",
    "cupy_poolmem.stats",
    "cupy_poolmem.report",
    "cupy_poolmem.managed",
    "cupy_poolmem.dask",
    "cupy_poolmem.numba",
]


def _inventory(path: str) -> dict[str, str]:
    """``{name: role}`` from a Sphinx ``objects.inv`` (version 2)."""
    with open(path, "rb") as f:
        data = f.read()
    header, _, body = data.partition(b"compressed using zlib.\n")
    assert header.startswith(b"# Sphinx inventory version 2"), header[:60]
    out = {}
    for line in zlib.decompress(body).decode().splitlines():
        name, role = line.split(" ", 2)[:2]
        out[name] = role
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    for mod in ("sphinx", "numpydoc"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("html")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "-n",
            "--keep-going",
            "-b",
            "html",
            "-d",
            str(out / ".doctrees"),
            DOCS,
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    return r, out


def test_docs_build_without_warnings(built):
    r, _ = built
    assert r.returncode == 0, f"sphinx -W failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    assert "WARNING" not in r.stderr, r.stderr[-6000:]


def test_key_pages_exist(built):
    r, out = built
    assert r.returncode == 0
    for page in PAGES:
        path = out / f"{page}.html"
        assert path.exists(), f"{page}.html missing"
        assert path.stat().st_size > 2000, f"{page}.html is nearly empty"
    index = (out / "index.html").read_text(encoding="utf-8")
    for page in PAGES[1:]:
        assert f'href="{page}.html"' in index, f"{page} is not in the index toctree"


def test_every_public_name_and_module_is_documented(built):
    r, out = built
    assert r.returncode == 0
    inv = _inventory(str(out / "objects.inv"))
    missing = [n for n in cupy_poolmem.__all__ if f"cupy_poolmem.{n}" not in inv]
    assert not missing, f"in cupy_poolmem.__all__ but not in the docs: {missing}"
    modules = {n for n, role in inv.items() if role == "py:module"}
    assert set(MODULES) <= modules, set(MODULES) - modules


def test_pages_say_what_the_brief_promises(built):
    """Spot checks of facts users rely on (not of wording)."""
    _, out = built
    pinned = (out / "pinned_pool.html").read_text(encoding="utf-8")
    for fact in (
        "cuMemPoolGetAccess",
        "cuMemPoolSetAccess",
        "PROT_NONE",
        "pinned_bandwidth.py",  # the measured figure: docs/_figures/, from its output
        "PinnedOutOfMemoryError",
        "cudaErrorMemoryAllocation",
        "NUMA",
    ):
        assert fact in pinned, fact
    managed = (out / "managed_pool.html").read_text(encoding="utf-8")
    for fact in ("CUDA_ERROR_NOT_SUPPORTED", "UnsupportedError", "cudaMallocManaged", "free"):
        assert fact in managed, fact
    sharing = (out / "sharing.html").read_text(encoding="utf-8")
    for fact in (
        "ForkingPickler",
        "spawn",
        "forkserver",
        "PoolClosedError",
        "SharingError",
        "inflight_timeout",
        "device-copy",
        "authkey",
        "UUID",
    ):
        assert fact in sharing, fact
    trouble = (out / "troubleshooting.html").read_text(encoding="utf-8")
    for fact in ("--ipc=host", "--pid=host", "MIG", "WSL", "cu12", "MissingDependencyError"):
        assert fact in trouble, fact
    compat = (out / "compatibility.html").read_text(encoding="utf-8")
    for fact in ("Python", "CuPy", "cuda.core", "cuda.bindings", "driver", "3.10"):
        assert fact in compat, fact
    migration = (out / "migration.html").read_text(encoding="utf-8")
    for fact in ("rmm_cupy_allocator", "MemoryPool", "MemoryAsyncPool", "set_allocator"):
        assert fact in migration, fact
    changelog = (out / "changelog.html").read_text(encoding="utf-8")
    assert "Unreleased" in changelog and "0.1.0" in changelog
    comparison = (out / "comparison.html").read_text(encoding="utf-8")
    # The measured tables, rendered from benchmarks/results/ (or the note that none is);
    # the page's text without its markup (a literal's words are spans of their own).
    text = " ".join(re.sub(r"<[^>]+>", " ", comparison).split())
    assert "No benchmark output is committed yet" in text or "python -m cupy_poolmem bench" in text
