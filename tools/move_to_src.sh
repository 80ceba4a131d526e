#!/usr/bin/env bash
# Move the package to a src/ layout: `git mv cupy_poolmem src/cupy_poolmem` and every
# configuration, script, test and doc edit the move needs, in one go.
#
#   bash tools/move_to_src.sh            from the top of a clean checkout; then review
#                                        `git status`/`git diff` and commit
#
# Why: with the package at the top of the repository, `python -m pytest` (which puts the
# working directory first on sys.path) imports the source tree instead of the installed
# package; in an unpacked sdist that is a package without its compiled hot path, and its
# Cython tests skip silently (CI deleted the folder to work around it).  Under src/, the
# tests import what pip installed: the wheel, or the editable install.
#
# Every edit is checked before anything changes: if the tree no longer has a line the
# script expects (someone changed it since), it stops, names the file and the line,
# and leaves the tree as it was.  It refuses a dirty tree and a tree already moved.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
if [ -e src/cupy_poolmem ] || [ ! -d cupy_poolmem ]; then
  echo "move_to_src: already moved (src/cupy_poolmem exists or cupy_poolmem/ is gone)" >&2
  exit 1
fi
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "move_to_src: commit or stash your changes first (git status is not clean)" >&2
  exit 1
fi

# Phase 1: check every edit applies, write nothing.  Phase 2 (after git mv): apply.
edits() {
  python - "$1" <<'PYEOF'
import glob
import re
import sys

apply = sys.argv[1] == "apply"

# (file, old, new, how many times old must occur)
EDITS = [
    # pyproject.toml: packages from src/, mypy on src/cupy_poolmem.
    ("pyproject.toml",
     '[tool.setuptools.packages.find]\ninclude = ["cupy_poolmem", "cupy_poolmem.*"]',
     '[tool.setuptools.packages.find]\nwhere = ["src"]\ninclude = ["cupy_poolmem", "cupy_poolmem.*"]',
     1),
    ("pyproject.toml", 'files = ["cupy_poolmem", "cupy_poolmem_dask.py"]',
     'files = ["src/cupy_poolmem", "src/cupy_poolmem_dask.py"]', 1),
    # The configuration-only Dask preload module sits beside the package.
    ("MANIFEST.in", "include cupy_poolmem_dask.py", "include src/cupy_poolmem_dask.py", 1),
    ("tools/gpu_dask.sh", 'export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"',
     'export PYTHONPATH="/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"', 1),
    # setup.py: the extension modules' sources.
    ("setup.py", '["cupy_poolmem/_arena.pyx"]', '["src/cupy_poolmem/_arena.pyx"]', 1),
    ("setup.py", '["cupy_poolmem/_hotpath.pyx"]', '["src/cupy_poolmem/_hotpath.pyx"]', 1),
    ("setup.py", "``cupy_poolmem/_hotpath_py.py``", "``src/cupy_poolmem/_hotpath_py.py``", 1),
    # MANIFEST.in and .gitignore: the package's files and Cython's output under src/.
    ("MANIFEST.in", "recursive-include cupy_poolmem ", "recursive-include src/cupy_poolmem ", 1),
    ("MANIFEST.in", "exclude cupy_poolmem/_hotpath.c cupy_poolmem/_arena.c",
     "exclude src/cupy_poolmem/_hotpath.c src/cupy_poolmem/_arena.c", 1),
    (".gitignore", "\ncupy_poolmem/_hotpath.c\n", "\nsrc/cupy_poolmem/_hotpath.c\n", 1),
    (".gitignore", "\ncupy_poolmem/_arena.c\n", "\nsrc/cupy_poolmem/_arena.c\n", 1),
    # .ci/check_dist.py: the sdist's paths (the wheel's do not change).
    (".ci/check_dist.py",
     '        "cupy_poolmem/_hotpath.pyx",\n        "cupy_poolmem/py.typed",\n'
     '        "cupy_poolmem/benchmarks/alloc.py",\n',
     '        "src/cupy_poolmem/_hotpath.pyx",\n        "src/cupy_poolmem/py.typed",\n'
     '        "src/cupy_poolmem/benchmarks/alloc.py",\n',
     1),
    # .ci/run: no more deleting the sdist's package folder; the unpacked sdist itself
    # must import the wheel's compiled hot path.
    (".ci/run", 'rm -rf "$SRC/cupy_poolmem"  # the tests must import the installed wheel\n', "", 1),
    (".ci/run",
     '(cd "$WORK" && "$VPY" -c "import cupy_poolmem, sys; '
     "sys.exit(cupy_poolmem.hotpath_implementation() != 'cython')\")",
     '(cd "$SRC" && "$VPY" -c "import cupy_poolmem, sys; '
     "sys.exit(cupy_poolmem.hotpath_implementation() != 'cython')\")",
     1),
    # .ci/gpu: the in-place build lands in src/cupy_poolmem; import it from there.
    (".ci/gpu", "export PYTHONPATH=$PWD:${PYTHONPATH:-}", "export PYTHONPATH=$PWD/src:${PYTHONPATH:-}", 1),
    # docs/conf.py: document the checkout's package.
    ("docs/conf.py",
     'sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))',
     'sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "src")))',
     1),
    # benchmarks/hotpath_instructions.py: the .pyx and the twin under src/; a revision
    # from before the move still has it at the top.
    ("benchmarks/hotpath_instructions.py",
     'PYX = os.path.join(ROOT, "cupy_poolmem", "_hotpath.pyx")',
     'SRC = os.path.join(ROOT, "src")\nPYX = os.path.join(SRC, "cupy_poolmem", "_hotpath.pyx")',
     1),
    ("benchmarks/hotpath_instructions.py", "DRIVE.format(where=ROOT, setup=SETUP_PURE)",
     "DRIVE.format(where=SRC, setup=SETUP_PURE)", 1),
    ("benchmarks/hotpath_instructions.py",
     'def _at_rev(rev: str) -> str:\n    return subprocess.run(\n'
     '        ["git", "show", f"{rev}:cupy_poolmem/_hotpath.pyx"],\n'
     "        cwd=ROOT,\n        check=True,\n        capture_output=True,\n"
     "        text=True,\n    ).stdout\n",
     'def _at_rev(rev: str) -> str:\n    for path in ("src/cupy_poolmem/_hotpath.pyx", "cupy_poolmem/_hotpath.pyx"):\n'
     "        r = subprocess.run(\n"
     '            ["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True\n'
     "        )\n"
     "        if r.returncode == 0:\n"
     "            return r.stdout\n"
     '    raise SystemExit(f"{rev}: no _hotpath.pyx ({r.stderr.strip()})")\n',
     1),
    # tests/test_examples_cpu.py: the examples import the package the tests import
    # (the installed one), not whatever sits at the top of the checkout.
    ("tests/test_examples_cpu.py",
     "PYTHONPATH=ROOT + os.pathsep",
     "PYTHONPATH=os.path.dirname(os.path.dirname(cupy_poolmem.__file__)) + os.pathsep",
     2),
]

# benchmarks/*.py wrappers: run the checkout's package from src/.
WRAPPER_OLD = "sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))"
WRAPPER_NEW = (
    'sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))'
)
for path in sorted(glob.glob("benchmarks/*.py")):
    n = open(path, encoding="utf-8").read().count(WRAPPER_OLD)
    if n:
        EDITS.append((path, WRAPPER_OLD, WRAPPER_NEW, n))

# Prose: paths into the package, `cupy_poolmem/...` or ``cupy_poolmem/...``.
PROSE = re.compile(r"(?<![\w/])(`{1,2})cupy_poolmem/")
prose_files = ["README.md", "CONTRIBUTING.md"] + sorted(glob.glob("docs/*.rst"))

problems = []
texts: dict[str, str] = {}
for path, old, new, count in EDITS:
    text = texts.get(path)
    if text is None:
        try:
            text = open(path, encoding="utf-8").read()
        except FileNotFoundError:
            problems.append(f"{path}: missing")
            continue
    found = text.count(old)
    if found != count:
        first = old.strip().splitlines()[0] if old.strip() else old
        problems.append(f"{path}: expected {count} of {first!r}, found {found}")
        continue
    texts[path] = text.replace(old, new)
for path in prose_files:
    text = texts.get(path) or open(path, encoding="utf-8").read()
    texts[path] = PROSE.sub(r"\1src/cupy_poolmem/", text)

if problems:
    print("move_to_src: the tree differs from what this script expects; nothing changed:",
          file=sys.stderr)
    for p in problems:
        print("  " + p, file=sys.stderr)
    sys.exit(1)
if apply:
    for path, text in texts.items():
        if open(path, encoding="utf-8").read() != text:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            print("edited", path)
PYEOF
}

