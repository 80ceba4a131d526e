"""Chaos run of zero-copy sharing: seeded rounds of hostile process lifecycles on one GPU.

A long-lived *hub* (this process, on IPC pools) drives a few long-lived worker
processes (spawned, on IPC pools too) through seeded random rounds.  In each round
producers (workers or the hub) allocate small int64 arrays whose every element is
known (``base + i``, ``base`` drawn for each array), pickle messages of them, and the
hub routes the messages to consumers over ``multiprocessing`` pipes (as pickled bytes,
and the hub's own arrays directly through the pipe).  Consumers check every element
and drop, hold, forward or return what they got.  Around that, the round draws events:
workers SIGKILLed at random moments (producers, consumers, forwarders mid-message),
producers that return right after sending, copies of messages replayed late (after
their block was recycled into a new life), into other processes, or from earlier
rounds, forged descriptor fields, the hub's pool trimmed and a pool closed under its
receivers, and a receiver killed with a write queued behind a long kernel while the
exporter reuses the memory.

What counts:

* **wrong data**: any element anywhere that is not the one sent, an array mapped
  outside (or past) the block its message names, or a replayed message that shows a
  later life's data.  A message may always be refused with a typed error
  (:class:`~cupy_poolmem.PoolmemError`, :class:`~cupy_poolmem.SharingError`): that is
  ``refused_ok``.
* **errors**: an exception of another type in a receiver, or a worker that died by
  itself (a crash).
* **leaks**: rounds after which the hub, given a few seconds to settle, still holds
  tickets, leases, limbo, mapped or idle blocks, pool bytes, or more threads, file
  descriptors, connections, imported pools or opened events than its live workers
  account for.
* **hangs**: rounds where an answer did not come within the round's time limit (the
  workers involved are killed and the run goes on).

It prints one summary line and exits with status 1 when any of these is not zero, or
when the time cap stopped it before all rounds ran::

    python -m cupy_poolmem bench chaos --seed 1 --rounds 300 --time-cap 600
    chaos: rounds=300/300 seed=1 wrong_data=0 leaks=0 hangs=0 errors=0 refused_ok=...

A round's scenario depends only on ``(seed, round)`` (``--first-round`` replays the
rounds from one on); kill moments and process timing do not repeat exactly.
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
