"""Operational limits of sharing on a CPU: handshake deadlines and caps, socket
directories, fork handlers, locks held across waits, descriptor exhaustion, peers
without a usable pid, bounded event and descriptor caches.

The simulated processes are tests/fakes/sharing.py's (real sockets, a fake driver).
"""

from __future__ import annotations

import os
import select
import socket
import stat
import struct
import sys
import threading
import time

import pytest
from fakes.sharing import sharing_threads, wait_for

from cupy_poolmem._sharing import _transport

KEY = b"family key"
KB = 1024

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="needs Linux (Unix sockets, SO_PEERCRED)"
)


@pytest.fixture
def world(sharing_world):
    return sharing_world


def _peer_threads(before):
    return [
        t
        for t in sharing_threads()
        if t not in before and t.name == "cupy_poolmem-peer" and t.is_alive()
    ]


def _closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """Whether the server end closed ``sock`` (EOF) within ``timeout`` s; reads and
    discards what the server sent before."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        r, _, _ = select.select([sock], [], [], left)
        if r:
            try:
                if sock.recv(4096) == b"":
                    return True
            except OSError:
                return True


# -- 1. the handshake: a deadline from connect, a cap, a loop that survives ------------------
def test_a_trickling_peer_is_dropped_at_the_handshake_deadline():
    """The limit was per recv: a peer sending a byte more often than that stayed
    connected, unauthenticated, for ever.  Its answer announces 200 bytes and never
    ends (bytes that made a whole answer would be refused as a wrong one instead)."""
    lst = _transport.Listener(KEY, lambda conn: None, handshake_timeout=0.6)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(lst.address)
        t0 = time.monotonic()
        s.sendall(struct.pack("!i", 200))  # the length of the answer, in its frame
        closed = False
        while time.monotonic() - t0 < 3.0 and not closed:
            try:
                s.send(b"\x00")  # a byte every 0.2 s: each recv of the server returns
            except OSError:
                closed = True
                break
            closed = _closed_by_server(s, 0.2)
        took = time.monotonic() - t0
        assert closed, "a peer that trickles bytes stayed connected past the deadline"
        assert took < 0.6 + 1.0
        assert wait_for(lambda: lst.refused == 1 and lst.handshakes == 0, 10.0)
    finally:
        s.close()
        lst.close()


def test_a_silent_peer_is_dropped_at_the_deadline_and_others_still_connect():
    served = []
    lst = _transport.Listener(KEY, served.append, handshake_timeout=0.5)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        silent.connect(lst.address)
        conn = _transport.connect(lst.address, KEY)  # served meanwhile
        assert wait_for(lambda: served, 2.0)
        assert _closed_by_server(silent, 2.0)
        assert wait_for(lambda: lst.refused == 1, 2.0)
        conn.close()
        served[0].close()
    finally:
        silent.close()
        lst.close()


def _silent(address: str, n: int) -> list[socket.socket]:
    """``n`` connections to ``address`` that never send a byte (in the order made)."""
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(address)
        socks.append(s)
    return socks


def test_handshake_threads_stop_at_the_cap_while_the_excess_waits_in_the_backlog():
    """One thread per connection, without a cap: a peer opening connections without
    authenticating made the exporter start threads without bound.  With no deadline
    near, exactly the cap's connections are accepted, each in one thread; the rest
    stay in the backlog (no thread) until a slot frees, then the next ones are taken.

    Threads are counted while no slot frees: a thread let go at its deadline ends a
    moment after its slot is given to the next connection, so a count taken while
    slots turn over is no bound."""
    assert wait_for(
        lambda: not [t for t in sharing_threads() if t.name == "cupy_poolmem-peer"], 10.0
    )
    before = set(sharing_threads())
    started: list[int] = []  # per thread started: connections authenticating then

    def counted(*args, **kwargs):
        started.append(lst.handshakes)  # (the accept thread: this one included)
        return threading.Thread(*args, **kwargs)

    lst = _transport.Listener(
        KEY, lambda conn: None, handshake_timeout=60.0, max_handshakes=4, thread_factory=counted
    )

    def more(n: int) -> bool:  # more than n accepted, or more than four threads
        return len(started) > n or len(_peer_threads(before)) > 4

    socks = []
    try:
        socks = _silent(lst.address, 12)
        assert wait_for(lambda: len(started) >= 4 and len(_peer_threads(before)) >= 4, 30.0)
        # Nothing frees a slot for a minute: a cap that let one more in does so at once.
        assert not wait_for(lambda: more(4), 0.5), (len(started), len(_peer_threads(before)))
        assert lst.handshakes == 4 and lst.refused == 0
        for s in socks[:4]:  # the four accepted (a backlog is first in, first out) leave
            s.close()
        assert wait_for(lambda: lst.refused == 4 and len(started) == 8, 30.0)
        assert wait_for(lambda: len(_peer_threads(before)) == 4, 30.0)  # theirs ended
        assert not wait_for(lambda: more(8), 0.5), (len(started), len(_peer_threads(before)))
        assert lst.handshakes == 4 and max(started) == 4
        for s in socks[4:]:
            s.close()
        assert wait_for(lambda: lst.refused == 12 and lst.handshakes == 0, 30.0)
        assert wait_for(lambda: not _peer_threads(before), 30.0)
        assert len(started) == 12 and max(started) == 4
    finally:
        for s in socks:
            s.close()
        lst.close()


def test_unauthenticated_connections_are_capped_and_the_excess_waits():
    """Beyond the cap, silent connections wait in the backlog, each group dropped at
    its deadline counted from its acceptance; a real receiver behind them is served
    once its turn comes (delayed, never refused for the cap)."""
    started: list[int] = []  # per thread started: connections authenticating then

    def counted(*args, **kwargs):
        started.append(lst.handshakes)
        return threading.Thread(*args, **kwargs)

    served = []
    lst = _transport.Listener(
        KEY, served.append, handshake_timeout=0.4, max_handshakes=4, thread_factory=counted
    )
    before = set(sharing_threads())
    socks = []
    try:
        t0 = time.monotonic()  # (before the first acceptance)
        socks = _silent(lst.address, 12)
        peak = 0
        while lst.refused < 12 and time.monotonic() - t0 < 30.0:
            peak = max(peak, lst.handshakes)
            time.sleep(0.01)
        took = time.monotonic() - t0
        assert lst.refused == 12, lst.refused  # three rounds of four, at their deadlines
        assert 0 < peak <= 4 and len(started) == 12 and max(started) == 4
        # Each group's deadline ran from its acceptance, after the one before it left.
        assert took >= 3 * 0.4 - 0.05, took
        assert all(_closed_by_server(s, 10.0) for s in socks)
        assert wait_for(lambda: not _peer_threads(before), 30.0)
        conn = _transport.connect(lst.address, KEY)
        assert wait_for(lambda: served, 10.0)
        conn.close()
        served[0].close()
    finally:
        for s in socks:
            s.close()
        lst.close()


def test_a_receiver_behind_silent_peers_is_served_after_their_deadline():
    """A receiver beyond the cap waits for a slot (never refused for the cap): it is
    served once a silent peer ahead of it was dropped at its deadline."""
    served = []  # (connection, silent peers refused when it was served)
    lst = _transport.Listener(
        KEY, lambda c: served.append((c, lst.refused)), handshake_timeout=0.5, max_handshakes=2
    )
    socks = []
    try:
        socks = _silent(lst.address, 2)
        assert wait_for(lambda: lst.handshakes == 2, 10.0)
        t0 = time.monotonic()
        conn = _transport.connect(lst.address, KEY, timeout=20.0)  # waits for a slot
        took = time.monotonic() - t0
        assert wait_for(lambda: served, 10.0)
        assert served[0][1] >= 1  # a silent peer's slot, freed at its deadline
        assert wait_for(lambda: lst.refused == 2, 10.0)
        assert all(_closed_by_server(s, 10.0) for s in socks)
        # Served by the silent peers' deadline (0.5 s), not at its own timeout (20 s);
        # a wide margin for a loaded machine.
        assert took < 0.5 + 9.5, took
        conn.close()
        served[0][0].close()
    finally:
        for s in socks:
            s.close()
        lst.close()


def test_honest_peers_beyond_the_cap_wait_for_a_slot_instead_of_being_refused():
    """A burst of receivers connecting at once (a pool of workers at start) whose
    handshakes are slow (an exporter busy with the GIL) went past the cap: those
    beyond it were refused at once, and their receive failed ("the exporter has
    exited"), though slots freed well within their deadline."""

    def slow_cred(sock):
        time.sleep(0.3)  # each handshake takes a while
        return os.getpid(), os.getuid()

    served = []
    lst = _transport.Listener(
        KEY, served.append, handshake_timeout=3.0, max_handshakes=2, peer_cred=slow_cred
    )
    errors = []

    def receiver():
        try:
            _transport.connect(lst.address, KEY, timeout=5.0).close()
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=receiver, daemon=True) for _ in range(6)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(10.0)
        assert errors == [] and lst.refused == 0
        assert wait_for(lambda: len(served) == 6, 2.0)
        assert lst.handshakes == 0
    finally:
        for c in served:
            c.close()
        lst.close()


