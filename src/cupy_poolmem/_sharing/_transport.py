"""Sharing connections: an authenticated Unix socket between a receiver and an exporter.

:class:`Listener` (the exporter's socket, bounded authenticated handshakes),
:func:`connect` (a receiver's end), :class:`Conn` (frames and file descriptors, the
peer's credentials and process) and :class:`Sender` (one connection's frames in
order from a thread of its own, never blocking the poster).  The security and
liveness rules are in docs/sharing.rst.
"""

from __future__ import annotations

import array
import contextlib
import os
import select
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing import connection as _mpc
from multiprocessing import util as _mp_util
from typing import Any

from .._errors import SharingError
from . import _wire

__all__ = ["Conn", "Listener", "connect", "Sender", "PeerProcess"]

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_TIMEVAL = struct.Struct("ll")


def _peer_cred(sock: socket.socket) -> tuple[int, int]:
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


_FD = struct.Struct("i")
_CLOEXEC = getattr(socket, "MSG_CMSG_CLOEXEC", 0)


def _fd_limit() -> str:
    """This process's open descriptors and its limit, in words."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return f"{len(os.listdir('/proc/self/fd'))} open, limit {soft}"
    except Exception:
        return "the open files limit is reached"


def _set_timeouts(sock: socket.socket, seconds: float) -> None:
    """Kernel-level send/receive timeouts on a blocking socket (0: none)."""
    tv = _TIMEVAL.pack(int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


class PeerProcess:
    """The process at the other end of a connection, as the kernel reported it.

    ``wait_gone()`` returns once that process has exited (its files, GPU context
    included, are closed then).  A pidfd taken while the peer is connected makes this
    immune to pid reuse; where pidfds are missing, the pid is polled.  A pid of 0
    (the peer lives in a pid namespace this process cannot see) cannot be watched.
    Only the exporter watches its receivers (``watch=True``): a receiver that kept a
    pidfd of every exporter it ever reached held one descriptor per dead producer.
    """

    def __init__(self, pid: int, watch: bool = True) -> None:
        self.pid = pid
        self._fd = -1
        if watch and pid > 0 and pid != os.getpid() and hasattr(os, "pidfd_open"):
            try:
                self._fd = os.pidfd_open(pid)
            except OSError:
                self._fd = -1

    @property
    def watchable(self) -> bool:
        return self.pid > 0 and self.pid != os.getpid()

    def wait_gone(self, timeout: float | None = None) -> bool:
        """Block until the peer process has exited; False on timeout."""
        if not self.watchable:
            return True
        if self._fd >= 0:
            p = select.poll()
            p.register(self._fd, select.POLLIN)
            ms = None if timeout is None else int(timeout * 1000)
            return bool(p.poll(ms))
        deadline = None if timeout is None else time.monotonic() + timeout
        while _pid_alive(self.pid):
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


class Conn:
    """One authenticated sharing connection (either end).  Sends are serialised."""

    def __init__(self, mpconn: Any, peer: PeerProcess) -> None:
        self._c = mpconn
        self.peer = peer
        self.lock = threading.Lock()
        self._closing = threading.Lock()  # shutdown/close: one at a time
        self.closed = False

    def send(self, data: bytes, fd: int | None = None, fds: Sequence[int] = ()) -> None:
        """Send one message (and a file descriptor, or ``fds``, right after it) as one
        unit; ``fds`` go in messages of at most ``_wire.STEP_FD_MAX`` descriptors."""
        with self.lock:
            if self.closed:
                raise OSError("sharing connection closed")
            self._c.send_bytes(data)
            try:
                if fd is not None:
                    self._send_fd([fd])
                for i in range(0, len(fds), _wire.STEP_FD_MAX):
                    self._send_fd(fds[i : i + _wire.STEP_FD_MAX])
            except BaseException:
                self._out_of_step()
                raise

    def _out_of_step(self) -> None:
        """A frame said descriptors follow and they could not be sent (send lock held):
        the peer would take the next frame's bytes for them.  Shut the socket (the peer
        sees EOF); not through :meth:`shutdown`, whose lock :meth:`close` takes before
        the send lock."""
        self.closed = True
        s = socket.socket(fileno=self._c.fileno())
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            s.detach()

    def _send_fd(self, fds: Sequence[int]) -> None:
        """The descriptors, through the connection's own socket (send lock held): with
        no duplicate of the socket (multiprocessing's send_handle makes one), a process
        out of descriptors could not, and the frame just sent said they follow."""
        s = socket.socket(fileno=self._c.fileno())
        try:
            s.settimeout(None)  # blocking, as the connection is
            packed = array.array("i", fds).tobytes()
            s.sendmsg([b"\x01"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, packed)])
        finally:
            s.detach()

    def try_send(self, data: bytes) -> bool:
        """Send now if no other thread is sending on this connection; else False."""
        if not self.lock.acquire(blocking=False):
            return False
        try:
            if self.closed:
                return False
            self._c.send_bytes(data)
            return True
        except OSError:
            return False
        finally:
            self.lock.release()

    def recv(self) -> bytes:
        return self._c.recv_bytes()

    def recv_fd(self) -> int:
        """The descriptor sent right after the last message.

        :class:`SharingError` when it was lost because this process has no descriptor
        free (the kernel drops it then, and says so); the connection stays in step.
        Received through the connection's own socket, with no duplicate descriptor: a
        process out of descriptors could not make one, and its next read would then
        take the descriptor's byte for a message.
        """
        return self._recv_fds(1)[0]

    def recv_fds(self, n: int) -> list[int]:
        """The ``n`` descriptors sent right after the last message (as :meth:`recv_fd`;
        all of them are read, and on a loss those received are closed)."""
        out: list[int] = []
        lost: SharingError | None = None
        for i in range(0, n, _wire.STEP_FD_MAX):
            k = min(_wire.STEP_FD_MAX, n - i)
            try:
                got = self._recv_fds(k)
            except SharingError as exc:
                lost = lost or exc
                continue
            if len(got) != k:
                for fd in got:
                    os.close(fd)
                lost = lost or SharingError(f"{k} file descriptors were sent, {len(got)} came")
                continue
            out.extend(got)
        if lost is not None:
            for fd in out:
                os.close(fd)
            raise lost
        return out

    def _recv_fds(self, n: int) -> list[int]:
        s = socket.socket(fileno=self._c.fileno())
        try:
            s.settimeout(None)  # blocking, as the connection is
            msg, anc, flags, _ = s.recvmsg(1, socket.CMSG_SPACE(n * _FD.size), _CLOEXEC)
        finally:
            s.detach()
        fds = [
            fd
            for level, kind, data in anc
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
            for fd in array.array("i", data[: len(data) - len(data) % _FD.size])
        ]
        if not msg and not anc:
            raise EOFError
        if not fds or flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            raise SharingError(
                "a file descriptor sent to this process was lost: it has none free (EMFILE: "
                f"{_fd_limit()}); raise the limit (ulimit -n, or resource.setrlimit("
                "resource.RLIMIT_NOFILE, ...)) or keep fewer files open, then receive again"
            )
        for fd in fds[n:]:
            os.close(fd)
        return fds[:n]

    def shutdown(self) -> None:
        """Shut the socket down: threads blocked on it wake (EOF, EPIPE), the peer
        sees EOF; the descriptor stays open until :meth:`close`."""
        with self._closing:
            self.closed = True
            if self._c.closed:
                return
            try:
                sock = socket.socket(fileno=os.dup(self._c.fileno()))
            except OSError:
                return
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self) -> None:
        """Close this end (by the thread that reads it, or once nothing reads it).

        The socket is shut down first, and the descriptor is closed only once no send
        is in progress: a send that raced with a bare close() could write its frame to
        whatever socket or file reused the descriptor's number meanwhile.
        """
        self.shutdown()
        with self._closing, self.lock:
            try:
                self._c.close()
            except OSError:
                pass

    def forget(self) -> None:
        """In a forked child: drop this process's copy of the descriptor, without
        touching the socket the parent still uses (no shutdown, no lock); its copy of
        the peer's pidfd goes too (nobody in the child waits on it)."""
        self.closed = True
        try:
            self._c.close()
        except OSError:
            pass
        self.peer.close()


def _wrap(
    sock: socket.socket,
    authkey: bytes,
    server: bool,
    timeout: float,
    peer_cred: Callable[[socket.socket], tuple[int, int]] | None = None,
) -> Conn:
    """Authenticate a connected socket both ways (bounded by ``timeout``); a :class:`Conn`.

    ``timeout`` bounds each receive; the listener also shuts a connection down at its
    handshake deadline, whatever the peer sends meanwhile.
    """
    pid, uid = (peer_cred or _peer_cred)(sock)
    if uid != os.getuid():
        raise PermissionError(f"sharing peer runs as uid {uid}, not {os.getuid()}")
    _set_timeouts(sock, timeout)
    c = _mpc.Connection(os.dup(sock.fileno()))
    try:
        if server:
            _mpc.deliver_challenge(c, authkey)
            _mpc.answer_challenge(c, authkey)
        else:
            _mpc.answer_challenge(c, authkey)
            _mpc.deliver_challenge(c, authkey)
        _set_timeouts(sock, 0)
    except BaseException:
        c.close()
        raise
    finally:
        sock.close()
    return Conn(c, PeerProcess(pid, watch=server))


# AF_UNIX paths are at most 107 bytes on Linux (108 with the terminating NUL).
_SUN_PATH_MAX = 107


def _socket_dir() -> str:
    """A fresh 0700 directory whose socket path fits ``sun_path``: under the temporary
    directory (``TMPDIR``) when its path is short enough, else under
    ``XDG_RUNTIME_DIR``, ``/dev/shm`` or ``/tmp``, the first that works."""
    tried = []
    for base in (None, os.environ.get("XDG_RUNTIME_DIR"), "/dev/shm", "/tmp"):
        if base is not None and not os.path.isdir(base):
            continue
        where = tempfile.gettempdir() if base is None else base
        # mkdtemp's names are "cupy_poolmem-" and 8 characters; "/s" follows.
        if len(os.fsencode(os.path.join(where, "cupy_poolmem-xxxxxxxx", "s"))) > _SUN_PATH_MAX:
            tried.append(f"{where} (path too long for a Unix socket)")
            continue
        try:
            return tempfile.mkdtemp(prefix="cupy_poolmem-", dir=base)  # mode 0700
        except OSError as exc:
            tried.append(f"{where} ({exc})")
    raise OSError(
        "cupy_poolmem: no directory for the sharing socket: "
        + "; ".join(tried)
        + "; set TMPDIR to a short, writable directory"
    )


def _remove_dir(path: str, pid: int) -> None:
    """Remove a listener's directory, only in the process that made it (a fork child
    that exits runs its parent's finalizers too)."""
    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)


