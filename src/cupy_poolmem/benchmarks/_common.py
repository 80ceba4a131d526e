"""Helpers shared by the benchmarks: timing, version header, table printing, and
saving a run's results (``--save DIR``) as JSON for ``tools/render_figures.py``."""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

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
    env: dict[str, Any] = {"title": title}
    try:
        import cuda.core

        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        lines.append(
            f"device: {name} | cupy {cupy.__version__} | cuda.core {cuda.core.__version__}"
            f" | cupy_poolmem {cupy_poolmem.__version__} "
            f"(hot path: {cupy_poolmem.hotpath_implementation()})"
        )
        env.update(
            device=name,
            n_gpus=cupy_poolmem.device_count(),
            driver=_cuda_version(cupy.cuda.runtime.driverGetVersion()),
            cupy=cupy.__version__,
            cuda_core=cuda.core.__version__,
            hotpath=cupy_poolmem.hotpath_implementation(),
        )
    except Exception as exc:  # pragma: no cover
        lines.append(f"(no device information: {exc})")
    extra = []
    for mod in ("rmm", "torch"):
        try:
            extra.append(f"{mod} {__import__(mod).__version__}")
            env[mod] = __import__(mod).__version__
        except Exception:
            extra.append(f"{mod} not installed")
    lines.append("peers: " + ", ".join(extra))
    text = "\n".join(lines)
    for rec in _RECORDING:
        rec.header(text, env)
    return text


def _cuda_version(v: int) -> str:
    """``13000`` -> ``"13.0"`` (the CUDA version a driver supports)."""
    return f"{v // 1000}.{v % 1000 // 10}"


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
    text = "\n".join(out)
    for rec in _RECORDING:
        rec.table(text, columns, rows)
    return text


# -- saving results -----------------------------------------------------------------------
#: The recorders of the runs in progress (``run`` with ``--save``): ``header`` and
#: ``table`` report to them.  Empty unless a run is being saved.
_RECORDING: list[Recorder] = []

#: Version 1 of the results file; ``tools/render_figures.py`` reads it.
RESULTS_FORMAT = 1


def device_slug(name: str) -> str:
    """A file-name part for a device name.

    Examples
    --------
    >>> device_slug("NVIDIA H200"), device_slug("NVIDIA GeForce RTX 4090 (MIG 1g.10gb)")
    ('nvidia-h200', 'nvidia-geforce-rtx-4090-mig-1g-10gb')
    """
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-device"


def _commit() -> str | None:
    """The git commit of the checkout the package was imported from (``+dirty`` when it
    has uncommitted changes), or ``None`` for an installed package."""
    where = os.path.dirname(os.path.abspath(cupy_poolmem.__file__))
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=10,
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "."],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


class Recorder:
    """What one benchmark run printed: its header's environment and every table.

    ``header`` and ``table`` report to it while it records (see :func:`recording`);
    :meth:`result` splits the printed text into the tables and the lines between them.

    Examples
    --------
    >>> rec = Recorder("demo", ["--quick"])
    >>> with recording(rec):
    ...     print("before the table")
    ...     print(table(["peer", "us"], [["a", "10"], ["b", "20"]]))
    ...     print("goal: met")
    before the table
    peer | us
    -----+---
    a    | 10
    b    | 20
    goal: met
    >>> r = rec.result()
    >>> r["tables"][0]["before"], r["tables"][0]["rows"], r["after"]
    (['before the table'], [['a', '10'], ['b', '20']], ['goal: met'])
    """

    def __init__(self, bench: str, argv: Sequence[str]) -> None:
        self.bench, self.argv = bench, list(argv)
        self.environment: dict[str, Any] = {}
        self._header = ""
        self._tables: list[tuple[str, list[str], list[list[str]]]] = []
        self.out = io.StringIO()
        self.started = datetime.datetime.now(datetime.timezone.utc)

    def header(self, text: str, env: dict[str, Any]) -> None:
        self._header = text
        self.environment = dict(env)

    def table(self, text: str, columns: list[str], rows: list[list[str]]) -> None:
        cells = [[str(v).strip() for v in r] for r in rows]
        self._tables.append((text, [str(c) for c in columns], cells))

    def result(self) -> dict[str, Any]:
        """The run as a JSON-ready dict (``RESULTS_FORMAT``)."""
        text = self.out.getvalue()
        if self._header and self._header in text:
            text = text.replace(self._header, "", 1)
        tables, pos = [], 0
        for tab_text, columns, rows in self._tables:
            at = text.find(tab_text, pos)
            if at < 0:
                continue  # built but never printed
            tables.append({"before": _lines(text[pos:at]), "columns": columns, "rows": rows})
            pos = at + len(tab_text)
        env = dict(self.environment)
        return {
            "format": RESULTS_FORMAT,
            "bench": self.bench,
            "argv": self.argv,
            "title": env.pop("title", self.bench),
            "date": self.started.strftime("%Y-%m-%d"),
            "cupy_poolmem": cupy_poolmem.__version__,
            "commit": _commit(),
            "environment": env,
            "tables": tables,
            "after": _lines(text[pos:]),
        }

    def save(self, directory: str) -> str:
        """Write :meth:`result` to ``directory/<bench>-<device slug>.json``; its path."""
        result = self.result()
        device = result["environment"].get("device", "unknown device")
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{self.bench}-{device_slug(device)}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1, ensure_ascii=False)
            f.write("\n")
        return path


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.splitlines() if line.strip()]


class _Tee(io.TextIOBase):
    def __init__(self, *targets: Any) -> None:
        self.targets = targets

    def write(self, s: str) -> int:
        for t in self.targets:
            t.write(s)
        return len(s)

    def flush(self) -> None:
        for t in self.targets:
            t.flush()


@contextlib.contextmanager
def recording(rec: Recorder) -> Iterator[Recorder]:
    """Record what the block prints, and its headers and tables, into ``rec``."""
    real = sys.stdout
    sys.stdout = _Tee(real, rec.out)
    _RECORDING.append(rec)
    try:
        yield rec
    finally:
        _RECORDING.remove(rec)
        sys.stdout = real


def split_save(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """``--save DIR`` (or ``--save=DIR``) taken out of ``argv``: ``(DIR or None, rest)``.

    Examples
    --------
    >>> split_save(["--quick", "--save", "out"])
    ('out', ['--quick'])
    >>> split_save(["--save=benchmarks/results"])
    ('benchmarks/results', [])
    >>> split_save(["--quick"])
    (None, ['--quick'])
    """
    rest, save = [], None
    it = iter(argv)
    for a in it:
        if a == "--save":
            save = next(it, None)
            if not save:
                raise SystemExit("--save needs a directory")
        elif a.startswith("--save="):
            save = a.split("=", 1)[1]
        else:
            rest.append(a)
    return save, rest


def run(main: Callable[[list[str]], object], bench: str) -> None:
    """Run a benchmark's ``main`` on ``sys.argv``; with ``--save DIR``, also save what it
    printed to ``DIR/<bench>-<device>.json`` (see ``tools/render_figures.py``)."""
    save, argv = split_save(sys.argv[1:])
    if save is None:
        status = main(argv)
    else:
        rec = Recorder(bench, argv)
        with recording(rec):
            status = main(argv)
        print(f"{bench}: results saved to {rec.save(save)}", file=sys.stderr)
    if isinstance(status, int) and status:
        sys.exit(status)
