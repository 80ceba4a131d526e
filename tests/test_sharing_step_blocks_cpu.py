"""Blocks of mapped and expandable pools sent end to end on the fakes (issue 35, stage 2):
the exporter's record names the steps under the block, the claim names the steps the
receiver holds, the reply carries the others' descriptors over the socket, and the
receiver maps exactly those steps; the lifetime protocol is the pool blocks' (leases,
limbo, SIGKILL reclaim, exporters that exit, forwarding, stale and forged messages
refused).  docs/sharing.rst, "Mapped and expandable blocks"."""

from __future__ import annotations

import pickle
import time

import pytest
from fakes.sharing import wait_for
from fakes.step_sharing import read_here, step_pool
from fakes.steps import StepVmm

from cupy_poolmem._errors import CUDADriverError, SharingError
from cupy_poolmem._sharing import _wire
from cupy_poolmem._sharing._steps import StaleStepsError

MiB = 1 << 20
MODES = ["expandable", "mapped"]


@pytest.fixture
def vmm(monkeypatch, fake_driver, sharing_world):
    from fakes.events import use_driver

    v = use_driver(fake_driver, monkeypatch, StepVmm())
    sharing_world.gpu.vmm = v
    return v


def steps_of(core, block):
    return core.placement.steps_under(block.ptr, block.size)


def book(proc):
    return proc.exporter.steps


def fds_exported(vmm):
    return sum(1 for e in vmm.log if e[0] == "export")


@pytest.mark.parametrize("mode", MODES)
def test_a_block_travels_and_the_receiver_reads_the_exporters_bytes(sharing_world, vmm, mode):
    w = sharing_world
    e, r = w.proc("e"), w.proc("r")
    core = step_pool(e, vmm, mode)
    b = core.alloc(3 * MiB + 5, payload=41)
    owner = r.recv(e.send(b))
    assert read_here(r, owner, b.size) == (41, 41)
    b.write(42)  # one memory: the exporter's later writes show there too
    assert read_here(r, owner, b.size) == (42, 42)
    steps = steps_of(core, b)
    assert owner.ptr != b.ptr  # the receiver's own reservation
    assert r.importer.step_maps(0).reserved == sum(s[2] for s in steps)  # exactly the steps
    assert {s[0] for s in steps} <= {sid for sid in book(e)._maps[core.placement]}
    assert all(book(e).receivers(core.placement, s[0]) == {1} for s in steps)
    ptr = b.ptr
    del owner, b  # the receiver unmaps, then the exporter frees it
    assert wait_for(lambda: core.freed == [ptr])
    assert not any(book(e).pinned(core.placement, s[0]) for s in steps)


def test_the_steps_travel_once_per_receiver_and_again_to_another(sharing_world, vmm):
    w = sharing_world
    e, r1, r2 = w.proc("e"), w.proc("r1"), w.proc("r2")
    core = step_pool(e, vmm)
    a = core.alloc(700 * 1024, payload=1)
    b = core.alloc(700 * 1024, payload=2)  # the same 2 MiB step as ``a``
    assert steps_of(core, a) == steps_of(core, b)
    oa = r1.recv(e.send(a))
    assert fds_exported(vmm) == 1
    ob = r1.recv(e.send(b))  # the step is imported here already: no descriptor
    assert fds_exported(vmm) == 1
    assert (read_here(r1, oa, a.size)[0], read_here(r1, ob, b.size)[0]) == (1, 2)
    o2 = r2.recv(e.send(a))  # another process: its own descriptor
    assert fds_exported(vmm) == 2 and read_here(r2, o2, a.size)[0] == 1
    assert r1.importer.step_maps(0).stats()["step_handles"] == 1


def test_letting_go_unmaps_the_window_and_frees_the_block_after_the_receiver(sharing_world, vmm):
    w = sharing_world
    e, r = w.proc("e"), w.proc("r", keep_mappings=0)
    core = step_pool(e, vmm)
    b = core.alloc(5 * MiB, payload=7)
    ptr = b.ptr
    owner = r.recv(e.send(b))
    del b  # the exporter lets go first: limbo until the receiver unmaps
    assert core.freed == [] and e.stats()["limbo_blocks"] == 1
    sid = steps_of_ptr(core, ptr)
    assert book(e).pinned(core.placement, sid)
    del owner
    assert wait_for(lambda: core.freed == [ptr])
    maps = r.importer.step_maps(0)
    assert maps.stats() == {"step_windows": 0, "step_handles": 0, "step_reserved_bytes": 0}
    assert not book(e).pinned(core.placement, sid)
    assert e.stats()["leases"] == 0 and e.stats()["limbo_blocks"] == 0


