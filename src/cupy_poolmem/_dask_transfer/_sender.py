"""The sending side: ``dask_serialize`` of ``cupy.ndarray``, and the refetch it serves.

:func:`serialize` sends a descriptor where :func:`~._decide.decide` allows it and
hands everything else to the original serializer.  A receiver that could not map a
block asks again (``REFETCH_OP``): :func:`serve_refetch` answers with the same
chunk through Dask's own serialization.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from . import _process
from ._decide import decide
from ._header import make_header, parse_header
from ._protocol import REFETCH_CONTEXT

__all__ = ["serialize"]

logger = logging.getLogger("cupy_poolmem.dask")


def _not_ipc_memory_reason() -> str:
    """``"allocator-replaced"`` (warned once) when that explains the chunk's memory."""
    st = _process.state()
    try:
        other = st.gpu.allocator_replaced()
    except Exception:  # noqa: BLE001 - a diagnosis only
        other = None
    if other is None:
        return "not-ipc-memory"
    if "allocator-replaced" not in st.warned:
        st.warned.add("allocator-replaced")
        logger.warning(
            "cupy_poolmem: CuPy's allocator on worker %s is %s, not cupy_poolmem's pool: "
            "something replaced it after the plugin ran (dask-cuda's RMM set-up with "
            "rmm_allocator_external_lib_list=['cupy'], or a dask-cuda benchmark without "
            "--disable-rmm). Chunks take Dask's own path; leave CuPy's allocator to the "
            "plugin",
            st.address,
            other,
        )
    return "allocator-replaced"


def serialize(x: Any, context: Any = None) -> tuple[dict, list]:
    """``dask_serialize`` of ``cupy.ndarray`` while the path is installed."""
    st = _process.state()
    orig = st.orig_serialize
    assert orig is not None, "cupy_poolmem's dask serializer ran without being installed"
    reason = decide(st.identity, st.config, context, int(x.nbytes), lambda: st.gpu.facts(x))
    if reason == "ipc":
        t0 = time.perf_counter()
        try:
            y = st.gpu.contiguous(x)
            if y is not x and not st.gpu.facts(y)[0]:
                reason = "not-ipc-memory"
            else:
                d = st.gpu.export(y)
        except Exception as exc:  # the sender's own failure: Dask's path instead
            logger.warning("cupy_poolmem: pool IPC export failed (%s: %s)", type(exc).__name__, exc)
            reason = "export-failed"
        st.counters.timed("export", time.perf_counter() - t0)
    if reason == "not-ipc-memory":
        reason = _not_ipc_memory_reason()
    if reason != "ipc":
        st.counters.fell_back(reason)
        return orig(x)
    st.counters.add("sent_ipc")
    st.counters.add("sent_ipc_bytes", int(x.nbytes))
    header = make_header(tuple(d), st.address or "")
    header["sent"] = time.monotonic()  # the receiver's "transit" timing (same boot)
    return header, []


async def serve_refetch(header: Any = None) -> dict[str, Any]:
    """The sender's handler: the chunk of ``header`` through Dask's own serialization."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, refetch_reply, header)


def refetch_reply(header: Any) -> dict[str, Any]:
    from distributed.protocol.serialize import Serialized
    from distributed.protocol.serialize import serialize as dserialize

    d, _ = parse_header(header)
    arr = _process.state().gpu.local_array(d)
    if arr is None:
        return {"status": "gone", "message": "the block is no longer held by this worker"}
    head, frames = dserialize(
        arr, serializers=("dask",), on_error="raise", context={REFETCH_CONTEXT: True}
    )
    _process.state().counters.add("refetch_served")
    return {"status": "OK", "data": Serialized(head, frames)}
