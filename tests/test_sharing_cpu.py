"""Every lifecycle of the sharing protocol on a CPU: real sockets, a fake driver.

Each test builds simulated processes (``SimProc``: a ``SharingContext`` with its own
settings and ``FakeDriver``) on one ``FakeGPU`` and checks what a receiver sees (the
generation and payload of the allocation it maps), the counts of ``ctx.stats()``, and
that the fake recorded no driver-rule violation.  See ``tests/fakes/sharing.py``.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import pickle
import random
import socket
import stat
import sys
import threading
import time
import warnings
from multiprocessing import connection as mpc

import pytest
from fakes.sharing import (
    FakeDriver,
    FakeStream,
    World,
    gated_wait_gone,
    open_fds,
    sharing_threads,
    wait_for,
)

from cupy_poolmem._errors import CUDADriverError, PoolmemError, SharingError
from cupy_poolmem._sharing import _exporter, _records, _transport, _unmapping, _wire
from cupy_poolmem._sharing._context import SharingContext
from cupy_poolmem._sharing._driver import Driver
from cupy_poolmem._sharing._records import LocalHold
from cupy_poolmem._sharing._reducers import describe, rebuild, receive

KB = 1024


@pytest.fixture
def world(sharing_world):
    return sharing_world


def _exporter_receiver(world, **recv_opts):
    e = world.proc("exporter")
    r = world.proc("receiver", **recv_opts)
    return e, r, e.pool()


def _frees(gpu, name="exporter"):
    return [x for x in gpu.log if x[0] == name and x[1] == "free"]


def _imports(gpu, name):
    return [x for x in gpu.log if x[0] == name and x[1] == "import"]


def _foreign_events_open(gpu, name):
    """Other processes' events ``name`` opened and has not closed."""
    opened = sum(1 for x in gpu.log if x[0] == name and x[1] == "open_event")
    closed = sum(1 for x in gpu.log if x[0] == name and x[1] == "close_event" and x[3])
    return opened - closed


# -- the fake itself: it must see the violations the tests rely on it to see --------------------
def test_driver_and_fake_driver_have_the_same_methods():
    def surface(cls):
        return {
            n: inspect.signature(f)
            for n, f in inspect.getmembers(cls, inspect.isfunction)
            if not n.startswith("_")
        }

    real, fake = surface(Driver), surface(FakeDriver)
    assert sorted(real) == sorted(fake), "FakeDriver drifted from Driver: keep them in step"
    for name, sig in real.items():
        assert list(sig.parameters) == list(fake[name].parameters), name
        defaults = [p.default for p in sig.parameters.values()]
        assert defaults == [p.default for p in fake[name].parameters.values()], name


def test_fake_gpu_flags_the_rules_it_checks():
    w = World()
    gpu = w.gpu
    e, r = w.proc("e"), w.proc("r")
    core = e.pool()
    try:
        b = core.alloc(64, payload=5)
        data = e.driver.export_pointer(b.ptr)
        h, _keep = r.driver.import_pool(core._rfd, core.kind, 0)
        # a read before the sender's writes are ordered before it
        local = r.driver.import_pointer(h, data)
        r.gpu.read(r.gpu.proc("r"), local)
        assert "before the sender's writes" in gpu.violations.pop()
        # the exporter frees while the receiver still maps it
        core._free_now(b.ptr, b.stream_ptr)
        assert "still imports it" in gpu.violations.pop()
        b.ptr = 0  # freed by hand above
        # a free not ordered after the importer's unmap
        b2 = core.alloc(64)
        local2 = r.driver.import_pointer(h, e.driver.export_pointer(b2.ptr))
        r.driver.free_async(local2, 7)
        core._free_now(b2.ptr, b2.stream_ptr)
        assert "without waiting" in gpu.violations.pop()
        b2.ptr = 0
        # a second import while the first one's free is not waited for
        b3 = core.alloc(64)
        data3 = e.driver.export_pointer(b3.ptr)
        local3 = r.driver.import_pointer(h, data3)
        r.driver.free_async(local3, 7)
        r.driver.import_pointer(h, data3)
        assert "again while its earlier import is live" in gpu.violations.pop()
        # an event used after closing it
        ev = r.driver.plain_event(7)
        r.driver.close_event(ev)
        r.driver.wait_event(7, ev)
        assert "after closing it" in gpu.violations.pop()
        assert gpu.violations == []
    finally:
        gpu.context_gone("r")
        w.teardown()


# -- the transport on its own ----------------------------------------------------------------------
def _new_threads(before, name):
    return [t for t in sharing_threads() if t not in before and t.name == name and t.is_alive()]


def test_closing_the_listener_ends_its_accept_thread():
    before = set(sharing_threads())
    lst = _transport.Listener(b"family key", lambda conn: None)
    assert wait_for(lambda: _new_threads(before, "cupy_poolmem-listen"))
    lst.close()  # a thread blocked in accept() kept the socket listening, forever
    assert wait_for(lambda: not _new_threads(before, "cupy_poolmem-listen"), 2.0)


def test_a_sender_thread_ends_when_its_connection_closes():
    class Conn:
        def __init__(self):
            self.sent = []

        def send(self, data, fd=None):
            self.sent.append(data)

    before = set(sharing_threads())
    s = _transport.Sender(Conn(), "cupy_poolmem-test-sender")
    s.post(_wire.Evict(1))
    assert s.flush(5.0) and s.conn.sent == [_wire.encode(_wire.Evict(1))]
    assert _new_threads(before, "cupy_poolmem-test-sender")
    s.close()  # one idle thread per dead peer stayed forever
    assert wait_for(lambda: not _new_threads(before, "cupy_poolmem-test-sender"), 2.0)
    s.post(_wire.Evict(2))  # posting to a closed sender is a no-op
    assert not _new_threads(before, "cupy_poolmem-test-sender") and len(s.conn.sent) == 1


def _conn_pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = _transport.Conn(mpc.Connection(os.dup(a.fileno())), _transport.PeerProcess(0))
    a.close()
    return conn, b


def test_closing_a_connection_waits_for_a_send_in_progress():
    """A bare close() released the descriptor's number under a send: the send could
    then write its frame into whatever socket or file reused the number."""
    conn, other = _conn_pair()
    entered, gate = threading.Event(), threading.Event()
    real = conn._c.send_bytes

    def slow_send(data):  # a send that has started (its descriptor number in hand)
        entered.set()
        gate.wait(5.0)
        real(data)

    conn._c.send_bytes = slow_send
    failed = []

    def send():
        try:
            conn.send(b"frame")
        except OSError as exc:
            failed.append(exc)

    sender = threading.Thread(target=send)
    sender.start()
    closer = threading.Thread(target=conn.close)
    try:
        assert entered.wait(5.0)
        closer.start()
        closer.join(0.2)
        assert closer.is_alive(), "close() released the descriptor under a send"
    finally:
        gate.set()
        sender.join(5.0)
        closer.join(5.0)
    assert not closer.is_alive() and len(failed) == 1  # shut down first: the send failed
    with pytest.raises(OSError):
        conn.send(b"late")
    assert conn.try_send(b"late") is False
    other.close()


def test_shutting_a_connection_down_wakes_its_reader():
    conn, other = _conn_pair()
    got = []

    def read():
        try:
            got.append(conn.recv())
        except (EOFError, OSError) as exc:
            got.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        time.sleep(0.05)
        conn.shutdown()  # a bare close() left the reader blocked and the socket open
        reader.join(2.0)
        assert not reader.is_alive() and isinstance(got[0], (EOFError, OSError))
        conn.close()  # by the reader's side, once it has stopped reading
        other.settimeout(2.0)
        assert other.recv(16) == b""  # the peer sees EOF
    finally:
        other.close()  # (a reader still blocked wakes now)
        reader.join(2.0)


def test_a_fork_child_forgets_its_copy_of_a_connection_without_breaking_the_parents():
    parent, other = _conn_pair()
    child = _transport.Conn(mpc.Connection(os.dup(parent._c.fileno())), parent.peer)
    child.forget()  # what abandon() does with the copy a fork child inherited
    parent.send(b"still open")
    other.settimeout(2.0)
    assert other.recv(64).endswith(b"still open")
    child2 = _transport.Conn(mpc.Connection(os.dup(parent._c.fileno())), parent.peer)
    child2.close()  # close() would have shut the shared socket down under the parent
    with pytest.raises(OSError):
        parent.send(b"broken")
    parent.close()
    other.close()


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux (/proc, pidfds)")
def test_a_receiver_keeps_no_descriptor_of_an_exporter_it_reached():
    """A receiver's connection kept a pidfd of its exporter after it closed: a consumer
    fed by 24 short-lived producers held 24 descriptors of dead processes."""
    other = os.getppid()  # a live process that is not this one: pidfds can be taken
    served = []
    lst = _transport.Listener(
        b"family key", served.append, peer_cred=lambda sock: (other, os.getuid())
    )
    try:
        before = _open_fds()
        for _ in range(5):
            client = _transport.connect(lst.address, b"family key")
            assert wait_for(lambda: served)
            server = served.pop()
            assert client.peer._fd == -1, "the receiving end watches nobody"
            if hasattr(os, "pidfd_open"):
                assert server.peer._fd >= 0, "the exporter watches its receiver"
            client.close()
            server.close()
            assert server.peer._fd >= 0 or not hasattr(os, "pidfd_open")  # kept to reap
            server.peer.close()  # what the exporter's reaper does once the peer is gone
        assert _open_fds() == before
    finally:
        lst.close()


def test_a_fork_child_drops_its_copy_of_the_exporters_pidfd():
    served = []
    lst = _transport.Listener(
        b"family key", served.append, peer_cred=lambda sock: (os.getppid(), os.getuid())
    )
    try:
        client = _transport.connect(lst.address, b"family key")
        assert wait_for(lambda: served)
        server = served.pop()
        server.forget()  # as a fork child does with what it inherited
        assert server.peer._fd == -1
        client.close()
    finally:
        lst.close()


def test_a_context_forked_after_cuda_init_refuses_to_share(world):
    e = world.proc("exporter")
    b = e.pool().alloc(KB, payload=1)
    msg = e.send(b)
    forked = SharingContext(e.settings, driver=e.driver, forked=True)
    with pytest.raises(PoolmemError, match="spawn"):
        describe(forked, b, "cupy", 0, (KB,), (1,), "|u1")
    with pytest.raises(PoolmemError, match="forkserver"):
        receive(forked, pickle.loads(msg))
    e.exporter.expire(now=time.monotonic() + 1e6)
    del b