def steps_of_ptr(core, ptr):
    return core.placement.steps_under(ptr, 1)[0][0]


def test_a_trim_keeps_the_steps_a_receiver_maps_and_no_reuse_shows_there(sharing_world, vmm):
    w = sharing_world
    e, r = w.proc("e"), w.proc("r", keep_mappings=0)
    core = step_pool(e, vmm)
    low = core.alloc(21 * MiB, payload=3)
    shared = core.alloc(21 * MiB, payload=5)  # in the range's last step
    steps = steps_of(core, shared)
    owner = r.recv(e.send(shared))
    del shared, low
    assert core.trim() >= 0
    for sid, va, _n in steps:  # pinned: still mapped in the exporter, not reused
        assert core.placement.step_ids.get(va) == sid
    again = core.alloc(21 * MiB, payload=9)  # lands in the low step, not under the mapping
    assert read_here(r, owner, 21 * MiB) == (5, 5)
    del owner
    assert wait_for(lambda: not book(e).pinned(core.placement, steps[0][0]))
    del again
    core.trim()
    assert all(core.placement.step_ids.get(va) != sid for sid, va, _n in steps)


def test_a_sigkilled_receiver_gives_its_steps_back_once_its_process_is_gone(sharing_world, vmm):
    w = sharing_world
    e, r = w.proc("e"), w.proc("r")
    core = step_pool(e, vmm)
    b = core.alloc(3 * MiB, payload=4)
    ptr = b.ptr
    sid = steps_of(core, b)[0][0]
    owner = r.recv(e.send(b))
    assert read_here(r, owner, b.size)[0] == 4
    r.kill()
    del b
    assert wait_for(lambda: core.freed == [ptr])
    assert not book(e).pinned(core.placement, sid)
    assert e.stats()["leases"] == 0


def test_a_message_after_its_block_went_and_the_range_shrank_is_refused(sharing_world, vmm):
    w = sharing_world
    e, r = w.proc("e", inflight_timeout=0.05), w.proc("r")
    core = step_pool(e, vmm)
    b = core.alloc(3 * MiB, payload=4)
    msg = e.send(b)
    del b
    assert wait_for(lambda: e.exporter.expire() >= 0 and e.stats()["limbo_blocks"] == 0)
    core.trim()  # the range shrank: the step is gone
    assert core.placement.reserved == 0
    with pytest.raises(SharingError):
        r.recv(msg)
    assert r.importer.step_maps(0).reserved == 0


def test_steps_that_changed_under_a_live_record_are_refused_as_stale(sharing_world, vmm):
    """A record whose steps are not mapped there any more (what a shrink and a new
    mapping at the same address would leave) is refused before anything is mapped."""
    w = sharing_world
    e, r = w.proc("e"), w.proc("r")
    core = step_pool(e, vmm)
    b = core.alloc(3 * MiB, payload=4)
    msg = e.send(b)
    ((sid, va, _n),) = steps_of(core, b)
    core.placement.step_ids[va] = 10_000 + sid  # the step was mapped again since
    with pytest.raises(StaleStepsError):
        r.recv(msg)
    assert r.importer.step_maps(0).reserved == 0
    assert not book(e).pinned(core.placement, 10_000 + sid)
    assert fds_exported(vmm) == 0


def test_a_forged_step_list_is_refused_as_another_block(sharing_world, vmm):
    w = sharing_world
    e, r = w.proc("e"), w.proc("r")
    core = step_pool(e, vmm)
    b = core.alloc(3 * MiB, payload=4)
    d = pickle.loads(e.send(b))
    ptr, size, n, _ = _wire.step_block(d.export_data)
    forged = d._replace(
        export_data=_wire.step_export_data(ptr, size, [(999, ptr & ~(2 * MiB - 1), 4 * MiB)])
    )
    with pytest.raises(_wire.ProtocolError, match="not those of the block"):
        r.recv(pickle.dumps(forged))
    assert r.importer.step_maps(0).reserved == 0 and fds_exported(vmm) == 0


