"""This process's connection to one exporter: requests, replies and its reader thread."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._errors import SharingError
from . import _wire
from ._mapping import GONE
from ._transport import Conn, Sender
from ._warn import warn_kept

if TYPE_CHECKING:
    from ._importer import Importer

__all__ = ["Client"]


class Client:
    """This process's connection to one exporter; a reader thread takes its frames."""

    def __init__(self, importer: Importer, address: str, conn: Conn) -> None:
        self.importer, self.address, self.conn = importer, address, conn
        self.sender = Sender(conn, "cupy_poolmem-to-exporter")
        self.closed = False
        self.events: dict[bytes, Any] = {}  # the exporter's IPC events, opened here
        self.retired: list[Any] = []  # out of ``events``, closed once nothing uses them
        self.keys: set[tuple[str, bytes]] = set()  # mappings of its blocks
        self.by_export: dict[int, tuple[str, bytes]] = {}
        self.busy = 0  # receives using it (and its events) now
        self._seq = 0
        self._lock = threading.Lock()
        self._waiters: dict[int, list[Any]] = {}
        # seq -> frames that give back what a reply granted after its asker gave up
        self._late: dict[int, tuple[Any, ...]] = {}
        threading.Thread(target=self._read, name="cupy_poolmem-from-exporter", daemon=True).start()

    def request(
        self, make: Callable[[int], Any], timeout: float, give_back: tuple[Any, ...] = ()
    ) -> tuple[Any, Any]:
        """Send a frame that expects a reply (``make(seq)``); wait for the reply:
        ``(reply, fd)``, ``fd`` the descriptor that came with it (a :class:`~._wire.Reply`)
        or the list of them (a :class:`~._wire.StepReply`), or None.

        ``give_back``: the frames that undo what an OK reply grants, sent if that reply
        arrives after this call gave up waiting (a lease nobody maps is returned).
        """
        done = threading.Event()
        with self._lock:
            if self.closed:
                raise SharingError(GONE)
            self._seq = self._seq % 0xFFFFFFFF + 1  # the frame's u32, never 0
            seq = self._seq
            slot: list[Any] = [done, None, None, None]  # event, reply, fd, fd lost
            self._waiters[seq] = slot
        try:
            # In order after the frames posted before it: a claim must not overtake an
            # Idle that said the mapping is unused (P12).
            self._send_in_order(make(seq))
        except OSError as exc:
            with self._lock:
                self._waiters.pop(seq, None)
            raise SharingError(f"{GONE} ({exc})") from None
        if not done.wait(timeout):
            with self._lock:
                late = self._waiters.pop(seq, None) is not None
                if late and not self.closed:
                    self._late[seq] = give_back
            if late or not done.wait(timeout):  # else the reply is being handed over
                raise SharingError(
                    f"the process that owns this array did not answer within {timeout} s"
                )
        if slot[1] is None:
            raise SharingError(GONE)
        if slot[3] is not None:  # granted, but its descriptor was lost: undo the grant
            if slot[1].status == _wire.OK:
                for frame in give_back:
                    self.sender.post(frame)
            raise SharingError(str(slot[3])) from None
        return slot[1], slot[2]

    def send_now(self, frame: Any) -> None:
        """Send at once when nothing is queued and the connection is free (no thread
        hand-off), else queue it behind what is queued."""
        if not (self.sender.idle() and self.conn.try_send(_wire.encode(frame))):
            self.sender.post(frame)

    def _send_in_order(self, frame: Any) -> None:
        """:meth:`send_now` for a frame whose reply is awaited: :class:`OSError` when
        the connection is gone (a queued frame's loss shows as the connection closing)."""
        if self.sender.idle() and self.conn.try_send(_wire.encode(frame)):
            return
        if self.sender.dead or self.conn.closed:
            raise OSError("sharing connection closed")
        self.sender.post(frame)

    def _read(self) -> None:
        try:
            while True:
                for f in _wire.decode(self.conn.recv()):
                    if isinstance(f, (_wire.Reply, _wire.StepReply)):
                        fd: Any = None
                        lost = None
                        try:
                            if isinstance(f, _wire.StepReply):  # each step's, in order
                                fd = self.conn.recv_fds(sum(1 for s in f.steps if s[3]))
                            elif f.has_fd:
                                fd = self.conn.recv_fd()
                        except RuntimeError as exc:  # lost (EMFILE): the exporter lives
                            lost = exc
                        with self._lock:
                            slot = self._waiters.pop(f.seq, None)
                            late = self._late.pop(f.seq, ()) if slot is None else ()
                        if slot is None:  # the asker timed out: undo what was granted
                            for one in fd if isinstance(fd, list) else [fd]:
                                if one is not None:
                                    os.close(one)
                            if f.status == _wire.OK:
                                for frame in late:
                                    self.sender.post(frame)
                            continue
                        slot[1], slot[2], slot[3] = f, fd, lost
                        slot[0].set()
                    elif isinstance(f, _wire.Release):
                        try:
                            self.importer.release(self, f.export_id, f.life)
                        except Exception as exc:  # keep reading: the block stays held
                            warn_kept("telling the exporter a mapping is idle", exc)
                    elif isinstance(f, _wire.Evict):
                        try:
                            self.importer.evict(self, f.export_id)
                        except Exception as exc:  # keep reading: the lease stays held
                            warn_kept("evicting a mapping the exporter asked back", exc)
        except (EOFError, OSError, _wire.ProtocolError):
            pass
        finally:
            with self._lock:
                self.closed = True
                waiters, self._waiters = list(self._waiters.values()), {}
                self._late.clear()
            for slot in waiters:
                slot[0].set()
            self.conn.close()
            self.sender.close()
            self.importer.exporter_gone(self)
