"""Check what the sdist and the wheel carry: ``python .ci/check_dist.py SDIST WHEEL``.

``--manylinux WHEEL`` checks only that a (repaired) wheel has a manylinux tag.
"""

from __future__ import annotations

import os
import sys
import tarfile
import zipfile


def fail(msg: str) -> None:
    print(f"check_dist: {msg}", file=sys.stderr)
    sys.exit(1)


def check_sdist(path: str) -> None:
    with tarfile.open(path) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    need = {
        "LICENSE",
        "README.md",
        "CHANGELOG.md",
        "CONTRIBUTING.md",
        "pyproject.toml",
        "setup.py",
        "cupy_poolmem/_hotpath.pyx",
        "cupy_poolmem/py.typed",
        "cupy_poolmem/benchmarks/alloc.py",
        "tests/conftest.py",
        "tests/_observer_fakes.py",
        "tests/_mp_workers.py",
        "docs/conf.py",
        "docs/index.rst",
        "examples/one_line_allocator.py",
        "benchmarks/alloc.py",
    }
    missing = sorted(need - names)
    if missing:
        fail(f"{os.path.basename(path)} lacks {missing}")
    tests_here = {f"tests/{n}" for n in os.listdir("tests") if n.endswith(".py")}
    if tests_here - names:
        fail(f"{os.path.basename(path)} lacks {sorted(tests_here - names)}")
    junk = sorted(n for n in names if n.endswith((".c", ".so", ".pyc")))
    if junk:
        fail(f"{os.path.basename(path)} carries build outputs: {junk}")
    print(f"sdist ok: {len(names)} files, tests and their helpers included, no generated C")


def check_wheel(path: str) -> None:
    with zipfile.ZipFile(path) as zf:
        names = set(zf.namelist())
    if any(n.endswith(".c") for n in names):
        fail(f"{os.path.basename(path)} carries generated C: "
             f"{[n for n in names if n.endswith('.c')]}")  # fmt: skip
    need = [
        "cupy_poolmem/py.typed",
        "cupy_poolmem/benchmarks/__init__.py",
        "cupy_poolmem/_sharing/__init__.py",
        "cupy_poolmem/_dask_transfer/__init__.py",
        "cupy_poolmem/report.py",
    ]
    missing = [n for n in need if n not in names]
    if missing:
        fail(f"{os.path.basename(path)} lacks {missing}")
    if not any(n.startswith("cupy_poolmem/_hotpath") and n.endswith(".so") for n in names):
        fail(f"{os.path.basename(path)} has no compiled hot path")
    if not any(n.endswith(".dist-info/licenses/LICENSE") for n in names):
        fail(f"{os.path.basename(path)} has no LICENSE in its metadata")
    if any(n.startswith("tests/") for n in names):
        fail(f"{os.path.basename(path)} installs a top-level 'tests' package")
    print(f"wheel ok: {os.path.basename(path)}, {len(names)} files, no generated C")


def main(argv: list[str]) -> None:
    if argv[:1] == ["--manylinux"]:
        name = os.path.basename(argv[1])
        if "manylinux" not in name:
            fail(f"{name} is not tagged manylinux")
        check_wheel(argv[1])
        return
    sdist, wheel = argv
    check_sdist(sdist)
    check_wheel(wheel)


if __name__ == "__main__":
    main(sys.argv[1:])
