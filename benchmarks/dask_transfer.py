"""Runs ``cupy_poolmem.benchmarks.dask_transfer`` (the benchmark ships with the package).

``python benchmarks/dask_transfer.py [--quick]`` from a source checkout; the same as
``python -m cupy_poolmem.benchmarks.dask_transfer``.  ``python -m cupy_poolmem bench`` runs them all.
"""

import os
import runpy
import sys

if __name__ == "__main__":
    sys.path.insert(
        0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    )
    runpy.run_module("cupy_poolmem.benchmarks.dask_transfer", run_name="__main__", alter_sys=True)