@contextlib.contextmanager
def _held_by_another_thread(lock):
    """``lock`` is held by another thread (a parent's thread at a fork) inside the block."""
    held, done = threading.Event(), threading.Event()

    def hold():
        with lock:
            held.set()
            done.wait(10.0)

    t = _started(hold)
    held.wait()
    try:
        yield
    finally:
        done.set()
        t.join()


def _started(fn):
    t = threading.Thread(target=fn)
    t.start()
    return t


def test_arrays_a_fork_child_inherited_are_let_go_without_locks_or_the_driver(world):
    e = world.proc("exporter")
    core = e.pool()
    b = core.alloc(KB, payload=1)
    hold = e.recv(e.send(b))
    b2 = core.alloc(KB, payload=2)
    e.send(b2)  # a ticket out
    inherited = [b, hold, b2]
    del b, hold, b2
    # A parent thread held the exporter's lock at the fork: it never runs in the child.
    with _held_by_another_thread(e.exporter.lock):
        address = e.exporter.address
        e.ctx.abandon()  # what the fork child's hook does with the parent's sharing state
        n_log = len(world.gpu.log)
        child = _started(inherited.clear)  # the child lets its arrays go
        child.join(2.0)
        stuck = child.is_alive()
    child.join()
    with socket.socket(socket.AF_UNIX) as s:  # wake the abandoned listener's thread
        s.connect(address)
    assert not stuck, "a fork child's array waited for a lock its parent's thread held"
    assert world.gpu.log[n_log:] == []  # and made no CUDA call for the parent's memory


def test_received_arrays_a_fork_child_inherited_are_let_go_without_locks_or_the_driver(world):
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=1)
    inherited = [r.recv(e.send(b))]
    with _held_by_another_thread(r.importer.lock):
        r.ctx.abandon()
        n_log = len([x for x in world.gpu.log if x[0] == "receiver"])
        m = inherited[0].m
        syncs = []
        r.driver.sync_stream = syncs.append  # a Numba handle let go syncs the device

        def child_lets_go():
            r.importer.close_raw(m)  # a Numba handle on the same mapping
            inherited.clear()

        child = _started(child_lets_go)
        child.join(2.0)
        stuck = child.is_alive()
    child.join()
    assert not stuck, "a fork child's array waited for a lock its parent's thread held"
    assert len([x for x in world.gpu.log if x[0] == "receiver"]) == n_log and syncs == []
    r.kill()  # the receiving process ends (its simulated reader thread with it)
    for peer in list(e.exporter.peers.values()):
        peer.conn.shutdown()
    del b


# -- 1. a producer that sends and exits normally -------------------------------------------------


def test_exit_with_nobody_reading_returns_after_exit_timeout(world):
    e = world.proc("exporter", exit_timeout=0.3)
    b = e.pool().alloc(KB, payload=1)
    e.send(b)
    del b
    t0 = time.monotonic()
    e.ctx.at_exit()
    took = time.monotonic() - t0
    assert 0.3 <= took < 1.5
    assert e.stats()["tickets_out"] == 1  # unclaimed: it pinned the block until the end


def test_exit_with_several_stalled_exporters_is_bounded_by_exit_timeout(world):
    r = world.proc("receiver", exit_timeout=0.3)
    es = [world.proc(f"e{i}") for i in range(3)]
    owners = [r.recv(e.send(e.pool().alloc(KB, payload=i))) for i, e in enumerate(es)]
    clients = list(r.importer.clients.values())
    assert len(clients) == 3
    for c in clients:
        c.sender._busy = True  # its thread is stuck in a send: the exporter stopped reading
    t0 = time.monotonic()
    r.ctx.at_exit()
    took = time.monotonic() - t0
    for c in clients:
        with c.sender._cv:
            c.sender._busy = False
    assert took < 2.0, f"exit took {took:.1f} s with exit_timeout=0.3"
    owners.clear()


def test_exit_of_an_exporter_with_many_stalled_receivers_is_bounded(world):
    e = world.proc("exporter", exit_timeout=0.3)
    b = e.pool().alloc(KB, payload=1)
    rs = [world.proc(f"r{i}") for i in range(20)]
    owners = [r.recv(e.send(b)) for r in rs]
    assert wait_for(lambda: e.exporter.unclaimed() == 0)
    peers = list(e.exporter.peers.values())
    for p in peers:
        p.sender._busy = True  # its thread is stuck in a send: the receiver stopped reading
    t0 = time.monotonic()
    e.exporter.at_exit(e.settings.exit_timeout)
    took = time.monotonic() - t0
    for p in peers:
        with p.sender._cv:
            p.sender._busy = False
    assert took < 1.0, f"exit took {took:.1f} s with exit_timeout=0.3"
    owners.clear()
    del b


def test_exit_waits_for_claim_and_mapping_outlives_the_exporter(world):
    e, r, core = _exporter_receiver(world)
    b = core.alloc(4 * KB, payload=7)
    msg = e.send(b)
    del b  # the producer returns: only the ticket holds the block now
    assert e.stats()["limbo_blocks"] == 1 and e.stats()["tickets_out"] == 1
    t0 = time.monotonic()
    ex = threading.Thread(target=e.exit)
    ex.start()
    time.sleep(0.2)
    assert ex.is_alive(), "at_exit returned with a message unclaimed"
    imp = r.recv(msg)  # claimed during the wait
    ex.join(5.0)
    assert not ex.is_alive() and time.monotonic() - t0 < 3.0  # well before exit_timeout
    assert r.read(imp) == (1, 7)
    # The exporter is gone (context and sockets): the mapping is still valid.
    client = imp.m.client
    assert wait_for(lambda: client.closed)
    assert r.read(imp) == (1, 7)
    assert world.gpu.violations == []
    del imp
    st = r.stats()
    assert (st["imported_blocks"], st["clients"], st["imported_pools"], st["opened_events"]) == (
        0,
        0,
        0,
        0,
    )


def test_exit_waits_until_a_granted_claim_is_mapped(world):
    """The exporter's exit must not end between granting a claim and the receiver's
    import: the allocation would go with the exporter's context, the message be lost."""
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=11)
    msg = e.send(b)
    del b
    claimed = threading.Event()
    go = threading.Event()

    def slow_import(*_a):  # the receiver is slow between its claim and its import
        claimed.set()
        go.wait(5.0)

    r.driver._hooks["import_pointer"] = slow_import
    got = []
    rt = threading.Thread(target=lambda: got.append(r.recv(msg)))
    rt.start()
    assert claimed.wait(5.0)
    ex = threading.Thread(target=e.exit)
    ex.start()
    time.sleep(0.2)
    exit_waited = ex.is_alive()
    go.set()
    rt.join(5.0)
    ex.join(5.0)
    assert exit_waited, "at_exit returned while a granted claim was not mapped yet"
    assert len(got) == 1 and r.read(got[0]) == (1, 11)
    got.clear()


# -- 2. tickets and registrations ------------------------------------------------------------------
def test_tickets_are_16_random_bytes_unique_across_processes(world):
    e1, e2 = world.proc("e1"), world.proc("e2")
    assert e1.exporter._tickets is os.urandom
    tickets = []
    for e in (e1, e2):
        b = e.pool().alloc(KB)
        for _ in range(300):
            tickets.append(pickle.loads(e.send(b)).ticket)
        e.exporter.expire(now=time.monotonic() + 1e6)
        del b
    assert all(len(t) == 16 for t in tickets)
    assert len(set(tickets)) == len(tickets)


def test_a_repeating_ticket_source_is_refused(world):
    e, r, core = _exporter_receiver(world)
    e.exporter._tickets = lambda n: b"\x01" * n
    b = core.alloc(KB, payload=3)
    msg = e.send(b)
    with pytest.raises(SharingError, match="duplicate sharing ticket"):
        e.send(b)
    assert e.stats()["tickets_out"] == 1
    imp = r.recv(msg)
    assert r.read(imp) == (1, 3)
    del imp, b


def test_duplicate_register_is_refused(world):
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=4)
    msg = e.send(b)
    imp = r.recv(msg)
    c = imp.m.client
    eid = imp.m.export_id
    fresh = os.urandom(16)

    def register(ticket, export_id=eid):
        reply, fd = c.request(lambda seq: _wire.Register(seq, export_id, ticket), 5.0)
        assert fd is None
        return reply.status

    assert register(fresh) == _wire.OK
    assert register(fresh) == _wire.NOT_HELD  # the same ticket twice
    assert register(pickle.loads(msg).ticket) == _wire.NOT_HELD  # a claimed one
    assert register(os.urandom(16), export_id=eid + 1000) == _wire.NOT_HELD  # unknown block
    assert e.stats()["tickets_out"] == 1  # only the first registration counts
    # A process that holds no lease on the block cannot register messages for it.
    other = world.proc("other")
    b2 = core.alloc(KB)
    other.recv(e.send(b2))  # connects `other`; its owner is dropped at once
    oc = other.importer.clients[e.exporter.address]
    reply, _ = oc.request(lambda seq: _wire.Register(seq, eid, os.urandom(16)), 5.0)
    assert reply.status == _wire.NOT_HELD
    del imp, b, b2


# -- 3. fan-out and volume ---------------------------------------------------------------------
def test_one_message_delivered_to_n_receivers_and_a_late_copy_is_stale(world):
    e = world.proc("exporter")
    core = e.pool()
    b = core.alloc(8 * KB, payload=21)
    ptr = b.ptr
    msg = e.send(b)
    rs = [world.proc(f"r{i}") for i in range(5)]
    owners = [r.recv(msg) for r in rs]
    assert [r.read(o) for r, o in zip(rs, owners)] == [(1, 21)] * 5
    assert e.stats()["leases"] == 5 and e.stats()["tickets_out"] == 0
    del b
    assert e.stats()["limbo_blocks"] == 1
    owners.clear()
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)
    assert len(_frees(world.gpu)) == 1
    # The address is reused for new data; a late copy must not map it.
    b2 = core.alloc(8 * KB, payload=22)
    assert b2.ptr == ptr
    late = world.proc("late")
    with pytest.raises(SharingError, match="stale"):
        late.recv(msg)
    assert _imports(world.gpu, "late") == []
    del b2


