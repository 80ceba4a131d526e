"""This process's transfer state and its counters: their one owner.

One worker per process (as dask-cuda runs them), so the state is the process's: the
installed config and identity, the worker, the serializers that were wrapped, the
:class:`Counters` and the GPU steps (``gpu``).  :data:`PROCESS` owns the current
:class:`TransferState`; the other parts read it with :func:`state` at call time, so a
test that gives ``PROCESS`` another state gives it to all of them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ._config import TransferConfig

log = logging.getLogger(__name__)

__all__ = ["Counters", "counters", "TransferState", "ProcessState", "PROCESS", "state"]


class Counters:
    """How this worker's CuPy chunks went: IPC or Dask's own path (thread-safe).

    Besides the counts: ``timings`` (seconds spent per step, ``{step: {"n",
    "total_s", "max_s"}}``) and ``warm`` (how each meeting with a same-host peer
    ended, ``{outcome: count}``).
    """

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
            self._timings: dict[str, list[float]] = {}
            self._warm: dict[str, int] = {}

    def timed(self, step: str, seconds: float) -> None:
        """Add one ``step`` that took ``seconds``."""
        with self._lock:
            t = self._timings.setdefault(step, [0, 0.0, 0.0])
            t[0] += 1
            t[1] += seconds
            t[2] = max(t[2], seconds)

    def warmed(self, outcome: str) -> None:
        """Count one meeting with a peer that ended with ``outcome``."""
        with self._lock:
            self._warm[outcome] = self._warm.get(outcome, 0) + 1

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._n[name] += n

    def fell_back(self, reason: str) -> None:
        log.debug("dask: a chunk takes Dask's own serialization (%s)", reason)
        with self._lock:
            self._fallback[reason] = self._fallback.get(reason, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._n)
            out["fallback"] = dict(self._fallback)
            out["timings"] = {
                k: {"n": int(n), "total_s": tot, "max_s": mx}
                for k, (n, tot, mx) in self._timings.items()
            }
            out["warm"] = dict(self._warm)
        return out


class TransferState:
    """What the transfer path of this process knows: set by ``install``, read by the
    serializers, the refetch and the meetings.  ``gpu``: the GPU and sharing steps
    (``_steps.GpuSteps``, made by ``install`` unless a test gave one of its own)."""

    def __init__(self, gpu: Any = None) -> None:
        self.gpu: Any = gpu
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
        self.device_uuid: str | None = None  # the worker's GPU's UUID
        self.warned: set[str] = set()  # warnings given once per process
        self.tasks: set[Any] = set()  # meetings with peers under way (asyncio tasks)
        self.met: set[str] = set()  # peers met (their addresses)


class ProcessState:
    """The owner of this process's :class:`TransferState` (``current``)."""

    def __init__(self) -> None:
        self.current = TransferState()


PROCESS = ProcessState()


def state() -> TransferState:
    """This process's transfer state."""
    return PROCESS.current


def counters() -> dict[str, Any]:
    """This process's transfer counters (see :func:`cupy_poolmem.dask.transfer_stats`),
    with ``installed``, ``ipc`` and ``met_peers`` (the addresses of the workers whose
    blocks this worker mapped at a meeting: its receives from them make no first
    contact)."""
    st = state()
    out = st.counters.to_dict()
    out["installed"] = st.identity is not None
    out["ipc"] = bool(st.config is not None and st.config.ipc)
    out["met_peers"] = sorted(st.met)
    return out
