"""The sharing protocol's model: a Hypothesis state machine over simulated processes.

Exporters, receivers and forwarders (``fakes.sharing.SimProc``: the package's real
protocol code and transport, a fake GPU) are driven through random sequences of
allocations, sends, copies of messages delivered late or to other processes, forged
fields, drops in any process, recycling and trims, ticket expiry, normal exits, kills
and forks.  After every step the invariants at the top of ``cupy_poolmem._sharing``
are checked; each check names the invariant (I1..I7) it covers.

CI runs a small budget.  A long search::

    CUPY_POOLMEM_MODEL_STEPS=1000000 CUPY_POOLMEM_MODEL_STEPS_PER_EXAMPLE=100 \
    CUPY_POOLMEM_MODEL_NO_SHRINK=1 CUPY_POOLMEM_MODEL_REPORT=model.log \
    python -m pytest --timeout=0 tests/test_sharing_model_cpu.py -k TestSharing

(about 1,000 steps a second on one core; the report file gets its progress, and a
failure's steps and traceback even when Hypothesis's replay of it takes another path).
Every counter-example found stays below as an explicit regression test.
"""

from __future__ import annotations

import functools
import gc
import os
import pickle
import struct
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from fakes.sharing import World, open_fds, sharing_threads, wait_for

from cupy_poolmem._errors import PoolmemError, SharingError
from cupy_poolmem._sharing._exporter import LocalHold
from cupy_poolmem._sharing._importer import Imported

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

KB = 1024
S0 = 0
MAX_PROCS = 4
IDX = st.integers(0, 15)  # an index into a list of the model (modulo its length)
MAX_BLOCKS = 3  # blocks alive at once (allocation is always possible: capped)
MAX_MSGS = 12  # messages remembered for late copies (oldest forgotten)
STEP_LIMIT_S = 8.0  # I7: no step waits longer (claim_timeout is 1 s)
PROC_SETTINGS = dict(claim_timeout=1.0, exit_timeout=0.02, inflight_timeout=30.0)
STEPS_RUN = [0]  # steps taken in this session (the long search reports it)
EXAMPLES_RUN = [0]
FULL_GC = [0]  # runs whose end needed a full garbage collection (reported)
RULES_RUN: Counter[str] = Counter()  # rule name -> times run (the long search reports it)


def counted(f: Any) -> Any:
    """Count the rule's runs in RULES_RUN, and trace them (see :func:`traced`)."""

    @functools.wraps(f)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        RULES_RUN[f.__name__] += 1
        self.trace.append(f"{f.__name__}({kwargs})")
        return traced(f)(self, *args, **kwargs)

    return run


def traced(f: Any) -> Any:
    """On a failure, append the run's steps and the traceback to the file named by
    CUPY_POOLMEM_MODEL_REPORT: Hypothesis replays a failing run to report it, and a
    replay of threads and sockets may take another path (it then reports only that
    the replay differed)."""

    @functools.wraps(f)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return f(self, *args, **kwargs)
        except Exception:  # (Hypothesis ends a run with a BaseException: not ours)
            out = os.environ.get("CUPY_POOLMEM_MODEL_REPORT")
            if out and not self.reported:
                self.reported = True
                import traceback

                with open(out, "a") as fh:
                    fh.write("FAILURE in " + f.__name__ + "\n  " + "\n  ".join(self.trace))
                    fh.write("\n" + traceback.format_exc() + "\n")
            raise

    return run


FORGEABLE = (
    "ticket",
    "export_id",
    "size",
    "offset",
    "strides",
    "dtype",
    "life",
    "block",
    "pool_kind",
)


@dataclass
class Proc:
    sim: Any
    alive: bool = True
    forked: bool = False  # a fork child of a parent that used CUDA: refuses to share
    pools: dict = field(default_factory=dict)  # recycle flag -> FakeCore
    expired_at: int = 0  # the step of its exporter's last forced expiry


@dataclass
class Msg:
    data: bytes
    payload: int  # what every array of it must read (I1)
    gen: int  # the allocation's generation (a forged life may read this block only)
    exporter: Proc
    sender: Proc
    source: int  # the token of the block or array it came from (never a reference)
    step: int
    forged: str | None = None
    tainted: bool = False  # a forged copy may have given its ticket back


