"""Blocks of expandable and mapped pools across processes, on the fakes: the steps under
a block exported (only from exportable memory, once per receiver), the receiver's
reservation of exactly those steps, the exporter's book of who maps what, and the rule
that no trim, out-of-memory retry or range shrink unmaps a step a receiver maps
(docs/sharing.rst, "Mapped and expandable blocks")."""

from __future__ import annotations

import os

import pytest
from fakes.expandable import SPAN
from fakes.sharing import wait_for
from fakes.steps import FD, StepVmm

from cupy_poolmem import _arena_py
from cupy_poolmem._errors import CUDADriverError, SharingError
from cupy_poolmem._expandable import SMALL_STEP, ExpandableBlocks
from cupy_poolmem._mapped import MappedBlocks
from cupy_poolmem._sharing._steps import (
    STEPS_MAX,
    StaleStepsError,
    StepExports,
    StepGrant,
    StepMappings,
    check_steps,
)

MiB = 1 << 20
NONE = 0  # CU_MEM_HANDLE_TYPE_NONE


@pytest.fixture
def vmm(monkeypatch, fake_driver):
    from fakes.events import use_driver

    return use_driver(fake_driver, monkeypatch, StepVmm())


def ranges(vmm, exportable=True, **kw):
    return ExpandableBlocks(
        0,
        span=SPAN,
        arena=_arena_py.Arena,
        driver=vmm,
        sync=vmm.sync_device,
        exportable=exportable,
        **kw,
    )


def pinned_ranges(vmm):
    """An exporter's step book and exportable ranges whose releases ask it for pins."""
    book = StepExports(vmm)
    blocks = ranges(vmm)
    blocks.set_pins(book.pins_for(blocks))
    return book, blocks


def alloc(blocks, size, stream=0x5000):
    err, ptr = blocks.alloc(size, stream)
    assert err == 0
    return ptr


def is_open(fd):
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


class Receiver:
    """One receiving process: its mappings, and its side of the claim."""

    def __init__(self, vmm, book, cid, owner="exporter-1", peers=()):
        self.vmm, self.book, self.cid, self.owner = vmm, book, cid, owner
        self.maps = StepMappings(vmm, 0, peers)

    def take(self, blocks, ptr, size, steps=None):
        steps = blocks.steps_under(ptr, size) if steps is None else steps
        grants = self.book.grant(self.cid, blocks, ptr, size, steps, self.maps.have(self.owner))
        try:
            return self.maps.map(self.owner, ptr, size, grants)
        except BaseException:
            self.book.unmapped(self.cid, blocks, [g.step.id for g in grants])
            raise

    def drop(self, blocks, key):
        self.maps.unmap(key)
        self.book.unmapped(self.cid, blocks, key[1])


# -- exportable memory only where asked ---------------------------------------------------
@pytest.mark.parametrize("exportable", [False, True])
def test_ranges_ask_for_a_shareable_handle_only_when_exportable(vmm, exportable):
    blocks = ranges(vmm, exportable=exportable)
    assert blocks._prop.requestedHandleTypes == (FD if exportable else NONE)
    ptr = alloc(blocks, 3 * MiB)
    book = StepExports(vmm)
    steps = blocks.steps_under(ptr, 3 * MiB)
    if exportable:
        (g,) = book.grant(1, blocks, ptr, 3 * MiB, steps)
        assert is_open(g.fd) and vmm.fd_phys[g.fd] == vmm.phys_at(ptr)
        os.close(g.fd)
    else:  # the driver refuses to export memory created without the handle type
        with pytest.raises(CUDADriverError, match="cuMemExportToShareableHandle"):
            book.grant(1, blocks, ptr, 3 * MiB, steps)
        assert not book.pinned(blocks, steps[0][0])  # a grant that failed pins nothing
    assert vmm.handles_alive == set()  # the retained handle went back either way


