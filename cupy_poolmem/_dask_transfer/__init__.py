"""Same-host transfers of CuPy chunks between Dask workers through pool IPC.

When a worker sends a CuPy array that lives on an IPC-enabled cupy_poolmem pool to
another worker of the same host, only a small header travels over the worker's
comm: the sharing :class:`~cupy_poolmem._sharing._wire.Descriptor` of the block
(its ticket registered with this process's exporter, as for any shared array).  The
receiving worker maps the block through the sharing importer: on the same GPU the
received chunk is a zero-copy view; on another GPU it is copied once, device to
device, into the receiver's own pool, and the mapping is let go at once.  The
sharing lifetime protocol (tickets, leases, limbo, the exit wait) keeps the block
alive until the receiver is done with it.

How it hooks into distributed (no patched copy of it):

* **Serializer.**  The ``"dask"`` serialization family's ``cupy.ndarray`` entry
  (``dask_serialize`` / ``dask_deserialize``, registered by
  ``distributed.protocol.cupy``) is wrapped: the original is captured and everything
  that does not take the IPC path is handed to it unchanged.  That family is what a
  worker's ``get_data`` uses over TCP (workers have no ``serializers`` of their own,
  so ``("dask", "pickle")``).  A new serialization family was the alternative; it
  would only be used where every worker, client and scheduler lists it in its
  ``serializers``, which a plugin registered after start-up cannot arrange.
* **Handshake.**  ``dask_serialize`` functions that take a ``context`` get the
  comm's ``context`` (``distributed.comm.tcp.TCP.write``), whose ``"recipient"`` is
  the handshake the peer sent when the comm was made.  A worker with this path
  installed adds an identity entry to its outgoing handshakes
  (``worker.connection_args["handshake_overrides"]``): a worker fetching data
  connects to the worker that has it, so the sender sees the receiver's identity.
  The sender takes the IPC path only for a recipient on the same boot (same
  ``/proc/sys/kernel/random/boot_id``), same user, same process family (the
  sharing connections authenticate with the multiprocessing authkey), same protocol
  version, that can see the chunk's GPU; anything else - the client, the scheduler,
  another host, a worker without the plugin, spilling to disk (no context) - gets
  Dask's own serialization.  Comms made before the path was installed carry no
  identity and keep falling back until they close.
* **Failures.**  A receiver that cannot map a block asks the sender again, through
  a handler the path adds to the sending worker (``cupy_poolmem_refetch``), for the
  same chunk through Dask's own serialization: the sender holds its data until the
  receiver has answered ``get_data``, so the block is still there.  Only when that
  fails too is :class:`~cupy_poolmem.TransferError` (a :class:`ConnectionError`)
  raised, which Dask handles as an unreachable sender.

One worker per process (as dask-cuda runs them): the state here is the process's.
This module is an integration leaf: the core never imports it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from .._errors import SharingError, TransferError
from ._config import CONFIG_DEFAULTS, CONFIG_KEY, TransferConfig
from ._decide import REASONS, decide
from ._header import make_header, parse_header
from ._identity import boot_id, check_identity, local_identity
from ._protocol import HANDSHAKE_KEY, HEADER_KEY, PROTOCOL, REFETCH_CONTEXT, REFETCH_OP

__all__ = [
    "CONFIG_DEFAULTS",
    "CONFIG_KEY",
    "HANDSHAKE_KEY",
    "HEADER_KEY",
    "PROTOCOL",
    "REASONS",
    "REFETCH_OP",
    "TransferConfig",
    "boot_id",
    "check_identity",
    "counters",
    "decide",
    "install",
    "local_identity",
    "make_header",
    "parse_header",
    "uninstall",
]

logger = logging.getLogger("cupy_poolmem.dask")


# -- counters --------------------------------------------------------------------------------
class Counters:
    """How this worker's CuPy chunks went: IPC or Dask's own path (thread-safe)."""

    _NAMES = (
        "sent_ipc",
        "sent_ipc_bytes",
        "received_view",
        "received_copy",
        "received_bytes",
        "refetched",
        "refetch_served",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._n = dict.fromkeys(self._NAMES, 0)
            self._fallback: dict[str, int] = {}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._n[name] += n

    def fell_back(self, reason: str) -> None:
        with self._lock:
            self._fallback[reason] = self._fallback.get(reason, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._n)
            out["fallback"] = dict(self._fallback)
        return out


# -- the process's state ------------------------------------------------------------------
class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.config: TransferConfig | None = None
        self.identity: dict[str, Any] | None = None
        self.address: str | None = None  # this worker's address (the refetch handler's)
        self.device = 0  # the worker's GPU (CuPy's current device at install)
        self.connection_args: dict[str, Any] = {}
        self.worker: Any = None
        self.orig_serialize: Callable | None = None
        self.orig_deserialize: Callable | None = None
        self.counters = Counters()


_state = _State()


def counters() -> dict[str, Any]:
    """This process's transfer counters (see :func:`cupy_poolmem.dask.transfer_stats`)."""
    out = _state.counters.to_dict()
    out["installed"] = _state.identity is not None
    out["ipc"] = bool(_state.config is not None and _state.config.ipc)
    return out