@dataclass
class Held:
    proc: Proc
    owner: Any
    payload: int | None  # None: a forged life, any data of block ``gen`` (see docs)
    gen: int
    msg: Msg
    tok: int = 0


class SharingModel(RuleBasedStateMachine):
    """Processes share arrays; the fake GPU and the reads say what each one sees."""

    def __init__(self) -> None:
        super().__init__()
        self.threads_before = set(sharing_threads())
        self.fds_before = open_fds()
        self.world = World()
        self.procs: list[Proc] = []
        self.blocks: list[tuple[Proc, Any, int, int]] = []  # (exporter, block, payload, token)
        self.msgs: list[Msg] = []
        self.held: list[Held] = []
        self.payloads = 0
        self.tokens = 0
        self.steps = 0
        self.names = 0
        self.trace: list[str] = []  # the steps so far, with their draws (for a report)
        self.reported = False
        self.t0 = time.monotonic()

    # -- helpers -----------------------------------------------------------------------
    def _new_proc(self, forked: bool = False) -> Proc:
        self.names += 1
        sim = self.world.proc(f"p{self.names}", **PROC_SETTINGS)
        if forked:
            sim.ctx.forked = True
        p = Proc(sim, forked=forked)
        self.procs.append(p)
        return p

    def _live(self) -> list[Proc]:
        return [p for p in self.procs if p.alive]

    def _pick(self, among: list, i: int) -> Any:
        """``among[i]`` (modulo its length), None if empty."""
        return among[i % len(among)] if among else None

    def _pool(self, p: Proc, recycle: bool) -> Any:
        core = p.pools.get(recycle)
        if core is None:
            core = p.pools[recycle] = p.sim.pool(recycle=recycle)
        return core

    def _remember(self, m: Msg) -> None:
        self.msgs.append(m)
        if len(self.msgs) > MAX_MSGS:
            self.msgs.pop(0)

    def _source_alive(self, m: Msg) -> bool:
        """Whether what sent ``m`` still holds its memory (a block, or a received array)."""
        return any(h.tok == m.source for h in self.held) or any(
            b[3] == m.source for b in self.blocks
        )

    def _must_succeed(self, m: Msg, target: Proc) -> bool:
        """A genuine message whose sender still holds its memory, nothing expired since
        it was made, and every process involved alive, is received (I2's other side)."""
        return (
            m.forged is None
            and not m.tainted
            and target.alive
            and not target.forked
            and m.exporter.alive
            and m.sender.alive
            and m.exporter.expired_at < m.step
            and self._source_alive(m)
        )

    def _ptr_of(self, m: Msg) -> int:
        """The exporter's address of the block message ``m`` names (its export record)."""
        d = pickle.loads(m.data)
        return struct.unpack_from("<8sQQ", d.export_data)[2]

    def _end(self, p: Proc, how: str) -> None:
        p.alive = False
        # Its arrays and blocks go with it (the model drops its references).
        self.held = [h for h in self.held if h.proc is not p]
        self.blocks = [b for b in self.blocks if b[0] is not p]
        if how == "exit":
            p.sim.exit()
        else:
            p.sim.kill()

    def _take(
        self, p: Proc, m: Msg, data: bytes, payload: int | None, genuine: bool = True
    ) -> None:
        """Deliver ``data`` (a copy of ``m``, maybe forged) to ``p``: its own data (I1),
        or a typed refusal."""
        must = genuine and payload is not None and self._must_succeed(m, p)
        try:
            owner = p.sim.recv(data)
        except PoolmemError as exc:
            assert not must, f"a live message was refused in {p.sim.name}: {exc}"
            if p.forked:
                return
            assert isinstance(exc, SharingError), exc
            return
        if payload is None:
            # I1, I5 (a forged next life, docs/sharing.rst "Trust boundary"): taken
            # without a round trip on a mapping the receiver holds, of that block only.
            # What the block holds now is not the receiver's to read in order (the
            # exporter may be rewriting it), so it is not read, and let go at once.
            assert isinstance(owner, Imported), owner
            imp = self.world.gpu.proc(p.sim.name).imports[owner.ptr]
            assert imp.alloc.gen == m.gen and imp.alloc.ptr == self._ptr_of(m)
            return
        gen, got = p.sim.read(owner, S0 if isinstance(owner, Imported) else None)
        assert got == payload, f"{p.sim.name} read {got}, was sent {payload} ({m.forged})"
        self.tokens += 1
        self.held.append(Held(p, owner, payload, m.gen, m, self.tokens))

    # -- rules -------------------------------------------------------------------------
    @initialize()
    def start(self) -> None:
        for _ in range(3):
            self._new_proc()

    # Every rule draws the same values whatever the state (no preconditions, indexes
    # taken modulo the lists' lengths; a rule with nothing to act on does nothing): a
    # replay whose threads answered in another order draws the same way.
    @rule(
        kind=st.sampled_from(("spawn", "fork", "trim", "trim_idle", "expire", "exit", "kill")),
        i=IDX,
    )
    @counted
    def disrupt(self, kind: str, i: int) -> None:
        """One of the rarer events (one rule, so that the sharing rules get most steps):
        a new process, trims, ticket expiry, a normal exit, a SIGKILL."""
        live = self._live()
        if kind in ("spawn", "fork"):
            if len(live) < MAX_PROCS:
                self._new_proc(forked=kind == "fork")
        elif kind == "trim":  # recycled blocks to their final free
            p = self._pick([p for p in live if p.pools], i)
            for core in p.pools.values() if p is not None else ():
                core.flush_cache()
        elif kind == "trim_idle":  # a receiver unmaps its idle mappings
            p = self._pick([p for p in live if not p.forked], i)
            if p is not None:
                p.sim.importer.trim_idle(0)
        elif kind == "expire":  # every ticket out is older than inflight_timeout
            p = self._pick([p for p in live if p.pools], i)
            if p is not None:
                p.expired_at = self.steps
                p.sim.exporter.expire(now=time.monotonic() + 3600.0)
        elif len(live) > 1:
            self._end(self._pick(live, i), kind)

    @rule(
        size=st.sampled_from((KB, KB, KB, 2 * KB)),
        recycle=st.sampled_from((True, True, True, False)),
        i=IDX,
    )
    @counted
    def allocate(self, size: int, recycle: bool, i: int) -> None:
        p = self._pick([p for p in self._live() if not p.forked], i)
        if p is None or len(self.blocks) >= MAX_BLOCKS:
            return
        self.payloads += 1
        b = self._pool(p, recycle).alloc(size, payload=self.payloads)
        self.tokens += 1
        self.blocks.append((p, b, self.payloads, self.tokens))

    @rule(i=IDX)
    @counted
    def send(self, i: int) -> None:
        if not self.blocks:
            return
        p, b, payload, tok = self._pick(self.blocks, i)
        gen = b.read()[0]
        self._remember(Msg(p.sim.send(b), payload, gen, p, p, tok, self.steps))

    @rule(i=IDX)
    @counted
    def forward(self, i: int) -> None:
        h = self._pick([h for h in self.held if isinstance(h.owner, Imported)], i)
        if h is None:
            return
        try:
            msg = h.proc.sim.send(h.owner)
        except SharingError:
            assert not self._must_forward(h), "a live forward was refused"
            return
        self._remember(Msg(msg, h.payload, h.gen, h.msg.exporter, h.proc, h.tok, self.steps))

    def _must_forward(self, h: Held) -> bool:
        return h.msg.exporter.alive and h.proc.alive

    @rule(i=IDX)
    @counted
    def deliver_newest(self, i: int) -> None:
        """The message just sent arrives somewhere (the common case)."""
        p = self._pick(self._live(), i)
        if self.msgs and p is not None:
            m = self.msgs[-1]
            self._take(p, m, m.data, m.payload)

    @rule(i=IDX, j=IDX)
    @counted
    def deliver(self, i: int, j: int) -> None:
        """A copy of a message (sent now, or kept: a second queue, a file) arrives."""
        m, p = self._pick(self.msgs, i), self._pick(self._live(), j)
        if m is not None and p is not None:
            self._take(p, m, m.data, m.payload)

    @rule(what=st.sampled_from(FORGEABLE), i=IDX, j=IDX, v=IDX)
    @counted
    def forge(self, what: str, i: int, j: int, v: int) -> None:
        """A copy with one field changed arrives: its own data, or a refusal; a forged
        life maps nothing but the block it names (I1, I5)."""
        m, p = self._pick(self.msgs, i), self._pick(self._live(), j)
        if m is None or p is None:
            return
        d = pickle.loads(m.data)
        other = pickle.loads(self.msgs[v % len(self.msgs)].data)
        change = {
            "ticket": lambda: {"ticket": os.urandom(16)},
            "export_id": lambda: {"export_id": d.export_id + (1, 7)[v % 2]},
            "size": lambda: {"size": 64 * d.size, "shape": (64 * d.size,)},
            "offset": lambda: {"offset": d.size, "shape": (1,)},
            "strides": lambda: {"strides": (-1,)},
            "dtype": lambda: {"dtype": ("|O", "<f8", "<u2")[v % 3]},
            "life": lambda: {"life": max(d.life + (-1, 1, 2)[v % 3], 0)},
            # another message's allocation (maybe of another pool) with this live ticket
            "block": lambda: {"pool_uuid": other.pool_uuid, "export_data": other.export_data},
            # another kind of pool (a host array on a device block, or a host pool)
            "pool_kind": lambda: {
                "pool_kind": (d.pool_kind + 1 + v % 2) % 3,
                "kind": ("cupy", "numpy")[v % 2],
            },
        }[what]()
        self.trace.append(f"  forged {change}")
        m.tainted = True  # a refused copy may give the genuine ticket back
        forged = pickle.dumps(d._replace(**change))
        # A forged life names the right block: what it reads is that block's (docs).
        payload = None if what == "life" and change["life"] != d.life else m.payload
        self._take(p, m, forged, payload, genuine=False)

    @rule(i=IDX)
    @counted
    def drop_array(self, i: int) -> None:
        h = self._pick(self.held, i)
        if h is not None:
            self.held.remove(h)
            del h  # the last reference: its owner goes now (no cycle holds it)

    @rule(i=IDX)
    @counted
    def drop_block(self, i: int) -> None:
        """The exporter lets go of its block: freed, limbo, or recycled (a later life)."""
        b = self._pick(self.blocks, i)
        if b is not None:
            self.blocks.remove(b)
            del b
            self._quiesce()  # its receivers may say Idle now: recycled before the next alloc

    @rule()
    @counted
    def settle(self) -> None:
        """Time passes: the frames on their way arrive and are answered (Hits, Idles,
        Releases, Unmaps, Evicts), so a dropped block may be recycled before the next
        allocation (the other rules run back to back, faster than any frame)."""
        self._quiesce()

    def _quiesce(self) -> None:
        for _ in range(3):  # Release -> Idle -> recycle: two hops and an answer
            for p in self._live():
                ctx = p.sim.ctx
                if ctx._importer is not None:
                    ctx._importer.flush(1.0)
                if ctx._exporter is not None:
                    for peer in list(ctx._exporter.peers.values()):
                        peer.sender.flush(1.0)
            time.sleep(0.001)

    def check(self) -> None:
        """Every invariant (what Hypothesis runs after each step)."""
        self.i1_arrays_read_the_life_they_were_sent()
        self.i3_nothing_freed_or_reused_under_a_mapping()
        self.i5_no_mapping_outside_its_block()
        self.i7_no_step_waits_without_a_bound()

    # -- invariants (I-numbers: cupy_poolmem/_sharing/__init__.py) -------------------------
    @invariant()
    @traced
    def i1_arrays_read_the_life_they_were_sent(self) -> None:
        """I1: every array alive reads its own message's data (a forged life: its block)."""
        self.steps += 1
        for h in self.held:
            gen, got = h.proc.sim.read(h.owner, S0 if isinstance(h.owner, Imported) else None)
            if h.payload is None:
                assert gen == h.gen
            else:
                assert got == h.payload, f"{h.proc.sim.name} reads {got}, was sent {h.payload}"

    @invariant()
    @traced
    def i3_nothing_freed_or_reused_under_a_mapping(self) -> None:
        """I3/I4: the fake GPU saw no free, reuse or rewrite before every importer's
        free and last use, no double import, no use of a closed event or pool."""
        assert self.world.gpu.violations == []

    @invariant()
    @traced
    def i5_no_mapping_outside_its_block(self) -> None:
        """I5: every mapping is exactly its block's size; every array lies inside it."""
        gpu = self.world.gpu
        for p in self._live():
            imp = p.sim.ctx._importer
            if imp is None:
                continue
            fake = gpu.proc(p.sim.name)
            with imp.lock:
                maps = list(imp.maps.values())
            for m in maps:
                i = fake.imports.get(m.ptr)
                if i is not None and m.leased:
                    assert m.size == i.alloc.size, (m.size, i.alloc.size)
        for h in self.held:
            if isinstance(h.owner, Imported):
                assert h.owner.size == h.owner.m.size
            elif isinstance(h.owner, LocalHold):
                assert h.owner.size == h.owner.rec.size

    @invariant()
    @traced
    def i7_no_step_waits_without_a_bound(self) -> None:
        """I7: every step (claims, exits, trims) ends within its timeouts."""
        now = time.monotonic()
        assert now - self.t0 < STEP_LIMIT_S, f"a step took {now - self.t0:.1f} s"
        self.t0 = now

    # -- the end: everything let go returns to baseline ------------------------------------
    @traced
    def teardown(self) -> None:
        try:
            self._let_go_and_check()
        finally:
            self.world.teardown()
            self.held.clear()
            self.blocks.clear()
            gc.collect(0)
            STEPS_RUN[0] += self.steps
            EXAMPLES_RUN[0] += 1
            out = os.environ.get("CUPY_POOLMEM_MODEL_REPORT")
            if out and EXAMPLES_RUN[0] % 500 == 0:  # the long search's progress
                with open(out, "a") as fh:
                    fh.write(
                        f"progress steps={STEPS_RUN[0]} full_gc={FULL_GC[0]} at {time.ctime()}\n"
                    )
        left = lambda: [t for t in sharing_threads() if t not in self.threads_before]  # noqa: E731
        assert wait_for(lambda: not left(), 5.0), f"I6: threads left: {left()}"
        assert wait_for(lambda: open_fds() <= self.fds_before, 5.0), "I6: fds left open"
        assert self.world.gpu.violations == []

    def _records(self, p: Proc) -> list[str]:
        """What holds each exported block of ``p`` (for an I6 failure's message)."""
        exp = p.sim.ctx._exporter
        out = []
        for rec in list(exp.records.values()) if exp is not None else ():
            block = rec.block_ref()
            held_by = [type(r).__name__ for r in gc.get_referrers(block)] if block else []
            out.append(
                f"record {rec.export_id} life {rec.life} local {rec.local} limbo "
                f"{rec.in_limbo} dormant {rec.core is None} block held by {held_by}"
            )
        return out

    def _let_go_and_check(self) -> None:
        """I6: once every process lets go, every counter returns to zero."""
        self.held.clear()
        self.blocks.clear()
        gc.collect(0)
        live = [p for p in self._live() if not p.forked]
        now = time.monotonic() + 3600.0
        for p in live:
            if p.sim.ctx._exporter is not None:
                p.sim.exporter.expire(now=now)
            for core in p.pools.values():
                core.flush_cache()

        def settled() -> bool:
            for p in live:
                imp = p.sim.ctx._importer
                if imp is not None:
                    imp.trim_idle(0)
                    imp.flush(0.5)
                for core in p.pools.values():
                    core.flush_cache()
            exporters = {q.sim.ctx.exporter_address() for q in live} - {None}
            for p in live:
                imp = p.sim.ctx._importer
                if imp is not None:
                    with imp.lock:
                        # a gone exporter's connection, events and pools are forgotten
                        if set(imp.clients) - exporters or imp._closing_pools:
                            return False
                        if any(q.client is None or q.client.closed for q in imp.pools.values()):
                            return False
                st_ = p.sim.stats()
                if any(
                    st_.get(k, 0)
                    for k in (
                        "exported_blocks",
                        "limbo_blocks",
                        "limbo_bytes",
                        "tickets_out",
                        "leases",
                        "imported_blocks",
                        "idle_mappings",
                    )
                ):
                    return False
            return True

        if not wait_for(settled, 1.0):
            # A block kept by a reference cycle (say, an array in a traceback) goes
            # with a full collection only: counted, and reported at the end.
            gc.collect()
            FULL_GC[0] += 1
        assert wait_for(settled, 5.0), "I6: " + "; ".join(
            f"{p.sim.name}: {p.sim.stats()} {self._records(p)}" for p in live
        )
        gpu = self.world.gpu
        for p in live:
            assert gpu.live_imports(p.sim.name) == [], f"I6: {p.sim.name} still maps"


