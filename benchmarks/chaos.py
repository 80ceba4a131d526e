"""Runs ``cupy_poolmem.benchmarks.chaos`` (the benchmark ships with the package).

``python benchmarks/chaos.py [--seed N] [--rounds N] [--time-cap S]`` from a source
checkout; the same as ``python -m cupy_poolmem bench chaos``.
"""

import os
import runpy
import sys

if __name__ == "__main__":
    sys.path.insert(
        0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    )
    runpy.run_module("cupy_poolmem.benchmarks.chaos", run_name="__main__", alter_sys=True)
