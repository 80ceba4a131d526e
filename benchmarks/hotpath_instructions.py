"""CPU instructions per ``pool.malloc(n)`` + free of the compiled hot path, under callgrind.

No GPU needed: the hot path's ``.pyx`` (this checkout's, or the one at a git revision)
is compiled once more with its four driver calls and CuPy's current-stream query
replaced by C stubs (an allocation returns the next pretend address, a free does
nothing, no stream captures, the current stream is the legacy one), then a
``PoolCore`` with a pretend CUDA pool is driven in a loop under
``valgrind --tool=callgrind``.  Two runs of different lengths are subtracted, so the
interpreter's start-up cancels and what is left is the instructions of one steady
allocation + free (a reuse-cache hit: the case ``cupy.empty(n)`` + free measures on
a GPU), the Python loop driving it included (about 300).  The last column counts one
with the reuse cache off (a stubbed driver call each way, so it is no guide to that
case's time on a GPU).  Timings are ``benchmarks/alloc.py``'s; this counts work.

``python benchmarks/hotpath_instructions.py [--rev REV ...] [--pure]``

``--rev REV`` (repeatable) measures the ``.pyx`` of a git revision too, for a
before/after table; ``--pure`` adds the pure-Python twin of this checkout.  Needs
valgrind, Cython and a C compiler.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src")
PYX = os.path.join(SRC, "cupy_poolmem", "_hotpath.pyx")
SIZES = [1 << 10, 1 << 20, 64 << 20]
N_SHORT, N_LONG = 2000, 22000

STUBS = '''
cdef extern from *:
    """
    static int hp_stub_ctxdev(int* d) { *d = 0; return 0; }
    static int hp_stub_capturing(void* s, int* st) { *st = 0; return 0; }
    static unsigned long long hp_stub_next = 0x100000;
    static int hp_stub_alloc(unsigned long long* p, size_t n, void* pool, void* s) {
        *p = hp_stub_next; hp_stub_next += 0x10000; return 0; }
    static int hp_stub_free(unsigned long long p, void* s) { return 0; }
    static intptr_t hp_stub_stream(void) { return 0; }
    """
    int hp_stub_ctxdev(int*)
    int hp_stub_capturing(void*, int*)
    int hp_stub_alloc(unsigned long long*, size_t, void*, void*)
    int hp_stub_free(unsigned long long, void*)
    intptr_t hp_stub_stream()
'''

# (pattern, replacement): the driver calls and the stream query, resolved to the stubs.
PATCHES = [
    (r'<_alloc_fn>_driver_fn\(\s*"cuMemAllocFromPoolAsync".*?\)\n', "<_alloc_fn>hp_stub_alloc\n"),
    (r'<_free_fn>_driver_fn\(\s*"cuMemFreeAsync".*?\)\n', "<_free_fn>hp_stub_free\n"),
    (r'<_ctxdev_fn>_driver_fn\(\s*"cuCtxGetDevice".*?\)\n', "<_ctxdev_fn>hp_stub_ctxdev\n"),
    (
        r'<_capturing_fn>_driver_fn\(\s*"cuStreamIsCapturing".*?\)\n',
        "<_capturing_fn>hp_stub_capturing\n",
    ),
    (
        r"<_stream_ptr_fn>PyCapsule_GetPointer\(\s*_cupy_stream.*?\)\n",
        "<_stream_ptr_fn>hp_stub_stream\n",
    ),
]

DRIVE = """
import sys
sys.path.insert(0, {where!r})
{setup}
n, size, cache = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
p.cache_limit = cache
p.cache_max_block = min(cache, 64 << 20)


def loop(malloc, size, n):
    for _ in range(n):
        m = malloc(size)
        m = None
    return m


loop(p.malloc, size, 50)
loop(p.malloc, size, n)
"""

SETUP_COMPILED = """
import _hp_cpu as hp


class S:
    ptr = 0
    device_id = 0


hp._get_current_stream = lambda: S  # a miss asks CuPy for the stream object


class P(hp.PoolCore):
    pass


p = P()
p._attach(0xABC, 0, hp.KIND_DEVICE)
"""

SETUP_PURE = """
from types import SimpleNamespace
from cupy_poolmem import _hotpath_py as hp

S = SimpleNamespace(ptr=0, device_id=0)
nxt = [0x100000]