def _budget() -> tuple[int, int]:
    """(examples, steps per example): CI's small budget, or the long search's."""
    total = int(os.environ.get("CUPY_POOLMEM_MODEL_STEPS", "0") or 0)
    per = int(os.environ.get("CUPY_POOLMEM_MODEL_STEPS_PER_EXAMPLE", "40"))
    if total:
        return max(total // per, 1), per
    return 200, 40


_EXAMPLES, _STEPS = _budget()
SharingModel.TestCase.settings = settings(
    max_examples=_EXAMPLES,
    stateful_step_count=_STEPS,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=not os.environ.get("CUPY_POOLMEM_MODEL_STEPS"),
    database=None,
    phases=(
        [hypothesis.Phase.explicit, hypothesis.Phase.generate]
        if os.environ.get("CUPY_POOLMEM_MODEL_NO_SHRINK")
        else list(hypothesis.Phase)
    ),
)


class TestSharingModel(SharingModel.TestCase):  # type: ignore[name-defined]
    @classmethod
    def tearDownClass(cls) -> None:
        out = os.environ.get("CUPY_POOLMEM_MODEL_REPORT")
        if out:
            with open(out, "a") as f:
                f.write(f"steps={STEPS_RUN[0]} full_gc={FULL_GC[0]} rules={dict(RULES_RUN)}\n")


# -- counter-examples the model found, kept as explicit sequences ----------------------------
def _run(steps: list[tuple[str, dict]]) -> SharingModel:
    """Run rules by name, checking every invariant after each."""
    m = SharingModel()
    ok = False
    try:
        m.start()
        m.check()
        for name, kw in steps:
            getattr(m, name)(**kw)
            m.check()
        ok = True
    finally:
        if ok:
            m.teardown()
        else:
            m.world.teardown()
    return m


def test_model_a_stale_copy_reaches_a_receiver_that_mapped_the_next_life_fresh():
    """p1 exports a recyclable block; p2 takes life 1 and lets go; the block is recycled
    and sent in life 2 to p3, which maps it fresh; life 1's message then reaches p3."""
    _run(
        [
            ("allocate", {"size": KB, "recycle": True, "i": 0}),  # p1's block, life 1
            ("send", {"i": 0}),  # msg 0
            ("deliver", {"i": 0, "j": 1}),  # p2 takes it
            ("drop_array", {"i": 0}),
            ("drop_block", {"i": 0}),  # p1 lets go: p2 asked to say Idle, recycled
            ("settle", {}),
            ("allocate", {"size": KB, "recycle": True, "i": 0}),  # the same block, life 2
            ("send", {"i": 0}),  # msg 1
            ("deliver", {"i": 1, "j": 2}),  # p3 maps life 2 fresh
            ("deliver", {"i": 0, "j": 2}),  # the copy of life 1 reaches p3: refused
        ]
    )


def test_model_a_forged_later_life_does_not_change_what_a_busy_mapping_serves():
    """p2 holds an array of life 1; a copy with its life forged to 2 arrives (a hit
    used to move the mapping to life 2); p2 forwards its genuine array back to p1,
    which must take it (the forward carried the forged life and was refused)."""
    _run(
        [
            ("allocate", {"size": KB, "recycle": True, "i": 0}),
            ("send", {"i": 0}),
            ("deliver", {"i": 0, "j": 1}),  # p2 holds an array of life 1
            (
                "forge",
                {"what": "life", "i": 0, "j": 1, "v": 1},
            ),  # life 2 reaches p2: claimed, refused
            ("forward", {"i": 0}),  # p2 sends its genuine array on
            ("deliver_newest", {"i": 0}),  # back in p1: its own block, life 1
        ]
    )


def test_model_a_forged_next_life_maps_only_its_block_and_is_not_read():
    """p2 keeps life 1 of a recycled block idle; the block is reused (payload 2) and a
    copy of life 1's message with its life forged to 2 reaches p2: a hit without a
    round trip, on that block (docs: Trust boundary).  Reading it then, unordered with
    the exporter's next rewrite, was flagged by the fake GPU: the model does not read
    what a forged life names, it checks the block."""
    _run(
        [
            ("allocate", {"size": KB, "recycle": True, "i": 0}),
            ("send", {"i": 0}),
            ("deliver", {"i": 0, "j": 1}),
            ("drop_array", {"i": 0}),
            ("drop_block", {"i": 0}),  # recycled once p2 said Idle for life 1
            ("allocate", {"size": KB, "recycle": True, "i": 0}),  # reused, not sent yet
            ("forge", {"what": "life", "i": 0, "j": 1, "v": 1}),
            ("drop_block", {"i": 0}),
            ("allocate", {"size": KB, "recycle": True, "i": 0}),  # rewritten
            ("forge", {"what": "life", "i": 0, "j": 0, "v": 0}),  # life 0 in p1: refused
        ]
    )


def test_model_a_live_ticket_with_another_blocks_allocation_maps_nothing():
    """p1 sends block 0 (payload 1) and block 1 (payload 2) of one pool; a copy of block
    1's message (its ticket live) naming block 0's export data reaches p2: the exporter
    granted the ticket and p2 read block 0 (1 KiB) as block 1 (2 KiB), under block 1's
    lease.  (Naming another pool, the pool's descriptor sent for block 1 was imported
    under the other pool's uuid.)"""
    _run(
        [
            ("allocate", {"size": KB, "recycle": True, "i": 0}),
            ("allocate", {"size": 2 * KB, "recycle": True, "i": 0}),  # the same pool
            ("send", {"i": 0}),  # msg 0: block 0
            ("send", {"i": 1}),  # msg 1: block 1
            ("forge", {"what": "block", "i": 1, "j": 1, "v": 0}),  # refused
            ("deliver", {"i": 1, "j": 1}),  # the genuine message: its own data
            ("deliver", {"i": 0, "j": 1}),
        ]
    )


def test_the_invariants_are_one_list_and_each_is_checked_where_it_says():
    """The package's invariant lines are docs/sharing.rst's, and each model check the
    list names exists and cites its invariant."""
    import re
    from pathlib import Path

    import cupy_poolmem._sharing as sharing

    root = Path(__file__).resolve().parents[1]
    doc = sharing.__doc__ or ""
    ours = [ln.strip() for ln in doc[doc.index("I1 ") :].splitlines() if ln.strip()]
    rst = (root / "docs" / "sharing.rst").read_text(encoding="utf-8")
    assert all(ln in rst for ln in ours), [ln for ln in ours if ln not in rst]
    ids = re.findall(r"^(I\d+) ", doc, re.M)
    assert ids == [f"I{i}" for i in range(1, len(ids) + 1)]
    for name in re.findall(r"model: ([^)]*)\)", doc):
        for part in name.split(","):
            part = part.strip().rstrip("*").strip('"')
            if part.startswith("i") and part[1].isdigit():
                checks = [n for n in dir(SharingModel) if n.startswith(part)]
                assert checks, part
                for n in checks:
                    assert f"I{part[1]}" in (getattr(SharingModel, n).__doc__ or ""), n
