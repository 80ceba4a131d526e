"""Forged messages that mix the fields of two genuine ones (CPU fakes): a live ticket of
one block never maps another block (I1, I5; docs/sharing.rst, trust boundary)."""

from __future__ import annotations

import os
import pickle

import pytest
from fakes.sharing import wait_for

from cupy_poolmem._errors import SharingError
from cupy_poolmem._sharing import _wire

KB = 1024


@pytest.fixture
def world(sharing_world):
    return sharing_world


def _two_blocks(world):
    """Block x (2 KiB, payload 1) and block y (1 KiB, payload 2) of one pool, each sent
    once: ``(e, core, x, y, dx, dy)``."""
    e = world.proc("exporter")
    core = e.pool()
    x = core.alloc(2 * KB, payload=1)
    y = core.alloc(KB, payload=2)
    return e, core, x, y, pickle.loads(e.send(x)), pickle.loads(e.send(y))


def _genuine_still_received(r, dx, dy):
    """The genuine messages are still received, with their own data."""
    for d, want in ((dx, 1), (dy, 2)):
        imp = r.recv(pickle.dumps(d))
        assert r.read(imp)[1] == want
        del imp


def test_a_live_ticket_of_one_block_does_not_map_another_blocks_allocation(world):
    """x's message (live ticket) with y's export data: the exporter granted x's ticket
    and the receiver mapped y, 2 KiB of a 1 KiB block, under x's lease (y itself not
    leased: freed or recycled under the reader).  The claim names the allocation."""
    e, _core, x, y, dx, dy = _two_blocks(world)
    r = world.proc("receiver")
    forged = pickle.dumps(dx._replace(export_data=dy.export_data))
    with pytest.raises(_wire.ProtocolError, match="not those of the block it names"):
        r.recv(forged)
    assert world.gpu.violations == [] and e.stats()["leases"] == 0
    assert r.importer.stats()["imported_blocks"] == 0
    _genuine_still_received(r, dx, dy)
    del x, y
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)


def test_a_live_ticket_does_not_map_a_block_of_another_pool(world):
    """x's message naming an allocation of another pool the receiver imported already
    (its uuid and export data from a genuine message of that pool)."""
    e, core, x, y, dx, dy = _two_blocks(world)
    other = e.pool()
    z = other.alloc(4 * KB, payload=3)
    w = other.alloc(4 * KB, payload=4)
    dz, dw = pickle.loads(e.send(z)), pickle.loads(e.send(w))
    r = world.proc("receiver")
    kept = r.recv(pickle.dumps(dz))  # the other pool is imported here
    forged = pickle.dumps(dx._replace(pool_uuid=dw.pool_uuid, export_data=dw.export_data))
    with pytest.raises(_wire.ProtocolError, match="not those of the block it names"):
        r.recv(forged)
    assert e.stats()["leases"] == 1  # z's, for ``kept`` only
    got = r.recv(pickle.dumps(dw))
    assert r.read(got)[1] == 4
    del kept, got, z, w
    _genuine_still_received(r, dx, dy)
    del x, y
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)


def test_a_numba_mapping_of_one_block_is_not_leased_for_another(world):
    """y mapped through a Numba handle (no lease), then x's message forged with y's
    export data: without the check the raw mapping became x's lease, sized as x."""
    e, core, x, y, dx, dy = _two_blocks(world)
    r = world.proc("receiver")
    fd = os.dup(core._rfd)  # what the Numba IPC handle carries
    try:
        raw = r.importer.open_raw(dy.pool_uuid, 0, dy.export_data, dy.size, fd)
    finally:
        os.close(fd)
    with pytest.raises(_wire.ProtocolError, match="not those of the block it names"):
        r.recv(pickle.dumps(dx._replace(export_data=dy.export_data)))
    assert not raw.leased and raw.size == KB and raw.export_id == 0
    r.importer.close_raw(raw)
    _genuine_still_received(r, dx, dy)
    del x, y
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)


