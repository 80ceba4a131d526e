"""Command line: ``python -m cupy_poolmem [doctor|demo|bench|report] ...``.

- ``doctor`` (default): versions, driver, GPUs, NUMA placement, pool features, self-check.
- ``demo``: a short tour of the one-line allocators with statistics.
- ``bench``: the allocation and sharing benchmarks (tables with ratios to peers).
- ``report LOG.csv ... [--plot usage.png]``: summarise allocation logs.
"""

from __future__ import annotations

import argparse
import os
import sys

_BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def _demo() -> int:
    from ._doctor import doctor

    rc = doctor(check=False)
    if rc:
        return rc
    import cupy
    import cupyx
    import numpy as np

    import cupy_poolmem as cpm

    alloc = cpm.set_allocator()
    cpm.set_pinned_memory_allocator()
    x = cupy.arange(1 << 24, dtype=cupy.float32)
    y = ((x * 2 + 1) ** 2 - x).sum()
    h = cupyx.empty_pinned((1 << 20,), dtype=np.float32)
    h[:] = 1.5
    d = cupy.asarray(h)
    print(f"\ndemo: sum={float(y):.6g}, pinned round trip ok={bool((d.get() == 1.5).all())}")
    s = alloc.pool().stats()
    print(
        f"device pool: {s.n_allocs} allocations, used {cpm.format_bytes(s.used_bytes)}, "
        f"peak {cpm.format_bytes(s.peak_used_bytes)}, reserved {cpm.format_bytes(s.reserved_bytes)}"
    )
    del x, y, d
    cupy.cuda.get_current_stream().synchronize()
    print(f"after del: used {cpm.format_bytes(alloc.pool().stats().used_bytes)}")
    return 0


def _bench(args: list[str]) -> int:
    """Run each benchmark script in its own process (they spawn workers), with progress."""
    import subprocess

    scripts = [
        n
        for n in ("alloc.py", "pinned_bandwidth.py", "ipc.py")
        if os.path.exists(os.path.join(_BENCH_DIR, n))
    ]
    if not scripts:
        print("benchmarks/ is not next to the package: run `bench` from a source checkout")
        return 2
    try:
        from tqdm import tqdm

        progress = tqdm(scripts, desc="benchmarks", unit="script", file=sys.stderr)
    except ImportError:
        progress = scripts
    rc = 0
    for i, name in enumerate(progress):
        if hasattr(progress, "set_postfix_str"):
            progress.set_postfix_str(name)
        else:
            print(f"[{i + 1}/{len(scripts)}] {name}", file=sys.stderr)
        r = subprocess.run([sys.executable, os.path.join(_BENCH_DIR, name), *args])
        rc = rc or r.returncode
    return rc


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m cupy_poolmem`` and the ``cupy-poolmem`` script."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "report":
        from . import report

        return report.main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m cupy_poolmem",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "command", nargs="?", default="doctor", choices=["doctor", "demo", "bench", "report"]
    )
    parser.add_argument("--no-check", action="store_true", help="doctor: skip the self-check")
    ns, rest = parser.parse_known_args(argv)
    if ns.command == "report":
        from . import report

        return report.main(rest)
    if rest and ns.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if ns.command == "doctor":
            from ._doctor import doctor

            return doctor(check=not ns.no_check)
        if ns.command == "demo":
            return _demo()
        return _bench(rest)
    except ImportError as exc:
        print(
            f"cupy_poolmem needs CuPy >= 14 and cuda-core >= 1.2 ({exc}); "
            "install with `pip install cupy_poolmem[cu13]`",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