edits check
mkdir -p src
git mv cupy_poolmem src/cupy_poolmem
git mv cupy_poolmem_dask.py src/cupy_poolmem_dask.py
# Build outputs git does not track (an in-place build's .so, Cython's .c) stay behind.
if [ -d cupy_poolmem ]; then
  echo "move_to_src: left in cupy_poolmem/ (untracked build outputs, removed):"
  find cupy_poolmem -type f | sed 's/^/  /'
  rm -rf cupy_poolmem
fi
edits apply

# A test that fails if the tests ever import the source tree instead of the package.
cat > tests/test_layout_cpu.py <<'PYEOF'
"""The tests import the installed package (a wheel, or the editable install of src/),
never a source folder at the top of the checkout (the flat layout's trap: an unpacked
sdist's tests ran the source without its compiled hot path)."""

from __future__ import annotations

import os
import subprocess
import sys

import cupy_poolmem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_package_folder_at_the_top():
    assert not os.path.exists(os.path.join(ROOT, "cupy_poolmem", "__init__.py"))


def test_the_working_directory_does_not_shadow_the_package():
    # `python -m pytest` puts the working directory first on sys.path.
    r = subprocess.run(
        [sys.executable, "-c", "import cupy_poolmem; print(cupy_poolmem.__file__)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert os.path.samefile(r.stdout.strip(), cupy_poolmem.__file__)
    top = os.path.dirname(os.path.dirname(r.stdout.strip()))
    assert not os.path.samefile(top, ROOT), "imported the checkout's top folder"
PYEOF
# The edited lines, formatted as CI checks them (ruff is pinned in .ci/tools.txt).
python -m ruff format -q benchmarks tests/test_layout_cpu.py tests/test_examples_cpu.py \
  .ci/check_dist.py setup.py docs/conf.py
git add -u
git add tests/test_layout_cpu.py

# Paths to the old place this script does not know (a configuration merged later):
# printed for a look.  The wheel's paths in .ci/check_dist.py (a wheel has no src/)
# and hotpath_instructions.py's fallback for old revisions are right as they are.
left=$(git grep -n -E '(^|[^/A-Za-z0-9_.])cupy_poolmem/' -- . ':!src' ':!CHANGELOG.md' \
  ':!tests' ':!docs/*.rst' ':!README.md' ':!CONTRIBUTING.md' ':!tools/move_to_src.sh' \
  ':!benchmarks/results' || true)
if [ -n "$left" ]; then
  echo "move_to_src: references to a top-level cupy_poolmem/ left (check any but the wheel's"
  echo "paths in .ci/check_dist.py and the old-revision fallback):"
  echo "$left" | sed 's/^/  /'
fi
echo "move_to_src: done; review 'git status' and 'git diff --cached -M', then commit"