def test_a_message_forwarded_to_a_third_process_maps_the_same_steps(sharing_world, vmm):
    w = sharing_world
    e, r, t = w.proc("e"), w.proc("r"), w.proc("t")
    core = step_pool(e, vmm)
    b = core.alloc(3 * MiB, payload=8)
    owner = r.recv(e.send(b))
    third = t.recv(r.send(owner))
    assert read_here(t, third, b.size) == (8, 8)
    assert book(e).receivers(core.placement, steps_of(core, b)[0][0]) == {1, 2}


def test_an_exporter_that_exits_leaves_the_receivers_mapping_readable(sharing_world, vmm):
    w = sharing_world
    e, r = w.proc("e"), w.proc("r")
    core = step_pool(e, vmm)
    b = core.alloc(3 * MiB, payload=6)
    owner = r.recv(e.send(b))
    e.exit()
    assert read_here(r, owner, b.size) == (6, 6)  # the imported handle holds the memory
    del owner
    assert wait_for(lambda: r.importer.step_maps(0).reserved == 0)


def test_the_dask_same_host_path_takes_a_step_block_as_any_other(sharing_world, vmm):
    """The Dask transfer describes, receives and reads back through the same reducers
    and importer (``describe``, ``receive``, ``Exporter.hold_live``)."""
    from cupy_poolmem._sharing._reducers import describe, receive

    w = sharing_world
    a, b = w.proc("a"), w.proc("b")
    core = step_pool(a, vmm)
    blk = core.alloc(3 * MiB, payload=12)
    d = describe(a.ctx, blk, "cupy", 0, (blk.size,), (1,), "|u1")
    owner, dev = receive(b.ctx, d)
    assert dev == 0 and read_here(b, owner, blk.size) == (12, 12)
    d2 = describe(a.ctx, blk, "cupy", 0, (blk.size,), (1,), "|u1")
    b.importer.give_back(d2)  # a receiver that cannot take it: the sender reads it back
    assert wait_for(lambda: a.stats()["tickets_out"] == 0)
    hold = a.exporter.hold_live(d2.export_id, d2.export_data, d2.life)
    assert hold is not None and vmm.read(hold.ptr) == 12
    del hold, owner


def test_a_failed_export_refuses_the_claim_and_gives_everything_back(sharing_world, vmm):
    w = sharing_world
    e, r = w.proc("e"), w.proc("r")
    core = step_pool(e, vmm)
    core.placement.exportable = False  # memory created without the handle type:
    core.placement._prop.requestedHandleTypes = 0  # the driver refuses to export it
    b = core.alloc(3 * MiB, payload=4)
    with pytest.warns(RuntimeWarning, match="cuMemExportToShareableHandle"):
        with pytest.raises(SharingError, match="could not export the 1 step"):
            r.recv(e.send(b))
    assert e.stats()["leases"] == 0 and e.stats()["tickets_out"] == 0
    assert not book(e).pinned(core.placement, steps_of(core, b)[0][0])
    assert r.importer.step_maps(0).reserved == 0 and vmm.handles_alive == set()
    ptr = b.ptr
    del b  # nothing holds it: freed at once
    assert core.freed == [ptr]


def test_a_message_back_in_its_exporter_reads_the_block_itself(sharing_world, vmm):
    w = sharing_world
    e = w.proc("e")
    core = step_pool(e, vmm)
    b = core.alloc(3 * MiB, payload=31)
    hold = e.recv(e.send(b))
    assert hold.ptr == b.ptr and vmm.read(hold.ptr) == 31
    assert fds_exported(vmm) == 0  # nothing exported for its own process
    ptr = b.ptr
    del b
    assert core.freed == []  # the round-tripped array holds it
    del hold
    assert wait_for(lambda: core.freed == [ptr])


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("size", 4 * MiB, _wire.ProtocolError),  # more bytes than the block: OUT_OF_SPAN
        ("ticket", b"\x07" * 16, SharingError),  # no live ticket: stale
        ("life", 3, SharingError),  # another life: refused
        ("export_id", 99, SharingError),  # no such export
    ],
)
def test_forged_fields_of_a_step_message_map_nothing(sharing_world, vmm, field, value, error):
    w = sharing_world
    e, r = w.proc("e"), w.proc("r")
    core = step_pool(e, vmm)
    b = core.alloc(3 * MiB, payload=4)
    d = pickle.loads(e.send(b))
    forged = d._replace(**{field: value})
    if field == "size":
        forged = forged._replace(shape=(value,))
    with pytest.raises(error):
        r.recv(pickle.dumps(forged))
    assert r.importer.step_maps(0).reserved == 0 and fds_exported(vmm) == 0
    assert e.stats()["leases"] == 0
    owner = r.recv(pickle.dumps(d))  # the genuine message still maps
    assert read_here(r, owner, b.size) == (4, 4)