def test_one_array_put_n_times(world):
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=9)
    msgs = [e.send(b) for _ in range(50)]
    assert e.stats()["tickets_out"] == 50
    owners = [r.recv(m) for m in msgs]
    assert {r.read(o) for o in owners} == {(1, 9)}
    assert len(_imports(world.gpu, "receiver")) == 1  # one import per allocation per process
    assert wait_for(lambda: e.stats()["tickets_out"] == 0)
    assert e.stats()["leases"] == 1
    owners.clear()
    assert r.stats()["idle_mappings"] == 1  # received more than once: kept
    del b  # the exporter's free asks the receiver to give the idle mapping back
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)
    assert r.stats()["idle_mappings"] == 0 and len(_frees(world.gpu)) == 1


def test_claimed_tickets_are_bounded_and_an_older_copy_is_refused(world):
    e, r, core = _exporter_receiver(world)
    e.exporter.claimed_max = 8
    r2 = world.proc("second")
    b = core.alloc(KB, payload=3)
    first = e.send(b)
    owners = [r.recv(first)]
    for _ in range(20):
        owners.append(r.recv(e.send(b)))
    rec = b.share
    assert wait_for(lambda: e.stats()["tickets_out"] == 0)
    assert len(rec.claimed) == 8  # not 21: a block put a million times stays small
    # a copy of the first message, claimed 20 messages ago: refused, nothing mapped
    with pytest.raises(SharingError, match="stale"):
        r2.recv(first)
    assert _imports(world.gpu, "second") == []
    # a copy of a recent one still maps the block
    assert r2.read(
        r2.recv(pickle.dumps(pickle.loads(first)._replace(ticket=list(rec.claimed)[-1])))
    ) == (1, 3)
    owners.clear()
    del b
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)


def test_64_receivers_of_one_exporter(world):
    e = world.proc("exporter")
    core = e.pool()
    b = core.alloc(KB, payload=64)
    rs = [world.proc(f"r{i}") for i in range(64)]
    owners = [r.recv(e.send(b)) for r in rs]
    assert all(r.read(o) == (1, 64) for r, o in zip(rs, owners))
    st = e.stats()
    assert (st["peers"], st["leases"], st["tickets_out"]) == (64, 64, 0)
    del b
    owners.clear()
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)
    assert len(_frees(world.gpu)) == 1


def test_10000_messages_in_flight_then_all_received(world):
    e, r, core = _exporter_receiver(world)
    t0 = time.monotonic()
    blocks = [core.alloc(KB, payload=i) for i in range(100)]
    msgs = [e.send(blocks[i % 100]) for i in range(10_000)]
    assert e.stats()["tickets_out"] == 10_000
    owners = [r.recv(m) for m in msgs]
    assert all(r.read(o)[1] == i % 100 for i, o in enumerate(owners))
    assert wait_for(lambda: e.stats()["tickets_out"] == 0, 10.0)
    assert e.stats()["leases"] == 100
    owners.clear()
    blocks.clear()
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0, 10.0)
    assert len(_frees(world.gpu)) == 100
    assert time.monotonic() - t0 < 20.0


# -- 4. forwarding and round trips ---------------------------------------------------------------
def test_a_forwarder_exits_before_the_third_process_receives(world):
    e = world.proc("exporter")
    f = world.proc("forwarder")
    t = world.proc("third")
    b = e.pool().alloc(2 * KB, payload=33)
    imp = f.recv(e.send(b))
    assert f.read(imp) == (1, 33)
    fwd = f.send(imp)  # registered with the exporter before the message exists
    assert pickle.loads(fwd).address == e.exporter.address
    assert pickle.loads(fwd).event is None  # the forwarder waited for its own writes
    del imp
    f.exit()
    del b  # and the producer let go: the forwarded ticket holds the block
    assert wait_for(lambda: e.stats()["leases"] == 0)
    assert e.stats()["limbo_blocks"] == 1 and e.stats()["tickets_out"] == 1
    timp = t.recv(fwd)
    assert t.read(timp) == (1, 33)
    del timp
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)


def test_put_and_get_in_the_same_process(world):
    e = world.proc("exporter")
    core = e.pool()
    b = core.alloc(KB, payload=5)
    hold = e.recv(e.send(b))
    assert isinstance(hold, LocalHold) and e.read(hold) == (1, 5)
    assert _imports(world.gpu, "exporter") == []  # its own memory: nothing imported
    del b  # the round-tripped array keeps the block
    assert _frees(world.gpu) == []
    del hold
    assert len(_frees(world.gpu)) == 1 and e.stats()["exported_blocks"] == 0


def test_get_in_the_same_process_after_the_exporter_dropped_its_array(world):
    e = world.proc("exporter")
    r = world.proc("receiver")
    b = e.pool().alloc(KB, payload=6)
    msg = e.send(b)
    del b
    assert e.stats()["limbo_blocks"] == 1
    hold = e.recv(msg)
    assert hold.block is None and e.read(hold) == (1, 6)
    # ... and sent on again from there
    imp = r.recv(e.send(hold))
    del hold
    assert _frees(world.gpu) == [] and r.read(imp) == (1, 6)
    del imp
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)
    assert len(_frees(world.gpu)) == 1


# -- 5. dying receivers and short-lived exporters ------------------------------------------------
def test_killed_receiver_lease_returned_only_after_its_process_is_gone(world, monkeypatch):
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=8)
    imp = r.recv(e.send(b))
    del b
    assert e.stats()["limbo_blocks"] == 1
    with gated_wait_gone(monkeypatch) as gone:
        r.kill(context_gone=False)  # its sockets close; its kernel still reads
        assert gone.waiting.wait(5.0)
        time.sleep(0.2)
        st = e.stats()
        assert (st["leases"], st["limbo_blocks"]) == (1, 1) and _frees(world.gpu) == []
        world.gpu.context_gone("receiver")
        gone.set()
        assert wait_for(lambda: e.stats()["exported_blocks"] == 0)
    assert len(_frees(world.gpu)) == 1 and e.stats()["peers"] == 0
    del imp  # the dead process's objects: nothing of the protocol is left to do


def test_24_short_lived_exporters_leave_nothing_in_a_long_lived_receiver(world):
    r = world.proc("receiver")
    warm = world.proc("warm")  # one exporter first, so lazy imports are done
    wb = warm.pool().alloc(KB)
    del wb
    base_fds, base_threads = open_fds(), len(sharing_threads())
    for i in range(24):
        e = world.proc(f"e{i}")
        core = e.pool()
        b = core.alloc(KB, payload=i)
        m1, m2 = e.send(b), e.send(b)
        imp = r.recv(m1)
        imp2 = r.recv(m2)  # a Hit; kept idle afterwards
        assert r.read(imp) == (1, i)
        del b
        if i % 2:
            del imp, imp2  # let go before the exporter exits
            e.exit()
        else:
            e.exit()  # exits while the receiver still uses its block
            assert r.read(imp) == (1, i)
            del imp, imp2
        core.dispose()
        world.procs.remove(e)
    st = r.stats()
    assert wait_for(lambda: r.stats()["clients"] == 0), r.stats()
    st = r.stats()
    assert (st["imported_blocks"], st["idle_mappings"], st["imported_pools"]) == (0, 0, 0)
    assert st["opened_events"] == 0
    assert wait_for(lambda: open_fds() == base_fds), (open_fds(), base_fds)
    assert wait_for(lambda: len(sharing_threads()) <= base_threads)


def test_24_short_lived_receivers_leave_nothing_in_a_long_lived_exporter(world):
    e = world.proc("exporter")
    core = e.pool()
    b = core.alloc(KB, payload=1)
    e.recv(e.send(b))  # starts the listener
    base_fds, base_threads = open_fds(), len(sharing_threads())
    for i in range(24):
        r = world.proc(f"r{i}")
        imp = r.recv(e.send(b))
        assert r.read(imp) == (1, 1)
        del imp  # its unmap carries an event the exporter opens
        r.exit()
        world.procs.remove(r)
    assert wait_for(lambda: e.stats()["peers"] == 0)
    assert e.stats()["leases"] == 0
    assert _foreign_events_open(world.gpu, "exporter") == 0
    assert wait_for(lambda: open_fds() == base_fds), (open_fds(), base_fds)
    assert wait_for(lambda: len(sharing_threads()) <= base_threads), sharing_threads()
    del b


# -- 6. messages never read, or read from disk -----------------------------------------------------
def test_an_unread_message_expires_after_inflight_timeout(world):
    e = world.proc("exporter", inflight_timeout=0.2)
    r = world.proc("receiver")
    b = e.pool().alloc(KB, payload=2)
    msg = e.send(b)
    del b
    assert e.stats()["limbo_blocks"] == 1
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0, 5.0)
    assert e.stats()["tickets_out"] == 0 and len(_frees(world.gpu)) == 1
    with pytest.raises(SharingError, match="stale"):
        r.recv(msg)
    assert _imports(world.gpu, "receiver") == []


def test_a_finalizer_run_by_gc_inside_the_ticket_scan_does_not_break_it(world):
    e = world.proc("exporter")
    core = e.pool()
    b1 = core.alloc(KB, payload=1)
    e.send(b1)  # a ticket out
    b2 = core.alloc(KB, payload=2)
    hold = e.recv(e.send(b2))
    del hold  # b2 exported, nothing holds it: its record goes when b2 goes
    last_ref = [b2]
    del b2
    fired = []

    def collecting(phase, info):  # a collection starts inside expire()'s scan
        f = sys._getframe(1)
        if phase == "start" and not fired and f.f_back and f.f_back.f_code.co_name == "expire":
            fired.append(f.f_code.co_name)
            last_ref.clear()  # what the collection finds: the last reference to b2

    old = gc.get_threshold()
    gc.callbacks.append(collecting)
    gc.set_threshold(1)
    try:
        n = e.exporter.expire(now=time.monotonic() + 1e6)
    finally:
        gc.set_threshold(*old)
        gc.callbacks.remove(collecting)
    assert fired  # the finalizer did run mid-scan
    assert n == 1 and e.stats()["tickets_out"] == 0
    del b1
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)


