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

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import itertools
import os
import pickle
import random
import re
import signal
import sys
import threading
import time
import traceback
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

# -- options ---------------------------------------------------------------------------------
DEFAULTS = {"seed": 1, "rounds": 300, "time_cap": 900, "workers": 4}


def add_options(parser: argparse.ArgumentParser, defaults: bool = True) -> None:
    """The chaos run's options (``defaults=False``: ``None`` when not given, for ``bench``)."""
    from .._cli import int_at_least

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
    from .._cli import Parser

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


# -- the scenario (pure: the same for one seed and round everywhere) ------------------------------
HUB = -1  # the hub's slot in a scenario
SIZES = (512, 4096, 32768, 131072)  # int64 elements per array: 4 KiB to 1 MiB
ACTIONS = ("drop", "hold", "forward", "return")
#: Forged descriptor fields (or pairs of them), each with the change applied.
FORGERIES = (
    "ticket",
    "export_id",
    "size",
    "size+shape",
    "size+offset",
    "offset",
    "offset+shape",
    "shape-larger",
    "shape-smaller",
    "strides-negative",
    "strides-reversed",
    "strides-huge",
    "dtype-object",
    "dtype-wider",
    "dtype-reinterpret",
    "life-newer",
    "life-older",
    "life-huge",
    "version",
)
#: Every kind of event a scenario may draw (each covered over a few dozen rounds).
EVENT_KINDS = (
    "kill_producer",
    "kill_consumer",
    "kill_forwarder",
    "returning_producer",
    "forward",
    "round_trip",
    "replay_other",
    "replay_stale",
    "replay_vault",
    "forge",
    "hub_load",
    "trim_pool",
    "close_pool",
    "killed_writer",
)


class Route(NamedTuple):
    """One delivery: copy ``copy`` of array ``array`` of a batch goes to ``consumer``."""

    array: int
    copy: int
    consumer: int  # worker slot, or HUB
    action: str  # one of ACTIONS
    forward_to: int  # the slot a forwarded message goes on to


class Batch(NamedTuple):
    """Arrays one producer makes in a round, and where their messages go."""

    producer: int  # worker slot, or HUB
    sizes: tuple[int, ...]
    copies: int  # pickled messages per array
    then: str  # "hold", "drop", "return" (workers), "recycle", "close" (the hub's temp pool)
    routes: tuple[Route, ...]


class Event(NamedTuple):
    kind: str  # one of EVENT_KINDS
    target: int  # worker slot, or HUB
    delay_ms: int
    detail: str  # a forged field, the batch of a kill...


class Plan(NamedTuple):
    number: int
    batches: tuple[Batch, ...]
    events: tuple[Event, ...]


def make_plan(seed: int, index: int, n_workers: int) -> Plan:
    """The scenario of round ``index`` (depends only on ``seed``, ``index``, ``n_workers``)."""
    rng = random.Random(f"cupy_poolmem-chaos:{seed}:{index}")
    slots = list(range(n_workers))
    batches: list[Batch] = []
    producers = rng.sample([HUB, *slots], rng.randint(1, min(3, n_workers)))
    events: list[Event] = []
    close = rng.random() < 0.1
    if close and HUB not in producers:
        producers[0] = HUB
    for prod in producers:
        sizes = tuple(rng.choice(SIZES) for _ in range(rng.randint(1, 3)))
        if prod == HUB:
            then = "close" if close else rng.choice(("hold", "hold", "drop", "recycle", "recycle"))
        else:
            then = rng.choices(("hold", "drop", "recycle", "return"), (35, 30, 25, 10))[0]
        copies = 2 if then == "recycle" or rng.random() < 0.3 else 1
        routes = []
        for a in range(len(sizes)):
            for c in range(copies):
                # A copy not routed is kept: replayed from the vault in a later round.  A
                # recycled block's copies all go (an unclaimed one would pin its life).
                if c > 0 and then != "recycle" and rng.random() < 0.5:
                    continue
                others = [s for s in slots if s != prod] or slots
                if prod != HUB and rng.random() < 0.1:
                    consumer = HUB
                else:
                    consumer = rng.choice(others if rng.random() < 0.9 else slots)
                if then == "close":
                    action = "hold"
                elif consumer == HUB:
                    action = rng.choice(("drop", "hold"))
                elif then == "recycle":  # mostly let go, so that the block can recycle
                    action = rng.choice(("drop", "drop", "forward", "hold"))
                else:
                    action = rng.choices(ACTIONS, (45, 30, 15, 10))[0]
                fwd = rng.choice([s for s in slots if s != consumer] or slots)
                routes.append(Route(a, c, consumer, action, fwd))
        batches.append(Batch(prod, sizes, copies, then, tuple(routes)))
    if rng.random() < 0.35:
        kinds = []
        if any(b.producer != HUB and b.then != "return" for b in batches):
            kinds.append("kill_producer")
        if any(r.consumer != HUB for b in batches for r in b.routes):
            kinds.append("kill_consumer")
        if any(r.action == "forward" for b in batches for r in b.routes):
            kinds.append("kill_forwarder")
        if kinds:
            kind = rng.choice(kinds)
            if kind == "kill_producer":
                b = rng.choice([b for b in batches if b.producer != HUB and b.then != "return"])
                events.append(Event(kind, b.producer, rng.randint(0, 150), ""))
            elif kind == "kill_consumer":
                r = rng.choice([r for b in batches for r in b.routes if r.consumer != HUB])
                events.append(Event(kind, r.consumer, rng.randint(0, 300), ""))
            else:
                r = rng.choice([r for b in batches for r in b.routes if r.action == "forward"])
                events.append(Event(kind, r.consumer, rng.randint(0, 60), ""))
    if any(b.then == "hold" for b in batches) and rng.random() < 0.5:  # forged from live ones
        for _ in range(rng.randint(1, 2)):
            events.append(Event("forge", rng.choice(slots), 0, rng.choice(FORGERIES)))
    for b in batches:
        if b.then == "recycle" and rng.random() < 0.85:
            target = rng.choice([*slots, HUB] if rng.random() < 0.2 else slots)
            events.append(Event("replay_stale", target, 0, ""))
    if rng.random() < 0.3:
        for _ in range(rng.randint(1, 2)):
            target = HUB if rng.random() < 0.25 else rng.choice(slots)
            events.append(Event("replay_vault", target, 0, ""))
    if rng.random() < 0.15:
        events.append(Event("trim_pool", HUB, 0, ""))
    if rng.random() < 0.06:
        events.append(Event("killed_writer", rng.choice(slots), 0, ""))
    return Plan(index, tuple(batches), tuple(events))


def kinds_of(plan: Plan) -> set[str]:
    """The event kinds a plan exercises (its events, and what its batches and routes do)."""
    out = {e.kind for e in plan.events}
    if any(e.kind == "replay_vault" and e.target == HUB for e in plan.events):
        out.add("hub_load")
    for b in plan.batches:
        if b.then == "return":
            out.add("returning_producer")
        if b.then == "close":
            out.add("close_pool")
        for r in b.routes:
            if r.action == "forward":
                out.add("forward")
            if r.action == "return":
                out.add("round_trip")
            if r.copy > 0:
                out.add("replay_other")
            if r.consumer == HUB:
                out.add("hub_load")
    return out


def pattern_base(seed: int, key: tuple) -> int:
    """The first element of the array made for ``key``: elements are ``base + i``.

    Bases are 40 random bits shifted past any index, so two arrays never share a value.
    """
    rng = random.Random(f"cupy_poolmem-chaos-data:{seed}:{key}")
    return (rng.getrandbits(40) + 1) << 20


# -- checking what a receiver got (pure numpy) ------------------------------------------------------
class Plain(NamedTuple):
    """A message of a whole array: ``n`` int64 elements ``base + i``."""

    base: int
    n: int


class Forged(NamedTuple):
    """A forged message of that array; the array sat at ``offset`` in a ``size``-byte block."""

    base: int
    n: int
    offset: int
    size: int
    field: str


