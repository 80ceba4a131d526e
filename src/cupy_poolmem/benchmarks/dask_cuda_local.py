"""dask-cuda's own benchmark script, with cupy_poolmem switched on by the environment alone.

Runs ``dask_cuda.benchmarks.local_cupy`` once per peer, each in its own process, and
tabulates its wall clocks and bandwidth.  The peers: docs/cli.rst, "bench dask-cuda".
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from ._common import child_env, header, table

__all__ = ["PEERS", "parse_local_cupy", "parse_time", "goals", "main", "warm_kernel_cache"]

#: The environment that switches cupy_poolmem on, and nothing else.
CONFIGURED_ENV = {
    "DASK_DISTRIBUTED__NANNY__PRELOAD": '["cupy_poolmem_dask"]',
    "DASK_DISTRIBUTED__WORKER__PRELOAD": '["cupy_poolmem_dask"]',
}
#: name -> (extra arguments of the script, environment added, what it is).
PEERS: dict[str, tuple[list[str], dict[str, str], str]] = {
    "tcp+cupy_poolmem": (["-p", "tcp", "--disable-rmm"], CONFIGURED_ENV, "env-configured"),
    "tcp+rmm": (["-p", "tcp"], {}, "dask-cuda defaults (RMM pool)"),
    "ucxx": (["-p", "ucxx"], {}, "dask-cuda defaults over UCXX"),
}
BASELINE = "tcp+rmm"

_UNITS = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9}  # divisors
_LONG = re.compile(r"^(?:(\d+)d)?\s*(?:(\d+)hr)?\s*(?:(\d+)m)?\s*(?:(\d+)s)?$")


def parse_time(text: str) -> float:
    """Seconds from ``dask.utils.format_time``'s output (``"58.12 ms"``, ``"20m 34s"``).

    Examples
    --------
    >>> parse_time("58.12 ms"), parse_time("1.49 s"), parse_time("20m 34s")
    (0.05812, 1.49, 1234.0)
    """
    t = text.strip()
    parts = t.split()
    if len(parts) == 2 and parts[1] in _UNITS:
        return float(parts[0]) / _UNITS[parts[1]]
    m = _LONG.match(t)
    if m and any(m.groups()):
        d, h, mi, s = (int(g) if g else 0 for g in m.groups())
        return float(((d * 24 + h) * 60 + mi) * 60 + s)
    raise ValueError(f"not a dask format_time value: {text!r}")


def _rate(text: str) -> float:
    """Bytes per second from ``"37.25 GiB/s"``."""
    from dask.utils import parse_bytes

    t = text.strip()
    if not t.endswith("/s"):
        raise ValueError(f"not a rate: {text!r}")
    return float(parse_bytes(t[:-2].strip()))


def _key_value(line: str) -> tuple[str, str] | None:
    if " | " not in line:
        return None
    k, v = line.split(" | ", 1)
    return k.strip(), v.strip()


def parse_local_cupy(text: str) -> dict[str, Any]:
    """What ``dask_cuda.benchmarks.local_cupy`` printed: runs, bandwidth, pairs.

    Returns ``{"wall_clocks": [s...], "throughputs": [B/s...], "bandwidth": B/s,
    "bandwidth_std": B/s, "wall_clock_mean": s, "pairs": {"(0,1)": {"q25", "q50",
    "q75"}}, "protocol": str, "workers": int}``.  Lines of other output (logs,
    warnings) are ignored.

    Raises
    ------
    ValueError
        No table of wall clocks was found (the script failed before printing it).

    Examples
    --------
    >>> out = parse_local_cupy('''Protocol                  | tcp
    ... Wall clock                | Throughput
    ... ----
    ... 944.00 ms                 | 3.16 GiB/s
    ... 61.20 ms                  | 48.70 GiB/s
    ... ====
    ... Bandwidth                 | 37.23 GiB/s +/- 673.93 MiB/s''')
    >>> [round(s, 4) for s in out["wall_clocks"]], round(out["bandwidth"] / 2**30, 2)
    ([0.944, 0.0612], 37.23)
    """
    out: dict[str, Any] = {
        "wall_clocks": [],
        "throughputs": [],
        "bandwidth": None,
        "bandwidth_std": None,
        "wall_clock_mean": None,
        "pairs": {},
        "protocol": None,
        "workers": None,
    }
    in_runs = False
    for raw in text.splitlines():
        line = raw.rstrip()
        if in_runs:
            if line.startswith("="):
                in_runs = False
                continue
            if line.startswith("-") or not line.strip():
                continue
            kv = _key_value(line)
            if kv is None:
                continue
            try:
                out["wall_clocks"].append(parse_time(kv[0]))
                out["throughputs"].append(_rate(kv[1]))
            except ValueError:
                continue
            continue
        kv = _key_value(line)
        if kv is None:
            continue
        k, v = kv
        if k == "Wall clock" and v == "Throughput":
            in_runs = True
        elif k == "Wall clock" and "+/-" in v:
            out["wall_clock_mean"] = parse_time(v.split("+/-")[0])
        elif k == "Bandwidth" and "+/-" in v:
            a, b = v.split("+/-")
            out["bandwidth"], out["bandwidth_std"] = _rate(a), _rate(b)
        elif k == "Protocol":
            out["protocol"] = v
        elif k == "Number of workers":
            out["workers"] = int(v)
        elif re.fullmatch(r"\(\d+,\d+\)", k):
            rates = re.findall(r"([0-9.]+ [KMGTP]?i?B/s)", v)
            if len(rates) >= 3:
                q = [_rate(r) for r in rates[:3]]
                out["pairs"][k] = {"q25": q[0], "q50": q[1], "q75": q[2]}
    if not out["wall_clocks"]:
        raise ValueError("no wall clock table in the output of dask_cuda.benchmarks.local_cupy")
    return out


def steady(runs: Sequence[float]) -> float:
    """The median of the runs after the first (the only run when there is one)."""
    return statistics.median(runs[1:]) if len(runs) > 1 else runs[0]


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _fmt_rate(r: float | None) -> str:
    return "-" if r is None else f"{r / 2**30:.2f} GiB/s"


def goals(results: dict[str, dict[str, Any]], ours: str = "tcp+cupy_poolmem") -> list[str]:
    """The issue's goal lines for ``ours`` against the other peers (``PASS``/``FAIL``/``n/a``).

    ``results``: peer -> parsed output, or ``{"skipped": reason}``.

    Examples
    --------
    >>> r = {"tcp+cupy_poolmem": {"wall_clocks": [0.5, 0.06, 0.061], "bandwidth": 8e10},
    ...      "tcp+rmm": {"wall_clocks": [1.0, 0.7, 0.7], "bandwidth": 8e8},
    ...      "ucxx": {"skipped": "distributed_ucxx is not installed"}}
    >>> for line in goals(r): print(line)
    PASS  steady: every run after the first within 10% of the best (max 61.0 ms, best 60.0 ms)
    n/a   steady wall clock at most UCXX's (ucxx: distributed_ucxx is not installed)
    n/a   first run no slower than UCXX's first (ucxx: distributed_ucxx is not installed)
    PASS  at least 5x faster than TCP+RMM (steady 11.6x)
    n/a   bandwidth at least 2x UCXX's (ucxx: distributed_ucxx is not installed)
    """
    lines: list[str] = []
    me = results.get(ours, {})
    if "wall_clocks" not in me:
        return [f"n/a   {ours} did not run ({me.get('skipped', 'no result')})"]
    runs = me["wall_clocks"]
    best = min(runs)
    later = runs[1:] or runs
    ok = max(later) <= 1.10 * best
    lines.append(
        f"{'PASS' if ok else 'FAIL'}  steady: every run after the first within 10% of the "
        f"best (max {_fmt_s(max(later))}, best {_fmt_s(best)})"
    )

    def vs(peer: str, label: str, check: Any) -> None:
        other = results.get(peer, {})
        if "wall_clocks" not in other:
            lines.append(f"n/a   {label} ({peer}: {other.get('skipped', 'no result')})")
            return
        passed, detail = check(other)
        lines.append(f"{'PASS' if passed else 'FAIL'}  {label} ({detail})")

    vs(
        "ucxx",
        "steady wall clock at most UCXX's",
        lambda o: (steady(runs) <= steady(o["wall_clocks"]), f"{_fmt_s(steady(runs))} vs "
                   f"{_fmt_s(steady(o['wall_clocks']))}"),
    )  # fmt: skip
    vs(
        "ucxx",
        "first run no slower than UCXX's first",
        lambda o: (runs[0] <= o["wall_clocks"][0], f"{_fmt_s(runs[0])} vs "
                   f"{_fmt_s(o['wall_clocks'][0])}"),
    )  # fmt: skip
    vs(
        BASELINE,
        "at least 5x faster than TCP+RMM",
        lambda o: (steady(o["wall_clocks"]) >= 5 * steady(runs),
                   f"steady {steady(o['wall_clocks']) / steady(runs):.1f}x"),
    )  # fmt: skip

    def bw(o: dict[str, Any]) -> tuple[bool, str]:
        mine, theirs = me.get("bandwidth"), o.get("bandwidth")
        if not mine or not theirs:
            return False, "bandwidth not printed"
        return mine >= 2 * theirs, f"{_fmt_rate(mine)} vs {_fmt_rate(theirs)}"

    vs("ucxx", "bandwidth at least 2x UCXX's", bw)
    return lines


def render(results: dict[str, dict[str, Any]]) -> str:
    """One table: a row per peer, ratios of steady wall clocks to TCP+RMM and UCXX."""

    def ratio(peer: str, r: dict[str, Any]) -> str:
        o = results.get(peer, {})
        if "wall_clocks" not in o or "wall_clocks" not in r:
            return "-"
        return f"{steady(o['wall_clocks']) / steady(r['wall_clocks']):.2f}x"

    rows = []
    for name, r in results.items():
        if "wall_clocks" not in r:
            rows.append([name, f"skipped: {r.get('skipped', '?')}", "", "", "", "", "", "", ""])
            continue
        runs = r["wall_clocks"]
        rows.append(
            [
                name,
                " ".join(_fmt_s(x) for x in runs),
                _fmt_s(runs[0]),
                _fmt_s(min(runs)),
                _fmt_s(steady(runs)),
                f"{max(runs[1:] or runs) / min(runs):.2f}",
                _fmt_rate(r.get("bandwidth")),
                ratio(BASELINE, r),
                ratio("ucxx", r),
            ]
        )
    cols = [
        "peer",
        "wall clock per run",
        "first",
        "best",
        "steady",
        "worst later/best",
        "bandwidth w->w",
        "speed-up vs tcp+rmm",
        "speed-up vs ucxx",
    ]
    return table(cols, rows)


def render_counters(counters: list[dict[str, Any]]) -> str:
    """Where the cupy_poolmem workers' time went: per worker, its chunks and meetings,
    then one row per timed step (``timings`` of the transfer counters).

    Examples
    --------
    >>> c = {"address": "tcp://h:1", "sent_ipc": 2, "received_copy": 1, "received_view": 0,
    ...      "fallback": {"small": 3}, "warm": {"met": 1},
    ...      "timings": {"receive.claim": {"n": 2, "total_s": 0.004, "max_s": 0.003}}}
    >>> row = render_counters([c]).splitlines()[2]
    >>> [x.strip() for x in row.split("|")]
    ['tcp://h:1', '2', '1', 'small=3', 'met=1', 'receive.claim', '2', '4.0', '2.0', '3.0']
    """
    rows = []
    for c in sorted(counters, key=lambda c: str(c.get("address"))):
        fb = ",".join(f"{k}={v}" for k, v in sorted((c.get("fallback") or {}).items())) or "-"
        warm = ",".join(f"{k}={v}" for k, v in sorted((c.get("warm") or {}).items())) or "-"
        head = [
            str(c.get("address")),
            str(c.get("sent_ipc", 0)),
            str(c.get("received_copy", 0) + c.get("received_view", 0)),
            fb,
            warm,
        ]
        steps = sorted((c.get("timings") or {}).items()) or [("-", {"n": 0})]
        for i, (step, t) in enumerate(steps):
            n = int(t.get("n", 0))
            tot = float(t.get("total_s", 0.0)) * 1e3
            rows.append(
                (head if i == 0 else [""] * len(head))
                + [
                    step,
                    str(n),
                    f"{tot:.1f}",
                    f"{tot / n:.1f}" if n else "-",
                    f"{float(t.get('max_s', 0.0)) * 1e3:.1f}",
                ]
            )
    cols = ["worker", "sent ipc", "received", "fallback", "meetings", "step", "n", "total ms"]
    return table([*cols, "mean ms", "max ms"], rows)


def _read_counters(directory: str) -> list[dict[str, Any]]:
    import json

    out = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if name.startswith("counters-") and name.endswith(".json"):
            try:
                with open(os.path.join(directory, name)) as f:
                    out.append(json.load(f))
            except (OSError, ValueError):
                continue
    return out


def _why_not(peer: str) -> str | None:
    """Why ``peer`` cannot run here, or None."""
    for mod, what in (("dask_cuda", "dask-cuda"), ("rmm", "rmm (the script imports it)"),
                      ("nvtx", "nvtx (the script imports it)"), ("pandas", "pandas")):  # fmt: skip
        if importlib.util.find_spec(mod) is None:
            return f"{what} is not installed"
    if peer == "ucxx" and importlib.util.find_spec("distributed_ucxx") is None:
        return "distributed_ucxx is not installed (pip install distributed-ucxx-cu13)"
    return None


def _env_for(extra: dict[str, str]) -> dict[str, str]:
    env = child_env()
    for k in list(env):  # only what this peer sets reaches the script
        if k.startswith(("DASK_DISTRIBUTED__NANNY__PRELOAD", "DASK_DISTRIBUTED__WORKER__PRELOAD")):
            del env[k]
    env.update(extra)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _run_bounded(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[str, str, str]:
    """``(stdout, stderr, status)`` of ``cmd``; past ``timeout`` its whole process group
    (the script, its nannies and workers) is killed."""
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return out, err, str(proc.returncode)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        out, err = proc.communicate(timeout=30)
        return out, err, f"timed out after {timeout:g} s"
    finally:
        if proc.poll() is None:  # interrupted: leave nothing running
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass


def run_peer(name: str, args: argparse.Namespace, log_dir: str | None = None) -> dict[str, Any]:
    """Run the script for one peer; its parsed output, or ``{"skipped": reason}``."""
    why = _why_not(name)
    if why is not None:
        return {"skipped": why}
    extra, env, _ = PEERS[name]
    cmd = [
        sys.executable, "-m", "dask_cuda.benchmarks.local_cupy", "-d", args.devices,
        "-o", "transpose_sum", "-s", str(args.size), "-c", str(args.chunk),
        "--runs", str(args.runs), "--warmup-runs", str(args.warmup_runs), *extra,
    ]  # fmt: skip
    print(f"[dask-cuda] {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    counters_dir = None
    if name == "tcp+cupy_poolmem":
        import tempfile

        counters_dir = tempfile.mkdtemp(prefix="cupy_poolmem-counters-")
        env = dict(env, DASK_DISTRIBUTED__COMM__CUPY_POOLMEM__COUNTERS_DIR=counters_dir)
    t0 = time.monotonic()
    out, err, rc = _run_bounded(cmd, _env_for(env), args.timeout)
    counters = _read_counters(counters_dir) if counters_dir else []
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        with open(os.path.join(log_dir, f"local_cupy-{name.replace('+', '_')}.log"), "w") as f:
            f.write(f"$ {' '.join(cmd)}\n# {time.monotonic() - t0:.1f} s, rc {rc}\n")
            f.write(out + "\n--- stderr ---\n" + err)
    try:
        parsed = parse_local_cupy(out)
    except ValueError:
        tail = " ".join(err.strip().splitlines()[-3:])[-300:]
        return {"skipped": f"the script failed (rc {rc}): {tail}"}
    parsed["rc"] = rc
    if counters_dir is not None:
        parsed["counters"] = counters
    return parsed


def warm_kernel_cache(run: Any = None) -> str:
    """Compile the graph's CuPy kernels into CuPy's on-disk cache in a child process,
    so no peer's first run pays the compilation (the first peer would); what it did.
    ``run``: how the child runs (``(cmd, env, timeout) -> (stdout, stderr, status)``)."""
    code = (
        "import cupy\n"
        "a = cupy.random.RandomState(1).random_sample((64, 64))\n"
        "float((a + a.T).sum())\n"
    )
    out, err, rc = (run or _run_bounded)([sys.executable, "-c", code], child_env(), 120.0)
    if rc != "0":
        last = err.strip().splitlines()[-1:]
        return f"no (exit {rc}: {last[0].strip() if last else 'no message'})"
    return "yes"


def _versions() -> str:
    out = []
    for mod in ("dask", "distributed", "dask_cuda", "rmm", "distributed_ucxx", "ucxx"):
        try:
            out.append(f"{mod} {__import__(mod).__version__}")
        except Exception:  # noqa: BLE001 - any failure: not usable here
            out.append(f"{mod} not installed")
    return ", ".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cupy_poolmem.benchmarks.dask_cuda_local")
    p.add_argument("--devices", default="0,1", help="GPUs, the script's -d (default 0,1)")
    p.add_argument("--size", type=int, default=20000)
    p.add_argument("--chunk", type=int, default=5000)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--warmup-runs", type=int, default=0)
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per peer")
    p.add_argument("--peers", default=",".join(PEERS), help="comma-separated subset")
    p.add_argument("--log-dir", default=None, help="write each peer's full output here")
    p.add_argument("--no-transfer", action="store_true", help="skip `bench transfer`")
    p.add_argument("--quick", action="store_true", help="bench transfer --quick")
    args = p.parse_args(argv)
    names = [n for n in args.peers.split(",") if n]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        p.error(f"unknown peer(s) {unknown}; choose from {list(PEERS)}")
    print(header("dask-cuda local_cupy transpose_sum: cupy_poolmem by environment vs peers"))
    print(f"versions: {_versions()}")
    print(
        f"local_cupy -d {args.devices} -o transpose_sum -s {args.size} -c {args.chunk} "
        f"--runs {args.runs} --warmup-runs {args.warmup_runs}"
    )
    print(f"CuPy kernels for the graph compiled beforehand: {warm_kernel_cache()}")
    results = {n: run_peer(n, args, args.log_dir) for n in names}
    print(render(results))
    print("goals (tcp+cupy_poolmem):")
    for line in goals(results):
        print("  " + line)
    ours = results.get("tcp+cupy_poolmem", {})
    if "counters" in ours:
        print("tcp+cupy_poolmem workers' transfer counters (where the time went):")
        print(render_counters(ours["counters"]) if ours["counters"] else "  (none written)")
    status = 0 if "wall_clocks" in results.get("tcp+cupy_poolmem", {"wall_clocks": 0}) else 1
    sys.stdout.flush()
    if not args.no_transfer:
        print("\n[bench transfer]", flush=True)
        cmd = [sys.executable, "-m", "cupy_poolmem.benchmarks.dask_transfer"]
        if args.quick:
            cmd.append("--quick")
        out, err, rc = _run_bounded(cmd, child_env(), args.timeout * 2)
        print(out, end="", flush=True)
        if rc != "0":
            print(f"bench transfer: exit {rc}\n{err[-2000:]}", flush=True)
            status = 1
    return status


if __name__ == "__main__":
    from cupy_poolmem.benchmarks._common import run

    run(main, "dask-cuda")  # --save DIR: also write DIR/dask-cuda-<device>.json
