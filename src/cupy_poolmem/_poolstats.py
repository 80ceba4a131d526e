"""The :class:`PoolStats` snapshot returned by ``pool.stats()``."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["PoolStats"]


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of one pool's counters.

    Used bytes and counts come from the pool's own hot path; reserved bytes from the
    CUDA driver's pool attributes.  ``used_bytes`` drops when the last array on a
    block goes away; ``reserved_bytes`` drops when the pool releases memory to the system
    (see ``release_threshold`` and :meth:`DevicePool.trim <Pool.trim>`).

    Attributes
    ----------
    kind : str
        ``"device"``, ``"pinned"`` or ``"managed"``.
    device : int
        Device ordinal (``-1`` for a pinned pool).
    used_bytes, peak_used_bytes : int
        Bytes handed out by ``malloc`` to live allocations, now and at the high-water
        mark (counted in the hot path, exact requested sizes).
    reserved_bytes, peak_reserved_bytes : int
        Bytes the pool holds from the system, now and at the high-water mark.
    n_allocs, n_frees : int
        Allocations and frees made through ``malloc`` since the pool was created.
    held_for_sharing_bytes : int
        Bytes freed here but kept alive because another process still uses them.
    max_size : int
        Hard cap of the pool (``0``: no cap beyond the device).
    release_threshold : int
        Bytes the pool keeps reserved across synchronisations.
    cached_bytes : int
        Freed blocks held in the pool's reuse cache (part of ``reserved_bytes``).
    graph_bytes : int
        Live bytes of graph-owned memory this pool handed out during CUDA graph
        captures (part of ``used_bytes``; the memory is the driver's graph memory,
        not part of ``reserved_bytes``).

    Examples
    --------
    >>> st = PoolStats(kind="device", device=0, used_bytes=8000, peak_used_bytes=8000,
    ...                reserved_bytes=2**21, peak_reserved_bytes=2**21, n_allocs=3, n_frees=1)
    >>> st.live_allocs, st.to_dict()["reserved_bytes"]
    (2, 2097152)

    From a pool, on a GPU:

    >>> import cupy, cupy_poolmem  # doctest: +SKIP
    >>> pool = cupy_poolmem.DevicePool()  # doctest: +SKIP
    >>> with cupy_poolmem.using(pool):  # doctest: +SKIP
    ...     x = cupy.ones(1000)
    >>> pool.stats().used_bytes >= 8000  # doctest: +SKIP
    True
    """

    kind: str
    device: int
    used_bytes: int
    peak_used_bytes: int
    reserved_bytes: int
    peak_reserved_bytes: int
    n_allocs: int
    n_frees: int
    held_for_sharing_bytes: int = 0
    max_size: int = 0
    release_threshold: int = 0
    cached_bytes: int = 0
    graph_bytes: int = 0

    @property
    def live_allocs(self) -> int:
        """Allocations not yet freed (``n_allocs - n_frees``).

        Examples
        --------
        >>> s = PoolStats("device", 0, 1024, 1024, 2 << 20, 2 << 20, n_allocs=3, n_frees=1)
        >>> s.live_allocs
        2
        """
        return self.n_allocs - self.n_frees

    def to_dict(self) -> dict:
        """Plain ``dict`` of the fields (for JSON, ``client.run``).

        Returns
        -------
        dict
            Every field by name, and ``live_allocs``.

        Examples
        --------
        >>> s = PoolStats("device", 0, 1024, 1024, 2 << 20, 2 << 20, n_allocs=3, n_frees=1)
        >>> d = s.to_dict()
        >>> d["used_bytes"], d["live_allocs"]
        (1024, 2)
        """
        d = asdict(self)
        d["live_allocs"] = self.live_allocs
        return d