def _extent(shape: tuple, strides: tuple, itemsize: int, offset: int) -> tuple[int, int]:
    """The byte range ``[lo, hi)`` a view reads (``lo == hi`` for an empty one)."""
    if 0 in shape:
        return offset, offset
    lo = hi = offset
    for n, st in zip(shape, strides):
        span = (n - 1) * st
        if span < 0:
            lo += span
        else:
            hi += span
    return lo, hi + itemsize


def outside(
    shape: tuple, strides: tuple, itemsize: int, offset: int, mem_size: int, expect: Forged
) -> str:
    """Why an array received for a forged message reaches outside the block the original
    message named ("" when it does not): checked before a byte of it is read."""
    lo, hi = _extent(shape, strides, itemsize, offset)
    if lo < hi and (lo < 0 or hi > expect.size):
        return (
            f"forged {expect.field}: an array over bytes [{lo}, {hi}) of a {expect.size}-byte "
            "block was built (memory outside its block)"
        )
    if mem_size > expect.size:
        return (
            f"forged {expect.field}: the received array's memory spans {mem_size} bytes of "
            f"a {expect.size}-byte block (mapped past its block)"
        )
    return ""


def verify(
    host: Any, strides: tuple, offset: int, mem_size: int, expect: Plain | Forged
) -> tuple[str, str]:
    """``(outcome, detail)`` for what a receiver got: ``host``, a contiguous numpy copy of
    the received array, whose device view had ``strides`` and started ``offset`` bytes
    into the memory it was built on (``mem_size`` bytes).

    Outcomes: ``"ok"``, ``"wrong"`` (other data, or memory outside the block the message
    names), ``"unchecked"`` (a forged view over bytes of the block nobody wrote).
    """
    import numpy as np

    pattern = np.arange(expect.base, expect.base + expect.n, dtype=np.int64)
    if isinstance(expect, Plain):
        if host.dtype != np.int64 or host.shape != (expect.n,):
            return "wrong", f"got {host.dtype} {host.shape}, sent int64 ({expect.n},)"
        bad = np.flatnonzero(host != pattern)
        if bad.size:
            i = int(bad[0])
            return "wrong", (
                f"{bad.size} of {expect.n} elements differ; [{i}] = {int(host[i])}, "
                f"sent {int(pattern[i])} (base {expect.base})"
            )
        return "ok", ""
    why = outside(host.shape, strides, host.dtype.itemsize, offset, mem_size, expect)
    if why:
        return "wrong", why
    lo, hi = _extent(host.shape, strides, host.dtype.itemsize, offset)
    if lo == hi:
        return "ok", ""
    if lo < expect.offset or hi > expect.offset + 8 * expect.n:
        return "unchecked", f"forged {expect.field}: reads bytes of the block nobody wrote"
    want = np.ndarray(
        host.shape,
        host.dtype,
        buffer=pattern.tobytes(),
        offset=offset - expect.offset,
        strides=strides,
    )
    if np.ascontiguousarray(want).tobytes() != np.ascontiguousarray(host).tobytes():
        return "wrong", f"forged {expect.field}: other bytes than the block's"
    return "ok", ""


# -- forging and peeking at pickled messages ---------------------------------------------------------
class _Call:
    """A pickled call ``func(*args)`` kept as it is (what a message's bytes unpickle to)."""

    def __init__(self, func: Any, args: tuple) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple:
        return self.func, self.args


class _Peeker(pickle.Unpickler):
    """Unpickles a message without running cupy_poolmem's functions in it (its rebuild:
    nothing is claimed or mapped); classes (the descriptor's) are built as usual."""

    def find_class(self, module: str, name: str) -> Any:
        obj = super().find_class(module, name)
        if module.split(".")[0] == "cupy_poolmem" and isinstance(obj, types.FunctionType):
            return lambda *args: _Call(obj, args)
        return obj


def peek(data: bytes) -> _Call:
    """The rebuild call a message's bytes hold (its descriptor is ``call.args[0]``)."""
    import io

    call = _Peeker(io.BytesIO(data)).load()
    if not isinstance(call, _Call):
        raise TypeError(f"not a zero-copy message: unpickles to {type(call).__name__}")
    return call


def repickle(call: _Call) -> bytes:
    """The bytes of a message that runs ``call`` when unpickled."""
    from multiprocessing.reduction import ForkingPickler

    return bytes(ForkingPickler.dumps(call))