def test_a_closed_listeners_thread_ends_at_once_and_polls_no_reused_descriptor():
    """close() closed the listening socket under its accept thread: a thread between
    reading the descriptor and polling it then polled whatever reused the number (a
    handshake's duplicate) until the next handshake deadline (1 close in several
    hundred, with a handshake just done).  Now the thread closes it, and sees close()
    soon although a shutdown does not wake a poll of a listening socket.  Timing
    dependent: many cycles, each thread must end within a second of close()."""
    slow = 0
    for _ in range(300):
        served = []
        lst = _transport.Listener(KEY, served.append, handshake_timeout=30.0)
        conn = _transport.connect(lst.address, KEY, timeout=5.0)
        threads = [
            t for t in threading.enumerate() if t.name == "cupy_poolmem-listen" and t.is_alive()
        ]
        lst.close()  # the server's handshake may still be under way
        conn.close()
        for t in threads:
            t.join(1.0)
            slow += t.is_alive()
        assert lst._sock.fileno() == -1 or any(t.is_alive() for t in threads)
        assert wait_for(lambda s=served: s, 5.0)
        served[0].close()
    assert slow == 0, f"{slow} accept threads outlived close() by a second"


def test_the_accept_loop_survives_a_failed_thread_start():
    """A Thread.start failure in the accept loop ended accepting for good: every
    receiver then saw "the exporter has exited"."""
    fail = [2]

    class FlakyThread(threading.Thread):
        def start(self):
            if fail[0] > 0:
                fail[0] -= 1
                raise RuntimeError("can't start new thread")
            super().start()

    served = []
    lst = _transport.Listener(KEY, served.append, thread_factory=FlakyThread)
    try:
        for _ in range(2):
            with pytest.raises((EOFError, OSError)):
                _transport.connect(lst.address, KEY, timeout=2.0)
        assert wait_for(lambda: lst.refused == 2 and lst.handshakes == 0, 2.0)
        conn = _transport.connect(lst.address, KEY, timeout=2.0)
        assert wait_for(lambda: served, 2.0)
        conn.send(b"hello")
        assert served[0].recv() == b"hello"
        conn.close()
        served[0].close()
    finally:
        lst.close()