@pytest.mark.parametrize("exportable", [False, True])
def test_mapped_blocks_ask_for_a_shareable_handle_only_when_exportable(vmm, exportable):
    blocks = MappedBlocks(0, driver=vmm, exportable=exportable)
    assert blocks._prop.requestedHandleTypes == (FD if exportable else NONE)
    ptr = alloc(blocks, 10 * MiB)
    ((sid, va, n),) = blocks.steps_under(ptr + 4096, 4096)
    assert (va, n) == (ptr, 10 * MiB) and vmm.exportable[vmm.phys_at(ptr)] is exportable


# -- the steps under a block ----------------------------------------------------------------
def test_steps_under_blocks_of_many_sizes_across_step_boundaries(vmm):
    blocks = ranges(vmm)
    sizes = [1, 511, 4096, 300 * 1024, 700 * 1024, MiB, MiB + 1, 5 * MiB, 21 * MiB, 47 * MiB]
    live = [(alloc(blocks, s), s) for s in sizes * 3]
    crossing = 0
    for ptr, size in live:
        steps = blocks.steps_under(ptr, size)
        assert steps, (ptr, size)
        check_steps(steps, ptr, size)  # contiguous, each with a byte of it, all of it
        crossing += len(steps) > 1
        for sid, va, n in steps:  # a step is one physical allocation, mapped there
            assert vmm.mapped[va] == n and blocks.step_ids[va] == sid
    assert crossing, "no block crossed a step boundary: the test needs one"


def test_a_block_in_the_room_of_two_freed_ones_spans_both_steps(vmm):
    blocks = ranges(vmm)
    a, b = alloc(blocks, 30 * MiB), alloc(blocks, 30 * MiB)
    keep = alloc(blocks, 30 * MiB)  # above them: the range cannot shrink under it
    sa, sb = blocks.steps_under(a, 30 * MiB), blocks.steps_under(b, 30 * MiB)
    assert len(sa) == len(sb) == 1 and sa != sb
    blocks.free(a, 0x5000)
    blocks.free(b, 0x5000)
    big = alloc(blocks, 60 * MiB)
    assert big == a  # first fit: the merged room of both
    assert blocks.steps_under(big, 60 * MiB) == sa + sb
    assert keep


# -- exporting: refused when stale or forged, fds once per receiver ------------------------
def test_a_message_made_before_the_range_shrank_is_refused(vmm):
    blocks = ranges(vmm)
    keep = alloc(blocks, 30 * MiB)  # the range stays, its top step goes
    ptr = alloc(blocks, 3 * MiB)
    old = blocks.steps_under(ptr, 3 * MiB)
    blocks.free(ptr, 0x5000)
    assert blocks.release(0) > 0  # the range shrank: its steps are unmapped
    ptr2 = alloc(blocks, 3 * MiB)  # mapped again at the same place: new memory
    assert ptr2 == ptr and blocks.steps_under(ptr2, 3 * MiB) != old
    book = StepExports(vmm)
    before = vmm.exports
    with pytest.raises(StaleStepsError, match="shrank") as info:
        book.grant(1, blocks, ptr, 3 * MiB, old)
    assert isinstance(info.value, SharingError) and vmm.exports == before
    assert keep


@pytest.mark.parametrize(
    "forge",
    [
        lambda s, p: [],  # none
        lambda s, p: s * 2,  # repeated: not contiguous
        lambda s, p: [(s[0][0], s[0][1] + SMALL_STEP, s[0][2])],  # not under the block
        lambda s, p: [(s[0][0], s[0][1], s[0][2] * 64)],  # past the block's step
        lambda s, p: [(-1, s[0][1], s[0][2])],  # malformed
        lambda s, p: [(s[0][0] + 7, s[0][1], s[0][2])],  # another step's id
        lambda s, p: [(i, p + i * 4096, 4096) for i in range(STEPS_MAX + 1)],  # too many
    ],
)
def test_a_forged_step_list_is_refused_before_anything_is_exported_or_mapped(vmm, forge):
    blocks = ranges(vmm)
    ptr = alloc(blocks, 512 * 1024)
    steps = forge(blocks.steps_under(ptr, 512 * 1024), ptr)
    book = StepExports(vmm)
    r = StepMappings(vmm, 0)
    n_log = len(vmm.log)
    with pytest.raises(StaleStepsError):
        book.grant(1, blocks, ptr, 512 * 1024, steps)
    with pytest.raises(StaleStepsError):  # the receiver checks too, before it reserves
        r.map("x", ptr, 512 * 1024, [StepGrant(s, None) for s in steps] if steps else [])
    assert not [e for e in vmm.log[n_log:] if e[0] in ("export", "reserve", "map", "import")]


