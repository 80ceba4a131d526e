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