# -- 6. socket directories: removed, and made where the path fits --------------------------
def test_a_long_tmpdir_falls_back_to_a_shorter_private_directory(tmp_path, monkeypatch):
    """A long TMPDIR made bind fail ("AF_UNIX path too long") and sharing with it."""
    import tempfile

    long_dir = tmp_path / ("d" * 100) / ("e" * 90)
    long_dir.mkdir(parents=True)
    assert len(str(long_dir)) >= 200
    monkeypatch.setenv("TMPDIR", str(long_dir))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    assert tempfile.gettempdir() == str(long_dir)
    served = []
    lst = _transport.Listener(KEY, served.append)
    try:
        d = os.path.dirname(lst.address)
        assert len(os.fsencode(lst.address)) <= 107
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
        assert os.stat(d).st_uid == os.getuid()
        conn = _transport.connect(lst.address, KEY)
        assert wait_for(lambda: served, 2.0)
        conn.close()
        served[0].close()
    finally:
        lst.close()
    assert not os.path.exists(d)


def test_the_socket_directory_goes_when_the_exporter_closes_or_exits(world):
    for end in ("close", "exit"):
        e = world.proc(f"exporter-{end}")
        r = world.proc(f"receiver-{end}")
        b = e.pool().alloc(KB, payload=7)
        owner = r.recv(e.send(b))
        assert r.read(owner)[1] == 7
        d = os.path.dirname(e.exporter.address)
        assert os.path.isdir(d)
        del owner
        if end == "close":
            e.exporter.close()
        else:
            e.exit()
        assert not os.path.exists(d), f"{end}: the socket directory stayed"


