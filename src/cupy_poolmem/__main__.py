"""Command line: ``python -m cupy_poolmem [doctor|demo|bench|report] ...`` (also ``cupy-poolmem``).

Each command has its own ``--help`` with an example.  Exit status: ``0`` done, ``1`` the
command ran and found a problem, ``2`` bad input or a machine that cannot run the
command (no GPU, no CUDA packages); errors are one line on stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from collections.abc import Sequence

import cupy_poolmem as cpm  # its public names; the GPU ones load on first use

from . import __version__, _doctor
from ._cli import Parser, fail, guard_pipe
from ._errors import GPU_EXTRA_HINT, MissingDependencyError, NoGPUError
from .benchmarks import BENCHMARKS, DEFAULT
from .benchmarks._common import child_env
from .benchmarks.chaos import add_options, forward_args
from .report import _cli as report_cli

PROG = "python -m cupy_poolmem"

DESCRIPTION = """\
CUDA stream-ordered memory pools for CuPy: check this machine, try the allocators,
run the benchmarks, or read allocation logs.  Without a command, runs the doctor.
"""

EPILOG = """\
examples:
  python -m cupy_poolmem                      the doctor: versions, GPUs, self-check
  python -m cupy_poolmem demo                 a short tour of the allocators
  python -m cupy_poolmem bench --quick        every benchmark table, shorter runs
  python -m cupy_poolmem report alloc-*.csv --plot usage.png

