"""Build the optional Cython hot path (``cupy_poolmem._hotpath``, its ``_arena``, ``_recorder``
and ``_log_batch``).

The extension needs only Cython and a C compiler: it takes its three driver calls from
cuda.bindings' compiled ``cydriver`` module at import time, so no CUDA header or
toolkit is needed to build it.  When it cannot be built, the package installs
without it and uses the pure-Python hot path in ``src/cupy_poolmem/_hotpath_py.py``.
"""

import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as exc:  # pragma: no cover - depends on the build machine
            print(
                f"cupy_poolmem: skipping the Cython hot path ({exc}); "
                "the pure-Python hot path will be used",
                file=sys.stderr,
            )

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # pragma: no cover
            print(f"cupy_poolmem: skipping {ext.name} ({exc})", file=sys.stderr)


# No debug information in the shipped modules (2.95 MB with it, about 0.4 MB
# without): compile without it and strip what the toolchain's own objects carry at
# link time, with the static symbol table (the dynamic one, which imports use, stays).
# GCC and Clang on Linux (manylinux, x86_64 and aarch64) take both flags.
# CUPY_POOLMEM_DEBUG_BUILD=1 keeps the debug information for a debugger.
_STRIPPED: dict[str, list[str]] = (
    {}
    if os.environ.get("CUPY_POOLMEM_DEBUG_BUILD")
    else {"extra_compile_args": ["-g0"], "extra_link_args": ["-Wl,--strip-all"]}
)


def _extensions():
    if os.environ.get("CUPY_POOLMEM_NO_EXTENSION"):
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        print("cupy_poolmem: Cython missing; pure-Python hot path only", file=sys.stderr)
        return []
    from setuptools import Extension

    # The hot path cimports the arena and the recorder (which cimports the log batch).
    exts = [
        Extension(f"cupy_poolmem.{name}", [f"src/cupy_poolmem/{name}.pyx"], **_STRIPPED)
        for name in ("_arena", "_log_batch", "_recorder", "_hotpath")
    ]
    try:
        return cythonize(exts, compiler_directives={"language_level": "3"}, quiet=True)
    except Exception as exc:  # a compile error must never break the install
        print(
            f"cupy_poolmem: Cython could not compile the hot path ({exc}); "
            "pure-Python hot path only",
            file=sys.stderr,
        )
        return []


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