_CHILD = r"""
import os, sys
sys.path.insert(0, {tests!r})
from cupy_poolmem._sharing import _transport
lst = _transport.Listener(b"k", lambda conn: None)
print(os.path.dirname(lst.address), flush=True)
{end}
"""


@pytest.mark.parametrize("end", ["", "sys.exit(0)", "raise SystemExit(3)"])
def test_the_socket_directory_goes_when_its_process_exits(end):
    """One directory per exporter process stayed for ever (a Pool(maxtasksperchild=1)
    left one per task)."""
    import subprocess

    tests = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(
        [sys.executable, "-c", _CHILD.format(tests=tests, end=end)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=os.path.dirname(tests),
    )
    d = out.stdout.strip().splitlines()[0]
    assert d and "cupy_poolmem-" in d, out.stderr
    assert not os.path.exists(d), "the child's socket directory stayed after it exited"


def _listen_and_return(q):
    lst = _transport.Listener(b"k", lambda conn: None)
    q.put(os.path.dirname(lst.address))
    return lst  # alive at the child's exit: its exit finalizers remove the directory


def test_the_socket_directory_of_a_multiprocessing_child_goes_with_it():
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_listen_and_return, args=(q,))
    p.start()
    try:
        d = q.get(timeout=60)
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join(5)
    assert p.exitcode == 0
    assert not os.path.exists(d)


def test_a_fork_child_that_exits_leaves_its_parents_directory():
    lst = _transport.Listener(KEY, lambda conn: None)
    d = os.path.dirname(lst.address)
    try:
        pid = os.fork()
        if pid == 0:  # the child runs the exit finalizers it inherited
            try:
                from multiprocessing import util

                util._exit_function()
            finally:
                os._exit(0)
        _wait_child(pid, 10.0)
        assert os.path.isdir(d), "a fork child removed its parent's socket directory"
    finally:
        lst.close()
    assert not os.path.exists(d)


