"""The hub: workers, routing, events, checks and the baseline of each round."""

from __future__ import annotations

import argparse
import gc
import os
import random
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

from .backends import WRITER_SPIN_MS
from .checks import Forged, Plain
from .forging import Call, forge, peek, repickle
from .results import Counters, Result, fd_targets, holding, leaks, open_fds
from .scenario import HUB, SIZES, Event, Plan, pattern_base
from .worker import check_received, classify_exc, worker_main

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
        parent, child = ctx.Pipe()
        self.wid = wid
        self.proc = ctx.Process(
            target=worker_main, args=(child, wid, backend), name=f"chaos-{wid}", daemon=True
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
            self.outcome(*classify_exc(exc))
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
            self.outcome(*classify_exc(exc))
            return
        o, d = check_received(self.be, arr, expect)
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
        self.send_load(w, repickle(Call(call.func, (forged, *call.args[1:]))), expect, "drop")
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
            o, d = check_received(self.be, x, expect)
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
            o, d = check_received(self.be, arr, expect)
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
