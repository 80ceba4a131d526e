"""Chaos run of zero-copy sharing: seeded rounds of hostile process lifecycles on one GPU.

A hub process drives spawned workers through rounds of kills, replays and forged
messages, checks every element received, and prints one summary line::

    python -m cupy_poolmem bench chaos --seed 1 --rounds 300 --time-cap 600

What a round does and what counts: docs/sharing.rst, "Chaos run".
"""

from .backends import GPU, FakeGPU
from .checks import Forged, Plain, outside, verify
from .forging import forge, peek, repickle
from .hub import HUB_SETTINGS, SETTLE_S, SPARES, Hub
from .options import DEFAULTS, add_options, build_parser, forward_args
from .results import (
    DEVICE_FD_SLACK,
    Counters,
    Result,
    exit_status,
    fd_kind,
    holding,
    leaks,
    open_fds,
    summary_line,
)
from .runner import main, run
from .scenario import ACTIONS, EVENT_KINDS, FORGERIES, HUB, SIZES, kinds_of, make_plan, pattern_base
from .worker import worker_main

__all__ = [
    "GPU",
    "FakeGPU",
    "Forged",
    "Plain",
    "outside",
    "verify",
    "forge",
    "peek",
    "repickle",
    "HUB_SETTINGS",
    "SETTLE_S",
    "SPARES",
    "Hub",
    "DEFAULTS",
    "add_options",
    "build_parser",
    "forward_args",
    "DEVICE_FD_SLACK",
    "Counters",
    "Result",
    "exit_status",
    "fd_kind",
    "holding",
    "leaks",
    "open_fds",
    "summary_line",
    "main",
    "run",
    "ACTIONS",
    "EVENT_KINDS",
    "FORGERIES",
    "HUB",
    "SIZES",
    "kinds_of",
    "make_plan",
    "pattern_base",
    "worker_main",
]
