"""Build the optional Cython hot path (``cupy_poolmem._hotpath``).

The extension only needs CUDA's ``cuda.h`` at build time (calls go through
cuda.bindings' ``cydriver``, which loads libcuda at run time).  When no header
or compiler is found, the package installs without it and falls back to the
pure-Python hot path in ``cupy_poolmem/_hotpath_py.py``.
"""

import glob
import os
import sys
import sysconfig

from setuptools import setup
from setuptools.command.build_ext import build_ext


def _cuda_include_dirs():
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "include"))
    candidates += sorted(glob.glob("/usr/local/cuda*/include"), reverse=True)
    purelib = sysconfig.get_paths()["purelib"]
    candidates += glob.glob(os.path.join(purelib, "nvidia", "*", "include"))
    candidates += glob.glob(os.path.join(purelib, "nvidia", "cu*", "include"))
    return [d for d in candidates if os.path.exists(os.path.join(d, "cuda.h"))][:1]


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as exc:  # pragma: no cover - depends on the build machine
            print(f"cupy_poolmem: skipping the Cython hot path ({exc}); "
                  "the pure-Python hot path will be used", file=sys.stderr)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # pragma: no cover
            print(f"cupy_poolmem: skipping {ext.name} ({exc})", file=sys.stderr)


def _extensions():
    if os.environ.get("CUPY_POOLMEM_NO_EXTENSION"):
        return []
    includes = _cuda_include_dirs()
    try:
        from Cython.Build import cythonize
    except ImportError:
        print("cupy_poolmem: Cython missing; pure-Python hot path only", file=sys.stderr)
        return []
    if not includes:
        print("cupy_poolmem: cuda.h not found (set CUDA_HOME); pure-Python hot path only",
              file=sys.stderr)
        return []
    from setuptools import Extension
    ext = Extension("cupy_poolmem._hotpath", ["cupy_poolmem/_hotpath.pyx"],
                    include_dirs=includes)
    return cythonize([ext], compiler_directives={"language_level": "3"}, quiet=True)


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