# Longest an accept thread waits while handshakes are under way before it looks at
# ``closed`` again (a shutdown does not wake a poll of a listening Unix socket).
_CLOSE_SEEN = 0.1


class Listener:
    """The exporter's listening socket; ``on_conn(conn)`` runs in the connection's thread.

    Each accepted connection is authenticated in a thread of its own, within
    ``handshake_timeout`` seconds of its acceptance whatever the peer sends meanwhile
    (the accept thread shuts down a connection past its deadline).  At most
    ``max_handshakes`` connections authenticate at once: more wait in the kernel's
    backlog, not accepted, until a handshake ends or its deadline passes (bounded by
    their own connect timeout), so a burst of receivers is served, not refused.  Those
    that fail or pass their deadline are counted in ``refused`` as their slot frees, as
    are those whose thread could not be started (``thread_factory``,
    ``threading.Thread`` by default); the listener keeps accepting in every case.
    ``peer_cred(sock) -> (pid, uid)``: the kernel's ``SO_PEERCRED`` unless a test says
    otherwise.

    The socket's directory is removed by :meth:`close`, and at the exit of the process
    that made it (``multiprocessing``'s exit finalizers, after the sharing exit wait).
    """

    def __init__(
        self,
        authkey: bytes,
        on_conn: Callable[[Conn], None],
        handshake_timeout: float = 5.0,
        max_handshakes: int = 64,
        thread_factory: Callable[..., threading.Thread] = threading.Thread,
        peer_cred: Callable[[socket.socket], tuple[int, int]] | None = None,
    ) -> None:
        self._dir = _socket_dir()
        self._cleanup = _mp_util.Finalize(
            self, _remove_dir, args=(self._dir, os.getpid()), exitpriority=-200
        )
        try:
            self.address = os.path.join(self._dir, "s")
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self._sock.bind(self.address)
                os.chmod(self.address, 0o600)
                self._sock.listen(128)
            except BaseException:
                self._sock.close()
                raise
        except BaseException:
            self._cleanup()
            raise
        self._authkey, self._on_conn, self._timeout = authkey, on_conn, handshake_timeout
        self._max = max_handshakes
        self._thread = thread_factory
        self._peer_cred = peer_cred
        self._pending: dict[socket.socket, float] = {}  # authenticating -> deadline
        self._plock = threading.Lock()
        self._slot = threading.Condition(self._plock)  # a handshake ended, or close()
        self.closed = False
        self.refused = 0
        threading.Thread(target=self._accept, name="cupy_poolmem-listen", daemon=True).start()

    @property
    def handshakes(self) -> int:
        """Connections authenticating now."""
        return len(self._pending)

    def _accept(self) -> None:
        try:
            self._accept_loop()
        finally:
            with self._plock:  # the only close of the socket while this thread runs
                self._sock.close()

    def _accept_loop(self) -> None:
        while not self.closed:
            wait = self._expire()
            with self._plock:
                if len(self._pending) >= self._max and not self.closed:
                    # Full: new arrivals stay in the backlog until a slot frees.
                    self._slot.wait(wait)
                    continue
            try:
                # Only this thread closes the socket: one closed under a thread about
                # to poll it left it polling whatever reused the number.  close()'s
                # shutdown wakes a blocking accept (EINVAL) but not a poll: a wait
                # with a deadline ahead sees ``closed`` within _CLOSE_SEEN.
                self._sock.settimeout(None if wait is None else min(max(wait, 0.001), _CLOSE_SEEN))
                sock, _ = self._sock.accept()
            except TimeoutError:
                continue  # a deadline passed: _expire at the top
            except OSError:
                if self.closed:
                    return
                time.sleep(0.01)
                continue
            if self.closed:  # accepted as close() ran: nobody serves it
                sock.close()
                return
            with self._plock:  # (a slot is free: only this thread takes one)
                self._pending[sock] = time.monotonic() + self._timeout
            try:
                self._thread(
                    target=self._handshake, args=(sock,), name="cupy_poolmem-peer", daemon=True
                ).start()
            except Exception:  # no thread (resources): refuse this one, keep accepting
                self._done(sock, refused=True)
                sock.close()

    def _expire(self) -> float | None:
        """Shut down the connections past their handshake deadline; seconds until the
        next deadline (None: nobody is authenticating)."""
        now = time.monotonic()
        with self._plock:
            late = [s for s, t in self._pending.items() if t <= now]
            for s in late:
                del self._pending[s]  # the handshake thread sees EOF and ends
                self.refused += 1
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            return min(self._pending.values()) - now if self._pending else None

    def _done(self, sock: socket.socket, refused: bool = False) -> bool:
        """The handshake of ``sock`` ended (``refused``: unserved); False when its
        deadline had shut it down.  A refusal is counted as its slot frees, under the
        lock: ``refused`` never lags the slots, nor loses a count to a racing thread."""
        with self._plock:
            self._slot.notify_all()
            held = self._pending.pop(sock, None) is not None
            if held and refused:
                self.refused += 1
            return held

    def _handshake(self, sock: socket.socket) -> None:
        try:
            conn = _wrap(sock, self._authkey, True, self._timeout, self._peer_cred)
        except Exception:  # silent, slow, foreign or unauthenticated peer: refused
            self._done(sock, refused=True)
            sock.close()
            return
        if not self._done(sock):  # authenticated as its deadline passed: too late
            conn.close()  # (refused by _expire)
            return
        self._on_conn(conn)

    def close(self) -> None:
        """Stop listening: the socket is shut down (the accept thread wakes and closes
        it) and its directory removed."""
        self.closed = True
        try:
            # A connection wakes the accept thread's poll (a shutdown does not); it
            # sees ``closed`` and closes the socket.
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as knock:
                knock.setblocking(False)
                with contextlib.suppress(OSError):  # (a full backlog wakes it anyway)
                    knock.connect(self.address)
            with self._plock:  # (not while the accept thread closes it)
                self._slot.notify_all()
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        finally:
            self._cleanup()


