"""The ``report`` command line: ``python -m cupy_poolmem report LOG ... [--plot FILE]``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from .._cli import Parser, describe_os_error, fail, guard_pipe, int_at_least, printable
from .._errors import InvalidOptionError, LogFormatError, MissingDependencyError
from ._export import check_export, export
from ._plot import PLOT_FORMATS, plot_format, plot_loaded
from ._read import load
from ._summary import summarize_loaded

PROG = "python -m cupy_poolmem report"
DESCRIPTION = """\
Summarise cupy_poolmem allocation logs: peak use per process and device, bytes per
tag, top call sites, and allocations never freed by the end of the log; optionally
plot memory over time.  Needs no GPU and no CUDA package (plots need matplotlib).
Write logs with cupy_poolmem.start_log("alloc-{pid}.csv") or CUPY_POOLMEM_LOG=...
"""
EPILOG = """\
examples:
  python -m cupy_poolmem report alloc-*.csv
  python -m cupy_poolmem report logs/ --plot usage.png --tag-depth 1
  python -m cupy_poolmem report alloc.csv --json | jq .leaked_bytes
  python -m cupy_poolmem report alloc.csv --to torch-snapshot alloc.pickle
  python -m cupy_poolmem report alloc.csv --to rmm-log rmm_log.csv
  cat alloc.csv | python -m cupy_poolmem report -

Rows with an invalid value are skipped and counted; files in a directory (or a
quoted glob) that are not logs are skipped with a warning on stderr.

exit status: 0 done, 1 the plot could not be drawn (matplotlib missing) or the output
was closed early (| head) or could not be written (a full disk), 2 bad input
"""


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The ``report`` options, added to ``ap`` (the CLI's subcommand parser uses it)."""
    ap.add_argument(
        "logs",
        nargs="+",
        metavar="LOG",
        help="log files (CSV), directories of them, quoted globs ('alloc-*.csv'), "
        "or - for standard input",
    )
    ap.add_argument(
        "--plot",
        metavar="FILE",
        help="draw used/reserved memory by tag; the suffix picks the format "
        f"({', '.join(PLOT_FORMATS)})",
    )
    ap.add_argument(
        "--top",
        type=int_at_least(0),
        default=10,
        metavar="N",
        help="call sites and leaks listed (default: 10)",
    )
    ap.add_argument(
        "--tag-depth",
        type=int_at_least(1),
        default=None,
        metavar="N",
        help="group nested tags by their first N components",
    )
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument(
        "--to",
        nargs=2,
        metavar=("FORMAT", "FILE"),
        help="also write the log for another viewer: torch-snapshot (a .pickle that "
        "PyTorch's memory_viz opens) or rmm-log (RMM's logging adaptor CSV, which its "
        "replay benchmark reads)",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``report`` with parsed arguments; return the exit status.

    The plot and the export are written before the summary is printed, so a reader
    that stops early (``| head``) does not stop them.
    """
    to = getattr(args, "to", None)
    try:
        if args.plot:
            plot_format(args.plot)  # a bad suffix is an error before any work
        if to:
            check_export(*to)
        loaded = load(args.logs)
        for option, out in (("--plot", args.plot), ("--to", to[1] if to else None)):
            if out and any(_same_file(out, s.path) for s in loaded.sources):
                raise InvalidOptionError(
                    f"{option} {out}: that file is a log being read; write to another file"
                )
        summ = summarize_loaded(loaded, args.top, args.tag_depth)
    except OSError as exc:
        return fail(PROG, describe_os_error(exc))
    except (LogFormatError, InvalidOptionError) as exc:
        return fail(PROG, str(exc))
    for name, why in loaded.skipped:
        print(f"{PROG}: warning: skipped {printable(name)}: {printable(why)}", file=sys.stderr)
    if args.json and summ.n_bad_lines:
        print(
            f"{PROG}: warning: skipped {summ.n_bad_lines} invalid row(s) "
            f"(first: {printable(summ.first_bad_line or '')})",
            file=sys.stderr,
        )
    errors: list[tuple[str, int]] = []
    done: list[str] = []
    if args.plot:
        try:
            out = plot_loaded(loaded, args.plot, tag_depth=args.tag_depth, summ=summ)
            done.append(f"plot written to {printable(out)}")
        except MissingDependencyError as exc:
            errors.append((f"cannot plot: {exc}", 1))
        except OSError as exc:
            errors.append((f"cannot write the plot: {describe_os_error(exc)}", 2))
        except LogFormatError as exc:
            errors.append((f"cannot plot: {exc}", 2))
    if to:
        try:
            n, files = export(loaded, to[0], to[1], tag_depth=args.tag_depth)
            done.append(f"{to[0]} written to {printable(', '.join(files))} ({n} events)")
        except OSError as exc:
            errors.append((f"cannot write {to[0]}: {describe_os_error(exc)}", 2))
    if args.json:
        print(json.dumps(summ.to_dict(), indent=1, allow_nan=False))
    else:
        print(summ.format(top=args.top))
        if done:
            print("\n" + "\n".join(done))
    for message, code in errors:
        fail(PROG, message, code=code)
    return max((code for _, code in errors), default=0)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # ``a`` does not exist yet
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cupy_poolmem report LOG [LOG ...] [--plot FILE]``; returns the exit code.

    Bad arguments exit (``SystemExit(2)``) with a one-line message, as argparse does.

    Parameters
    ----------
    argv : sequence of str, optional
        The arguments after ``report``; default ``sys.argv[1:]``.

    Returns
    -------
    int
        The exit code: 0 on success.

    Examples
    --------
    >>> main(["alloc-101.csv", "alloc-102.csv", "--plot", "usage.png"])  # doctest: +SKIP
    0
    """
    ap = Parser(prog=PROG, description=DESCRIPTION, epilog=EPILOG)
    add_arguments(ap)
    args = ap.parse_args(list(argv) if argv is not None else None)
    return guard_pipe(run, args, prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
