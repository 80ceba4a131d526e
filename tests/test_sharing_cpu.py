"""Every lifecycle of the sharing protocol on a CPU: real sockets, a fake driver."""

from __future__ import annotations

import threading
import time

from cupy_poolmem._sharing import _transport


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