def test_a_failing_free_does_not_stop_later_messages_from_expiring(world):
    e = world.proc("exporter", inflight_timeout=0.1)
    core = e.pool()
    calls = []

    def hook(ptr, size, stream):
        calls.append(ptr)
        if len(calls) == 1:
            raise CUDADriverError("cuMemFreeAsync", 700, "CUDA_ERROR_ILLEGAL_ADDRESS", "")
        return False

    core.release_hook = hook
    b1 = core.alloc(KB, payload=1)
    e.send(b1)
    del b1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert wait_for(lambda: calls, 5.0)  # the janitor's free of the first one failed
        b2 = core.alloc(KB, payload=2)
        e.send(b2)  # never read either
        del b2
        # the ticket janitor is still there to expire it
        assert wait_for(lambda: e.stats()["tickets_out"] == 0, 3.0), e.stats()
    assert len(calls) == 2 and e.stats()["exported_blocks"] == 0


def test_a_message_from_disk_after_its_block_was_freed_and_reused(world, tmp_path):
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=1)
    path = tmp_path / "msg.pkl"
    path.write_bytes(e.send(b))
    del b
    assert e.exporter.expire(now=time.monotonic() + 1e6) == 1
    assert e.stats()["exported_blocks"] == 0
    b2 = core.alloc(KB, payload=2)  # the same address, new data
    assert world.gpu.log[-1][2:] == (b2.ptr, 2)
    with pytest.raises(SharingError, match="stale"):
        r.recv(path.read_bytes())
    assert _imports(world.gpu, "receiver") == []
    # And while the receiver maps the new block at that address:
    imp = r.recv(e.send(b2))
    assert r.read(imp) == (2, 2)
    with pytest.raises(SharingError):
        r.recv(path.read_bytes())
    assert r.read(imp) == (2, 2) and len(_imports(world.gpu, "receiver")) == 1
    del imp, b2


# -- 7. re-imports, graph capture, closing a pool with blocks in limbo ---------------------------
def test_reimport_while_the_previous_unmap_is_queued(world, monkeypatch):
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=3)
    m1, m2 = e.send(b), e.send(b)
    r.driver._set_stream(FakeStream(0x77))
    imp = r.recv(m1)
    c = imp.m.client
    held = []
    real_post = c.sender.post
    monkeypatch.setattr(c.sender, "post", held.append)  # the unmap waits in the queue
    del imp
    assert [type(f).__name__ for f in held] == ["Unmap"]
    assert e.stats()["leases"] == 1
    r.driver._set_stream(FakeStream(0x88))  # re-imported on another stream
    imp = r.recv(m2)
    assert r.read(imp) == (1, 3)
    # the second import waited on the first one's unmap (the fake checks the order)
    syncs = [x for x in world.gpu.log if x[0] == "receiver" and x[1] == "sync_event"]
    assert syncs and syncs[-1][3] == "receiver"
    assert e.stats()["leases"] == 2
    monkeypatch.undo()
    for f in held:
        real_post(f)
    assert wait_for(lambda: e.stats()["leases"] == 1)
    del imp, b
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)


def test_an_array_dropped_during_stream_capture_is_unmapped_after_capture(world):
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=4)
    r.driver._set_stream(FakeStream(0x99))
    imp = r.recv(e.send(b))
    r.driver._capturing.add(0x99)
    del imp
    time.sleep(0.15)
    unmaps = lambda: [x for x in world.gpu.log if x[0] == "receiver" and x[1] == "unmap"]  # noqa: E731
    assert unmaps() == [] and e.stats()["leases"] == 1
    r.driver._capturing.discard(0x99)
    assert wait_for(lambda: unmaps() and e.stats()["leases"] == 0, 5.0)
    assert unmaps()[0][4] == 0x99  # freed on its own stream, once the capture ended
    del b


def test_close_of_a_pool_with_blocks_in_limbo(world):
    e, r, core = _exporter_receiver(world)
    b1 = core.alloc(KB, payload=1)
    b2 = core.alloc(KB, payload=2)
    imp = r.recv(e.send(b1))
    del b1  # in limbo: the receiver maps it
    core.close()
    assert core.released == 0
    del b2  # the last live block: the limbo one still counts
    assert core.released == 0 and core._held_for_sharing == KB
    assert r.read(imp) == (1, 1)
    del imp
    assert wait_for(lambda: core.released == 1)
    assert core._held_for_sharing == 0 and len(_frees(world.gpu)) == 2


# -- 8. eviction ---------------------------------------------------------------------------------
def test_a_block_received_twice_is_kept_idle_and_evicted_when_the_exporter_frees(world):
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=1)
    m1, m2 = e.send(b), e.send(b)
    imp = r.recv(m1)
    del imp  # received once: unmapped at once
    assert r.stats()["idle_mappings"] == 0
    assert wait_for(lambda: e.stats()["leases"] == 0)
    imp = r.recv(m2)
    del imp  # received again: kept
    assert r.stats()["idle_mappings"] == 1 and e.stats()["leases"] == 1
    del b
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)
    assert r.stats()["idle_mappings"] == 0


def test_a_keeper_claiming_the_last_ticket_of_a_limbo_block_is_asked_to_evict(world):
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=1)
    m1, m2 = e.send(b), e.send(b)
    first = r.recv(m1)
    del first  # received once: unmapped at once (remembered as seen)
    assert wait_for(lambda: e.stats()["leases"] == 0)
    del b  # in limbo, held by m2's ticket only
    imp = r.recv(m2)  # a Claim (not a Hit) that may keep the mapping: the last ticket
    m = imp.m
    assert m.keep
    assert wait_for(lambda: m.evict, 2.0)  # nothing else will ever ask for it back
    del imp
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)
    assert r.stats()["idle_mappings"] == 0 and len(_frees(world.gpu)) == 1


def test_a_hit_with_an_expired_ticket_still_makes_its_receiver_a_keeper(world):
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=1)
    a1 = r.recv(e.send(b))
    late = e.send(b)
    assert e.exporter.expire(now=time.monotonic() + 1e6) == 1  # read after inflight_timeout
    a2 = r.recv(late)  # a Hit: r maps the block under its lease, and may keep it
    assert r.read(a2) == (1, 1)
    del a1, a2
    assert r.stats()["idle_mappings"] == 1
    del b  # the exporter must ask for the idle mapping back
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0, 2.0), e.stats()
    assert r.stats()["idle_mappings"] == 0


def test_an_evicted_mapping_in_use_goes_when_its_last_user_goes(world):
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=1)
    m1, m2 = e.send(b), e.send(b)
    a1, a2 = r.recv(m1), r.recv(m2)  # the second is a Hit: r may keep it
    del b
    m = a1.m
    assert wait_for(lambda: m.evict)  # the Evict arrived; both arrays use the mapping
    assert e.stats()["limbo_blocks"] == 1
    del a1
    assert e.stats()["limbo_blocks"] == 1
    assert r.read(a2) == (1, 1)
    del a2
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)
    assert r.stats()["idle_mappings"] == 0


def test_keep_mappings_zero_unmaps_at_once(world):
    e, r, core = _exporter_receiver(world, keep_mappings=0)
    b = core.alloc(KB)
    for _ in range(3):
        imp = r.recv(e.send(b))
        del imp
        assert r.stats()["idle_mappings"] == 0
    assert wait_for(lambda: e.stats()["leases"] == 0)
    assert len(_imports(world.gpu, "receiver")) == 3
    del b


def test_keep_mappings_is_an_lru_cap(world):
    e, r, core = _exporter_receiver(world, keep_mappings=2)
    r.settings._on_keep_change = r.ctx.trim
    blocks = [core.alloc(KB, payload=i) for i in range(4)]
    for blk in blocks:  # each received twice: a candidate to keep
        for _ in range(2):
            imp = r.recv(e.send(blk))
            del imp
    del blk
    assert r.stats()["idle_mappings"] == 2
    kept = {m.export_id for m in r.importer.idle.values()}
    ids = [blk.share.export_id for blk in blocks]
    assert kept == set(ids[2:])  # the least recently used went first
    imp = r.recv(e.send(blocks[2]))  # a re-use refreshes it
    del imp
    imp = r.recv(e.send(blocks[1]))
    del imp
    assert {m.export_id for m in r.importer.idle.values()} == {ids[2], ids[1]}
    r.settings.keep_mappings = 1
    assert {m.export_id for m in r.importer.idle.values()} == {ids[1]}
    assert wait_for(lambda: e.stats()["leases"] == 1)
    blocks.clear()
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)


# -- 9. security ---------------------------------------------------------------------------------
def test_a_silent_client_does_not_block_the_listener(world, monkeypatch):
    real = _exporter.Listener
    monkeypatch.setattr(_exporter, "Listener", lambda key, on: real(key, on, handshake_timeout=0.3))
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=1)
    msg = e.send(b)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        silent.connect(e.exporter.address)
        t0 = time.monotonic()
        imp = r.recv(msg)  # served while the silent one holds its handshake
        assert time.monotonic() - t0 < 0.3 and r.read(imp) == (1, 1)
        assert wait_for(lambda: e.exporter._listener.refused == 1, 3.0)
        silent.settimeout(2.0)
        while silent.recv(4096):  # the challenge, then EOF: dropped
            pass
    finally:
        silent.close()
    assert e.stats()["peers"] == 1
    del imp, b


def test_a_client_with_the_wrong_authkey_is_refused(world):
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB)
    msg = e.send(b)
    r.importer.authkey = b"not the family's key"
    with pytest.raises(SharingError):
        r.recv(msg)
    assert wait_for(lambda: e.exporter._listener.refused == 1)
    st = e.stats()
    assert (st["peers"], st["leases"], st["tickets_out"]) == (0, 0, 1)
    del b


