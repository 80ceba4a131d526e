"""The sharing protocol over blocks of mapped and expandable pools: a Hypothesis state
machine driving simulated processes (``fakes.sharing`` with ``fakes.step_sharing``:
the package's real exporter, wire, transport and importer; physical memory on the VMM
fake) through random allocations, sends, late deliveries, copies of messages, drops,
frees, trims, SIGKILLed and exiting receivers and messages replayed after their block
went and the range shrank.

Invariants after every step: every array a receiver holds reads exactly the bytes its
message was sent with; every step a receiver maps is still the exporter's step at that
address (the pin rule: no trim or shrink unmaps it); a receiver reserves exactly the
steps of its windows; the exporter's book pins every step a live receiver maps.  At the
end, once everybody let go: no lease, pin, window, reservation or step is left.

``test_the_model_fails_when_an_exporter_frees_under_its_receivers`` runs it with the
exporter's limbo taken out and expects a receiver's read to catch it; without the pin
rule alone it still holds (limbo keeps every leased block, and so its steps, live).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import pytest
from fakes.sharing import World, sharing_threads, wait_for
from fakes.step_sharing import read_here, step_pool
from fakes.steps import StepVmm

from cupy_poolmem._errors import SharingError

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

KiB, MiB = 1 << 10, 1 << 20
SIZES = [1, 4 * KiB, 300 * KiB, 1000 * KiB, MiB + 1, 3 * MiB, 19 * MiB, 21 * MiB, 45 * MiB]
IDX = st.integers(0, 15)
MAX_BLOCKS = 4
PROC = dict(claim_timeout=2.0, exit_timeout=0.05, inflight_timeout=30.0)


@dataclass
class Msg:
    data: bytes
    payload: int
    size: int
    block_alive: bool = True  # its exporter still holds the block
    delivered: int = 0


@dataclass
class Held:
    proc: Any
    owner: Any
    payload: int
    size: int


@pytest.fixture(autouse=True)
def _vmm_seat(monkeypatch, fake_driver):
    """Each example's VMM fake is the driver the package calls (the mapped blocks' events
    ask it), with no device switching."""
    from cupy_poolmem import _device

    monkeypatch.setattr(_device, "on_device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(StepBlocksModel, "seat", fake_driver)


class StepBlocksModel(RuleBasedStateMachine):
    mode = "expandable"
    pin_rule = True
    mutant = False  # a protocol rule taken out: refusals are allowed, reads are checked
    seat: Any = None  # fake_driver (see _vmm_seat)

    def __init__(self) -> None:
        super().__init__()
        self.threads0 = set(sharing_threads())
        self.world = World()
        self.vmm = self.world.gpu.vmm = self.seat(StepVmm())
        self.e = self.world.proc("e", **PROC)
        self.core = step_pool(self.e, self.vmm, self.mode)
        if not self.pin_rule:
            self.core.placement.is_pinned = lambda va: False
        self.receivers = [self.world.proc(f"r{i}", **PROC) for i in range(2)]
        self.receivers.append(self.world.proc("r2", keep_mappings=0, **PROC))
        self.names = 3
        self.blocks: list[tuple[Any, int, list[Msg]]] = []  # (block, payload, its messages)
        self.msgs: list[Msg] = []
        self.held: list[Held] = []
        self.payloads = iter(range(1, 1 << 30))

    def _pick(self, among: list, i: int) -> Any:
        return among[i % len(among)] if among else None

    # -- the exporter ----------------------------------------------------------------------
    @initialize(sizes=st.lists(st.sampled_from(SIZES), min_size=1, max_size=3), j=IDX)
    def start(self, sizes, j):
        """Blocks to share from the start, the first one sent."""
        for n in sizes:
            self.alloc(n)
        self.send(0, j)

    @rule(size=st.sampled_from(SIZES))
    def alloc(self, size):
        if len(self.blocks) >= MAX_BLOCKS:
            return
        v = next(self.payloads)
        self.blocks.append((self.core.alloc(size, payload=v), v, []))

    @rule(i=IDX)
    def free(self, i):
        if self.blocks:
            _b, _v, msgs = self.blocks.pop(i % len(self.blocks))
            for m in msgs:
                m.block_alive = False

    @rule()
    def trim(self):
        self.core.trim()

    @rule(i=IDX)
    def make_message(self, i):
        """A message made now, delivered later (or never)."""
        ent = self._pick(self.blocks, i)
        if ent is not None:
            b, v, msgs = ent
            m = Msg(self.e.send(b), v, b.size)
            msgs.append(m)
            self.msgs = (self.msgs + [m])[-8:]

    # -- receivers -------------------------------------------------------------------------
    def _deliver(self, m: Msg, r: Any, must: bool) -> None:
        before = r.importer.step_maps(0).reserved
        try:
            owner = r.recv(m.data)
        except SharingError:
            assert not must or self.mutant, "a live message for a held block was refused"
            assert r.importer.step_maps(0).reserved == before  # nothing was mapped
            return
        finally:
            m.delivered += 1
        got = read_here(r, owner, m.size)
        assert got == (m.payload, m.payload), f"a receiver reads other bytes: {got}"
        self.held.append(Held(r, owner, m.payload, m.size))

    @rule(i=IDX, j=IDX)
    def send(self, i, j):
        ent = self._pick(self.blocks, i)
        if ent is not None:
            b, v, msgs = ent
            m = Msg(self.e.send(b), v, b.size)
            msgs.append(m)
            self._deliver(m, self._pick(self.receivers, j), must=True)

    @rule(i=IDX, j=IDX)
    def deliver_late(self, i, j):
        """A message made earlier: taken while its ticket or block lives, else refused
        (its block went, perhaps the range shrank and its step is mapped again)."""
        m = self._pick(self.msgs, i)
        if m is not None:
            self._deliver(m, self._pick(self.receivers, j), must=not m.delivered)

    @rule(i=IDX, j=IDX)
    def forward(self, i, j):
        h = self._pick(self.held, i)
        r = self._pick(self.receivers, j)
        if h is not None and r is not h.proc:
            try:
                data = h.proc.send(h.owner)
            except SharingError:
                assert self.mutant, "a receiver holding an array could not forward it"
                return
            self._deliver(Msg(data, h.payload, h.size), r, must=True)

    @rule(i=IDX)
    def drop(self, i):
        if self.held:
            self.held.pop(i % len(self.held))

    @rule(j=IDX)
    def kill_receiver(self, j):
        r = self._pick(self.receivers, j)
        self.held = [h for h in self.held if h.proc is not r]
        r.kill()
        self.names += 1
        self.receivers[self.receivers.index(r)] = self.world.proc(f"r{self.names}", **PROC)

    @rule(j=IDX)
    def exit_receiver(self, j):
        """A receiver's normal exit (its finalizer, then its process gone) while it maps."""
        r = self._pick(self.receivers, j)
        self.held = [h for h in self.held if h.proc is not r]
        r.exit()
        self.names += 1
        self.receivers[self.receivers.index(r)] = self.world.proc(f"r{self.names}", **PROC)

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def every_array_reads_its_messages_bytes(self):
        for h in self.held:
            got = read_here(h.proc, h.owner, h.size)
            assert got == (h.payload, h.payload), f"a receiver reads other bytes: {got}"

    def _windows(self, r: Any) -> dict:
        maps = r.importer._step_maps.get(0)
        return dict(maps._windows) if maps is not None else {}

    @invariant()
    def mapped_steps_stay_the_exporters(self):
        for r in self.receivers:
            for (_owner, _ids), win in self._windows(r).items():
                at = win.base
                for sid, va, n in win.steps:
                    assert self.core.placement.step_ids.get(va) == sid, (sid, va)
                    assert self.vmm.phys_at(va) == self.vmm.phys_at(at)  # the same memory
                    at += n

    @invariant()
    def receivers_reserve_exactly_their_windows(self):
        for r in self.receivers:
            maps = r.importer._step_maps.get(0)
            if maps is not None:
                assert maps.reserved == sum(w.size for w in self._windows(r).values())

    @invariant()
    def the_book_pins_every_step_a_receiver_maps(self):
        book = self.e.exporter.steps
        for r in self.receivers:
            for (_owner, ids), _win in self._windows(r).items():
                for sid in ids:
                    assert book is not None and book.pinned(self.core.placement, sid), sid

    def teardown(self):
        try:
            self.held.clear()
            self.blocks.clear()
            self.msgs.clear()
            for r in self.receivers:
                r.importer.trim_idle(0)
            book = self.e.exporter.steps
            assert wait_for(lambda: self.e.stats()["leases"] == 0, 5.0), self.e.stats()
            assert wait_for(lambda: self.e.stats()["tickets_out"] == 0 or self._expire(), 5.0)
            assert wait_for(lambda: self.e.stats()["limbo_blocks"] == 0, 5.0), self.e.stats()
            if book is not None:
                assert not any(book._maps.get(self.core.placement, {}).values())
            for r in self.receivers:
                assert wait_for(lambda r=r: not self._windows(r), 5.0)
            self.core.trim()
            assert self.core.placement.reserved == 0
        finally:
            self.world.teardown()
            left = [t for t in sharing_threads() if t not in self.threads0 and t.is_alive()]
            assert wait_for(lambda: not [t for t in left if t.is_alive()], 5.0)

    def _expire(self) -> bool:
        self.e.settings.inflight_timeout = 0.0
        self.e.exporter.expire()
        return self.e.stats()["tickets_out"] == 0


