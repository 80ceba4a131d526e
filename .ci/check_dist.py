"""Check what the sdist and the wheel carry: ``python .ci/check_dist.py SDIST WHEEL``.

``--manylinux WHEEL`` checks only that a (repaired) wheel has a manylinux tag.
"""

from __future__ import annotations

import os
import struct
import sys
import tarfile
import zipfile

# A stripped compiled module is about 0.1 MB (the arena) and 0.45 MB (the hot path) on
# x86_64; with debug information it was 2.95 MB in all.
MAX_SO_BYTES = 1 << 20


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
        "src/cupy_poolmem/_hotpath.pyx",
        "src/cupy_poolmem/_recorder.pyx",
        "src/cupy_poolmem/_recorder.pxd",
        "src/cupy_poolmem/_log_batch.pyx",
        "src/cupy_poolmem/_log_batch.pxd",
        "src/cupy_poolmem/py.typed",
        "src/cupy_poolmem/benchmarks/alloc.py",
        "tests/conftest.py",
        "tests/fakes/observer.py",
        "tests/support/mp_workers.py",
        "docs/conf.py",
        "docs/index.rst",
        "docs/_static/cupy_poolmem.css",
        "examples/one_line_allocator.py",
        "benchmarks/alloc.py",
        "tools/render_figures.py",
    }
    missing = sorted(need - names)
    if missing:
        fail(f"{os.path.basename(path)} lacks {missing}")
    tests_here = {
        os.path.join(d, n) for d, _, ns in os.walk("tests") for n in ns if n.endswith(".py")
    }
    if tests_here - names:
        fail(f"{os.path.basename(path)} lacks {sorted(tests_here - names)}")
    junk = sorted(n for n in names if n.endswith((".c", ".so", ".pyc")))
    if junk:
        fail(f"{os.path.basename(path)} carries build outputs: {junk}")
    print(f"sdist ok: {len(names)} files, tests and their helpers included, no generated C")


def elf_section_names(data: bytes) -> list[str]:
    """The section names of a 64- or 32-bit little- or big-endian ELF file."""
    if data[:4] != b"\x7fELF":
        raise ValueError("not an ELF file")
    is64 = data[4] == 2
    end = "<" if data[5] == 1 else ">"
    if is64:
        (shoff,) = struct.unpack_from(end + "Q", data, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from(end + "HHH", data, 0x3A)
    else:
        (shoff,) = struct.unpack_from(end + "I", data, 0x20)
        shentsize, shnum, shstrndx = struct.unpack_from(end + "HHH", data, 0x2E)

    def section(i: int) -> tuple[int, int, int]:
        base = shoff + i * shentsize
        if is64:
            name, _type, _flags, _addr, offset, size = struct.unpack_from(
                end + "IIQQQQ", data, base
            )
        else:
            name, _type, _flags, _addr, offset, size = struct.unpack_from(
                end + "IIIIII", data, base
            )
        return name, offset, size

    _, str_off, str_size = section(shstrndx)
    strtab = data[str_off : str_off + str_size]
    names = []
    for i in range(shnum):
        name_off = section(i)[0]
        names.append(strtab[name_off : strtab.index(b"\0", name_off)].decode())
    return names


def check_compiled(name: str, data: bytes) -> None:
    """A shipped extension module carries no debug information and stays small."""
    sections = elf_section_names(data)
    debug = [s for s in sections if s.startswith((".debug", ".zdebug")) or s == ".symtab"]
    if debug:
        fail(f"{name} is not stripped: it has {debug} (setup.py's -g0 / --strip-all)")
    if len(data) > MAX_SO_BYTES:
        fail(f"{name} is {len(data)} bytes, over {MAX_SO_BYTES}: debug information?")


def check_wheel(path: str) -> None:
    with zipfile.ZipFile(path) as zf:
        names = set(zf.namelist())
        compiled = {n: zf.read(n) for n in names if n.endswith(".so")}
    for so_name, data in sorted(compiled.items()):
        check_compiled(so_name, data)
    if any(n.endswith(".c") for n in names):
        fail(f"{os.path.basename(path)} carries generated C: "
             f"{[n for n in names if n.endswith('.c')]}")  # fmt: skip
    need = [
        "cupy_poolmem/py.typed",
        "cupy_poolmem/benchmarks/__init__.py",
        "cupy_poolmem/_sharing/__init__.py",
        "cupy_poolmem/_dask_transfer/__init__.py",
        "cupy_poolmem/report/__init__.py",
    ]
    missing = [n for n in need if n not in names]
    if missing:
        fail(f"{os.path.basename(path)} lacks {missing}")
    # The compiled hot path loads only with the modules it cimports (else the twin runs).
    for mod in ("_hotpath", "_recorder", "_log_batch"):
        if not any(n.startswith(f"cupy_poolmem/{mod}.") and n.endswith(".so") for n in names):
            what = "hot path" if mod == "_hotpath" else mod
            fail(f"{os.path.basename(path)} has no compiled {what}")
    if not any(n.endswith(".dist-info/licenses/LICENSE") for n in names):
        fail(f"{os.path.basename(path)} has no LICENSE in its metadata")
    if any(n.startswith("tests/") for n in names):
        fail(f"{os.path.basename(path)} installs a top-level 'tests' package")
    sizes = ", ".join(f"{os.path.basename(n)} {len(d)} B" for n, d in sorted(compiled.items()))
    print(
        f"wheel ok: {os.path.basename(path)}, {len(names)} files, no generated C, stripped {sizes}"
    )


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