'python -m cupy_poolmem COMMAND --help' describes each command.
exit status: 0 done, 1 a check failed, 2 bad input or no GPU / CUDA packages
"""


def _missing_gpu_packages() -> str | None:
    """The first GPU package that is not installed, or ``None`` when all are."""
    for name in ("cupy", "cuda.core", "cuda.bindings"):
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except ModuleNotFoundError:  # the parent package ("cuda") is missing
            return name
    return None


def _needs_gpu(prog: str, what: str) -> int | None:
    """An exit status (after a one-line message) when ``what`` cannot run here, else None."""
    missing = _missing_gpu_packages()
    if missing is not None:
        return fail(prog, str(MissingDependencyError(what, f"no module named {missing!r}")))
    if cpm.device_count() == 0:
        return fail(
            prog,
            f"{what} needs a CUDA GPU, and CUDA sees none here (no driver, no device, or "
            "CUDA_VISIBLE_DEVICES empty); `python -m cupy_poolmem doctor` tells more",
        )
    return None


# -- doctor ------------------------------------------------------------------------------
def _run_doctor(args: argparse.Namespace) -> int:
    missing = _missing_gpu_packages()
    if missing is None:
        return _doctor.doctor(check=not args.no_check)
    print("cupy_poolmem doctor")
    for k, v in _doctor.versions():
        print(f"  {k:14s} {v}")
    print(
        f"\nThis is a base install: {missing} is not installed, so only the CPU features "
        "work (sizes, statistics, `python -m cupy_poolmem report`).  For the GPU "
        f"features: {GPU_EXTRA_HINT}"
    )
    return 2


# -- demo --------------------------------------------------------------------------------
def _demo(args: argparse.Namespace) -> int:
    rc = _needs_gpu(f"{PROG} demo", "demo")
    if rc is not None:
        return rc
    rc = _doctor.doctor(check=False)
    if rc:
        return rc
    import cupy
    import cupyx
    import numpy as np

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


# -- bench -------------------------------------------------------------------------------
def _bench(args: argparse.Namespace) -> int:
    """Run each benchmark module in its own process (they spawn workers)."""
    given = forward_args(args)
    if given and "chaos" not in args.names:
        return fail(
            f"{PROG} bench",
            f"{' '.join(given[::2])} only apply to the chaos benchmark; name it: "
            f"{PROG} bench chaos {' '.join(given)}",
        )
    rc = _needs_gpu(f"{PROG} bench", "bench")
    if rc is not None:
        return rc
    names = list(dict.fromkeys(args.names)) or list(DEFAULT)
    save = ["--save", os.path.abspath(args.save)] if args.save else []
    env = child_env()
    status = 0
    for i, name in enumerate(names, start=1):
        module = f"{__package__}.benchmarks.{BENCHMARKS[name][0]}"
        if name == "chaos":
            extra = given + (["--rounds", "30"] if args.quick and args.rounds is None else [])
        else:
            extra = (["--quick"] if args.quick else []) + save
        print(f"[{i}/{len(names)}] {name}: {BENCHMARKS[name][1]}", file=sys.stderr, flush=True)
        r = subprocess.run([sys.executable, "-m", module, *extra], env=env)
        status = status or (1 if r.returncode else 0)
    return status


# -- report ------------------------------------------------------------------------------
def _report(args: argparse.Namespace) -> int:
    return report_cli.run(args)


# -- parser ------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The ``python -m cupy_poolmem`` parser with its four subcommands."""
    parser = Parser(prog=PROG, description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"cupy_poolmem {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    p = sub.add_parser(
        "doctor",
        help="versions, driver, GPUs, NUMA nodes, pool features and a self-check (default)",
        description="Print the versions of CuPy, cuda.core and cuda.bindings, the driver, "
        "each GPU\n(memory, NUMA node, pool features), then write a pattern through each "
        "pool kind\nand read it back, and time an allocation against CuPy's MemoryPool.",
        epilog="example:\n  python -m cupy_poolmem doctor --no-check\n\n"
        "exit status: 0 all checks passed, 1 a self-check failed, 2 no usable GPU or driver",
    )
    p.add_argument("--no-check", action="store_true", help="skip the self-check and timing")
    p.set_defaults(func=_run_doctor)

    p = sub.add_parser(
        "demo",
        help="a short tour of the one-line allocators, with statistics",
        description="Make cupy_poolmem CuPy's device and pinned allocators, compute on a "
        "16M-element\narray, copy through pinned memory, and print the pool's statistics.",
        epilog="example:\n  python -m cupy_poolmem demo\n\nexit status: 0 done, 2 no GPU",
    )
    p.set_defaults(func=_demo)

    listing = "\n".join(f"  {n:8s} {d}" for n, (_m, d) in BENCHMARKS.items())
    p = sub.add_parser(
        "bench",
        help="benchmark tables: cupy_poolmem against its peers, measured in the same run",
        description="Run the benchmarks, each in its own process, and print one table each "
        "(peers\nmeasured in the same run, ratios to a named baseline, device and "
        f"versions).\n\nbenchmarks:\n{listing}",
        epilog="examples:\n  python -m cupy_poolmem bench --quick\n"
        "  python -m cupy_poolmem bench alloc ipc\n"
        "  python -m cupy_poolmem bench --save benchmarks/results\n"
        "  python -m cupy_poolmem bench chaos --seed 1 --rounds 300 --time-cap 600\n\n"
        "exit status: 0 done, 1 a benchmark failed, 2 no GPU or CUDA packages",
    )

    def benchmark_name(text: str) -> str:
        if text not in BENCHMARKS:
            raise argparse.ArgumentTypeError(
                f"unknown benchmark {text!r} (choose from {', '.join(BENCHMARKS)})"
            )
        return text

    p.add_argument(
        "names",
        nargs="*",
        type=benchmark_name,
        metavar="NAME",
        help=f"benchmarks to run (default: {' '.join(DEFAULT)}; also: "
        f"{' '.join(n for n in BENCHMARKS if n not in DEFAULT)})",
    )
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    p.add_argument(
        "--save",
        metavar="DIR",
        help="also write each benchmark's results to DIR/<bench>-<device>.json "
        "(tools/render_figures.py renders the docs' figures from them)",
    )
    add_options(p, defaults=False)
    p.set_defaults(func=_bench)

    p = sub.add_parser(
        "report",
        help="summarise and plot allocation logs (no GPU needed)",
        description=report_cli.DESCRIPTION,
        epilog=report_cli.EPILOG,
    )
    report_cli.add_arguments(p)
    p.set_defaults(func=_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m cupy_poolmem`` and the ``cupy-poolmem`` script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["doctor", *argv])
    prog = f"{PROG} {args.command}"
    try:
        return guard_pipe(args.func, args, prog=prog)
    except (MissingDependencyError, NoGPUError) as exc:
        return fail(prog, str(exc))
    except KeyboardInterrupt:
        return fail(prog, "interrupted", code=130)


if __name__ == "__main__":
    sys.exit(main())