def _wait_child(pid: int, timeout: float) -> int:
    """The child's exit status; kills it and fails when it is still running at ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked child hung (still running after {timeout} s)")


# -- 3. fork handlers whatever other threads hold --------------------------------------------
def test_a_fork_while_another_thread_holds_the_pools_registry_lock_does_not_hang():
    """The child's fork handler took the pools' registry lock, which the parent's thread
    held at the fork: no thread of the child would ever release it."""
    from cupy_poolmem import _runtime
    from cupy_poolmem._sharing import _context  # noqa: F401  (its fork handler runs)

    held, done = threading.Event(), threading.Event()

    def hold():
        with _runtime.registry_lock():  # the registry lock of this (the parent) process
            held.set()
            done.wait(20.0)

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    try:
        assert held.wait(5.0)
        pid = os.fork()
        if pid == 0:  # the fork handlers ran already; the registry is usable here
            code = 1
            try:
                _runtime.all_pools()
                code = 0
            finally:
                os._exit(code)
        assert _wait_child(pid, 10.0) == 0
    finally:
        done.set()
        t.join(5.0)


# -- 7. receivers without a usable pid (another pid namespace) -------------------------------
def _pid0(sock):
    return 0, os.getuid()  # what SO_PEERCRED says of a process in another pid namespace


def _frees(gpu, name):
    return [x for x in gpu.log if x[0] == name and x[1] == "free"]


def test_a_receiver_of_unknown_pid_keeps_its_leases_after_its_socket_closes(world):
    """Its leases went when its socket closed: its kernel, still running, read memory
    the exporter had freed (and reused)."""
    e = world.proc("exporter", listener_options={"peer_cred": _pid0})
    r = world.proc("receiver")
    b = e.pool().alloc(KB, payload=5)
    imp = r.recv(e.send(b))
    assert r.read(imp) == (1, 5)
    del b
    assert e.stats()["limbo_blocks"] == 1
    with pytest.warns(ResourceWarning, match="another pid namespace"):
        r.kill(context_gone=False)  # its sockets close; its kernel still reads
        assert wait_for(lambda: e.stats()["peers"] == 0, 5.0)
    time.sleep(0.1)
    st = e.stats()
    assert (st["leases"], st["limbo_blocks"]) == (1, 1) and _frees(world.gpu, "exporter") == []
    assert e.exporter.stranded == 1
    world.gpu.context_gone("receiver")
    del imp


def test_a_receiver_of_unknown_pid_that_unmaps_gives_its_lease_back(world):
    e = world.proc("exporter", listener_options={"peer_cred": _pid0})
    r = world.proc("receiver")
    b = e.pool().alloc(KB, payload=6)
    imp = r.recv(e.send(b))
    assert r.read(imp) == (1, 6)
    del b, imp  # received once: unmapped at once, and said so
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0, 5.0)
    assert len(_frees(world.gpu, "exporter")) == 1
    r.exit()
    assert wait_for(lambda: e.stats()["peers"] == 0, 5.0)
    assert e.exporter.stranded == 0


# -- 4. a receiver out of file descriptors -----------------------------------------------------
def _socketpair_conns():
    from multiprocessing import connection as mpc

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ca = _transport.Conn(mpc.Connection(a.detach()), _transport.PeerProcess(0, watch=False))
    cb = _transport.Conn(mpc.Connection(b.detach()), _transport.PeerProcess(0, watch=False))
    return ca, cb


def test_a_descriptor_lost_for_want_of_free_descriptors_is_named_and_the_connection_stays():
    """recv_handle duplicated the socket first: out of descriptors that failed with the
    descriptor's byte unread (the next read took it for a frame), or the kernel's
    truncation surfaced as a RuntimeError the receiver took for a dead exporter."""
    import resource

    from cupy_poolmem._errors import SharingError

    sender, receiver = _socketpair_conns()
    r, w = os.pipe()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fillers = []
    try:
        sender.send(b"reply", r)  # a frame, and a descriptor right after it
        sender.send(b"next", r)
        assert receiver.recv() == b"reply"
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
        try:
            while True:
                fillers.append(os.dup(w))
        except OSError:
            pass
        with pytest.raises(SharingError, match="EMFILE.*raise the limit"):
            receiver.recv_fd()
        for fd in fillers:
            os.close(fd)
        fillers = []
        assert receiver.recv() == b"next"  # in step: the lost descriptor's byte was read
        fd = receiver.recv_fd()  # and descriptors arrive again
        assert os.path.sameopenfile(fd, r)
        os.close(fd)
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        os.close(r)
        os.close(w)
        sender.close()
        receiver.close()


def test_an_exporter_out_of_descriptors_sends_a_reply_and_its_descriptor_in_step():
    """send_handle duplicated the socket to send the descriptor: an exporter out of
    descriptors sent the reply (saying a descriptor follows) and then failed, so the
    receiver took the next frame's first byte for the descriptor's (out of step)."""
    import resource

    sender, receiver = _socketpair_conns()
    r, w = os.pipe()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fillers = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
        try:
            while True:
                fillers.append(os.dup(w))
        except OSError:
            pass
        sender.send(b"reply", r)  # no descriptor free in the sender
        sender.send(b"next")
        for fd in fillers:
            os.close(fd)
        fillers = []
        assert receiver.recv() == b"reply"
        fd = receiver.recv_fd()
        assert os.path.sameopenfile(fd, r)
        os.close(fd)
        assert receiver.recv() == b"next"
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        os.close(r)
        os.close(w)
        sender.close()
        receiver.close()


def test_a_receiver_that_lost_a_pool_descriptor_takes_the_next_message(world):
    """A receiver out of descriptors treated its live exporter as gone, and refused
    its messages until its old arrays were dropped."""
    from cupy_poolmem._errors import SharingError

    e = world.proc("exporter")
    r = world.proc("receiver")
    core = e.pool()
    client = r.importer.client(e.exporter.address)
    real = client.conn.recv_fd
    failures = [1]

    def out_of_descriptors():
        fd = real()  # what the kernel does out of descriptors: the descriptor goes
        if failures[0]:
            failures[0] -= 1
            os.close(fd)
            raise RuntimeError("received 0 items of ancdata")  # recv_handle's words
        return fd

    client.conn.recv_fd = out_of_descriptors  # this connection's descriptor receipt fails once
    b1 = core.alloc(KB, payload=1)
    with pytest.raises(SharingError):
        r.recv(e.send(b1))
    assert not client.closed, "a live exporter was taken for gone"
    assert wait_for(lambda: e.stats()["leases"] == 0, 5.0)  # the grant was given back
    b2 = core.alloc(KB, payload=2)
    imp = r.recv(e.send(b2))  # the pool's descriptor comes again
    assert r.read(imp) == (1, 2)
    assert r.importer.client(e.exporter.address) is client
    del imp, b1, b2
    assert wait_for(lambda: e.stats()["exported_blocks"] == 0, 5.0)


# -- 2. no lock held across a wait on another process's work ---------------------------------
def test_a_host_wait_on_a_receivers_work_stalls_no_export_or_claim(world):
    """The exporter waited on the host for a receiver's event under its lock: one
    receiver's long kernel stalled every export and claim of the process."""
    e = world.proc("exporter")
    r = world.proc("receiver")
    r2 = world.proc("receiver2")
    core = e.pool()
    b = core.alloc(KB, payload=1)
    imp = r.recv(e.send(b))
    assert r.read(imp) == (1, 1)
    b2 = core.alloc(KB, payload=2)
    gate, waiting = threading.Event(), threading.Event()

    def long_kernel(ev):  # the host wait returns once the receiver's work is done
        waiting.set()
        assert gate.wait(10.0)

    stream = b.stream_ptr
    e.driver._capturing.add(stream)  # a capture on the block's stream: waits go to the host
    e.driver._hooks["sync_event"] = long_kernel
    try:
        del b  # limbo: the receiver maps it
        del imp  # its Unmap comes with an event: the free waits on the host for it
        assert waiting.wait(5.0)
        out = []

        def export_and_claim():
            out.append(r2.read(r2.recv(e.send(b2))))

        t = threading.Thread(target=export_and_claim, daemon=True)
        t.start()
        t.join(3.0)
        assert not t.is_alive(), "an export and claim waited for another receiver's kernel"
        assert out == [(1, 2)]
        assert _frees(world.gpu, "exporter") == []  # not before the receiver's work is done
    finally:
        gate.set()
        e.driver._hooks.pop("sync_event", None)
    assert wait_for(lambda: len(_frees(world.gpu, "exporter")) == 1, 5.0)
    e.driver._capturing.discard(stream)


