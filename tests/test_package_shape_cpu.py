"""The package's shape, measured from its source by ``tools/layout.py``: no import circle
(imports inside functions count), no file over 800 lines, few package imports inside
functions and each saying why, few patches of private names in the tests."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "layout.py")

pytestmark = pytest.mark.skipif(
    not os.path.exists(SCRIPT), reason="needs the source checkout's tools/layout.py"
)


def _layout() -> Any:
    spec = importlib.util.spec_from_file_location("layout_for_tests", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def figures() -> dict[str, Any]:
    return _layout().measure(ROOT)


def test_no_import_circle(figures):
    assert figures["circles"] == []


def test_no_package_file_over_800_lines(figures):
    assert figures["over_limit"] == {}


def test_few_package_imports_inside_functions_each_saying_why(figures):
    late = figures["late_imports"]
    assert len(late) <= 8, "\n".join(late)
    assert [x for x in late if x.endswith("UNCOMMENTED")] == []


def test_tests_patch_few_private_names(figures):
    assert figures["monkeypatch_setattr_private"] < 20, "\n".join(figures["private_patches"])


def _write(path: Any, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_measure_sees_circles_long_files_late_imports_and_private_patches(tmp_path):
    pkg = tmp_path / "src" / "cupy_poolmem"
    _write(pkg / "__init__.py", "")
    _write(pkg / "a.py", "from . import b\n")
    _write(pkg / "b.py", "def f():\n    from . import a\n    return a\n")
    _write(
        pkg / "c.py",
        "def g():\n    # loaded late: the base install has no CuPy\n    from . import a\n",
    )
    _write(pkg / "long.py", "x = 1\n" * 801)
    _write(
        pkg / "d.py",
        "import importlib\n\ndef h():\n    return importlib.import_module('.a', 'cupy_poolmem')\n",
    )
    _write(pkg / "hot.pyx", "cimport cython\nfrom cupy_poolmem.long import x\nimport numpy\n")
    _write(
        pkg / "e.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import long\n",
    )
    _write(
        tmp_path / "tests" / "sub" / "test_x.py",
        "def test(monkeypatch, mp):\n    monkeypatch.setattr(m, '_x', 1)\n"
        "    mp.setattr('cupy_poolmem.a._y', 2)\n    monkeypatch.setattr(m, 'public', 3)\n",
    )
    r = _layout().measure(str(tmp_path))
    assert r["circles"] == [["cupy_poolmem.a", "cupy_poolmem.b"]]
    assert r["over_limit"] == {"cupy_poolmem.long": 801}
    late = sorted(r["late_imports"])
    assert len(late) == 3, late
    assert late[0].startswith("cupy_poolmem.b -> cupy_poolmem.a") and late[0].endswith(
        "UNCOMMENTED"
    )
    assert late[1].startswith("cupy_poolmem.c -> cupy_poolmem.a") and "UNCOMMENTED" not in late[1]
    assert late[2].startswith("cupy_poolmem.d -> cupy_poolmem.a")
    assert r["monkeypatch_setattr"] == 3 and r["monkeypatch_setattr_private"] == 2
    assert r["floor_of"]["cupy_poolmem.e"] == 0  # TYPE_CHECKING imports never run
    assert r["floor_of"]["cupy_poolmem.hot.pyx"] == 1  # a .pyx's absolute import is an edge