def test_malformed_frames_are_ignored_and_return_no_lease(world):
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=1)
    msg = e.send(b)
    imp = r.recv(msg)
    del b
    conn = imp.m.client.conn
    eid = imp.m.export_id
    unmap = _wire.encode(_wire.Unmap(eid, None))
    bad = [
        b"",
        b"\xff",
        unmap[:-1],  # truncated
        unmap + b"\0",  # too long
        bytes([32]) + b"\x05\x00" + unmap,  # a batch whose length lies
        bytes([32, 9]),  # a batch cut in its length
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for data in bad:
            conn.send(data)
        conn.send(_wire.encode(_wire.Evict(eid)))  # frames of the other direction
        conn.send(_wire.encode(_wire.Reply(1, _wire.OK, False)))
        # a frame that is well-formed but names no lease of this peer
        intruder = world.proc("intruder")
        b2 = core.alloc(KB)
        intruder.recv(e.send(b2))
        ic = intruder.importer.clients[e.exporter.address]
        ic.conn.send(_wire.encode(_wire.Unmap(eid, None)))
        ic.conn.send(_wire.encode(_wire.Drop(eid, pickle.loads(msg).ticket)))
        # the connection still works: a round trip after the garbage
        reply, _ = imp.m.client.request(lambda seq: _wire.Register(seq, eid, os.urandom(16)), 5.0)
        assert reply.status == _wire.OK
    said = [str(w.message) for w in caught]
    assert sum("malformed" in m for m in said) == len(bad) + 2, said
    assert not [m for m in said if "AttributeError" in m], said
    assert wait_for(lambda: e.stats()["leases"] == 1)  # the intruder's own lease went back
    st = e.stats()
    assert (st["leases"], st["limbo_blocks"]) == (1, 1) and _frees(world.gpu) == []
    assert r.read(imp) == (1, 1)
    e.exporter.expire(now=time.monotonic() + 1e6)
    del imp, b2
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)


def test_a_claim_with_an_unknown_or_stale_ticket_is_refused_and_gets_no_fd(world):
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB)
    d = pickle.loads(e.send(b))
    c = r.importer.client(d.address)
    assert wait_for(lambda: e.stats()["peers"] == 1)  # the exporter's handshake is over
    fds = open_fds()
    for eid, ticket in [
        (d.export_id, os.urandom(16)),  # guessed ticket
        (d.export_id + 7, d.ticket),  # another block
        (0, b"\0" * 16),
    ]:

        def claim(seq, eid=eid, ticket=ticket):
            return _wire.Claim(
                seq,
                eid,
                ticket,
                True,
                False,
                False,
                d.life,
                d.size,
                d.size,
                _wire.block_id(d.pool_uuid, d.pool_kind, d.export_data),
            )

        reply, fd = c.request(claim, 5.0)
        assert (reply.status, reply.has_fd, fd) == (_wire.REFUSED, False, None)
    assert open_fds() == fds
    st = e.stats()
    assert (st["leases"], st["tickets_out"]) == (0, 1)
    # the real ticket is granted, with the pool's descriptor
    reply, fd = c.request(
        lambda seq: _wire.Claim(
            seq,
            d.export_id,
            d.ticket,
            True,
            False,
            False,
            d.life,
            d.size,
            d.size,
            _wire.block_id(d.pool_uuid, d.pool_kind, d.export_data),
        ),
        5.0,
    )
    assert reply.status == _wire.OK and fd is not None
    os.close(fd)
    c.send_now(_wire.Unmap(d.export_id, None))
    assert wait_for(lambda: e.stats()["leases"] == 0)
    del b


def test_the_socket_is_a_filesystem_path_in_a_0700_directory(world):
    e = world.proc("exporter")
    b = e.pool().alloc(KB)
    e.send(b)
    addr = e.exporter.address
    assert os.path.isabs(addr) and not addr.startswith("\0")
    assert stat.S_ISSOCK(os.stat(addr).st_mode)
    assert stat.S_IMODE(os.stat(os.path.dirname(addr)).st_mode) == 0o700
    e.exporter.expire(now=time.monotonic() + 1e6)
    del b
    e.exporter.close()
    assert not os.path.exists(os.path.dirname(addr))


# -- 10. scale ------------------------------------------------------------------------------------
def test_a_stalled_peer_does_not_stall_others(world, monkeypatch):
    monkeypatch.setattr(_records, "Sender", lambda conn, name: _transport.Sender(conn, name, 16))
    e = world.proc("exporter")
    stalled, ok = world.proc("stalled"), world.proc("ok")
    core = e.pool()
    blocks = [core.alloc(KB, payload=i) for i in range(200)]
    held = []
    for blk in blocks:  # received twice: the stalled one may keep them (it gets Evicts)
        held.append(stalled.recv(e.send(blk)))
        held.append(stalled.recv(e.send(blk)))
    # It stops reading its socket; the exporter's socket to it is small.
    gate = threading.Event()
    monkeypatch.setattr(stalled.importer, "evict", lambda c, eid: gate.wait(10.0))
    for p in e.exporter.peers.values():
        s = socket.socket(fileno=os.dup(p.conn._c.fileno()))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        s.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        blocks.clear()  # 200 Evicts for the stalled peer
        assert wait_for(lambda: e.stats()["dropped_frames"] > 0, 5.0)
        # Meanwhile the other peer's claims, hits and evicts go through.
        b = core.alloc(KB, payload=99)
        t0 = time.monotonic()
        o1 = ok.recv(e.send(b))
        o2 = ok.recv(e.send(b))
        assert ok.read(o1) == (1, 99)
        del o1, o2, b
        assert wait_for(lambda: ok.stats()["idle_mappings"] == 0 and e.stats()["leases"] == 200)
        assert time.monotonic() - t0 < 2.0
    gate.set()
    held.clear()


def test_the_per_peer_sender_queue_is_bounded(world):
    class StuckConn:
        def __init__(self):
            self.release = threading.Event()
            self.entered = threading.Event()
            self.sent = []

        def send(self, data, fd=None):
            self.entered.set()
            self.release.wait(5.0)
            self.sent.append(data)

    conn = StuckConn()
    s = _transport.Sender(conn, "cupy_poolmem-test", limit=4)
    s.post(_wire.Evict(1))
    assert conn.entered.wait(5.0)  # the thread took it and is stuck sending
    with pytest.warns(ResourceWarning, match="not reading"):
        for i in range(10):
            s.post(_wire.Evict(i + 2))
    assert s.dropped == 6
    conn.release.set()
    assert s.flush(5.0)
    frames = [f for data in conn.sent for f in _wire.decode(data)]
    assert [f.export_id for f in frames] == [1, 2, 3, 4, 5]
    s.close()
    assert wait_for(lambda: not [t for t in sharing_threads() if t.name == "cupy_poolmem-test"])


# -- 11. descriptors from elsewhere ------------------------------------------------------------------
def _descriptor(**change):
    d = _wire.Descriptor(
        _wire.VERSION,
        "cupy",
        "/tmp/x/s",
        "pool",
        "GPU-x",
        _wire.POOL_DEVICE,
        1,
        b"\0" * 64,
        1024,
        b"\1" * 16,
        None,
        0,
        (256,),
        (4,),
        "<f4",
        1,
    )
    return d._replace(**change)


def test_an_old_format_message_raises_a_clear_protocol_error():
    with pytest.raises(_wire.ProtocolError, match="format 1 from a different cupy_poolmem"):
        rebuild(1, "cupy", "/tmp/x", 5, 1024)
    with pytest.raises(_wire.ProtocolError, match="format 2"):
        rebuild(_descriptor(version=2))
    with pytest.raises(_wire.ProtocolError, match="cannot read"):
        rebuild(tuple(_descriptor()))


@pytest.mark.parametrize(
    "change",
    [
        {"kind": "torch"},
        {"address": None},
        {"pool_kind": 7},
        {"export_id": 0},
        {"export_data": b"\0" * 63},
        {"size": 0},
        {"ticket": b"\1" * 15},
        {"event": b"\0" * 8},
        {"offset": 2048},
        {"offset": -1},
        {"life": -1},
        {"life": True},
        {"life": 2**64},
    ],
)
def test_a_descriptor_with_bad_fields_raises_a_protocol_error(change):
    d = _descriptor(**change)
    with pytest.raises(_wire.ProtocolError, match="malformed") as ei:
        _wire.check_descriptor(d)
    assert f"({next(iter(change))}=" in str(ei.value)  # names the field
    assert isinstance(_wire.ProtocolError("x"), SharingError)


@pytest.mark.parametrize(
    "change",
    [
        {"shape": (-1,)},
        {"shape": [256]},
        {"strides": (4, 4)},
        {"dtype": "not a dtype"},
        {"dtype": 5},
        {"dtype": "O"},  # object pointers read from shared memory
        {"shape": (512,)},  # 2 KiB of float32 in a 1 KiB block
        {"offset": 8, "shape": (256,)},  # past the end by 8 bytes
        {"strides": (-4,)},  # starts before the block
    ],
)
def test_a_descriptor_whose_array_does_not_fit_its_block_raises_a_protocol_error(change):
    """Checked before anything is mapped: an array past its block would read other
    memory, and an object dtype would turn shared bytes into pointers."""
    with pytest.raises(_wire.ProtocolError, match="malformed") as ei:
        _wire.check_descriptor(_descriptor(**change))
    key = next(iter(change))
    assert f"({key}=" in str(ei.value) or "does not fit its 1024-byte block" in str(ei.value)


def test_well_formed_descriptors_pass_the_check():
    _wire.check_descriptor(_descriptor())
    _wire.check_descriptor(_descriptor(offset=1020, shape=(1,), strides=(4,)))
    _wire.check_descriptor(_descriptor(offset=1020, shape=(256,), strides=(-4,)))
    _wire.check_descriptor(_descriptor(shape=(0,), offset=1024))
    _wire.check_descriptor(_descriptor(shape=(16, 16), strides=(64, 4)))
    _wire.check_descriptor(_descriptor(shape=(4,), strides=(0,)))  # broadcast


def test_the_fast_descriptor_check_and_the_field_by_field_list_agree():
    """check_descriptor accepts in one expression; _problem names the failing field.
    Random descriptors (mostly broken) must get the same verdict from both."""
    import random

    rng = random.Random(7)
    choices = {
        "version": [_wire.VERSION, _wire.VERSION + 1],
        "kind": ["cupy", "numpy", "torch", 1],
        "address": ["/tmp/x/s", b"/tmp", None],
        "pool_uuid": ["pool", 3],
        "device_uuid": ["GPU-x", "", None],
        "pool_kind": [0, 1, 2, 3, True],
        "export_id": [1, 0, 2**64, 2**64 - 1, 1.0, True],
        "export_data": [b"\0" * 64, b"\0" * 63, "x" * 64],
        "size": [1024, 0, -5, 8, 1024.0],
        "ticket": [b"\1" * 16, b"\1" * 17, None],
        "event": [None, b"\2" * 64, b"\2" * 8, "e"],
        "offset": [0, 4, 1020, 1024, 1025, -1, False],
        "shape": [(256,), (0,), (1,), (-1,), [256], (16, 16), (2, True), (300,)],
        "strides": [(4,), (-4,), (0,), (64, 4), (4, 4), [4], (4.0,)],
        "dtype": ["<f4", "<f8", "|u1", "O", "nope", 5, "<c16"],
        "life": [1, 0, 2**64 - 1, -1, 2**64, True, 1.0],
    }
    verdicts = set()
    for _ in range(4000):
        change = {k: rng.choice(v) for k, v in choices.items() if rng.random() < 0.3}
        d = _descriptor(**change)
        problem = _wire._problem(d)
        try:
            _wire.check_descriptor(d)
            ok = True
        except _wire.ProtocolError as exc:
            ok = False
            assert problem is not None and str(exc) == problem, (change, problem, exc)
        assert ok == (problem is None), (change, problem)
        verdicts.add(ok)
    assert verdicts == {True, False}
    assert _wire._problem(tuple(_descriptor())) is not None


