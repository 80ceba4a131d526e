"""A model of the steps of expandable blocks shared between processes, checked by
Hypothesis: random allocations, writes, sends to receivers (some with a step's descriptor
lost), unmaps, frees, trims (every kind of release), SIGKILLed receivers and stale or
replayed step lists, on the fake driver with physical memory (tests/fakes/steps.py).

Invariants after every step: a receiver reads exactly the bytes the exporter wrote in
the block it was sent (never another block's, never memory unmapped under it); every
step a receiver maps is still the exporter's step at that address (never unmapped or
mapped again under it); a receiver reserves exactly the steps of its windows and holds
imported exactly the steps they map; the book pins exactly the steps receivers map.  At
the end, once everybody let go: nothing mapped, reserved, imported or open.
"""

from __future__ import annotations

import os

from fakes.expandable import SPAN
from fakes.steps import StepVmm
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cupy_poolmem import _arena_py
from cupy_poolmem._expandable import ExpandableBlocks
from cupy_poolmem._sharing._steps import StaleStepsError, StepExports, StepMappings

KiB, MiB = 1 << 10, 1 << 20
SIZES = [1, 4 * KiB, 300 * KiB, 1000 * KiB, MiB + 1, 3 * MiB, 19 * MiB, 21 * MiB, 45 * MiB]
STREAMS = [0x5000, 0x6000]
N_RECEIVERS = 3


