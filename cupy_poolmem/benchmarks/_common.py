"""Helpers shared by the benchmarks: timing, version header, table printing."""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable

import cupy_poolmem

from ._paired import timed_burst


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child Python that must import this very cupy_poolmem.

    Puts the directory holding the package first on ``PYTHONPATH``, so a benchmark run
    from a source checkout measures that checkout, not another installed copy.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(cupy_poolmem.__file__)))
    path = os.environ.get("PYTHONPATH", "")
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = root + (os.pathsep + path if path else "")
    return env


def require_gpu(name: str) -> None:
    """Exit with one line (status 2) when there is no GPU to benchmark on."""
    if cupy_poolmem.device_count() == 0:
        print(
            f"{name}: needs a CUDA GPU, and CUDA sees none here (no driver, no device, or "
            "CUDA_VISIBLE_DEVICES empty)",
            file=sys.stderr,
        )
        raise SystemExit(2)


def header(title: str) -> str:
    import cupy

    lines = [f"== {title} =="]
    try:
        import cuda.core

        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        lines.append(
            f"device: {name} | cupy {cupy.__version__} | cuda.core {cuda.core.__version__}"
            f" | cupy_poolmem {cupy_poolmem.__version__} "
            f"(hot path: {cupy_poolmem.hotpath_implementation()})"
        )
    except Exception as exc:  # pragma: no cover
        lines.append(f"(no device information: {exc})")
    extra = []
    for mod in ("rmm", "torch"):
        try:
            extra.append(f"{mod} {__import__(mod).__version__}")
        except Exception:
            extra.append(f"{mod} not installed")
    lines.append("peers: " + ", ".join(extra))
    return "\n".join(lines)


def median_time(fn: Callable[[], object], n: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean seconds per call of ``fn`` over ``n`` calls."""
    burst = timed_burst(fn)
    burst(min(n, 500))  # warm-up
    return statistics.median(burst(n) for _ in range(repeats))


def table(columns: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)), *(len(str(r[i])) for r in rows)) for i, c in enumerate(columns)]
    out = [
        " | ".join(str(c).ljust(w) for c, w in zip(columns, widths)),
        "-+-".join("-" * w for w in widths),
    ]
    out += [" | ".join(str(v).ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(out)