# -- 12. races found while writing these tests ---------------------------------------------------
def test_a_dead_receivers_events_stay_open_while_a_free_waits_on_them(world):
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=1)
    imp = r.recv(e.send(b))
    del imp  # its unmap carries an event the exporter's free will wait on
    assert wait_for(lambda: e.stats()["leases"] == 0)
    gate, paused = threading.Event(), threading.Event()

    def slow_wait(stream, ev):
        if ev.event.owner.name == "receiver":
            paused.set()
            gate.wait(3.0)

    e.driver._hooks["wait_event"] = slow_wait
    holder = [b]
    del b
    t = threading.Thread(target=holder.clear)  # the exporter frees its block
    t.start()
    try:
        assert paused.wait(5.0)
        r.kill()  # the receiver dies while the free waits on its event
        closed = lambda: [x for x in world.gpu.log if x[:2] == ("exporter", "close_event")]  # noqa: E731
        wait_for(closed, 0.5)
    finally:
        gate.set()
        t.join(5.0)
    assert wait_for(closed)  # closed once the free no longer needs it
    assert world.gpu.violations == []
    assert len(_frees(world.gpu)) == 1


def test_a_claim_answered_after_claim_timeout_gives_its_lease_back(world, monkeypatch):
    e, r, core = _exporter_receiver(world, claim_timeout=0.2)
    b = core.alloc(KB, payload=1)
    msg = e.send(b)

    def slow_claim(cid):
        time.sleep(0.5)  # the exporter is busy: the receiver gives up first

    monkeypatch.setattr(e.exporter, "claim_hook", slow_claim)
    r.importer.client(e.exporter.address)
    assert wait_for(lambda: e.stats()["peers"] == 1)
    fds = open_fds()
    with pytest.raises(SharingError, match="did not answer"):
        r.recv(msg)
    # The late grant is given back (and its pool descriptor closed), not held forever.
    assert wait_for(lambda: e.stats()["tickets_out"] == 0 and e.stats()["leases"] == 0, 3.0)
    assert wait_for(lambda: open_fds() == fds)
    monkeypatch.undo()
    imp = r.recv(msg)  # another copy of the message still maps the block
    assert r.read(imp) == (1, 1)
    del imp, b
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)


def test_request_sequence_numbers_wrap_at_32_bits(world):
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=1)
    imp = r.recv(e.send(b))
    c = imp.m.client
    eid = imp.m.export_id
    c._seq = 2**32 - 2
    for _ in range(3):  # a long-lived receiver passes 2**32 requests
        reply, _ = c.request(lambda seq: _wire.Register(seq, eid, os.urandom(16)), 5.0)
        assert reply.status == _wire.OK
    e.exporter.expire(now=time.monotonic() + 1e6)
    del imp, b


def test_connecting_to_an_unresponsive_exporter_does_not_block_other_unmaps(world, tmp_path):
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=1)
    imp = r.recv(e.send(b))
    # A process that accepts connections but never answers the handshake.
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mute.bind(str(tmp_path / "mute"))
    mute.listen(4)
    stuck = pickle.dumps(pickle.loads(e.send(b))._replace(address=str(tmp_path / "mute")))
    errors = []

    def receive_stuck():
        try:
            r.recv(stuck)
        except SharingError as exc:
            errors.append(exc)

    t = threading.Thread(target=receive_stuck)
    t.start()
    try:
        time.sleep(0.1)  # it is waiting for the mute peer's challenge
        holder = [imp]
        del imp
        d = threading.Thread(target=holder.clear)  # drops the other exporter's array
        d.start()
        d.join(1.0)
        assert not d.is_alive(), "an unmap waited for another exporter's handshake"
        assert wait_for(lambda: e.stats()["leases"] == 0)
    finally:
        mute.close()  # the handshake fails now
        t.join(15.0)
    assert not t.is_alive() and len(errors) == 1
    e.exporter.expire(now=time.monotonic() + 1e6)
    del b


def test_threads_receiving_from_one_exporter_share_one_connection(world):
    e, r, core = _exporter_receiver(world)
    blocks = [core.alloc(KB, payload=i) for i in range(8)]
    msgs = [e.send(blk) for blk in blocks]
    start = threading.Barrier(8, timeout=5.0)
    got = {}

    def take(i):
        start.wait()
        got[i] = r.recv(msgs[i])

    ts = [threading.Thread(target=take, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(5.0)
    assert sorted(got) == list(range(8))
    assert all(r.read(got[i]) == (1, i) for i in range(8))
    assert r.stats()["clients"] == 1 and e.stats()["peers"] == 1
    got.clear()
    blocks.clear()
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)


def test_a_receive_never_waits_on_the_socket_and_its_hit_arrives_later(world, monkeypatch):
    """A Hit is posted lazily: the receive returns while the exporter's socket is full,
    the importer's lock stays free meanwhile, and the exporter still gets the Hit (its
    ticket claimed) once the socket drains."""
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=1)
    m1, m2 = e.send(b), e.send(b)
    imp = r.recv(m1)
    c = imp.m.client
    assert wait_for(lambda: e.stats()["tickets_out"] == 1)
    gate, sending = threading.Event(), threading.Event()
    real = c.conn.send

    def full_socket(data, fd=None):  # the exporter's socket buffer is full for a while
        sending.set()
        gate.wait(5.0)
        return real(data, fd)

    monkeypatch.setattr(c.conn, "send", full_socket)
    got = []
    t = threading.Thread(target=lambda: got.append(r.recv(m2)))  # a Hit
    t.start()
    try:
        t.join(2.0)
        assert not t.is_alive() and len(got) == 1, "a receive waited on the socket"
        assert sending.wait(5.0)  # the sender thread took the Hit and is stuck sending it
        free = r.importer.lock.acquire(timeout=1.0)
        if free:
            r.importer.lock.release()
        assert free, "the importer's lock was held across a blocking send"
        assert e.stats()["tickets_out"] == 1  # not there yet: the ticket pins the block
    finally:
        gate.set()
        t.join(5.0)
    assert wait_for(lambda: e.stats()["tickets_out"] == 0)
    assert r.read(got[0]) == (1, 1)
    got.clear()
    del imp, b


def test_lazy_frames_keep_their_order_behind_and_before_urgent_ones():
    """Sender: lazy frames wait at most ``delay`` unless an urgent frame or a flush
    comes; the socket sees every frame once, in the order posted."""
    from cupy_poolmem._sharing._transport import Sender

    sent = []

    class Conn:
        def send(self, data, fd=None):
            sent.append(_wire.decode(data))

    s = Sender(Conn(), "test", delay=60.0)  # lazy frames alone would wait a minute
    s.post(_wire.Hit(1, b"a" * 16, 0), lazy=True)
    s.post(_wire.Hit(2, b"b" * 16, 0), lazy=True)
    time.sleep(0.05)
    assert sent == []  # still gathering
    s.post(_wire.Unmap(1, None))  # urgent: goes now, behind the two Hits
    assert wait_for(lambda: sum(len(f) for f in sent) == 3)
    s.post(_wire.Hit(3, b"c" * 16, 0), lazy=True)
    assert not s.idle()
    assert s.flush(5.0)
    frames = [f for batch in sent for f in batch]
    assert [type(f).__name__ for f in frames] == ["Hit", "Hit", "Unmap", "Hit"]
    assert [f.export_id for f in frames] == [1, 2, 1, 3]
    s.close()
    fast = Sender(Conn(), "test", delay=0.001)
    sent.clear()
    for i in range(1, 1001):
        fast.post(_wire.Hit(i, bytes(16), 0), lazy=True)
    assert wait_for(lambda: sum(len(f) for f in sent) == 1000)  # no flush needed
    assert [f.export_id for batch in sent for f in batch] == list(range(1, 1001))
    assert len(sent) < 1000  # gathered into batches
    fast.close()


def test_an_exporter_leaving_mid_receive_does_not_close_the_event_being_waited_on(world):
    e = world.proc("exporter", exit_timeout=0.2)
    r = world.proc("receiver")
    b = e.pool().alloc(KB, payload=1)
    m1, m2 = e.send(b), e.send(b)
    imp = r.recv(m1)
    client = imp.m.client
    del imp  # connected, the exporter's event open; nothing mapped any more
    gate, paused = threading.Event(), threading.Event()

    def slow_sync(ev):  # the receiver waits on the sender's event...
        paused.set()
        gate.wait(5.0)

    r.driver._hooks["sync_event"] = slow_sync
    got = []

    def take():
        try:
            got.append(r.recv(m2))
        except SharingError as exc:
            got.append(exc)

    t = threading.Thread(target=take)
    t.start()
    try:
        assert paused.wait(5.0)
        del b
        e.exit()  # ... while the exporter goes away
        assert wait_for(lambda: client.closed)
        time.sleep(0.05)
    finally:
        gate.set()
        t.join(5.0)
    assert len(got) == 1 and isinstance(got[0], SharingError) and "exited" in str(got[0])
    assert world.gpu.violations == []  # the event was not closed under the wait
    st = r.stats()
    assert (st["clients"], st["opened_events"]) == (0, 0)  # and released after it
    assert _foreign_events_open(world.gpu, "receiver") == 0