def test_the_claim_frame_carries_the_block_and_round_trips():
    c = _wire.Claim(7, 3, b"t" * 16, True, False, True, 2, 1024, 512, _wire.block_id("p", 0, b"d"))
    assert _wire.decode(_wire.encode(c)) == [c]
    assert (
        _wire.block_id("p", 0, b"d") != _wire.block_id("p", 0, b"e") != _wire.block_id("q", 0, b"e")
    )
    assert len(_wire.block_id("p", 0, b"\0" * 64)) == 16


def _raw(r, core, d, size, view):
    fd = os.dup(core._rfd)  # what the Numba IPC handle carries
    try:
        return r.importer.open_raw(d.pool_uuid, 0, d.export_data, size, fd, view)
    finally:
        os.close(fd)


def test_a_numba_handle_past_its_allocation_is_refused_before_mapping(world):
    """A handle's own offset and size must lie within its allocation size."""
    e, core, x, y, dx, dy = _two_blocks(world)
    r = world.proc("receiver")
    for view in ((0, KB + 1), (KB, 1), (-1, 4), (8, -4)):
        with pytest.raises(_wire.ProtocolError, match="Numba IPC handle"):
            _raw(r, core, dy, KB, view)
    assert r.importer.stats()["imported_blocks"] == 0 and not r.importer.pools
    raw = _raw(r, core, dy, KB, (KB - 4, 4))  # the last item: fine
    r.importer.close_raw(raw)
    _genuine_still_received(r, dx, dy)
    del x, y
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)


def test_a_numba_handle_larger_than_the_leased_mapping_is_refused(world):
    """The block mapped under a lease (its size checked by the exporter), then a Numba
    handle of it that says the allocation is 64 times larger: the handle's array would
    reach 63 KiB past the block.  The mapping made already bounds it."""
    e, core, x, y, dx, dy = _two_blocks(world)
    r = world.proc("receiver")
    imp = r.recv(pickle.dumps(dy))
    with pytest.raises(_wire.ProtocolError, match="allocation of 1024 bytes"):
        _raw(r, core, dy, 64 * KB, (0, 64 * KB))
    assert imp.m.users == 1  # no user counted for the refused handle
    raw = _raw(r, core, dy, KB, (0, KB))
    assert raw is imp.m and raw.users == 2
    r.importer.close_raw(raw)
    assert r.read(imp)[1] == 2
    del imp, raw
    _genuine_still_received(r, dx, dy)
    del x, y
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)


# -- stale copies through forwarders and round trips (sequences the model draws rarely) ---
def test_a_forwarded_copy_after_the_block_was_recycled_is_refused_everywhere(world):
    """p2 holds life 1 and forwards it (a ticket the exporter registered); nobody takes
    the forward, its ticket expires, p2 lets go: the block recycles into life 2 (new
    data).  The forward's copy then reaches p3, which maps life 2 fresh, and p1 (the
    exporter, a round trip): refused in both, never life 2's data."""
    e = world.proc("exporter")
    core = e.pool(recycle=True)
    b = core.alloc(KB, payload=1)
    r2, r3 = world.proc("p2"), world.proc("p3")
    held = r2.recv(e.send(b))
    fwd = r2.send(held)  # the forward: a ticket registered for p2's array
    del held, b
    e.exporter.expire(now=float("inf"))  # the forward's ticket expires
    assert wait_for(lambda: core.cached_blocks() == 1)  # recycled: life 1 is over
    b2 = core.alloc(KB, payload=2)
    own2 = r3.recv(e.send(b2))  # p3 maps life 2 fresh
    assert r3.read(own2, 0)[1] == 2
    for who in (r3, e):
        with pytest.raises(SharingError, match="stale|freed or reused"):
            who.recv(fwd)
    assert r3.read(own2, 0)[1] == 2
    assert e.stats()["tickets_out"] == 0  # the refused copies pinned nothing
    del own2, b2