def connect(address: str, authkey: bytes, timeout: float = 10.0) -> Conn:
    """Connect to an exporter's listener and authenticate (OSError when unreachable)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _set_timeouts(sock, timeout)
        sock.connect(address)
    except BaseException:
        sock.close()
        raise
    return _wrap(sock, authkey, False, timeout)


class Sender:
    """One connection's outgoing frames, sent in order by a thread of its own.

    ``post`` never blocks and is safe from ``__del__``.  At most ``limit`` frames wait;
    beyond that a frame is dropped and counted (every frame the protocol posts is one
    whose loss keeps memory held, never frees it early).

    ``post(frame, lazy=True)`` is for frames nobody waits on (a receiver's ``Hit``): the
    thread sends them within ``delay`` seconds, together with whatever else was posted
    by then, so a steady stream of them costs a deque append each instead of a wake-up
    and a system call each.  Any other post (or :meth:`flush`) sends them at once; order
    is kept either way.
    """

    def __init__(self, conn: Conn, name: str, limit: int = 65536, delay: float = 0.002) -> None:
        self.conn = conn
        self.name = name
        self.limit = limit
        self.delay = delay
        self.dropped = 0
        self._q: deque[Any] = deque()
        self._cv = threading.Condition(threading.RLock())
        self._thread: threading.Thread | None = None
        self._busy = False
        self._woken = False  # the thread was told about the frames queued now
        self._urgent = False  # a frame (or a flush) that must not wait for ``delay``
        self.dead = False

    def idle(self) -> bool:
        """Nothing queued and nothing being sent: a frame sent now keeps the order."""
        return not self._q and not self._busy

    def post(self, frame: Any, lazy: bool = False) -> None:
        if self.dead:
            return
        if len(self._q) >= self.limit:
            self.dropped += 1
            if self.dropped == 1:
                warnings.warn(
                    f"cupy_poolmem: the sharing peer behind {self.name} is not reading; "
                    "protocol messages are dropped (memory stays held until it exits)",
                    ResourceWarning,
                    stacklevel=2,
                )
            return
        self._q.append(frame)
        # Appended before the flag is read; the thread clears the flag before it looks
        # at the queue a last time: a frame is never left queued with nobody woken.
        if lazy and self._woken:
            return
        with self._cv:
            self._woken = True
            if not lazy:
                self._urgent = True
            if self._thread is None:
                if sys.is_finalizing():  # a new thread would never run (3.11 waits forever)
                    return  # the peer sees the connection close at this process's exit
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cv.notify_all()  # the thread, not only a flush() waiting meanwhile

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self.dead:
                    if self._q:
                        break
                    self._woken = False
                    if self._q:
                        break
                    self._busy = False
                    self._cv.notify_all()
                    self._cv.wait()
                if self.dead:  # closed: the thread ends with its connection
                    self._busy = False
                    self._cv.notify_all()
                    return
                self._busy = True
                if not self._urgent and self.delay > 0:
                    self._cv.wait(self.delay)  # gather lazy frames; an urgent post wakes it
                self._urgent = False
            frames = []
            while self._q:
                frames.append(self._q.popleft())
            if not frames:
                continue
            try:
                self.conn.send(_wire.encode_batch(frames))
            except (OSError, ValueError):
                self.dead = True  # the other process exited: nothing to tell it any more
                self._q.clear()
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
                return

    def close(self) -> None:
        """The connection is gone: drop what is queued and end the thread."""
        with self._cv:
            self.dead = True
            self._q.clear()
            self._cv.notify_all()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every posted frame was handed to the socket; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            if self._q:  # lazy frames go now
                self._urgent = True
                self._cv.notify_all()
            while (self._q or self._busy) and not self.dead:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True