# -- sending ---------------------------------------------------------------------------------
def _facts(x: Any) -> tuple[bool, str]:
    """``(shareable, device_uuid)`` of a CuPy array's memory."""
    from .._device import device_uuid
    from .._sharing._reducers import _owner, _shareable

    owner = _owner(x.data.mem)
    return owner is not None and _shareable(owner), device_uuid(x.device.id)


def _export(x: Any) -> tuple:
    """The sharing descriptor of a new message for ``x`` (contiguous), ticket registered."""
    from .._sharing import context
    from .._sharing._reducers import _owner, describe

    owner = _owner(x.data.mem)
    offset = x.data.ptr - owner.ptr
    return describe(context(), owner, "cupy", offset, x.shape, x.strides, x.dtype.str)


def _contiguous(x: Any) -> Any:
    """``x``, or a C-contiguous copy on its GPU (from the worker's pool)."""
    if x.flags.c_contiguous or x.flags.f_contiguous:
        return x
    import cupy

    with cupy.cuda.Device(x.device.id):
        return cupy.ascontiguousarray(x)


def serialize(x: Any, context: Any = None) -> tuple[dict, list]:
    """``dask_serialize`` of ``cupy.ndarray`` while the path is installed."""
    st = _state
    orig = st.orig_serialize
    assert orig is not None, "cupy_poolmem's dask serializer ran without being installed"
    reason = decide(st.identity, st.config, context, int(x.nbytes), lambda: _facts(x))
    if reason == "ipc":
        try:
            y = _contiguous(x)
            if y is not x and not _facts(y)[0]:
                reason = "not-ipc-memory"
            else:
                d = _export(y)
        except Exception as exc:  # the sender's own failure: Dask's path instead
            logger.warning("cupy_poolmem: pool IPC export failed (%s: %s)", type(exc).__name__, exc)
            reason = "export-failed"
    if reason != "ipc":
        st.counters.fell_back(reason)
        return orig(x)
    st.counters.add("sent_ipc")
    st.counters.add("sent_ipc_bytes", int(x.nbytes))
    return make_header(tuple(d), st.address or ""), []


# -- receiving ----------------------------------------------------------------------------------
def _worker_device() -> Any:
    """A context manager making the worker's GPU current (CuPy's ``Device``)."""
    import cupy

    return cupy.cuda.Device(_state.device)


def _receive(d: Any) -> tuple[Any, str]:
    """Map the block of ``d``: ``(array, "view" | "copy")`` on this worker's GPU."""
    import cupy

    from .._sharing import context
    from .._sharing._reducers import array_on, receive

    owner, dev = receive(context(), d)
    view = array_on(owner, d, dev)
    mine = _state.device
    if dev == mine:
        return view, "view"
    try:
        with _worker_device():
            order = "F" if view.flags.f_contiguous and not view.flags.c_contiguous else "C"
            out = cupy.empty(view.shape, view.dtype, order=order)
            stream = cupy.cuda.get_current_stream()
            # One device-to-device copy; CuPy enables peer access between the two GPUs
            # where they allow it, and the imported pool was granted to this GPU.
            out.data.copy_from_device_async(view.data, view.nbytes, stream)
            stream.synchronize()  # done before the mapping goes, ready on every stream
    finally:
        del view, owner  # the mapping is let go now (unmapped, lease returned)
    return out, "copy"


def deserialize(header: Any, frames: list) -> Any:
    """``dask_deserialize`` of ``cupy.ndarray``: the IPC header, else the original."""
    st = _state
    if not (isinstance(header, dict) and HEADER_KEY in header):
        if st.orig_deserialize is None:
            from distributed.protocol.cupy import dask_deserialize_cupy_ndarray

            return dask_deserialize_cupy_ndarray(header, frames)
        return st.orig_deserialize(header, frames)
    d, sender = parse_header(header)
    try:
        arr, how = _receive(d)
    except Exception as exc:
        logger.warning(
            "cupy_poolmem: could not map a chunk from %s (%s: %s); fetching it again "
            "through Dask's serialization",
            sender,
            type(exc).__name__,
            exc,
        )
        arr = _refetch(sender, header, exc)
        st.counters.add("refetched")
        return arr
    st.counters.add("received_" + how)
    st.counters.add("received_bytes", int(arr.nbytes))
    return arr


