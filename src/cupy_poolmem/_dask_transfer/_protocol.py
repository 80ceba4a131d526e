"""The names and the version both ends of a same-host transfer agree on.

The handshake entry (:mod:`._identity`), the chunk's sub-header (:mod:`._header`) and
the refetch round trip (:mod:`._receiver` asks, :mod:`._sender` answers) are read by
peers: a peer of another :data:`PROTOCOL` falls back to Dask's own serialization.
"""

from __future__ import annotations

__all__ = ["HANDSHAKE_KEY", "HEADER_KEY", "PROTOCOL", "REFETCH_CONTEXT", "REFETCH_OP", "WARM_OP"]

#: Version of the handshake entry and of the header; peers of another version fall back.
PROTOCOL = 1
#: The key of this path's entry in a comm handshake.
HANDSHAKE_KEY = "cupy-poolmem"
#: The key that marks a sub-header as an IPC descriptor (absent: Dask's own format).
HEADER_KEY = "cupy-poolmem-ipc"
#: The handler a sending worker serves for receivers that could not map a block.
REFETCH_OP = "cupy_poolmem_refetch"
#: The serialization context key of a refetch answer (it never takes the IPC path again).
REFETCH_CONTEXT = HANDSHAKE_KEY + "-refetch"
#: The handler a worker serves for same-host peers that meet it when they start.
WARM_OP = "cupy_poolmem_warm"