def test_an_exporter_exiting_waits_for_a_message_on_its_way(sharing_world, vmm):
    import threading

    w = sharing_world
    e, r = w.proc("e", exit_timeout=5.0), w.proc("r")
    core = step_pool(e, vmm)
    b = core.alloc(3 * MiB, payload=17)
    msg = e.send(b)
    del b  # the exporter's own array is gone: the ticket holds the block
    done = threading.Event()
    t = threading.Thread(target=lambda: (e.ctx.at_exit(), done.set()))
    t.start()
    try:
        assert not done.wait(0.2)  # waiting for the message's receiver
        owner = r.recv(msg)
        assert done.wait(5.0)  # claimed and mapped: the exit goes on
    finally:
        t.join(10)
    e.close()
    assert read_here(r, owner, 3 * MiB) == (17, 17)


def test_sixty_four_receivers_each_map_the_block_and_each_gets_its_own_descriptor(
    sharing_world, vmm
):
    w = sharing_world
    e = w.proc("e")
    core = step_pool(e, vmm)
    b = core.alloc(5 * MiB, payload=64)
    (sid, _va, n), *_ = steps_of(core, b)
    rs = [w.proc(f"r{i}") for i in range(64)]
    owners = [r.recv(e.send(b)) for r in rs]
    for r, o in zip(rs, owners, strict=True):
        assert read_here(r, o, b.size) == (64, 64)
        assert r.importer.step_maps(0).reserved == sum(s[2] for s in steps_of(core, b))
    assert fds_exported(vmm) == 64 * len(steps_of(core, b))  # once per receiving process
    assert len(book(e).receivers(core.placement, sid)) == 64
    ptr = b.ptr
    del owners, o, b  # (``o``: the loop's last)
    assert wait_for(lambda: core.freed == [ptr], 10.0)
    assert book(e).receivers(core.placement, sid) == set()


def test_many_blocks_on_shared_and_crossing_steps_travel_to_one_receiver_and_all_go(
    sharing_world, vmm
):
    """The GPU test of many pickled sizes, on the fakes: small blocks share a step (the
    claim names it held: no second descriptor), large ones cross step boundaries; the
    receiver reserves exactly the windows, and once everything is let go on both sides
    nothing is leased, pinned, mapped or reserved."""
    w = sharing_world
    e, r = w.proc("e"), w.proc("r", keep_mappings=0)
    core = step_pool(e, vmm)
    sizes = [4, 4000, 1_000_000, MiB, 1_200_000, 5 * MiB, 21 * MiB, 47 * MiB]
    blocks, owners, windows = [], [], {}
    for k, n in enumerate(sizes * 2):
        b = core.alloc(n, payload=1000 + k)
        steps = steps_of(core, b)
        windows[tuple(s[0] for s in steps)] = sum(s[2] for s in steps)
        o = r.recv(e.send(b))
        assert read_here(r, o, n) == (1000 + k, 1000 + k), (k, n, steps)
        assert r.importer.step_maps(0).reserved == sum(windows.values()), (k, n, windows)
        blocks.append(b)
        owners.append(o)
    assert any(len(k) > 1 for k in windows), "no block crossed a step boundary"
    held = {s[0] for b in blocks for s in steps_of(core, b)}
    assert r.importer.step_maps(0).stats()["step_handles"] == len(held)
    assert fds_exported(vmm) == len(held)  # each step's descriptor travelled once
    del owners, o  # (``o``: the loop's last)
    maps = r.importer.step_maps(0)
    assert wait_for(lambda: maps.stats()["step_windows"] == 0), maps.stats()
    assert wait_for(lambda: e.stats()["leases"] == 0), e.stats()
    assert not any(book(e).pinned(core.placement, sid) for sid in held)
    del blocks, b  # (``b``: the loop's last)
    core.trim()
    assert core.placement.reserved == 0
    assert maps.stats() == {"step_windows": 0, "step_handles": 0, "step_reserved_bytes": 0}