def test_a_step_list_naming_one_step_twice_is_refused_before_anything_is_mapped(vmm):
    """Two contiguous extents under one id (one physical allocation would be mapped
    twice, and its handle released twice at the unmap): forged."""
    steps = [(5, 0x20_0000, 0x20_0000), (5, 0x40_0000, 0x20_0000)]
    with pytest.raises(StaleStepsError, match="twice"):
        check_steps(steps, 0x30_0000, 0x20_0000)
    r = StepMappings(vmm, 0)
    n_log = len(vmm.log)
    with pytest.raises(StaleStepsError, match="twice"):
        r.map("x", 0x30_0000, 0x20_0000, [StepGrant(s, None) for s in steps])
    assert not [e for e in vmm.log[n_log:] if e[0] in ("reserve", "map", "import")]


def test_each_step_goes_to_a_receiver_once_and_to_every_receiver(vmm):
    blocks = ranges(vmm)
    book = StepExports(vmm)
    a, b = alloc(blocks, 512 * 1024), alloc(blocks, 512 * 1024)  # the same 2 MiB step
    r1, r2 = Receiver(vmm, book, 1), Receiver(vmm, book, 2)
    _, k1 = r1.take(blocks, a, 512 * 1024)
    _, k2 = r1.take(blocks, b, 512 * 1024)  # its step is imported here already: no fd
    assert vmm.exports == 1 and [e[0] for e in vmm.log].count("import") == 1
    r2.take(blocks, a, 512 * 1024)  # another process: its own descriptor
    assert vmm.exports == 2
    assert not any(is_open(fd) for fd in vmm.fd_phys)  # every descriptor closed after import
    assert book.receivers(blocks, k1[1][0]) == {1, 2} and k1[1] == k2[1]


# -- the receiver reserves and maps exactly the steps ------------------------------------
def test_the_receiver_reserves_exactly_the_steps_and_reads_the_exporters_bytes(vmm):
    blocks = ranges(vmm)
    book = StepExports(vmm)
    alloc(blocks, 1000 * 1024)
    alloc(blocks, 1000 * 1024)
    ptr = alloc(blocks, 1000 * 1024)  # across the small range's first step boundary
    steps = blocks.steps_under(ptr, 1000 * 1024)
    assert len(steps) == 2
    for i in range(0, 1000 * 1024, 4096):
        vmm.write(ptr + i, ptr + i)  # the exporter writes its pattern
    r = Receiver(vmm, book, 1, peers=(1,))
    here, key = r.take(blocks, ptr, 1000 * 1024)
    reserve = [e for e in vmm.log if e[0] == "reserve"][-1]
    assert reserve[2] == sum(n for _s, _va, n in steps) == 2 * SMALL_STEP  # not a GPU's span
    assert r.maps.reserved == 2 * SMALL_STEP
    assert all(vmm.read(here + i) == ptr + i for i in range(0, 1000 * 1024, 4096))
    assert vmm.phys_at(here) == vmm.phys_at(ptr)  # the same memory, not a copy
    assert [d for d, _f in vmm.access[here - (ptr - steps[0][1])]] == [0, 1]  # sender's grants
    r.drop(blocks, key)
    assert r.maps.stats() == {"step_windows": 0, "step_handles": 0, "step_reserved_bytes": 0}
    assert not book.pinned(blocks, steps[0][0])


