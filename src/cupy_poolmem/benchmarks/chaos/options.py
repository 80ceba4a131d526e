"""Options of the chaos run, and the parser of ``python -m cupy_poolmem.benchmarks.chaos``."""

from __future__ import annotations

import argparse
from typing import Any

from ..._cli import Parser, int_at_least

# -- options ---------------------------------------------------------------------------------
DEFAULTS = {"seed": 1, "rounds": 300, "time_cap": 900, "workers": 4}


def add_options(parser: argparse.ArgumentParser, defaults: bool = True) -> None:
    """The chaos run's options (``defaults=False``: ``None`` when not given, for ``bench``)."""

    def d(name: str) -> Any:
        return DEFAULTS[name] if defaults else None

    parser.add_argument(
        "--seed", type=int_at_least(0), default=d("seed"), help="chaos: random seed (default 1)"
    )
    parser.add_argument(
        "--rounds",
        type=int_at_least(1),
        default=d("rounds"),
        help="chaos: rounds to run (default 300)",
    )
    parser.add_argument(
        "--time-cap",
        type=int_at_least(1),
        default=d("time_cap"),
        metavar="SECONDS",
        help="chaos: start no round after this many seconds (default 900)",
    )
    parser.add_argument(
        "--workers",
        type=int_at_least(2),
        default=d("workers"),
        help="chaos: long-lived worker processes (producers, consumers, forwarders; default 4)",
    )


def forward_args(ns: argparse.Namespace) -> list[str]:
    """The chaos options given to ``bench`` (``add_options(defaults=False)``), as argv."""
    out = []
    for name in DEFAULTS:
        value = getattr(ns, name, None)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m cupy_poolmem bench chaos",
        description="Seeded randomized rounds of process lifecycles and hostile messages "
        "around one\nlong-lived hub; data checked everywhere, the hub's counters after "
        "each round.",
        epilog="example:\n  python -m cupy_poolmem bench chaos --seed 7 --rounds 300\n\n"
        "exit status: 0 no wrong data, leak, hang or error in every round asked; 1 otherwise",
    )
    add_options(p)
    p.add_argument("--first-round", type=int, default=0, help="index of the first round")
    p.add_argument(
        "--verbose", action="store_true", help="one line per round (what it drew, what it saw)"
    )
    return p
