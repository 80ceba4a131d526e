"""Where did the memory go?  An allocation log with tags and call sites, summarised and plotted.

Shows :func:`cupy_poolmem.start_log` (one CSV line per allocation and free, with call
sites because ``track=True``), :func:`cupy_poolmem.tag` (nested labels),
:func:`cupy_poolmem.track` and :meth:`Pool.outstanding <cupy_poolmem.Pool.outstanding>`
(what is alive now, and which line allocated it) and :func:`cupy_poolmem.statistics`,
around a small "model" workload; then :mod:`cupy_poolmem.report` prints a summary of
the log and draws memory over time, stacked by tag, to a PNG.

    python examples/allocation_log.py [usage.png]

The log is written next to the PNG (``usage.csv`` for ``usage.png``); read it again
later, on any machine, with ``python -m cupy_poolmem report usage.csv --plot usage.png``.

Needs: an NVIDIA GPU, ``pip install -e ".[cu13]"`` and matplotlib for the plot.
"""

from __future__ import annotations

import os
import sys


def layer(cupy, cpm, x, w, name: str):
    """One "layer": a matmul, a nonlinearity and a few temporaries, tagged with ``name``."""
    with cpm.tag(name):  # nested in "step": "step/layer0", ...
        h = x @ w
        h = cupy.maximum(h, 0) + 0.01 * h  # temporaries, freed as they go
        with cpm.tag("norm"):
            h = (h - h.mean(axis=1, keepdims=True)) / (h.std(axis=1, keepdims=True) + 1e-5)
        return h


def model_step(cupy, cpm, rng, weights):
    """One training-like step, tagged "step": returns the output and the loss."""
    with cpm.tag("step"):
        x = rng.standard_normal((2048, 1024), dtype=cupy.float32)
        for k, w in enumerate(weights):
            x = layer(cupy, cpm, x, w, f"layer{k}")
        with cpm.tag("loss"):
            loss = float((x * x).mean())
    return x, loss


def main() -> int:
    png = sys.argv[1] if len(sys.argv) > 1 else "usage.png"
    try:
        import cupy

        import cupy_poolmem
        from cupy_poolmem import report
    except ImportError as exc:
        print(f"this example needs CuPy and cupy_poolmem: {exc}", file=sys.stderr)
        return 1
    if cupy_poolmem.device_count() == 0:
        print(
            "this example needs an NVIDIA GPU and its driver, and this machine has none "
            "(cupy_poolmem.device_count() == 0); `python -m cupy_poolmem report LOG.csv` "
            "reads existing logs without one",
            file=sys.stderr,
        )
        return 1

    log = os.path.splitext(png)[0] + ".csv"
    alloc = cupy_poolmem.set_allocator()
    rng = cupy.random.default_rng(0)
    # One unlogged step first: kernel compilation and library start-up would otherwise
    # fill most of the plot's time axis.
    model_step(cupy, cupy_poolmem, rng, [rng.standard_normal((1024, 1024), dtype=cupy.float32)])

    path = cupy_poolmem.start_log(log, track=True)  # track=True: call sites too
    print(f"logging allocations to {path}")
    with cupy_poolmem.statistics() as st:
        with cupy_poolmem.tag("weights"):
            weights = [
                rng.standard_normal((1024, 1024), dtype=cupy.float32) * 0.03 for _ in range(4)
            ]
        for step in range(5):
            x, loss = model_step(cupy, cupy_poolmem, rng, weights)
            if step == 2:
                with cupy_poolmem.tag("cache"):
                    kept = x.copy()  # still alive at the end: a "leak"
        cupy.cuda.get_current_stream().synchronize()
    print(f"\nstatistics() of the workload:\n{st}\nlast loss {loss:.4f}")

    print("\nlargest live allocations now (tracking is on while the log is):")
    for a in alloc.pool().outstanding(limit=3):
        print(" ", a)

    del x
    cupy_poolmem.stop_log()
    summary = report.summarize(path)
    print("\n" + summary.format(top=5))
    try:
        out = report.plot(path, png, title="examples/allocation_log.py")
    except ImportError as exc:
        print(f"\ncannot draw {png}: {exc}", file=sys.stderr)
        return 1
    print(f"\nplot written to {out}; log in {path}")
    del kept, weights
    return 0


if __name__ == "__main__":
    sys.exit(main())