def test_a_receiver_whose_import_fails_keeps_nothing_and_closes_the_descriptors(vmm):
    blocks = ranges(vmm)
    book = StepExports(vmm)
    alloc(blocks, 1000 * 1024)
    alloc(blocks, 1000 * 1024)
    ptr = alloc(blocks, 1000 * 1024)
    assert len(blocks.steps_under(ptr, 1000 * 1024)) == 2
    grants = book.grant(1, blocks, ptr, 1000 * 1024, blocks.steps_under(ptr, 1000 * 1024))
    r = StepMappings(vmm, 0)
    vmm.fail["cuMemMap"] = 2  # the second step's... first map fails: all undone
    alive = set(vmm.handles_alive)
    with pytest.raises(CUDADriverError, match="cuMemMap"):
        r.map("x", ptr, 1000 * 1024, grants)
    assert not any(is_open(g.fd) for g in grants)
    assert r.stats()["step_reserved_bytes"] == 0 and vmm.handles_alive == alive
    assert not [
        va
        for va in vmm.reserved_va
        if va not in {a.base for p in blocks.arenas.values() for a in p}
    ]


# -- the rule: no unmap under a receiver ------------------------------------------------------
def test_a_trim_while_receivers_map_keeps_their_steps_and_the_memory(vmm):
    book, blocks = pinned_ranges(vmm)
    low = alloc(blocks, 30 * MiB)
    top = alloc(blocks, 30 * MiB)
    vmm.write(top, 1234)
    r = Receiver(vmm, book, 1)
    here, key = r.take(blocks, top, 30 * MiB)
    phys = vmm.phys_at(top)
    blocks.free(top, 0x5000)  # (the protocol holds it in limbo; the step rule holds anyway)
    blocks.free(low, 0x5000)
    assert blocks.release(0) == 0  # the top step is pinned: nothing above it goes
    assert top in vmm.mapped and phys not in vmm.freed and vmm.read(here) == 1234
    assert blocks.release(0, at_least=True) == 0  # the out-of-memory retry's way too
    r.drop(blocks, key)
    assert blocks.release(0) == 60 * MiB  # once it let go, both steps go
    assert phys in vmm.freed


def test_a_step_is_pinned_from_the_grant_on_before_the_receiver_maps_it(vmm):
    book, blocks = pinned_ranges(vmm)
    keep = alloc(blocks, 30 * MiB)
    ptr = alloc(blocks, 4 * MiB)
    vmm.write(ptr, 9)
    (g,) = book.grant(1, blocks, ptr, 4 * MiB, blocks.steps_under(ptr, 4 * MiB))
    blocks.free(ptr, 0x5000)  # (a forged early free: the grant alone must hold the step)
    assert blocks.release(0) == 0 and vmm.read(ptr) == 9
    here, key = StepMappings(vmm, 0).map("x", ptr, 4 * MiB, [g])
    assert vmm.read(here) == 9 and vmm.phys_at(here) == vmm.phys_at(ptr)
    assert keep


def test_a_shrink_stops_at_the_first_pinned_step_from_the_top(vmm):
    book, blocks = pinned_ranges(vmm)
    ptrs = [alloc(blocks, 30 * MiB) for _ in range(3)]
    r = Receiver(vmm, book, 1)
    _, key = r.take(blocks, ptrs[1], 30 * MiB)
    for p in ptrs:
        blocks.free(p, 0x5000)
    assert blocks.release(0) == 30 * MiB  # the top one only: the middle one is mapped there
    assert ptrs[1] in vmm.mapped and ptrs[0] in vmm.mapped and ptrs[2] not in vmm.mapped
    r.drop(blocks, key)
    assert blocks.release(0) == 60 * MiB