def test_trims_and_reallocations_after_a_receiver_was_sigkilled_never_reuse_its_steps(
    sharing_world, vmm
):
    """The GPU test of SIGKILLed receivers under trims and reallocations, on the fakes:
    the block the exporter let go stays in limbo for the live receiver (and the dead
    one until it is reaped), its steps stay mapped through every trim, the reallocated
    blocks land elsewhere, and once the live receiver lets go everything goes."""
    w = sharing_world
    e, r1, r2 = w.proc("e"), w.proc("r1"), w.proc("r2", keep_mappings=0)
    core = step_pool(e, vmm)
    shared = core.alloc(25 * MiB, payload=5)
    steps, at = steps_of(core, shared), shared.ptr
    o1, o2 = r1.recv(e.send(shared)), r2.recv(e.send(shared))
    r1.kill()
    del shared, o1
    for round_ in range(4):
        extra = [
            core.alloc(n, payload=100 * round_ + k)
            for k, n in enumerate((3 * MiB, 41 * MiB, MiB, 23 * MiB))
        ]
        for k, y in enumerate(extra):
            assert y.read()[1] == 100 * round_ + k
            assert y.ptr >= at + 25 * MiB or y.ptr + y.size <= at, (round_, k)  # elsewhere
        del extra, y
        core.trim()
        assert all(core.placement.step_ids.get(va) == sid for sid, va, _n in steps), round_
        assert read_here(r2, o2, 25 * MiB) == (5, 5), round_
    assert wait_for(lambda: e.stats()["leases"] == 1), e.stats()  # r1 reaped
    del o2
    assert wait_for(lambda: e.stats()["leases"] == 0), e.stats()
    # (freed just after the lease went: trimmed until it is)
    assert wait_for(lambda: core.trim() >= 0 and core.placement.reserved == 0), e.stats()