def test_a_copy_of_life_one_back_in_its_exporter_is_refused_dormant_and_reused(world):
    """A copy of life 1's message comes back to the exporter while the block waits in
    the reuse cache (dormant), then while a new array uses it (not sent yet), then in
    life 2: refused each time (a LocalHold would read the new array's data)."""
    e = world.proc("exporter")
    core = e.pool(recycle=True)
    b = core.alloc(KB, payload=1)
    r = world.proc("receiver")
    first = e.send(b)
    copy = pickle.dumps(pickle.loads(first))
    got = r.recv(first)
    del got, b
    assert wait_for(lambda: core.cached_blocks() == 1)
    with pytest.raises(SharingError):
        e.recv(copy)  # dormant
    b2 = core.alloc(KB, payload=2)  # the same block, a new array, not sent yet
    with pytest.raises(SharingError):
        e.recv(copy)
    msg2 = e.send(b2)  # life 2
    with pytest.raises(SharingError):
        e.recv(copy)
    own = e.recv(msg2)  # life 2's own message: its data
    assert e.read(own)[1] == 2
    del own, b2


@pytest.mark.parametrize(
    "shape, strides",
    [((2**62,), (0,)), ((2**40, 2**40), (0, 0)), ((2**61, 4), (0, 0))],
)
def test_a_broadcast_descriptor_too_large_for_an_array_is_a_protocol_error(shape, strides):
    """Zero strides keep any count of items inside the block; ``count * itemsize`` past
    2**63 is no array size (numpy and CuPy raised a bare ValueError after mapping)."""
    d = _wire.Descriptor(
        _wire.VERSION, "cupy", "/tmp/x", "pool", "GPU-x", _wire.POOL_DEVICE, 1,
        b"\0" * 64, 1024, b"\1" * 16, None, 0, shape, strides, "<f4", 1,
    )  # fmt: skip
    with pytest.raises(_wire.ProtocolError, match=r"malformed \(shape="):
        _wire.check_descriptor(d)
    ok = d._replace(shape=(2**60,), strides=(0,))  # 2**62 bytes: an array size
    assert _wire.check_descriptor(ok) is ok
    empty = d._replace(shape=(2**62, 2**62, 0), strides=(0, 0, 4))
    assert _wire.check_descriptor(empty) is empty


def test_a_host_array_on_device_memory_is_a_malformed_descriptor():
    """kind "numpy" makes the receiver build a host array on the mapping's address: on
    a device pool's block the host would dereference a device address."""
    d = _wire.Descriptor(
        _wire.VERSION, "numpy", "/tmp/x", "pool", "", _wire.POOL_DEVICE, 1,
        b"\0" * 64, 1024, b"\1" * 16, None, 0, (256,), (4,), "<f4", 0,
    )  # fmt: skip
    with pytest.raises(_wire.ProtocolError, match=r"malformed \(kind="):
        _wire.check_descriptor(d)
    for kind in (_wire.POOL_PINNED, _wire.POOL_MANAGED):
        ok = d._replace(pool_kind=kind)
        assert _wire.check_descriptor(ok) is ok


@pytest.mark.parametrize("held", [False, True], ids=["claim", "hit"])
def test_a_forged_pool_kind_is_refused_whatever_the_receiver_maps(world, held):
    """A device block's message naming a pinned (host) pool, with its live ticket: a
    fresh receiver would import the pool as a host pool (the exporter refuses the
    claim); one that maps the block already checks its pool's kind."""
    e, _core, x, y, dx, dy = _two_blocks(world)
    r = world.proc("receiver")
    kept = r.recv(pickle.dumps(dy)) if held else None
    if held:
        dy = pickle.loads(e.send(y))  # a new live ticket for the forged copy
    forged = pickle.dumps(dy._replace(kind="numpy", pool_kind=_wire.POOL_PINNED))
    with pytest.raises(_wire.ProtocolError, match="kind|not those of the block"):
        r.recv(forged)
    assert r.importer.stats()["imported_pools"] == (1 if held else 0)
    del kept
    if held:  # the refused copy gave its (copied) ticket back, as docs say it may
        dy = pickle.loads(e.send(y))
    _genuine_still_received(r, dx, dy)
    del x, y
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)