def test_a_receiver_that_dies_during_a_host_wait_on_its_event_does_not_close_it_under_it(world):
    """Waits on the host now run without the lock: the reaper of a dead receiver must
    not close the event a wait is using (the fake flags a sync of a closed event)."""
    e = world.proc("exporter")
    r = world.proc("receiver")
    core = e.pool()
    b = core.alloc(KB, payload=1)
    imp = r.recv(e.send(b))
    gate, waiting = threading.Event(), threading.Event()

    def long_kernel(ev):
        waiting.set()
        assert gate.wait(10.0)

    stream = b.stream_ptr
    e.driver._capturing.add(stream)
    e.driver._hooks["sync_event"] = long_kernel
    holder = [b]
    del b
    let_go = threading.Thread(target=holder.clear, daemon=True)  # its free waits on the host
    try:
        del imp  # unmapped: its Unmap's event is what the block's free waits for
        assert wait_for(lambda: e.stats()["leases"] == 0, 5.0)
        let_go.start()
        assert waiting.wait(5.0)
        r.kill()  # reaped at once (one pid for every simulated process)
        assert wait_for(lambda: e.stats()["peers"] == 0, 5.0)
        assert not [x for x in world.gpu.log if x[0] == "exporter" and x[1] == "close_event"]
    finally:
        gate.set()
        e.driver._hooks.pop("sync_event", None)
        let_go.join(5.0)
    assert wait_for(lambda: len(_frees(world.gpu, "exporter")) == 1, 5.0)
    assert wait_for(
        lambda: [x for x in world.gpu.log if x[0] == "exporter" and x[1] == "close_event"], 5.0
    )  # closed by the wait, once done
    e.driver._capturing.discard(stream)


