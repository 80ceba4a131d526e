"""Runs ``cupy_poolmem.benchmarks.dask_workload`` (the benchmark ships with the package).

``python benchmarks/dask_workload.py [--quick]`` from a source checkout; the same as
``python -m cupy_poolmem.benchmarks.dask_workload``.  ``python -m cupy_poolmem bench`` runs them all.
"""

import os
import runpy
import sys

if __name__ == "__main__":
    sys.path.insert(
        0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    )
    runpy.run_module("cupy_poolmem.benchmarks.dask_workload", run_name="__main__", alter_sys=True)
