"""PinnedPool: a stream-ordered pool of page-locked host memory."""

from __future__ import annotations

import os
import threading
from collections import deque
from typing import Any

import cuda.core as cc
import cupy

from .. import _streams
from .._device import check_device, grant_access, nearest_numa_node, require_gpu
from .._errors import InvalidOptionError, OptionTypeError
from .._poolstats import PoolStats
from .._runtime import hp as _hp
from .._sizes import parse_bytes
from . import _driver
from ._base import Pool
from ._options import check_bool


def _host_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


class PinnedPool(Pool):
    """A stream-ordered pool of page-locked host memory on the GPU's nearest NUMA node.

    Use it as CuPy's pinned allocator (``cupyx.empty_pinned``, asynchronous copies).
    Every visible GPU (or those in ``devices``) is granted access to the pool, so
    copies run at full DMA speed.  (A host pool without device access copies through
    a staging path at a quarter of the bandwidth or less: the cause of slow copies
    from a default cuda.core ``PinnedMemoryResource``.)

    Parameters
    ----------
    numa_node : int, optional
        Host NUMA node; ``None`` picks the node nearest the current GPU (its
        ``host_numa_id``), or lets the OS place memory when the GPU reports none.
    max_size : int or str, optional
        Hard cap in bytes or as a string ("8GB").
    release_threshold : int or str, optional
        As for :class:`DevicePool`.
    devices : list of int, optional
        GPUs that get access; default all visible GPUs.
    ipc : bool
        Make the pool exportable to other processes.

    Notes
    -----
    A freed pinned block is not returned to the pool until the work enqueued on its
    stream (and on the stream current at free time) has finished: the host may write
    into a block as soon as ``malloc`` returns it, so a pending asynchronous copy
    must never see its buffer reused.

    Examples
    --------
    >>> import cupy, cupyx, cupy_poolmem
    >>> pinned = cupy_poolmem.PinnedPool()  # doctest: +SKIP
    >>> cupy.cuda.set_pinned_memory_allocator(pinned.malloc)  # doctest: +SKIP
    >>> h = cupyx.empty_pinned((1024,), dtype="f4")  # doctest: +SKIP
    """

    _kind_name = "pinned"

    def __init__(
        self,
        numa_node: int | None = None,
        max_size: int | str | None = None,
        release_threshold: int | str | None = None,
        devices: list[int] | None = None,
        ipc: bool = False,
    ) -> None:
        n = require_gpu("PinnedPool")
        ipc = check_bool(ipc, "ipc")
        if numa_node is not None and (
            isinstance(numa_node, bool) or not isinstance(numa_node, int)
        ):
            raise OptionTypeError(f"numa_node must be an int or None; got {numa_node!r}")
        if numa_node is not None and numa_node < 0:
            raise InvalidOptionError(
                f"numa_node={numa_node} must be >= 0 (or None for the node nearest the current GPU)"
            )
        devs = (
            list(range(n)) if devices is None else [check_device(d, "devices[]") for d in devices]
        )
        max_b = parse_bytes(max_size, name="max_size", allow_none=True) or 0
        parse_bytes(release_threshold, name="release_threshold", allow_none=True)
        node = nearest_numa_node() if numa_node is None else numa_node
        cur = cupy.cuda.runtime.getDevice()
        with cupy.cuda.Device(cur):
            try:
                mr = cc.PinnedMemoryResource(
                    cc.PinnedMemoryResourceOptions(
                        ipc_enabled=ipc, max_size=max_b, numa_id=None if node < 0 else node
                    )
                )
            except Exception as exc:
                raise _driver.wrap(exc, "creating a pinned pool") from exc
            grant_access(int(mr.handle), devs)
        self.ipc = ipc
        self.numa_node = node
        self.devices = devs
        self._setup(mr, -1, _hp.KIND_PINNED, release_threshold, max_b)
        self._capacity = _host_memory_bytes()
        self.release_hook = self._defer_free

    def _setup(self, *args: Any, **kwargs: Any) -> None:
        # Frees deferred until their streams' work is done (see _defer_free).  The lock
        # is reentrant: a garbage collection can start under it, and a pinned block
        # freed there defers its free under it again (same thread).
        self._pending: deque = deque()
        self._pending_lock = threading.RLock()
        super()._setup(*args, **kwargs)

    def _describe(self) -> str:
        return f"PinnedPool(numa_node={self.numa_node})"

    def _defer_free(self, ptr: int, size: int, stream: Any) -> bool:
        """Hold a freed block until its stream's work is done (see class Notes).

        A block whose stream is capturing a graph waits for the capture to end
        first: an event recorded there would be part of the graph.
        """
        if _streams.capture_status(int(stream.ptr)) != _streams.CAPTURE_NONE:
            with self._lock:
                self._capture_held.append(("pinned", ptr, size, int(stream.ptr), stream))
                self.n_capture_held = len(self._capture_held)
            return True
        events = []
        # CuPy's null stream names no device (-1): the current one is the block's.
        dev = stream.device_id if stream.device_id >= 0 else cupy.cuda.runtime.getDevice()
        with cupy.cuda.Device(dev):
            ev = cupy.cuda.Event(disable_timing=True)
            ev.record(stream)
            events.append(ev)
            cur = cupy.cuda.get_current_stream()
            if (
                cur.ptr != stream.ptr
                and cur.device_id in (stream.device_id, -1)
                and _streams.capture_status(int(cur.ptr)) == _streams.CAPTURE_NONE
            ):
                ev2 = cupy.cuda.Event(disable_timing=True)
                ev2.record(cur)
                events.append(ev2)
        with self._pending_lock:
            self._pending.append((events, ptr, stream))
        try:
            self._release_done()
        except Exception:  # e.g. an event query refused during a global-mode capture
            pass
        return True

    def _release_done(self, wait: bool = False) -> int:
        """Return finished deferred blocks to the pool; with ``wait``, all of them."""
        done = 0
        while True:
            # Nothing is allocated under the lock, and the first entry is taken only if
            # it is still first: a collection while its events are asked (a nested
            # deferral may release it first) or another thread cannot make this free
            # an entry twice, or one whose events are not done.
            with self._pending_lock:
                if not self._pending:
                    return done
                entry = self._pending[0]
            events, ptr, stream = entry
            if not wait and not all(e.done for e in events):
                return done
            with self._pending_lock:
                if not self._pending or self._pending[0] is not entry:
                    continue  # released meanwhile
                self._pending.popleft()
            for e in events:
                e.synchronize()
            self._free_now(ptr, stream.ptr, stream)
            done += 1

    def _reclaim(self) -> None:
        self._release_done(wait=True)
        super()._reclaim()

    def _take_pending(self) -> list[int]:
        # Blocks still waiting for their streams go to the retirer, which frees them
        # after its sync (never lost, never freed before their streams' work).
        lock = getattr(self, "_pending_lock", None)  # None: a collector cleared __dict__
        if lock is None:
            return []
        with lock:  # swapped, then read outside: a collection here cannot change it
            pending, self._pending = self._pending, deque()
        return [ptr for _, ptr, _ in pending]

    def _retire_now(self, leftovers: Any = (), before_destroy: Any = None) -> None:
        super()._retire_now([*leftovers, *self._take_pending()], before_destroy)

    def _finalize_leftovers(self) -> list[int]:
        left = super()._finalize_leftovers()  # "pinned" held frees: no deferral now
        return [*left, *self._take_pending()]

    def trim(self, keep: int | str = 0, *, sync: bool = True) -> int:
        """Release unused reserved host memory, keeping at least ``keep`` bytes.

        Blocks whose stream-ordered frees have completed are released first.

        Parameters
        ----------
        keep : int or str, default 0
            Reserved bytes to keep (``"1GiB"`` works too).
        sync : bool, default True
            Wait for frees still pending on streams first, so their memory is released.

        Returns
        -------
        int
            The bytes released.

        Examples
        --------
        >>> released = cupy_poolmem.PinnedPool().trim()  # doctest: +SKIP
        """
        self._release_done(wait=sync)
        return super().trim(keep, sync=sync)

    def stats(self) -> PoolStats:
        """Return a :class:`~cupy_poolmem.PoolStats` snapshot of this pool.

        Returns
        -------
        PoolStats
            Bytes used and reserved now and at their peaks, and the counts.

        Examples
        --------
        >>> cupy_poolmem.PinnedPool().stats().used_bytes  # doctest: +SKIP
        0
        """
        self._release_done()
        return super().stats()
