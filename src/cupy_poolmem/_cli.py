"""Pieces every command of ``python -m cupy_poolmem`` shares: parser, argument types, exits.

Exit codes: ``0`` success; ``1`` the command ran and found a problem (a failed
self-check, a plot that could not be drawn for want of matplotlib); ``2`` bad input
(unknown option, bad value, unreadable log) or a machine that cannot run the command
(no GPU, no CUDA packages).  Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

__all__ = [
    "Parser",
    "HelpFormatter",
    "int_at_least",
    "fail",
    "describe_os_error",
    "guard_pipe",
    "printable",
]


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the line breaks of descriptions and examples; wraps option help."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line: ``PROG: error: WHY (see --help)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` for ints ``>= minimum``, with a message naming the value."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}; got {value}")
        return value

    convert.__name__ = f"int >= {minimum}"
    return convert


def printable(s: str) -> str:
    """``s`` with every character a terminal would act on written as an escape.

    Control characters (escape sequences, carriage returns, bells), format characters
    (bidirectional overrides) and undecodable bytes become ``\\x1b``, ``\\u202e``...;
    everything else is kept.

    Examples
    --------
    >>> printable("step\\x1b[2J")
    'step\\\\x1b[2J'
    >>> printable("modèle/attention")
    'modèle/attention'
    """
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in s)


def fail(prog: str, message: str, code: int = 2) -> int:
    """Print ``PROG: error: MESSAGE`` on stderr (one line) and return ``code``."""
    text = printable(" ".join(str(message).split()))  # no escape sequences
    print(f"{prog}: error: {text}", file=sys.stderr)
    return code


def describe_os_error(exc: OSError) -> str:
    """``FILE: reason`` for an ``OSError`` (``x.csv: No such file or directory``)."""
    if exc.filename is not None and exc.strerror:
        return f"{os.fsdecode(exc.filename)}: {exc.strerror}"
    return str(exc)


def guard_pipe(fn: Callable[..., int], *args: Any, prog: str = "python -m cupy_poolmem") -> int:
    """Run ``fn(*args)``; a reader that closes the pipe early (``| head``) ends it quietly,
    and output that cannot be written (a full disk) is a one-line error; both exit 1.

    Python's documented recipe: point stdout at ``/dev/null`` so that the flush at exit
    does not raise again.
    """
    try:
        rc = fn(*args)
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        _stdout_to_devnull()
        return 1
    except OSError as exc:
        if exc.errno not in _OUTPUT_ERRORS:
            raise
        _stdout_to_devnull()
        return fail(prog, f"cannot write the output: {exc.strerror}", code=1)


# What a write to a redirected stdout meets on a full or failing disk.
_OUTPUT_ERRORS = {
    getattr(errno, n) for n in ("ENOSPC", "EDQUOT", "EFBIG", "EIO") if hasattr(errno, n)
}


def _stdout_to_devnull() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout replaced (tests): nothing to do
        pass
