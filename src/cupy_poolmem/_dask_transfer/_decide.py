"""The decision: the IPC path, or the reason a chunk takes Dask's own path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._config import TransferConfig
from ._identity import check_identity
from ._protocol import HANDSHAKE_KEY, REFETCH_CONTEXT

__all__ = ["REASONS", "decide", "peer_reason"]

#: Why a chunk took Dask's own path (the counters' ``fallback`` keys).
REASONS = (
    "disabled",  # this worker's config says ipc: false (or the path is not installed)
    "no-recipient",  # no comm context: spilling, a local serialize() call
    "peer-without-plugin",  # the recipient's handshake has no entry: client, scheduler...
    "bad-peer-identity",  # an entry that does not follow the schema
    "protocol-mismatch",  # another cupy_poolmem protocol version
    "other-host",  # another boot id
    "other-user",  # another uid
    "other-family",  # another multiprocessing authkey: its sharing socket would refuse us
    "no-secret",  # one of the two has a per-host secret, the other not
    "other-secret",  # both have a per-host secret, not the same one
    "allocator-replaced",  # CuPy's allocator here is no longer the plugin's (RMM set later...)
    "small",  # below min-bytes
    "not-ipc-memory",  # not on an IPC-enabled cupy_poolmem pool (or captured, closed...)
    "device-not-visible",  # the recipient cannot see the chunk's GPU
    "refetch",  # the sender's answer to a receiver that could not map a block
    "export-failed",  # the sharing exporter raised: Dask's path instead
)


def peer_reason(me: dict[str, Any], peer: dict[str, Any] | None) -> str:
    """``"ipc"`` when the two identities can share pool IPC, else the reason they cannot.

    Examples
    --------
    >>> from cupy_poolmem._dask_transfer import local_identity
    >>> me = local_identity(["GPU-0"])
    >>> peer_reason(me, dict(me, uid=me["uid"] + 1))
    'other-user'
    >>> peer_reason(me, local_identity(["GPU-0"], authkey=b"k" * 32))
    'no-secret'
    """
    if peer is None:
        return "bad-peer-identity"
    if peer["proto"] != me["proto"]:
        return "protocol-mismatch"
    if not me["boot"] or peer["boot"] != me["boot"]:
        return "other-host"
    if peer["uid"] != me["uid"]:
        return "other-user"
    if peer["family"] != me["family"]:
        mine, theirs = me.get("auth", "process"), peer.get("auth", "process")
        if mine != theirs:
            return "no-secret"
        return "other-secret" if mine == "secret" else "other-family"
    return "ipc"


def decide(
    me: dict[str, Any] | None,
    config: TransferConfig | None,
    context: Any,
    nbytes: int,
    facts: Callable[[], tuple[bool, str]],
) -> str:
    """``"ipc"``, or the reason (one of :data:`REASONS`) a chunk takes Dask's own path.

    ``facts()`` -> ``(shareable, device_uuid)`` of the chunk; called last, only when
    everything else allows the IPC path.

    Examples
    --------
    >>> from cupy_poolmem._dask_transfer import local_identity
    >>> me = local_identity(["GPU-0"])
    >>> decide(me, TransferConfig(), {"recipient": {"cupy-poolmem": me}}, 2**20,
    ...        lambda: (True, "GPU-0"))
    'ipc'
    >>> decide(me, TransferConfig(), {"recipient": {}}, 2**20, lambda: (True, "GPU-0"))
    'peer-without-plugin'
    """
    if me is None or config is None or not config.ipc:
        return "disabled"
    if context is None or not isinstance(context, dict):
        return "no-recipient"
    if context.get(REFETCH_CONTEXT):
        return "refetch"
    recipient = context.get("recipient")
    if not isinstance(recipient, dict):
        return "no-recipient"
    if HANDSHAKE_KEY not in recipient:
        return "peer-without-plugin"
    peer = check_identity(recipient[HANDSHAKE_KEY])
    reason = peer_reason(me, peer)
    if reason != "ipc":
        return reason
    assert peer is not None
    if nbytes < max(config.min_bytes, 1):
        return "small"
    shareable, dev_uuid = facts()
    if not shareable:
        return "not-ipc-memory"
    if dev_uuid not in peer["devices"]:
        return "device-not-visible"
    return "ipc"