def test_blocks_on_shared_steps_received_by_many_threads_at_once(sharing_world, vmm):
    """Claims of one receiver in flight together (each naming the steps held when it
    was made, replies carrying descriptors in any order): every block reads its own
    bytes, each step is imported once here, and letting go in many threads frees all."""
    import threading

    w = sharing_world
    e, r = w.proc("e"), w.proc("r", keep_mappings=0)
    core = step_pool(e, vmm)
    sizes = [4000, 300_000, 700_000, 3 * MiB, 21 * MiB, 4000, 300_000, 5 * MiB] * 3
    blocks = [core.alloc(n, payload=k) for k, n in enumerate(sizes)]
    msgs = [e.send(b) for b in blocks]
    owners: list = [None] * len(msgs)
    errors: list = []

    def take(i):
        try:
            owners[i] = r.recv(msgs[i])
        except BaseException as exc:  # (reported below)
            errors.append(exc)

    def let_go(i):
        owners[i] = None

    for work in (take, let_go):
        ts = [threading.Thread(target=work, args=(i,)) for i in range(len(msgs))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(20)
        assert not errors, errors
        if work is take:
            for k, b in enumerate(blocks):
                assert read_here(r, owners[k], b.size) == (k, k), k
            held = {s[0] for b in blocks for s in steps_of(core, b)}
            assert r.importer.step_maps(0).stats()["step_handles"] == len(held)
    maps = r.importer.step_maps(0)
    assert wait_for(lambda: maps.stats()["step_windows"] == 0), maps.stats()
    assert wait_for(lambda: e.stats()["leases"] == 0), e.stats()
    del blocks, b  # (``b``: the loop's last)
    core.trim()
    assert core.placement.reserved == 0 and maps.stats()["step_handles"] == 0


def test_a_collection_inside_the_step_book_can_free_a_shared_block(sharing_world, vmm):
    """A garbage collection may run anywhere in the book's code, and the blocks it frees
    go to the exporter (its lock); meanwhile a receiver's Unmap holds the exporter's lock
    and updates the book.  One lock for both: the freeing finishes, nothing deadlocks."""
    import threading

    w = sharing_world
    e, r = w.proc("e"), w.proc("r")
    core = step_pool(e, vmm)
    b = core.alloc(3 * MiB, payload=1)
    owner = r.recv(e.send(b))
    exp, sid = e.exporter, steps_of(core, b)[0][0]
    in_book, unmap_has_lock = threading.Event(), threading.Event()
    freed: list = []

    def collection_in_the_book():  # a finalizer run while the book is being changed
        with exp.steps.lock:
            in_book.set()
            unmap_has_lock.wait(0.5)  # (never set while the book's lock is the exporter's)
            got = exp.lock.acquire(timeout=2.0)  # what Exporter.release does first
            freed.append(got)
            if got:
                exp.lock.release()

    def unmap_frame():  # what the server does with a receiver's Unmap
        in_book.wait(5.0)
        with exp.lock:
            unmap_has_lock.set()
            exp.steps.unmapped(99, core.placement, [sid])

    ts = [threading.Thread(target=f) for f in (collection_in_the_book, unmap_frame)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert freed == [True], "the collection waited for the exporter's lock: a deadlock"
    assert read_here(r, owner, b.size) == (1, 1)


def test_a_receiver_sigkilled_with_its_step_claim_in_flight_holds_up_nothing(sharing_world, vmm):
    """The receiver dies while the exporter answers its claim (the descriptors on their
    way): the exporter's exit does not wait for its ``Mapped``, and once it is reaped
    its lease, its pins and the block go."""
    import threading

    w = sharing_world
    e, r = w.proc("e", exit_timeout=5.0), w.proc("r", claim_timeout=2.0)
    core = step_pool(e, vmm)
    b = core.alloc(3 * MiB, payload=9)
    sid, ptr = steps_of(core, b)[0][0], b.ptr
    msg = e.send(b)
    e.exporter.claim_hook = lambda cid: r.kill()  # SIGKILL as the claim is answered
    failed: list = []
    t = threading.Thread(target=lambda: failed.append(pytest.raises(SharingError, r.recv, msg)))
    with pytest.warns(RuntimeWarning, match="StepClaim failed"):  # its reply had nowhere to go
        t.start()
        t.join(10)
        assert wait_for(lambda: e.stats()["peers"] == 0), e.stats()  # served, reaped
    assert failed, "the dead receiver's receive did not end"
    del b
    t0 = time.monotonic()
    e.ctx.at_exit()  # nothing on its way any more: no wait for a Mapped that never comes
    assert time.monotonic() - t0 < 2.0
    assert wait_for(lambda: core.freed == [ptr]), e.stats()
    assert e.stats()["leases"] == 0 and not book(e).pinned(core.placement, sid)


def test_a_receiver_keeps_no_entry_per_pool_an_exporter_made_and_let_go(sharing_world, vmm):
    """An exporter that makes a new pool per task (each sends one block, then goes):
    the receiver's table of the exporters' placements holds only those it maps now,
    not one entry per pool the exporter ever sent from."""
    w = sharing_world
    e, r = w.proc("e"), w.proc("r", keep_mappings=0)
    for k in range(40):
        core = step_pool(e, vmm)
        b = core.alloc(3 * MiB, payload=k)
        owner = r.recv(e.send(b))
        assert read_here(r, owner, b.size) == (k, k)
        assert len(r.importer._step_pools) == 1, k
        del owner, b
        assert wait_for(lambda: e.stats()["leases"] == 0), e.stats()
        assert len(r.importer._step_pools) == 0, k
    assert r.importer.step_maps(0).stats()["step_handles"] == 0


def test_every_descriptor_is_closed_on_every_failed_path_of_a_step_claim(sharing_world, vmm):
    """Open descriptors counted around the ways a step claim fails after descriptors
    exist: the exporter's export of the second of three steps refused, the receiver's
    import of its second step refused, its map refused, and a reply that comes after
    the receiver gave up waiting.  Each time nothing stays open, leased, pinned,
    imported or reserved, and the block still travels afterwards."""
    from fakes.sharing import open_fds

    w = sharing_world
    e, r = w.proc("e"), w.proc("r", keep_mappings=0, claim_timeout=0.3)
    core = step_pool(e, vmm)
    first = core.alloc(4000, payload=2)  # a round trip first: the connection is open
    o = r.recv(e.send(first))
    del o, first
    assert wait_for(lambda: e.stats()["leases"] == 0)
    held = [core.alloc(1000 * 1024) for _ in range(2)]
    spanning = core.alloc(1000 * 1024, payload=5)
    assert len(steps_of(core, spanning)) == 2  # across the small range's first step
    base = open_fds()
    maps = r.importer.step_maps(0)

    def failing(name, n):
        real = getattr(vmm, name)
        calls = []

        def f(*a):
            calls.append(a)
            if len(calls) == n:
                setattr(vmm, name, real)
                return (1, None) if name != "cuMemMap" else (1,)
            return real(*a)

        setattr(vmm, name, f)

    def settled():
        return (
            e.stats()["leases"] == 0
            and maps.stats() == {"step_windows": 0, "step_handles": 0, "step_reserved_bytes": 0}
            and not any(book(e).pinned(core.placement, s[0]) for s in steps_of(core, spanning))
            and open_fds() == base
        )

    failing("cuMemExportToShareableHandle", 2)
    with pytest.warns(RuntimeWarning, match="cuMemExportToShareableHandle"):
        with pytest.raises(SharingError, match="could not export the 2 step"):
            r.recv(e.send(spanning))
    assert wait_for(settled), (e.stats(), maps.stats(), open_fds(), base)
    failing("cuMemImportFromShareableHandle", 2)
    with pytest.raises(CUDADriverError, match="cuMemImportFromShareableHandle"):
        r.recv(e.send(spanning))
    assert wait_for(settled), (e.stats(), maps.stats(), open_fds(), base)
    vmm.fail["cuMemMap"] = 1
    with pytest.raises(CUDADriverError, match="cuMemMap"):
        r.recv(e.send(spanning))
    assert wait_for(settled), (e.stats(), maps.stats(), open_fds(), base)
    e.exporter.claim_hook = lambda cid: time.sleep(0.6)  # answered after r gave up
    n = fds_exported(vmm)
    with pytest.raises(SharingError, match="did not answer"):
        r.recv(e.send(spanning))
    e.exporter.claim_hook = None
    assert wait_for(lambda: fds_exported(vmm) == n + 2)  # the late grant's descriptors
    assert wait_for(settled), (e.stats(), maps.stats(), open_fds(), base)
    owner = r.recv(e.send(spanning))
    assert read_here(r, owner, spanning.size) == (5, 5)
    del owner
    assert wait_for(settled), (e.stats(), maps.stats(), open_fds(), base)
    del held


def test_the_tables_stay_bounded_under_a_churn_of_blocks_receivers_keep_idle(sharing_world, vmm):
    """Hundreds of fresh blocks of many sizes, each sent, read and let go, with the
    receiver keeping idle mappings (at most ``keep_mappings``), its exporter freeing
    and trimming as it goes: the exporter's records and book, the receiver's windows,
    handles, holds and placements stay within what the idle mappings hold."""
    w = sharing_world
    keep = 4
    e, r = w.proc("e"), w.proc("r", keep_mappings=keep)
    core = step_pool(e, vmm)
    sizes = [4000, 700 * 1024, 1000 * 1024, 3 * MiB, 21 * MiB]
    maps = r.importer.step_maps(0)
    for k in range(300):
        b = core.alloc(sizes[k % len(sizes)], payload=k)
        o = r.recv(e.send(b))
        assert read_here(r, o, b.size) == (k, k), k
        del o, b
        if k % 7 == 0:
            core.trim()
        idle = len(r.importer.idle)
        assert idle <= keep, k
        assert len(e.exporter.records) <= keep + 1, (k, e.stats())
        assert maps.stats()["step_windows"] <= keep + 1, (k, maps.stats())
        assert len(maps._holds) == 0 and len(maps._users) == len(maps._windows)
        assert sum(len(v) for v in book(e)._maps.values()) <= 2 * (keep + 1), k
        assert len(r.importer._step_pools) <= 1 and len(r.importer.maps) <= keep + 1
    r.importer.trim_idle(0)
    assert wait_for(lambda: e.stats()["leases"] == 0), e.stats()
    assert wait_for(lambda: not e.exporter.records), e.stats()
    assert maps.stats() == {"step_windows": 0, "step_handles": 0, "step_reserved_bytes": 0}
    assert not any(book(e)._maps.values()) and not r.importer._step_pools
    core.trim()
    assert core.placement.reserved == 0


def test_receivers_that_come_map_and_are_killed_leave_no_entry_behind(sharing_world, vmm):
    """Thirty receivers in turn, each mapping a block of the same step and a block of
    its own, then SIGKILLed: once each is reaped the exporter's peers, leases, book and
    records hold nothing of it, and the steps go at the next trim."""
    w = sharing_world
    e = w.proc("e")
    core = step_pool(e, vmm)
    shared = core.alloc(700 * 1024, payload=1)
    for k in range(30):
        r = w.proc(f"r{k}")
        own = core.alloc(5 * MiB, payload=100 + k)
        o1, o2 = r.recv(e.send(shared)), r.recv(e.send(own))
        assert (read_here(r, o1, shared.size)[0], read_here(r, o2, own.size)[0]) == (1, 100 + k)
        r.kill()
        del o1, o2, own
        assert wait_for(lambda: e.stats()["peers"] == 0 and e.stats()["leases"] == 0), k
        assert len(e.exporter.records) == 1, (k, e.stats())  # the shared one, still live
        assert not any(book(e)._maps.values()), k
    del shared
    assert wait_for(lambda: not e.exporter.records), e.stats()
    core.trim()
    assert core.placement.reserved == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_receiver_that_exits_while_it_maps_gives_its_steps_back(sharing_world, vmm, mode):
    """A receiver's normal exit (its finalizer, then its process gone) with arrays still
    mapped: the exporter's leases and pins of it go, the block it let go is freed, and
    a trim gives the steps back."""
    w = sharing_world
    e, r = w.proc("e"), w.proc("r")
    core = step_pool(e, vmm, mode)
    b = core.alloc(5 * MiB, payload=3)
    steps, ptr = steps_of(core, b), b.ptr
    owner = r.recv(e.send(b))
    assert read_here(r, owner, b.size) == (3, 3)
    del b
    assert core.freed == [] and all(book(e).pinned(core.placement, s[0]) for s in steps)
    r.exit()
    assert wait_for(lambda: core.freed == [ptr]), e.stats()
    assert e.stats()["leases"] == 0 and e.stats()["peers"] == 0
    assert not any(book(e).pinned(core.placement, s[0]) for s in steps)
    core.trim()
    assert core.placement.reserved == 0
    del owner


def test_a_view_across_a_step_boundary_maps_its_block_and_a_span_past_it_maps_nothing(
    sharing_world, vmm
):
    """An array that starts in one step and ends in the next reads the exporter's bytes
    at both ends through one window of the block's steps; a message whose array reaches
    past its block (forged offset) is refused before anything is claimed or mapped."""
    w = sharing_world
    e, r = w.proc("e"), w.proc("r")
    core = step_pool(e, vmm)
    held = [core.alloc(1000 * 1024) for _ in range(2)]
    b = core.alloc(1000 * 1024, payload=6)
    (_s1, va1, n1), (_s2, va2, n2) = steps_of(core, b)
    assert b.ptr < va2 < b.ptr + b.size  # the block crosses the boundary
    lo, hi = va2 - b.ptr - 100, va2 - b.ptr + 100  # a view from step 1 into step 2
    vmm.write(b.ptr + lo, 61)
    vmm.write(b.ptr + hi - 1, 62)
    d = pickle.loads(e.send(b, lo, hi - lo))
    forged = d._replace(offset=b.size - 10)  # its 200 bytes reach past the block
    with pytest.raises(_wire.ProtocolError):
        r.recv(pickle.dumps(forged))
    assert r.importer.step_maps(0).reserved == 0 and fds_exported(vmm) == 0
    owner = r.recv(pickle.dumps(d))
    assert (vmm.read(owner.ptr + lo), vmm.read(owner.ptr + hi - 1)) == (61, 62)
    assert r.importer.step_maps(0).reserved == n1 + n2 and va2 == va1 + n1
    del owner, held


def test_a_forged_held_claim_asking_for_a_pool_descriptor_of_a_step_block_is_refused(
    sharing_world, vmm
):
    """A step block has no CUDA pool whose descriptor could go out: a plain ``Claim``
    (``held``, so not refused as a fresh claim) asking for one is answered at once,
    refused, and grants nothing: no lease, no pin, nothing the exporter's exit waits for."""
    w = sharing_world
    e, r = w.proc("e"), w.proc("r", claim_timeout=3.0)
    core = step_pool(e, vmm)
    b = core.alloc(3 * MiB, payload=4)
    d = pickle.loads(e.send(b))
    c = r.importer.client(d.address)
    end = _wire.span(d)[1]
    t0 = time.monotonic()
    reply, fd = c.request(
        lambda seq: _wire.claim_for(d, seq, True, True, True, end)._replace(want_fd=True), 3.0
    )
    assert time.monotonic() - t0 < 2.0 and reply.status != _wire.OK and fd is None
    assert e.stats()["leases"] == 0 and e.exporter.unclaimed() == 1  # its ticket only
    assert not book(e).pinned(core.placement, steps_of(core, b)[0][0])
    owner = r.recv(pickle.dumps(d))  # the genuine message still maps
    assert read_here(r, owner, b.size) == (4, 4)