def forge(desc: Any, field: str, rng: random.Random) -> Any:
    """``desc`` (a descriptor, a NamedTuple) with ``field`` forged; None when this version's
    descriptor has no such field."""
    f = getattr(desc, "_fields", ())
    need = {"ticket", "export_id", "size", "offset", "shape", "strides", "dtype", "life"}
    if field == "version":
        need = {"version"}
    if not need <= set(f):
        return None
    if field == "version":
        return desc._replace(version=desc.version + 1)
    size, shape, off = desc.size, desc.shape, desc.offset
    n = shape[0] if shape else 1
    if field == "ticket":
        return desc._replace(ticket=bytes(rng.getrandbits(8) for _ in range(len(desc.ticket))))
    if field == "export_id":
        return desc._replace(export_id=desc.export_id + rng.randint(1, 4))
    if field == "size":
        return desc._replace(size=size * 64)
    if field == "size+shape":
        return desc._replace(size=size * 64, shape=(n * 64,))
    if field == "size+offset":
        return desc._replace(size=size * 64, offset=size * 2)
    if field == "offset":
        return desc._replace(offset=size)
    if field == "offset+shape":
        k = rng.randint(1, max(n - 1, 1))
        return desc._replace(offset=off + 8 * k, shape=(max(n - k, 0),))
    if field == "shape-larger":
        return desc._replace(shape=(n * 2,))
    if field == "shape-smaller":
        return desc._replace(shape=(max(n // 2, 1),))
    if field == "strides-negative":
        return desc._replace(strides=(-8,))
    if field == "strides-reversed":
        return desc._replace(strides=(-8,), offset=off + 8 * (n - 1))
    if field == "strides-huge":
        return desc._replace(strides=(8 * 1024,))
    if field == "dtype-object":
        return desc._replace(dtype="|O")
    if field == "dtype-wider":
        return desc._replace(dtype="<c16")
    if field == "dtype-reinterpret":
        return desc._replace(dtype="<f8")
    if field == "life-newer":
        return desc._replace(life=desc.life + 1)
    if field == "life-older":
        return desc._replace(life=max(desc.life - 1, 0))
    if field == "life-huge":
        return desc._replace(life=2**63)
    raise ValueError(f"unknown forgery {field!r}")


# -- results, leaks, the summary line (pure) ------------------------------------------------------------
@dataclasses.dataclass
class Result:
    """What a chaos run counted."""

    seed: int = 0
    rounds_asked: int = 0
    rounds: int = 0
    ok: int = 0
    refused_ok: int = 0
    unchecked: int = 0
    wrong_data: int = 0
    errors: int = 0
    leaks: int = 0
    hangs: int = 0
    kills: int = 0
    spawned: int = 0
    recycled: int = 0
    elapsed: float = 0.0
    device: str = "?"
    aborted: str = ""
    details: list[str] = dataclasses.field(default_factory=list)
    refusals: dict[str, int] = dataclasses.field(default_factory=dict)  # by exception type
    forgeries_skipped: int = 0  # fields this version's descriptor does not have

    def note(self, what: str, round_index: int, text: str) -> None:
        """Count a finding (``what`` is a counter name) and keep its description."""
        setattr(self, what, getattr(self, what) + 1)
        if len(self.details) < 200:
            self.details.append(f"round {round_index}: {what}: {' '.join(text.split())[:600]}")

    @property
    def capped(self) -> bool:
        return self.rounds < self.rounds_asked

    def failed(self) -> bool:
        return bool(
            self.wrong_data
            or self.leaks
            or self.hangs
            or self.errors
            or self.capped
            or self.aborted
        )


def summary_line(r: Result) -> str:
    """The one line a run prints at the end."""
    line = (
        f"chaos: rounds={r.rounds}/{r.rounds_asked} seed={r.seed} wrong_data={r.wrong_data} "
        f"leaks={r.leaks} hangs={r.hangs} errors={r.errors} refused_ok={r.refused_ok} "
        f"checked_ok={r.ok} unchecked={r.unchecked} kills={r.kills} spawned={r.spawned} "
        f"recycled={r.recycled} elapsed={r.elapsed:.1f}s device={r.device}"
    )
    if r.capped:
        line += " capped=time"
    if r.aborted:
        line += f" aborted={r.aborted}"
    return line


def exit_status(r: Result) -> int:
    return 1 if r.failed() else 0


class Counters(NamedTuple):
    """What the hub holds between rounds."""

    fds: dict[str, int]  # open file descriptors by kind
    threads: int
    used_bytes: int
    held_bytes: int  # held_for_sharing_bytes
    sharing: dict[str, int]  # cupy_poolmem.sharing.stats()
    procs: int  # worker processes the hub holds (running or starting)


#: Sharing counters that must be back at zero once the hub and its workers let go.
ZERO_AFTER_ROUND = (
    "tickets_out",
    "leases",
    "limbo_blocks",
    "limbo_bytes",
    "imported_blocks",
    "idle_mappings",
)
THREADS_PER_CONNECTION = 2  # a reader or server thread, and a sender thread
POOLS_PER_CLIENT = 2  # a DevicePool's two CUDA pools (the small-block one too)
EVENTS_PER_CLIENT = 2
DEVICE_FD_SLACK = 4  # descriptors the driver opens once, at some first use
PIPES_PER_PROCESS = 2  # multiprocessing's spawn keeps both ends of its set-up pipe


def fd_kind(target: str) -> str:
    """The kind of an open descriptor from its ``/proc/self/fd`` link."""
    if target.startswith("socket:"):
        return "socket"
    if target.startswith("pipe:"):
        return "pipe"
    if target == "anon_inode:[pidfd]" or target.startswith("pidfd:"):
        return "pidfd"
    return "other"


def open_fds() -> dict[str, int]:
    kinds: dict[str, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            kind = fd_kind(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def fd_targets(limit: int = 8) -> str:
    """The most common targets of this process's open descriptors (for a leak's report)."""
    seen: dict[str, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            t = re.sub(r"\d+", "N", os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
        seen[t] = seen.get(t, 0) + 1
    top = sorted(seen.items(), key=lambda kv: -kv[1])[:limit]
    return ", ".join(f"{t} x{n}" for t, n in top)


def leaks(base: Counters, now: Counters) -> list[str]:
    """What ``now`` holds beyond what ``base`` (no worker connected) and its live workers
    account for; empty when nothing leaked."""
    out = []
    s = now.sharing
    for k in ZERO_AFTER_ROUND:
        if s.get(k, 0) > base.sharing.get(k, 0):
            out.append(f"{k}={s[k]}")
    if now.used_bytes > base.used_bytes:
        out.append(f"pool used_bytes={now.used_bytes} (baseline {base.used_bytes})")
    if now.held_bytes > base.held_bytes:
        out.append(f"pool held_for_sharing_bytes={now.held_bytes}")
    peers, clients = s.get("peers", 0), s.get("clients", 0)
    if peers > now.procs:
        out.append(f"peers={peers} with {now.procs} worker processes")
    if clients > now.procs:
        out.append(f"clients={clients} with {now.procs} worker processes")
    conns = peers + clients
    if s.get("imported_pools", 0) > POOLS_PER_CLIENT * clients:
        out.append(f"imported_pools={s['imported_pools']} with {clients} clients")
    if s.get("opened_events", 0) > EVENTS_PER_CLIENT * clients:
        out.append(f"opened_events={s['opened_events']} with {clients} clients")
    allowed_threads = base.threads + THREADS_PER_CONNECTION * conns
    if now.threads > allowed_threads:
        out.append(f"threads={now.threads} (baseline {base.threads} + {conns} connections)")
    allowed = {
        "socket": base.fds.get("socket", 0) + conns + now.procs,
        "pipe": base.fds.get("pipe", 0) + PIPES_PER_PROCESS * now.procs,
        "pidfd": base.fds.get("pidfd", 0) + conns,
        # the driver's: a descriptor per imported pool, maybe per opened IPC event
        "other": base.fds.get("other", 0)
        + POOLS_PER_CLIENT * s.get("imported_pools", 0)
        + EVENTS_PER_CLIENT * conns
        + DEVICE_FD_SLACK,
    }
    for kind, n in sorted(now.fds.items()):
        if n > allowed.get(kind, 0):
            out.append(f"fds[{kind}]={n} (allowed {allowed.get(kind, 0)})")
    return out


def holding(now: Counters, pool: str) -> str:
    """What the hub holds, for a leak's report: the sharing counters that are not zero
    (tickets, leases, limbo, exported and imported blocks, peers...) and the pool's."""
    s = ", ".join(f"{k}={v}" for k, v in sorted(now.sharing.items()) if v)
    return f"holding: sharing {{{s or 'all zero'}}}, pool {{{pool}}}"


# -- the worker processes ----------------------------------------------------------------------------
WORKER_SETTINGS = {"exit_timeout": 3.0, "inflight_timeout": 1.0, "claim_timeout": 5.0}
IDLE_EXIT_S = 300.0  # a worker whose hub went silent this long exits
WRITER_SPIN_MS = 300  # the killed writer's kernel, before its write


def _classify_exc(exc: BaseException) -> tuple[str, str]:
    """``("refused:TYPE", why)`` for cupy_poolmem's typed errors, else ``("error", why)``."""
    from cupy_poolmem import PoolmemError

    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, PoolmemError):
        return f"refused:{type(exc).__name__}", text
    tb = " ".join("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).split())
    return "error", f"{text} | {tb[-900:]}"


def _check(be: Any, arr: Any, expect: Plain | Forged) -> tuple[str, str]:
    """:func:`verify` for a received array (``be``: the backend it lives on).  An array
    of a forged message that reaches outside its block is not read."""
    try:
        if isinstance(expect, Forged):
            shape, strides, item, offset, mem_size = be.geometry(arr)
            why = outside(shape, strides, item, offset, mem_size, expect)
            if why:
                return "wrong", why
        host, strides, offset, mem_size = be.view(arr)
        return verify(host, strides, offset, mem_size, expect)
    except Exception as exc:
        return "error", f"reading a received array: {type(exc).__name__}: {exc}"


_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def _spin(ms: float) -> None:
    """Keep the current stream busy for about ``ms`` milliseconds."""
    import cupy
    import numpy as np

    k = cupy.RawKernel(_SPIN, "spin")
    rate = cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrClockRate, 0)
    k((1,), (1,), (np.int64(int(ms * rate)),))


# -- what the run runs on ------------------------------------------------------------------------
class GPU:
    """The real thing: CuPy arrays on cupy_poolmem's IPC pools, shared zero-copy."""

    name = "gpu"

    def __init__(self) -> None:
        import cupy

        import cupy_poolmem

        self.cupy, self.cpm = cupy, cupy_poolmem

    def setup(self, settings: dict[str, float]) -> None:
        """Make cupy_poolmem CuPy's allocator (IPC pools) and apply sharing settings."""
        self.cpm.set_allocator()
        for k, v in settings.items():
            setattr(self.cpm.sharing, k, v)
        x = self.arange(1, 8)  # load the kernels the checks use
        self.view(x)

    def arange(self, base: int, n: int) -> Any:
        return self.cupy.arange(base, base + n, dtype=self.cupy.int64)

    def new_pool(self) -> Any:
        return self.cpm.DevicePool(ipc=True)

    def using(self, pool: Any = None) -> Any:
        """Allocate from ``pool`` (default: the allocator's pool) in a ``with`` block."""
        return self.cpm.using(pool if pool is not None else self.cpm.get_pool())

    def trim(self) -> None:
        self.cpm.get_pool().trim()

    def ptr(self, arr: Any) -> int:
        return int(arr.data.ptr)

    def geometry(self, arr: Any) -> tuple[tuple, tuple, int, int, int]:
        """``(shape, strides, item size, offset, memory size)`` (see :func:`outside`)."""
        mem = arr.data.mem
        offset = int(arr.data.ptr) - int(mem.ptr)
        return arr.shape, tuple(arr.strides), arr.dtype.itemsize, offset, int(mem.size)

    def view(self, arr: Any) -> tuple[Any, tuple, int, int]:
        """``(host copy, strides, offset, memory size)`` of an array (see :func:`verify`)."""
        import numpy as np

        host = np.ascontiguousarray(self.cupy.asnumpy(arr))
        offset = int(arr.data.ptr) - int(arr.data.mem.ptr)
        return host, tuple(arr.strides), offset, int(arr.data.mem.size)

    def sync(self) -> None:
        self.cupy.cuda.get_current_stream().synchronize()

    def stats(self) -> dict[str, int]:
        return dict(self.cpm.sharing.stats())

    def collect(self) -> None:
        self.cpm.sharing.collect()

    def pool_bytes(self) -> tuple[int, int]:
        """The allocator pool's ``used_bytes`` and ``held_for_sharing_bytes``."""
        st = self.cpm.get_pool().stats()
        return st.used_bytes, st.held_for_sharing_bytes

    def pool_detail(self) -> str:
        """The allocator pool's counters, for a leak's report."""
        st = self.cpm.get_pool().stats()
        return (
            f"used_bytes={st.used_bytes}, live_allocs={st.live_allocs}, "
            f"held_for_sharing_bytes={st.held_for_sharing_bytes}, cached_bytes={st.cached_bytes}"
        )

    def write_late(self, arr: Any) -> None:
        """Queue a write of ``arr`` behind a long kernel."""
        _spin(WRITER_SPIN_MS)
        arr.fill(-1)  # runs after the spin, unless this process is gone by then

    def device(self) -> str:
        cupy = self.cupy
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
        name = props["name"]
        return (name.decode() if isinstance(name, bytes) else str(name)).replace(" ", "_")


class FakeDescriptor(NamedTuple):
    """What a :class:`FakeGPU` message carries: the array's view, and the block (``n``
    int64 from ``base``, remade by the receiver: a message stays small, as a real one)."""

    version: int
    ticket: bytes
    export_id: int
    size: int
    offset: int
    shape: tuple
    strides: tuple
    dtype: str
    life: int
    base: int
    n: int


def fake_rebuild(d: FakeDescriptor) -> FakeArray:
    """Receive a :class:`FakeGPU` message: refused (a typed error) unless its view lies
    within its block, as the sharing protocol promises; else a copy of the block."""
    import numpy as np

    from cupy_poolmem import SharingError

    try:
        dt = np.dtype(d.dtype)
    except TypeError:
        raise SharingError(f"dtype {d.dtype!r}") from None
    lo, hi = _extent(d.shape, d.strides, dt.itemsize, d.offset)
    if d.version != 1 or dt.hasobject or d.size != 8 * d.n or lo < 0 or hi > d.size:
        raise SharingError("a fake descriptor that does not fit its block")
    block = bytearray(np.arange(d.base, d.base + d.n, dtype=np.int64).tobytes())
    view = np.ndarray(d.shape, dt, buffer=block, offset=d.offset, strides=d.strides)
    arr = FakeArray(view, d.offset, block, d.base)
    arr.received = True
    return arr


class FakeArray:
    """A :class:`FakeGPU` array: a numpy view at ``offset`` into its block's bytes."""

    _ptrs = itertools.count(1 << 12, 1 << 12)

    def __init__(self, data: Any, offset: int, block: bytearray, base: int) -> None:
        self.data, self.offset, self.block, self.base = data, offset, block, base
        self.ptr = next(FakeArray._ptrs)
        self.received = False

    def __reduce__(self) -> tuple:
        d = FakeDescriptor(
            1,
            bytes(16),
            1,
            len(self.block),
            self.offset,
            self.data.shape,
            self.data.strides,
            self.data.dtype.str,
            1,
            self.base,
            len(self.block) // 8,
        )
        return fake_rebuild, (d,)


class FakeGPU:
    """A CPU stand-in for :class:`GPU` (tests of the run's own machinery): numpy arrays
    sent by value in messages that forgeries can change.  It shows what the run counts
    when the protocol keeps its promises: every check passes, nothing leaks.  Its
    ``pool_bytes`` are the bytes of the arrays it made that are still alive, as a
    pool's ``used_bytes`` (so a reference the harness forgets is a leak here too).

    ``corrupt``: every received array shows one wrong element; ``leak``: the hub keeps a
    pipe open and an array alive per collection (both to see that the run counts them).
    """

    def __init__(self, corrupt: bool = False, leak: bool = False) -> None:
        self.corrupt, self.leak = corrupt, leak
        self.name = "fake" + ("-corrupt" if corrupt else "") + ("-leaky" if leak else "")
        self._kept: list[tuple[tuple[int, int], FakeArray]] = []
        self.used_bytes = 0  # bytes of the arrays made here that are alive (a pool's)

    def setup(self, settings: dict[str, float]) -> None:
        pass

    def arange(self, base: int, n: int) -> FakeArray:
        import numpy as np

        block = bytearray(np.arange(base, base + n, dtype=np.int64).tobytes())
        arr = FakeArray(np.ndarray((n,), np.int64, buffer=block), 0, block, base)
        self.used_bytes += len(block)  # as a pool's used_bytes: until the array goes
        weakref.finalize(arr, self._freed, len(block))
        return arr

    def _freed(self, nbytes: int) -> None:
        self.used_bytes -= nbytes

    def new_pool(self) -> Any:
        return types.SimpleNamespace(closed=False, close=lambda: None)

    def using(self, pool: Any = None) -> Any:
        return contextlib.nullcontext()

    def trim(self) -> None:
        pass

    def ptr(self, arr: FakeArray) -> int:
        return arr.ptr

    def geometry(self, arr: FakeArray) -> tuple[tuple, tuple, int, int, int]:
        d = arr.data
        return d.shape, d.strides, d.dtype.itemsize, arr.offset, len(arr.block)

    def view(self, arr: FakeArray) -> tuple[Any, tuple, int, int]:
        import numpy as np

        host = np.array(arr.data, order="C")
        if self.corrupt and arr.received and host.size:
            host.flat[0] += 1
        return host, arr.data.strides, arr.offset, len(arr.block)

    def sync(self) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return dict.fromkeys((*ZERO_AFTER_ROUND, "peers", "clients"), 0)

    def collect(self) -> None:
        if self.leak:
            self._kept.append((os.pipe(), self.arange(1, 512)))

    def pool_bytes(self) -> tuple[int, int]:
        return self.used_bytes, 0

    def pool_detail(self) -> str:
        return f"used_bytes={self.used_bytes}"

    def write_late(self, arr: FakeArray) -> None:
        arr.data[...] = -1  # its own copy: nobody else sees it

    def device(self) -> str:
        return "fake"


#: What ``run`` can run on (``opts.backend``, "gpu" unless a test says "fake").
BACKENDS: dict[str, Any] = {
    "gpu": GPU,
    "fake": FakeGPU,
    "fake-corrupt": functools.partial(FakeGPU, corrupt=True),
    "fake-leaky": functools.partial(FakeGPU, leak=True),
}


class _WorkerState:
    """A worker's arrays: what it made (by batch) and what it holds (by message)."""

    def __init__(self, conn: Any, be: Any) -> None:
        self.conn, self.be = conn, be
        self.held: dict[int, tuple[Any, Any]] = {}  # mid -> (array, expectation or None)
        self.own: dict[Any, list[tuple[Any, Plain]]] = {}  # batch tag -> its arrays

    def make(self, items: list, copies: int) -> tuple[list, list]:
        """Allocate and fill one array per item; pickle ``copies`` messages of each."""
        from multiprocessing.reduction import ForkingPickler

        arrays, msgs = [], []
        for ai, base, n in items:
            a = self.be.arange(base, n)
            arrays.append((a, Plain(base, n)))
            for c in range(copies):
                msgs.append((ai, c, bytes(ForkingPickler.dumps(a))))
        return arrays, msgs

    def take(self, mid: int, arr: Any, expect: Any, action: str) -> None:
        """Check a received array, act on it, and report."""
        from multiprocessing.reduction import ForkingPickler

        extra = None
        try:
            outcome, detail = _check(self.be, arr, expect)
            if outcome in ("ok", "unchecked"):
                if action in ("forward", "return"):
                    try:
                        extra = bytes(ForkingPickler.dumps(arr))
                    except BaseException as exc:
                        outcome, detail = _classify_exc(exc)
                elif action == "hold":
                    self.held[mid] = (arr, expect)
                elif action == "write":
                    self.be.write_late(arr)
                    self.held[mid] = (arr, None)
        except BaseException as exc:
            outcome, detail = _classify_exc(exc)
        self.conn.send(("result", mid, outcome, detail, extra))

    def recheck(self) -> list[tuple[int | None, str, str]]:
        """Re-read every array held or made here: what is no longer what was sent."""
        out: list[tuple[int | None, str, str]] = []
        for mid, (arr, expect) in self.held.items():
            if expect is not None:
                o, d = _check(self.be, arr, expect)
                if o not in ("ok", "unchecked"):
                    out.append((mid, o, "a held array re-read: " + d))
        for tag, arrays in self.own.items():
            for a, expect in arrays:
                o, d = _check(self.be, a, expect)
                if o != "ok":
                    out.append((None, o, f"an array it made ({tag}) re-read: {d}"))
        return out

    def recycle(self, old: Any, tag: Any, items: list) -> None:
        """Drop a batch's arrays, let their blocks go back to the pool, make new ones."""
        ptrs = {self.be.ptr(a) for a, _ in self.own.pop(old, [])}
        deadline = time.monotonic() + 0.5
        while self.be.stats().get("limbo_blocks", 0) and time.monotonic() < deadline:
            time.sleep(0.005)
        arrays, msgs = self.make(items, 2)
        reused = sum(self.be.ptr(a) in ptrs for a, _ in arrays)
        self.own[tag] = arrays
        del arrays
        self.conn.send(("produced", tag, msgs, reused))

    def settle(self) -> None:
        """Re-read, let everything go, unmap idle mappings; report with the counters."""
        found = self.recheck()
        self.held.clear()
        self.own.clear()
        gc.collect()
        self.be.sync()
        self.be.collect()
        self.conn.send(("settled", found, self.be.stats()))


def worker_main(conn: Any, wid: int, backend: str = "gpu") -> None:
    """A long-lived worker: produce, receive, check, forward on the hub's word, until told
    to exit, killed, or the hub goes away (its pipe closes, or stays silent)."""
    from multiprocessing.reduction import ForkingPickler

    be = BACKENDS[backend]()
    be.setup(WORKER_SETTINGS)
    conn.send(("ready", wid, os.getpid()))
    st = _WorkerState(conn, be)
    seq = 0  # messages read from the hub, failed ones too (the hub counts its sends)
    while True:
        if not conn.poll(IDLE_EXIT_S):
            return
        seq += 1
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        except BaseException as exc:  # a message of the hub's own arrays was refused
            conn.send(("recv_failed", seq, *_classify_exc(exc)))
            continue
        op = msg[0]
        try:
            if op == "produce":
                _, tag, items, copies, then = msg
                arrays, msgs = st.make(items, copies)
                conn.send(("produced", tag, msgs, 0))
                if then == "return":
                    return  # the process exits at once: its exit waits for the claims
                if then != "drop":
                    st.own[tag] = arrays
                del arrays
            elif op == "recycle":
                st.recycle(*msg[1:])
            elif op == "load":
                _, mid, expect, data, action = msg
                msg = None
                try:
                    arr = ForkingPickler.loads(data)
                except BaseException as exc:
                    conn.send(("result", mid, *_classify_exc(exc), None))
                    continue
                st.take(mid, arr, expect, action)
                del arr
            elif op == "take":
                _, mid, expect, arr, action = msg
                msg = None
                st.take(mid, arr, expect, action)
                del arr
            elif op == "recheck":
                conn.send(("rechecked", st.recheck()))
            elif op == "settle":
                st.settle()
            elif op == "exit":
                return
        except BaseException as exc:
            conn.send(("failed", op, *_classify_exc(exc)))
        finally:
            msg = None


# -- the hub ---------------------------------------------------------------------------------------
HUB_SETTINGS = {"exit_timeout": 1.0, "inflight_timeout": 1.0, "claim_timeout": 5.0}
ROUND_TIMEOUT_S = 30.0  # an answer later than this is a hang
# How long the hub's counters may take to come back after a round: well past the hub's
# inflight_timeout and a sweep of its janitor (a message nobody read, to a receiver
# killed before it read it, pins its block that long) and a killed receiver's reaping
# (its leases go once its process is gone).  What is still held after it is a leak.
SETTLE_S = 5.0
SPARES = 3  # workers started ahead, to replace killed ones at once
STUCK_S = 120.0  # the hub itself making no progress this long: the run is aborted


class Worker:
    """The hub's end of one worker process: its pipe and process handle."""

    def __init__(self, ctx: Any, wid: int, backend: str) -> None:
        from cupy_poolmem.benchmarks.chaos import worker_main as target  # importable by name

        parent, child = ctx.Pipe()
        self.wid = wid
        self.proc = ctx.Process(
            target=target, args=(child, wid, backend), name=f"chaos-{wid}", daemon=True
        )
        self.proc.start()
        child.close()
        self.conn = parent
        self.pid = self.proc.pid
        self.ready = False
        self.gone = False  # its process ended (or its pipe broke)
        self.leaving = False  # killed by the hub, or told to return: not to be used again
        self.sent = 0
        self.takes: dict[int, int] = {}  # number of a pipe message -> mid of a direct array

    def send(self, msg: tuple) -> bool:
        """Send on the pipe (pickling the hub's arrays in it); False when it is gone."""
        if self.gone:
            return False
        try:
            self.conn.send(msg)
        except (OSError, ValueError):
            self.gone = True
            return False
        self.sent += 1
        return True


class Msg(NamedTuple):
    """A message the hub keeps: its bytes and what it must show."""

    data: bytes
    expect: Plain


class Hub:
    """Runs the rounds: workers, routing, events, checks and the baseline."""

    def __init__(self, opts: argparse.Namespace, result: Result, be: Any) -> None:
        import multiprocessing as mp

        self.be = be
        self.opts = opts
        self.r = result
        self.ctx = mp.get_context("spawn")
        self.workers: list[Worker] = []  # every process the hub holds
        self.slots: list[Worker | None] = [None] * opts.workers
        self.next_wid = 0
        self.beat = time.monotonic()
        self.base: Counters | None = None
        self.round = 0
        self.kills: list[tuple[float, Worker]] = []
        self.waiting: dict[Any, Worker] = {}  # what the hub waits for -> from whom
        self.expect: dict[int, Any] = {}  # mid -> expectation
        self.forward_to: dict[int, int] = {}  # mid -> slot its forwarded message goes to
        self.returned: list[tuple[bytes, Any]] = []  # messages sent back to the hub
        self.produced: dict[Any, list] = {}
        self.vault: list[Msg] = []  # messages of earlier rounds, replayed later
        self.own: dict[Any, tuple[Any, Plain]] = {}  # the hub's arrays in this round
        self.mid = 0

    # -- workers -------------------------------------------------------------------------------
    def spawn(self) -> Worker:
        w = Worker(self.ctx, self.next_wid, self.be.name)
        self.next_wid += 1
        self.workers.append(w)
        self.r.spawned += 1
        return w

    def usable(self, slot: int) -> Worker | None:
        """The worker in ``slot`` when it can take messages (not killed, not leaving)."""
        w = self.slots[slot] if slot != HUB else None
        return None if w is None or w.gone or w.leaving else w

    def spares(self) -> list[Worker]:
        in_slots = {id(w) for w in self.slots if w is not None}
        return [w for w in self.workers if not (w.gone or w.leaving or id(w) in in_slots)]

    def fill_slots(self, deadline: float) -> bool:
        """Give every empty slot a ready worker; keep SPARES more starting."""
        for i, w in enumerate(self.slots):
            if w is not None and (w.gone or w.leaving):
                self.slots[i] = None
        while True:
            spares = self.spares()
            for i, w in enumerate(self.slots):
                ready = [s for s in spares if s.ready]
                if w is None and ready:
                    self.slots[i] = ready[0]
                    spares.remove(ready[0])
            empty = sum(w is None for w in self.slots)
            for _ in range(max(empty + SPARES - len(spares), 0)):
                self.spawn()
            if not empty:
                return True
            if not self.pump(lambda: any(s.ready for s in self.spares()), deadline):
                return False

    def kill(self, w: Worker) -> None:
        if not w.gone:
            w.leaving = True
            try:
                os.kill(w.pid, signal.SIGKILL)
                self.r.kills += 1
            except ProcessLookupError:
                pass

    def reap(self) -> None:
        """Join the workers whose process ended; close their pipes and process handles."""
        for w in list(self.workers):
            if not (w.gone or not w.proc.is_alive()):
                continue
            w.proc.join(10)
            if w.proc.is_alive():  # its pipe broke, the process lingers
                self.kill(w)
                w.proc.join(10)
                if w.proc.is_alive():
                    continue
            if not w.leaving and w.proc.exitcode != 0:
                self.r.note(
                    "errors",
                    self.round,
                    f"worker {w.wid} died by itself (exit code {w.proc.exitcode})",
                )
            self.gone(w)
            w.conn.close()
            w.proc.close()
            self.workers.remove(w)
        for i, s in enumerate(self.slots):
            if s is not None and s not in self.workers:
                self.slots[i] = None

    # -- the event loop ----------------------------------------------------------------------
    def pump(self, done: Callable[[], bool], deadline: float) -> bool:
        """Take the workers' messages and fire due kills until ``done()``; False at
        ``deadline``."""
        from multiprocessing.connection import wait

        while not done():
            now = time.monotonic()
            self.beat = now
            for t, w in list(self.kills):
                if t <= now:
                    self.kills.remove((t, w))
                    self.kill(w)
            if now >= deadline:
                return False
            conns = {w.conn: w for w in self.workers if not w.gone}
            sentinels = {w.proc.sentinel: w for w in self.workers if not w.gone}
            nxt = min([t for t, _ in self.kills] + [deadline, now + 0.1])
            for obj in wait([*conns, *sentinels], timeout=max(nxt - now, 0.0)):
                if obj in conns:
                    w = conns[obj]
                    if not w.gone:
                        self.receive(w)
                else:
                    w = sentinels[obj]
                    while not w.gone and w.conn.poll(0):
                        self.receive(w)
                    self.gone(w)
        return True

    def answered(self, key: Any) -> Callable[[], bool]:
        """A test for :meth:`pump`: nothing waits for ``key`` any more."""
        return lambda: key not in self.waiting

    def sleep(self, seconds: float) -> None:
        """Wait, taking the workers' messages meanwhile."""
        self.pump(lambda: False, time.monotonic() + seconds)

    def gone(self, w: Worker) -> None:
        w.gone = True
        for k, who in list(self.waiting.items()):
            if who is w:
                del self.waiting[k]

    def receive(self, w: Worker) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            self.gone(w)
            return
        op = msg[0]
        if op == "ready":
            w.ready = True
        elif op == "produced":
            _, tag, msgs, reused = msg
            self.produced[tag] = msgs
            self.r.recycled += reused
            self.waiting.pop(("produce", tag), None)
        elif op == "result":
            _, mid, outcome, detail, extra = msg
            self.outcome(outcome, f"worker {w.wid}: {detail}")
            if outcome == "error":
                self.kill(w)  # a CUDA error may poison its context: a fresh one takes over
            self.waiting.pop(("mid", mid), None)
            expect = self.expect.get(mid)
            if extra is not None and expect is not None:
                if mid in self.forward_to:
                    target = self.usable(self.forward_to.pop(mid))
                    if target is not None:
                        self.send_load(target, extra, expect, "drop")
                else:
                    self.returned.append((extra, expect))
        elif op == "recv_failed":
            _, seq, outcome, detail = msg
            mid = w.takes.pop(seq, None)
            if mid is None:
                self.r.note("errors", self.round, f"worker {w.wid} could not read: {detail}")
            else:
                self.outcome(outcome, f"worker {w.wid}: {detail}")
                self.waiting.pop(("mid", mid), None)
        elif op in ("rechecked", "settled"):
            for _mid, outcome, detail in msg[1]:
                self.outcome(outcome, f"worker {w.wid}: {detail}")
            self.waiting.pop((op, w.wid), None)
        elif op == "failed":
            _, what, outcome, detail = msg
            self.r.note("errors", self.round, f"worker {w.wid} failed at {what}: {detail}")
            self.kill(w)  # its state is unknown now: a fresh worker takes its place
            self.gone(w)

    def outcome(self, outcome: str, detail: str) -> None:
        if outcome == "ok":
            self.r.ok += 1
        elif outcome.startswith("refused"):
            self.r.refused_ok += 1
            kind = outcome.partition(":")[2] or "?"
            self.r.refusals[kind] = self.r.refusals.get(kind, 0) + 1
        elif outcome == "unchecked":
            self.r.unchecked += 1
        elif outcome == "wrong":
            self.r.note("wrong_data", self.round, detail)
        else:
            self.r.note("errors", self.round, detail)

    # -- sending ---------------------------------------------------------------------------------
    def new_mid(self, expect: Any) -> int:
        self.mid += 1
        self.expect[self.mid] = expect
        return self.mid

    def send_load(self, w: Worker, data: bytes, expect: Any, action: str) -> int:
        """Send a message's bytes to a worker, which unpickles them."""
        mid = self.new_mid(expect)
        if w.send(("load", mid, expect, data, action)):
            self.waiting[("mid", mid)] = w
        return mid

    def send_take(self, w: Worker, arr: Any, expect: Plain, action: str) -> int:
        """Send one of the hub's arrays through the pipe itself (pickled by the pipe)."""
        mid = self.new_mid(expect)
        try:
            ok = w.send(("take", mid, expect, arr, action))
        except Exception as exc:
            self.outcome(*_classify_exc(exc))
            return mid
        if ok:
            w.takes[w.sent] = mid
            self.waiting[("mid", mid)] = w
        return mid

    def hub_load(self, data: bytes, expect: Any) -> None:
        """The hub receives a message itself (a round trip, a replay)."""
        from multiprocessing.reduction import ForkingPickler

        self.beat = time.monotonic()
        try:
            arr = ForkingPickler.loads(data)
        except Exception as exc:
            self.outcome(*_classify_exc(exc))
            return
        o, d = _check(self.be, arr, expect)
        self.outcome(o, "the hub: " + d)
        del arr

    def dumps(self, arr: Any) -> bytes:
        from multiprocessing.reduction import ForkingPickler

        return bytes(ForkingPickler.dumps(arr))

    def ask_all(self, op: str, answer: str) -> None:
        for i in range(len(self.slots)):
            w = self.usable(i)
            if w is not None and w.send((op,)):
                self.waiting[(answer, w.wid)] = w

    def send_to(self, target: int, data: bytes, expect: Any) -> None:
        """A message to a worker slot (dropped there once checked), or to the hub."""
        if target == HUB:
            self.hub_load(data, expect)
            return
        w = self.usable(target)
        if w is not None:
            self.send_load(w, data, expect, "drop")

    def delivered(self, deadline: float) -> bool:
        """Wait for every answer asked for; then the hub reads what came back to it."""
        if not self.pump(lambda: not self.waiting, deadline):
            return False
        while self.returned:
            data, expect = self.returned.pop()
            self.hub_load(data, expect)
        return True

    # -- one round ------------------------------------------------------------------------------
    def run_round(self, plan: Plan) -> None:
        self.round = plan.number
        deadline = time.monotonic() + ROUND_TIMEOUT_S
        for d in (self.waiting, self.produced, self.forward_to, self.expect):
            d.clear()
        self.returned.clear()
        if not self.fill_slots(deadline):
            self.r.note("hangs", plan.number, "no worker became ready in time")
            return
        for s in self.slots:
            if s is not None:
                s.takes.clear()
        rng = random.Random(f"cupy_poolmem-chaos-run:{self.opts.seed}:{plan.number}")
        temp_pool = None
        msgs: dict[tuple, Msg] = {}  # (batch, array, copy) -> a message kept as bytes
        try:
            temp_pool = self.produce(plan, msgs, deadline)
            if temp_pool is False:
                return self.hang(plan, "producing")
            if not self.deliver(plan, msgs, deadline):
                return self.hang(plan, "delivering")
            if temp_pool is not None:  # 3. closed under the receivers holding its arrays
                if rng.random() < 0.5:  # the hub's own arrays gone first: all in limbo
                    for b, batch in enumerate(plan.batches):
                        if batch.then == "close":
                            for a in range(len(batch.sizes)):
                                self.own.pop((b, a), None)
                temp_pool.close()
                self.ask_all("recheck", "rechecked")
                if not self.delivered(deadline):
                    return self.hang(plan, "re-reading after a pool's close")
            for e in plan.events:  # 4. forged copies of live messages
                if e.kind == "forge":
                    self.send_forged(plan, e, msgs, rng)
            if not self.delivered(deadline):
                return self.hang(plan, "delivering forged messages")
            recycled = self.recycle(plan, msgs, deadline, rng)  # 5. next lives, old copies
            if recycled is None:
                return self.hang(plan, "recycling")
            stale, fresh = recycled
            for e in plan.events:
                if e.kind == "replay_stale":
                    for target in sorted({e.target} | fresh):
                        for m in stale:
                            self.send_to(target, m.data, m.expect)
            if not self.delivered(deadline):
                return self.hang(plan, "replaying stale messages")
            for e in plan.events:  # 6. messages of earlier rounds
                if e.kind == "replay_vault" and self.vault:
                    m = self.vault[rng.randrange(len(self.vault))]
                    self.send_to(e.target, m.data, m.expect)
            if not self.delivered(deadline):
                return self.hang(plan, "replaying earlier rounds' messages")
            self.vault += [m for m in msgs.values() if rng.random() < 0.3]
            del self.vault[:-64]
            for e in plan.events:  # 7. a receiver killed with a write queued
                if e.kind == "killed_writer" and not self.killed_writer(plan, e, deadline):
                    return self.hang(plan, "a killed writer")
        except Exception:
            self.r.note("errors", plan.number, "the hub: " + traceback.format_exc())
        finally:
            for _t, w in self.kills:  # due after the round's work: it dies idle, holding
                self.kill(w)
            self.kills.clear()
            msgs.clear()
            self.settle(plan, deadline)
            if temp_pool and not temp_pool.closed:
                temp_pool.close()

    def produce(self, plan: Plan, msgs: dict, deadline: float) -> Any:
        """1. Producers make their arrays and messages (kills of producers meanwhile).
        Returns the pool to close under its receivers (or None); False on a hang."""
        be, seed = self.be, self.opts.seed
        t0 = time.monotonic()
        for e in plan.events:
            w = self.slots[e.target] if e.target != HUB else None
            if e.kind == "kill_producer" and w is not None:
                self.kills.append((t0 + e.delay_ms / 1e3, w))
        temp_pool = None
        for b, batch in enumerate(plan.batches):
            items = [
                (a, pattern_base(seed, (plan.number, b, a, 0)), n)
                for a, n in enumerate(batch.sizes)
            ]
            if batch.producer == HUB:
                if batch.then == "close":
                    temp_pool = be.new_pool()
                with be.using(temp_pool):
                    for a, base, n in items:
                        arr = be.arange(base, n)
                        self.own[(b, a)] = (arr, Plain(base, n))
                        for c in range(1, batch.copies):
                            msgs[(b, a, c)] = Msg(self.dumps(arr), Plain(base, n))
                        del arr
                continue
            w = self.usable(batch.producer)
            tag = (plan.number, b)
            if w is not None and w.send(("produce", tag, items, batch.copies, batch.then)):
                self.waiting[("produce", tag)] = w
                if batch.then == "return":
                    w.leaving = True  # it exits once its messages are claimed
        if not self.pump(lambda: not self.waiting, deadline):
            return False
        for b, batch in enumerate(plan.batches):
            for a, c, data in self.produced.get((plan.number, b), []):
                base = pattern_base(seed, (plan.number, b, a, 0))
                msgs[(b, a, c)] = Msg(data, Plain(base, batch.sizes[a]))
        return temp_pool

    def deliver(self, plan: Plan, msgs: dict, deadline: float) -> bool:
        """2. Every routed copy goes to its consumer (kills of consumers and forwarders at
        random moments meanwhile); the hub's own arrays go through the pipe itself."""
        seed = self.opts.seed
        t0 = time.monotonic()
        for e in plan.events:
            w = self.slots[e.target] if e.target != HUB else None
            if e.kind in ("kill_consumer", "kill_forwarder") and w is not None:
                self.kills.append((t0 + e.delay_ms / 1e3, w))
        to_hub = []
        for b, batch in enumerate(plan.batches):
            for route in batch.routes:
                expect = Plain(
                    pattern_base(seed, (plan.number, b, route.array, 0)), batch.sizes[route.array]
                )
                m = msgs.get((b, route.array, route.copy))
                if route.consumer == HUB:
                    if m is not None:
                        to_hub.append(m)
                    continue
                w = self.usable(route.consumer)
                if w is None:
                    continue
                if batch.producer == HUB and route.copy == 0:
                    arr = self.own[(b, route.array)][0]
                    mid = self.send_take(w, arr, expect, route.action)
                    del arr
                elif m is not None:
                    mid = self.send_load(w, m.data, expect, route.action)
                else:
                    continue  # its producer died before sending it
                if route.action == "forward":
                    self.forward_to[mid] = route.forward_to
        for b, batch in enumerate(plan.batches):
            if batch.producer == HUB and batch.then == "drop":
                for a in range(len(batch.sizes)):
                    self.own.pop((b, a), None)  # in limbo until its messages are claimed
        if any(e.kind == "trim_pool" for e in plan.events):
            self.be.trim()  # under receivers mapping, holding and idling
        for m in to_hub:
            self.hub_load(m.data, m.expect)
        return self.delivered(deadline)

    def send_forged(self, plan: Plan, e: Event, msgs: dict, rng: random.Random) -> None:
        """Forge field ``e.detail`` of a live message (its producer holds the array)."""
        live = [
            (b, a)
            for b, batch in enumerate(plan.batches)
            if batch.then == "hold"
            for a in range(len(batch.sizes))
        ]
        w = self.usable(e.target)
        if not live or w is None:
            return
        b, a = live[rng.randrange(len(live))]
        batch = plan.batches[b]
        genuine = None
        if batch.producer == HUB:
            data = genuine = self.dumps(self.own[(b, a)][0])  # a fresh message, ticket live
        else:
            m = msgs.get((b, a, 0))
            if m is None:
                return  # its producer died before sending it
            data = m.data
        call = peek(data)
        desc = call.args[0]
        forged = forge(desc, e.detail, rng)
        if forged is None:  # this version's descriptor has no such field
            self.r.forgeries_skipped += 1
            return
        expect = Forged(
            pattern_base(self.opts.seed, (plan.number, b, a, 0)),
            batch.sizes[a],
            desc.offset,
            desc.size,
            e.detail,
        )
        self.send_load(w, repickle(_Call(call.func, (forged, *call.args[1:]))), expect, "drop")
        if genuine is not None:  # then the message itself (its ticket claimed, not expired)
            self.send_load(w, genuine, Plain(expect.base, expect.n), "drop")

    def recycle(
        self, plan: Plan, msgs: dict, deadline: float, rng: random.Random
    ) -> tuple[list[Msg], set[int]] | None:
        """5. Producers of ``recycle`` batches drop their arrays and make new ones of the
        same sizes (their blocks' next lives when recycled); the new messages go to the
        same consumers, and a second one to another worker, which maps the block fresh
        in its new life (and holds or drops it).  Returns the old messages (stale once
        their blocks recycled) and those other workers' slots; None on a hang."""
        seed, be = self.opts.seed, self.be
        stale: list[Msg] = []
        fresh: set[int] = set()
        for b, batch in enumerate(plan.batches):
            if batch.then != "recycle":
                continue
            stale += [m for (bb, _a, _c), m in msgs.items() if bb == b]
            items = [
                (a, pattern_base(seed, (plan.number, b, a, 1)), n)
                for a, n in enumerate(batch.sizes)
            ]
            new: dict[int, tuple[bytes, Plain]] = {}
            second: dict[int, tuple[bytes, Plain]] = {}
            if batch.producer == HUB:
                old = set()
                for a in range(len(batch.sizes)):
                    arr = self.own.pop((b, a))[0]
                    old.add(be.ptr(arr))
                    del arr
                limit = time.monotonic() + 0.5
                while be.stats().get("limbo_blocks", 0) and time.monotonic() < limit:
                    self.sleep(0.005)
                for a, base, n in items:
                    arr = be.arange(base, n)
                    self.r.recycled += be.ptr(arr) in old
                    self.own[(b, a, "next")] = (arr, Plain(base, n))
                    new[a] = (self.dumps(arr), Plain(base, n))
                    second[a] = (self.dumps(arr), Plain(base, n))
                    del arr
            else:
                w = self.usable(batch.producer)
                if w is None:
                    continue
                tag = (plan.number, b, "next")
                if w.send(("recycle", (plan.number, b), tag, items)):
                    self.waiting[("produce", tag)] = w
                if not self.pump(self.answered(("produce", tag)), deadline):
                    return None
                for a, c, data in self.produced.get(tag, []):
                    expect = Plain(items[a][1], items[a][2])
                    (new if c == 0 else second)[a] = (data, expect)
            for route in batch.routes:
                tw = self.usable(route.consumer)
                if tw is not None and route.copy == 0 and route.array in new:
                    data, expect = new[route.array]
                    self.send_load(tw, data, expect, "drop")
            had = {r.consumer for r in batch.routes}
            had |= {r.forward_to for r in batch.routes if r.action == "forward"}
            live = [i for i in range(len(self.slots)) if self.usable(i) is not None]
            others = [i for i in live if i not in had] or live
            for a, (data, expect) in sorted(second.items()):
                msgs[(b, a, "next")] = Msg(data, expect)
                if not others:
                    continue
                target = rng.choice(others)
                w = self.usable(target)
                if w is not None:
                    fresh.add(target)
                    self.send_load(w, data, expect, rng.choice(("hold", "drop")))
        if not self.delivered(deadline):
            return None
        return stale, fresh

    def killed_writer(self, plan: Plan, e: Event, deadline: float) -> bool:
        """7. A receiver queues a write behind a long kernel and is killed; the hub drops
        the array and reuses the memory: its new data must survive the killed write."""
        be = self.be
        w = self.usable(e.target)
        if w is None:
            return True
        n = SIZES[-1]
        base = pattern_base(self.opts.seed, (plan.number, "writer"))
        arr = be.arange(base, n)
        mid = self.send_take(w, arr, Plain(base, n), "write")
        if not self.pump(self.answered(("mid", mid)), deadline):
            return False
        self.kill(w)
        held = be.pool_bytes()[1]
        del arr  # in limbo (held for sharing) until the killed process is gone
        if be.pool_bytes()[1] > held:  # wait for it to be let go, to reuse its memory
            limit = time.monotonic() + 5.0
            while be.pool_bytes()[1] > held and time.monotonic() < limit:
                self.sleep(0.01)
        reuse = []
        for k in range(4):
            b2 = pattern_base(self.opts.seed, (plan.number, "writer", k))
            reuse.append((be.arange(b2, n), Plain(b2, n)))
        self.sleep(2 * WRITER_SPIN_MS / 1e3)  # longer than the killed kernel's spin
        for x, expect in reuse:
            o, d = _check(self.be, x, expect)
            self.outcome(o, "the hub's memory reused after a killed writer: " + d)
        return True

    def hang(self, plan: Plan, phase: str) -> None:
        who = sorted({w.wid for w in self.waiting.values()})
        what = sorted(str(k) for k in self.waiting)[:6]
        self.r.note("hangs", plan.number, f"{phase}: no answer from workers {who} for {what}")
        for w in list(self.workers):
            if w.wid in who:
                self.kill(w)
        self.waiting.clear()

    # -- after a round: everyone lets go; the hub's counters come back -------------------------------
    def settle(self, plan: Plan, deadline: float) -> None:
        be = self.be
        self.waiting.clear()
        self.ask_all("settle", "settled")
        if not self.pump(lambda: not self.waiting, max(deadline, time.monotonic() + 10)):
            self.hang(plan, "settling")
        self.recheck_own()
        self.reap()
        gc.collect()
        be.sync()
        limit = time.monotonic() + SETTLE_S
        assert self.base is not None
        while True:
            be.collect()
            found = leaks(self.base, self.counters())
            if not found or time.monotonic() > limit:
                break
            self.sleep(0.02)
            self.reap()
        if found:
            if any(f.startswith("fds[") for f in found):
                found.append(f"open: {fd_targets()}")
            found.append(holding(self.counters(), self.be.pool_detail()))
            self.r.note("leaks", plan.number, "; ".join(found))

    def recheck_own(self) -> None:
        """Re-read the hub's own arrays, then let them go.  (In a function of its own: a
        loop variable left in :meth:`settle` would keep the last array alive through
        the leak check, and count its block as leaked.)"""
        for arr, expect in self.own.values():
            o, d = _check(self.be, arr, expect)
            if o != "ok":
                self.outcome(o, "the hub's own array re-read: " + d)
        self.own.clear()

    def counters(self) -> Counters:
        used, held = self.be.pool_bytes()
        return Counters(
            open_fds(), threading.active_count(), used, held, self.be.stats(), len(self.workers)
        )

    def start(self) -> None:
        """Start what the hub keeps for good (sharing's listener and ticket threads, the
        pools' retirer, multiprocessing's resource tracker), then take the baseline."""
        from multiprocessing import resource_tracker
        from multiprocessing.reduction import ForkingPickler

        be = self.be
        be.setup(HUB_SETTINGS)
        resource_tracker.ensure_running()
        pool = be.new_pool()
        with be.using(pool):
            x = be.arange(0, 8)
        y = ForkingPickler.loads(ForkingPickler.dumps(x))  # a message to itself
        be.view(y)
        del x, y
        x = be.arange(0, 8)
        y = ForkingPickler.loads(ForkingPickler.dumps(x))
        del x, y
        pool.close()
        be.trim()
        gc.collect()
        be.sync()
        be.collect()
        base = self.counters()
        for _ in range(30):  # threads started above (a retirer) may still be ending
            time.sleep(0.1)
            now = self.counters()
            if now.threads >= base.threads and sum(now.fds.values()) >= sum(base.fds.values()):
                break
            base = now
        self.base = base

    def stop(self) -> None:
        for w in self.workers:
            if not w.gone:
                w.send(("exit",))
        end = time.monotonic() + 10
        for w in self.workers:
            w.proc.join(max(end - time.monotonic(), 0.1))
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(5)


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
    from ._common import require_gpu

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


if __name__ == "__main__":
    # The importable module's names, not __main__'s: the workers unpickle the
    # expectations (Plain, Forged) by the module's name.
    from cupy_poolmem.benchmarks.chaos import main as _main

    sys.exit(_main())