def alloc(size, pool, sptr):
    nxt[0] += 0x10000
    return 0, nxt[0]


hp.use_driver(
    hp.Driver(
        alloc=alloc,
        free=lambda ptr, sptr: (0,),
        ctx_device=lambda: (0, 0),
        is_capturing=lambda s: (0, 0),
        current_stream=lambda: S,
    )
)


class P(hp.PoolCore):
    pass


p = P()
p._attach(0xABC, 0, hp.KIND_DEVICE)  # a pretend CUDA pool (0: every block from a backend)
"""


def patched(src: str) -> str:
    for pat, rep in PATCHES:
        src, n = re.subn(pat, rep, src, count=1, flags=re.S)
        if n != 1:
            raise SystemExit(f"hotpath_instructions: no match for {pat!r} in the .pyx")
    head, sep, tail = src.partition("\nfrom libc.string cimport strcmp\n")
    return head + sep + STUBS + tail


def build(src: str, where: str) -> None:
    with open(os.path.join(where, "_hp_cpu.pyx"), "w") as f:
        f.write(patched(src))
    setup = textwrap.dedent(
        """
        from setuptools import Extension, setup
        from Cython.Build import cythonize
        setup(script_args=["-q", "build_ext", "--inplace"],
              ext_modules=cythonize([Extension("_hp_cpu", ["_hp_cpu.pyx"])],
                                    compiler_directives={"language_level": "3"}, quiet=True))
        """
    )
    r = subprocess.run([sys.executable, "-c", setup], cwd=where, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"hotpath_instructions: the build failed:\n{r.stderr[-3000:]}")


def instructions(script: str, n: int, size: int, cache: int) -> int:
    with tempfile.TemporaryDirectory() as out:
        f = os.path.join(out, "cg.out")
        subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={f}"]
            + [sys.executable, script, str(n), str(size), str(cache)],
            check=True,
            capture_output=True,
            env=dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1"),  # no spinning
        )
        with open(f) as fh:
            for line in fh:
                if line.startswith("summary:") or line.startswith("totals:"):
                    return int(line.split()[1])
    raise SystemExit("hotpath_instructions: callgrind wrote no totals")


def per_op(script: str, size: int, cache: int) -> float:
    short = instructions(script, N_SHORT, size, cache)
    long = instructions(script, N_LONG, size, cache)
    return (long - short) / (N_LONG - N_SHORT)


def measure(label: str, script: str) -> list[str]:
    row = [label]
    for size in SIZES:
        row.append(f"{per_op(script, size, 1 << 30):8.0f}")
    row.append(f"{per_op(script, 1 << 20, 0):8.0f}")
    return row


def main(argv: list[str]) -> None:
    if shutil.which("valgrind") is None:
        raise SystemExit("hotpath_instructions: needs valgrind")
    revs = [argv[i + 1] for i, a in enumerate(argv) if a == "--rev"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sources = [(f"compiled @ {r}", _at_rev(r)) for r in revs]
        sources.append(("compiled (this checkout)", open(PYX).read()))
        for i, (label, src) in enumerate(sources):
            where = os.path.join(tmp, f"b{i}")
            os.makedirs(where)
            build(src, where)
            script = os.path.join(where, "drive.py")
            with open(script, "w") as f:
                f.write(DRIVE.format(where=where, setup=SETUP_COMPILED))
            rows.append(measure(label, script))
        if "--pure" in argv:
            script = os.path.join(tmp, "drive_pure.py")
            with open(script, "w") as f:
                f.write(DRIVE.format(where=SRC, setup=SETUP_PURE))
            rows.append(measure("pure-Python twin (this checkout)", script))
    head = ["hot path", "1 KiB hit", "1 MiB hit", "64 MiB hit", "1 MiB, cache off"]
    print("CPU instructions per malloc + free (callgrind, loop included)")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    for r in [head] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def _at_rev(rev: str) -> str:
    for path in ("src/cupy_poolmem/_hotpath.pyx", "cupy_poolmem/_hotpath.pyx"):
        r = subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True
        )
        if r.returncode == 0:
            return r.stdout
    raise SystemExit(f"{rev}: no _hotpath.pyx ({r.stderr.strip()})")


if __name__ == "__main__":
    main(sys.argv[1:])