class MappedBlocksModel(StepBlocksModel):
    mode = "mapped"


_SETTINGS = settings(
    max_examples=int(os.environ.get("CUPY_POOLMEM_STEP_BLOCKS_MODEL_EXAMPLES", "60")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
    database=None,
)
TestStepBlocksModel = StepBlocksModel.TestCase
TestStepBlocksModel.settings = _SETTINGS
TestMappedBlocksModel = MappedBlocksModel.TestCase
TestMappedBlocksModel.settings = _SETTINGS


class WithoutLimbo(StepBlocksModel):
    """The exporter frees a shared block at once, under its receivers' mappings."""

    mutant = True

    def __init__(self) -> None:
        super().__init__()
        exp = self.e.exporter

        def release(ptr: int, size: int, stream: Any, rec: Any, core: Any = None) -> bool:
            with exp.lock:
                exp.records.pop(rec.export_id, None)  # forgotten: freed now
            return False

        exp.release = release

    def teardown(self):  # (what is left over is this mutant's, not the protocol's)
        self.held.clear()
        self.blocks.clear()
        self.world.teardown()


class WithoutThePinRule(StepBlocksModel):
    pin_rule = False


def _search(machine: Any, examples: int) -> None:
    run = machine.TestCase
    run.settings = settings(_SETTINGS, max_examples=examples, phases=[hypothesis.Phase.generate])
    run("runTest").runTest()


def test_the_model_fails_when_an_exporter_frees_under_its_receivers():
    """Without limbo the freed room is handed out again and written: a receiver reads
    another block's bytes, and the model says so."""
    with pytest.raises(AssertionError, match="a receiver reads other bytes"):
        _search(WithoutLimbo, 300)


def test_without_the_pin_rule_limbo_still_keeps_every_mapped_step():
    """The pin rule is the second line here: a leased block stays live (limbo), so no
    step under a receiver's window is ever free for a trim to cut.  (The step book's
    own model, tests/test_sharing_steps_model_cpu.py, drives the placements without
    limbo and fails without the pin rule.)"""
    _search(WithoutThePinRule, 60)
