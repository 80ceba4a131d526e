"""What a worker says about itself in its handshake, and how a peer's entry is checked.

A sender takes the IPC path only for a recipient on the same boot, the same user and
the same sharing key (the multiprocessing authkey of the process family, or the key
of a per-host secret: ``auth`` says which), of the same :data:`PROTOCOL`, that can
see the chunk's GPU (:func:`~._decide.decide` compares the two entries).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from multiprocessing import current_process
from typing import Any

from .. import __version__
from ._protocol import PROTOCOL

__all__ = ["boot_id", "check_identity", "local_identity"]

_FAMILY_SALT = b"cupy_poolmem.dask identity 1"


def boot_id() -> str:
    """This host's boot id (``/proc/sys/kernel/random/boot_id``); ``""`` if unknown.

    Two processes share GPU memory only on the same running kernel: the same boot
    id.  Containers on one host share it too.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _family(key: bytes | None = None) -> str:
    """A fingerprint of the sharing key (default: the multiprocessing authkey); the key
    itself never travels."""
    if key is None:
        key = bytes(current_process().authkey)
    return hmac.new(key, _FAMILY_SALT, hashlib.sha256).hexdigest()[:32]


#: ``auth`` of an identity: the key is the process family's, or a per-host secret's.
AUTH_PROCESS = "process"
AUTH_SECRET = "secret"


def local_identity(
    devices: list[str] | tuple[str, ...], authkey: bytes | None = None
) -> dict[str, Any]:
    """The handshake entry of this process: protocol, host, user, sharing key, GPUs.

    ``devices``: the UUIDs of the GPUs this process can see (a sender only uses the
    IPC path for a chunk whose GPU the receiver can see).  ``authkey``: the key its
    sharing sockets authenticate with when it comes from a per-host secret (default:
    the multiprocessing authkey).

    Examples
    --------
    >>> ident = local_identity(["GPU-0"])
    >>> sorted(ident)
    ['auth', 'boot', 'devices', 'family', 'pid', 'proto', 'uid', 'version']
    >>> ident["auth"], local_identity(["GPU-0"], authkey=b"k" * 32)["auth"]
    ('process', 'secret')
    """
    return {
        "proto": PROTOCOL,
        "version": __version__,
        "boot": boot_id(),
        "uid": os.getuid(),
        "family": _family(authkey),
        "auth": AUTH_SECRET if authkey is not None else AUTH_PROCESS,
        "devices": list(devices),
        "pid": os.getpid(),
    }


_IDENTITY_TYPES: dict[str, Any] = {
    "proto": int,
    "version": str,
    "boot": str,
    "uid": int,
    "family": str,
    "devices": (list, tuple),
    "pid": int,
}


def check_identity(entry: Any) -> dict[str, Any] | None:
    """A peer's handshake entry if it is well formed, else None (the peer falls back).

    Examples
    --------
    >>> check_identity({"proto": 1}) is None
    True
    """
    if not isinstance(entry, dict):
        return None
    for name, typ in _IDENTITY_TYPES.items():
        v = entry.get(name)
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            return None
    if not all(isinstance(u, str) for u in entry["devices"]):
        return None
    if entry.get("auth", AUTH_PROCESS) not in (AUTH_PROCESS, AUTH_SECRET):
        return None
    return entry
