"""The pieces under step-backed sharing, each on its own: the StepClaim and StepReply
frames, many descriptors over one connection, the receiver's hold on the handles a
claim names, the receiver's peers, and an unmap that waits for the last use
(docs/sharing.rst, "Mapped and expandable blocks")."""

from __future__ import annotations

import os
import socket

import pytest
from fakes.sharing import wait_for
from fakes.step_sharing import read_here, step_pool
from fakes.steps import StepVmm

from cupy_poolmem._errors import SharingError
from cupy_poolmem._expandable import ExpandableBlocks
from cupy_poolmem._sharing import _transport, _wire
from cupy_poolmem._sharing._steps import StepExports, StepMappings

MiB = 1 << 20


@pytest.fixture
def vmm(monkeypatch, fake_driver, sharing_world):
    from fakes.events import use_driver

    v = use_driver(fake_driver, monkeypatch, StepVmm())
    sharing_world.gpu.vmm = v
    return v


def _claim(seq=7):
    return _wire.Claim(seq, 3, b"t" * 16, False, True, False, 0, 4096, 4096, b"b" * 16)


# -- frames ------------------------------------------------------------------------------------
def test_step_frames_round_trip_alone_and_in_a_batch():
    claim = _wire.StepClaim(_claim(), (5, 9, 1 << 40))
    reply = _wire.StepReply(7, _wire.OK, ((5, 0x20000, 2 * MiB, False), (6, 0x220000, MiB, True)))
    assert _wire.decode(_wire.encode(claim)) == [claim]
    assert _wire.decode(_wire.encode(reply)) == [reply]
    assert _wire.decode(_wire.encode_batch([claim, _wire.Mapped(3)])) == [claim, _wire.Mapped(3)]
    empty = _wire.StepReply(8, _wire.STALE_STEPS, ())
    assert _wire.decode(_wire.encode(empty)) == [empty]


def test_a_claim_names_at_most_have_max_steps_held():
    many = tuple(range(_wire.HAVE_MAX + 100))
    (back,) = _wire.decode(_wire.encode(_wire.StepClaim(_claim(), many)))
    assert back.have == many[: _wire.HAVE_MAX]  # the rest come again with descriptors


def test_a_forged_claim_naming_more_held_steps_than_a_claim_names_is_refused():
    """No receiver sends more than ``HAVE_MAX`` held ids (encode cuts the list): a frame
    that names more is malformed, refused before the exporter reads it."""
    head = _wire.encode(_wire.StepClaim(_claim(), ()))[:-4]
    n = _wire.HAVE_MAX + 1
    forged = head + n.to_bytes(4, "little") + b"".join(i.to_bytes(8, "little") for i in range(n))
    with pytest.raises(_wire.ProtocolError, match="entries"):
        _wire.decode(forged)
    ok = head + (n - 1).to_bytes(4, "little") + b"\1" * 8 * (n - 1)
    assert len(_wire.decode(ok)[0].have) == _wire.HAVE_MAX


@pytest.mark.parametrize("cut", [1, 8, 25])
def test_truncated_or_padded_step_frames_are_refused(cut):
    buf = _wire.encode(_wire.StepReply(7, _wire.OK, ((5, 0x20000, 2 * MiB, True),) * 3))
    with pytest.raises(_wire.ProtocolError):
        _wire.decode(buf[:-cut])
    with pytest.raises(_wire.ProtocolError):
        _wire.decode(buf + b"\0" * cut)
    claim = _wire.encode(_wire.StepClaim(_claim(), (1, 2)))
    with pytest.raises(_wire.ProtocolError):
        _wire.decode(claim[:-cut])


def test_step_export_data_names_the_block_and_a_digest_of_its_steps():
    steps = [(1, 0x200000, 2 * MiB), (2, 0x400000, 2 * MiB)]
    data = _wire.step_export_data(0x300000, 2 * MiB, steps)
    assert len(data) == 64 and _wire.step_block(data)[:3] == (0x300000, 2 * MiB, 2)
    other = _wire.step_export_data(
        0x300000, 2 * MiB, [(1, 0x200000, 2 * MiB), (3, 0x400000, 2 * MiB)]
    )
    assert other != data  # another step under the same addresses: another block
    assert _wire.step_block(bytes(64)) is None  # a CUDA pool's export record


# -- descriptors ---------------------------------------------------------------------------------
def _socketpair_conns():
    from multiprocessing import connection as mpc

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ca = _transport.Conn(mpc.Connection(a.detach()), _transport.PeerProcess(0, watch=False))
    cb = _transport.Conn(mpc.Connection(b.detach()), _transport.PeerProcess(0, watch=False))
    return ca, cb


def test_more_descriptors_than_one_message_takes_arrive_in_order():
    sender, receiver = _socketpair_conns()
    files = [os.memfd_create(f"f{i}") for i in range(2 * _wire.STEP_FD_MAX + 7)]
    try:
        sender.send(b"reply", fds=files)
        sender.send(b"next")
        assert receiver.recv() == b"reply"
        got = receiver.recv_fds(len(files))
        assert [os.fstat(g).st_ino for g in got] == [os.fstat(f).st_ino for f in files]
        for g in got:
            os.close(g)
        assert receiver.recv() == b"next"  # in step after three descriptor messages
    finally:
        for f in files:
            os.close(f)
        sender.close()
        receiver.close()