def _refetch(sender: str, header: dict, cause: BaseException) -> Any:
    """Ask ``sender`` for the chunk of ``header`` through Dask's own serialization.

    Runs in a thread with its own event loop: this one may be the worker's, blocked
    in the deserialization that called us.
    """
    from distributed.comm import connect
    from distributed.protocol.serialize import Serialized, merge_and_deserialize

    timeout = _state.config.refetch_timeout if _state.config is not None else 120.0
    args = dict(_state.connection_args)
    box: dict[str, Any] = {}

    async def go() -> Any:
        comm = await connect(sender, timeout=timeout, deserialize=False, **args)
        try:
            await comm.write({"op": REFETCH_OP, "header": header, "reply": True})
            return await comm.read()
        finally:
            await comm.close()

    def run() -> None:
        try:
            box["reply"] = asyncio.run(asyncio.wait_for(go(), timeout))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    t = threading.Thread(target=run, name="cupy_poolmem-refetch", daemon=True)
    t.start()
    t.join(timeout + 5.0)
    reply = box.get("reply")
    if not isinstance(reply, dict) or reply.get("status") != "OK":
        why = box.get("error") or (reply.get("message") if isinstance(reply, dict) else reply)
        raise TransferError(
            f"a chunk from {sender} could not be mapped ({type(cause).__name__}: {cause}) "
            f"nor fetched again through Dask's serialization ({why!r:.200})"
        ) from cause
    data = reply.get("data")
    if not isinstance(data, Serialized):
        raise TransferError(f"{sender} answered a refetch with {type(data).__name__}")
    from distributed.protocol.compression import decompress

    frames = data.frames
    if "compression" in data.header:
        frames = decompress(data.header, frames)
    with _worker_device():
        return merge_and_deserialize(data.header, frames)


async def _serve_refetch(header: Any = None) -> dict[str, Any]:
    """The sender's handler: the chunk of ``header`` through Dask's own serialization."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, _refetch_reply, header)


def _refetch_reply(header: Any) -> dict[str, Any]:
    from distributed.protocol.serialize import Serialized
    from distributed.protocol.serialize import serialize as dserialize

    d, _ = parse_header(header)
    arr = _local_array(d)
    if arr is None:
        return {"status": "gone", "message": "the block is no longer held by this worker"}
    head, frames = dserialize(
        arr, serializers=("dask",), on_error="raise", context={REFETCH_CONTEXT: True}
    )
    _state.counters.add("refetch_served")
    return {"status": "OK", "data": Serialized(head, frames)}


def _local_array(d: Any) -> Any:
    """The array ``d`` describes, read in the process that sent it (None if gone)."""
    from .._sharing import context
    from .._sharing._reducers import array_on, rebuild

    try:
        return rebuild(d)  # the ticket is live (or was claimed): the sharing round trip
    except SharingError:
        pass
    ctx = context()
    if ctx.exporter_address() != d.address:
        return None
    hold = ctx.exporter.hold_live(d.export_id, d.export_data, d.life)
    if hold is None:
        return None
    return array_on(hold, d, hold.rec.dev)


# -- installation --------------------------------------------------------------------------------
def _register() -> None:
    """Wrap the ``"dask"`` family's ``cupy.ndarray`` entries (idempotent)."""
    import cupy
    import distributed.protocol.cupy  # noqa: F401 - registers the originals
    from distributed.protocol.serialize import dask_deserialize, dask_serialize

    st = _state
    cur = dask_serialize.dispatch(cupy.ndarray)
    if cur is not serialize:
        st.orig_serialize = cur
        dask_serialize.register(cupy.ndarray, serialize)
    cur = dask_deserialize.dispatch(cupy.ndarray)
    if cur is not deserialize:
        st.orig_deserialize = cur
        dask_deserialize.register(cupy.ndarray, deserialize)


def _unregister() -> None:
    """Give the ``cupy.ndarray`` serializer back.  The deserializer stays: a peer may
    still send IPC headers over a comm made while this worker advertised the path
    (it delegates everything else to the original)."""
    import cupy
    from distributed.protocol.serialize import dask_serialize

    st = _state
    if st.orig_serialize is not None and dask_serialize.dispatch(cupy.ndarray) is serialize:
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
    with _state.lock:
        _register()
        _state.config, _state.identity, _state.device = cfg, ident, device
        _state.address = getattr(worker, "address", None)
        _state.worker = worker
        for ca in _handshake_dicts(worker):
            ho = dict(ca.get("handshake_overrides") or {})
            ho[HANDSHAKE_KEY] = ident
            ca["handshake_overrides"] = ho
        _state.connection_args = {
            k: v for k, v in (getattr(worker, "connection_args", None) or {}).items()
        }
        handlers = getattr(worker, "handlers", None)
        if isinstance(handlers, dict):
            handlers[REFETCH_OP] = _serve_refetch
    logger.info(
        "cupy_poolmem: same-host CuPy transfers through pool IPC on %s (min-bytes %d)",
        _state.address,
        cfg.min_bytes,
    )
    return True


def uninstall(worker: Any = None) -> None:
    """Stop sending through IPC: restore the serializer and the handshake.  Idempotent."""
    with _state.lock:
        if _state.identity is not None:
            _unregister()
        _state.identity = None
        _state.config = None
        w = worker if worker is not None else _state.worker
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
            if isinstance(handlers, dict) and handlers.get(REFETCH_OP) is _serve_refetch:
                del handlers[REFETCH_OP]
        _state.worker = None