# -- 5. bounded caches: Numba handles' descriptors, opened events ---------------------------
def _numba():
    pytest.importorskip("numba.cuda", reason="needs Numba's CUDA target")
    return pytest.importorskip("cupy_poolmem.numba", reason="needs Numba's CUDA target")


def _numba_handle(cpn, fd):
    import uuid

    return cpn.PoolIpcHandle(
        object(),
        pool_uuid=uuid.uuid4(),
        device_uuid="GPU-test",
        payload=bytes(range(64)),
        alloc_size=4096,
        size=1024,
        export_fd=fd,
    )


def _fd_count():
    return len(os.listdir("/proc/self/fd"))


def test_numba_handle_descriptors_untaken_past_the_inflight_timeout_are_closed(monkeypatch):
    import pickle

    from cupy_poolmem._sharing import settings

    cpn = _numba()
    from cupy_poolmem import _numba_memory

    monkeypatch.setattr(settings, "inflight_timeout", 0.05)
    r, w = os.pipe()
    try:
        h = _numba_handle(cpn, w)
        pickle.loads(pickle.dumps(h))._release_fd()
        base = _fd_count()
        for _ in range(5):
            pickle.dumps(h)
        assert _fd_count() == base + 5, "a duplicate per pickle"
        time.sleep(0.1)
        msg = pickle.dumps(h)  # a pickle closes those past the timeout
        assert wait_for(lambda: _fd_count() == base + 1, 5.0) and _numba_memory.SENT.untaken() == 1
        got = pickle.loads(msg)  # a fresh one is taken as before
        os.write(got._fd, b"x")
        assert os.read(r, 1) == b"x"
        got._release_fd()
        assert wait_for(lambda: _fd_count() == base, 5.0)
        from cupy_poolmem._errors import SharingError

        late = pickle.dumps(h)
        time.sleep(0.1)
        pickle.dumps(h)  # closes the late one's duplicate: its receiver is told why
        with pytest.raises(SharingError, match="inflight_timeout"):
            pickle.loads(late)
        del h
    finally:
        os.close(r)
        os.close(w)


def _opened_not_closed(gpu, name):
    """Other processes' events ``name`` opened and has not closed."""
    opened = sum(1 for x in gpu.log if x[0] == name and x[1] == "open_event")
    closed = sum(1 for x in gpu.log if x[0] == name and x[1] == "close_event" and x[3])
    return opened - closed


def test_a_receiver_keeps_a_bounded_number_of_an_exporters_events_open(world):
    """One event per stream the exporter sent from stayed open in the receiver for as
    long as the exporter lived."""
    from fakes.sharing import FakeStream

    e = world.proc("exporter")
    r = world.proc("receiver")
    r.importer.events_max = 4
    core = e.pool()
    kept = []
    for i in range(20):
        b = core.alloc(KB, payload=i, stream=FakeStream(0x1000 + i))  # its own stream
        imp = r.recv(e.send(b))
        assert r.read(imp) == (1, i)
        kept.append((b, imp))
        assert _opened_not_closed(world.gpu, "receiver") <= 4
        assert r.stats()["opened_events"] <= 4
    # Those closed are opened again when their streams send again: data still right.
    b, _ = kept[0]
    again = r.recv(e.send(b))
    assert r.read(again) == (1, 0)
    assert _opened_not_closed(world.gpu, "receiver") <= 4
    del kept, again, b, imp


