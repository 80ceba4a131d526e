"""Same-host transfers of CuPy chunks between Dask workers through pool IPC.

A chunk on an IPC-enabled pool travels to a worker of the same host as a small
header (its block's sharing descriptor); the receiver maps the block (a view on the
same GPU, one device copy on another) or, failing that, asks the sender again
through Dask's own serialization.  How it hooks into distributed (the handshake
identity, the wrapped ``"dask"`` serializer, the refetch, the meetings) is in
docs/dask.rst.

Parts: ``_protocol`` (names and version), ``_config``, ``_identity`` (the handshake
entry), ``_secret`` (the per-host secret file), ``_decide`` (IPC or why not),
``_header``, ``_process`` (the process's state, its one owner), ``_sender`` and
``_receiver`` (the serializer wrappers, the refetch), ``_warm`` (meeting the peers),
``_steps`` (the GPU and sharing steps, loaded by ``install``), ``_install``.  An
integration leaf: the core never imports it.
"""

from __future__ import annotations

from ._config import CONFIG_DEFAULTS, CONFIG_KEY, TransferConfig
from ._decide import REASONS, decide, peer_reason
from ._header import make_header, parse_header
from ._identity import boot_id, check_identity, local_identity
from ._install import install, uninstall
from ._process import Counters, counters
from ._protocol import HANDSHAKE_KEY, HEADER_KEY, PROTOCOL, REFETCH_OP, WARM_OP
from ._receiver import deserialize
from ._sender import serialize

__all__ = [
    "CONFIG_DEFAULTS",
    "CONFIG_KEY",
    "HANDSHAKE_KEY",
    "HEADER_KEY",
    "PROTOCOL",
    "REASONS",
    "REFETCH_OP",
    "WARM_OP",
    "Counters",
    "TransferConfig",
    "boot_id",
    "check_identity",
    "counters",
    "decide",
    "deserialize",
    "install",
    "local_identity",
    "make_header",
    "parse_header",
    "peer_reason",
    "serialize",
    "uninstall",
]
