"""Installation on a worker: the handshake entry, the refetch and meeting handlers,
the serializers, the per-host secret's key, and the meeting with same-host peers.

:func:`install` and :func:`uninstall` are idempotent; :mod:`cupy_poolmem.dask`'s
plugin calls them at worker setup and teardown.
"""

from __future__ import annotations

import asyncio
import logging
from multiprocessing import current_process
from typing import Any

from . import _process, _receiver, _sender, _warm
from ._config import CONFIG_KEY, TransferConfig
from ._identity import local_identity
from ._protocol import HANDSHAKE_KEY, REFETCH_OP, WARM_OP
from ._secret import authkey_from_secret, load_secret

__all__ = ["install", "uninstall"]

logger = logging.getLogger("cupy_poolmem.dask")


def _register() -> None:
    """Wrap the ``"dask"`` family's ``cupy.ndarray`` entries (idempotent)."""
    import cupy
    import distributed.protocol.cupy  # noqa: F401 - registers the originals
    from distributed.protocol.serialize import dask_deserialize, dask_serialize

    st = _process.state()
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

    st = _process.state()
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


def _sharing_key(cfg: TransferConfig, sharing: Any) -> bytes | None:
    """Set the sharing context's key from the per-host secret, if configured; the
    context's key when it is not the process family's (None when it is)."""
    if cfg.secret is not None:
        secret = load_secret(cfg.secret)
        assert secret is not None
        sharing.use_authkey(authkey_from_secret(secret))
    key = bytes(sharing.authkey)
    return None if key == bytes(current_process().authkey) else key


def _start_meeting(worker: Any) -> None:
    """Meet the same-host peers in the background (when a loop runs in this thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return  # no event loop here (a test's fake worker): nothing to meet
    st = _process.state()
    task = asyncio.ensure_future(_warm.meet_peers(worker))
    st.tasks.add(task)
    task.add_done_callback(st.tasks.discard)


def install(
    worker: Any,
    device: int,
    config: TransferConfig | None = None,
    devices: list[str] | None = None,
    sharing: Any = None,
) -> bool:
    """Install the IPC path on ``worker`` (GPU ``device``); False when config says no.

    Adds the identity to the worker's outgoing handshakes, the refetch and meeting
    handlers to its handlers, wraps the CuPy serializers, and (``warm``) starts
    meeting the same-host peers.  Idempotent.  ``devices``: the UUIDs of the GPUs
    this process sees (default: asked from CUDA).  ``sharing``: the sharing context
    whose key a configured ``secret`` sets (default: the process's).

    Raises
    ------
    InvalidOptionError
        The configured ``secret`` file is not private to this user (see
        ``._secret``); nothing is installed then.
    """
    cfg = config if config is not None else TransferConfig.from_dask_config()
    if not cfg.ipc:
        uninstall(worker)
        logger.info("cupy_poolmem: same-host IPC transfers off (%s.ipc is false)", CONFIG_KEY)
        return False
    st = _process.state()
    if st.gpu is None:
        # Loaded late: the GPU steps import the sharing package, which hooks into the
        # pools and pickling; a client or scheduler importing this package must not.
        from ._steps import GpuSteps

        st.gpu = GpuSteps(st)
    if sharing is None:
        sharing = st.gpu.sharing()
    key = _sharing_key(cfg, sharing)
    if devices is None:
        devices = st.gpu.device_uuids()
    ident = local_identity(devices, authkey=key)
    with st.lock:
        _register()
        st.config, st.identity, st.device = cfg, ident, device
        st.device_uuid = devices[device] if 0 <= device < len(devices) else None
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
            handlers[REFETCH_OP] = _sender.serve_refetch
            handlers[WARM_OP] = _warm.serve
    if cfg.warm:
        _start_meeting(worker)
    logger.info(
        "cupy_poolmem: same-host CuPy transfers through pool IPC on %s (min-bytes %d, "
        "sharing key: %s)",
        st.address,
        cfg.min_bytes,
        "per-host secret" if key is not None else "process family",
    )
    return True


def _write_counters(directory: str) -> None:
    """This worker's counters as ``DIR/counters-<pid>.json`` (failures only logged)."""
    import json
    import os

    try:
        os.makedirs(directory, exist_ok=True)
        out = dict(_process.counters(), address=_process.state().address, pid=os.getpid())
        path = os.path.join(directory, f"counters-{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump(out, f)
    except (OSError, TypeError, ValueError) as exc:
        logger.warning(
            "cupy_poolmem: could not write the transfer counters to %s: %s", directory, exc
        )


def uninstall(worker: Any = None) -> None:
    """Stop sending through IPC: restore the serializer and the handshake.  Idempotent.

    With ``counters-dir`` configured, the counters are written there first.
    """
    st = _process.state()
    cfg = st.config
    if st.identity is not None and cfg is not None and cfg.counters_dir:
        _write_counters(cfg.counters_dir)
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
            if isinstance(handlers, dict) and handlers.get(REFETCH_OP) is _sender.serve_refetch:
                del handlers[REFETCH_OP]
            if isinstance(handlers, dict) and handlers.get(WARM_OP) is _warm.serve:
                del handlers[WARM_OP]
        st.worker = None
        tasks, st.tasks = list(st.tasks), set()
    for t in tasks:
        t.cancel()
