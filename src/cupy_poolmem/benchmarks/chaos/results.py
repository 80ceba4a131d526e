"""The run's result, its leak checks and the summary line (pure)."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import NamedTuple


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
