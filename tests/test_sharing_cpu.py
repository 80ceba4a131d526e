"""Every lifecycle of the sharing protocol on a CPU: real sockets, a fake driver."""

from __future__ import annotations

import threading
import time

from cupy_poolmem._sharing import _transport, _wire


def _threads(prefix):
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


def _wait(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.002)
    return bool(cond())


# -- the transport on its own ----------------------------------------------------------------------
def test_closing_the_listener_ends_its_accept_thread():
    before = set(_threads("cupy_poolmem-listen"))
    lst = _transport.Listener(b"family key", lambda conn: None)
    new = lambda: [t for t in _threads("cupy_poolmem-listen") if t not in before]  # noqa: E731
    assert _wait(new)
    lst.close()  # a thread blocked in accept() kept the socket listening, forever
    assert _wait(lambda: not new(), 2.0), new()


def test_a_sender_thread_ends_when_its_connection_closes():
    class Conn:
        def __init__(self):
            self.sent = []

        def send(self, data, fd=None):
            self.sent.append(data)

    before = set(_threads("cupy_poolmem-test-sender"))
    s = _transport.Sender(Conn(), "cupy_poolmem-test-sender")
    s.post(_wire.Evict(1))
    assert s.flush(5.0) and s.conn.sent == [_wire.encode(_wire.Evict(1))]
    new = lambda: [t for t in _threads("cupy_poolmem-test-sender") if t not in before]  # noqa: E731
    assert new()
    s.close()  # one idle thread per dead peer stayed forever
    assert _wait(lambda: not new(), 2.0)
    s.post(_wire.Evict(2))  # posting to a closed sender is a no-op
    assert not new() and len(s.conn.sent) == 1
