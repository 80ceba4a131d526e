"""The receiving side: ``dask_deserialize`` of ``cupy.ndarray``, and the refetch it asks.

:func:`deserialize` maps the block of an IPC header on this worker's GPU (a view on
the same GPU, one device-to-device copy on another) and hands everything else to the
original deserializer.  A block it cannot map is asked again from the sender
(:func:`refetch`) through Dask's own serialization.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from .._errors import TransferError
from . import _process
from ._header import parse_header
from ._protocol import HEADER_KEY, REFETCH_OP

__all__ = ["deserialize"]

logger = logging.getLogger("cupy_poolmem.dask")


def first_steps(ctx: Any, d: Any, steps: bool = False) -> str:
    """What receiving ``d`` will cost before its data is there (a guess made just before):

    ``"first-contact"`` (no connection to its exporter yet: connect, authenticate,
    import the pool, claim), ``"pool-import"`` (connected; its pool not imported),
    ``"claim"`` (a block not mapped here: one claim round trip), ``"mapped"`` (mapped
    already: no round trip when its life allows) or ``"own"`` (back in its exporter).
    ``steps``: ``d`` is a block of a mapped or expandable pool, which travels as the
    steps under it: no pool to import, its claim's reply carries them.
    """
    exp = ctx._exporter
    if exp is not None and d.address == exp.own_address:
        return "own"
    imp = ctx._importer
    if imp is None or d.address not in imp.clients:
        return "first-contact"
    if (d.pool_uuid, d.export_data) in imp.maps:  # (a step-backed block has no pool)
        return "mapped"
    if not steps and d.pool_uuid not in imp.pools:
        return "pool-import"
    return "claim"


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def deserialize(header: Any, frames: list) -> Any:
    """``dask_deserialize`` of ``cupy.ndarray``: the IPC header, else the original."""
    st = _process.state()
    if not (isinstance(header, dict) and HEADER_KEY in header):
        if st.orig_deserialize is None:
            from distributed.protocol.cupy import dask_deserialize_cupy_ndarray

            return dask_deserialize_cupy_ndarray(header, frames)
        return st.orig_deserialize(header, frames)
    d, sender = parse_header(header)
    sent = header.get("sent")
    if isinstance(sent, float):  # the sender's monotonic clock: one boot, one clock
        st.counters.timed("transit", max(time.monotonic() - sent, 0.0))
    t0 = time.perf_counter()
    try:
        arr, how = st.gpu.receive(d)
    except Exception as exc:
        logger.warning(
            "cupy_poolmem: could not map a chunk from %s (%s: %s); fetching it again "
            "through Dask's serialization",
            sender,
            type(exc).__name__,
            exc,
        )
        arr = st.gpu.refetch(sender, header, exc)
        st.counters.add("refetched")
        return arr
    st.counters.add("received_" + how)
    st.counters.add("received_bytes", int(arr.nbytes))
    where = "event-loop" if _on_event_loop() else "thread"
    st.counters.timed(f"deserialize.{where}", time.perf_counter() - t0)
    return arr


def refetch(sender: str, header: dict, cause: BaseException) -> Any:
    """Ask ``sender`` for the chunk of ``header`` through Dask's own serialization.

    Runs in a thread with its own event loop: this one may be the worker's, blocked
    in the deserialization that called us.
    """
    from distributed.comm import connect
    from distributed.protocol.serialize import Serialized, merge_and_deserialize

    st = _process.state()
    timeout = st.config.refetch_timeout if st.config is not None else 120.0
    args = dict(st.connection_args)
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
    with _process.state().gpu.worker_device():
        return merge_and_deserialize(data.header, frames)