def test_concurrent_first_receives_import_the_pool_once(world):
    e, r, core = _exporter_receiver(world)
    b1, b2 = core.alloc(KB, payload=1), core.alloc(KB, payload=2)
    m1, m2 = e.send(b1), e.send(b2)
    calls, gate = [], threading.Event()

    def slow_import(fd, kind, dev):  # the first import takes a while
        calls.append(fd)
        if len(calls) == 1:
            gate.wait(0.3)

    r.driver._hooks["import_pool"] = slow_import
    got = []
    ts = [threading.Thread(target=lambda m=m: got.append(r.recv(m))) for m in (m1, m2)]
    ts[0].start()
    assert wait_for(lambda: calls)
    ts[1].start()  # claims with the pool's descriptor too, while the first imports
    for t in ts:
        t.join(5.0)
    gate.set()
    assert len(calls) == 1  # one import; no second copy imported, then closed
    assert sorted(r.read(o) for o in got) == [(1, 1), (1, 2)]
    assert r.stats()["imported_pools"] == 1
    got.clear()
    del b1, b2
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)


def test_an_unmap_whose_event_cannot_be_opened_keeps_its_lease(world):
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=1)
    imp = r.recv(e.send(b))
    del b  # in limbo: the receiver's lease holds it

    def cannot_open(handle):
        raise CUDADriverError("cuIpcOpenEventHandle", 1, "CUDA_ERROR_INVALID_VALUE")

    e.driver._hooks["open_event"] = cannot_open
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del imp  # its Unmap names an event the exporter cannot open
        assert wait_for(lambda: caught)
    assert "Unmap failed" in str(caught[0].message)
    e.ctx.collect()
    st = e.stats()
    # Freeing now would not wait for the receiver's free: leaking is the safe side.
    assert (st["leases"], st["limbo_blocks"]) == (1, 1) and _frees(world.gpu) == []
    r.exit()  # once the receiver is gone, its lease is
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)


def test_a_failed_eviction_keeps_the_connection(world):
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=1)
    imp = r.recv(e.send(b))
    imp2 = r.recv(e.send(b))  # a Hit: r keeps the mapping idle once it is let go
    client = imp.m.client
    del imp, imp2
    assert r.stats()["idle_mappings"] == 1

    def broken(stream, ev):
        raise CUDADriverError("cuStreamWaitEvent", 1, "CUDA_ERROR_INVALID_VALUE")

    r.driver._hooks["wait_event"] = broken
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del b  # the exporter asks for the idle mapping back; unmapping it fails
        assert wait_for(lambda: caught)
    assert "evicting" in str(caught[0].message)
    r.driver._hooks.clear()
    assert not client.closed  # the connection (and every other block on it) lives on
    b2 = core.alloc(KB, payload=2)
    imp = r.recv(e.send(b2))
    assert r.read(imp) == (1, 2) and imp.m.client is client
    assert e.stats()["limbo_blocks"] == 1  # the failed one stays held: the safe side
    del imp, b2


def test_a_reimport_waits_for_its_old_free_past_the_closing_cap(world):
    e, r, core = _exporter_receiver(world)
    r.importer.closing_max = 2
    blocks = [core.alloc(KB, payload=i) for i in range(4)]
    r.driver._set_stream(FakeStream(0x77))
    for blk in blocks:  # four unmaps queued on 0x77; the first falls out of the table
        imp = r.recv(e.send(blk))
        del imp
    del blk
    imp = r.recv(e.send(blocks[0]))  # re-imported: its old free must have run
    assert r.read(imp) == (1, 0)
    assert world.gpu.violations == []
    del imp
    blocks.clear()
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)


# -- 13. more lifecycles: devices, host pools, failures, everything at once ----------------------
def test_devices_are_matched_by_uuid_whatever_the_visible_order(world):
    e = world.proc("exporter")  # sees GPUs 0, 1
    r = world.proc("receiver", visible=[1, 0])  # CUDA_VISIBLE_DEVICES=1,0
    b = e.pool(device=1).alloc(KB, payload=5)
    d = pickle.loads(e.send(b))
    assert d.device_uuid == world.gpu.uuids[1]
    owner, dev = receive(r.ctx, d)
    assert dev == 0 and owner.m.dev == 0  # the receiver's ordinal of that GPU
    assert r.read(owner) == (1, 5)
    del owner, b
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)


def test_a_receiver_that_cannot_see_the_gpu_returns_the_ticket(world):
    e = world.proc("exporter")
    r = world.proc("receiver", visible=[0])  # only GPU 0
    b = e.pool(device=1).alloc(KB, payload=5)
    msg = e.send(b)
    with pytest.raises(SharingError, match="cannot see"):
        r.recv(msg)
    assert wait_for(lambda: e.stats()["tickets_out"] == 0)  # not pinned until it expires
    assert _imports(world.gpu, "receiver") == []
    del b
    assert e.stats()["exported_blocks"] == 0


def test_a_pinned_pool_block_is_shared_and_read_after_a_host_wait(world):
    e, r = world.proc("exporter"), world.proc("receiver", receive_order="stream")
    core = e.pool(kind=_wire.POOL_PINNED)
    b = core.alloc(KB, payload=12)
    d = describe(e.ctx, b, "numpy", 0, (KB,), (1,), "|u1")
    assert d.device_uuid == "" and d.pool_kind == _wire.POOL_PINNED
    owner, _ = receive(r.ctx, _wire.check_descriptor(pickle.loads(pickle.dumps(d))))
    assert r.read(owner) == (1, 12)  # numpy reads on the host: waited there
    del owner, b
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)


def test_receive_order_stream_orders_only_the_receiving_stream(world):
    e, r, core = _exporter_receiver(world, receive_order="stream")
    b = core.alloc(KB, payload=3)
    r.driver._set_stream(FakeStream(0x42))
    imp = r.recv(e.send(b))
    assert r.read(imp, stream=0x42) == (1, 3)  # the receiving stream waited, on the device
    waits = [x for x in world.gpu.log if x[:2] == ("receiver", "wait_event")]
    assert waits and waits[-1][2] == 0x42
    assert not [x for x in world.gpu.log if x[:2] == ("receiver", "sync_event")]
    del imp, b


def test_a_message_that_fails_to_pickle_halfway_does_not_pin_memory(world):
    e = world.proc("exporter", inflight_timeout=0.2)
    b = e.pool().alloc(KB, payload=1)
    with pytest.raises(TypeError, match="pickle"):  # the ticket was registered first
        pickle.dumps([pickle.loads(e.send(b)), threading.Lock()])
    del b
    assert e.stats()["limbo_blocks"] == 1
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0, 5.0)  # expired, freed
    assert len(_frees(world.gpu)) == 1


def test_a_killed_exporters_mappings_stay_valid_and_its_messages_fail(world):
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=4)
    imp = r.recv(e.send(b))
    late = e.send(b)
    e.kill()  # no exit wait: its unclaimed message dies with it
    client = imp.m.client
    assert wait_for(lambda: client.closed)
    assert r.read(imp) == (1, 4)  # the receiver's import keeps the memory
    with pytest.raises(SharingError, match="exited"):
        r.recv(late)
    del imp
    st = r.stats()
    assert (st["clients"], st["imported_pools"], st["opened_events"]) == (0, 0, 0)
    assert world.gpu.live_imports("receiver") == []


def test_producers_consumers_forwarders_and_round_trips_at_once(world):
    """Two exporters allocate, send and drop; four receiving threads in two processes
    take random messages (some stale by then), forward some and drop them; each
    exporter takes some of its own messages back.  Every array read sees the data its
    message was made for; at the end everything is freed and the fake saw no rule
    broken."""
    es = [world.proc(f"e{i}", keep_mappings=2) for i in range(2)]
    rs = [world.proc(f"r{i}", keep_mappings=2) for i in range(2)]
    cores = [e.pool() for e in es]
    lock = threading.Lock()
    msgs = []  # (message, exporter's address, (generation, payload) it was made for)
    errors = []
    stop = time.monotonic() + 1.0

    def produce(i):
        rnd = random.Random(i)
        blocks = []
        while time.monotonic() < stop:
            if len(blocks) < 6 or rnd.random() < 0.3:
                blocks.append(cores[i].alloc(KB, payload=(i, rnd.random())))
            blk = rnd.choice(blocks)
            m = es[i].send(blk)
            with lock:
                msgs.append((m, es[i].exporter.address, blk.read()))
            if rnd.random() < 0.3:
                blocks.pop(rnd.randrange(len(blocks)))
        blocks.clear()

    def consume(p, seed, forward, own=None):
        rnd = random.Random(seed)
        held = []
        while time.monotonic() < stop:
            with lock:
                pick = [x for x in msgs[-64:] if own is None or x[1] == own]
            if not pick:
                time.sleep(0.001)
                continue
            m, addr, want = rnd.choice(pick)
            try:
                o = p.recv(m)
            except SharingError:
                continue  # stale: its block was freed (and maybe reused) meanwhile
            if p.read(o) != want:
                errors.append(f"{p.name} read {p.read(o)} for {want}")
            if forward and rnd.random() < 0.2:
                try:
                    fm = p.send(o)
                except SharingError:
                    pass
                else:
                    with lock:
                        msgs.append((fm, addr, want))
            held.append(o)
            if len(held) > 3 or rnd.random() < 0.5:
                held.pop(rnd.randrange(len(held)))
        held.clear()

    ts = [threading.Thread(target=produce, args=(i,)) for i in range(2)]
    ts += [
        threading.Thread(target=consume, args=(rs[j], 10 + 2 * j + k, True))
        for j in range(2)
        for k in range(2)
    ]
    ts += [
        threading.Thread(target=consume, args=(es[i], 20 + i, False, es[i].exporter.address))
        for i in range(2)
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10.0)
    assert not any(t.is_alive() for t in ts)
    msgs.clear()
    assert errors == []
    for r in rs:
        r.ctx.collect()  # idle mappings go back
    for e in es:
        e.exporter.expire(now=time.monotonic() + 1e6)  # unread messages too
    assert wait_for(lambda: all(e.stats()["exported_blocks"] == 0 for e in es), 5.0)
    assert sum(1 for x in world.gpu.log if x[1] == "import") > 10  # it did share
    assert world.gpu.violations == []


def test_writes_on_a_record_stream_stream_are_ordered_before_the_message(world):
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=1)
    other = FakeStream(0x66)
    b.record_stream(other)  # the array is written on another stream
    b.write(2, stream=other)
    imp = r.recv(e.send(b))  # the message's event covers that stream's writes too
    assert r.read(imp) == (1, 2)
    assert world.gpu.violations == []
    del imp, b