def test_a_mapped_pools_cached_block_a_receiver_maps_is_not_given_back(vmm):
    book = StepExports(vmm)
    blocks = MappedBlocks(0, driver=vmm, exportable=True)
    blocks.set_pins(book.pins_for(blocks))
    a, b = alloc(blocks, 10 * MiB), alloc(blocks, 12 * MiB)
    r = Receiver(vmm, book, 1)
    _, key = r.take(blocks, a, 10 * MiB)
    blocks.free(a, 0x5000)
    blocks.free(b, 0x5000)
    assert blocks.release(0) == 12 * MiB and a in vmm.mapped and b not in vmm.mapped
    r.drop(blocks, key)
    assert blocks.release(0) == 10 * MiB and a not in vmm.mapped


def test_the_book_counts_each_mapping_so_one_unmap_of_two_keeps_the_pin(vmm):
    book = StepExports(vmm)
    blocks = ranges(vmm)
    ptr = alloc(blocks, 3 * MiB)
    ((sid, _va, _n),) = blocks.steps_under(ptr, 3 * MiB)
    book.mapped(1, blocks, [sid])
    book.mapped(1, blocks, [sid])
    book.mapped(2, blocks, [sid])
    book.unmapped(1, blocks, [sid])
    book.unmapped(2, blocks, [sid])
    assert book.pinned(blocks, sid) and book.receivers(blocks, sid) == {1}
    book.unmapped(1, blocks, [sid])
    book.unmapped(1, blocks, [sid])  # a duplicate: nothing below zero
    assert not book.pinned(blocks, sid)
    other = ranges(vmm)  # another pool's step of the same id is another step
    book.mapped(3, other, [sid])
    assert not book.pinned(blocks, sid) and book.pinned(other, sid)


def test_a_sigkilled_receivers_steps_are_reclaimed_once_its_process_is_gone(vmm, sharing_world):
    # The exporter's reaping of a receiver (the existing SIGKILL path) frees its steps.
    e, r = sharing_world.proc("exporter"), sharing_world.proc("receiver")
    book = e.exporter.steps = StepExports(vmm)
    blocks = ranges(vmm)
    blocks.set_pins(book.pins_for(blocks))
    core = e.pool()
    imp = r.recv(e.send(core.alloc(1024, payload=1)))  # a connection, so a peer to reap
    (cid,) = e.exporter.peers
    ptr = alloc(blocks, 30 * MiB)
    ((sid, _va, _n),) = blocks.steps_under(ptr, 30 * MiB)
    book.mapped(cid, blocks, [sid])
    blocks.free(ptr, 0x5000)
    assert blocks.release(0) == 0
    r.kill()
    assert wait_for(lambda: not book.pinned(blocks, sid), 5.0)
    assert blocks.release(0) == 30 * MiB
    del imp


def test_new_blocks_after_a_trim_under_a_receiver_never_land_in_its_step(vmm):
    # Trim and reallocate while a receiver maps a live block: its bytes stay its own.
    book, blocks = pinned_ranges(vmm)
    shared = alloc(blocks, 25 * MiB)
    vmm.write(shared, 77)
    r = Receiver(vmm, book, 1)
    here, key = r.take(blocks, shared, 25 * MiB)
    for round_ in range(5):
        ptrs = [alloc(blocks, s * MiB) for s in (3, 40, 1, 22)]
        for p in ptrs:
            vmm.write(p, round_)
        for p in ptrs:
            blocks.free(p, 0x5000)
        blocks.release(0)
        assert vmm.read(here) == 77, round_
    r.drop(blocks, key)


def test_a_receiver_maps_a_step_once_for_blocks_on_the_same_steps(vmm):
    blocks = ranges(vmm)
    book = StepExports(vmm)
    ptr = alloc(blocks, 30 * MiB)
    r = Receiver(vmm, book, 1)
    h1, k1 = r.take(blocks, ptr, 30 * MiB)
    h2, k2 = r.take(blocks, ptr + 4 * MiB, 4096)  # a view inside: the same window
    assert k1 == k2 and h2 == h1 + 4 * MiB and r.maps.stats()["step_windows"] == 1
    r.drop(blocks, k1)
    assert r.maps.stats()["step_windows"] == 1 and book.pinned(blocks, k1[1][0])
    r.drop(blocks, k2)
    assert r.maps.stats()["step_windows"] == 0 and not book.pinned(blocks, k1[1][0])


