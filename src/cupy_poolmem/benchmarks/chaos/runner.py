"""The chaos run: rounds until done or the time cap, with a watchdog."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

from .._common import require_gpu
from .backends import BACKENDS
from .hub import STUCK_S, Hub
from .options import build_parser
from .results import Result, exit_status, summary_line
from .scenario import kinds_of, make_plan


def _watchdog(hub: Hub, result: Result, stop: threading.Event) -> None:
    """End the run with its summary line when the hub itself stops making progress."""
    import faulthandler

    while not stop.wait(1.0):
        if time.monotonic() - hub.beat > STUCK_S:
            result.hangs += 1
            result.aborted = "hub-stuck"
            faulthandler.dump_traceback(all_threads=True)
            for w in list(hub.workers):
                try:
                    os.kill(w.pid, signal.SIGKILL)
                except OSError:
                    pass
            for line in result.details[:50]:
                print(line, file=sys.stderr)
            print(summary_line(result), flush=True)
            os._exit(1)


def run(opts: argparse.Namespace) -> Result:
    """The chaos run (needs a GPU): rounds until done or the time cap."""
    result = Result(seed=opts.seed, rounds_asked=opts.rounds)
    t_start = time.monotonic()
    be = BACKENDS[getattr(opts, "backend", "gpu")]()
    hub = Hub(opts, result, be)
    result.device = be.device()
    stop = threading.Event()
    threading.Thread(
        target=_watchdog, args=(hub, result, stop), name="chaos-watchdog", daemon=True
    ).start()
    hub.start()
    try:
        for i in range(opts.first_round, opts.first_round + opts.rounds):
            if time.monotonic() - t_start > opts.time_cap:
                break
            plan = make_plan(opts.seed, i, opts.workers)
            before = (result.wrong_data, result.errors, result.leaks, result.hangs)
            hub.run_round(plan)
            result.rounds += 1
            result.elapsed = time.monotonic() - t_start
            after = (result.wrong_data, result.errors, result.leaks, result.hangs)
            if opts.verbose or before != after:
                print(
                    f"round {i} ({result.elapsed:.1f}s): {' '.join(sorted(kinds_of(plan)))} | "
                    f"ok={result.ok} refused={result.refused_ok} wrong={result.wrong_data} "
                    f"errors={result.errors} leaks={result.leaks} hangs={result.hangs}",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        hub.stop()
        stop.set()
    result.elapsed = time.monotonic() - t_start
    return result


def main(argv: Sequence[str] | None = None) -> int:
    opts = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    require_gpu("chaos")
    result = run(opts)
    for line in result.details[:50]:
        print(line, file=sys.stderr)
    if result.refusals:
        kinds = ", ".join(f"{k}={n}" for k, n in sorted(result.refusals.items()))
        print(f"chaos: messages refused, by error: {kinds}", file=sys.stderr)
    if result.forgeries_skipped:
        print(
            f"chaos: {result.forgeries_skipped} forgeries skipped: the descriptor lacks "
            "their fields (update chaos.forge)",
            file=sys.stderr,
        )
    print(summary_line(result), flush=True)
    return exit_status(result)
