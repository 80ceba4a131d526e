"""Meeting same-host peers when a worker starts: the once-only costs paid early.

Once registered, a worker calls each same-host peer's :data:`~._protocol.WARM_OP`
handler; both sides export a small and a large block, map the other's and let them
go, so the connection and the imported pools are made before the first chunk.  How
each meeting ended and its seconds go to the counters (docs/dask.rst, "Warm-up and
where the time goes").
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from . import _process
from ._decide import peer_reason
from ._header import parse_header
from ._identity import check_identity

__all__ = ["meet", "meet_peers", "serve", "warm_sizes"]

logger = logging.getLogger("cupy_poolmem.dask")

MiB = 1 << 20
#: Seconds a worker waits to be registered before it gives meeting its peers up.
REGISTER_TIMEOUT = 120.0
#: Seconds one meeting may take.
MEET_TIMEOUT = 60.0


def warm_sizes(small_pool: int, min_bytes: int) -> list[int]:
    """Block sizes that reach each CUDA pool chunks of ``min_bytes`` and up come from.

    ``small_pool``: the device pool's small-block limit (0: one CUDA pool).

    Examples
    --------
    >>> warm_sizes(8 << 20, 1 << 20)
    [1048576, 9437184]
    >>> warm_sizes(0, 1 << 20)
    [2097152]
    """
    lo = max(int(min_bytes), 1)
    sizes = [lo] if small_pool >= lo else []
    sizes.append(max(int(small_pool), lo) + MiB)
    return sizes


def _receive_blocks(headers: list[Any]) -> int:
    """Map each block of ``headers`` and let it go; how many were received.

    Their steps are timed as ``warm.<kind>``, apart from the chunks' ``receive.<kind>``.
    """
    n = 0
    for h in headers:
        d, _ = parse_header(h)
        arr, _how = _process.state().gpu.receive(d, step="warm")
        del arr
        n += 1
    return n


def _visible(peer: dict[str, Any]) -> bool:
    """The peer sees this worker's GPU (it can map this worker's blocks)."""
    st = _process.state()
    uuid = st.device_uuid
    return uuid is None or uuid in peer.get("devices", ())


async def serve(
    identity: Any = None, address: Any = None, reciprocate: bool = True
) -> dict[str, Any]:
    """The :data:`~._protocol.WARM_OP` handler: blocks to map for a peer that meets us."""
    st = _process.state()
    if st.identity is None or st.worker is None:
        return {"status": "skip", "reason": "disabled"}
    peer = check_identity(identity)
    reason = peer_reason(st.identity, peer)
    if reason == "ipc" and peer is not None and not _visible(peer):
        reason = "device-not-visible"
    if reason != "ipc":
        st.counters.warmed("served-" + reason)
        return {"status": "skip", "reason": reason}
    loop = asyncio.get_running_loop()
    headers = await loop.run_in_executor(None, st.gpu.export_blocks)
    if reciprocate and isinstance(address, str) and "://" in address:
        task = asyncio.ensure_future(meet(st.worker, address, reciprocate=False))
        st.tasks.add(task)
        task.add_done_callback(st.tasks.discard)
    st.counters.warmed("served")
    return {"status": "OK", "identity": st.identity, "headers": headers}


async def meet(worker: Any, address: str, reciprocate: bool = True) -> str:
    """Meet the worker at ``address``: map its blocks (and it ours); the outcome."""
    st = _process.state()
    if st.identity is None:
        return "disabled"
    t0 = time.perf_counter()
    try:
        reply = await asyncio.wait_for(
            worker.rpc(address).cupy_poolmem_warm(
                identity=st.identity, address=st.address, reciprocate=reciprocate
            ),
            MEET_TIMEOUT,
        )
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - no handler there (no plugin), gone...
        logger.debug("cupy_poolmem: could not meet %s (%s: %s)", address, type(exc).__name__, exc)
        outcome = "peer-without-plugin" if "handler" in str(exc).lower() else "unreachable"
        st.counters.warmed(outcome)
        return outcome
    if reply is None:  # distributed answers None for an op it has no handler for
        st.counters.warmed("peer-without-plugin")
        return "peer-without-plugin"
    if not isinstance(reply, dict) or reply.get("status") != "OK":
        outcome = str(reply.get("reason", "refused")) if isinstance(reply, dict) else "refused"
        st.counters.warmed(outcome)
        return outcome
    peer = check_identity(reply.get("identity"))
    outcome = peer_reason(st.identity, peer)
    if outcome == "ipc":
        headers = reply.get("headers")
        try:
            loop = asyncio.get_running_loop()
            # msgpack may bring the list back as a tuple
            await loop.run_in_executor(
                None, _receive_blocks, list(headers) if isinstance(headers, (list, tuple)) else []
            )
            outcome = "met"
            st.met.add(address)
        except Exception as exc:  # noqa: BLE001 - the chunks will try (and refetch) again
            logger.info(
                "cupy_poolmem: meeting %s failed (%s: %s); its chunks connect on first use",
                address,
                type(exc).__name__,
                exc,
            )
            outcome = "failed"
    st.counters.warmed(outcome)
    st.counters.timed("warm", time.perf_counter() - t0)
    return outcome


def _host(address: str) -> str:
    from distributed.comm.addressing import get_address_host

    return get_address_host(address)


async def meet_peers(worker: Any, poll: float = 0.05) -> list[str]:
    """Once ``worker`` is registered, meet every worker of its host; their outcomes."""
    from distributed.core import Status

    deadline = time.monotonic() + REGISTER_TIMEOUT
    while getattr(worker, "status", None) != Status.running:
        if getattr(worker, "status", None) in (Status.closing, Status.closed, Status.failed):
            return []
        if time.monotonic() > deadline:
            return []
        await asyncio.sleep(poll)
    info = await worker.scheduler.identity()
    me = worker.address
    host = _host(me)
    peers = [
        a
        for a, w in (info.get("workers") or {}).items()
        if a != me and isinstance(w, dict) and w.get("host") == host
    ]
    if not peers:
        return []
    out = await asyncio.gather(*(meet(worker, a) for a in peers), return_exceptions=True)
    return [o if isinstance(o, str) else f"error: {o!r}" for o in out]