def test_forget_unmaps_every_window_of_a_gone_exporter(vmm):
    blocks = ranges(vmm)
    book = StepExports(vmm)
    r = Receiver(vmm, book, 1)
    for s in (30 * MiB, 4096, 25 * MiB):
        r.take(blocks, alloc(blocks, s), s)
    assert r.maps.stats()["step_windows"] == 3
    r.maps.forget(r.owner)
    assert r.maps.stats() == {"step_windows": 0, "step_handles": 0, "step_reserved_bytes": 0}


def test_an_unmap_the_driver_refuses_still_frees_the_rest_and_names_the_call(vmm):
    blocks = ranges(vmm)
    book = StepExports(vmm)
    ptr = alloc(blocks, 30 * MiB)
    r = Receiver(vmm, book, 1)
    _, key = r.take(blocks, ptr, 30 * MiB)
    ours = set(vmm.reserved_va) - {a.base for p in blocks.arenas.values() for a in p}
    vmm.fail["cuMemUnmap"] = 1  # CUDA_ERROR_INVALID_VALUE
    with pytest.raises(CUDADriverError, match="cuMemUnmap"):
        r.maps.unmap(key)
    assert r.maps.stats() == {"step_windows": 0, "step_handles": 0, "step_reserved_bytes": 0}
    assert not (ours & vmm.reserved_va)  # the reservation went anyway


def test_the_book_forgets_a_placement_that_is_gone(vmm):
    import gc

    book = StepExports(vmm)
    blocks = ranges(vmm)
    ptr = alloc(blocks, 3 * MiB)
    ((sid, _va, _n),) = blocks.steps_under(ptr, 3 * MiB)
    book.mapped(1, blocks, [sid])
    pins = book.pins_for(blocks)
    assert pins(sid)
    blocks.close()
    del blocks
    gc.collect()
    assert not book._maps and not pins(sid)  # no pin left for whatever comes next


@pytest.mark.parametrize("how", ["no descriptor", "import refused"])
def test_a_map_refused_after_its_first_step_was_imported_keeps_no_handle(vmm, how):
    """The second step of a block fails (it came without a descriptor and is not held
    here, or the driver refuses its import) after the first was imported: the first
    step's handle goes too, so this process holds none of the exporter's memory and its
    table of handles does not keep an entry no window uses."""
    blocks = ranges(vmm)
    book = StepExports(vmm)
    alloc(blocks, 1000 * 1024)
    alloc(blocks, 1000 * 1024)
    ptr = alloc(blocks, 1000 * 1024)
    steps = blocks.steps_under(ptr, 1000 * 1024)
    assert len(steps) == 2
    g0, g1 = book.grant(1, blocks, ptr, 1000 * 1024, steps)
    r = StepMappings(vmm, 0)
    alive = set(vmm.handles_alive)
    if how == "no descriptor":
        os.close(g1.fd)
        grants = [g0, StepGrant(g1.step, None)]
        error: type = StaleStepsError
    else:
        grants = [g0, g1]
        real_import = vmm.cuMemImportFromShareableHandle
        calls = []

        def second_refused(fd, kind):
            calls.append(fd)
            return (1, None) if len(calls) == 2 else real_import(fd, kind)

        vmm.cuMemImportFromShareableHandle = second_refused
        error = CUDADriverError
    with pytest.raises(error):
        r.map("x", ptr, 1000 * 1024, grants)
    assert not any(g.fd is not None and is_open(g.fd) for g in grants)
    assert r.stats() == {"step_windows": 0, "step_handles": 0, "step_reserved_bytes": 0}
    assert r.have("x") == set() and vmm.handles_alive == alive