def test_an_exporter_keeps_a_bounded_number_of_a_receivers_events_open(world):
    """One event per stream a receiver unmapped on stayed open in the exporter for as
    long as the receiver lived."""
    from fakes.sharing import FakeStream

    e = world.proc("exporter")
    r = world.proc("receiver")
    e.exporter.events_max = 4
    core = e.pool()
    for i in range(20):
        b = core.alloc(KB, payload=i)
        r.driver._set_stream(FakeStream(0x2000 + i))  # the receiver uses it on its own stream
        imp = r.recv(e.send(b))
        assert r.read(imp)[1] == i
        del imp  # unmapped, with an event of that stream
        assert wait_for(lambda: e.stats()["leases"] == 0, 5.0)
        del b  # its free waits for that event
        assert wait_for(lambda: e.stats()["exported_blocks"] == 0, 5.0)
        assert _opened_not_closed(world.gpu, "exporter") <= 4
    assert len([x for x in world.gpu.log if x[0] == "exporter" and x[1] == "free"]) == 20


def test_an_event_taken_out_of_the_receivers_cache_is_not_closed_under_a_hit_waiting_on_it(
    world,
):
    from fakes.sharing import FakeStream

    e = world.proc("exporter")
    r = world.proc("receiver")
    r.importer.events_max = 1
    core = e.pool()
    a = core.alloc(KB, payload=1, stream=FakeStream(0x3001))
    first = r.recv(e.send(a))  # maps it; its event is opened
    gate, waiting = threading.Event(), threading.Event()

    def slow(ev):
        if not waiting.is_set():
            waiting.set()
            assert gate.wait(10.0)

    msg = e.send(a)
    r.driver._hooks["sync_event"] = slow
    got = []
    hit = threading.Thread(target=lambda: got.append(r.recv(msg)), daemon=True)
    hit.start()  # a hit: waits on the host for the exporter's event
    try:
        assert waiting.wait(5.0)
        b = core.alloc(KB, payload=2, stream=FakeStream(0x3002))
        other = r.recv(e.send(b))  # another stream's event: the first one is taken out
        assert r.read(other) == (1, 2)
        closes = [x for x in world.gpu.log if x[0] == "receiver" and x[1] == "close_event"]
        assert closes == [], "closed while a hit waited on it"
    finally:
        gate.set()
        hit.join(5.0)
        r.driver._hooks.pop("sync_event", None)
    assert r.read(got[0]) == (1, 1)
    assert wait_for(lambda: _opened_not_closed(world.gpu, "receiver") <= 1, 5.0)
    got.clear()
    del first, other


def test_a_finalized_pools_block_goes_to_the_retirer_once_though_settled_during_its_wait(world):
    """A finalized pool's block is waited for on the host (no lock held) before it goes
    to the retirer: a second settle meanwhile (the ticket sweep drops a ticket it listed
    before a receiver claimed it) handed it to the retirer twice, a double free."""
    e = world.proc("exporter")
    r = world.proc("receiver")
    core = e.pool(recycle=True)
    for i in range(1, 3):  # received twice: the receiver keeps an idle mapping
        b = core.alloc(KB, payload=i)
        msg = e.send(b)
        del b
        own = r.recv(msg)
        assert r.read(own, 0)[1] == i
        del own
        assert wait_for(lambda: core.cached_blocks() == 1, 5.0)
    (rec,) = e.exporter.records.values()
    gate, waiting = threading.Event(), threading.Event()

    def long_kernel(ev):  # the receiver's unmap is not done yet
        waiting.set()
        assert gate.wait(10.0)

    e.driver._hooks["sync_event"] = long_kernel
    try:
        core.finalize()  # the receiver is asked to unmap; its Unmap starts the wait
        assert waiting.wait(5.0)
        e.exporter.drop_ticket(rec, bytes(16))  # a listed ticket, claimed since
    finally:
        gate.set()
        e.driver._hooks.pop("sync_event", None)
    assert wait_for(lambda: core.leftovers, 5.0)
    time.sleep(0.1)
    assert core.leftovers == [rec.ptr]  # once
    st = e.stats()
    assert (st["exported_blocks"], st["limbo_bytes"], core._held_for_sharing) == (0, 0, 0)
    core.retirer_frees()
    assert len(_frees(world.gpu, "exporter")) == 1
