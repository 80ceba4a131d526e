"""The benchmarks behind ``python -m cupy_poolmem bench``, shipped with the package.

Each module prints one table: peers measured in the same process and run, ratios to a
named baseline, the device name, and the versions of CuPy, cuda.core and the peers.
They need a GPU; ``bench`` runs each in its own process (they spawn workers)::

    python -m cupy_poolmem bench                 # alloc, pinned, churn, ipc
    python -m cupy_poolmem bench alloc --quick   # one of them, shorter
    python -m cupy_poolmem bench dask            # needs dask, distributed, dask-cuda
    python -m cupy_poolmem bench transfer        # the same, and two GPUs
    python -m cupy_poolmem bench dask-cuda       # dask-cuda's own script; also transfer
    python -m cupy_poolmem bench dask-timeline   # where each transpose_sum run's time went
    python -m cupy_poolmem bench chaos --rounds 300   # sharing under chaos: one line

or directly ``python -m cupy_poolmem.benchmarks.alloc [--quick]``.  In a source
checkout, ``benchmarks/*.py`` are thin wrappers that run these modules.
"""

from __future__ import annotations

#: ``bench`` name -> (module under ``cupy_poolmem.benchmarks``, what it measures).
BENCHMARKS: dict[str, tuple[str, str]] = {
    "alloc": ("alloc", "cupy.empty + free and a temporaries chain vs CuPy, RMM pools"),
    "pinned": ("pinned_bandwidth", "pinned host copies vs cudaHostAlloc, cuda.core"),
    "churn": ("churn", "a many-sizes trace: reserved peak vs CuPy, RMM, torch"),
    "ipc": ("ipc", "sharing through multiprocessing vs torch and CuPy pickling"),
    "dask": ("dask_workload", "Dask graphs: the plugin vs dask-cuda's allocators"),
    "transfer": ("dask_transfer", "a CuPy chunk between two GPU workers: TCP vs pool IPC"),
    "dask-cuda": (
        "dask_cuda_local",
        "dask-cuda's local_cupy script: TCP + cupy_poolmem by env vs TCP+RMM vs UCXX",
    ),
    "dask-timeline": (
        "dask_timeline",
        "transpose_sum run by run: task stream, event-loop lag, GC, transfer steps",
    ),
    "chaos": ("chaos", "seeded rounds of killed processes and hostile messages: data, leaks"),
}

#: What ``python -m cupy_poolmem bench`` runs when given no name.
DEFAULT = ("alloc", "pinned", "churn", "ipc")