# -- 14. the Numba plugin's raw mappings share the importer ----------------------------------------
def test_a_numba_handle_and_a_cupy_message_share_one_mapping(world):
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=8)
    d = pickle.loads(e.send(b))
    fd = os.dup(core._rfd)  # what the Numba IPC handle carries
    try:
        raw = r.importer.open_raw(d.pool_uuid, 0, d.export_data, d.size, fd)
    finally:
        os.close(fd)
    imp = r.recv(pickle.dumps(d))  # the CuPy message: same allocation, one import
    assert imp.m is raw and raw.leased and len(_imports(world.gpu, "receiver")) == 1
    assert r.read(imp) == (1, 8) and e.stats()["leases"] == 1
    r.importer.close_raw(raw)
    assert r.read(imp) == (1, 8)  # still mapped for the CuPy array
    del imp
    assert wait_for(lambda: e.stats()["leases"] == 0)
    del b
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)


def test_a_numba_handle_opened_while_an_unmap_is_queued_waits_for_it(world):
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=8)
    d = pickle.loads(e.send(b))
    r.driver._set_stream(FakeStream(0x77))
    imp = r.recv(pickle.dumps(d))
    del imp  # freed in order on 0x77: not waited for by anybody yet
    fd = os.dup(core._rfd)
    try:
        raw = r.importer.open_raw(d.pool_uuid, 0, d.export_data, d.size, fd)
    finally:
        os.close(fd)
    assert world.gpu.violations == []  # the new import waited for the old one's free
    r.importer.close_raw(raw)
    del b
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)


def _open_raw(r, core, d):
    fd = os.dup(core._rfd)  # what the Numba IPC handle carries
    try:
        return r.importer.open_raw(d.pool_uuid, 0, d.export_data, d.size, fd)
    finally:
        os.close(fd)


def _slow_first_pool_import(r):
    """Hold the first pool import (outside the importer's lock) until the gate opens."""
    calls, gate = [], threading.Event()

    def slow_import(fd, kind, dev):
        calls.append(fd)
        if len(calls) == 1:
            gate.wait(5.0)

    r.driver._hooks["import_pool"] = slow_import
    return calls, gate


def test_a_numba_handle_opened_while_a_message_of_it_maps_waits_and_shares_it(world):
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=8)
    msg = e.send(b)
    d = pickle.loads(msg)
    calls, gate = _slow_first_pool_import(r)
    got, raws = [], []
    t = threading.Thread(target=lambda: got.append(r.recv(msg)))
    t.start()
    assert wait_for(lambda: calls)  # the message's mapping is under way
    u = threading.Thread(target=lambda: raws.append(_open_raw(r, core, d)))
    u.start()
    u.join(0.1)
    assert u.is_alive() and not raws  # waits for the mapping under way
    gate.set()
    t.join(5.0)
    u.join(5.0)
    ((imp,), (raw,)) = got, raws
    assert raw is imp.m and len(_imports(world.gpu, "receiver")) == 1
    assert r.read(imp) == (1, 8) and len(calls) == 1
    r.importer.close_raw(raw)
    del imp, got[:]
    assert wait_for(lambda: e.stats()["leases"] == 0)
    del b
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)


def test_a_message_received_while_a_numba_handle_of_it_maps_waits_and_shares_it(world):
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=9)
    msg = e.send(b)
    d = pickle.loads(msg)
    calls, gate = _slow_first_pool_import(r)
    got, raws = [], []
    u = threading.Thread(target=lambda: raws.append(_open_raw(r, core, d)))
    u.start()
    assert wait_for(lambda: calls)  # the handle's mapping is under way
    t = threading.Thread(target=lambda: got.append(r.recv(msg)))
    t.start()
    t.join(0.1)
    assert t.is_alive() and not got  # waits for the mapping under way
    gate.set()
    u.join(5.0)
    t.join(5.0)
    ((imp,), (raw,)) = got, raws
    assert imp.m is raw and raw.leased and len(_imports(world.gpu, "receiver")) == 1
    assert r.read(imp) == (1, 9) and len(calls) == 1 and e.stats()["leases"] == 1
    r.importer.close_raw(raw)
    assert r.read(imp) == (1, 9)  # still mapped for the CuPy array
    del imp, got[:]
    assert wait_for(lambda: e.stats()["leases"] == 0)
    del b
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)


def test_a_hit_whose_wait_fails_gives_its_ticket_back_and_keeps_the_mapping(world):
    """The re-send fast path: the sender's event fails to be waited on (a driver
    error) -> the receive raises with the CUDA error name, the ticket goes back to the
    exporter (nothing stays pinned for inflight_timeout), the user taken is let go
    again, and the next message for the block is received normally."""
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=7)
    imp = r.recv(e.send(b))
    m = imp.m
    msg = e.send(b)

    def broken(ev):
        raise CUDADriverError("cuEventSynchronize", 999, "CUDA_ERROR_UNKNOWN")

    r.driver._hooks["sync_event"] = broken
    with pytest.raises(CUDADriverError, match="CUDA_ERROR_UNKNOWN"):
        r.recv(msg)
    r.driver._hooks.clear()
    gc.collect()
    assert m.users == 1  # only ``imp``
    assert wait_for(lambda: e.stats()["tickets_out"] == 0)
    imp2 = r.recv(e.send(b))
    assert imp2.m is m and r.read(imp2) == (1, 7)
    del imp, imp2
    assert r.stats()["idle_mappings"] == 1
    b = None
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)
    assert world.gpu.violations == []


def test_gone_exporters_pools_close_in_relaxed_mode_during_a_capture(world):
    """A graph capture under way in the receiver (global mode, on another stream): the
    pools of an exporter that is gone are still closed, with every event query made in
    relaxed capture mode (a plain query would fail and invalidate the capture)."""
    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=3)
    imp = r.recv(e.send(b))
    r.driver._capturing.add(0x99)
    try:
        del imp, b
        e.exit()
        assert wait_for(lambda: r.stats()["clients"] == 0)
        assert wait_for(lambda: r.stats()["imported_pools"] == 0)
    finally:
        r.driver._capturing.discard(0x99)
    assert world.gpu.violations == []


def test_a_failing_pool_close_keeps_that_pool_and_the_others_still_close(world):
    """close_done_pools: a driver error while settling one gone exporter's pool keeps
    that pool (imported, never destroyed unsynchronised), warns, and does not stop the
    pools of later exporters from closing."""
    r = world.proc("receiver")
    failing = {"on": True}

    def broken(ev):
        if failing["on"] and threading.current_thread() is not threading.main_thread():
            raise CUDADriverError("cuEventSynchronize", 999, "CUDA_ERROR_UNKNOWN")

    for i in range(2):
        e = world.proc(f"e{i}")
        core = e.pool()
        b = core.alloc(KB, payload=i)
        imp = r.recv(e.send(b))
        del imp, b
        if i == 0:
            r.driver._hooks["sync_event"] = broken
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                e.exit()
                assert wait_for(lambda: r.importer._kept_pools)
            assert any("closing the pool" in str(w.message) for w in caught)
            r.driver._hooks.clear()
            kept = r.importer._kept_pools[0]
            assert kept.keepalive.closed is False  # kept, not destroyed
        else:
            e.exit()
        core.dispose()
        world.procs.remove(e)
    assert wait_for(lambda: r.stats()["clients"] == 0)
    assert wait_for(lambda: r.stats()["imported_pools"] == 1)  # only the kept one
    assert world.gpu.violations == []


def test_event_done_counts_errors_other_than_not_ready_as_done(fake_driver):
    """Driver.event_done: NOT_READY is the only 'not yet'; a sticky error (illegal
    address) or a destroyed context counts as done, so nothing polls for ever."""
    drv = Driver()
    answers = iter([600, 0, 700, 201])

    class D:
        @staticmethod
        def cuEventQuery(ev):
            return (next(answers),)

    fake_driver(D)  # the driver Driver asks the provider for
    assert [drv.event_done(object()) for _ in range(4)] == [False, True, True, True]


def test_the_deferred_retry_backs_off_while_nothing_changes_and_stops_when_done(world, monkeypatch):
    """A free deferred by a capture that lasts: the retry thread polls at 20 Hz at
    first, then backs off to once a second; when the capture ends it lets go and the
    thread ends."""
    sleeps: list[float] = []
    real_sleep = time.sleep

    def fast_sleep(s):
        if threading.current_thread().name != "cupy_poolmem-deferred":
            return real_sleep(s)
        sleeps.append(s)
        real_sleep(0.001)

    e, r, core = _exporter_receiver(world)
    b = core.alloc(KB, payload=5)
    imp = r.recv(e.send(b))
    m = imp.m
    monkeypatch.setattr(_unmapping.time, "sleep", fast_sleep)
    r.driver._set_stream(FakeStream(0x99))
    imp.stream = FakeStream(0x99)
    r.driver._capturing.add(0x99)
    del imp  # deferred: its stream captures
    assert wait_for(lambda: len(sleeps) >= 8)
    assert sleeps[0] == 0.05 and max(sleeps) == 1.0 and sleeps == sorted(sleeps)
    assert m.users == 1  # still deferred
    r.driver._capturing.discard(0x99)
    assert wait_for(lambda: r.importer._deferred_thread is None)
    assert m.users == 0
    del b
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0)
    assert world.gpu.violations == []


def test_free_events_of_an_imported_pool_stay_bounded_with_a_stream_per_task(world):
    """A worker that makes a new stream per task: the imported pool keeps one free
    event per stream only until those frees are done (bounded), and the events it let
    go were synchronised first; the pool still closes cleanly when the exporter goes."""
    e, r, core = _exporter_receiver(world)
    blocks = [core.alloc(KB, payload=i) for i in range(40)]
    for i, blk in enumerate(blocks):
        r.driver._set_stream(FakeStream(0x1000 + i))  # a new stream per task
        imp = r.recv(e.send(blk))
        assert r.read(imp) == (1, i)
        del imp  # unmapped on that stream
    pool = next(iter(r.importer.pools.values()))
    assert len(pool.frees) <= r.importer.frees_max + 1
    blocks.clear()
    e.exit()
    assert wait_for(lambda: r.stats()["imported_pools"] == 0)
    assert world.gpu.violations == []
