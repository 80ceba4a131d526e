"""Installation on a worker: the handshake entry, the refetch handler, the serializers.

:func:`install` and :func:`uninstall` are idempotent; :mod:`cupy_poolmem.dask`'s
plugin calls them at worker setup and teardown.
"""

from __future__ import annotations

import logging
from typing import Any

from . import _process, _receiver, _sender
from ._config import CONFIG_KEY, TransferConfig
from ._identity import local_identity
from ._protocol import HANDSHAKE_KEY, REFETCH_OP

__all__ = ["install", "uninstall"]

logger = logging.getLogger("cupy_poolmem.dask")


def _register() -> None:
    """Wrap the ``"dask"`` family's ``cupy.ndarray`` entries (idempotent)."""
    import cupy
    import distributed.protocol.cupy  # noqa: F401 - registers the originals
    from distributed.protocol.serialize import dask_deserialize, dask_serialize

    st = _process._state
    cur = dask_serialize.dispatch(cupy.ndarray)
    if cur is not _sender.serialize:
        st.orig_serialize = cur
        dask_serialize.register(cupy.ndarray, _sender.serialize)
    cur = dask_deserialize.dispatch(cupy.ndarray)
    if cur is not _receiver.deserialize:
        st.orig_deserialize = cur
        dask_deserialize.register(cupy.ndarray, _receiver.deserialize)


def _unregister() -> None:
    """Give the ``cupy.ndarray`` serializer back.  The deserializer stays: a peer may
    still send IPC headers over a comm made while this worker advertised the path
    (it delegates everything else to the original)."""
    import cupy
    from distributed.protocol.serialize import dask_serialize

    st = _process._state
    if st.orig_serialize is not None and dask_serialize.dispatch(cupy.ndarray) is _sender.serialize:
        dask_serialize.register(cupy.ndarray, st.orig_serialize)


def _handshake_dicts(worker: Any) -> list[dict[str, Any]]:
    """The connection-argument dicts of ``worker`` (its own and its rpc pool's)."""
    out: list[dict[str, Any]] = []
    for obj in (worker, getattr(worker, "rpc", None)):
        ca = getattr(obj, "connection_args", None)
        if isinstance(ca, dict) and all(ca is not o for o in out):
            out.append(ca)
    return out


def install(
    worker: Any,
    device: int,
    config: TransferConfig | None = None,
    devices: list[str] | None = None,
) -> bool:
    """Install the IPC path on ``worker`` (GPU ``device``); False when config says no.

    Adds the identity to the worker's outgoing handshakes, the refetch handler to
    its handlers, and wraps the CuPy serializers.  Idempotent.  ``devices``: the
    UUIDs of the GPUs this process sees (default: asked from CUDA).
    """
    cfg = config if config is not None else TransferConfig.from_dask_config()
    if not cfg.ipc:
        uninstall(worker)
        logger.info("cupy_poolmem: same-host IPC transfers off (%s.ipc is false)", CONFIG_KEY)
        return False
    if devices is None:
        from .._device import device_count, device_uuid

        devices = [device_uuid(i) for i in range(device_count())]
    ident = local_identity(devices)
    st = _process._state
    with st.lock:
        _register()
        st.config, st.identity, st.device = cfg, ident, device
        st.address = getattr(worker, "address", None)
        st.worker = worker
        for ca in _handshake_dicts(worker):
            ho = dict(ca.get("handshake_overrides") or {})
            ho[HANDSHAKE_KEY] = ident
            ca["handshake_overrides"] = ho
        st.connection_args = {
            k: v for k, v in (getattr(worker, "connection_args", None) or {}).items()
        }
        handlers = getattr(worker, "handlers", None)
        if isinstance(handlers, dict):
            handlers[REFETCH_OP] = _sender._serve_refetch
    logger.info(
        "cupy_poolmem: same-host CuPy transfers through pool IPC on %s (min-bytes %d)",
        st.address,
        cfg.min_bytes,
    )
    return True


def uninstall(worker: Any = None) -> None:
    """Stop sending through IPC: restore the serializer and the handshake.  Idempotent."""
    st = _process._state
    with st.lock:
        if st.identity is not None:
            _unregister()
        st.identity = None
        st.config = None
        w = worker if worker is not None else st.worker
        if w is not None:
            for ca in _handshake_dicts(w):
                ho = ca.get("handshake_overrides")
                if isinstance(ho, dict) and HANDSHAKE_KEY in ho:
                    ho = {k: v for k, v in ho.items() if k != HANDSHAKE_KEY}
                    if ho:
                        ca["handshake_overrides"] = ho
                    else:
                        ca.pop("handshake_overrides", None)
            handlers = getattr(w, "handlers", None)
            if isinstance(handlers, dict) and handlers.get(REFETCH_OP) is _sender._serve_refetch:
                del handlers[REFETCH_OP]
        st.worker = None
