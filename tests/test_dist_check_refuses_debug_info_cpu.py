"""CPU tests of the release checks: ``.ci/check_dist.py`` refuses an extension module
that carries debug information, and passes one built as ``setup.py`` builds them."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK_DIST = os.path.join(ROOT, ".ci", "check_dist.py")

pytestmark = pytest.mark.skipif(
    not os.path.exists(CHECK_DIST), reason="needs the source checkout's .ci/ (not in the sdist)"
)


@pytest.fixture(scope="module")
def check_dist():
    spec = importlib.util.spec_from_file_location("check_dist", CHECK_DIST)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _shared_object(tmp_path, name: str, flags: list[str]) -> bytes:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler (cc)")
    src = tmp_path / "m.c"
    src.write_text("int cupy_poolmem_probe(int x) { return x * 3 + 1; }\n")
    out = tmp_path / name
    subprocess.run([cc, "-shared", "-fPIC", *flags, str(src), "-o", str(out)], check=True)
    return out.read_bytes()


def test_debug_build_is_refused(tmp_path, check_dist):
    data = _shared_object(tmp_path, "debug.so", ["-g"])
    assert any(s.startswith(".debug") for s in check_dist.elf_section_names(data))
    with pytest.raises(SystemExit):
        check_dist.check_compiled("debug.so", data)


def test_unstripped_symbol_table_is_refused(tmp_path, check_dist):
    data = _shared_object(tmp_path, "symtab.so", ["-g0"])
    assert ".symtab" in check_dist.elf_section_names(data)
    with pytest.raises(SystemExit):
        check_dist.check_compiled("symtab.so", data)


def test_setup_py_flags_pass(tmp_path, check_dist):
    # The flags setup.py gives every extension module.
    data = _shared_object(tmp_path, "stripped.so", ["-g0", "-Wl,--strip-all"])
    names = check_dist.elf_section_names(data)
    assert ".text" in names and ".dynsym" in names
    check_dist.check_compiled("stripped.so", data)  # no SystemExit


def test_oversized_module_is_refused(tmp_path, check_dist):
    data = _shared_object(tmp_path, "big.so", ["-g0", "-Wl,--strip-all"])
    padded = data + b"\0" * (check_dist.MAX_SO_BYTES + 1 - len(data))
    with pytest.raises(SystemExit):
        check_dist.check_compiled("big.so", padded)


def test_not_elf_is_an_error(check_dist):
    with pytest.raises(ValueError, match="not an ELF"):
        check_dist.elf_section_names(b"MZ\x90\x00" + b"\0" * 60)


def _wheel(tmp_path, so: bytes, modules: list[str]) -> str:
    """A wheel holding the files the check asks for and these compiled ``modules``."""
    import zipfile

    path = tmp_path / "cupy_poolmem-0.0-cp311-cp311-linux_x86_64.whl"
    files = [
        "cupy_poolmem/py.typed",
        "cupy_poolmem/benchmarks/__init__.py",
        "cupy_poolmem/_sharing/__init__.py",
        "cupy_poolmem/_dask_transfer/__init__.py",
        "cupy_poolmem/report/__init__.py",
        "cupy_poolmem-0.0.dist-info/licenses/LICENSE",
    ]
    with zipfile.ZipFile(path, "w") as zf:
        for name in files:
            zf.writestr(name, "")
        for m in modules:
            zf.writestr(f"cupy_poolmem/{m}.cpython-311-x86_64-linux-gnu.so", so)
    return str(path)


def test_wheel_without_the_hot_paths_compiled_recorder_is_refused(tmp_path, check_dist):
    """The compiled hot path loads only with the compiled recorder and log batches it
    cimports; a wheel without them would run the pure-Python twin."""
    so = _shared_object(tmp_path, "stripped.so", ["-g0", "-Wl,--strip-all"])
    check_dist.check_wheel(_wheel(tmp_path, so, ["_arena", "_log_batch", "_recorder", "_hotpath"]))
    for missing in ("_recorder", "_log_batch"):
        kept = [m for m in ("_arena", "_log_batch", "_recorder", "_hotpath") if m != missing]
        with pytest.raises(SystemExit):
            check_dist.check_wheel(_wheel(tmp_path, so, kept))