class StepSharing(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.vmm = StepVmm()
        self.book = StepExports(self.vmm)
        self.blocks = ExpandableBlocks(
            0,
            span=SPAN,
            arena=_arena_py.Arena,
            driver=self.vmm,
            sync=self.vmm.sync_device,
            exportable=True,
            pinned=None,
        )
        self.blocks.set_pins(self.book.pins_for(self.blocks))
        self.live: dict[int, tuple[int, int, int]] = {}  # ptr -> (size, stream, value)
        self.values = iter(range(1, 1 << 30))
        self.maps = {c: StepMappings(self.vmm, 0) for c in range(N_RECEIVERS)}
        # (receiver, ptr) -> (key, here, size, value, steps)
        self.held: dict[tuple[int, int], tuple] = {}
        self.old: list[tuple[int, int, list]] = []
        self.orphans: set[tuple[int, int]] = (
            set()
        )  # held, but their block was freed  # step lists of messages made earlier
        self.fds0 = len(os.listdir("/proc/self/fd"))

    # -- the exporter ----------------------------------------------------------------------
    @rule(size=st.sampled_from(SIZES), stream=st.sampled_from(STREAMS))
    def allocate_and_write(self, size, stream):
        err, ptr = self.blocks.alloc(size, stream)
        assert err == 0
        v = next(self.values)
        self.vmm.write(ptr, v)
        if size > 1:
            self.vmm.write(ptr + size - 1, -v)
        self.live[ptr] = (size, stream, v)
        self.old.append((ptr, size, self.blocks.steps_under(ptr, size)))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        # The protocol frees a block only once no receiver maps it (I3): so does the model.
        free = [p for p in self.live if not any(k[1] == p for k in self.held)]
        if not free:
            return
        ptr = data.draw(st.sampled_from(sorted(free)))
        _size, stream, _v = self.live.pop(ptr)
        self.blocks.free(ptr, stream)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_under_a_receiver(self, data):
        # A block back in its arena while a receiver maps it (what limbo prevents): its
        # room may hold other data, but its steps must stay mapped (the step rule).
        c, ptr = data.draw(st.sampled_from(sorted(self.held)))
        if ptr not in self.live:
            return
        _size, stream, _v = self.live.pop(ptr)
        self.blocks.free(ptr, stream)
        for k in [k for k in self.held if k[1] == ptr]:
            self.orphans.add(k)

    @rule(keep=st.sampled_from([0, 0, 2 * MiB, 30 * MiB]), at_least=st.booleans())
    def trim(self, keep, at_least):
        self.blocks.release(keep, at_least=at_least)

    # -- receivers ---------------------------------------------------------------------------
    @precondition(lambda self: self.live)
    @rule(c=st.integers(0, N_RECEIVERS - 1), data=st.data())
    def send(self, c, data):
        ptr = data.draw(st.sampled_from(sorted(self.live)))
        if (c, ptr) in self.held:
            return
        self.orphans.discard((c, ptr))
        size, _s, v = self.live[ptr]
        steps = self.blocks.steps_under(ptr, size)
        grants = self.book.grant(c, self.blocks, ptr, size, steps, self.maps[c].have("e"))
        here, key = self.maps[c].map("e", ptr, size, grants)
        self.held[(c, ptr)] = (key, here, size, v, steps)

    @precondition(lambda self: self.live)
    @rule(c=st.integers(0, N_RECEIVERS - 1), data=st.data())
    def send_with_a_descriptor_lost(self, c, data):
        """A step's descriptor did not come with the grant (a claim that named it held,
        say): the map is refused, and whatever it imported before that goes again."""
        ptr = data.draw(st.sampled_from(sorted(self.live)))
        if (c, ptr) in self.held:
            return
        size, _s, _v = self.live[ptr]
        steps = self.blocks.steps_under(ptr, size)
        grants = self.book.grant(c, self.blocks, ptr, size, steps, self.maps[c].have("e"))
        with_fd = [i for i, g in enumerate(grants) if g.fd is not None]
        if with_fd:  # (none: every step is imported here already, so nothing is lost)
            i = data.draw(st.sampled_from(with_fd))
            os.close(grants[i].fd)
            grants[i] = grants[i]._replace(fd=None)
            try:
                self.maps[c].map("e", ptr, size, grants)
            except StaleStepsError:
                pass
            else:
                raise AssertionError("a step came without its descriptor, yet was mapped")
        else:
            for g in grants:
                assert g.fd is None
        self.book.unmapped(c, self.blocks, [s[0] for s in steps])  # the grant given back

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def unmap(self, data):
        c, ptr = data.draw(st.sampled_from(sorted(self.held)))
        key, *_ = self.held.pop((c, ptr))
        self.orphans.discard((c, ptr))
        self.maps[c].unmap(key)
        self.book.unmapped(c, self.blocks, key[1])

    @rule(c=st.integers(0, N_RECEIVERS - 1))
    def kill_receiver(self, c):
        # SIGKILL: its process and mappings go; the exporter reaps it once it is gone.
        self.maps[c].forget("e")
        self.maps[c] = StepMappings(self.vmm, 0)  # a new process takes its place
        for k in [k for k in self.held if k[0] == c]:
            del self.held[k]
            self.orphans.discard(k)
        self.book.drop_peer(c)

    @precondition(lambda self: self.old)
    @rule(c=st.integers(0, N_RECEIVERS - 1), data=st.data())
    def replay_an_old_step_list(self, c, data):
        ptr, size, steps = data.draw(st.sampled_from(self.old))
        now = self.blocks.steps_under(ptr, size)
        try:
            grants = self.book.grant(c, self.blocks, ptr, size, steps, self.maps[c].have("e"))
        except StaleStepsError:
            assert steps != now  # refused only when the steps changed
            return
        assert steps == now  # granted only when they are the steps mapped there now
        for g in grants:
            if g.fd is not None:
                os.close(g.fd)
        self.book.unmapped(c, self.blocks, [s[0] for s in steps])

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def receivers_read_their_blocks_bytes(self):
        for (c, ptr), (_key, here, size, v, _steps) in self.held.items():
            if (c, ptr) in self.orphans:
                continue  # its room may hold another block's data now
            assert self.vmm.read(here) == v
            assert size == 1 or self.vmm.read(here + size - 1) == -v
            assert self.vmm.phys_at(here) == self.vmm.phys_at(ptr)

    @invariant()
    def mapped_steps_stay_the_exporters(self):
        for (_c, _ptr), (_key, here, _size, _v, steps) in self.held.items():
            at = here - (_ptr - steps[0][1])
            for sid, va, n in steps:
                assert self.blocks.step_ids.get(va) == sid and self.vmm.mapped.get(va) == n
                assert self.vmm.phys_at(va) == self.vmm.phys_at(at)  # the same memory
                at += n

    @invariant()
    def receivers_reserve_exactly_their_windows(self):
        for c, m in self.maps.items():
            windows = {
                key: sum(s[2] for s in steps)
                for (cc, _p), (key, *_, steps) in self.held.items()
                if cc == c
            }
            assert m.reserved == sum(windows.values())

    @invariant()
    def receivers_hold_only_the_handles_their_windows_map(self):
        for c, m in self.maps.items():
            ids = {sid for (cc, _p), (key, *_r) in self.held.items() if cc == c for sid in key[1]}
            assert m.stats()["step_handles"] == len(ids), (c, m.stats(), ids)

    @invariant()
    def the_book_pins_exactly_what_receivers_map(self):
        want: dict = {}
        for (c, _ptr), (key, *_rest) in self.held.items():
            for sid in set(key[1]):
                want.setdefault(sid, set()).add(c)
        for sid in set(self.blocks.step_ids.values()):
            assert self.book.receivers(self.blocks, sid) == want.get(sid, set()), sid

    def teardown(self):
        for (c, _ptr), (key, *_rest) in list(self.held.items()):
            self.maps[c].unmap(key)
            self.book.unmapped(c, self.blocks, key[1])
        self.orphans.clear()
        for ptr, (_size, stream, _v) in list(self.live.items()):
            self.blocks.free(ptr, stream)
        self.blocks.release(0)
        assert self.blocks.reserved == 0 and not self.blocks.step_ids
        assert not self.vmm.mapped and not self.vmm.handles_alive
        assert all(m.stats()["step_reserved_bytes"] == 0 for m in self.maps.values())
        assert set(self.vmm.phys_of) == set() and not self.vmm.refs
        assert len(os.listdir("/proc/self/fd")) == self.fds0  # every descriptor closed


TestStepSharing = StepSharing.TestCase
TestStepSharing.settings = settings(
    max_examples=int(os.environ.get("CUPY_POOLMEM_STEP_MODEL_EXAMPLES", "60")),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