def test_a_frame_whose_descriptors_cannot_follow_closes_the_connection_out_of_step():
    """The frame went out saying descriptors follow, then sending them failed: the peer
    would take the next frame's first byte for them (and everything after it for
    garbage).  The connection is shut instead: nothing more is sent on it, and the peer
    reads the end of the stream where the descriptors were due."""
    sender, receiver = _socketpair_conns()
    not_open = 1 << 20  # (no process has this many descriptors open)
    try:
        with pytest.raises(OSError):
            sender.send(b"reply", fds=[not_open])
        with pytest.raises(OSError):
            sender.send(b"next")  # never after a frame left out of step
        assert receiver.recv() == b"reply"
        with pytest.raises(EOFError):
            receiver.recv_fds(1)
    finally:
        sender.close()
        receiver.close()


def test_descriptors_lost_for_want_of_free_ones_are_named_and_none_is_left_open():
    import resource

    sender, receiver = _socketpair_conns()
    files = [os.memfd_create(f"f{i}") for i in range(_wire.STEP_FD_MAX + 3)]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fillers: list[int] = []
    try:
        sender.send(b"reply", fds=files)
        sender.send(b"next")
        assert receiver.recv() == b"reply"
        open_before = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_before + 8, hard))
        try:
            while True:
                fillers.append(os.dup(files[0]))
        except OSError:
            pass
        with pytest.raises(SharingError, match="EMFILE"):
            receiver.recv_fds(len(files))
        for fd in fillers:
            os.close(fd)
        fillers = []
        assert len(os.listdir("/proc/self/fd")) == open_before  # none of them kept
        assert receiver.recv() == b"next"  # and the connection is in step
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for f in files:
            os.close(f)
        sender.close()
        receiver.close()


# -- the receiver's hold on what a claim names ------------------------------------------------
def test_a_handle_a_claim_names_stays_imported_until_the_reply_is_handled(vmm):
    blocks = ExpandableBlocks(0, span=1 << 30, driver=vmm, sync=vmm.sync_device, exportable=True)
    err, a = blocks.alloc(MiB, 0x5000)
    assert err == 0
    book, maps = StepExports(vmm), StepMappings(vmm, 0)
    steps = blocks.steps_under(a, MiB)
    _, key = maps.map("e", a, MiB, book.grant(1, blocks, a, MiB, steps))
    held = maps.hold("e")  # a claim names the step: its reply sends no descriptor
    assert held == (steps[0][0],)
    maps.unmap(key)  # the only window goes meanwhile...
    assert maps.have("e") == {steps[0][0]}  # ...but the handle stays for the claim
    grants = book.grant(1, blocks, a, MiB, steps, held)
    assert grants[0].fd is None
    here, key = maps.map("e", a, MiB, grants)  # mapped from the held handle
    maps.let_go("e", held)
    assert maps.have("e") == {steps[0][0]}  # a window maps it now
    maps.unmap(key)
    assert maps.have("e") == set() and maps.stats()["step_reserved_bytes"] == 0
    held = maps.hold("e")
    maps.let_go("e", held)  # nothing held: nothing released twice
    assert vmm.handles_alive == set()
    blocks.free(a, 0x5000)


# -- peers and the unmap's wait ------------------------------------------------------------------
def test_a_receivers_mapping_gives_every_gpu_it_sees_access_as_imported_pools_do(
    sharing_world, vmm
):
    w = sharing_world
    e, both, one = w.proc("e"), w.proc("both"), w.proc("one", visible=[0])
    core = step_pool(e, vmm)
    b = core.alloc(3 * MiB, payload=5)
    o2 = both.recv(e.send(b))
    o1 = one.recv(e.send(b))
    for proc, owner, want in ((both, o2, [0, 1]), (one, o1, [0])):
        (win,) = proc.importer.step_maps(0)._windows.values()
        assert sorted(dev for dev, flags in vmm.access[win.base] if flags == "READWRITE") == want
        assert read_here(proc, owner, b.size) == (5, 5)


def test_a_receiver_unmaps_only_once_its_last_use_is_done(sharing_world, vmm):
    w = sharing_world
    e, r = w.proc("e"), w.proc("r", keep_mappings=0)
    core = step_pool(e, vmm)
    b = core.alloc(3 * MiB, payload=5)
    owner = r.recv(e.send(b))
    maps = r.importer.step_maps(0)
    r.driver.unfinished = 1  # a kernel reading it still runs
    del owner
    assert maps.stats()["step_windows"] == 1  # not unmapped under that kernel
    assert e.stats()["leases"] == 1  # and the exporter still holds the block for it
    assert wait_for(lambda: maps.stats()["step_windows"] == 0)  # later, once it is done
    assert wait_for(lambda: e.stats()["leases"] == 0)
    assert not e.exporter.steps.pinned(core.placement, core.placement.steps_under(b.ptr, 1)[0][0])
