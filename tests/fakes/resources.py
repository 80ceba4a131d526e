"""cuda.core's DeviceMemoryResource (a CUDA pool) played on the host: ``PlainMR`` (a
handle, its options, ``close``), ``PeerMR`` (peer grants that may fail, every change
logged), ``GrantsMR`` (peer grants kept in a table shared by the pools)."""

from __future__ import annotations

from types import SimpleNamespace


class PlainMR(SimpleNamespace):
    """A cuda.core DeviceMemoryResource: a handle and its options."""

    def close(self):
        self.closed = True


class PeerMR:
    """cuda.core DeviceMemoryResource's peer_accessible_by, without a driver."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.peers: tuple = ()
        self.events: list = []
        self.fail = fail

    @property
    def peer_accessible_by(self):
        return tuple(SimpleNamespace(device_id=d) for d in self.peers)

    @peer_accessible_by.setter
    def peer_accessible_by(self, devices):
        if self.fail is not None:
            raise self.fail
        self.peers = tuple(devices)
        self.events.append(("set", self.peers))

    def close(self) -> None:
        self.events.append(("close",))


class GrantsMR(SimpleNamespace):
    """A cuda.core DeviceMemoryResource whose peer grants live in ``grants``."""

    def close(self):
        self.closed = True

    @property
    def peer_accessible_by(self):
        return self.grants[self.handle]

    @peer_accessible_by.setter
    def peer_accessible_by(self, peers):
        self.grants[self.handle] = tuple(peers)
        self.log.append(("set", self.handle, tuple(peers)))
